"""LoRA <-> Hugging Face PEFT: exported adapters and merged weights reproduce our logits in transformers; CLI round trip and errors."""

from __future__ import annotations

import copy
import json

import jax
import numpy as np
import pytest
import torch
from flax import nnx

from maxtext import from_hf
from maxtext.convert import hf_params
from maxtext.convert import peft as lora_peft
from maxtext.convert.__main__ import main
from maxtext.convert.model_params import flat_params, model_from_flat
from maxtext.layers.lora import LoRAParam
from maxtext.train import checkpoint_files
from tests.hf_fixtures import hf_logits, save_tiny_model
from tests.test_mhc import jit_logits

LORA = {"enable_lora": True, "lora_rank": 4, "lora_alpha": 8}
KW = dict(dtype="float32", matmul_precision="highest")


@pytest.fixture(scope="module")
def toks():
  return np.random.default_rng(1).integers(0, 97, size=(2, 10)).astype(np.int32)


@pytest.fixture(scope="module")
def adapted(tmp_path_factory, toks):
  """A tiny HF llama, loaded with LoRA on every default projection and random (non-zero) B."""
  hf_dir = tmp_path_factory.mktemp("llama")
  torch_model = save_tiny_model("llama2", hf_dir)
  model, config = from_hf(hf_dir, lora=LORA, **KW)
  for i, (_, var) in enumerate(nnx.to_flat_state(nnx.state(model, LoRAParam))):
    var.set_value(0.3 * jax.random.normal(jax.random.key(i), var.shape))
  flat = {k: np.asarray(v) for k, v in flat_params(model).items()}
  return hf_dir, torch_model, model, config, flat, jit_logits(model, toks)


def _adapters(flat):
  return {k: v for k, v in flat.items() if "/lora/" in k}


def test_peft_adapter_reproduces_our_logits_in_transformers(adapted, toks, tmp_path):
  peft = pytest.importorskip("peft")  # without it, test_merged_weights_reproduce_our_logits still checks the maths

  _, torch_model, _, config, flat, ours = adapted
  tensors, adapter_config = lora_peft.to_peft(_adapters(flat), config)
  assert adapter_config["r"] == 4 and adapter_config["lora_alpha"] == 8
  assert adapter_config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
  assert tensors["base_model.model.model.layers.2.self_attn.o_proj.lora_A.weight"].shape == (4, 32)  # r x in
  assert tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"].shape == (16, 4)  # out x r
  lora_peft.write(tmp_path, tensors, adapter_config)
  plain = hf_logits(torch_model, toks)
  assert np.abs(plain - ours).max() > 0.1  # the adapters matter
  with torch.no_grad():
    wrapped = peft.PeftModel.from_pretrained(copy.deepcopy(torch_model), str(tmp_path)).eval()
    theirs = wrapped(torch.as_tensor(toks, dtype=torch.long)).logits.float().numpy()
  np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)


def test_merged_weights_reproduce_our_logits(adapted, toks):
  _, torch_model, _, config, flat, ours = adapted
  merged = hf_params.maxtext_to_hf(lora_peft.merge(flat, config), config)
  target = copy.deepcopy(torch_model)
  target.load_state_dict({k: torch.as_tensor(np.array(v)) for k, v in merged.items()}, strict=True)
  np.testing.assert_allclose(hf_logits(target, toks), ours, atol=1e-4, rtol=0)


def test_peft_round_trip_scanned_and_unscanned(adapted):
  hf_dir, _, _, config, flat, _ = adapted
  adapters = _adapters(flat)
  tensors, adapter_config = lora_peft.to_peft(adapters, config)
  assert (
    lora_peft.lora_overrides(adapter_config, config)["lora_module_path"]
    == "(^|/)(attention/key|attention/out|attention/query|attention/value|mlp/wi_0|mlp/wi_1|mlp/wo)$"
  )
  back = lora_peft.from_peft(tensors, config, {k: v.shape for k, v in adapters.items()})
  assert sorted(back) == sorted(adapters) and all(np.array_equal(back[k], adapters[k]) for k in adapters)
  unscanned = from_hf(hf_dir, lora=LORA, scan_layers=False, **KW)[1]
  per_layer = {k.replace("layers/", f"layers/{i}/", 1): v[i] for k, v in adapters.items() for i in range(3)}
  again, _ = lora_peft.to_peft(per_layer, unscanned)
  assert all(np.array_equal(again[k], tensors[k]) for k in tensors)
  with pytest.raises(Exception, match="lacks 'base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight'"):
    lora_peft.from_peft({k: v for k, v in tensors.items() if "layers.0.self_attn.k_proj.lora_A" not in k}, config, {k: v.shape for k, v in adapters.items()})


def _run(argv, capsys):
  with pytest.raises(SystemExit) as e:
    main(argv)
  return e.value.code, capsys.readouterr()


def test_cli_lora_to_peft_merge_and_peft_to_lora(adapted, toks, tmp_path, capsys):
  import transformers

  hf_dir, _, model, config, flat, ours = adapted
  base = tmp_path / "base"
  main(["hf-to-maxtext", "--hf-dir", str(hf_dir), "--out", str(base)])
  run_ckpt = tmp_path / "run_ckpt"
  checkpoint_files.save_params(str(run_ckpt), nnx.state(model, LoRAParam))  # what a LoRA run's checkpoint holds
  run_config = [str(base / "maxtext_model.yml"), "lora.enable_lora=true", "lora.lora_rank=4", "lora.lora_alpha=8"]
  main(["lora-to-peft", "--checkpoint", str(run_ckpt), "--out", str(tmp_path / "peft"), "--config", *run_config])
  assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["r"] == 4
  exported, _ = lora_peft.read(tmp_path / "peft")
  expected, _ = lora_peft.to_peft(_adapters(flat), config)
  assert sorted(exported) == sorted(expected) and all(np.array_equal(exported[k], expected[k]) for k in expected)

  main(["lora-to-peft", "--merge", "--checkpoint", str(run_ckpt), "--out", str(tmp_path / "merged"), "--config", *run_config])
  merged_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), attn_implementation="eager").float().eval()
  np.testing.assert_allclose(hf_logits(merged_model, toks), ours, atol=1e-4, rtol=0)

  main(["peft-to-lora", "--peft-dir", str(tmp_path / "peft"), "--out", str(tmp_path / "back"), "--config", str(base / "maxtext_model.yml")])
  printed = capsys.readouterr().out
  assert "lora.lora_rank=4" in printed and "lora.lora_alpha=8.0" in printed and f"lora.lora_restore_path={tmp_path / 'back'}" in printed
  shapes = checkpoint_files.param_shapes(str(tmp_path / "back"))
  assert shapes == {k: v.shape for k, v in _adapters(flat).items()}

  errors = [
    ["lora-to-peft", "--checkpoint", str(run_ckpt), "--out", str(tmp_path / "peft"), "--config", *run_config],  # existing output
    ["lora-to-peft", "--checkpoint", str(run_ckpt), "--out", str(tmp_path / "x1"), "--config", *run_config, "mhc_expansion_rate=2"],
    ["lora-to-peft", "--checkpoint", str(run_ckpt), "--out", str(tmp_path / "x2"), "--config", str(base / "maxtext_model.yml")],
    ["lora-to-peft", "--checkpoint", str(run_ckpt), "--out", str(tmp_path / "x3"), "--config", *run_config[:-2], "lora.lora_rank=2"],
    ["peft-to-lora", "--peft-dir", str(tmp_path / "peft"), "--out", str(tmp_path / "x4"), "--config", *run_config],
    ["peft-to-lora", "--peft-dir", str(tmp_path / "nothing"), "--out", str(tmp_path / "x5"), "--config", str(base / "maxtext_model.yml")],
  ]
  messages = ["already exists", "mHC connectors have no", "lora.enable_lora=true", "this model needs (3, 32, 2)", "drop lora.enable_lora", "not a PEFT adapter"]
  for argv, message in zip(errors, messages):
    code, out = _run(argv, capsys)
    err = out.err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], (argv, out.err)
  assert not (tmp_path / "x3").exists() and not (tmp_path / "x4").exists()


def test_peft_adapter_trained_on_an_int8_base_loads_onto_the_float_model(adapted, toks, tmp_path):
  """QLoRA: our model holds the base in int8 (w8a8 products). Its exported adapter on the float model in transformers
  gives logits that differ from ours by int8's own error on the base (our float-base logits vs our int8-base logits,
  to 1e-3), here under 3% of the logits' range."""
  peft = pytest.importorskip("peft")

  _, torch_model, _, config, flat, _ = adapted
  small = {k: v * 0.2 if "/lora/" in k else v for k, v in flat.items()}  # adapters of a trained run's size
  logits = {}
  for mode in ("", "int8"):
    model = model_from_flat(config.model_copy(update={"quantization": mode}), small)  # int8: kernels quantized here
    logits[mode] = jit_logits(model, toks)
  assert nnx.state(model, nnx.Param)["layers"]["attention"]["query"]["kernel"][...].dtype == np.int8
  tensors, adapter_config = lora_peft.to_peft(_adapters(small), config)
  lora_peft.write(tmp_path, tensors, adapter_config)
  with torch.no_grad():
    wrapped = peft.PeftModel.from_pretrained(copy.deepcopy(torch_model), str(tmp_path)).eval()
    theirs = wrapped(torch.as_tensor(toks, dtype=torch.long)).logits.float().numpy()
  int8_error = np.abs(logits["int8"] - logits[""]).max()
  np.testing.assert_allclose(theirs, logits[""], atol=1e-4, rtol=0)
  assert abs(np.abs(theirs - logits["int8"]).max() - int8_error) < 1e-3
  assert 0 < int8_error < 0.03 * np.ptp(logits[""])


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss", "qwen2", "olmo3"])
def test_peft_adapters_of_gemma3_and_gpt_oss_round_trip_and_load_in_peft(tmp_path, toks, family):
  """Adapters on every attention projection (and gemma3's MLP) export to PEFT bit for bit and back, and PEFT on the
  transformers model gives our logits (gpt-oss: the q/k/v/o biases and sinks stay in the frozen base; qwen2 and olmo3:
  the q/k/v biases and the whole-projection QK norms)."""
  peft = pytest.importorskip("peft")

  torch_model = save_tiny_model(family, tmp_path / "hf")
  model, config = from_hf(tmp_path / "hf", lora=LORA, **KW)
  for i, (_, var) in enumerate(nnx.to_flat_state(nnx.state(model, LoRAParam))):
    var.set_value(0.3 * jax.random.normal(jax.random.key(i), var.shape))
  adapters = _adapters({k: np.asarray(v) for k, v in flat_params(model).items()})
  assert {k.split("/")[1] + "/" + k.split("/")[2] for k in adapters} >= {"attention/query", "attention/key", "attention/value", "attention/out"}
  tensors, adapter_config = lora_peft.to_peft(adapters, config)
  back = lora_peft.from_peft(tensors, config, {k: v.shape for k, v in adapters.items()})
  assert sorted(back) == sorted(adapters) and all(np.array_equal(back[k], adapters[k]) for k in adapters)
  lora_peft.write(tmp_path / "peft", tensors, adapter_config)
  with torch.no_grad():
    wrapped = peft.PeftModel.from_pretrained(torch_model, str(tmp_path / "peft")).eval()
    theirs = wrapped(torch.as_tensor(toks, dtype=torch.long)).logits.float().numpy()
  np.testing.assert_allclose(theirs, jit_logits(model, toks), atol=1e-4, rtol=0)
