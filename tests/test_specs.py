"""The model's specs: the config is read once (maxtext.models.specs), layers take small hashable specs, import no
config, model or inference code and name no family; dtype names become types once, in the platform policy."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import jax.numpy as jnp
import pytest
from flax import nnx

from maxtext import models, platform
from maxtext.config import MaxTextConfig, from_overrides
from maxtext.models import feed_forward_specs, registry, specs

LAYERS = Path(__file__).parent.parent / "maxtext" / "layers"
TINY = dict(num_devices=1, base_emb_dim=16, base_num_query_heads=2, base_num_kv_heads=2, head_dim=8, base_mlp_dim=24, vocab_size=32)
TINY.update(base_num_decoder_layers=2, max_target_length=8)
MOE = dict(num_experts=4, num_experts_per_tok=2, base_moe_mlp_dim=8)


def _imports(path: Path) -> set[str]:
  modules = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module:
      modules.add(node.module)
    elif isinstance(node, ast.Import):
      modules.update(alias.name for alias in node.names)
  return modules


def test_layers_import_no_config_model_or_inference_code():
  upward = {
    f"{p.name}: {m}"
    for p in LAYERS.glob("*.py")
    for m in _imports(p)
    if m.split(".")[:2] in (["maxtext", "config"], ["maxtext", "models"], ["maxtext", "inference"])
  }
  assert not upward


def test_layers_compare_no_family_name():
  """A family's difference is a spec field: no string constant in the layers' code names a family."""
  names = set(registry.FAMILIES)
  found = []
  for path in LAYERS.glob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value in names for c in [node.left, *node.comparators]):
        found.append(f"{path.name}:{node.lineno}")
  assert not found


@pytest.mark.parametrize(
  "overrides",
  [dict(decoder_block="llama2"), dict(decoder_block="mixtral", **MOE), dict(decoder_block="gemma2", mhc_expansion_rate=2, lora={"enable_lora": True})],
)
def test_no_layer_keeps_the_config(overrides):
  """Every module below the Transformer holds specs, never the MaxTextConfig (it would sit in every graphdef)."""
  model = models.abstract_model(from_overrides(**TINY, **overrides))
  holders = [
    "/".join(map(str, path)) or "<model>"
    for path, module in nnx.iter_modules(model)
    if path and any(isinstance(value, MaxTextConfig) for value in vars(module).values())
  ]
  assert not holders


def test_specs_are_hashable_and_built_alike():
  config = from_overrides(**TINY, decoder_block="deepseek", **MOE, shared_experts=1, first_num_dense_layers=1, q_lora_rank=4, kv_lora_rank=4)
  config = config.model_copy(update={"qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4})
  a, b = specs.model(config), specs.model(config)
  assert a == b and hash(a) == hash(b)
  assert type(a.layer.attention).__name__ == "MLASpec" and type(a.layers[0].feed_forward).__name__ == "MLPSpec"
  assert [k.ffn for k in a.kinds] == ["dense", "moe_shared"] and a.layers[1] is a.layer
  assert a.layer.feed_forward.shared == feed_forward_specs.mlp(config, config.moe_mlp_dim)


def test_family_differences_are_spec_fields():
  mixtral = from_overrides(**TINY, decoder_block="mixtral", **MOE, norm_topk_prob=False)
  qwen = from_overrides(**TINY, decoder_block="qwen3_moe", **MOE, norm_topk_prob=False)
  assert feed_forward_specs.moe(mixtral).routing.renormalize and not feed_forward_specs.moe(qwen).routing.renormalize
  gpt_oss = from_overrides(**TINY, decoder_block="gpt_oss", **MOE, mlp_activations_limit=7.0)
  assert feed_forward_specs.moe(gpt_oss).glu_limit == 7.0 and feed_forward_specs.moe(mixtral.model_copy(update={"mlp_activations_limit": 7.0})).glu_limit == 0.0


def test_dtype_names_become_types_in_the_policy():
  config = from_overrides(num_devices=1, dtype="float16", weight_dtype="bfloat16", matmul_precision="highest")
  dtypes = platform.for_platform(config, "cpu").dtypes
  assert (dtypes.compute, dtypes.params, dtypes.accumulation, dtypes.output) == (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float32)
  assert str(dtypes.precision).endswith("HIGHEST")
  kernel = models.abstract_model(from_overrides(**TINY, weight_dtype="bfloat16")).layers.mlp.wo.kernel
  assert kernel.dtype == jnp.bfloat16
  with pytest.raises(dataclasses.FrozenInstanceError):
    dtypes.compute = jnp.float32
