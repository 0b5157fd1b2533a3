"""load_parameters_path=<Hugging Face directory>: its config.json sets the architecture keys (and, unless given, the
tokenizer) of the run's config, and its safetensors are converted while being read, each process reading only the
slices of each tensor that its devices hold."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from maxtext.convert.hf_architecture import TOKENIZER_FILES, is_hf_dir  # noqa: F401  (is_hf_dir: hf_dir.is_hf_dir for its callers)
from maxtext.errors import ConfigError
from maxtext.models import registry

# What a Hugging Face model directory holds besides its weights and config.json, copied into merged exports.
HF_EXTRAS = (
  *TOKENIZER_FILES,
  "special_tokens_map.json",
  "added_tokens.json",
  "vocab.json",
  "merges.txt",
  "chat_template.jinja",
  "chat_template.json",
  "generation_config.json",
)


def source_dir(config: Any) -> Path | None:
  """The Hugging Face directory a run's model came from: load_parameters_path itself, or the tokenizer directory
  that hf-to-maxtext's maxtext_model.yml records; None when neither is one."""
  for path in (config.load_parameters_path, config.tokenizer_path if config.tokenizer_type == "huggingface" else ""):
    if path and Path(path).is_dir() and any((Path(path) / f).is_file() for f in (*TOKENIZER_FILES, "generation_config.json")):
      return Path(path)
  return None


def copy_extras(source: Path | None, out: Path) -> list[str]:
  """Copy the tokenizer files and generation_config.json of source into out (an exported HF directory); their names."""
  import shutil

  if source is None:
    return []
  copied = []
  for name in HF_EXTRAS:
    if (source / name).is_file() and not (out / name).exists():
      shutil.copyfile(source / name, out / name)
      copied.append(name)
  return copied


# ---- reading: each tensor's slice an index of a maxtext parameter needs ----


class _Files:
  """The directory's tensors by name, read by slices through safetensors' lazy reader (no file is read whole)."""

  def __init__(self, hf_dir: str):
    from safetensors import safe_open

    self.handles: dict[str, Any] = {}
    self.where: dict[str, Any] = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
      try:
        handle = safe_open(str(f), framework="numpy")
      except Exception as e:  # safetensors' own error types vary by version
        raise ConfigError(f"'{f}' is not a readable safetensors file ({' '.join(str(e).split())[:160]}); re-download or re-export it") from None
      for name in handle.keys():
        if name in self.where:
          raise ConfigError(f"tensor '{name}' is stored in two files of '{hf_dir}'; remove the stray file (the directory mixes two checkpoints?)")
        self.where[name] = handle
      self.handles[str(f)] = handle

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.where[name].get_slice(name).get_shape())

  def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
    """tensor[name][index] as a numpy array (bfloat16 via ml_dtypes), checked finite and floating."""
    from maxtext.convert.hf_checkpoint_tensors import check_weight

    part = self.where[name].get_slice(name)
    try:
      value = np.asarray(part[index] if index else part[:])
    except (TypeError, ValueError):  # numpy lacks the dtype (bfloat16): read the slice through JAX, which keeps it exactly
      value = self._read_flax(name, index)
    check_weight(name, value)
    return value

  def _read_flax(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
    from safetensors import safe_open

    path = next(p for p, h in self.handles.items() if h is self.where[name])
    with safe_open(path, framework="flax") as f:
      part = f.get_slice(name)
      return np.asarray(part[index] if index else part[:])


def _ranges(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[range]:
  return [range(*s.indices(n)) for s, n in zip(tuple(index) + (slice(None),) * (len(shape) - len(index)), shape)]


def _flat_positions(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[np.ndarray, tuple[int, ...]]:
  """The row-major positions, in a flattened `shape`, of the elements `index` selects, and the selection's shape."""
  ranges = _ranges(index, shape)
  grid = np.ix_(*[np.asarray(r, dtype=np.int64) for r in ranges]) if ranges else ()
  flat = np.ravel_multi_index(grid, shape) if ranges else np.zeros((), np.int64)
  return np.asarray(flat).reshape(-1), tuple(len(r) for r in ranges)


def _span(positions: np.ndarray) -> slice:
  return slice(int(positions.min()), int(positions.max()) + 1) if positions.size else slice(0, 0)


def _reader(files: _Files, rule: Any, name: str, ours: tuple[int, ...]) -> Callable[[tuple[slice, ...]], np.ndarray] | None:
  """index of our per-layer array (shape `ours`) -> its values, reading only the slice of tensor `name` it covers;
  None for a layout only a whole-tensor conversion handles."""
  from maxtext.convert import hf_layouts

  fn = rule.to_ours
  if rule.part is not None:
    return None
  if fn is hf_layouts.identity:
    want = ours
    read = lambda idx: files.read(name, tuple(idx))  # noqa: E731
  elif fn is hf_layouts.transpose:
    want = ours[::-1]
    read = lambda idx: files.read(name, tuple(idx)[::-1]).T  # noqa: E731
  elif isinstance(fn, functools.partial) and fn.func is hf_layouts.bias_to_ours:
    (shape,) = fn.args
    want = (int(np.prod(shape)),)

    def read(idx):
      pos, sel = _flat_positions(idx, shape)
      span = _span(pos)
      return files.read(name, (span,))[pos - span.start].reshape(sel)
  elif isinstance(fn, functools.partial) and fn.func is hf_layouts.linear_to_ours:
    in_shape, out_shape = fn.args
    want = (int(np.prod(out_shape)), int(np.prod(in_shape)))

    def read(idx):
      idx = tuple(idx) + (slice(None),) * (len(ours) - len(idx))
      pin, sin = _flat_positions(idx[: len(in_shape)], in_shape)
      pout, sout = _flat_positions(idx[len(in_shape) :], out_shape)
      rows, cols = _span(pout), _span(pin)
      block = files.read(name, (rows, cols))[np.ix_(pout - rows.start, pin - cols.start)]
      return np.ascontiguousarray(block.T).reshape(*sin, *sout)
  else:
    return None
  have = files.shape(name)
  if have != want:
    raise ConfigError(
      f"tensor '{name}' has shape {have}, but config.json's sizes need {want}; config.json disagrees with the safetensors files: fix one of them"
    )
  return read


def _param_readers(files: _Files, config: Any, shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, Callable], set[str]] | None:
  """Per maxtext parameter path: index -> values; and the HF tensors they read. None when some parameter needs the
  whole-tensor conversion (gpt-oss's interleaved experts, MXFP4, multimodal or MTP checkpoints)."""
  from maxtext.convert import hf_checkpoint_tensors, hf_layer_rules, hf_layer_slots

  names = set(files.where)
  if config.mtp_num_layers or any(n.startswith(hf_checkpoint_tensors.TEXT_DECODER_PREFIXES) or n.endswith("_blocks") for n in names):
    return None
  used: set[str] = set()
  readers: dict[str, Callable] = {}

  def need(name: str) -> str:
    if name not in names:
      raise ConfigError(f"checkpoint is missing tensor '{name}' that the {config.decoder_block} model needs; is this the right model directory?")
    used.add(name)
    return name

  for r in hf_layer_rules.global_rules(config):
    if r.ours not in shapes:
      return None
    read = _reader(files, r, need(r.hf), shapes[r.ours])
    if read is None:
      return None
    readers[r.ours] = read
  kinds = registry.get(config.decoder_block).kinds(config)
  if len({k.structure for k in kinds[config.first_num_dense_layers :]}) > 1:
    return None  # a pattern of several layer structures (blocks, a remainder): read whole tensors
  for stack, first, count, _ in hf_layer_slots.stacks(config):
    for r in hf_layer_rules.layer_rules(config, kinds[first]):
      layers = []
      for i in range(count):
        path = f"{stack}/{r.ours}" if config.scan_layers else f"{stack}/{i}/{r.ours}"
        if path not in shapes:
          return None
        per_layer = shapes[path][1:] if config.scan_layers else shapes[path]
        prefix = f"model.layers.{first + i}."
        if r.experts:
          per_expert = [_reader(files, r, need(prefix + r.hf.format(j=j)), per_layer[1:]) for j in range(config.num_experts)]
          if any(p is None for p in per_expert):
            return None
          layers.append(lambda idx, ps=per_expert: np.stack([ps[j](tuple(idx)[1:]) for j in _ranges(tuple(idx)[:1], (len(ps),))[0]]))
        else:
          layers.append(_reader(files, r, need(prefix + r.hf), per_layer))
          if layers[-1] is None:
            return None
        if not config.scan_layers:
          readers[path] = layers[-1]
      if config.scan_layers:
        readers[f"{stack}/{r.ours}"] = lambda idx, ls=layers: np.stack([ls[i](tuple(idx)[1:]) for i in _ranges(tuple(idx)[:1], (len(ls),))[0]])
  if config.logits_via_embedding and "lm_head.weight" in names:
    used.add("lm_head.weight")
    embed = readers["embed/embedding"]

    def tied(idx, embed=embed):
      value = embed(idx)
      if not np.array_equal(files.read("lm_head.weight", tuple(idx)), value):
        raise ConfigError("config.json ties the embeddings (tie_word_embeddings) but lm_head.weight differs from model.embed_tokens.weight; fix config.json")
      return value

    readers["embed/embedding"] = tied
  return readers, used


def _streamed(hf_dir: str, config: Any, shapes: dict[str, tuple[int, ...]]) -> dict[str, Callable] | None:
  """Readers of every parameter in shapes, the directory's headers checked (every tensor present in its shape, none
  left over); None when the checkpoint needs the whole-tensor conversion. Reads no tensor."""
  from maxtext.convert import hf_checkpoint_tensors, hf_config, safetensors_io

  files = _Files(hf_dir)
  found = _param_readers(files, config, shapes)
  if found is None or set(found[0]) != set(shapes):
    return None
  readers, used = found
  stored_mtp = hf_config.stored_mtp_layers(safetensors_io.read_config(hf_dir), f"{hf_dir}/config.json")
  hf_checkpoint_tensors.check_all_used(sorted(set(files.where) - used), config, stored_mtp)
  return readers


def _shapes(target: Any) -> dict[str, tuple[int, ...]]:
  from flax import nnx

  from maxtext.convert.model_params import path_str

  return {path_str(k): tuple(v.get_value().shape) for k, v in nnx.to_flat_state(target)}


def check(hf_dir: str, config: Any, target: Any) -> None:
  """Preflight: the directory's tensors fit target's parameters (headers only; a whole-tensor checkpoint is checked as it loads)."""
  _streamed(hf_dir, config, _shapes(target))


def restore(hf_dir: str, config: Any, target: Any) -> Any:
  """target (an nnx.State of sharded ShapeDtypeStructs: the model's base parameters) filled from hf_dir's safetensors.
  Each array is built by jax.make_array_from_callback, so a process reads only its devices' slices; a checkpoint that
  only a whole-tensor conversion reads is converted whole, then sharded."""
  import jax
  from flax import nnx

  from maxtext.convert import hf_config, hf_params, safetensors_io
  from maxtext.convert.model_params import path_str

  shapes = _shapes(target)
  readers = _streamed(hf_dir, config, shapes)
  if readers is None:
    stored_mtp = hf_config.stored_mtp_layers(safetensors_io.read_config(hf_dir), f"{hf_dir}/config.json")
    flat = hf_params.hf_to_maxtext(safetensors_io.read_tensors(hf_dir), config, stored_mtp)
    for k, a in flat.items():
      if k in shapes and tuple(a.shape) != shapes[k]:
        raise ConfigError(f"parameter '{k}' converts to shape {tuple(a.shape)} but the config's model needs {shapes[k]}; check config.json")
    readers = {k: (lambda idx, a=a: a[tuple(idx)]) for k, a in flat.items()}
  missing = sorted(set(shapes) - set(readers))
  if missing:
    raise ConfigError(f"the Hugging Face checkpoint has no tensor for {missing[0]} (and {len(missing) - 1} more); check the model type and config")
  out = []
  for keys, var in nnx.to_flat_state(target):
    abstract = var.get_value()
    read = readers[path_str(keys)]
    sharding = getattr(abstract, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    array = jax.make_array_from_callback(abstract.shape, sharding, lambda idx, r=read, d=abstract.dtype: np.asarray(r(idx)).astype(d))
    out.append((keys, var.replace(array)))
  return nnx.from_flat_state(out)
