"""python -m maxtext.launch --cluster C --tpu-type v5p-128 --num-slices 2 --docker-image IMG [--project P --zone Z]
[--workload W] [--dry-run] [--output-manifest PATH] [--skip-compile-check] -- configs/base.yml run_name=r key=value ..."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys

from maxtext.cli import entry
from maxtext.errors import ConfigError
from maxtext.launch import jobset, preflight, target, xpk

EXAMPLE = """example (print the xpk command without submitting):
  python -m maxtext.launch --cluster C --tpu-type v5p-128 --num-slices 2 --docker-image IMG --dry-run \\
    -- configs/base.yml run_name=r model_name=llama3.1-8b per_device_batch_size=2 base_output_directory=gs://bucket/runs

After '--' come the config file and key=value overrides of maxtext.train (see python -m maxtext.train --help)."""


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    prog="python -m maxtext.launch",
    usage="python -m maxtext.launch --cluster C --tpu-type T --docker-image IMG [options] -- <config.yml> [key=value ...]",
    description="Check a training config for TPU slices and submit it with xpk.",
    epilog=EXAMPLE,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("--cluster", required=True, help="GKE cluster (as created by `xpk cluster create`).")
  p.add_argument("--tpu-type", required=True, help="Slice type, e.g. v5p-128, v5e-16 (or xpk's v5litepod-16), v6e-256.")
  p.add_argument("--num-slices", type=int, default=1, help="Slices; >1 spreads the dcn_* parallelism over the data-center network.")
  p.add_argument("--docker-image", required=True, help="Image with maxtext and libtpu (scripts/Dockerfile), pushed where the cluster can pull it.")
  p.add_argument("--project", help="GCP project (default: gcloud's).")
  p.add_argument("--zone", help="GCP zone (default: gcloud's).")
  p.add_argument("--workload", help="Workload name (default: from run_name).")
  p.add_argument("--dry-run", action="store_true", help="Print the xpk command instead of running it.")
  p.add_argument("--output-manifest", metavar="PATH", help="Write a JobSet YAML for `kubectl apply -f PATH` instead of running xpk.")
  p.add_argument("--skip-compile-check", action="store_true", help="Do not AOT-compile the train step for the target first.")
  p.add_argument("--xpk", default=os.environ.get("XPK", "xpk"), help="xpk executable (default: $XPK or xpk on PATH).")
  return p


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  if "--" not in argv:
    raise ConfigError("missing '--' before the config; usage: python -m maxtext.launch --cluster C --tpu-type v5p-128 ... -- configs/base.yml key=value ...")
  split = argv.index("--")
  return parser().parse_args(argv[:split]), argv[split + 1 :]


@entry(lambda: parser().format_help())
def main(argv: list[str]) -> int:
  args, config_argv = parse(argv)
  goal = target.parse_target(args.tpu_type, args.num_slices)
  config = target.validate(config_argv, goal)
  train_args = target.train_args(config_argv, config)
  workload = target.check_workload_name(args.workload) if args.workload else target.workload_name(config.run_name)
  where = f"{goal.topo.name} x {goal.num_slices} slice(s) = {goal.num_devices} devices"
  print(f"config ok for {where}: global batch {config.global_batch_size_to_train_on}, ici {config.ici_parallelism}, dcn {config.dcn_parallelism}")
  if not config.base_output_directory.startswith("gs://"):
    print(f"note: base_output_directory '{config.base_output_directory}' is inside the container and is lost when the job ends; use gs://bucket/dir")
  if not args.skip_compile_check:
    report = preflight.compile_check(config_argv, goal)
    print(
      f"AOT check: fits, {report['total_bytes'] / 1024**3:.2f} of {report['hbm_bytes'] / 1024**3:.2f} GiB per device, compiled in {report['compile_seconds']:.0f}s"
    )
  if args.output_manifest:
    jobset.write(args.output_manifest, jobset.manifest(goal, workload, args.docker_image, train_args))
    print(f"wrote JobSet {workload} to {args.output_manifest}; submit it with: kubectl apply -f {shlex.quote(args.output_manifest)}")
    return 0
  cmd = xpk.workload_create(goal, args.cluster, workload, args.docker_image, train_args, args.project, args.zone, xpk=args.xpk)
  if args.dry_run:
    print(shlex.join(cmd))
    return 0
  if shutil.which(args.xpk) is None:
    raise ConfigError(f"xpk not found ('{args.xpk}'); install it (pipx install xpk), pass --xpk PATH, or use --output-manifest with kubectl")
  return subprocess.run(cmd).returncode


if __name__ == "__main__":
  sys.exit(main())
