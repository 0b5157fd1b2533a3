"""Toy AOT measurement: how far a TPU executable's reported temporaries exceed its buffer-assignment heap.

    python benchmarks/tpu_scan_temporaries.py --topology v5p-8 --layers 32 --tokens 4096 --width 4096

Compiles (no TPU needed; libtpu required) `layers` float32 [width, width] layers applied to [tokens, width]
bfloat16 activations, under `jax.checkpoint`, donated, in four forms: `scan` (w - 0.1 * grad, the layers in
a scan), `grad` (the scan's gradients returned as outputs), `unroll` (w - 0.1 * grad, layers unrolled) and
`offload` (`scan` with each layer's input named and offloaded to pinned host memory, as
decoder_layer_input=offload does), and `manual` (`scan` with a hand-written backward: a custom_vjp whose forward scan
keeps each layer's input and whose backward is a reverse scan recomputing each layer with jax.vjp). Prints each form's reported temporaries, the preallocated-temp heap from
XLA's buffer dump, the excess, and the host temporaries.
Set LIBTPU_INIT_ARGS to try compiler flags.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile


def heap_bytes(dump_dir: str, name: str) -> int:
  """Sum of the preallocated-temp allocations in XLA's buffer assignment dump of module jit_<name>."""
  (path,) = glob.glob(os.path.join(dump_dir, f"*.jit_{name}.*after_optimizations-buffer-assignment.txt"))
  with open(path) as f:
    return sum(int(re.search(r"size (\d+)", line).group(1)) for line in f if line.startswith("allocation") and "preallocated-temp" in line)


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--topology", default="v5p-8")
  parser.add_argument("--layers", type=int, default=32)
  parser.add_argument("--tokens", type=int, default=4096)
  parser.add_argument("--width", type=int, default=4096)
  args = parser.parse_args(argv)
  os.environ["JAX_PLATFORMS"] = "cpu"
  dump = tempfile.mkdtemp(prefix="scan_temps_")
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}"  # read when jax starts

  import jax
  import jax.numpy as jnp
  from jax.ad_checkpoint import checkpoint_name

  from maxtext import topology
  from maxtext.aot.devices import topology_devices

  device = topology_devices(topology.parse(args.topology))[0]
  sharding = jax.sharding.SingleDeviceSharding(device)

  offload_input = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[], names_which_can_be_offloaded=["input"], offload_src="device", offload_dst="pinned_host"
  )

  def body(h, w):
    h = checkpoint_name(h, "input")
    return jnp.tanh(h @ w.astype(jnp.bfloat16)), None

  def loss(ws, x, unroll, policy=None):
    h = x.astype(jnp.bfloat16)
    if unroll:
      for i in range(args.layers):
        h = jax.checkpoint(body)(h, ws[i])[0]
    else:
      h = jax.lax.scan(jax.checkpoint(body, policy=policy), h, ws)[0]
    return h.astype(jnp.float32).sum()

  @jax.custom_vjp
  def stack(ws, h):
    return jax.lax.scan(body, h, ws)[0]

  def stack_fwd(ws, h):
    def step(h, w):
      return body(h, w)[0], h  # keep each layer's input

    out, inputs = jax.lax.scan(step, h, ws)
    return out, (ws, inputs)

  def stack_bwd(residuals, g):
    ws, inputs = residuals

    def step(g, xs):  # recompute one layer from its saved input, in reverse
      w, h = xs
      _, vjp = jax.vjp(lambda w, h: body(h, w)[0], w, h)
      dw, dh = vjp(g)
      return dh, dw

    dh, dws = jax.lax.scan(step, g, (ws, inputs), reverse=True)
    return dws, dh

  stack.defvjp(stack_fwd, stack_bwd)

  def manual_loss(ws, x):
    return stack(ws, x.astype(jnp.bfloat16)).astype(jnp.float32).sum()

  def scan(ws, x):
    return ws - 0.1 * jax.grad(loss)(ws, x, False)

  def manual(ws, x):
    return ws - 0.1 * jax.grad(manual_loss)(ws, x)

  def grad(ws, x):
    return jax.grad(loss)(ws, x, False)

  def unroll(ws, x):
    return ws - 0.1 * jax.grad(loss)(ws, x, True)

  def offload(ws, x):
    return ws - 0.1 * jax.grad(loss)(ws, x, False, offload_input)

  shapes = (
    jax.ShapeDtypeStruct((args.layers, args.width, args.width), jnp.float32, sharding=sharding),
    jax.ShapeDtypeStruct((args.tokens, args.width), jnp.float32, sharding=sharding),
  )
  saved = args.layers * args.tokens * args.width * 2
  print(f"{args.topology}: {args.layers} layers, saved-input stack {saved / 1e9:.3f} GB")
  for fn in (scan, grad, unroll, offload, manual):
    name = fn.__name__
    memory = jax.jit(fn, donate_argnums=0).lower(*shapes).compile().memory_analysis()
    temp, heap = memory.temp_size_in_bytes, heap_bytes(dump, name)
    print(
      f"  {name:7s} temporaries {temp / 1e9:.3f} GB  heap {heap / 1e9:.3f} GB  excess {(temp - heap) / 1e9:.3f} GB"
      f"  host {memory.host_temp_size_in_bytes / 1e9:.3f} GB"
    )


if __name__ == "__main__":
  main(sys.argv[1:])
