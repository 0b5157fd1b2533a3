"""MaxText 0.2.5's own model files (tests/data/maxtext_0.2.5, copied unchanged from the wheel): each text model file
of a family built here loads with MaxText's base.yml to the published parameter count; each file of a family or
feature not built here is refused in one line that names it (exit 2 from the command line); this project's
deepseek3-671b-2dfsdp and -batchsplit files shard as MaxText's do, with this project's mesh axes and logical axes."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import pytest

from maxtext import counting
from maxtext import mesh as mesh_lib
from maxtext.config import ConfigError, load
from maxtext.config.sections import DEFAULT_LOGICAL_AXIS_RULES
from tests.test_bad_inputs import _run_case, assert_one_line_exit_2
from tests.test_model_files import NOT_PUBLISHED, PUBLISHED_BILLIONS, TOLERANCE

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "maxtext_0.2.5"
MT_BASE = str(DATA / "configs" / "base.yml")
REFUSED_BASE = str(DATA / "refused" / "base.yml")  # MaxText's base.yml (base_config), beside the refused model files
LOADED = sorted(p.stem for p in (DATA / "configs" / "models").glob("*.yml"))
FAMILIES_BUILT = "the families built here: llama2, mistral, mixtral"

# Each refused MaxText file -> what its one line names.
REFUSED = {
  **{name: ("'decoder_block'", "'gpt3'", FAMILIES_BUILT) for name in ("gpt3-175b", "gpt3-22b", "gpt3-52k", "gpt3-6b")},
  **{name: ("'decoder_block'", "'envy'", FAMILIES_BUILT) for name in ("envy-switch-base", "envy-switch-large", "envy-switch-xxl", "envy-test")},
  "qwen3-custom-30b-a3b": ("'decoder_block'", "'qwen3_custom_moe'", FAMILIES_BUILT),
  "qwen3.5-35b-a3b-fp8": ("weight_dtype 'float8_e4m3fn'", "use model_name=qwen3.5-35b-a3b", "quantization=fp8"),
  "qwen3.5-397b-a17b-fp8": ("weight_dtype 'float8_e4m3fn'", "use model_name=qwen3.5-397b-a17b", "quantization=fp8"),
  "qwen3-omni-30b-a3b": ("use_audio: true", "builds no audio encoder"),
  "deepseek-custom": ("'engram_layers'", "does not implement"),
  "deepseek3-671b-2dfsdp": ("'override_logical_axis_rules'", "does not implement"),
  "deepseek3-671b-batchsplit": ("'use_batch_split_schedule'", "does not implement"),
}


def test_every_refused_file_is_listed():
  assert sorted(p.stem for p in (DATA / "refused" / "models").glob("*.yml")) == sorted(REFUSED)


# The config values that shape the parameters: where MaxText's file and this project's file of the same name agree on
# all of them, the count is this project's file's, which tests/test_model_files.py checks against the published size.
SHAPE_FIELDS = (
  *("decoder_block", "emb_dim", "num_query_heads", "num_kv_heads", "head_dim", "mlp_dim", "moe_mlp_dim", "num_decoder_layers", "vocab_size"),
  *("num_experts", "shared_experts", "first_num_dense_layers", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
  *("use_qk_norm", "attention_bias", "logits_via_embedding", "mtp_num_layers", "sliding_window_size"),
)


@pytest.mark.parametrize("name", LOADED)
def test_maxtext_file_loads_to_the_published_size(name):
  config = load([MT_BASE, f"model_name={name}"], env={}, num_devices=1)
  assert config.model_name == name
  ours = load([str(ROOT / "configs" / "base.yml"), f"model_name={name}"], env={}, num_devices=1)
  if config.decoder_block == "gemma2":  # MaxText counts gemma2 layers in (local, global) pairs: half the layers here (docs/config.md)
    assert config.num_decoder_layers * 2 == ours.num_decoder_layers
    return
  assert name in PUBLISHED_BILLIONS or name in NOT_PUBLISHED
  if name in PUBLISHED_BILLIONS and any(getattr(config, k) != getattr(ours, k) for k in SHAPE_FIELDS):
    count = counting.param_count(config) - counting.mtp_params(config)
    assert count == pytest.approx(PUBLISHED_BILLIONS[name] * 1e9, rel=TOLERANCE.get(name, 0.01))


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_maxtext_file_of_a_family_or_feature_not_built_is_refused_by_name(name):
  with pytest.raises(ConfigError) as raised:
    load([REFUSED_BASE, f"model_name={name}"], env={}, num_devices=1)
  message = str(raised.value)
  assert "\n" not in message and all(part in message for part in REFUSED[name]), message


def test_refused_maxtext_file_is_one_line_exit_2(tmp_path):
  """As the user runs it: `python -m maxtext.config <MaxText base.yml> model_name=gpt3-175b`."""
  run = tmp_path / "run"
  run.mkdir()
  proc, before, after = _run_case([sys.executable, "-m", "maxtext.config", REFUSED_BASE, "model_name=gpt3-175b"], run, run, "")
  assert_one_line_exit_2(proc, "invalid value for 'decoder_block' (models/gpt3-175b.yml): 'gpt3'; this project does not build that family")
  assert proc.stdout == "" and before == after


# A tiny DeepSeek (MLA, one dense and one MoE layer) in place of the 671B dimensions: the rules shard its parameters.
TINY_DEEPSEEK = dict(
  base_emb_dim=64,
  base_num_query_heads=4,
  base_num_kv_heads=4,
  base_mlp_dim=128,
  base_moe_mlp_dim=32,
  base_num_decoder_layers=2,
  first_num_dense_layers=1,
  vocab_size=256,
  q_lora_rank=32,
  kv_lora_rank=16,
  qk_nope_head_dim=8,
  qk_rope_head_dim=4,
  v_head_dim=8,
  head_dim=12,
  num_experts=8,
  n_routing_groups=2,
  topk_routing_group=1,
  mtp_num_layers=0,
  max_target_length=16,
  per_device_batch_size=1,
  dataset_type="synthetic",
)


def _param_specs(model: str, **parallelism: int) -> dict[str, tuple]:
  from maxtext.train import setup

  args = [f"{k}={v}" for k, v in {**TINY_DEEPSEEK, **parallelism}.items()]
  config = load([str(ROOT / "configs" / "base.yml"), f"model_name={model}", "override_model_config=true", *args], env={}, num_devices=8)
  shardings = setup.build(config, mesh_lib.create(config, jax.devices()[:8])).param_shardings()
  return {jax.tree_util.keystr(path, simple=True, separator="/"): tuple(s.spec) for path, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}


@pytest.mark.parametrize("model", ["deepseek3-671b-2dfsdp", "deepseek3-671b-batchsplit"])
def test_layout_files_name_every_logical_axis_of_this_project(model):
  """The file's rules replace the defaults (MaxText's override_logical_axis_rules): none is left at this project's
  default, none names a logical axis that nothing here reads, and every mesh axis they name is in mesh_axes."""
  config = load([str(ROOT / "configs" / "base.yml"), f"model_name={model}"], env={}, num_devices=1)
  rules = dict(config.logical_axis_rules)
  assert list(rules) == [name for name, _ in DEFAULT_LOGICAL_AXIS_RULES]
  assert {a for axes in rules.values() for a in axes} <= set(config.mesh_axes) and set(config.data_sharding) <= set(config.mesh_axes)


def test_2dfsdp_shards_weights_over_two_fsdp_axes_and_activations_by_batch():
  specs = _param_specs("deepseek3-671b-2dfsdp", ici_fsdp_parallelism=2, ici_tensor_parallelism=2, ici_expert_parallelism=2)
  assert specs["layers/attention/wq_b/kernel/value"] == (None, "fsdp", ("tensor", "expert"), None)  # embed-side over fsdp, heads over the second axis
  assert specs["layers/mlp/wi_0/value"] == (None, None, "fsdp", ("tensor", "expert"))  # experts not split: each expert 2D-sharded
  assert specs["embed/embedding/value"] == ("tensor", "fsdp")
  config = load([str(ROOT / "configs" / "base.yml"), "model_name=deepseek3-671b-2dfsdp"], env={}, num_devices=1)
  rules = dict(config.logical_axis_rules)
  assert rules["activation_batch"] == ["data", "fsdp", "tensor", "expert", "context"] and rules["activation_heads"] == rules["activation_mlp"] == []


def test_batchsplit_shards_experts_over_expert_and_weights_over_fsdp_only():
  specs = _param_specs("deepseek3-671b-batchsplit", ici_fsdp_parallelism=2, ici_data_parallelism=2, ici_expert_parallelism=2)
  assert specs["layers/mlp/wi_0/value"] == (None, "expert", "fsdp", None)
  assert specs["layers/attention/wq_b/kernel/value"] == (None, "fsdp", None, None)
  assert not {a for spec in specs.values() for axes in spec for a in ((axes,) if isinstance(axes, str) else axes or ())} - {"fsdp", "expert"}


def test_gemma_reads_the_releases_gelu_as_tanh_and_exports_only_what_gemma_for_causal_lm_builds():
  """google/gemma-2b's config.json says hidden_act "gelu", which transformers runs as the tanh approximation."""
  from maxtext.config import from_overrides
  from maxtext.convert import hf_config, hf_config_export

  release = dict(model_type="gemma", hidden_act="gelu", hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
  read = hf_config.overrides_from_hf({**release, "num_key_value_heads": 1, "head_dim": 8, "vocab_size": 97, "tie_word_embeddings": True})
  assert read["decoder_block"] == "gemma" and read["mlp_activations"] == ["gelu", "linear"] and read["base_num_kv_heads"] == 1
  capped = from_overrides(num_devices=1, decoder_block="gemma", logits_via_embedding=True, mlp_activations=["gelu", "linear"], final_logits_soft_cap=30.0)
  with pytest.raises(ConfigError, match="GemmaForCausalLM attends in full, without soft caps"):
    hf_config_export.hf_config_from(capped)
  exported = hf_config_export.hf_config_from(capped.model_copy(update={"final_logits_soft_cap": None}))
  assert (exported["model_type"], exported["architectures"], exported["hidden_act"]) == ("gemma", ["GemmaForCausalLM"], "gelu_pytorch_tanh")


def test_maxtext_deepseek4_files_build_v4s_layers():
  """MaxText's deepseek4-284b (unchanged): V4-Flash's 284B within 1.5%; its 43 layers two sliding, then CSA and HCA
  alternating from a CSA layer; hash routing in the first three; mHC over four streams. deepseek4-tiny: the same pattern."""
  from maxtext.models import registry

  for name in ("deepseek4-284b", "deepseek4-tiny"):
    config = load([MT_BASE, f"model_name={name}"], env={}, num_devices=1)
    kinds = registry.get(config.decoder_block).kinds(config)
    assert [k.variant for k in kinds[:4]] == ["sliding_attention", "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    assert [k.ffn for k in kinds[:4]] == ["moe_hash"] * 3 + ["moe_shared"] and config.mhc_expansion_rate == 4
  assert counting.param_count(load([MT_BASE, "model_name=deepseek4-284b"], env={}, num_devices=1)) == pytest.approx(284e9, rel=0.015)
