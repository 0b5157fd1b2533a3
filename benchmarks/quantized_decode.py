"""Greedy decoding with quantized weights (and KV cache) against the float model, on a trained checkpoint:
`python benchmarks/quantized_decode.py [--variants int8,int8+kv8,...] [--tokens N] <config.yml> key=value ...` prints
one JSON line per variant.

The config names the checkpoint (the run's own, load_parameters_path or hf_model_path) and is decoded as given
(the reference, normally dtype=bfloat16 without quantization), then once per variant: int8 (weights int8, products
w8a8), int4w (weights int4, bf16 products), fp8, each optionally with '+kv8' or '+kv4' (an int8 / int4 KV cache). Every
variant's weights are quantized on load, as `python -m maxtext.decode` does. The prompts are PROMPTS, each continued
greedily for --tokens tokens, all in one batch.

Variants that measure, rather than serve: 'int8w' (the int8 kernels with the activations kept in the compute dtype:
the weights' share of int8's error), and the noise floor of harmless perturbations, 'float32' (the reference config
in float32) and 'unbatched' (the reference config, each prompt decoded in a batch of its own).

Reported per variant: free-running agreement (the share of generated positions whose token equals the reference's;
after a first difference the continuations may part for good), teacher-forced agreement (the share of positions
where the variant's next-token argmax, given the reference's own continuation as context, equals the reference's
token; a full forward pass, so no KV cache), the logits' error at those positions (RMS of the difference over the
reference logits' standard deviation), the first position where they part, and the weight and KV cache bytes against
the reference's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

PROMPTS = (
  "The for statement",
  "A function definition",
  "The import statement",
  "Exceptions are",
  "The with statement",
  "Class definitions",
  "An assignment statement",
  "The return statement",
)
VARIANTS = {
  "int8": {"quantization": "int8"},
  "int8w": {"quantization": "int8"},  # activations unquantized (weight_only below)
  "int4w": {"quantization": "int4w"},
  "fp8": {"quantization": "fp8"},
  "float32": {"dtype": "float32", "weight_dtype": "float32"},
  "unbatched": {},  # decoded one prompt per batch (below)
}
WEIGHT_ONLY = ("int8w",)
CACHES = {"kv8": {"quantize_kvcache": True, "kv_quant_dtype": "int8"}, "kv4": {"quantize_kvcache": True, "kv_quant_dtype": "int4"}}


def variant_updates(name: str) -> dict:
  weights, _, cache = name.partition("+")
  return {**VARIANTS.get(weights, {}), **CACHES.get(cache, {})}


def main(argv: list[str]) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--variants", default="float32,unbatched,int8,int8w,int8+kv8,int8+kv4,int4w,fp8", help="comma-separated")
  parser.add_argument("--tokens", type=int, default=64, help="tokens generated per prompt")
  parser.add_argument("config", nargs="+", help="<config.yml> key=value ...")
  args = parser.parse_args(argv)

  import jax
  import numpy as np
  from flax import nnx

  from maxtext import mesh as mesh_lib
  from maxtext.config import load
  from maxtext.inference import cache_layout
  from maxtext.inference.generate import Generator
  from maxtext.inference.loading import load_decode_tokenizer, load_model, serving_policy
  from maxtext.layers.dtypes import bits
  from maxtext.process import prepare

  reference_config = load(args.config, devices=prepare)
  mesh = mesh_lib.create(reference_config)
  tokenizer = load_decode_tokenizer(reference_config)
  bos = [tokenizer.bos_id] if reference_config.add_bos and tokenizer.bos_id is not None else []
  prompts = [bos + tokenizer.encode(p) for p in PROMPTS]
  length = max(len(p) for p in prompts) + args.tokens

  def run(config, weight_only=False, unbatched=False):
    policy = serving_policy(config, mesh)
    if weight_only:
      policy = dataclasses.replace(policy, quantization=dataclasses.replace(policy.quantization, activation=None))
    model = load_model(config, mesh, log=lambda _: None, policy=policy)
    gen = Generator(model, config=config, max_target_length=length, max_prefill_length=max(len(p) for p in prompts), mesh=mesh)
    batches = [[p] for p in prompts] if unbatched else [prompts]
    tokens = [t[: args.tokens] for batch in batches for t in gen.generate(batch).tokens]
    weight_bytes = sum(x.size * bits(x.dtype) // 8 for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    kv_bytes = cache_layout.nbytes(cache_layout.abstract(config, len(prompts), gen.layout))[0]
    graphdef, state = nnx.split(model)
    logits = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    return tokens, weight_bytes, kv_bytes, lambda rows: np.asarray(jax.device_get(logits(state, rows)))

  ref_tokens, ref_weights, ref_kv, ref_logits = run(reference_config)
  # The reference's own continuations, as one padded batch: row i = prompt i + its generated tokens.
  width = max(len(p) + len(t) for p, t in zip(prompts, ref_tokens))
  rows = np.zeros((len(prompts), width), np.int32)
  for i, (p, t) in enumerate(zip(prompts, ref_tokens)):
    rows[i, : len(p) + len(t)] = p + t
  reference = ref_logits(rows).astype(np.float64)
  forced_at = [(i, len(p) - 1 + j) for i, p in enumerate(prompts) for j in range(len(ref_tokens[i]))]
  ref_forced = np.stack([reference[i, k] for i, k in forced_at])
  out = []
  for name in args.variants.split(","):
    config = reference_config.model_copy(update=variant_updates(name))
    tokens, weights, kv, logits = run(config, weight_only=name.partition("+")[0] in WEIGHT_ONLY, unbatched=name == "unbatched")
    variant_logits = logits(rows)
    predicted = variant_logits.argmax(-1)
    got_forced = np.stack([variant_logits[i, k] for i, k in forced_at]).astype(np.float64)
    same = positions = forced = 0
    first = []
    for i, (p, ref, got) in enumerate(zip(prompts, ref_tokens, tokens)):
      n = min(len(ref), len(got))
      matches = [a == b for a, b in zip(ref, got)]
      same += sum(matches)
      positions += max(len(ref), len(got))
      first.append(next((j for j, m in enumerate(matches) if not m), n))
      forced += sum(int(predicted[i, len(p) - 1 + j] == ref[j]) for j in range(len(ref)))
    row = {
      "variant": name,
      "reference": f"{reference_config.dtype}, quantization='{reference_config.quantization}'",
      "prompts": len(prompts),
      "tokens_per_prompt": args.tokens,
      "free_running_agreement": round(same / positions, 4),
      "teacher_forced_agreement": round(forced / sum(len(t) for t in ref_tokens), 4),
      "logit_rms_error": round(float(np.sqrt(np.mean((got_forced - ref_forced) ** 2)) / ref_forced.std()), 5),
      "first_difference_per_prompt": first,
      "weight_bytes": weights,
      "weight_bytes_vs_reference": round(weights / ref_weights, 4),
      "kv_cache_bytes": kv,
      "kv_cache_bytes_vs_reference": round(kv / ref_kv, 4),
    }
    print(json.dumps(row), flush=True)
    out.append(row)
  return out


if __name__ == "__main__":
  main(sys.argv[1:])
