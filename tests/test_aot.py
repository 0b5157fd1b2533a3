"""AOT compilation of the train step for TPU topologies on this CPU host (needs libtpu), and its report."""

import importlib.util
import json

import pytest

from maxtext import topology, train_compile
from maxtext.aot import memory
from maxtext.config import ConfigError, from_overrides

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed (pip install 'maxtext[tpu]')")

TINY = dict(
  base_emb_dim=64,
  base_mlp_dim=128,
  base_num_query_heads=4,
  base_num_kv_heads=2,
  head_dim=16,
  base_num_decoder_layers=2,
  vocab_size=512,
  per_device_batch_size=1,
  max_target_length=64,
)
TINY_ARGS = [f"{k}={v}" for k, v in TINY.items()]
FIELDS = {
  "compile_seconds",
  "argument_bytes",
  "output_bytes",
  "temp_bytes",
  "host_temp_bytes",
  "host_argument_bytes",
  "total_bytes",
  "hbm_bytes",
  "fits",
  "tflops_per_step",
  "remat_policy",
  "decoder_layer_input",
  "params_bytes",
  "opt_state_bytes",
  "quantized_kernel_bytes",
  "int8_products",
}


@pytest.mark.parametrize("name, slices", [("v5e-4", 1), ("v5p-8", 1), ("v6e-8", 1), ("v5p-8", 2)])
def test_small_model_compiles_for_topology(name, slices):
  from maxtext.aot.compile import compile_for_topology

  config = from_overrides(compile_topology=name, compile_topology_num_slices=slices, **TINY)
  result = compile_for_topology(config)
  topo = topology.parse(name)
  assert len(result.devices) == topo.chips * slices and result.devices[0].platform == "tpu"
  s = result.summary()
  assert set(s) == FIELDS and s["fits"] is True and s["hbm_bytes"] == topo.chip.hbm_bytes
  assert s["total_bytes"] == s["argument_bytes"] + s["output_bytes"] - result.memory.alias_bytes + s["temp_bytes"] > 0
  assert result.memory.alias_bytes > 0  # the state is donated
  assert s["tflops_per_step"] > 0
  if slices > 1:
    hlo = result.compiled.as_text()
    assert "all-reduce" in hlo  # gradients are summed over the dcn data axis


def run_cli(args, capsys):
  code = 0
  try:
    train_compile.main(["configs/base.yml", *args])
  except SystemExit as e:
    code = e.code
  out, err = capsys.readouterr()
  return code, out, err


def test_optimizer_state_in_host_memory_leaves_the_device_arguments():
  """optimizer_memory_host_offload on a TPU topology: the optimizer state is a host argument of the compiled step,
  so the device's arguments shrink by exactly what the host's grow (its size, tiled), and the report says where it is."""
  from maxtext.aot.compile import compile_for_topology

  on_device, on_host = (compile_for_topology(from_overrides(compile_topology="v5p-8", optimizer_memory_host_offload=off, **TINY)) for off in (False, True))
  moved = on_host.memory.host_argument_bytes
  assert moved >= on_host.state_bytes["opt_state"] > 0 and on_device.memory.host_argument_bytes == 0
  assert on_host.memory.argument_bytes == on_device.memory.argument_bytes - moved
  assert "host arguments" in on_host.memory.lines()[0] and "in pinned host memory" in on_host.state_line(on_host.config)


def test_cli_prints_report_and_json_last_line(capsys):
  code, out, err = run_cli(["compile_topology=v5e-4", *TINY_ARGS], capsys)
  assert code == 0, err
  lines = out.strip().splitlines()
  report = json.loads(lines[-1])
  assert set(report) == FIELDS and report["fits"] is True
  assert any(line.startswith("compiled in ") and "TFLOPs per step" in line for line in lines)
  assert any("GiB HBM: fits" in line for line in lines)


def test_too_big_exits_3_with_one_line(capsys):
  big = {**TINY, "vocab_size": 32000, "per_device_batch_size": 64, "max_target_length": 8192}  # 130 GiB of logits per device
  big["decoder_layer_input"] = "device"  # one compile: offloading the layer inputs could not save that much
  code, out, err = run_cli(["compile_topology=v5e-4", *(f"{k}={v}" for k, v in big.items())], capsys)
  assert code == 3
  assert json.loads(out.strip().splitlines()[-1])["fits"] is False
  (line,) = err.strip().splitlines()
  assert line.startswith("error: does not fit: needs ") and ", v5e has 16.00 GiB" in line and "largest:" in line


def test_unknown_topology_exits_2_listing_names(capsys):
  code, out, err = run_cli(["compile_topology=v5p-7", *TINY_ARGS], capsys)
  assert code == 2
  (line,) = err.strip().splitlines()
  assert line.startswith("error: unknown compile_topology 'v5p-7'; valid names: v4-8") and "v6e-256" in line


def test_missing_topology_is_an_error():
  from maxtext.aot.compile import topology_mesh

  with pytest.raises(ConfigError, match="compile_topology is not set"):
    topology_mesh(from_overrides(num_devices=8))


@pytest.mark.parametrize(
  "message, need_gib, largest",
  [
    (
      "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (35.00G) exceeds available HBM (15.75G).",
      37.0,
      "HLO temporaries 35.00 GiB",
    ),
    (
      "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 120.50G of 95.74G hbm. "
      'Exceeded hbm capacity by 24.76G.\n\nLargest program allocations in hbm:\n\n  1. Size: 64.00G\n     Operator: op_name="jit(step)/dot_general"\n',
      120.5,
      'op_name="jit(step)/dot_general" 64.00 GiB',
    ),
    ("RESOURCE_EXHAUSTED: something else", None, ""),
  ],
)
def test_out_of_memory_messages(message, need_gib, largest):
  err = RuntimeError(message)
  assert memory.is_out_of_memory(err)
  r = memory.from_oom_error(err, argument_bytes=2 * memory.GIB, hbm_bytes=95 * memory.GIB)
  assert not r.fits and r.largest == largest
  line = r.does_not_fit_message("v5p")
  assert line.startswith("does not fit: needs ") and ", v5p has 95.00 GiB" in line
  if need_gib is not None:
    assert r.total_bytes == pytest.approx(need_gib * memory.GIB, rel=1e-3)
  else:
    assert "needs more than 95.00 GiB" in line


def test_mla_decode_step_compiles_for_topology_with_its_compressed_cache():
  """maxtext.decode_compile's core: one decode step of a tiny MLA model for v5p-8, the latent cache sharded over the batch
  and donated; its per-device bytes are the formula's batch share."""
  from maxtext.aot.decode import compile_decode_step
  from maxtext.inference import cache_layout

  mla = dict(decoder_block="deepseek", kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, q_lora_rank=0)
  config = from_overrides(compile_topology="v5p-8", **{**TINY, **mla, "max_target_length": 128, "max_prefill_predict_length": 64})
  result = compile_decode_step(config)
  assert result.batch == 4 and result.memory.fits and result.memory.alias_bytes >= result.cache_bytes_per_device
  total = cache_layout.theoretical_bytes(config, 4, cache_layout.layout(config))
  assert total == 4 * config.num_decoder_layers * 128 * (config.kv_lora_rank + config.qk_rope_head_dim) * 2
  assert result.cache_bytes_per_device == total // 4 + 4  # one row per device, plus its length
  assert "per-head keys and values (mla_naive_kvcache=true) would take" in result.cache_line
