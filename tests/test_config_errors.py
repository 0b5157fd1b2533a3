"""Malformed configs: one-line ConfigError from the API; `error: ...` on stderr and exit 2 from the CLI; nothing written."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from maxtext.config import ConfigError, load

ROOT = Path(__file__).resolve().parents[1]
BASE = str(ROOT / "configs" / "base.yml")

# Files a case may use, written into its temporary directory: name -> content.
FILES = {
  "bad_yaml.yml": "steps: [1, 2\nrun_name: x\n",
  "list.yml": "- steps\n- 5\n",
  "tab.yml": "steps:\t\n\t- 1\n",
  "typo.yml": f"base_config: {BASE}\nper_device_batch_sise: 2\n",
  "cycle_a.yml": "base_config: cycle_b.yml\nsteps: 1\n",
  "cycle_b.yml": "base_config: cycle_a.yml\n",
  "orphan.yml": "base_config: no_such_parent.yml\n",
  "bad_parent.yml": "base_config: 5\n",
  "lora_list.yml": f"base_config: {BASE}\nlora: [1, 2]\n",
  "nested_typo.yml": f"base_config: {BASE}\nlora:\n  lora_rnk: 2\n",
}

# (id, argv after the yml (first item may name a FILES entry or 'missing.yml'), env, expected message fragment)
CASES = [
  ("unknown_key", [BASE, "stepz=5"], {}, "unknown config key 'stepz' (did you mean 'steps'?) on the command line"),
  ("unknown_key_no_hint", [BASE, "zzzqqq=1"], {}, "unknown config key 'zzzqqq' on the command line"),
  ("typo_in_yaml", ["typo.yml"], {}, "unknown config key 'per_device_batch_sise' (did you mean 'per_device_batch_size'?) in typo.yml"),
  ("nested_typo_cli", [BASE, "lora.lora_rnk=2"], {}, "did you mean 'lora.lora_rank'?"),
  ("nested_typo_yaml", ["nested_typo.yml"], {}, "unknown config key 'lora.lora_rnk' (did you mean 'lora.lora_rank'?)"),
  ("unknown_env", [BASE], {"M_STEPZ": "5"}, "unknown config key 'stepz' (did you mean 'steps'?) from environment variable M_STEPZ"),
  ("wrong_type_int", [BASE, "steps=abc"], {}, "invalid value for 'steps' (command line): 'abc'; input should be a valid integer"),
  ("wrong_type_float", [BASE, "learning_rate=fast"], {}, "invalid value for 'learning_rate' (command line): 'fast'"),
  ("wrong_type_bool", [BASE, "enable_checkpointing=maybe"], {}, "invalid value for 'enable_checkpointing' (command line): 'maybe'"),
  ("wrong_type_list", [BASE, "mlp_activations=silu"], {}, "invalid value for 'mlp_activations'"),
  ("wrong_type_env", [BASE], {"M_STEPS": "many"}, "invalid value for 'steps' (env M_STEPS): 'many'"),
  ("negative_steps", [BASE, "steps=-1"], {}, "invalid value for 'steps' (command line): -1; input should be greater than 0"),
  ("zero_batch", [BASE, "per_device_batch_size=0"], {}, "invalid value for 'per_device_batch_size'"),
  (
    "fraction_above_one",
    [BASE, "warmup_steps_fraction=1.5"],
    {},
    "invalid value for 'warmup_steps_fraction' (command line): 1.5; input should be less than or equal to 1",
  ),
  ("lora_rank_zero", [BASE, "lora.lora_rank=0"], {}, "invalid value for 'lora.lora_rank' (command line): 0"),
  ("bad_literal_remat", [BASE, "remat_policy=fulll"], {}, "invalid value for 'remat_policy' (command line): 'fulll'; input should be 'full', 'minimal'"),
  ("bad_literal_dtype", [BASE, "dtype=float64"], {}, "invalid value for 'dtype' (command line): 'float64'"),
  ("bad_literal_block", [BASE, "decoder_block=gpt"], {}, "invalid value for 'decoder_block' (command line): 'gpt'"),
  ("bad_literal_activation", [BASE, "mlp_activations=[silu,swish]"], {}, "invalid value for 'mlp_activations' (command line): 'swish'"),
  ("bad_yaml", ["bad_yaml.yml"], {}, "is not valid YAML at line"),
  ("yaml_tab", ["tab.yml"], {}, "is not valid YAML"),
  ("yaml_not_mapping", ["list.yml"], {}, "must hold a mapping of key: value, not list"),
  ("missing_file", ["missing.yml"], {}, "config file 'missing.yml' not found"),
  ("base_config_cycle", ["cycle_a.yml"], {}, "includes itself through base_config; break the cycle"),
  ("base_config_missing_parent", ["orphan.yml"], {}, "no_such_parent.yml' not found"),
  ("base_config_not_a_name", ["bad_parent.yml"], {}, "base_config in"),
  ("base_config_on_cli", [BASE, "base_config=x.yml"], {}, "base_config (on the command line) can only be set inside a YAML file"),
  ("lora_not_mapping", ["lora_list.yml"], {}, "config key 'lora' (in lora_list.yml) must be a mapping"),
  ("no_equals", [BASE, "steps"], {}, "command-line argument 'steps' is not key=value"),
  ("empty_key", [BASE, "=5"], {}, "command-line argument '=5' is not key=value"),
  ("env_and_cli", [BASE, "steps=1"], {"M_STEPS": "2"}, "config key 'steps' is set both on the command line and by environment variable M_STEPS"),
  (
    "model_conflict",
    [BASE, "model_name=llama2-7b", "base_emb_dim=1024"],
    {},
    "'base_emb_dim=1024' conflicts with 'base_emb_dim: 4096' in models/llama2-7b.yml",
  ),
  (
    "unknown_model",
    [BASE, "model_name=llama9"],
    {},
    "unknown model_name 'llama9'; available: deepseek2-{16b,236b}, deepseek3-{671b,671b-2dfsdp,671b-batchsplit,test,tiny}, deepseek3.2-671b",
  ),
  ("model_name_path", [BASE, "model_name=../base"], {}, "invalid value for 'model_name': '../base'"),
  (
    "unsupported_maxtext_key",
    [BASE, "ici_tensor_transpose_parallelism=2"],
    {},
    "'ici_tensor_transpose_parallelism' (on the command line) is a MaxText option this project does not implement",
  ),
  (
    "unsupported_in_env",
    [BASE],
    {"M_USE_IOTA_EMBED": "true"},
    "'use_iota_embed' (from environment variable M_USE_IOTA_EMBED) is a MaxText option this project does not implement",
  ),
  ("derived_key", [BASE, "emb_dim=512"], {}, "config key 'emb_dim' (on the command line) is derived and cannot be set"),
  ("derived_key_batch", [BASE, "global_batch_size_to_train_on=8"], {}, "is derived and cannot be set"),
  ("scale_not_power_of_two", [BASE, "global_parameter_scale=3"], {}, "invalid value for 'global_parameter_scale': 3; it must be a power of two"),
  ("two_fills", [BASE, "ici_data_parallelism=-1"], {}, "only one ici parallelism may be -1, got ici_data_parallelism, ici_fsdp_parallelism"),
  ("fill_not_divisible", [BASE, "ici_tensor_parallelism=3"], {}, "cannot fill 8 devices: 3 does not divide 8"),
  (
    "product_mismatch",
    [BASE, "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"],
    {},
    "ici parallelism product 4 (1 x 1 x 2 x 1 x 1 x 2 x 1) != 8 devices per slice",
  ),
  ("parallelism_zero", [BASE, "ici_tensor_parallelism=0"], {}, "invalid value for 'ici_tensor_parallelism': 0"),
  ("dcn_mismatch", [BASE, "dcn_data_parallelism=2"], {}, "dcn parallelism product 2 (2 x 1 x 1 x 1 x 1 x 1 x 1) != 1 slices"),
  ("heads_not_multiple", [BASE, "base_num_query_heads=6", "base_num_kv_heads=4"], {}, "num_query_heads 6 is not a multiple of num_kv_heads 4"),
  ("experts_per_tok", [BASE, "num_experts=2", "num_experts_per_tok=4"], {}, "num_experts_per_tok 4 > num_experts 2"),
  ("routing_groups", [BASE, "num_experts=8", "n_routing_groups=3", "topk_routing_group=1"], {}, "group-limited routing needs n_routing_groups dividing"),
  ("bias_update_without_bias", [BASE, "num_experts=4", "routed_bias_update_rate=0.01"], {}, "routed_bias_update_rate > 0 updates the routing bias"),
  ("sinks_without_sink_params", [BASE, "attention_sink=true"], {}, "attention_sink=true, but decoder_block=llama2 has no sink parameters"),
  ("clamped_glu_outside_gpt_oss", [BASE, "mlp_activations_limit=7"], {}, "mlp_activations_limit clamps the experts' SwiGLU of deepseek4, gpt_oss"),
  ("linear_scaling_with_llama31", [BASE, "rope_type=llama3.1", "rope_linear_scaling_factor=8"], {}, "rope_linear_scaling_factor scales the default rope"),
  ("shared_experts_dense", [BASE, "shared_experts=1"], {}, "shared_experts need experts, but num_experts is 1"),
  ("capacity_zero", [BASE, "num_experts=4", "capacity_factor=0"], {}, "invalid value for 'capacity_factor': 0.0"),
  ("ragged_buffer_zero", [BASE, "num_experts=4", "ragged_buffer_factor=0"], {}, "invalid value for 'ragged_buffer_factor': 0.0"),
  ("two_load_paths", [BASE, "load_parameters_path=a", "load_full_state_path=b"], {}, "load_parameters_path and load_full_state_path are both set"),
  ("fractional_batch", [BASE, "per_device_batch_size=0.3"], {}, "per_device_batch_size 0.3 x 8 devices"),
  ("run_name_slash", [BASE, "run_name=a/b"], {}, "invalid value for 'run_name': 'a/b'"),
  ("bad_mesh_axes", [BASE, "mesh_axes=[data,pipeline]"], {}, "invalid mesh_axes ['data', 'pipeline']"),
  (
    "rules_unknown_axis",
    [BASE, "mesh_axes=[data,fsdp]", "data_sharding=[data]"],
    {},
    "logical_axis_rules maps 'activation_batch' to ['expert'], not in mesh_axes",
  ),
  ("schedule_steps_zero", [BASE, "learning_rate_schedule_steps=0"], {}, "invalid value for 'learning_rate_schedule_steps': 0"),
  (
    "wsd_fractions",
    [BASE, "lr_schedule_type=wsd", "warmup_steps_fraction=0.6", "wsd_decay_steps_fraction=0.6"],
    {},
    "warmup_steps_fraction + wsd_decay_steps_fraction > 1",
  ),
  ("stages_not_dividing_devices", [BASE, "ici_pipeline_parallelism=3"], {}, "'ici_pipeline_parallelism': 3, 'ici_fsdp_parallelism': -1"),
  (
    "layers_not_dividing_stages",
    [BASE, "ici_pipeline_parallelism=4", "num_layers_per_pipeline_stage=3"],
    {},
    "16 decoder layers do not split into 4 stages (ici_pipeline_parallelism x dcn_pipeline_parallelism) x num_layers_per_pipeline_stage 3 x whole "
    "repeats; change num_layers_per_pipeline_stage or the stage count, or pipeline only pipeline_parallel_layers=12 of them",
  ),
  (
    "microbatches_not_multiple_of_stages",
    [BASE, "ici_pipeline_parallelism=2", "num_pipeline_microbatches=3"],
    {},
    "num_pipeline_microbatches 3 is not a positive multiple of the 2 pipeline stages",
  ),
  (
    "microbatches_vs_batch",
    [BASE, "ici_pipeline_parallelism=2", "num_pipeline_microbatches=16", "per_device_batch_size=1"],
    {},
    "does not divide the global batch of 8",
  ),
  (
    "circular_delay_microbatches",
    [BASE, "ici_pipeline_parallelism=2", "pipeline_delay_activation_forwarding=true", "num_pipeline_microbatches=2"],
    {},
    "needs num_pipeline_microbatches >= 2 x 2",
  ),
  (
    "pipeline_parallel_layers_not_dividing_stages",
    [BASE, "ici_pipeline_parallelism=4", "pipeline_parallel_layers=6"],
    {},
    "pipeline_parallel_layers 6 do not split into 4 stages (ici_pipeline_parallelism x dcn_pipeline_parallelism)",
  ),
  (
    "pipeline_parallel_layers_too_many",
    [BASE, "ici_pipeline_parallelism=2", "pipeline_parallel_layers=18"],
    {},
    "pipeline_parallel_layers 18 is not -1 (all) or 1..16",
  ),
  ("pipeline_parallel_layers_without_stages", [BASE, "pipeline_parallel_layers=8"], {}, "pipeline_parallel_layers configure pipeline parallelism"),
  ("pipeline_keys_without_stages", [BASE, "num_pipeline_microbatches=4"], {}, "num_pipeline_microbatches configure pipeline parallelism"),
  ("pipeline_unscanned", [BASE, "ici_pipeline_parallelism=2", "scan_layers=false"], {}, "set scan_layers=true"),
  (
    "context_seq_not_divisible",
    [BASE, "ici_context_parallelism=4", "max_target_length=100"],
    {},
    "max_target_length 100 is not divisible by 2 x 4 context shards",
  ),
  ("context_strategy_unknown", [BASE, "context_parallel_strategy=rings"], {}, "invalid value for 'context_parallel_strategy' (command line): 'rings'"),
  ("no_config_file", [], {}, "no config file given"),
  ("key_value_first", ["steps=5"], {}, "the first argument must be a YAML config file, got 'steps=5'"),
]

CLI_CASES = [
  "unknown_key",
  "typo_in_yaml",
  "wrong_type_int",
  "bad_yaml",
  "missing_file",
  "base_config_cycle",
  "product_mismatch",
  "model_conflict",
  "layers_not_dividing_stages",
  "context_seq_not_divisible",
]


def _prepare(tmp_path: Path, argv: list[str]) -> tuple[list[str], Path]:
  for name, text in FILES.items():
    (tmp_path / name).write_text(text)
  out = tmp_path / "out"
  if not argv:
    return [], out
  return [argv[0], *argv[1:], f"base_output_directory={out}"], out


def _snapshot(tmp_path: Path) -> dict[str, bytes]:
  return {str(p.relative_to(tmp_path)): p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}


def test_there_are_at_least_30_cases():
  assert len({case[0] for case in CASES}) == len(CASES) >= 30
  assert set(CLI_CASES) <= {case[0] for case in CASES}


@pytest.mark.parametrize("case_id, argv, env, expected", CASES, ids=[c[0] for c in CASES])
def test_api_raises_one_line_config_error(tmp_path, monkeypatch, case_id, argv, env, expected):
  monkeypatch.chdir(tmp_path)
  args, out = _prepare(tmp_path, argv)
  before = _snapshot(tmp_path)
  with pytest.raises(ConfigError) as err:
    load(args, env=env, num_devices=8)
  message = str(err.value)
  assert expected in message
  assert "\n" not in message and "Traceback" not in message and len(message) < 800  # the model-file list is the longest
  assert not out.exists() and _snapshot(tmp_path) == before


@pytest.mark.parametrize("case_id", CLI_CASES)
def test_cli_prints_one_error_line_and_exits_2(tmp_path, case_id):
  _, argv, env, expected = next(c for c in CASES if c[0] == case_id)
  args, out = _prepare(tmp_path, argv)
  before = _snapshot(tmp_path)
  proc_env = {k: v for k, v in os.environ.items() if not k.startswith("M_")} | env
  proc_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), proc_env.get("PYTHONPATH", "")])
  proc = subprocess.run([sys.executable, "-m", "maxtext.config", *args], capture_output=True, text=True, cwd=tmp_path, env=proc_env, timeout=120)
  assert proc.returncode == 2
  assert proc.stdout == ""
  lines = proc.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], proc.stderr
  assert "Traceback" not in proc.stderr
  assert not out.exists() and _snapshot(tmp_path) == before
