"""The code's shape, read from its source with ast (no JAX, well under a second): no import circles in maxtext/,
layers that import nothing above them, model modules that keep no config, and a train loop of short functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "maxtext"
MAX_TRAIN_FUNCTION_LINES = 60
ABOVE_LAYERS = ("maxtext.config", "maxtext.models", "maxtext.inference", "maxtext.train", "maxtext.mesh")
# models/: the spec builders (specs.py and the *_specs.py beside it) and the build entry (maxtext/counting.py counts a run)
READS_CONFIG = {"specs.py", "common_specs.py", "mixer_specs.py", "feed_forward_specs.py", "pipeline_specs.py", "vision_specs.py", "__init__.py"}


def _module(path: Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = {_module(p): p for p in sorted(PACKAGE.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in SOURCES.items()}


def _imports(name: str) -> set[str]:
  """The maxtext modules name imports anywhere in its file (lazy and TYPE_CHECKING imports included): a submodule
  where `from package import x` names one, else the package."""
  package = name if SOURCES[name].name == "__init__.py" else name.rpartition(".")[0]
  out = set()
  for node in ast.walk(TREES[name]):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names if a.name in SOURCES)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
      for alias in node.names:
        target = f"{base}.{alias.name}"
        out.add(target if target in SOURCES else base)
  return {m for m in out if m in SOURCES and m != name}


GRAPH = {name: _imports(name) for name in SOURCES}


def _circles() -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan)."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  found: list[list[str]] = []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(GRAPH[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(GRAPH):
    if v not in index:
      visit(v)
  return found


def test_no_import_circles():
  assert _circles() == []


def test_the_circle_check_finds_a_circle(monkeypatch):
  monkeypatch.setitem(GRAPH, "maxtext.platform", GRAPH["maxtext.platform"] | {"maxtext.layers.quantization"})
  assert any("maxtext.platform" in c and "maxtext.layers.quantization" in c for c in _circles())


@pytest.mark.parametrize("name", [n for n in SOURCES if n.startswith("maxtext.layers.")])
def test_layers_import_nothing_above_them(name):
  above = sorted(m for m in GRAPH[name] if m.startswith(ABOVE_LAYERS))
  assert not above, f"{name} imports {above}"


@pytest.mark.parametrize("name", [n for n in SOURCES if n.startswith(("maxtext.layers.", "maxtext.models"))])
def test_no_module_keeps_the_config(name):
  source = SOURCES[name].read_text()
  assert "self.config" not in source
  if SOURCES[name].name not in READS_CONFIG:
    assert "maxtext.config" not in {m for m in GRAPH[name]} | {m.rpartition(".")[0] for m in GRAPH[name]}, f"{name} imports maxtext.config"


def _long_functions(tree: ast.AST) -> list[tuple[str, int]]:
  return [
    (n.name, n.end_lineno - n.lineno + 1)
    for n in ast.walk(tree)
    if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.end_lineno - n.lineno + 1 > MAX_TRAIN_FUNCTION_LINES
  ]


@pytest.mark.parametrize("name", [n for n in SOURCES if n.startswith("maxtext.train")])
def test_train_functions_are_short(name):
  assert _long_functions(TREES[name]) == []


def test_the_length_check_finds_a_long_function():
  body = "\n".join(f"  x{i} = {i}" for i in range(MAX_TRAIN_FUNCTION_LINES))
  assert _long_functions(ast.parse(f"def loop():\n{body}\n")) == [("loop", MAX_TRAIN_FUNCTION_LINES + 1)]
