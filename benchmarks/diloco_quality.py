"""DiLoCo against plain data parallelism on the same model, data and steps: final eval loss, and the bytes that cross
between the two replica groups per step (counted in each compiled train step, benchmarks/hlo_cross_group.py).

    JAX_PLATFORMS=cpu python benchmarks/diloco_quality.py [configs/quickstart.yml] [key=value ...]

Runs `python -m maxtext.train` twice on 2 simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=2):
plain data parallelism (ici_data_parallelism=2) and DiLoCo (enable_diloco=true ici_diloco_parallelism=2
diloco_sync_period=8 diloco_outer_lr=1.0 diloco_outer_momentum=0.0; any of these can be overridden), both at once,
for 304 steps with an eval after steps 152 and 304 (multiples of H),
then prints one JSON line: both eval losses, their relative gap, and the cross-group bytes per step of each.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
DILOCO = {"enable_diloco": "true", "ici_diloco_parallelism": "2", "diloco_sync_period": "8", "diloco_outer_lr": "1.0", "diloco_outer_momentum": "0.0"}
PLAIN = {"ici_data_parallelism": "2"}
SHARED = {"steps": "304", "eval_interval": "152"}  # multiples of H=8: DiLoCo's global parameters are evaluated right after a sync
EVAL_LINE = re.compile(r"eval after step (\d+): eval_loss: ([\d.]+)")


def _env() -> dict[str, str]:
  path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
  return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2", PYTHONPATH=path)


def _command(config: str, out: str, name: str, keys: dict[str, str]) -> list[str]:
  keys = {"base_output_directory": f"{out}/{name}", "run_name": name, "enable_tensorboard": "false", "ici_fsdp_parallelism": "1", **keys}
  return [sys.executable, "-m", "maxtext.train", config, *(f"{k}={v}" for k, v in keys.items())]


def _cross_group_bytes_per_step(config: str, keys: dict[str, str]) -> float:
  """Bytes one device sends between groups per step, averaged over a sync period (the sync's branch runs every H-th step)."""
  code = f"""
import json, sys
sys.path.insert(0, {str(REPO / "benchmarks")!r})
from hlo_cross_group import cross_group_bytes
from maxtext import config as config_lib, mesh as mesh_lib
from maxtext.train import setup as setup_lib
c = config_lib.load([{config!r}, *{[f"{k}={v}" for k, v in keys.items()]!r}], num_devices=2)
s = setup_lib.build(c, mesh_lib.create(c))
print(json.dumps(cross_group_bytes(s.compiled_step.as_text(), group_size=1)))
"""
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), check=True)
  counted = json.loads(proc.stdout.strip().splitlines()[-1])
  period = int(keys.get("diloco_sync_period", 1)) if keys.get("enable_diloco") == "true" else 1
  return counted["every_step"] + counted["in_branches"] / period


def main(argv: list[str]) -> None:
  config = argv[0] if argv and "=" not in argv[0] else str(REPO / "configs" / "quickstart.yml")
  extra = dict(a.split("=", 1) for a in argv if "=" in a)
  diloco_keys = {**DILOCO, **{k: v for k, v in extra.items() if "diloco" in k}}
  shared = {**SHARED, **{k: v for k, v in extra.items() if "diloco" not in k}}
  with tempfile.TemporaryDirectory() as out:
    runs = {name: {**shared, **keys} for name, keys in (("plain", PLAIN), ("diloco", diloco_keys))}
    logs = Path(os.environ.get("DILOCO_BENCH_LOGS") or out)  # each run's output, kept there when DILOCO_BENCH_LOGS is set
    logs.mkdir(parents=True, exist_ok=True)
    procs = {}
    for name, keys in runs.items():
      with open(logs / f"{name}.log", "w") as log:
        procs[name] = subprocess.Popen(_command(config, out, name, keys), stdout=log, stderr=subprocess.STDOUT, text=True, env=_env())
    result: dict[str, object] = {}
    for name, proc in procs.items():
      proc.wait()
      text = (logs / f"{name}.log").read_text()
      evals = EVAL_LINE.findall(text)
      if proc.returncode or not evals:
        sys.exit(f"{name} run failed (exit {proc.returncode}):\n{text[-3000:]}")
      result[f"{name}_eval_loss"] = float(evals[-1][1])
      result[f"{name}_eval_after_step"] = int(evals[-1][0])
    result["relative_gap"] = (result["diloco_eval_loss"] - result["plain_eval_loss"]) / result["plain_eval_loss"]
    for name, keys in runs.items():
      result[f"{name}_cross_group_bytes_per_step"] = _cross_group_bytes_per_step(config, {**keys, "base_output_directory": f"{out}/{name}", "run_name": name})
    result["diloco_keys"] = diloco_keys
  print(json.dumps(result))


if __name__ == "__main__":
  main(sys.argv[1:])
