"""Training Qwen3-VL (and Llama 4) on image-text records from the command line: the data and settings that cannot work are one
`error:` line, exit 2, nothing written (the helpers of tests/test_bad_inputs.py; one subprocess per case)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.test_bad_inputs_qwen3_vl import _train

LLAMA4_KEYS = (
  "decoder_block=llama4",
  "chunk_attn_window_size=64",
  "use_multimodal=true",
  "tile_size_for_vit=16",
  "patch_size_for_vit=4",
  "hidden_size_for_vit=32",
  "intermediate_size_for_vit=128",
  "num_hidden_layers_for_vit=1",
  "num_attention_heads_for_vit=4",
  "projector_input_dim_for_vit=24",
  "projector_output_dim_for_vit=24",
  "vision_output_dim_for_vit=24",
  "image_token_id=500",
  "image_placeholder=<image>",
)


def _llama4_train(*extra: str) -> list[str]:
  from tests.test_bad_inputs import GRAIN_JSONL
  from tests.test_bad_inputs import _train as train

  return train(*GRAIN_JSONL, *LLAMA4_KEYS, "grain_train_files={tmp}/data.jsonl", "use_sft=true", "train_data_columns=[prompt,completion]", *extra)


def _make_inputs(tmp) -> None:
  import io

  from PIL import Image

  for name, side in (("pic.png", 8), ("big.png", 16)):  # 4 and 16 patches of 4 x 4 pixels
    out = io.BytesIO()
    Image.fromarray(np.full((side, side, 3), 200, np.uint8)).save(out, format="PNG")
    (tmp / name).write_bytes(out.getvalue())
  (tmp / "bad.png").write_bytes(b"not an image")
  files = {
    "data": {"prompt": "a <image> b", "completion": " c", "image": "pic.png"},
    "unreadable": {"prompt": "a <image> b", "completion": " c", "image": "bad.png"},
    "places": {"prompt": "a <image> b <image>", "completion": " c", "image": "pic.png"},
    "big": {"prompt": "a <image> b", "completion": " c", "image": "big.png"},
  }
  for name, record in files.items():
    (tmp / f"{name}.jsonl").write_text(json.dumps(record) + "\n")


CASES = [
  ("unreadable_image", _train("grain_train_files={tmp}/unreadable.jsonl"), "image 0: the image is not a readable PNG/JPEG"),
  ("more_places_than_images", _train("grain_train_files={tmp}/places.jsonl"), "has 2 '<image>' place(s) but 1 image(s)"),
  ("image_over_the_patch_budget", _train("grain_train_files={tmp}/big.jsonl", "max_patches_per_row_for_vit=4"), "16 image patches (4x4 patches), more than"),
  ("llama4_more_places_than_images", _llama4_train("grain_train_files={tmp}/places.jsonl"), "has 2 '<image>' place(s) but 1 image(s)"),
  ("budget_not_a_multiple_of_the_merge", _train("max_patches_per_row_for_vit=6"), "max_patches_per_row_for_vit=6 is not a multiple of"),
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
