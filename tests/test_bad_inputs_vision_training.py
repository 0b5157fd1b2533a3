"""Vision training choices that contradict the model: one subprocess as the user runs train (exit 2, one `error:`
line, nothing written), the other contradictions in process."""

from __future__ import annotations

import pytest

from maxtext.errors import ConfigError
from tests.test_bad_inputs import _run_case, _train, assert_one_line_exit_2
from tests.test_train_helpers import tiny_config


def test_tower_learning_rate_on_a_text_only_model_is_one_line_exit_2(tmp_path):
  run = tmp_path / "run"
  run.mkdir()
  proc, before, after = _run_case(_train("vision_learning_rate_scale=0.1"), tmp_path, run, "")
  assert_one_line_exit_2(proc, "vision_learning_rate_scale=0.1 scales the vision tower's learning rate, but use_multimodal=false")
  assert before == after and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
  "overrides, mention",
  [
    (dict(freeze_vision_encoder_params=True), "freeze_vision_encoder_params=true freezes it"),
    ({"lora.enable_lora": True}, "only the adapters train"),
  ],
)
def test_tower_learning_rate_on_a_tower_that_does_not_train_is_refused(overrides, mention):
  with pytest.raises(ConfigError, match=mention):
    tiny_config(num_devices=1, decoder_block="gemma3", use_multimodal=True, vision_learning_rate_scale=0.5, **overrides)


def test_llama4_vision_keys_on_another_family_are_refused():
  with pytest.raises(ConfigError, match="tile_size_for_vit=224 shapes llama4's vision tower, not decoder_block=gemma3's; set it to 336"):
    tiny_config(num_devices=1, decoder_block="gemma3", use_multimodal=True, tile_size_for_vit=224)


def test_llama4_adapter_widths_must_agree():
  from maxtext.models import vision_specs

  config = tiny_config(num_devices=1, decoder_block="llama4", use_multimodal=True, chunk_attn_window_size=8, projector_output_dim_for_vit=512)
  with pytest.raises(ConfigError, match="set all three equal"):
    vision_specs.vision(config)


def test_freeze_on_a_text_only_model_is_accepted_as_in_maxtext():
  """MaxText's base.yml sets freeze_vision_encoder_params: true for every model; a text-only model has nothing to freeze."""
  config = tiny_config(num_devices=1, freeze_vision_encoder_params=True)
  assert not config.use_multimodal
