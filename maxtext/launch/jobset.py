"""A JobSet manifest for `kubectl apply -f`, for clusters without xpk: one Job per slice, one pod per TPU host."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml

from maxtext.launch.target import Target


def manifest(target: Target, workload: str, docker_image: str, train_args: Sequence[str]) -> dict[str, Any]:
  """GKE's TPU webhook gives each pod TPU_WORKER_ID/TPU_WORKER_HOSTNAMES (and MEGASCALE_* across slices),
  from which jax.distributed.initialize() finds its peers."""
  topo, hosts = target.topo, target.topo.num_hosts
  container = {
    "name": "maxtext",
    "image": docker_image,
    "command": ["python", "-m", "maxtext.train", *train_args],
    "securityContext": {"privileged": True},
    "resources": {"limits": {"google.com/tpu": topo.chips_per_host}},
  }
  pod = {
    "restartPolicy": "Never",
    "hostNetwork": True,
    "dnsPolicy": "ClusterFirstWithHostNet",
    "nodeSelector": {"cloud.google.com/gke-tpu-accelerator": topo.chip.gke_accelerator, "cloud.google.com/gke-tpu-topology": topo.shape_str},
    "tolerations": [{"key": "google.com/tpu", "operator": "Exists"}],
    "containers": [container],
  }
  job = {
    "parallelism": hosts,
    "completions": hosts,
    "completionMode": "Indexed",
    "backoffLimit": 0,
    "template": {"metadata": {"labels": {"app": workload}}, "spec": pod},
  }
  return {
    "apiVersion": "jobset.x-k8s.io/v1alpha2",
    "kind": "JobSet",
    "metadata": {"name": workload, "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}},
    "spec": {
      "failurePolicy": {"maxRestarts": 0},
      "replicatedJobs": [{"name": "slice", "replicas": target.num_slices, "template": {"spec": job}}],
    },
  }


def write(path: str, doc: dict[str, Any]) -> None:
  with open(path, "w") as f:
    yaml.safe_dump(doc, f, sort_keys=False)
