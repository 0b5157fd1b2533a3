"""Every feature on the families added with issues 36-38 (llama4, gemma4 dense and MoE, qwen3_next, qwen3_5,
qwen3_5_moe, deepseek_v32), on the tiny configs of their own test files: one training step with LoRA, mHC and an int8
base together (QLoRA); PEFT adapters that transformers + peft run to our logits; the train step compiled for a TPU
topology with those features (train_compile). Conversion, decoding and GRPO are tested in the families' own files
and tests/test_grpo_families.py; docs/models.md has the matrix."""

from __future__ import annotations

import copy
import importlib.util
import re

import jax
import numpy as np
import pytest
import torch
from flax import nnx

from maxtext import from_hf
from maxtext.config import from_overrides
from maxtext.convert import hf_config
from maxtext.convert import peft as lora_peft
from maxtext.convert.model_params import flat_params
from maxtext.errors import ConfigError
from maxtext.layers.lora import LoRAParam
from maxtext.layers.mhc import MHCParam
from maxtext.train import setup as setup_lib
from tests import test_deepseek_v32, test_gemma4, test_llama4, test_qwen3_5, test_qwen3_next
from tests.hf_fixtures import FAMILY_CONFIGS, hf_logits
from tests.test_lora import _fixed_batch
from tests.test_mhc import jit_logits
from tests.test_train_helpers import FAST_COMPILE, TINY, mesh_for

S, F = "sliding_attention", "full_attention"
# Hugging Face configs of 3-4 layers (every layer kind of the family once at least) -> their maxtext keys.
HF_CONFIGS = {
  "llama4": lambda: test_llama4.tiny_config(num_hidden_layers=4),  # dense, MoE, dense, MoE; NoPE at layer 3
  # sliding, global, and a KV-shared global layer with the double-wide MLP; per-layer inputs
  "gemma4": lambda: test_gemma4.tiny_config(num_hidden_layers=4, layer_types=[S, S, F, F], num_kv_shared_layers=1),
  # the MoE block beside the dense MLP; no per-layer inputs, so mHC can run
  "gemma4_moe": lambda: test_gemma4.tiny_config(**test_gemma4.MOE, num_hidden_layers=4, layer_types=[S, S, F, F], hidden_size_per_layer_input=0),
  "qwen3_next": lambda: test_qwen3_next.tiny_config(),  # 3 Gated DeltaNet layers + 1 attention layer, then one more
  "qwen3_5": lambda: test_qwen3_5.tiny_config("dense"),
  "qwen3_5_moe": lambda: test_qwen3_5.tiny_config("moe"),
  "deepseek_v32": lambda: test_deepseek_v32.tiny_config(),  # 1 dense + 2 MoE layers, MLA over the indexer's top-k keys
  "olmo3": FAMILY_CONFIGS["olmo3"],  # post-norms only, whole-projection QK norm, 3 sliding layers per global one
  "qwen2": FAMILY_CONFIGS["qwen2"],  # q/k/v biases, tied embeddings
}
FAMILIES = list(HF_CONFIGS)
# mHC cannot run beside Gemma 4's per-layer inputs (a one-line ConfigError, checked below); everything else runs n = 2.
MHC = {name: 1 if name == "gemma4" else 2 for name in FAMILIES}
# Adapters on every dense projection: attention, Gated DeltaNet, MLA (not its indexer), shared experts, and the MLP where
# no layer has routed experts under mlp/ (a path matching routed experts is refused: LoRA does not adapt them).
ATTENTION = r"attention/(query|key|value|out|in_proj_qkvz|in_proj_ba|in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj|wq_a|wq_b|wkv_a|wkv_b)"
DENSE_MLP = {"gemma4", "qwen3_5", "olmo3", "qwen2"}


def lora(name: str) -> dict:
  mlp = r"mlp/(wi_0|wi_1|wo)" if name in DENSE_MLP else r"mlp/shared_experts/(wi_0|wi_1|wo)"
  return {"enable_lora": True, "lora_rank": 4, "lora_alpha": 8, "lora_module_path": f"(^|/)({ATTENTION}|{mlp})$"}


def _trimmed(hf: dict) -> dict:
  """The Gated DeltaNet families' 5-layer test configs cut to 4 layers: one scanned block of 3 linear + 1 attention."""
  if "layer_types" in hf and hf.get("linear_num_value_heads"):
    hf = {**hf, "num_hidden_layers": 4, "layer_types": hf["layer_types"][:4]}
  return hf


def family_config(name: str, num_devices: int | None = 1, **keys):
  """The family's tiny maxtext config (synthetic data) with LoRA, mHC and an int8 base, and `keys`; num_devices None:
  compile_topology's devices."""
  model = hf_config.overrides_from_hf(_trimmed(HF_CONFIGS[name]().to_dict()))
  run = {k: v for k, v in TINY.items() if k not in model}
  features = dict(lora=lora(name), mhc_expansion_rate=MHC[name], quantization="int8")
  return from_overrides(num_devices=num_devices, **{**model, **run, **features, **keys})


def _flat(state, kind=nnx.Param) -> dict[str, np.ndarray]:
  return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.filter_state(state, kind))}


@pytest.fixture(scope="module", params=FAMILIES)
def trained(request):
  """(name, state before, state after one step, loss at step 0, loss of the same step with every adapter zeroed (the base model's))."""
  name = request.param
  config = family_config(name)
  setup = setup_lib.build(config, mesh_for(config))
  with jax.set_mesh(setup.mesh):
    start = jax.device_get(setup.init_state())
    batch = jax.device_put(_fixed_batch(config), setup.batch_shardings)
    step = setup.jit_step.lower(setup.abstract_state, setup.abstract_batch).compile(compiler_options=FAST_COMPILE)
    after, metrics = step(jax.device_put(start, setup.state_shardings), batch)
    # The same compiled step on the base model alone: A = 0 and B = 0 make every adapter's product exactly zero.
    base_only = jax.tree.map(lambda x: x, start)
    for _, var in nnx.to_flat_state(nnx.filter_state(base_only["params"], LoRAParam)):
      var.set_value(np.zeros_like(var.get_value()))
    _, base_metrics = step(jax.device_put(base_only, setup.state_shardings), batch)
  return name, start, jax.device_get(after), float(metrics["loss"]), float(base_metrics["loss"])


def test_lora_mhc_and_int8_train_together(trained):
  """One step of LoRA on an int8 base with mHC connectors: the base stays bit-identical (and int8), the adapters and
  connectors move, and at step 0 the adapted model's loss is the base model's (B = 0 at init)."""
  name, start, after, loss, base_loss = trained
  assert np.isfinite(loss) and loss > 0
  np.testing.assert_allclose(loss, base_loss, rtol=1e-6, atol=0)
  adapters = _flat(start["params"], LoRAParam)
  assert adapters and not any(np.any(v) for k, v in adapters.items() if k.endswith("lora_b"))
  moved = _flat(after["params"], LoRAParam)
  assert all(not np.array_equal(adapters[k], moved[k]) for k in adapters if k.endswith("lora_b")), name
  connectors_before, connectors_after = _flat(start["params"], MHCParam), _flat(after["params"], MHCParam)
  if MHC[name] > 1:
    assert connectors_before and any(not np.array_equal(v, connectors_after[k]) for k, v in connectors_before.items())
  else:
    assert not connectors_before
  base_before = _flat(start["params"], nnx.All(nnx.Param, nnx.Not(nnx.Any(LoRAParam, MHCParam))))
  base_after = _flat(after["params"], nnx.All(nnx.Param, nnx.Not(nnx.Any(LoRAParam, MHCParam))))
  assert sorted(base_before) == sorted(base_after) and all(np.array_equal(v, base_after[k]) for k, v in base_before.items())
  int8 = [k for k, v in base_before.items() if v.dtype == np.int8]
  assert all(k[: -len("lora/lora_a")] + "kernel" in int8 for k in adapters if k.endswith("lora_a")), name  # QLoRA: every adapted kernel stored int8


def test_mhc_beside_gemma4_per_layer_inputs_is_a_one_line_config_error():
  with pytest.raises(ConfigError, match="hidden_size_per_layer_input adds per-layer inputs to one residual stream") as e:
    family_config("gemma4", mhc_expansion_rate=2)
  assert "\n" not in str(e.value)


# --------------------------------------------------------------------------------------------------------------------
# PEFT: the converted checkpoint with random adapters, exported, run by transformers + peft.

PEFT_DIRS = {
  "llama4": lambda d: test_llama4.saved(d),
  "gemma4": lambda d: test_gemma4.saved(d),
  "gemma4_moe": lambda d: test_gemma4.saved_moe(d),
  "qwen3_next": lambda d: test_qwen3_next.saved(d),
  "qwen3_5_moe": lambda d: test_qwen3_5.saved("moe", d),  # the dense variant: tests/test_qwen3_5.py
  "deepseek_v32": lambda d: test_deepseek_v32.save_tiny(d),
}
# peft under transformers 5 reads the target modules gate_proj/up_proj/down_proj of qwen3_next and deepseek models as
# their fused routed experts (peft.utils.transformers_weight_conversion): adapters on their shared experts would not
# load there, so those two export attention adapters only (MLA's and the Gated DeltaNet's included).
ATTENTION_ONLY = {"qwen3_next", "deepseek_v32"}


@pytest.mark.parametrize("name", list(PEFT_DIRS))
def test_peft_adapters_reproduce_our_logits_in_transformers(name, tmp_path):
  peft = pytest.importorskip("peft")

  torch_model = PEFT_DIRS[name](str(tmp_path / "hf"))
  adapted = {**lora(name), "lora_module_path": f"(^|/){ATTENTION}$"} if name in ATTENTION_ONLY else lora(name)
  model, config = from_hf(tmp_path / "hf", lora=adapted, dtype="float32", matmul_precision="highest")
  for i, (_, var) in enumerate(nnx.to_flat_state(nnx.state(model, LoRAParam))):
    var.set_value(0.3 * jax.random.normal(jax.random.key(i), var.shape))
  adapters = {k: np.asarray(v) for k, v in flat_params(model).items() if "/lora/" in k}
  if name == "qwen3_next":  # a shared-expert adapter peft would drop: refused in one line instead
    shared = {re.sub(r"attention/\w+/", "mlp/shared_experts/wi_0/", k): v for k, v in adapters.items()}
    with pytest.raises(ConfigError, match="fused routed experts, so the adapter on .*gate_proj would not load; use --merge"):
      lora_peft.to_peft({**adapters, **shared}, config)
  tensors, adapter_config = lora_peft.to_peft(adapters, config)
  back = lora_peft.from_peft(tensors, config, {k: v.shape for k, v in adapters.items()})
  assert sorted(back) == sorted(adapters) and all(np.array_equal(back[k], adapters[k]) for k in adapters)
  lora_peft.write(tmp_path / "peft", tensors, adapter_config)
  tokens = np.random.default_rng(3).integers(0, 97, size=(2, 10)).astype(np.int32)
  ours = jit_logits(model, tokens)
  assert np.abs(hf_logits(torch_model, tokens) - ours).max() > 0.1  # the adapters matter
  with torch.no_grad():
    wrapped = peft.PeftModel.from_pretrained(copy.deepcopy(torch_model), str(tmp_path / "peft")).eval()
  np.testing.assert_allclose(hf_logits(wrapped, tokens), ours, atol=1e-4, rtol=0)


# --------------------------------------------------------------------------------------------------------------------
# train_compile: the step with LoRA, mHC and the int8 base compiled for a v5p-8 (compile-only TPU devices, libtpu).

# The families whose layers compile unlike any other (chunked attention and interleaved MoE; per-layer kinds and k = v;
# Gated DeltaNet; post-norms only); qwen3_5_moe and deepseek_v32 also compile (measured, about 40 CPU s each) and are left out for CI time.
AOT_FAMILIES = ["llama4", "gemma4_moe", "qwen3_next", "olmo3"]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed (pip install 'maxtext[tpu]')")
@pytest.mark.parametrize("name", AOT_FAMILIES)
def test_train_step_compiles_for_a_tpu_topology(name):
  from maxtext.aot.compile import compile_for_topology

  result = compile_for_topology(family_config(name, num_devices=None, compile_topology="v5p-8"))
  s = result.summary()
  assert result.devices[0].platform == "tpu" and len(result.devices) == 4
  assert s["fits"] is True and s["tflops_per_step"] > 0
  assert s["quantized_kernel_bytes"] > 0 and s["int8_products"] > 0  # the base is stored int8 and its products run in int8
