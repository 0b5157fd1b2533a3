"""Bad inputs, each run as the user would (a subprocess): exit 2, one `error:` line, no traceback, nothing written.

Every failure found in a reliability campaign becomes a row of CASES. A row's argv may name `{tmp}` (the
case's scratch directory, holding only the inputs the case made) and `{run}` (a run directory with one checkpoint) and `{sp}` (a tiny sentencepiece model).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests import cli_server
from tests.test_data_common import sp_model
from tests.test_train_helpers import TINY_MODEL
from tests.xla_env import xla_flags

REPO = Path(__file__).resolve().parents[1]
CASE_TIMEOUT_SECONDS = 180  # far above any case's run time on a busy 2-core machine: reaching it means the process hung
TINY = dict(
  **TINY_MODEL,
  steps=3,  # a case that wrongly starts training still ends
  enable_tensorboard="true",
  async_checkpointing="false",
  base_output_directory="{tmp}/out",
  run_name="r",
)
CONVERT_TO = [sys.executable, "-m", "maxtext.convert", "hf-to-maxtext", "--out"]
CONVERT = [*CONVERT_TO, "{tmp}/converted"]


def _train(*extra: str) -> list[str]:
  """The train command on the tiny model, with key=value overrides replacing its defaults."""
  keys = {**TINY, **dict(e.split("=", 1) for e in extra)}
  return [sys.executable, "-m", "maxtext.train", str(REPO / "configs" / "base.yml"), *(f"{k}={v}" for k, v in keys.items())]


def _train_yml(name: str) -> list[str]:
  """The train command on the tiny model whose config file is {tmp}/name (made by _make_config_inputs), run_name from the file."""
  return [sys.executable, "-m", "maxtext.train", "{tmp}/" + name, *(f"{k}={v}" for k, v in TINY.items() if k != "run_name")]


GRAIN_JSONL = ("dataset_type=grain", "grain_file_type=jsonl", "tokenizer_path={sp}", "vocab_size=512")
GRPO = (
  *GRAIN_JSONL,
  "grain_train_files={tmp}/data.jsonl",
  "use_grpo=true",
  "train_data_columns=[text]",
  "decode_sampling_strategy=weighted",
  "grpo_reward_functions=[maxtext.train.rewards:topic_overlap]",
  "max_prefill_predict_length=8",
  "per_device_batch_size=2",
)

# (id, argv, what the one line must mention)
CASES = [
  ("lora_module_path_not_a_regex", _train("lora.lora_module_path=("), "lora.lora_module_path"),
  ("keep_zero_checkpoints", _train("max_num_checkpoints_to_keep=0"), "max_num_checkpoints_to_keep"),
  ("load_parameters_path_not_a_checkpoint", _train("load_parameters_path={tmp}/not_a_checkpoint"), "not a readable checkpoint"),
  ("load_full_state_path_missing", _train("load_full_state_path={tmp}/missing"), "does not exist"),
  ("lora_restore_path_not_a_checkpoint", _train("lora.enable_lora=true", "lora.lora_restore_path={tmp}/not_a_checkpoint"), "not a readable checkpoint"),
  ("compiled_trainstep_file_missing", _train("compiled_trainstep_file={tmp}/missing.bin"), "missing.bin"),
  ("vocab_not_divisible_by_vocab_tiling", _train("num_vocab_tiling=3"), "num_vocab_tiling 3"),
  ("step_does_not_fit_memory", _train("max_target_length=1048576", "per_device_batch_size=4"), "GiB per device"),
  ("output_under_a_regular_file", _train("base_output_directory={tmp}/a_file/out"), "not a directory"),
  ("metrics_file_under_a_regular_file", _train("metrics_file={tmp}/a_file/metrics.jsonl"), "not a directory"),
  (
    "no_data_files",
    _train("dataset_type=grain", "grain_file_type=jsonl", "grain_train_files={tmp}/none/*.jsonl", "tokenizer_path={sp}", "vocab_size=512"),
    "matches no file",
  ),
  (
    "tokenizer_missing",
    _train(
      "dataset_type=grain", "grain_file_type=jsonl", "grain_train_files={tmp}/data.jsonl", "tokenizer_type=sentencepiece", "tokenizer_path={tmp}/no.model"
    ),
    "no.model",
  ),
  ("restart_with_another_model_shape", _train("base_output_directory={run}", "base_mlp_dim=128"), "shape"),
  ("run_directory_locked_by_a_live_run", _train("base_output_directory={tmp}/locked"), "in use by another run"),
  ("quantization_unknown_mode", _train("quantization=int3"), "'quantization'"),
  ("quantization_int4w_training_without_lora", _train("quantization=int4w"), "lora.enable_lora=true"),
  ("quantize_kvcache_in_training", _train("quantize_kvcache=true"), "python -m maxtext.decode"),
  ("quantize_kvcache_on_mla", _train("decoder_block=deepseek", "quantize_kvcache=true"), "(MLA) caches a compressed latent"),
  (
    "checkpoint_is_quantized_on_a_float_checkpoint",
    _train("quantization=int8", "lora.enable_lora=true", "checkpoint_is_quantized=true", "load_parameters_path={run}/r/checkpoints/1"),
    "holds float kernels",
  ),
  ("dpo_and_grpo_together", _train("use_dpo=true", "use_grpo=true", "dataset_type=grain"), "use_dpo and use_grpo are both true"),
  (
    "dpo_data_without_rejected_column",
    _train(*GRAIN_JSONL, "grain_train_files={tmp}/chosen_only.jsonl", "use_dpo=true", "train_data_columns=[chosen,rejected]"),
    "no column 'rejected'",
  ),
  ("grpo_num_generations_below_2", _train(*GRPO, "num_generations=1"), "num_generations=1"),
  ("grpo_reward_function_does_not_import", _train(*GRPO, "grpo_reward_functions=[no_such_module:score]"), "module 'no_such_module' does not import"),
  ("pipeline_stages_not_dividing_devices", _train("ici_pipeline_parallelism=2"), "'ici_pipeline_parallelism': 2"),
  ("convert_truncated_safetensors", [*CONVERT, "--hf-dir", "{tmp}/hf_truncated"], "not a readable safetensors file"),
  ("convert_hidden_size_disagrees", [*CONVERT, "--hf-dir", "{tmp}/hf_wrong_size"], "does not fit hidden_size"),
  # convert: every bad --out is one line, and the process ends (a writer left waiting used to keep it alive)
  ("convert_out_under_a_regular_file", [*CONVERT_TO, "{tmp}/a_file/sub", "--hf-dir", "{tmp}/hf"], "not a directory"),
  ("convert_out_is_a_regular_file", [*CONVERT_TO, "{tmp}/a_file", "--hf-dir", "{tmp}/hf"], "is an existing file"),
  ("convert_out_cannot_be_made", [*CONVERT_TO, "/proc/maxtext_out", "--hf-dir", "{tmp}/hf"], "cannot be made"),
  ("convert_config_json_is_a_list", [*CONVERT, "--hf-dir", "{tmp}/hf_list_config"], "holds a JSON list"),
  # what a config may expand to, and names
  ("yaml_alias_bomb", _train_yml("alias_bomb.yml"), "expands to more than"),
  ("yaml_50_mb_value", _train_yml("huge_value.yml"), "longer than a config may be"),
  ("run_name_50_mb", _train_yml("huge_run_name.yml"), "longer than a config may be"),
  ("run_name_300_characters", _train("run_name=" + "a" * 300), "300 bytes long"),
  ("run_name_with_nul", _train_yml("nul_run_name.yml"), "contains '\\x00'"),
  ("run_name_with_newline", _train("run_name=a\nb"), "contains '\\n'"),
  ("convert_config_contradicts_itself", [*CONVERT, "--hf-dir", "{tmp}/hf_contradiction"], "lists 3 layer_types for num_hidden_layers=2"),
  ("attention_sink_without_sink_parameters", _train("attention_sink=true"), "has no sink parameters"),
]


def _hf_dir(path: Path, hidden: int, tensors_hidden: int) -> None:
  """A tiny Llama-style Hugging Face directory whose tensors use tensors_hidden while config.json says hidden."""
  from safetensors.numpy import save_file

  path.mkdir()
  heads, layers, vocab, mlp = 2, 1, 64, 32
  cfg = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=hidden, intermediate_size=mlp, num_attention_heads=heads)
  cfg.update(num_key_value_heads=heads, num_hidden_layers=layers, vocab_size=vocab, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64)
  cfg.update(tie_word_embeddings=False, hidden_act="silu", head_dim=8)
  (path / "config.json").write_text(json.dumps(cfg))
  e, q = tensors_hidden, heads * 8
  t = {"model.embed_tokens.weight": (vocab, e), "model.norm.weight": (e,), "lm_head.weight": (vocab, e)}
  for name, shape in {
    "self_attn.q_proj.weight": (q, e),
    "self_attn.k_proj.weight": (q, e),
    "self_attn.v_proj.weight": (q, e),
    "self_attn.o_proj.weight": (e, q),
    "mlp.gate_proj.weight": (mlp, e),
    "mlp.up_proj.weight": (mlp, e),
    "mlp.down_proj.weight": (e, mlp),
    "input_layernorm.weight": (e,),
    "post_attention_layernorm.weight": (e,),
  }.items():
    t[f"model.layers.0.{name}"] = shape
  save_file({k: np.zeros(s, np.float32) for k, s in t.items()}, str(path / "model.safetensors"))


def _alias_bomb(levels: int = 10) -> str:
  """mlp_activations: [&a [x, x, ...], &b [*a, *a, ...], ...]: 10 levels of 10 make 10**10 values."""
  lists = ["&l0 [" + ", ".join(["silu"] * 10) + "]"] + [f"&l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, levels)]
  return "mlp_activations: [" + ", ".join(lists) + "]\n"


def _make_config_inputs(tmp: Path, case_id: str) -> None:
  """The config files a case names (only its own: some are 50 MB)."""
  head = f"base_config: {REPO / 'configs' / 'base.yml'}\n"
  files = {
    "yaml_alias_bomb": ("alias_bomb.yml", lambda: head + _alias_bomb()),
    "yaml_50_mb_value": ("huge_value.yml", lambda: head + "mlp_activations: [" + "silu, " * (50 * 2**20 // 6) + "silu]\n"),
    "run_name_50_mb": ("huge_run_name.yml", lambda: head + "run_name: " + "a" * 50 * 2**20 + "\n"),
    "run_name_with_nul": ("nul_run_name.yml", lambda: head + 'run_name: "a\\0b"\n'),
  }
  if case_id in files:
    name, text = files[case_id]
    (tmp / name).write_text(text())


def _make_inputs(tmp: Path) -> None:
  (tmp / "not_a_checkpoint").mkdir()
  (tmp / "not_a_checkpoint" / "notes.txt").write_text("not a checkpoint\n")
  (tmp / "a_file").write_text("a regular file\n")
  (tmp / "locked" / "r").mkdir(parents=True)  # held by this (live) test process
  (tmp / "locked" / "r" / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": "now"}))
  (tmp / "data.jsonl").write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(8)))
  (tmp / "chosen_only.jsonl").write_text("".join(json.dumps({"chosen": f"answer {i}"}) + "\n" for i in range(8)))
  _hf_dir(tmp / "hf_truncated", 16, 16)
  weights = tmp / "hf_truncated" / "model.safetensors"
  weights.write_bytes(weights.read_bytes()[:1000])
  _hf_dir(tmp / "hf_wrong_size", 24, 16)
  _hf_dir(tmp / "hf", 16, 16)
  _hf_dir(tmp / "hf_list_config", 16, 16)
  (tmp / "hf_list_config" / "config.json").write_text("[1, 2]")
  (tmp / "hf_contradiction").mkdir()  # a Gemma 3 config.json whose layer_types do not count its layers
  gemma3 = dict(model_type="gemma3_text", hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=64)
  gemma3.update(num_hidden_layers=2, sliding_window=4, layer_types=["sliding_attention"] * 3)
  (tmp / "hf_contradiction" / "config.json").write_text(json.dumps(gemma3))


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
  """Every path under root with its size and mtime: what a case must leave untouched."""
  out = {}
  for dirpath, dirnames, filenames in os.walk(root):
    for name in dirnames + filenames:
      p = Path(dirpath) / name
      st = p.lstat()
      out[str(p.relative_to(root))] = (st.st_size if p.is_file() else 0, st.st_mtime_ns)
  return out


def _env() -> dict[str, str]:
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(1), PYTHONPATH=str(REPO))
  env.pop("PYTHONWARNINGS", None)
  return env


def _run_case(argv: list[str], tmp: Path, run: Path, sp: str) -> tuple[subprocess.CompletedProcess, tuple, tuple]:
  args = [a.replace("{tmp}", str(tmp)).replace("{run}", str(run)).replace("{sp}", sp) for a in argv]
  before = (_snapshot(tmp.parent), _snapshot(run))
  proc = cli_server.run(args, cwd=tmp, env=_env(), timeout=CASE_TIMEOUT_SECONDS)  # a process of its own, forked warm; a hang fails the case
  return proc, before, (_snapshot(tmp.parent), _snapshot(run))


def run_cases(tmp_path_factory, cases: list[tuple[str, list[str], Callable[[Path], None]]], run: Path, sp: str) -> dict[str, tuple]:
  """Each (case id, argv, make_inputs) in a fresh work directory that make_inputs fills, two cases at a time:
  case id -> (process, snapshot before, snapshot after)."""
  import concurrent.futures

  jobs = {}
  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    for case_id, argv, make_inputs in cases:
      tmp = tmp_path_factory.mktemp("case") / "work"
      tmp.mkdir()
      make_inputs(tmp)
      jobs[case_id] = pool.submit(_run_case, argv, tmp, run, sp)
  return {k: v.result() for k, v in jobs.items()}


def assert_one_line_exit_2(proc: subprocess.CompletedProcess, mention: str) -> None:
  """The process exited 2 with one `error: ...` line on stderr that mentions `mention`, and no traceback."""
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
  assert mention in lines[0], lines[0]
  assert "Traceback" not in proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  """Run every case (two at a time) once; each gets its own scratch directory."""
  run_root = tmp_path_factory.mktemp("existing_run")
  argv = [a.replace("{tmp}/out", str(run_root)) for a in _train("steps=1")]
  made = cli_server.run(argv, env=_env(), timeout=300)
  assert made.returncode == 0, made.stderr[-2000:]
  shutil.rmtree(run_root / "r" / "tensorboard", ignore_errors=True)
  sp = sp_model()
  jobs = {}
  with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
    for case_id, argv, _ in CASES:
      tmp = tmp_path_factory.mktemp("case") / "work"
      tmp.mkdir()
      _make_inputs(tmp)
      _make_config_inputs(tmp, case_id)
      jobs[case_id] = pool.submit(_run_case, argv, tmp, run_root, sp)
  return {k: v.result() for k, v in jobs.items()}, run_root


@pytest.mark.parametrize("case_id,argv,mention", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_nothing_written(results, case_id, argv, mention):
  (proc, before, after), _ = results[0][case_id], results[1]
  assert_one_line_exit_2(proc, mention)
  assert after == before  # no directory, lock, checkpoint, events file or metrics file appeared or changed
