"""Qwen3-VL (vision_encoder_block=qwen3_vl) from the command line: the inputs it adds that cannot work are one `error:`
line, exit 2, nothing written (the helpers of tests/test_bad_inputs.py). tests/test_vlm_qwen3_vl.py decodes with an image."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

QWEN_KEYS = (
  "decoder_block=qwen3",
  "use_multimodal=true",
  "vision_encoder_block=qwen3_vl",
  "use_mrope=true",
  "mrope_section=[4,2,2]",
  "hidden_size_for_vit=16",
  "intermediate_size_for_vit=32",
  "num_hidden_layers_for_vit=2",
  "num_attention_heads_for_vit=2",
  "out_hidden_size_for_vit=32",
  "patch_size_for_vit=4",
  "num_position_embeddings_for_vit=16",
  "deepstack_visual_indexes_for_vit=[0]",
  "image_size_for_vit=16",
  "min_pixels_for_vit=64",
  "image_token_id=500",
  "image_placeholder=<image>",
)


def _decode(*extra: str) -> list[str]:
  from tests.test_bad_inputs import REPO, TINY

  keys = {**TINY, "tokenizer_path": "{sp}", "vocab_size": "512", "prompt": "look <image> here", **dict(e.split("=", 1) for e in (*QWEN_KEYS, *extra))}
  return [sys.executable, "-m", "maxtext.decode", str(REPO / "configs" / "base.yml"), *(f"{k}={v}" for k, v in keys.items())]


def _train(*extra: str) -> list[str]:
  from tests.test_bad_inputs import GRAIN_JSONL, _train

  return _train(*GRAIN_JSONL, *QWEN_KEYS, "grain_train_files={tmp}/data.jsonl", "use_sft=true", "train_data_columns=[prompt,completion]", *extra)


def _make_inputs(tmp) -> None:
  import io

  from PIL import Image

  out = io.BytesIO()
  Image.fromarray(np.full((8, 8, 3), 200, np.uint8)).save(out, format="PNG")
  (tmp / "pic.png").write_bytes(out.getvalue())
  (tmp / "data.jsonl").write_text(json.dumps({"prompt": "a <image> b", "completion": " c", "image": "pic.png"}) + "\n")


CASES = [
  ("not_a_qwen3_decoder", _decode("image_path={tmp}/pic.png", "decoder_block=llama2"), "needs decoder_block qwen3 or qwen3_moe"),
  ("without_mrope", _decode("image_path={tmp}/pic.png", "use_mrope=false"), "set use_mrope=true"),
  ("tower_width_is_not_the_text_width", _decode("image_path={tmp}/pic.png", "out_hidden_size_for_vit=48"), "out_hidden_size_for_vit=48 must equal"),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  from tests.test_bad_inputs import run_cases
  from tests.test_data_common import sp_model

  return run_cases(tmp_path_factory, [(case_id, argv, _make_inputs) for case_id, argv, _ in CASES], tmp_path_factory.mktemp("no_run"), sp_model())


@pytest.mark.parametrize("case_id,argv,mention", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_nothing_written(results, case_id, argv, mention):
  from tests.test_bad_inputs import assert_one_line_exit_2

  proc, before, after = results[case_id]
  assert_one_line_exit_2(proc, mention)
  assert after == before
