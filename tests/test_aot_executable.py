"""compiled_trainstep_file: a compiled step saved with its stamp, loaded back, and refused when it does not match."""

import jax
import pytest

from maxtext import mesh as mesh_lib
from maxtext.aot import executable
from maxtext.config import ConfigError, from_overrides

TINY = dict(
  base_emb_dim=32,
  base_mlp_dim=64,
  base_num_query_heads=2,
  base_num_kv_heads=2,
  head_dim=16,
  base_num_decoder_layers=1,
  vocab_size=128,
  per_device_batch_size=1,
  max_target_length=16,
  steps=3,
  enable_checkpointing=False,
  enable_tensorboard=False,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A config, its setup on the 8 CPU devices, the normally compiled step, and the file it was saved to."""
  from maxtext.train import setup as setup_lib

  config = from_overrides(**TINY)
  mesh = mesh_lib.create(config)
  with jax.set_mesh(mesh):
    setup = setup_lib.build(config, mesh)
    compiled = setup.jit_step.lower(setup.abstract_state, setup.abstract_batch).compile()
  path = str(tmp_path_factory.mktemp("aot") / "train_step.bin")
  executable.save(path, compiled, config, jax.devices())
  return config, mesh, setup, compiled, path


def test_settings_outside_the_step_do_not_matter(saved):
  config, _, _, _, path = saved
  other = from_overrides(**{**TINY, "steps": 3}, run_name="elsewhere", base_output_directory="/tmp/x", compiled_trainstep_file=path, log_period=7)
  executable.check(path, other, jax.devices())


@pytest.mark.parametrize(
  "change, devices, message",
  [
    ({"learning_rate": 1e-3}, 8, r"was compiled for a different config \(learning_rate: 3e-05 -> 0.001\)"),
    ({"remat_policy": "minimal"}, 8, r"different config \(remat_policy: 'full' -> 'minimal'\)"),
    ({}, 4, r"was compiled for device_kind=cpu, num_devices=8, num_slices=1 but this run has device_kind=cpu, num_devices=4"),
  ],
)
def test_mismatches_are_refused_with_one_line(saved, change, devices, message):
  config, _, _, _, path = saved
  other = from_overrides(**{**TINY, **change}, num_devices=devices)
  with pytest.raises(ConfigError, match=message) as e:
    executable.load(path, other, jax.devices()[:devices])
  assert "\n" not in str(e.value)


def test_missing_or_foreign_files_are_refused(saved, tmp_path):
  config = saved[0]
  with pytest.raises(ConfigError, match="cannot be read"):
    executable.load(str(tmp_path / "nope.bin"), config, jax.devices())
  foreign = tmp_path / "foreign.bin"
  foreign.write_bytes(b"\x80\x04 not ours")
  with pytest.raises(ConfigError, match="is not a maxtext compiled train step"):
    executable.load(str(foreign), config, jax.devices())


def test_every_run_only_key_is_a_config_key():
  from maxtext.config import MaxTextConfig

  assert executable._RUN_ONLY_KEYS <= set(MaxTextConfig.model_fields)


def test_train_runs_the_loaded_step(saved, tmp_path, capsys):
  """Saved, loaded and run by maxtext.train: every step's loss equals the normally compiled step's."""
  from maxtext.train.loop import train

  config, mesh, _, _, path = saved
  plain = train(from_overrides(**TINY, base_output_directory=str(tmp_path / "a")), mesh=mesh)
  loaded = train(from_overrides(**TINY, base_output_directory=str(tmp_path / "b"), compiled_trainstep_file=path), mesh=mesh)
  assert f"loaded the compiled train step from {path}" in capsys.readouterr().out
  assert loaded.losses == plain.losses and len(plain.losses) == TINY["steps"]
