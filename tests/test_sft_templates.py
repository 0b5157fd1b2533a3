"""Chat templates run bounded and never double BOS/EOS; DPO pairs that are dropped are counted and named.

The renderer (maxtext.data.chat_template) is tested in this process with short limits; the user's view (one line,
exit 2) is tests/test_bad_inputs_templates.py.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from maxtext.data import chat_template, create_iterator
from maxtext.data.chat_template import ChatTemplate, TemplateSource
from maxtext.errors import ConfigError, DataError
from maxtext.tokenizer import load_tokenizer
from tests.test_data_common import config, mesh_for, write_jsonl
from tests.test_sft import CONVERSATION, TEMPLATE, first_row, sft_config

# SmolLM2's chat template (ChatML): its tokenizer's BOS and EOS are <|im_start|> and <|im_end|>, template tokens.
CHATML = (
  "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
  "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
  "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TURNS = [{"role": "user", "content": "predict the next token"}, {"role": "assistant", "content": "the next token of every document"}]
REPO = Path(__file__).resolve().parents[1]
ORIGIN = "chat_template_path '/t.jinja'"


@pytest.fixture(scope="module")
def chatml_tokenizer(tmp_path_factory):
  """A tiny Hugging Face tokenizer whose BOS is <|im_start|> and EOS <|im_end|>, with the ChatML template."""
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast

  path = tmp_path_factory.mktemp("chatml")
  raw = Tokenizer(models.BPE(unk_token="<unk>"))
  raw.pre_tokenizer = pre_tokenizers.Whitespace()
  texts = [t["content"] for t in CONVERSATION] * 5 + ["system user assistant You are a helpful AI"] * 5
  raw.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"]))
  raw.save(str(path / "tokenizer.json"))
  fast = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), bos_token="<|im_start|>", eos_token="<|im_end|>")
  fast.chat_template = CHATML
  fast.save_pretrained(path / "tok")
  return str(path / "tok")


def real_tokens(row) -> list[int]:
  return row["inputs"][row["inputs_segmentation"] > 0].tolist()


def test_template_holding_bos_and_eos_gets_no_second_one(tmp_path, chatml_tokenizer):
  tok = load_tokenizer("huggingface", chatml_tokenizer)
  path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
  row = first_row(sft_config(path, tokenizer_type="huggingface", tokenizer_path=chatml_tokenizer, max_target_length=256))
  tokens = real_tokens(row)
  rendered = "".join(f"<|im_start|>{t['role']}\n{t['content']}<|im_end|>\n" for t in CONVERSATION)
  assert tokens == tok.encode(rendered)  # exactly the rendered conversation: one <|im_start|> first, no <|im_end|> after its "\n"
  assert tokens[:2] != [tok.bos_id, tok.bos_id] and tokens.count(tok.eos_id) == 5
  trained = row["targets"][row["targets_segmentation"] != 0].tolist()
  assert tok.eos_id in trained  # each reply's own <|im_end|> is trained on


def test_template_without_bos_and_eos_still_gets_them(tmp_path, chatml_tokenizer):
  tok = load_tokenizer("huggingface", chatml_tokenizer)
  path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
  row = first_row(sft_config(path, tokenizer_type="huggingface", tokenizer_path=chatml_tokenizer, chat_template=TEMPLATE, max_target_length=256))
  tokens = real_tokens(row)
  assert tokens[0] == tok.bos_id and tokens[1] != tok.bos_id
  assert tokens[-1] == tok.eos_id and tokens.count(tok.eos_id) == 1


def render_error(source: str, exc=DataError) -> str:
  template = ChatTemplate(TemplateSource(source, ORIGIN))
  with pytest.raises(exc) as e:
    template.pieces(TURNS, {}, "chat.jsonl line 3")
  template.close()
  return str(e.value)


@pytest.mark.parametrize(
  "source,cause",
  [
    ("{{ 1/0 }}", "ZeroDivisionError: division by zero"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    ("{% include 'other.jinja' %}", "TypeError: no loader"),
    ("{% for i in range(1000000000) %}{% endfor %}", "OverflowError: Range too big"),
    ("{{ raise_exception('roles must alternate') }}", "TemplateError: roles must alternate"),
    ("{{ 'x' * 300000000 }}", f"rendered more than {chat_template.MAX_RENDER_CHARS} characters"),
    ("{{ ('x' * 3000000000)|length }}", "MemoryError"),  # over the renderer's address-space limit
    ("{{ messages|length }}", "does not render conversations prefix by prefix"),
  ],
  ids=["zero_division", "recursive_macro", "include", "huge_range", "raise_exception", "huge_output", "huge_value", "not_prefix"],
)
def test_failing_template_is_one_data_error_naming_it(source, cause):
  message = render_error(source)
  assert message.startswith(f"chat.jsonl line 3: the chat template ({ORIGIN})") and cause in message
  assert "\n" not in message


ENDLESS = "{% for m in messages %}{{ m.content }}{% endfor %}{% if messages|length > 1 %}{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}{% endif %}"


def test_endless_template_stops_at_the_deadline_and_the_renderer_restarts(monkeypatch):
  monkeypatch.setattr(chat_template, "RENDER_SECONDS", 1.0)
  template = ChatTemplate(TemplateSource(ENDLESS, ORIGIN))
  with pytest.raises(DataError, match=rf"the chat template \({ORIGIN}\) did not finish rendering within 1 s"):
    template.pieces(TURNS, {}, "chat.jsonl line 3")
  # the late renderer was killed; the next conversation starts another
  assert template.pieces(TURNS[:1], {}, "chat.jsonl line 4") == [("predict the next token", False)]
  template.close()


def test_renderer_ends_when_its_parent_is_killed_mid_render(tmp_path):
  """kill -9 of the trainer while its renderer runs an endless loop leaves no renderer behind (it used to spin on)."""
  pid_file = tmp_path / "renderer.pid"
  script = f"""
import sys
from maxtext.data.chat_template import ChatTemplate, TemplateSource
t = ChatTemplate(TemplateSource({ENDLESS!r}, "chat_template"))
open({str(pid_file)!r}, "w").write(str(t._proc.pid))
t.pieces([{{"role": "user", "content": "a"}}, {{"role": "assistant", "content": "b"}}], {{}}, "here")
"""
  parent = subprocess.Popen([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=str(REPO)))
  deadline = time.monotonic() + 60
  while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
    time.sleep(0.1)
  renderer = int(pid_file.read_text())
  time.sleep(0.5)  # the render is under way
  parent.kill()
  parent.wait()
  deadline = time.monotonic() + 15
  while _alive(renderer) and time.monotonic() < deadline:
    time.sleep(0.2)
  assert not _alive(renderer)


def _alive(pid: int) -> bool:
  """True while pid runs (a zombie, dead but not yet reaped by init, counts as ended)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False


def test_compile_errors_name_the_template():
  with pytest.raises(ConfigError, match=rf"the chat template \({ORIGIN}\) has a syntax error at line 2: "):
    ChatTemplate(TemplateSource("ok\n{% for m in messages %}", ORIGIN))
  with pytest.raises(ConfigError, match=rf"the chat template \({ORIGIN}\) cannot be compiled: RecursionError"):
    ChatTemplate(TemplateSource("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", ORIGIN))


def test_template_pickles_as_its_source_and_renders_where_it_is_loaded():
  template = ChatTemplate(TemplateSource(TEMPLATE, ORIGIN))
  copy = pickle.loads(pickle.dumps(template))
  assert copy._proc is None  # started on first use, in the process that renders
  assert (
    copy.pieces(TURNS, {}, "w")
    == template.pieces(TURNS, {}, "w")
    == [
      ("<|user|>predict the next token\n", False),
      ("<|assistant|>", False),
      ("the next token of every document\n", True),
    ]
  )
  copy.close()
  template.close()


def test_tokenizer_own_template_is_named(tmp_path, chatml_tokenizer):
  from maxtext.data import sft

  source = sft.resolve_chat_template("", "", "{{ 1/0 }}", chatml_tokenizer)
  assert source.origin == f"the tokenizer's own template in '{chatml_tokenizer}'"
  assert sft.resolve_chat_template("{{ x }}", "", "{{ y }}", chatml_tokenizer) == TemplateSource("{{ x }}", "chat_template")


def dpo_iterator(tmp_path, rows, **kw):
  path = write_jsonl(tmp_path / "pairs.jsonl", rows)
  cfg = config(grain_train_files=path, use_dpo=True, train_data_columns=["prompt", "chosen", "rejected"], max_target_length=32, packing=False, **kw)
  return create_iterator(cfg, mesh_for(cfg))


def test_dropped_pairs_are_counted_by_reason(tmp_path):
  long_prompt = "the model reads text and learns " * 8  # fills max_target_length // 2 = 16 tokens
  rows = [{"prompt": "the model", "chosen": f"reads {i}", "rejected": f"reads {i}" if i < 18 else f"learns {i}"} for i in range(30)]
  rows += [{"prompt": long_prompt, "chosen": "text", "rejected": "data"}] * 3
  it = dpo_iterator(tmp_path, rows)
  assert it.notes == [
    "train data: 21 of the 33 pairs are dropped: 18 have chosen equal to rejected and 3 leave no difference to score "
    "within max_target_length // 2 = 16 tokens (the prompt takes the room)"
  ]
  it.close()


def test_no_usable_pair_is_an_error_naming_the_cause(tmp_path):
  rows = [{"prompt": "the model", "chosen": f"reads {i}", "rejected": f"reads {i}"} for i in range(6)]
  with pytest.raises(DataError, match=r"has no usable DPO pair: of the 6 pairs, 6 have chosen equal to rejected; fix the pairs"):
    dpo_iterator(tmp_path, rows)


def test_survey_of_a_large_data_set_reads_a_sample(tmp_path, monkeypatch):
  from maxtext.data import pipeline

  monkeypatch.setattr(pipeline, "SURVEY_PAIRS", 4)
  rows = [{"prompt": "the model", "chosen": f"reads {i}", "rejected": f"reads {i}" if i % 2 else f"learns {i}"} for i in range(24)]
  it = dpo_iterator(tmp_path, rows)
  assert it.notes[0].startswith("train data: 2 of the first 4 pairs read are dropped: 2 have chosen equal to rejected")
  np.testing.assert_array_equal(next(it)["inputs"].shape, (8, 32))
  it.close()
