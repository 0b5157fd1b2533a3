"""MaxText command-line compatibility (a key given twice takes the last value, shown by `python -m maxtext.config`),
the validation of float keys in one place, and the MFU yardstick that keeps the best figure seen (issue 43)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from maxtext.config import ConfigError, from_overrides
from maxtext.config import __main__ as explain
from maxtext.config.loader import load_with_sources
from maxtext.config.quantization_checks import calibration_problem
from maxtext.train import perf

BASE = str(Path(__file__).resolve().parents[1] / "configs" / "base.yml")


def test_a_key_given_twice_takes_the_last_value_and_the_source_names_the_earlier_ones():
  """MaxText (OmegaConf) takes the last of repeated keys; scripts append overrides to a base argv and rely on it."""
  config, sources = load_with_sources([BASE, "steps=1", "run_name=a", "steps=5", "lora.lora_rank=4", "steps=7", "lora.lora_rank=8"], env={}, num_devices=1)
  assert config.steps == 7 and config.lora.lora_rank == 8 and config.run_name == "a"
  assert sources["steps"] == "command line (given 3 times, the last wins; earlier: steps=1, steps=5)"
  assert sources["lora.lora_rank"] == "command line (given 2 times, the last wins; earlier: lora.lora_rank=4)"
  assert sources["run_name"] == "command line"


def test_an_overridden_earlier_value_need_not_be_valid_and_the_environment_still_conflicts():
  config, _ = load_with_sources([BASE, "steps=abc", "steps=2"], env={}, num_devices=1)
  assert config.steps == 2  # only the value that counts is validated, as in MaxText
  with pytest.raises(ConfigError, match="set both on the command line and by environment variable M_STEPS"):
    load_with_sources([BASE, "steps=1", "steps=2"], env={"M_STEPS": "3"}, num_devices=1)


def test_explain_output_shows_the_override(capsys, monkeypatch):
  for name in [n for n in os.environ if n.startswith("M_")]:  # the command line alone
    monkeypatch.delenv(name)
  explain.main([BASE, "steps=10", "steps=20"])
  line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("steps "))
  assert line.split("#")[0].split("=")[1].strip() == "20"
  assert line.endswith("# command line (given 2 times, the last wins; earlier: steps=10)")
  explain.main([BASE, "steps=10", "steps=20", "--json"])
  assert json.loads(capsys.readouterr().out)["steps"] == {"value": 20, "source": "command line (given 2 times, the last wins; earlier: steps=10)"}


@pytest.mark.parametrize(
  "key,value",
  [
    ("learning_rate", "inf"),
    ("learning_rate", "-.inf"),
    ("adam_b2", "nan"),
    ("adam_weight_decay", "inf"),
    ("warmup_steps_fraction", "nan"),
    ("gradient_clipping_threshold", "inf"),
    ("skip_step_scaling_factor", "inf"),
    ("z_loss_multiplier", "nan"),
    ("decode_sampling_temperature", "inf"),
    ("final_logits_soft_cap", "inf"),
  ],
)
def test_no_float_key_takes_inf_or_nan(key, value):
  with pytest.raises(ConfigError, match=f"invalid value for '{key}' .*input should be a finite number"):
    load_with_sources([BASE, f"{key}={value}"], env={}, num_devices=1)


def test_adam_eps_must_be_positive():
  with pytest.raises(ConfigError, match="invalid value for 'adam_eps' .*greater than 0"):
    from_overrides(num_devices=1, adam_eps=0.0)
  assert from_overrides(num_devices=1, adam_eps=1e-6).adam_eps == 1e-6


@pytest.mark.parametrize("method", ["absmax", "absmax,0.9", "rms,3", "fixed,2", "fixed,-2,2", "fixed,-1.5e2,1.5e2"])
def test_fp8_calibration_methods_qwix_runs_are_accepted(method):
  assert calibration_problem(method) is None
  assert from_overrides(num_devices=1, quantization="fp8_full", bwd_quantization_calibration_method=method).bwd_quantization_calibration_method == method


@pytest.mark.parametrize(
  "method,problem",
  [
    ("absmax,-3", "not > 0"),
    ("absmax,0", "not > 0"),
    ("rms,inf", "not finite"),
    ("rms", "gives rms 0 factors"),
    ("fixed,5,1", "not a range [-c, c]"),
    ("fixed,-1,2", "not a range [-c, c]"),  # fp8 has no zero point: qwix refuses an asymmetric range mid-run
    ("fixed,0", "not > 0"),
    ("fixed,1e", "not a number"),
    ("minmax", "not a calibration method"),
    ("ABSMAX", "not a calibration method"),
  ],
)
def test_fp8_calibration_methods_that_fail_or_degenerate_are_refused(method, problem):
  assert problem in calibration_problem(method)


def _cached(path: Path) -> dict[str, float]:
  return json.loads(path.read_text())


def test_a_stale_measured_yardstick_is_measured_again_and_raised(tmp_path, monkeypatch):
  """A yardstick cached while the host was busy (0.115) made an idle run report 97% MFU; the idle matmul does 0.142."""
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  cache = tmp_path / "maxtext" / "peak_tflops.json"
  config = from_overrides(num_devices=1)
  perf._write_cache(str(cache), perf.cache_key(), 0.115)
  fresh = []
  monkeypatch.setattr(perf, "fresh_matmul_tflops", lambda fmt="bf16": fresh.append(fmt) or 0.142)
  stick = perf.Yardstick.of(config)
  assert stick.tflops == 0.115 and stick.measured
  assert stick.mfu(0.05) == pytest.approx(0.05 / 0.115) and fresh == [] and stick.take_note() is None  # far below: no measurement
  assert stick.mfu(0.112) == pytest.approx(0.112 / 0.142)  # 97% of the stale figure: measured again, raised
  assert fresh == ["bf16"] and stick.source == "measured bf16 matmul, re-measured"
  note = stick.take_note()
  assert note.startswith("MFU yardstick raised from 0.115 to 0.142 TFLOP/s/device: a step ran at 97% of it") and str(cache) in note
  assert _cached(cache)[perf.cache_key()] == 0.142 and perf.Yardstick.of(config).tflops == 0.142  # the next run starts from it
  assert stick.mfu(0.14) == pytest.approx(0.14 / 0.142) and fresh == ["bf16"]  # measured once per run
  assert stick.mfu(0.15) == 1.0 and stick.tflops == 0.15 and "a train step ran faster" in stick.take_note()
  assert stick.mfu(0.16) == 1.0 and stick.take_note() is None  # each faster step raises it, said once
  assert _cached(cache)[perf.cache_key()] == 0.16


def test_the_cache_keeps_the_best_figure_seen(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  cache = tmp_path / "maxtext" / "peak_tflops.json"
  perf._write_cache(str(cache), "k", 0.142)
  perf._write_cache(str(cache), "k", 0.115)  # a measurement on a busy host does not lower it
  assert _cached(cache) == {"k": 0.142}
  monkeypatch.setattr(perf, "fresh_matmul_tflops", lambda fmt="bf16": 0.09)
  stick = perf.Yardstick(0.142, perf.MEASURED, measured=True, cache=str(cache), key="k", remeasure=lambda: perf.fresh_matmul_tflops())
  assert stick.mfu(0.14) == pytest.approx(0.14 / 0.142) and stick.tflops == 0.142 and stick.take_note() is None  # a slower re-measure changes nothing
  assert _cached(cache) == {"k": 0.142}


def test_a_table_or_configured_peak_is_never_measured(monkeypatch):
  monkeypatch.setattr(perf, "fresh_matmul_tflops", lambda fmt="bf16": pytest.fail("measured"))
  stick = perf.Yardstick.of(from_overrides(num_devices=1, device_peak_tflops=0.1))
  assert stick.source == "config" and stick.mfu(0.095) == pytest.approx(0.95)


def test_an_eval_batch_that_does_not_split_over_the_batch_shards_is_refused():
  """It used to end the run at its first eval with a sharding traceback, after the run had written its directory."""
  with pytest.raises(ConfigError, match=r"eval_per_device_batch_size 0.125 x 8 devices = 1 sequences do not split over the 8 batch shards"):
    from_overrides(num_devices=8, eval_per_device_batch_size=0.125)
  assert from_overrides(num_devices=8, eval_per_device_batch_size=0.25, ici_fsdp_parallelism=2, ici_tensor_parallelism=4).global_batch_size_to_eval_on == 2


def test_adamw_mask_patterns_must_find_a_trained_parameter():
  import jax.numpy as jnp
  from flax import nnx

  from maxtext.train import preflight

  class Params(nnx.Module):
    def __init__(self):
      self.embed = nnx.Param(jnp.zeros((4, 2)))
      self.kernel = nnx.Param(jnp.zeros((2, 3)))
      self.scale = nnx.Param(jnp.zeros((3,)))

  params = nnx.state(Params(), nnx.Param)
  preflight.check_adamw_mask(from_overrides(num_devices=1, adamw_mask=["^embed", "kern"]), params)
  with pytest.raises(ConfigError, match=r"adamw_mask pattern '\^kernel/w' finds no trained parameter's path.*paths look like 'embed', 'kernel'"):
    preflight.check_adamw_mask(from_overrides(num_devices=1, adamw_mask=["^embed", "^kernel/w"]), params)
  with pytest.raises(ConfigError, match="opt_type=sgd does not apply"):
    preflight.check_adamw_mask(from_overrides(num_devices=1, opt_type="sgd", adamw_mask=["^embed"]), params)
