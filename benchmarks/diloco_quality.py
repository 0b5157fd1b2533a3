"""DiLoCo against plain data parallelism on the same model, data and steps: final eval loss, and the bytes that cross
between the two replica groups per step (counted in each compiled train step, benchmarks/hlo_cross_group.py).

    JAX_PLATFORMS=cpu python benchmarks/diloco_quality.py [configs/quickstart.yml] [key=value ...]

Runs `python -m maxtext.train` on 2 simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=2):
plain data parallelism (ici_data_parallelism=2) and DiLoCo (enable_diloco=true ici_diloco_parallelism=2
diloco_sync_period=8 diloco_outer_lr=1.0 diloco_outer_momentum=0.0; any of these can be overridden), all at once,
for 304 steps with an eval after steps 152 and 304 (multiples of H). Comma-separated values of the DiLoCo keys
(diloco_outer_lr=1.0,0.7 diloco_outer_momentum=0.0,0.9) are zipped into several DiLoCo runs against the one plain run.
Prints one JSON line per DiLoCo run (a table row): every eval loss of both runs, the final eval losses' relative gap,
the final train losses, the cross-group bytes per step of each (counted in its compiled step) and their ratio, and
the wall seconds of each run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
DILOCO = {"enable_diloco": "true", "ici_diloco_parallelism": "2", "diloco_sync_period": "8", "diloco_outer_lr": "1.0", "diloco_outer_momentum": "0.0"}
PLAIN = {"ici_data_parallelism": "2"}
SHARED = {"steps": "304", "eval_interval": "152"}  # multiples of H=8: DiLoCo's global parameters are evaluated right after a sync
EVAL_LINE = re.compile(r"eval after step (\d+): eval_loss: ([\d.]+)")
FINAL_TRAIN_LINE = re.compile(r"final train loss ([\d.]+)")


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


def _variants(extra: dict[str, str]) -> list[dict[str, str]]:
  """The DiLoCo runs: DILOCO with the command's diloco keys, comma-separated values zipped into one run each."""
  given = {k: v.split(",") for k, v in extra.items() if "diloco" in k}
  count = max([len(v) for v in given.values()] + [1])
  if any(len(v) not in (1, count) for v in given.values()):
    sys.exit(f"error: comma-separated DiLoCo values must all have {count} entries (or one): {given}")
  return [{**DILOCO, **{k: v[i] if len(v) > 1 else v[0] for k, v in given.items()}} for i in range(count)]


def _final_train_loss(text: str) -> float:
  found = FINAL_TRAIN_LINE.findall(text)
  return float(found[-1]) if found else float("nan")


def main(argv: list[str]) -> None:
  config = argv[0] if argv and "=" not in argv[0] else str(REPO / "configs" / "quickstart.yml")
  extra = dict(a.split("=", 1) for a in argv if "=" in a)
  shared = {**SHARED, **{k: v for k, v in extra.items() if "diloco" not in k}}
  with tempfile.TemporaryDirectory() as out:
    runs = {"plain": {**shared, **PLAIN}} | {f"diloco{i}": {**shared, **keys} for i, keys in enumerate(_variants(extra))}
    logs = Path(os.environ.get("DILOCO_BENCH_LOGS") or out)  # each run's output, kept there when DILOCO_BENCH_LOGS is set
    logs.mkdir(parents=True, exist_ok=True)
    procs, began = {}, time.perf_counter()
    for name, keys in runs.items():
      with open(logs / f"{name}.log", "w") as log:
        procs[name] = subprocess.Popen(_command(config, out, name, keys), stdout=log, stderr=subprocess.STDOUT, text=True, env=_env())
    ended: dict[str, float] = {}
    while len(ended) < len(procs):  # each run's wall time: from the common start to its exit
      ended |= {name: time.perf_counter() - began for name, proc in procs.items() if name not in ended and proc.poll() is not None}
      time.sleep(1)
    figures: dict[str, dict[str, object]] = {}
    for name, proc in procs.items():
      seconds = ended[name]
      text = (logs / f"{name}.log").read_text()
      evals = EVAL_LINE.findall(text)
      if proc.returncode or not evals:
        sys.exit(f"{name} run failed (exit {proc.returncode}):\n{text[-3000:]}")
      figures[name] = {
        "eval_loss": {int(step): float(loss) for step, loss in evals},
        "final_eval_loss": float(evals[-1][1]),
        "final_train_loss": _final_train_loss(text),
        "cross_group_bytes_per_step": _cross_group_bytes_per_step(config, {**runs[name], "base_output_directory": f"{out}/{name}", "run_name": name}),
        "wall_seconds": round(seconds, 1),
      }
  plain = figures.pop("plain")
  for name, row in figures.items():
    result = {
      "diloco_keys": {k: v for k, v in runs[name].items() if "diloco" in k},
      "plain": plain,
      "diloco": row,
      "relative_gap": (row["final_eval_loss"] - plain["final_eval_loss"]) / plain["final_eval_loss"],
      "bytes_ratio": row["cross_group_bytes_per_step"] / plain["cross_group_bytes_per_step"],
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
