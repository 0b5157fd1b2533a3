"""`python -m maxtext.decode`: completions from a Hugging Face directory or a run's checkpoint; bad input exits 2 with one line."""

from __future__ import annotations

import json

import pytest

from maxtext.decode import main
from tests.hf_fixtures import save_tiny_model

ARGS = ["configs/base.yml", "tokenizer_type=huggingface", "max_target_length=20", "max_prefill_predict_length=16", "dtype=float32"]


def word_tokenizer(path, words: int) -> str:
  """A whitespace word-level tokenizer.json: <unk>, <s>, </s>, then w0 .. w{words-1}."""
  from tokenizers import Tokenizer, models, pre_tokenizers

  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(words)}}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.save(str(path))
  return str(path)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("llama")
  save_tiny_model("llama2", d)
  return d


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  return word_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", 90)  # 93 tokens <= vocab_size 97


def run(capsys, *args):
  main([*ARGS, *args])
  return capsys.readouterr().out


def test_decode_from_hf_directory(hf_dir, tokenizer, capsys):
  out = run(capsys, f"hf_model_path={hf_dir}", f"tokenizer_path={tokenizer}", "prompt=w1 w2 w3")
  assert "completion: " in out and "prompt: w1 w2 w3" in out
  assert "prefill: 4 tokens" in out and "tokens/s" in out
  assert "KV cache: 0.01 MiB for batch 1 x 20 tokens over 3 layers (32 values per token and layer, float32)" in out


def test_decode_kimi_shaped_deepseek_from_its_compressed_cache(tokenizer, tmp_path, capsys):
  """A DeepseekV3 directory with one routing group and plain rope (as Kimi K2's config.json): the command decodes from
  the compressed MLA cache and prints its size beside the naive one; maxtext.generate gives the same completion."""
  import maxtext
  from maxtext.tokenizer import load_tokenizer

  save_tiny_model("deepseek_plain", tmp_path)
  out = run(capsys, f"hf_model_path={tmp_path}", f"tokenizer_path={tokenizer}", "prompt=w1 w2 w3")
  line = next(x for x in out.splitlines() if x.startswith("KV cache:"))
  assert "(20 values per token and layer, float32); per-head keys and values (mla_naive_kvcache=true) would take" in line and "(3.6x)" in line
  model, config = maxtext.from_hf(tmp_path, dtype="float32", max_target_length=20, max_prefill_predict_length=16)
  completion = maxtext.generate(model, load_tokenizer("huggingface", tokenizer), "w1 w2 w3", config=config)
  assert f"completion: {completion}\n" in out


def test_decode_from_the_runs_own_checkpoint(hf_dir, tokenizer, tmp_path, capsys):
  from maxtext import from_hf
  from maxtext.convert.hf_config import overrides_from_hf
  from maxtext.train.checkpoint_files import save_params

  model, _ = from_hf(hf_dir)
  from flax import nnx

  save_params(str(tmp_path / "r" / "checkpoints" / "7" / "items"), nnx.state(model, nnx.Param))
  arch = [f"{k}={json.dumps(v)}" for k, v in overrides_from_hf(json.loads((hf_dir / "config.json").read_text())).items() if k != "dtype"]
  out = run(
    capsys,
    *arch,
    f"base_output_directory={tmp_path}",
    "run_name=r",
    f"tokenizer_path={tokenizer}",
    "prompt=w5",
    "decode_sampling_strategy=topk",
    "decode_sampling_top_k=3",
  )
  assert f"loaded parameters from {tmp_path}/r/checkpoints/7" in out and "completion: " in out


@pytest.mark.parametrize(
  "case, message",
  [
    ("long_prompt", "more than max_prefill_predict_length=16"),
    ("missing_checkpoint", "does not exist"),
    ("no_checkpoint_in_run", "no checkpoint to decode"),
    ("tokenizer_vocab", "has 123 tokens but the model's vocabulary has 97"),
  ],
)
def test_bad_input_is_one_line_exit_2(case, message, hf_dir, tokenizer, tmp_path, capsys):
  args = {
    "long_prompt": [f"hf_model_path={hf_dir}", f"tokenizer_path={tokenizer}", "prompt=" + " ".join(f"w{i}" for i in range(20))],
    "missing_checkpoint": [f"load_parameters_path={tmp_path}/nowhere", f"tokenizer_path={tokenizer}", "vocab_size=97"],
    "no_checkpoint_in_run": [f"base_output_directory={tmp_path}", "run_name=r", f"tokenizer_path={tokenizer}", "vocab_size=97"],
    "tokenizer_vocab": [f"hf_model_path={hf_dir}", f"tokenizer_path={word_tokenizer(tmp_path / 'big.json', 120)}"],
  }[case]
  with pytest.raises(SystemExit) as e:
    main([*ARGS, *args])
  err = capsys.readouterr().err
  assert e.value.code == 2
  assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_generate_api(hf_dir, tokenizer, tmp_path):
  import maxtext
  from maxtext.errors import DataError
  from maxtext.tokenizer import load_tokenizer

  model, config = maxtext.from_hf(hf_dir, dtype="float32", max_target_length=20, max_prefill_predict_length=16)
  tok = load_tokenizer("huggingface", tokenizer)
  completions = maxtext.generate(model, tok, ["w1 w2", "w3"], config=config)
  assert isinstance(completions, list) and len(completions) == 2 and all(isinstance(c, str) for c in completions)
  assert maxtext.generate(model, tok, "w1 w2", config=config) == completions[0]
  with pytest.raises(DataError, match="has 123 tokens"):
    maxtext.generate(model, load_tokenizer("huggingface", word_tokenizer(tmp_path / "big.json", 120)), "w1", config=config)
