"""Checkpoint and resume mistakes, each run as the user would (a subprocess): one `error:` line, exit 2, no traceback,
nothing written, renamed or lost (the in-process side: tests/test_resume_safety.py).

The cases share three inputs made once: a run with one checkpoint ({run}), the checkpoint of a LoRA run over it as
its frozen base ({lora}), and an int8 checkpoint as decode's save_quantized_params_path writes it, then damaged ({q8}).
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from maxtext import mesh as mesh_lib
from maxtext.train import checkpoint_files, checkpointing, initial_params
from maxtext.train import setup as setup_lib
from maxtext.train import state as state_lib
from tests import cli_server
from tests.test_bad_inputs import CASE_TIMEOUT_SECONDS, REPO, _env, _run_case, _snapshot, _train
from tests.test_decode_cli import word_tokenizer
from tests.test_train_helpers import TINY_MODEL, mesh_for, tiny_config


def _decode(*extra: str) -> list[str]:
  """The decode command on the tiny model (int8 kernels), key=value overrides appended."""
  keys = {**TINY_MODEL, "tokenizer_type": "huggingface", "tokenizer_path": "{tok}", "max_prefill_predict_length": 8, "prompt": "w1 w2"}
  keys.update({"quantization": "int8", "base_output_directory": "{tmp}/out", "run_name": "r"})
  keys.update(dict(e.split("=", 1) for e in extra))
  return [sys.executable, "-m", "maxtext.decode", str(REPO / "configs" / "base.yml"), *(f"{k}={v}" for k, v in keys.items())]


BASE = "{run}/r/checkpoints/1"
# (id, argv, what the one line must mention)
CASES = [
  ("resume_with_another_optimizer", _train("base_output_directory={run}", "opt_type=sgd"), "were written with opt_type=adamw; this config has opt_type=sgd"),
  (
    "lora_continuation_without_its_base",  # load_parameters_path cleared: the adapters would train over a random base
    _train("lora.enable_lora=true", "load_full_state_path={lora}/r/checkpoints/1/items"),
    f"trained over the frozen base load_parameters_path={BASE}",
  ),
  # the flipped bytes land in array data or in Orbax's array metadata (which file is largest varies): either line names it
  ("quantized_checkpoint_damaged", _decode("load_parameters_path={q8}", "checkpoint_is_quantized=true"), "'{q8}' is "),
  ("save_quantized_params_path_exists", _decode(f"load_parameters_path={BASE}", "save_quantized_params_path={tmp}/a_dir"), "already exists"),
]

# A full disk met by a save after the checks (simulated: TensorStore's own error for ENOSPC, taken from a full tmpfs,
# raised by the second save; mounting a small tmpfs needs root).
DISK_FULL_RUN = """
import runpy, sys
import orbax.checkpoint as ocp
real, calls = ocp.CheckpointManager.save, []
def save(self, step, *a, **k):
  calls.append(step)
  if len(calls) == 2:
    raise ValueError('RESOURCE_EXHAUSTED: Error writing "params/0" in OCDBT database at local file "%s/": Failed writing: '
                     '"%s/d/5c": Failed to write 720213 bytes to file 7: No space left on device [os_error_code=\\'28\\']' % (self.directory, self.directory))
  return real(self, step, *a, **k)
ocp.CheckpointManager.save = save
sys.argv = ["maxtext.train", *sys.argv[1:]]
runpy.run_module("maxtext.train", run_name="__main__", alter_sys=True)
"""


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess:
  return cli_server.run(argv, env=_env(), timeout=CASE_TIMEOUT_SECONDS, **kw)  # `python -m maxtext...`: forked warm


def _damage(item: Path) -> None:
  """Flip 16 bytes at the start of the largest array data file: its chunk no longer decodes."""
  data = max((f for f in item.rglob("*") if f.is_file() and f.parent.name == "d"), key=lambda f: f.stat().st_size)
  raw = bytearray(data.read_bytes())
  raw[:16] = bytes(b ^ 0xFF for b in raw[:16])
  data.write_bytes(bytes(raw))


def _lora_checkpoint(root: Path, base: str) -> None:
  """What a LoRA run of the tiny model over `base` saves after one step (its adapters and their optimizer state)."""
  config = tiny_config(num_devices=1, base_output_directory=str(root), run_name="r", lora={"enable_lora": True}, load_parameters_path=base)
  setup = setup_lib.build(config, mesh_for(config))
  with jax.set_mesh(setup.mesh):
    state = state_lib.checkpointed(dict(setup.init_state(), step=jnp.asarray(1, jnp.int32)), config)
    ckpt = checkpointing.Checkpointer(config)
    ckpt.save(1, state, {"step": 1})
    ckpt.close()


def _quantized_checkpoint(path: Path, base: str) -> None:
  """What decode's save_quantized_params_path writes for the tiny model over `base` (int8 kernels and their scales)."""
  from maxtext.convert.peft import _abstract_params
  from maxtext.inference.loading import serving_policy

  config = tiny_config(quantization="int8", load_parameters_path=base)  # all 8 test devices: decode builds its mesh from the config
  stored = _abstract_params(config, serving_policy(config, mesh_lib.create(config)))
  restored, _ = checkpoint_files.restore_some_params(base, initial_params.base_target(config, stored), "load_parameters_path")
  checkpoint_files.save_params(str(path), initial_params.quantize_restored(config, restored, stored))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  """The shared inputs, then every case (two at a time) once, each in its own scratch directory."""
  run, lora, shared = (tmp_path_factory.mktemp(name) for name in ("existing_run", "lora_run", "shared"))
  made = _run([a.replace("{tmp}/out", str(run)) for a in _train("steps=1")])
  assert made.returncode == 0, made.stderr[-2000:]
  base, q8 = BASE.replace("{run}", str(run)), shared / "q8"
  _lora_checkpoint(lora, base)
  _quantized_checkpoint(q8, base)
  _damage(q8)
  inputs = {"{run}": str(run), "{lora}": str(lora), "{q8}": str(q8), "{tok}": word_tokenizer(shared / "tokenizer.json", 90)}

  def filled(argv: list[str]) -> list[str]:
    for key, value in inputs.items():
      argv = [a.replace(key, value) for a in argv]
    return argv

  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    jobs = {}
    for case_id, argv, _ in CASES:
      tmp = tmp_path_factory.mktemp("case") / "work"
      tmp.mkdir()
      (tmp / "a_dir").mkdir()
      jobs[case_id] = pool.submit(_run_case, filled(argv), tmp, run, "")
    disk = tmp_path_factory.mktemp("disk_full")
    full = [a.replace("{tmp}", str(disk)) for a in _train("steps=3", "checkpoint_period=1")]
    jobs["disk_full"] = pool.submit(_run, [sys.executable, "-c", DISK_FULL_RUN, *full[3:]], cwd=disk)
    return {k: v.result() for k, v in jobs.items()}, inputs, disk


@pytest.mark.parametrize("case_id,argv,mention", CASES, ids=[c[0] for c in CASES])
def test_checkpoint_mistake_is_one_line_exit_2_nothing_written(results, case_id, argv, mention):
  outcomes, inputs, _ = results
  proc, before, after = outcomes[case_id]
  for key, value in inputs.items():
    mention = mention.replace(key, value)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
  assert mention in lines[0], lines[0]
  assert "Traceback" not in proc.stdout + proc.stderr and "<bound method" not in lines[0]
  assert after == before  # nothing appeared, changed or was renamed (the existing run's checkpoints included)


def test_a_full_disk_during_a_save_is_one_line_exit_2_and_keeps_the_previous_checkpoint(results):
  proc, disk = results[0]["disk_full"], results[2]
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert len(lines) == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
  ckpts = disk / "out" / "r" / "checkpoints"
  assert lines[0].startswith(f"error: writing a checkpoint or metrics failed: {ckpts}") and "is full; it needs" in lines[0], lines[0]
  assert "out of memory" not in lines[0]
  assert (ckpts / "1" / "items").is_dir() and (ckpts / "data_iterator" / "1" / "process_0.json").exists()  # the previous step, intact
  assert _snapshot(ckpts / "1")  # and not emptied
