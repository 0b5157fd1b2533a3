"""load_parameters_path=<Hugging Face directory>: the architecture from config.json, the weights converted and
sharded while read (step-0 logits equal transformers'), host memory bounded, a contradicting key a one-line error."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc

import jax.numpy as jnp
import numpy as np
import pytest

from tests import hf_fixtures
from tests.test_bad_inputs import REPO, _env, _snapshot

BASE = str(REPO / "configs" / "base.yml")
FLOAT32 = ["dtype=float32", "weight_dtype=float32", "matmul_precision=highest", "attention=dot_product", "max_target_length=16"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  d = tmp_path_factory.mktemp("hf") / "llama"
  return d, hf_fixtures.save_tiny_model("llama2", d)


def test_architecture_and_logits_from_hf_dir(llama):
  """Sharded over 8 devices (fsdp), the loaded model's logits equal transformers' within 1e-4 in float32."""
  from maxtext import mesh as mesh_lib
  from maxtext.config import load
  from maxtext.inference.loading import load_model

  d, torch_model = llama
  config = load([BASE, f"load_parameters_path={d}", *FLOAT32], env={})
  assert (config.decoder_block, config.emb_dim, config.num_decoder_layers, config.vocab_size) == ("llama2", 32, 3, 97)
  lines = []
  model = load_model(config, mesh_lib.create(config), log=lines.append)
  assert lines == [f"loaded parameters from {d}"]
  tokens = np.array([[1, 5, 9, 20, 33, 2, 7, 8]])
  ours = np.asarray(model(jnp.asarray(tokens)))
  np.testing.assert_allclose(ours, hf_fixtures.hf_logits(torch_model, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama2", "mixtral"])
def test_sliced_reads_equal_whole_conversion(tmp_path, family):
  """Every parameter read by slices (as a shard's callback asks) equals the same slice of the whole-tensor conversion."""
  from maxtext.config import load
  from maxtext.convert import hf_dir, hf_params, safetensors_io

  d = tmp_path / family
  hf_fixtures.save_tiny_model(family, d)
  config = load([BASE, f"load_parameters_path={d}", "scan_layers=true"], env={})
  whole = hf_params.hf_to_maxtext(safetensors_io.read_tensors(d), config)
  readers, _ = hf_dir._param_readers(hf_dir._Files(str(d)), config, {k: v.shape for k, v in whole.items()})
  rng = np.random.default_rng(0)
  for path, value in whole.items():
    for _ in range(3):
      index = []
      for n in value.shape:
        a = int(rng.integers(0, n))
        index.append(slice(a, int(rng.integers(a + 1, n + 1))))
      np.testing.assert_array_equal(readers[path](tuple(index)), value[tuple(index)], err_msg=path)


def test_host_memory_of_the_load_is_a_fraction_of_the_weights(tmp_path):
  """Numpy allocations while loading stay below half the weights' bytes (the whole-directory read held all of them)."""
  import transformers
  from flax import nnx

  from maxtext import mesh as mesh_lib
  from maxtext import models
  from maxtext.config import load
  from maxtext.convert import hf_dir

  d = tmp_path / "wide"
  model = transformers.AutoModelForCausalLM.from_config(
    transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4)
  )
  model.save_pretrained(d)
  weights = sum(p.numel() * 4 for p in model.parameters())
  config = load([BASE, f"load_parameters_path={d}", "dtype=float32", "weight_dtype=float32", "scan_layers=false"], env={})
  mesh = mesh_lib.create(config)
  abstract = nnx.state(models.abstract_model(config), nnx.Param)
  shardings = models.state_shardings(abstract, config, mesh)
  target = nnx.from_flat_state(
    [
      (k, v.replace(__import__("jax").ShapeDtypeStruct(v.shape, v.dtype, sharding=s)))
      for (k, v), (_, s) in zip(nnx.to_flat_state(abstract), nnx.to_flat_state(shardings))
    ]
  )
  tracemalloc.start()
  restored = hf_dir.restore(str(d), config, target)
  peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  assert len(list(nnx.to_flat_state(restored))) == len(list(nnx.to_flat_state(abstract)))
  assert peak < weights / 2, (peak, weights)


def _train(d, tmp, *extra):
  keys = ["steps=2", "per_device_batch_size=1", "enable_checkpointing=false", f"base_output_directory={tmp}/out", "run_name=r", "dataset_type=synthetic"]
  return [sys.executable, "-m", "maxtext.train", BASE, f"load_parameters_path={d}", "max_target_length=16", *keys, *extra]


def test_key_contradicting_config_json_is_one_line(llama, tmp_path):
  d, _ = llama
  before = _snapshot(tmp_path)
  proc = subprocess.run(_train(d, tmp_path, "base_emb_dim=64"), capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: 'base_emb_dim=64' (command line) contradicts"), proc.stderr
  assert "config.json" in lines[0] and "hidden_size" not in lines[0]
  assert _snapshot(tmp_path) == before


def test_eval_takes_hf_model_path(llama, tmp_path):
  """maxtext.eval's hf_model_path scores the directory's weights (architecture from its config.json)."""
  from maxtext.config import load
  from maxtext.eval import evaluate, with_hf_model

  d, _ = llama
  argv = [BASE, f"hf_model_path={d}", "eval_steps=1", "per_device_batch_size=1", "dataset_type=synthetic", f"base_output_directory={tmp_path}", "run_name=e"]
  config = load(with_hf_model(argv, load(argv, env={})), env={})
  lines = []
  result = evaluate(config, log=lines.append)
  assert f"loaded parameters from {d}" in lines and np.isfinite(result["eval_loss"])


def test_unquoted_prompt_with_a_colon_is_its_text():
  """prompt=Question: what is -- a string key's value, not the YAML mapping {'Question': 'what is'}."""
  from maxtext.config import load

  assert load([BASE, "prompt=Question: what is"], env={}).prompt == "Question: what is"
