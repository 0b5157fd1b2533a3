"""`python -m maxtext.convert`: HF -> Orbax params -> HF through the real command line."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests import cli_server
from tests.hf_fixtures import save_tiny_model
from tests.xla_env import xla_flags


def run(*args: str) -> subprocess.CompletedProcess:
  """The command as a process of its own, forked from a server that imported maxtext once (tests/cli_server.py)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1)}
  return cli_server.run([sys.executable, "-m", "maxtext.convert", *args], env=env, timeout=300)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  root = tmp_path_factory.mktemp("convert")
  save_tiny_model("gemma2", root / "hf")
  result = run("hf-to-maxtext", "--hf-dir", str(root / "hf"), "--out", str(root / "mt"))
  assert result.returncode == 0, result.stderr
  return root


def test_round_trip_through_the_cli_is_bit_identical(converted):
  result = run("maxtext-to-hf", "--checkpoint", str(converted / "mt"), "--out", str(converted / "hf2"))
  assert result.returncode == 0, result.stderr
  a, b = load_file(str(converted / "hf" / "model.safetensors")), load_file(str(converted / "hf2" / "model.safetensors"))
  assert sorted(a) == sorted(b)
  assert all(np.array_equal(a[k], b[k]) for k in a)
  import transformers

  model = transformers.AutoModelForCausalLM.from_pretrained(converted / "hf2")
  assert type(model).__name__ == "Gemma2ForCausalLM"


def test_existing_output_is_refused_with_one_line(converted):
  before = sorted(p.name for p in (converted / "mt").iterdir())
  result = run("hf-to-maxtext", "--hf-dir", str(converted / "hf"), "--out", str(converted / "mt"))
  assert result.returncode == 2
  assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: --out ") and "not empty" in result.stderr and "Traceback" not in result.stderr
  assert sorted(p.name for p in (converted / "mt").iterdir()) == before


def test_missing_hf_dir_is_one_line_error(tmp_path):
  result = run("hf-to-maxtext", "--hf-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
  assert result.returncode == 2 and result.stderr.startswith("error: ") and "config.json" in result.stderr
  assert not (tmp_path / "o").exists()


def test_mxfp4_experts_dequantise_as_transformers_does():
  """gpt-oss's published MXFP4 expert blocks and scales become the dense tensors transformers' dequantiser gives."""
  torch = pytest.importorskip("torch")
  from transformers.integrations.mxfp4 import convert_moe_packed_tensors

  from maxtext.convert import mxfp4

  rng = np.random.default_rng(0)
  blocks = rng.integers(0, 256, size=(2, 6, 3, 16), dtype=np.uint8)  # 2 experts, 6 rows, 3 groups of 32 values
  scales = rng.integers(120, 134, size=(2, 6, 3), dtype=np.uint8)
  expected = convert_moe_packed_tensors(torch.as_tensor(blocks), torch.as_tensor(scales), dtype=torch.float32).numpy()
  dense = mxfp4.dense_experts({"mlp.experts.down_proj_blocks": blocks, "mlp.experts.down_proj_scales": scales, "other": np.ones(1)})
  assert sorted(dense) == ["mlp.experts.down_proj", "other"] and dense["mlp.experts.down_proj"].shape == (2, 96, 6)
  np.testing.assert_array_equal(dense["mlp.experts.down_proj"], expected)
