"""Loader order (yml chain < model file < command line < env), derived values and the explain CLI."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from maxtext.config import ConfigError, from_overrides, load, load_with_sources

ROOT = Path(__file__).resolve().parents[1]
BASE = str(ROOT / "configs" / "base.yml")


def write(path: Path, text: str) -> str:
  path.write_text(text)
  return str(path)


@pytest.fixture
def chain(tmp_path):
  """child.yml -> parent.yml -> base.yml, with models/ beside them."""
  write(tmp_path / "parent.yml", f"base_config: {BASE}\nsteps: 7\nlearning_rate: 1e-3\nrun_name: parent\n")
  child = write(tmp_path / "child.yml", "base_config: parent.yml\nsteps: 9\nlora:\n  lora_rank: 4\n")
  (tmp_path / "models").mkdir()
  write(tmp_path / "models" / "toy.yml", "base_emb_dim: 64\nbase_num_decoder_layers: 3\nsteps: 11\n")
  return child


def test_base_config_chaining(chain):
  config, sources = load_with_sources([chain], env={}, num_devices=1)
  assert config.steps == 9 and sources["steps"] == "child.yml"
  assert config.learning_rate == 1e-3 and sources["learning_rate"] == "parent.yml"  # 1e-3 without a dot is a float
  assert config.run_name == "parent" and config.lora.lora_rank == 4 and sources["lora.lora_rank"] == "child.yml"
  assert config.lora.enable_lora is False and sources["lora.enable_lora"] == "base.yml"


def test_precedence_yml_model_cli_env(chain):
  config, sources = load_with_sources([chain, "model_name=toy"], env={}, num_devices=1)
  assert config.steps == 11 and sources["steps"] == "models/toy.yml"  # model file beats the yml chain
  assert config.emb_dim == 64 and config.num_decoder_layers == 3
  config, sources = load_with_sources([chain, "model_name=toy", "override_model_config=true", "steps=12"], env={}, num_devices=1)
  assert config.steps == 12 and sources["steps"] == "command line"
  config, sources = load_with_sources([chain, "model_name=toy", "override_model_config=true"], env={"M_STEPS": "13"}, num_devices=1)
  assert config.steps == 13 and sources["steps"] == "env M_STEPS"
  same = load([chain, "model_name=toy", "steps=11"], env={}, num_devices=1)  # same value as the model file: no conflict
  assert same.steps == 11


def test_model_file_conflict_needs_override(chain):
  with pytest.raises(ConfigError, match=r"'base_emb_dim=32' conflicts with 'base_emb_dim: 64' in models/toy.yml; pass override_model_config=true"):
    load([chain, "model_name=toy", "base_emb_dim=32"], env={}, num_devices=1)
  with pytest.raises(ConfigError, match="override_model_config=true"):
    load([chain, "model_name=toy"], env={"M_BASE_EMB_DIM": "32"}, num_devices=1)
  config = load([chain, "model_name=toy", "base_emb_dim=32", "override_model_config=true"], env={}, num_devices=1)
  assert config.emb_dim == 32


def test_env_overrides_and_typing():
  config, sources = load_with_sources([BASE], env={"M_STEPS": "5", "M_LORA__ENABLE_LORA": "true", "HOME": "/x", "MSTEPS": "1"}, num_devices=1)
  assert config.steps == 5 and sources["steps"] == "env M_STEPS"
  assert config.lora.enable_lora is True and sources["lora.enable_lora"] == "env M_LORA__ENABLE_LORA"
  with pytest.raises(ConfigError, match="both on the command line and by environment variable M_STEPS"):
    load([BASE, "steps=6"], env={"M_STEPS": "5"}, num_devices=1)


def test_env_defaults_to_os_environ(monkeypatch):
  monkeypatch.setenv("M_STEPS", "5")
  assert load([BASE], num_devices=1).steps == 5
  assert from_overrides(num_devices=1).steps != 5  # from_overrides ignores the environment


def test_cli_yaml_typing():
  config = load(
    [BASE, "steps=10", "mlp_activations=[gelu]", "max_num_checkpoints_to_keep=none", "run_name=2024", "learning_rate=3e-4", "enable_checkpointing=false"],
    env={},
    num_devices=1,
  )
  assert config.steps == 10 and config.mlp_activations == ["gelu"] and config.max_num_checkpoints_to_keep is None
  assert config.run_name == "2024" and config.learning_rate == 3e-4 and config.enable_checkpointing is False
  assert load([BASE, "remat_policy=none"], env={"M_PROFILER": ""}, num_devices=1).remat_policy == "none"  # a Literal choice, not None


def test_nested_lora_keys_from_cli_yaml_and_python(tmp_path):
  config = load([BASE, "lora.enable_lora=true", "lora.lora_rank=8"], env={}, num_devices=1)
  assert config.lora.enable_lora and config.lora.lora_rank == 8 and config.lora.lora_alpha == 32.0
  yml = write(tmp_path / "l.yml", f"base_config: {BASE}\nlora: {{enable_lora: true, lora_alpha: 4}}\n")
  config = load([yml, "lora.lora_rank=2"], env={}, num_devices=1)
  assert (config.lora.enable_lora, config.lora.lora_rank, config.lora.lora_alpha) == (True, 2, 4.0)
  config = from_overrides(num_devices=1, lora={"enable_lora": True, "lora_rank": 3})
  assert config.lora.enable_lora and config.lora.lora_rank == 3


@pytest.mark.parametrize(
  "scale, layers, heads, emb",
  [(1, 1, 1, 1), (2, 1, 2, 1), (4, 1, 2, 2), (8, 2, 2, 2), (16, 2, 4, 2), (32, 2, 4, 4), (64, 4, 4, 4)],
)
def test_global_parameter_scale_split(scale, layers, heads, emb):
  c = from_overrides(num_devices=1, global_parameter_scale=scale)
  assert c.num_decoder_layers == 16 * layers
  assert (c.num_query_heads, c.num_kv_heads, c.mlp_dim) == (16 * heads, 16 * heads, 7168 * heads)
  assert c.emb_dim == 2048 * emb


def test_parallelism_fill():
  c = from_overrides(num_devices=8, ici_tensor_parallelism=2)
  assert c.mesh_axes == ["data", "stage", "fsdp", "sequence", "context", "tensor", "expert"]
  assert c.ici_parallelism == [1, 1, 4, 1, 1, 2, 1] and c.dcn_parallelism == [1, 1, 1, 1, 1, 1, 1]
  c = from_overrides(num_devices=8, ici_fsdp_parallelism=1, ici_data_parallelism=-1)
  assert c.ici_parallelism == [8, 1, 1, 1, 1, 1, 1]
  c = load([BASE, "ici_fsdp_parallelism=2", "ici_sequence_parallelism=2"], env={}, num_devices=4)
  assert c.ici_parallelism == [1, 1, 2, 2, 1, 1, 1]
  c = load([BASE], env={}, num_devices=8, num_slices=2)
  assert c.ici_parallelism == [1, 1, 4, 1, 1, 1, 1] and c.dcn_parallelism == [2, 1, 1, 1, 1, 1, 1] and c.num_slices == 2
  c = load([BASE, "dcn_data_parallelism=1", "dcn_pipeline_parallelism=-1", "ici_context_parallelism=2"], env={}, num_devices=8, num_slices=2)
  assert c.ici_parallelism == [1, 1, 2, 1, 2, 1, 1] and c.dcn_parallelism == [1, 2, 1, 1, 1, 1, 1]
  c = load([BASE, "mesh_axes=[fsdp,data]", "logical_axis_rules=[[embed,[fsdp]]]", "data_sharding=[data]"], env={}, num_devices=8)
  assert c.ici_parallelism == [8, 1]


def test_batch_sizes():
  c = from_overrides(num_devices=8, per_device_batch_size=2, gradient_accumulation_steps=4)
  assert (c.micro_batch_size_to_train_on, c.global_batch_size_to_train_on) == (16, 64)
  c = from_overrides(num_devices=8, per_device_batch_size=0.25)
  assert (c.micro_batch_size_to_train_on, c.global_batch_size_to_train_on) == (2, 2)


def test_run_name_output_dirs_and_schedule(tmp_path):
  c, sources = load_with_sources([BASE, "model_name=llama2-7b", f"base_output_directory={tmp_path}"], env={}, num_devices=1)
  assert re.fullmatch(r"llama2-7b_\d{4}-\d{2}-\d{2}-\d{2}-\d{2}", c.run_name) and sources["run_name"] == "derived"
  assert c.learning_rate_schedule_steps == c.steps == 150_001 and sources["learning_rate_schedule_steps"] == "derived"
  c, sources = load_with_sources(
    [BASE, "run_name=r1", f"base_output_directory={tmp_path}", "steps=10", "learning_rate_schedule_steps=20"], env={}, num_devices=1
  )
  assert sources["run_name"] == "command line" and sources["learning_rate_schedule_steps"] == "command line"
  assert c.checkpoint_dir == os.path.join(str(tmp_path), "r1", "checkpoints", "")
  assert c.tensorboard_dir == os.path.join(str(tmp_path), "r1", "tensorboard", "")
  assert c.learning_rate_schedule_steps == 20
  assert not any(tmp_path.iterdir())  # loading writes nothing


def test_devices_from_jax_and_compile_topology():
  c = load([BASE], env={})
  assert c.num_devices == 8 and c.ici_parallelism == [1, 1, 8, 1, 1, 1, 1]  # conftest: 8 simulated CPU devices
  c = load([BASE, "compile_topology=v5e-16", "compile_topology_num_slices=2"], env={})
  assert (c.num_devices, c.num_slices, c.ici_parallelism[2], c.dcn_parallelism[0]) == (32, 2, 16, 2)


def test_explain_cli_json_and_text(tmp_path):
  env = {**os.environ, "M_LOG_PERIOD": "7"}
  cmd = [sys.executable, "-m", "maxtext.config", BASE, "model_name=qwen3-0.6b", "steps=5", "run_name=x", f"base_output_directory={tmp_path}"]
  out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
  assert out.returncode == 0, out.stderr
  table = json.loads(out.stdout)
  assert table["steps"] == {"value": 5, "source": "command line"}
  assert table["base_emb_dim"] == {"value": 1024, "source": "models/qwen3-0.6b.yml"}
  assert table["log_period"] == {"value": 7, "source": "env M_LOG_PERIOD"}
  assert table["adam_b1"] == {"value": 0.9, "source": "base.yml"}
  assert table["emb_dim"] == {"value": 1024, "source": "derived"}
  assert table["lora.lora_rank"]["source"] == "base.yml"
  assert table["ici_parallelism"]["value"] == [1, 1, 8, 1, 1, 1, 1]
  assert table["checkpoint_dir"]["value"] == os.path.join(str(tmp_path), "x", "checkpoints", "")
  assert not any(tmp_path.iterdir())
  text = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
  assert text.returncode == 0, text.stderr
  lines = text.stdout.splitlines()
  assert len(lines) == len(table)
  assert any(re.fullmatch(r"steps\s+= 5\s+# command line", line) for line in lines)
