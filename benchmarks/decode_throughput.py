"""Decode throughput: `python benchmarks/decode_throughput.py <config.yml> key=value ...` prints one JSON line per batch size.

For each batch size (--batches, default 1 and 32) it compiles the prefill and the on-device decode loop once,
then reports prefill tokens/s (prompts of max_prefill_predict_length tokens), the median time of one jitted
decode step (`Generator.step`, the cache donated) and decode tokens/s from it, the same from the on-device
loop, the KV cache's bytes against batch x sum over layers (slots x values per slot x bytes): 2 x kv_heads x
head_dim per slot, or for MLA's compressed cache kv_lora_rank + qk_rope_head_dim (printed beside the naive
per-head size), and whether the decode step ever compiled more than once. The batch-1 step is compared with the
weight-streaming bound: parameter bytes / this host's measured streaming bandwidth (step_profile.py's probe).
Parameters are a random init of the config's model (the speed does not depend on their values); with
`quantization` its kernels are stored quantized, as `python -m maxtext.decode` holds them.

--baseline also builds the same model with quantization off and an unquantized KV cache (dtype as configured) and
times the two decode steps interleaved (one step of each, repeated): the row then adds the baseline's cache bytes,
step time and tokens/s and the ratios (quantized / baseline), which noise on a shared host affects alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def median_seconds(fn, *args, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


class Stepper:
  """One generator's decode steps from a prefilled cache, each timed until its logits are ready."""

  def __init__(self, gen, tokens: np.ndarray, lengths: np.ndarray):
    prefill, _ = gen._executables_for(tokens, lengths)
    self.gen = gen
    self.cache, logits = prefill(gen.state, tokens, lengths, None, None)
    self.next_tokens = jnp.argmax(logits, -1).astype(jnp.int32)
    self.cache, logits = gen.step(gen.state, self.cache, self.next_tokens)  # compiles the step for this batch size
    logits.block_until_ready()
    self.times: list[float] = []

  def step(self) -> None:
    start = time.perf_counter()
    self.cache, logits = self.gen.step(self.gen.state, self.cache, self.next_tokens)
    logits.block_until_ready()
    self.times.append(time.perf_counter() - start)

  def profile(self, steps: int) -> dict:
    """benchmarks/top_ops.py's profile of `steps` more decode steps (not added to the timings)."""
    import top_ops

    try:
      hlo = self.gen.step.lower(self.gen.state, self.cache, self.next_tokens).compile().as_text()
    except Exception:  # noqa: BLE001 - the ops' shapes are a nicety; the profile stands without them
      hlo = ""
    count = len(self.times)
    result = top_ops.safe_profile(self.step, steps, hlo=hlo)
    del self.times[count:]
    return result


def main(argv: list[str]) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
  parser.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size")
  parser.add_argument("--unstack", action="store_true", help="decode with the stacked layers split per layer (maxtext.inference.unstack)")
  parser.add_argument("--baseline", action="store_true", help="also time the model with quantization off and an unquantized cache, interleaved")
  parser.add_argument("--profile_batches", type=int, nargs="*", default=[], help="trace decode steps of these batch sizes: top ops by device time")
  parser.add_argument("config", nargs="+", help="<config.yml> key=value ...")
  args = parser.parse_args(argv)

  from maxtext.config import load
  from maxtext.process import prepare

  config = load(args.config, devices=prepare)
  return measure(config, args.batches, args.steps, unstack=args.unstack, baseline=args.baseline, profile_batches=tuple(args.profile_batches))


def measure(
  config,
  batches: list[int],
  steps: int,
  unstack: bool = False,
  baseline: bool = False,
  print_rows: bool = True,
  stream_megabytes: int = 256,
  profile_batches: tuple[int, ...] = (),
  profile_steps: int = 10,
) -> list[dict]:
  """The rows of the module docstring for config (random parameters), one per batch size; printed as JSON lines
  (the cache layout line on stderr first) unless print_rows is False. stream_megabytes: the bandwidth probe's array.
  profile_batches: for these batch sizes also trace profile_steps decode steps and add "top_ops" (benchmarks/top_ops.py)."""
  from step_profile import stream_gb_per_s

  from maxtext import mesh as mesh_lib
  from maxtext import models
  from maxtext.inference import cache_layout
  from maxtext.inference.generate import Generator
  from maxtext.inference.loading import serving_policy
  from maxtext.inference.unstack import unstack_layers
  from maxtext.layers.dtypes import bits

  mesh = mesh_lib.create(config)

  def generator(config):
    model = models.create_sharded(config, mesh, policy=serving_policy(config, mesh))
    param_bytes = sum(x.size * bits(x.dtype) // 8 for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return Generator(unstack_layers(model) if unstack else model, config=config, mesh=mesh), param_bytes

  gen, param_bytes = generator(config)
  base_config = config.model_copy(update={"quantization": "", "quantize_kvcache": False, "quantize_logits_proj": False})
  base_gen, base_param_bytes = generator(base_config) if baseline else (None, 0)
  bandwidth = stream_gb_per_s(stream_megabytes)
  bound_s = param_bytes / (bandwidth * 1e9)
  if print_rows:
    print(cache_layout.describe(config, batches[0], gen.layout), file=sys.stderr)
  prompt_length = config.max_prefill_predict_length
  rows = []
  rng = np.random.default_rng(0)
  for batch in batches:
    prompts = rng.integers(0, config.vocab_size, size=(batch, prompt_length)).tolist()
    compile_s = gen.compile(batch, prompt_length)
    if base_gen:
      base_gen.compile(batch, prompt_length)
    tokens, lengths = gen.pad(prompts)
    prefill, _ = gen._executables_for(tokens, lengths)
    with jax.set_mesh(mesh):
      prefill_s = median_seconds(prefill, gen.state, tokens, lengths, None, None, repeats=5)
      runs = [Stepper(gen, tokens, lengths)] + ([Stepper(base_gen, tokens, lengths)] if base_gen else [])
      compiles = gen.step._cache_size()
      for _ in range(steps):
        for run in runs:  # interleaved: both models see the same moments of a shared host
          run.step()
      times, step_s = runs[0].times, statistics.median(runs[0].times)
      kv_bytes, length_bytes = cache_layout.nbytes(runs[0].cache)
      top = runs[0].profile(profile_steps) if batch in profile_batches else None
    result = gen.generate(prompts)  # the on-device loop: prompt_length + generated = max_target_length per row
    loop_steps = result.decode_tokens / batch
    row = {
      "batch": batch,
      "prompt_tokens": prompt_length,
      "max_target_length": config.max_target_length,
      "compile_s": round(compile_s, 2),
      "prefill_s": round(prefill_s, 4),
      "prefill_tokens_per_s": round(batch * prompt_length / prefill_s, 1),
      "decode_step_s": round(step_s, 5),
      "decode_step_min_s": round(min(times), 5),
      "decode_tokens_per_s": round(batch / step_s, 1),
      "loop_step_s": round(result.decode_seconds / loop_steps, 5),
      "loop_decode_tokens_per_s": round(result.decode_tokens / result.decode_seconds, 1),
      "kv_cache_bytes": kv_bytes,
      "kv_cache_theoretical_bytes": cache_layout.theoretical_bytes(config, tokens.shape[0], gen.layout),
      "kv_cache_form": gen.layout.form,
      "kv_cache_naive_bytes": cache_layout.theoretical_bytes(config, tokens.shape[0], gen.layout, "mla_naive") if gen.layout.form == "mla_latent" else None,
      "cache_lengths_bytes": length_bytes,
      "decode_step_recompiles": gen.step._cache_size() - compiles,
      "scan_layers": config.scan_layers and not unstack,
      "param_bytes": param_bytes,
      "stream_gb_per_s": round(bandwidth, 2),
      "weight_streaming_bound_s": round(bound_s, 5),
      "step_over_bound": round(step_s / bound_s, 2),
      "min_step_over_bound": round(min(times) / bound_s, 2),
      "device": jax.devices()[0].device_kind,
      "quantization": config.quantization,
      "kv_cache": f"{config.kv_quant_dtype} ({config.kv_quant_axis})" if config.quantize_kvcache else config.dtype,
    }
    if top is not None:
      row["top_ops"] = top
    if base_gen:
      base = runs[1]
      base_step_s = statistics.median(base.times)
      base_kv = cache_layout.nbytes(base.cache)[0]
      row.update(
        baseline_param_bytes=base_param_bytes,
        baseline_kv_cache_bytes=base_kv,
        baseline_decode_step_s=round(base_step_s, 5),
        baseline_decode_tokens_per_s=round(batch / base_step_s, 1),
        kv_cache_bytes_vs_baseline=round(kv_bytes / base_kv, 4),
        param_bytes_vs_baseline=round(param_bytes / base_param_bytes, 4),
        decode_speed_vs_baseline=round(base_step_s / step_s, 3),
        decode_speed_vs_baseline_min=round(min(base.times) / min(times), 3),
      )
    if print_rows:
      print(json.dumps(row), flush=True)
    rows.append(row)
  return rows


if __name__ == "__main__":
  main(sys.argv[1:])
