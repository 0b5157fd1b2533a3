"""Test environment: CPU only, 8 simulated devices, fast compiles (tests/xla_env.py), no network, one JAX compilation
cache per test session."""

import os
import shutil
import tempfile

from tests.xla_env import xla_flags

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("XLA_FLAGS", xla_flags(8))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# JAX's persistent compilation cache, shared by the session's test processes (pytest-xdist workers inherit the
# controller's environment) and by every subprocess they start: the tests build the same tiny models again and again,
# and a program compiled once is read back instead of compiled again (a tiny training run: 21 CPU s cold, 5 CPU s
# warm). Every program is cached, however small or quick to compile. A fresh directory per session, removed at its
# end; JAX_COMPILATION_CACHE_DIR set by the caller is used as it is and kept.
_CACHE_MADE_HERE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _CACHE_MADE_HERE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="maxtext-tests-jax-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def _cache_cpu_programs_only() -> None:
  """Programs compiled for a TPU topology from this CPU host (the AOT tests) would be written to the cache, but cannot
  be read back here: JAX warns and compiles again. Read and write the cache for CPU programs only."""
  from jax._src import compiler  # JAX has no public hook for this; if its private names change, every program is cached

  read, write = getattr(compiler, "_cache_read", None), getattr(compiler, "_cache_write", None)
  if read is None or write is None:
    return

  def cache_read(module_name, cache_key, compile_options, backend, *rest, **kw):
    return read(module_name, cache_key, compile_options, backend, *rest, **kw) if backend.platform == "cpu" else (None, None)

  def cache_write(cache_key, compile_time_secs, module_name, backend, *rest, **kw):
    if backend.platform == "cpu":
      write(cache_key, compile_time_secs, module_name, backend, *rest, **kw)

  compiler._cache_read, compiler._cache_write = cache_read, cache_write


# The files that take longest (the full suite's --durations on 2 cores, Nov 2026), longest first. Under `-n 2 --dist
# loadfile` each file is one unit of work, handed to whichever worker runs short; pytest-xdist would hand out the files
# with the most tests first, which puts these (a few tests behind a long shared fixture) last, where one worker ends
# minutes after the other. Run longest first, the two workers end within about the length of the last small file.
LONGEST_FILES = (
  "test_docs_commands.py",
  "test_elastic.py",
  "test_run_ends.py",
  "test_splash_aot.py",
  "test_pipeline.py",
  "test_pipeline_hybrid.py",
  "test_multihost.py",
  "test_bad_inputs.py",
  "test_multi_tier.py",
  "test_gpu_suite.py",
  "test_qwen3_next.py",
  "test_post_training.py",
  "test_qwen3_5.py",
  "test_vlm_qwen3_vl.py",
  "test_hf_workflow.py",
  "test_moe_families.py",
  "test_moe_dispatch.py",
  "test_quantization.py",
  "test_harness.py",
  "test_bad_inputs_templates.py",
  "test_vision_training.py",
  "test_preemption.py",
  "test_vlm_gemma3.py",
  "test_deepseek_v32.py",
  "test_lora_multi.py",
  "test_bad_inputs_rewards.py",
  "test_bad_inputs_checkpoints.py",
)


def pytest_configure(config):
  _cache_cpu_programs_only()
  if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order pytest_collection_modifyitems gives
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
  """Files in LONGEST_FILES first, in its order; then the others, most tests first (pytest-xdist's own order). A file's
  tests keep their order and stay together."""
  counts: dict[str, int] = {}
  for item in items:
    counts[item.path.name] = counts.get(item.path.name, 0) + 1
  rank = {name: i for i, name in enumerate(LONGEST_FILES)}
  first_index = {}
  for i, item in enumerate(items):
    first_index.setdefault(item.path.name, i)
  items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -counts[item.path.name], first_index[item.path.name]))


def pytest_unconfigure(config):
  if _CACHE_MADE_HERE is not None:
    shutil.rmtree(_CACHE_MADE_HERE, ignore_errors=True)
