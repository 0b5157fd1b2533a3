"""tensorboardX loads without torch (2 CPU seconds a process), and torch still imports afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys, tempfile
from maxtext.tensorboard_import import import_tensorboardx
writer = import_tensorboardx().SummaryWriter(tempfile.mkdtemp())
writer.add_scalar("loss", 1.5, 0)
writer.close()
assert "torch" not in sys.modules, "tensorboardX pulled torch in"
import_tensorboardx("tensorboardX.proto.event_pb2")
import torch
assert torch.ones(2).sum().item() == 2.0
print("ok")
"""


def test_tensorboardx_loads_without_torch_and_torch_still_imports():
  env = dict(os.environ, PYTHONPATH=str(REPO))
  result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
  assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
