"""Resume safety in process: a committed step keeps its data position until a newer step is committed (a kill -9
between an async save and its commit), array checksums catch altered bytes, another optimizer stops with one line
and moves nothing, a LoRA continuation keeps its frozen base, a full disk in TensorStore's words is a full disk.
(The CLI side, one line and exit 2 per case: tests/test_bad_inputs_checkpoints.py.)"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext import memory_limit
from maxtext.errors import ConfigError
from maxtext.layers.lora import LoRAParam
from maxtext.train import checkpoint_files, checkpointing, checksums, initial_params, outputs, preflight, run_report
from maxtext.train import loop as loop_lib
from maxtext.train import setup as setup_lib
from maxtext.train import state as state_lib
from maxtext.train.loop import train
from maxtext.train.trainable import split_params
from tests.test_train_helpers import mesh_for, tiny_config

# Restoring altered arrays makes Orbax abandon sibling reads (maxtext.errors.ABANDONED_READ_NOISE), as in test_reliability.
pytestmark = [
  pytest.mark.filterwarnings(r"ignore:Exception ignored in. <coroutine object _read_array_index_and_device_put:pytest.PytestUnraisableExceptionWarning"),
  pytest.mark.filterwarnings(r"ignore:Exception ignored in. None[\s\S]*Event loop is closed:pytest.PytestUnraisableExceptionWarning"),
]

LORA = {"enable_lora": True, "lora_rank": 2, "lora_alpha": 4.0}
# TensorStore's words for a full disk during a save (taken from a real 400 KiB tmpfs), under a RESOURCE_EXHAUSTED status
DISK_FULL = (
  'RESOURCE_EXHAUSTED: Error writing "params/layers/mlp/wo/kernel/0" in OCDBT database at local file "/ckpt/5.orbax-checkpoint-tmp/items/": '
  "Failed writing: \"/ckpt/5.orbax-checkpoint-tmp/items/d/5cfa\": Failed to write 720213 bytes to file 7: No space left on device [os_error_code='28']"
)


def _cfg(tmp, run="r", **kw):
  base = {"base_output_directory": str(tmp), "run_name": run, "steps": 4, "learning_rate_schedule_steps": 4, "checkpoint_period": 2}
  return tiny_config(num_devices=1, **{**base, **kw})


@pytest.fixture(scope="module")
def shared_setup(tmp_path_factory):
  config = _cfg(tmp_path_factory.mktemp("setup"))
  return setup_lib.build(config, mesh_for(config))


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, shared_setup):
  """A finished AdamW run with checkpoints 2 and 4, copied fresh by each test that changes it."""
  tmp = tmp_path_factory.mktemp("good")
  train(_cfg(tmp), setup=shared_setup)
  return tmp


def _copy(src, dst):
  shutil.copytree(src, dst, dirs_exist_ok=True)
  return dst / "r" / "checkpoints"


def _restore(config, setup, said, data_iter=None):
  ckpt = checkpointing.Checkpointer(config)
  try:
    return ckpt.restore_latest(state_lib.checkpointed(setup.abstract_state, config), said.append, data_iter)
  finally:
    ckpt.close()


def test_a_committed_step_keeps_its_data_state_until_a_newer_step_is_committed(shared_setup, tmp_path, monkeypatch):
  """max_num_checkpoints_to_keep=1, async: Orbax drops step 1 from its step list when the save of step 2 starts, but
  deletes it only after step 2 is committed. A kill -9 in between must leave step 1 usable, data position included."""
  config = _cfg(tmp_path, async_checkpointing=True, max_num_checkpoints_to_keep=1)
  ckpts = tmp_path / "r" / "checkpoints"
  with jax.set_mesh(shared_setup.mesh):
    state = state_lib.checkpointed(shared_setup.init_state(), config)
  ckpt = checkpointing.Checkpointer(config)
  gate = threading.Event()
  try:
    ckpt.save(1, dict(state, step=jnp.asarray(1, jnp.int32)), {"step": 1})
    ckpt.wait()
    deleter = ckpt.manager._checkpoint_deleter  # hold back the deletion of step 1: the moment before step 2's commit lasts
    real_delete = deleter.delete_steps
    monkeypatch.setattr(deleter, "delete_steps", lambda steps: (gate.wait(120), real_delete(steps)))
    ckpt.save(2, dict(state, step=jnp.asarray(2, jnp.int32)), {"step": 2})
    # What a kill -9 now leaves: step 1 committed, step 2 not (its directory, finished or not, is left out).
    top = str(ckpts)
    shutil.copytree(ckpts, tmp_path / "killed" / "r" / "checkpoints", ignore=lambda d, names: [n for n in names if d == top and n.startswith("2")])
  finally:
    gate.set()
    ckpt.close()
  assert sorted(os.listdir(ckpts)) == ["2", "data_iterator"]  # once step 2 was committed, step 1 went, and its data state with it
  assert not (ckpts / "data_iterator" / "1" / "process_0.json").exists() and (ckpts / "data_iterator" / "2" / "process_0.json").exists()

  killed = _cfg(tmp_path / "killed")
  data_iter = loop_lib.create_data_iterator(killed, shared_setup.mesh, "train")
  said = []
  restored = _restore(killed, shared_setup, said, data_iter)
  assert said == [] and restored is not None and int(restored.state["step"]) == 1  # the last committed step, not step 0
  assert data_iter.get_state() == {"step": 1}


def test_altered_array_bytes_in_the_newest_checkpoint_fall_back_to_the_previous_step(two_checkpoints, shared_setup, tmp_path, capsys):
  """16 flipped bytes inside array data that still decodes: the checksums recorded at save time catch them."""
  ckpts = _copy(two_checkpoints, tmp_path)
  bad = ckpts / "4"
  data = max((f for f in (bad / "items").rglob("*") if f.is_file() and f.parent.name == "d"), key=lambda f: f.stat().st_size)
  raw = bytearray(data.read_bytes())
  middle = len(raw) // 2
  raw[middle : middle + 16] = bytes(b ^ 0xFF for b in raw[middle : middle + 16])
  data.write_bytes(bytes(raw))
  result = train(_cfg(tmp_path, steps=5), setup=shared_setup)
  out = capsys.readouterr().out
  assert sorted(result.losses) == [2, 3, 4] and np.isfinite(list(result.losses.values())).all()  # trained on from step 2
  said = [line for line in out.splitlines() if "is unusable" in line]
  assert len(said) == 1 and f"checkpoint {bad} is unusable (its arrays differ from the checksums recorded when it was saved: " in said[0]
  assert "restored checkpoint at step 2" in out
  assert len(list(ckpts.glob("4.unusable-*"))) == 1  # set aside, never deleted (a new step 4 was saved since)


def test_checksums_depend_on_values_only():
  a = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
  same = checksums.of_state({"x": a, "y": jnp.ones((2,), jnp.bfloat16), "z": jnp.asarray(3, jnp.int32)})
  assert same == checksums.of_state({"x": a.copy(), "y": jnp.ones((2,), jnp.bfloat16), "z": jnp.asarray(3, jnp.int32)})
  assert checksums.mismatches(same, {"x": a.at[2, 3].set(11.000001)}) == ["x"]  # one element, lowest bit
  assert checksums.mismatches(same, {"x": a.T.T, "y": jnp.ones((2,), jnp.float32)}) == []  # another dtype is not compared
  assert checksums.of_state({"x": a.reshape(4, 3)})["x"] == same["x"]  # row-major position, not the shape


def test_another_optimizer_stops_with_one_line_and_moves_nothing(two_checkpoints, shared_setup, tmp_path):
  ckpts = _copy(two_checkpoints, tmp_path)
  before = sorted(os.listdir(ckpts))
  sgd = _cfg(tmp_path, opt_type="sgd")
  setup = setup_lib.build(sgd, mesh_for(sgd))  # abstract: nothing compiles
  for check in (
    lambda: preflight.check_restore_paths(sgd, setup, state_lib.checkpointed(setup.abstract_state, sgd)),
    lambda: _restore(sgd, setup, []),
  ):
    with pytest.raises(ConfigError) as e:
      check()
    message = str(e.value)
    assert "\n" not in message and "were written with opt_type=adamw; this config has opt_type=sgd" in message and "nothing was moved" in message
    assert f"run_name=<new name> load_parameters_path={ckpts / '4' / 'items'}" in message
  assert sorted(os.listdir(ckpts)) == before  # no checkpoint set aside
  said = []
  assert int(_restore(_cfg(tmp_path), shared_setup, said).state["step"]) == 4 and said == []  # the original config still resumes
  fresh = _cfg(tmp_path, run="sgd", opt_type="sgd", load_parameters_path=str(ckpts / "4" / "items"))
  preflight.check_restore_paths(fresh, setup, state_lib.checkpointed(setup.abstract_state, fresh))  # the way on it names is accepted


def test_a_lora_continuation_keeps_its_frozen_base(tmp_path):
  """The summary's continuation (load_full_state_path) works with the base load_parameters_path the config sets; without
  it, the adapters' checkpoint names the base it trained over instead of training over a random init."""
  base_dir, ckpt_dir = tmp_path / "base", tmp_path / "lora" / "checkpoints"
  config = _cfg(tmp_path, run="lora", lora=LORA, load_parameters_path=str(base_dir))
  setup = setup_lib.build(config, mesh_for(config))
  with jax.set_mesh(setup.mesh):
    state = setup.init_state()
    _, frozen = split_params(state["params"], config)
    base = jax.tree.map(lambda x: 1.5 * x + 0.01, frozen)  # a trained model's parameters, unlike the seeded init
    checkpoint_files.save_params(str(base_dir), base)
    saved = state_lib.checkpointed(dict(state, step=jnp.asarray(2, jnp.int32)), config)
    ckpt = checkpointing.Checkpointer(config)
    ckpt.save(2, saved, {"step": 2})
    ckpt.close()

  go_on = _cfg(tmp_path, run="next", lora=LORA, load_parameters_path=str(base_dir), load_full_state_path=str(ckpt_dir / "2" / "items"))
  assert run_report.continuation(config, str(ckpt_dir / "2")) == f"run_name=<new name> load_full_state_path={ckpt_dir / '2' / 'items'}"
  said = []
  with jax.set_mesh(setup.mesh):
    preflight.check_restore_paths(go_on, setup, state_lib.checkpointed(setup.abstract_state, go_on))
    restored = loop_lib.restore_or_init(dataclasses.replace(setup, config=go_on), None, None, said.append)
  flat, want = dict(nnx.to_flat_state(restored["params"])), dict(nnx.to_flat_state(base))
  assert int(restored["step"]) == 2 and all(np.array_equal(flat[k][...], want[k][...]) for k in want)  # the base, not the init
  adapters = dict(nnx.to_flat_state(nnx.filter_state(saved["params"], LoRAParam)))
  assert adapters and all(np.array_equal(flat[k][...], adapters[k][...]) for k in adapters)
  assert not any(line.startswith("warning:") for line in said)

  no_base = _cfg(tmp_path, run="lora", lora=LORA)
  with pytest.raises(ConfigError, match=rf"holds LoRA adapters trained over the frozen base load_parameters_path={base_dir}, but this config sets no"):
    preflight.check_restore_paths(no_base, setup, state_lib.checkpointed(setup.abstract_state, no_base))
  said = []
  initial_params.load_initial_params(no_base, None, setup.abstract_state["params"], said.append, adapters=False)
  assert len(said) == 1 and said[0].startswith("warning: lora.enable_lora=true without load_parameters_path: the frozen base is a random init")


def test_continuation_clears_a_base_only_outside_lora(tmp_path):
  plain = _cfg(tmp_path, load_parameters_path=str(tmp_path / "base"))
  assert run_report.continuation(plain, "C") == "run_name=<new name> load_full_state_path=C/items load_parameters_path="
  assert run_report.continuation(_cfg(tmp_path), "C") == "run_name=<new name> load_full_state_path=C/items"


def test_a_full_disk_in_tensorstore_words_is_a_full_disk_not_out_of_memory(shared_setup, tmp_path, monkeypatch):
  assert not memory_limit.is_out_of_memory(ValueError(DISK_FULL)) and memory_limit.is_out_of_memory(ValueError("RESOURCE_EXHAUSTED: Out of memory"))
  real_save = checkpointing.Checkpointer.save

  def save(self, step, state, data_state):
    if step == 4:
      raise ValueError(DISK_FULL)
    return real_save(self, step, state, data_state)

  monkeypatch.setattr(checkpointing.Checkpointer, "save", save)
  with pytest.raises(outputs.OutputError, match=r"writing a checkpoint or metrics failed: .* is full; it needs .* free\. Earlier checkpoints are intact"):
    train(_cfg(tmp_path), setup=shared_setup)
  assert os.path.isdir(tmp_path / "r" / "checkpoints" / "2" / "items")
