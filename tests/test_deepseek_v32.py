"""DeepSeek V3.2 (decoder_block=deepseek_v32): MLA over the top-k keys of a lightning indexer (DeepSeek Sparse Attention).

Against transformers' DeepseekV32ForCausalLM on a tiny random model (float32, eager): logits scanned and unscanned with
index_topk below the sequence length, greedy decoding, conversion both ways; the indexer's KL term against a hand
computation and where its gradients go in the dense warm-up; the 671B model file's counts; bad inputs as one line.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from maxtext import from_hf
from maxtext.config import ConfigError, load
from maxtext.convert import hf_config, hf_config_export, hf_params, safetensors_io
from maxtext.convert.model_params import flat_params
from maxtext.layers.mla_sparse import indexer_kl, select_topk
from tests.hf_fixtures import YARN, away_from_init, hf_logits
from tests.test_bad_inputs import CONVERT, REPO, _run_case, assert_one_line_exit_2

TOPK = 5  # below the 12 tokens of the parity batch: the selection matters
SEQ = 12


def tiny_config(**edit) -> transformers.DeepseekV32Config:
  """1 dense + 2 MoE layers, MLA with a query latent and YaRN (DeepSeek's mscale), an indexer of 8 heads (ties in its
  ReLU scores are then rare) and top-5 keys."""
  fields = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    q_lora_rank=12,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    max_position_embeddings=32,
    rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
    n_group=4,
    topk_group=2,
    index_n_heads=8,
    index_head_dim=8,
    index_topk=TOPK,
  )
  return transformers.DeepseekV32Config(**{**fields, **edit})


def save_tiny(out_dir, **edit) -> transformers.PreTrainedModel:
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(tiny_config(**edit), attn_implementation="eager").float().eval()
  away_from_init(model)
  model.save_pretrained(out_dir)
  return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  d = tmp_path_factory.mktemp("deepseek_v32")
  return d, save_tiny(d)


@pytest.fixture(scope="module")
def tokens():
  return np.random.default_rng(0).integers(0, 97, size=(2, SEQ)).astype(np.int32)


@pytest.mark.parametrize("scan", [True, False])
def test_logits_match_transformers(saved, tokens, scan):
  hf_dir, torch_model = saved
  model, config = from_hf(hf_dir, scan_layers=scan, dtype="float32", matmul_precision="highest")
  assert (config.decoder_block, config.use_indexer, config.indexer_topk, config.indexer_n_heads, config.indexer_head_dim) == ("deepseek_v32", True, TOPK, 8, 8)
  ours = np.asarray(model(tokens))
  np.testing.assert_allclose(ours, hf_logits(torch_model, tokens), atol=1e-4, rtol=0)
  if scan:  # every key (top-k = the sequence) gives other logits: the selection is what matched
    dense, _ = from_hf(hf_dir, scan_layers=scan, dtype="float32", matmul_precision="highest", indexer_topk=SEQ)
    assert np.abs(np.asarray(dense(tokens)) - ours).max() > 1e-2


def test_round_trip_is_bit_identical_and_exports_to_transformers(saved, tokens, tmp_path):
  hf_dir, torch_model = saved
  model, config = from_hf(hf_dir, dtype="float32")
  back = hf_params.maxtext_to_hf({k: np.asarray(v) for k, v in flat_params(model).items()}, config)
  original = safetensors_io.read_tensors(hf_dir)
  assert sorted(back) == sorted(original) and any(".indexer.k_norm.bias" in k for k in back)
  for k, v in original.items():
    assert back[k].dtype == v.dtype and np.array_equal(back[k], v), k
  exported = hf_config_export.hf_config_from(config)
  assert (exported["model_type"], exported["index_topk"], exported["index_n_heads"], exported["index_head_dim"]) == ("deepseek_v32", TOPK, 8, 8)
  safetensors_io.write(tmp_path, exported, back)
  loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float().eval()
  np.testing.assert_allclose(hf_logits(loaded, tokens), hf_logits(torch_model, tokens), atol=1e-5, rtol=0)


def test_greedy_decode_matches_transformers_generate(saved):
  """Prompts of 3 and 9 tokens and 17 tokens in all: the indexer keys are cached and each step selects the top 5 of
  the cache, as transformers does."""
  from maxtext.inference import Generator

  hf_dir, torch_model = saved
  rng = np.random.default_rng(1)
  prompts = [rng.integers(3, 97, size=n).tolist() for n in (3, 9)]
  eos = torch_model.config.eos_token_id
  for naive in (False, True):
    model, config = from_hf(hf_dir, dtype="float32", matmul_precision="highest", mla_naive_kvcache=naive)
    ours = Generator(model, config=config, max_target_length=17, max_prefill_length=16, eos_id=eos).generate(prompts).tokens
    for prompt, got in zip(prompts, ours):
      with torch.no_grad():
        ref = torch_model.generate(torch.tensor([prompt]), max_new_tokens=17 - len(prompt), do_sample=False, eos_token_id=eos, pad_token_id=0)
      assert got == ref[0, len(prompt) :].tolist(), f"naive={naive}, prompt of {len(prompt)}"


def test_topk_selection_and_kl_by_hand():
  """select_topk keeps the k best allowed keys (ties to the earlier key); indexer_kl is KL(p || softmax(I)) summed over
  real queries, p the heads' attention probabilities summed and L1-normalised on the support."""
  scores = jnp.array([[[3.0, 1.0, 2.0, 2.0, 9.0]]])
  allowed = jnp.array([[[True, True, True, True, False]]])
  assert select_topk(scores, allowed, 2).tolist() == [[[True, False, True, False, False]]]
  assert select_topk(scores, allowed, 9).tolist() == allowed.tolist()  # fewer allowed keys than k: all of them
  probs = jnp.array([[[[0.5, 0.5, 0.0]], [[0.2, 0.6, 0.2]]]])  # [B=1, H=2, S=1, T=3]
  index = jnp.array([[[0.0, 1.0, 2.0]]])
  support = jnp.array([[[True, True, True]]])
  p = np.array([0.7, 1.1, 0.2]) / 2.0
  q = np.exp([0.0, 1.0, 2.0]) / np.exp([0.0, 1.0, 2.0]).sum()
  expected = float(np.sum(p * np.log(p / q)))
  np.testing.assert_allclose(float(indexer_kl(index, probs, support, jnp.array([[True]]))), expected, rtol=1e-6)
  assert float(indexer_kl(index, probs, support, jnp.array([[False]]))) == 0.0  # padding queries do not count
  sparse = jnp.array([[[True, True, False]]])  # sparse training: both distributions on the selected keys
  p2, q2 = np.array([0.7, 1.1]) / 1.8, np.exp([0.0, 1.0]) / np.exp([0.0, 1.0]).sum()
  np.testing.assert_allclose(float(indexer_kl(index, probs, sparse, jnp.array([[True]]))), float(np.sum(p2 * np.log(p2 / q2))), rtol=1e-6)


def _tiny_train_config(**keys):
  base = dict(
    model_name="deepseek3-tiny",
    override_model_config="true",
    decoder_block="deepseek_v32",
    use_indexer="true",
    indexer_n_heads=4,
    indexer_head_dim=8,
    indexer_topk=4,
    base_num_decoder_layers=2,
    base_emb_dim=32,
    base_mlp_dim=32,
    base_moe_mlp_dim=8,
    base_num_query_heads=2,
    base_num_kv_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    n_routing_groups=-1,
    topk_routing_group=-1,
    vocab_size=128,
    q_lora_rank=8,
    kv_lora_rank=8,
    qk_nope_head_dim=4,
    qk_rope_head_dim=4,
    v_head_dim=4,
    head_dim=8,
    mtp_num_layers=0,
    max_target_length=16,
    per_device_batch_size=1,
    dtype="float32",
    indexer_loss_scaling_factor=0.5,
  )
  return load([str(REPO / "configs" / "base.yml"), *(f"{k}={v}" for k, v in {**base, **keys}.items())], env={}, num_devices=1)


def _gradient_norms(config, batch, which: str) -> tuple[list[str], float, float]:
  """(trainable parameter paths, gradient norm on the indexers, elsewhere) of one term of the objective: all (the
  loss), kl (the indexer term) or lm (the cross entropy)."""
  from maxtext import models
  from maxtext.train import loss as loss_lib
  from maxtext.train.step import LanguageModel
  from maxtext.train.trainable import split_params

  model = nnx.merge(nnx.graphdef(models.abstract_model(config)), jax.jit(lambda: nnx.state(models.build(config, nnx.Rngs(0))))())
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  trainable, frozen = split_params(params, config)

  def term(trainable):
    sums = loss_lib.loss_sums(nnx.merge(graphdef, trainable, frozen, rest), batch, config)
    return {"all": LanguageModel(config).loss(sums, 1.0), "kl": sums.indexer, "lm": sums.xent}[which]

  norms = {".".join(map(str, p)): float(jnp.linalg.norm(v[...])) for p, v in nnx.to_flat_state(jax.jit(jax.grad(term))(trainable))}  # compiled, not op by op
  paths = [".".join(map(str, p)) for p, _ in nnx.to_flat_state(trainable)]
  return paths, sum(v for k, v in norms.items() if "indexer" in k), sum(v for k, v in norms.items() if "indexer" not in k)


def test_dense_warmup_trains_only_the_indexer_on_the_kl():
  """Warm-up (indexer_sparse_training=false): the trainable parameters are the indexers' alone, and the loss's
  gradient reaches them (the KL). Sparse training: everything trains; the KL's gradient reaches only the indexers, the
  cross entropy's only the rest."""
  rng = np.random.default_rng(0)
  tok = rng.integers(1, 100, size=(2, 16)).astype(np.int32)
  segs = np.ones_like(tok)
  segs[1, 10:] = 0  # padding
  batch = dict(inputs=tok, targets=np.roll(tok, -1, 1), inputs_position=np.tile(np.arange(16, dtype=np.int32), (2, 1)))
  batch = {k: jnp.asarray(v) for k, v in {**batch, "inputs_segmentation": segs, "targets_segmentation": segs}.items()}
  paths, on_indexer, elsewhere = _gradient_norms(_tiny_train_config(indexer_sparse_training="false"), batch, "all")
  assert paths and all("indexer" in p for p in paths) and on_indexer > 0 and elsewhere == 0
  sparse = _tiny_train_config(indexer_sparse_training="true")
  paths, on_indexer, elsewhere = _gradient_norms(sparse, batch, "kl")
  assert not all("indexer" in p for p in paths) and on_indexer > 0 and elsewhere == 0
  _, on_indexer, elsewhere = _gradient_norms(sparse, batch, "lm")
  assert on_indexer == 0 and elsewhere > 0


def test_671b_counts():
  """deepseek3.2-671b: 671B parameters with 37B active per token (the report's figures; active without the embedding), MTP module aside."""
  from maxtext import counting

  config = load([str(REPO / "configs" / "base.yml"), "model_name=deepseek3.2-671b", "mtp_num_layers=0", "override_model_config=true"], env={}, num_devices=1)
  total, active = counting.param_count(config), counting.param_count(config, include_embedding=False, active_only=True)
  assert abs(total / 671e9 - 1) < 0.015 and abs(active / 37e9 - 1) < 0.015, (total, active)


def test_config_rules():
  base = str(REPO / "configs" / "base.yml")
  with pytest.raises(ConfigError, match="use_indexer=true, but decoder_block=deepseek has no sparse attention layers"):
    load([base, "model_name=deepseek3-tiny", "override_model_config=true", "use_indexer=true"], env={}, num_devices=1)
  with pytest.raises(ConfigError, match="set use_indexer=true"):
    load([base, "model_name=deepseek3-tiny", "override_model_config=true", "decoder_block=deepseek_v32"], env={}, num_devices=1)
  with pytest.raises(ConfigError, match="indexer projects MLA's query latent; set q_lora_rank > 0"):
    load(
      [base, "model_name=deepseek3-tiny", "override_model_config=true", "decoder_block=deepseek_v32", "use_indexer=true", "q_lora_rank=0"],
      env={},
      num_devices=1,
    )
  with pytest.raises(ConfigError, match="mlp_layer_types must be first_k_dense_replace=1 'dense' then 'sparse'"):
    hf_config.overrides_from_hf({**tiny_config().to_dict(), "mlp_layer_types": ["dense", "sparse", "shared"]})


def test_decode_topk_larger_than_the_context_is_one_line_exit_2(tmp_path):
  run = tmp_path / "run"
  run.mkdir()
  argv = [
    sys.executable,
    "-m",
    "maxtext.decode",
    str(REPO / "configs" / "base.yml"),
    "model_name=deepseek3-tiny",
    "decoder_block=deepseek_v32",
    "override_model_config=true",
  ]
  argv += ["use_indexer=true", "indexer_topk=128", "max_target_length=64", "max_prefill_predict_length=8", "prompt=hi", "run_name=d"]
  proc, before, after = _run_case([*argv, "base_output_directory={tmp}/out"], tmp_path, run, "")
  assert_one_line_exit_2(proc, "indexer_topk=128 is larger than the decode context max_target_length=64")
  assert before == after


def test_unknown_layer_type_is_one_line_exit_2(tmp_path):
  hf = tmp_path / "hf"
  save_tiny(hf)
  cfg = json.loads((hf / "config.json").read_text())
  (hf / "config.json").write_text(json.dumps({**cfg, "layer_types": ["indexed_attention", "sliding_attention", "indexed_attention"]}))
  run = tmp_path / "run"
  run.mkdir()
  proc, before, after = _run_case([*CONVERT, "--hf-dir", "{tmp}/hf"], tmp_path, run, "")
  assert_one_line_exit_2(proc, "layer_types must be 3 x 'indexed_attention'")
  assert before == after and not (tmp_path / "converted").exists()


@pytest.mark.parametrize("sparse_training", [True, False])
def test_blockwise_paths_equal_the_dense_masked_form(monkeypatch, sparse_training):
  """By blocks of 5 queries over 12 tokens (the last block padded), the gather and masked training paths give the
  output, the indexer KL and every gradient of the masked form in one block (the dense masked attention), float32,
  with two documents and padding; in the dense warm-up (sparse_training=False), the blockwise KL."""
  from maxtext import platform
  from maxtext.layers import mla_sparse
  from maxtext.models import mixer_specs

  config = _tiny_train_config(indexer_sparse_training=str(sparse_training).lower(), max_target_length=SEQ)
  spec = mixer_specs.mla_sparse(config)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, SEQ, config.emb_dim)), jnp.float32)
  weights = jnp.asarray(rng.normal(size=(2, SEQ, config.emb_dim)), jnp.float32)
  positions = jnp.asarray(np.stack([np.r_[np.arange(7), np.arange(5)], np.arange(SEQ)]), jnp.int32)
  segments = jnp.asarray(np.stack([np.r_[np.ones(7), 2 * np.ones(5)], np.r_[np.ones(9), np.zeros(3)]]), jnp.int32)

  def run(path: str, block: int):
    monkeypatch.setattr(mla_sparse, "QUERY_BLOCK", block)
    policy = dataclasses.replace(platform.for_platform(config, "cpu"), sparse_attention=path)
    graphdef, state = nnx.split(mla_sparse.SparseMLA(spec, policy=policy, rngs=nnx.Rngs(0)))

    def objective(state, x):
      out, kl = nnx.merge(graphdef, state)(x, positions, segments, 0)
      return jnp.sum(out * weights) + kl, (out, kl)

    (_, (out, kl)), grads = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))(state, x)
    return out, kl, jax.tree.leaves(grads)

  out, kl, grads = run("masked", SEQ)
  assert float(kl) > 0
  for path in ("gather", "masked") if sparse_training else ("gather",):  # the warm-up's paths differ only in the KL's blocks
    got_out, got_kl, got_grads = run(path, 5)
    np.testing.assert_allclose(np.asarray(got_out), np.asarray(out), atol=1e-5, rtol=0, err_msg=path)
    np.testing.assert_allclose(float(got_kl), float(kl), rtol=1e-5, err_msg=path)
    for got, want in zip(got_grads, grads, strict=True):
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-4, err_msg=path)


def test_flops_count_the_top_k_keys_the_gather_path_scores():
  """Sparse training through the gather path scores each query's indexer_topk latent keys; the dense warm-up scores
  every visible key at MLA's width. The step's FLOPs follow the path that runs."""
  from maxtext import counting

  sparse = _tiny_train_config(indexer_sparse_training="true")
  warmup = _tiny_train_config()
  c = sparse
  assert counting._keys(sparse) == [c.indexer_topk] * 2 and counting._keys(warmup) == [c.max_target_length] * 2
  assert counting.attention_width(sparse, "mla_sparse") == (2 * c.kv_lora_rank + c.qk_rope_head_dim) / 2
  assert counting.attention_width(warmup, "mla_sparse") == (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) / 2
  wide = _tiny_train_config(indexer_sparse_training="true", indexer_topk=64)  # every visible key selected
  assert counting._keys(wide) == [c.max_target_length] * 2


def test_flops_count_the_indexer_that_runs_and_no_gradient_it_never_gets():
  """The dense warm-up trains only the indexer, whose inputs are detached: no gradient reaches any other weight or
  the attention scores, so the step costs its forward pass plus the indexer's weight gradients (2 per entry) and its
  scores' backward (twice their forward). Without a KL the indexer gets no gradient at all, only its forward."""
  from maxtext import counting
  from maxtext.layers.mla_sparse import Indexer

  warmup = _tiny_train_config()
  c = warmup
  tokens = c.global_batch_size_to_train_on * c.max_target_length
  model = counting._tree(c).model
  indexer_params = sum(v.size for _, m in counting._modules_of(model, Indexer) for v in counting._params(m))
  layers = c.num_decoder_layers
  scores = 2 * tokens * c.max_target_length * c.indexer_n_heads * c.indexer_head_dim * layers
  # the forward pass also counts the routing bias (a non-trained variable) the training weights leave out
  unused = sum(
    2 * v.size for kind in counting._tree(c).kinds for v in counting._variables(counting._tree(c).layers[kind.structure]) if not isinstance(v, nnx.Param)
  )
  assert indexer_params > 0 and not any(counting._model_flops(c).backward)
  assert counting.training_flops_per_step(c) - counting.forward_flops_per_step(c) == tokens * (2 * indexer_params - unused) + 2 * scores
  no_kl = _tiny_train_config(indexer_sparse_training="true", indexer_loss_scaling_factor=0.0)
  with_kl = _tiny_train_config(indexer_sparse_training="true")
  assert counting.training_flops_per_step(with_kl) - counting.training_flops_per_step(no_kl) == tokens * 2 * indexer_params + 2 * scores
