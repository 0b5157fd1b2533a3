"""train_compile for a TPU topology from this CPU host lowers splash attention, and it saves memory over XLA attention."""

import importlib.util

import pytest

from maxtext.config import from_overrides

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed (pip install 'maxtext[tpu]')")

MODEL = dict(
  compile_topology="v5p-8",
  base_emb_dim=128,
  base_mlp_dim=256,
  base_num_query_heads=4,
  base_num_kv_heads=2,
  head_dim=128,
  base_num_decoder_layers=1,
  vocab_size=512,
  per_device_batch_size=1,
  max_target_length=2048,
)


def test_splash_lowers_for_v5p_and_shrinks_temporaries():
  from maxtext.aot.compile import compile_for_topology

  fused = compile_for_topology(from_overrides(attention="flash", **MODEL))
  xla = compile_for_topology(from_overrides(attention="dot_product", **MODEL))
  assert "tpu_custom_call" in fused.compiled.as_text() and "tpu_custom_call" not in xla.compiled.as_text()
  # [B, H, S, S] float32 scores (16 MiB a layer here) are what the fused kernel never materialises
  assert fused.memory.temp_bytes < xla.memory.temp_bytes / 2


def test_layer_inputs_leave_hbm_for_host_memory_on_tpu_when_the_step_needs_it():
  """decoder_layer_input=auto on TPU, when the step does not fit with the inputs in HBM, compiles it again with each
  scanned layer's saved input in pinned host memory: the host temporaries are exactly the [layers, B, S, E] bfloat16
  stack, and the device's total falls (by nearly the stack under libtpu 0.0.42.1, whose loop mirrors it; by about a third
  of it under 0.0.52 at this tiny size). (Which candidate fits is tests/test_attention_kernels.py's.)"""
  from maxtext.aot import remat_auto
  from maxtext.aot.compile import topology_mesh
  from maxtext.train import setup as setup_lib

  auto = from_overrides(**{**MODEL, "base_num_decoder_layers": 4, "base_emb_dim": 512, "max_target_length": 1024})
  lines = []
  resolved, choice = remat_auto.resolve(auto, topology_mesh(auto), setup_lib.build, 1, lines.append)  # 1 byte: the inputs go to the host
  assert (resolved.remat_policy, resolved.decoder_layer_input, choice.fits) == ("full", "offload", False)
  stack = 4 * 1 * 1024 * 512 * 2
  offload = choice.step.memory  # the chosen candidate's compile, handed on
  assert offload.host_temp_bytes == stack and "host temporaries" in offload.lines()[0]
  assert choice.tried[("full", "device")] > choice.tried[("full", "offload")] + 0.25 * stack
  assert "decoder_layer_input=auto chose remat_policy=full with each layer's saved input in pinned host memory" in lines[0]


def test_scanned_weights_are_cast_inside_the_layer_loop():
  """No bfloat16 copy of a whole stacked float32 weight is made outside the layer scan (remat.tied_to_carry)."""
  import re

  from maxtext.aot.compile import compile_for_topology

  text = compile_for_topology(from_overrides(**{**MODEL, "base_num_decoder_layers": 4, "max_target_length": 256})).compiled.as_text()
  entry = text[text.index("\nENTRY ") + 1 :].splitlines()
  stacked = set(re.findall(r"param\.\d+: f32\[(4(?:,\d+){2,})\]", entry[0]))
  assert len(stacked) >= 4, entry[0]  # the stacked attention and MLP kernels [layers, ...]
  shapes = "|".join(re.escape(shape) for shape in stacked)
  copies = [line.strip()[:120] for line in entry[1:] if re.search(rf"= bf16\[(?:{shapes})\]", line)]
  assert not copies, copies


def test_summed_output_kernel_gradient_is_sliced_once():
  """The whole [emb, vocab] float32 sum of the output-kernel gradient feeds only the slice that keeps this device's
  shard, so it dies at once; without train.step's barrier XLA fuses the slice into the gradient norm and the update
  and keeps the whole sum alive until the update (2.1 GB per device for llama3.1-8b on v5p-8)."""
  import re

  from maxtext.aot.compile import compile_for_topology

  real_head = dict(base_emb_dim=4096, base_mlp_dim=256, vocab_size=128256, max_target_length=256)  # smaller heads fuse differently
  text = compile_for_topology(from_overrides(**{**MODEL, **real_head})).compiled.as_text()
  entry = text[text.index("\nENTRY ") + 1 :].split("\n}\n")[0].splitlines()
  sums = [m.group(1) for line in entry if (m := re.search(r"(%all-reduce[.\d]*) = f32\[4096,128256\]", line))]
  users = {name: [line.strip()[:100] for line in entry if re.search(re.escape(name) + r"[,)]", line)] for name in sums}
  assert all(len(u) == 1 and "= f32[1024,128256]" in u[0] for u in users.values()), users


def test_state_layouts_are_the_compilers_so_stacked_kernels_are_not_relaid_every_step():
  """On TPU the train state takes the device layouts XLA picks (platform policy compiler_state_layouts): the
  stacked query kernel is stored the way its per-layer all-gather reads it, so the step makes no float32
  relayout copy of it (for llama3.1-8b on v5p-8 those copies of the attention kernels were 1.34 GB per device)."""
  import dataclasses
  import re

  import jax

  from maxtext import platform, topology
  from maxtext.aot.compile import topology_mesh
  from maxtext.aot.memory import compile_step
  from maxtext.train import setup as setup_lib
  from maxtext.train import state as state_lib

  config = from_overrides(**{**MODEL, "base_emb_dim": 1024, "base_num_query_heads": 8, "base_num_decoder_layers": 4, "max_target_length": 256})
  mesh = topology_mesh(config)
  tpu = platform.resolve(config, mesh)
  assert tpu.platform == "tpu" and tpu.compiler_state_layouts  # the TPU policy's default

  def compiled(layouts_by_compiler):
    with jax.set_mesh(mesh):
      policy = dataclasses.replace(tpu, compiler_state_layouts=layouts_by_compiler, offload_layer_inputs=False)  # this one change alone
      setup = setup_lib.build(config, mesh, policy=policy)
      step = compile_step(setup, topology.parse(config.compile_topology).chip.hbm_bytes)
      return step.compiled, step.memory

  def relayout_copies(step):
    text = step.as_text()
    entry = text[text.index("\nENTRY ") + 1 :].split("\n}\n")[0].splitlines()
    return [line.strip()[:90] for line in entry if re.search(r"= f32\[4,[\d,]+\]\{[^}]*\} copy\(%param", line)]

  (default, default_memory), (chosen, chosen_memory) = compiled(False), compiled(True)
  assert relayout_copies(default) and not relayout_copies(chosen), (relayout_copies(default), relayout_copies(chosen))
  assert chosen_memory.temp_bytes < default_memory.temp_bytes
  query = state_lib.compiled_formats(chosen)["params"]["layers"]["attention"]["query"]["kernel"]
  query = query.get_value() if hasattr(query, "get_value") else query  # an nnx.Variable holding the Format
  assert query.layout.major_to_minor != (0, 1, 2, 3)


def test_final_soft_cap_keeps_no_second_copy_of_the_logits():
  """With a final logit soft cap the fused loss keeps only the raw (bfloat16) logits: the float32 capped ones are
  recomputed, and their logsumexp needs no max pass, which made XLA write a second [tokens, vocab] float32 array
  (7.8 GiB per device for gemma2-27b at batch 2 x 4096 on v5p-32; benchmarks/README.md)."""
  from maxtext.aot.compile import compile_for_topology

  head = dict(vocab_size=16384, max_target_length=512, logits_via_embedding=True)
  logits_bytes = 1 * 512 * 16384 * 4
  capped, plain = (compile_for_topology(from_overrides(**{**MODEL, **head}, final_logits_soft_cap=cap)).memory.temp_bytes for cap in (30.0, 0.0))
  assert capped < plain + logits_bytes / 2, (capped, plain)
