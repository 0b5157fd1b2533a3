"""configs/base.yml and the pydantic schema stay one source of truth."""

from pathlib import Path

import pydantic
import pytest
import yaml

from maxtext.config import MaxTextConfig, all_keys, from_overrides
from maxtext.config.maxtext_config import DERIVED_KEYS, SECTION_CLASSES
from maxtext.config.render import render_base_yml

ROOT = Path(__file__).resolve().parents[1]
BASE_YML = ROOT / "configs" / "base.yml"


def test_base_yml_is_rendered_from_the_schema():
  assert BASE_YML.read_text() == render_base_yml(), "configs/base.yml is stale: run `python scripts/render_base_yml.py`"


def test_every_field_is_in_base_yml_with_its_default():
  data = yaml.safe_load(BASE_YML.read_text())
  for key in MaxTextConfig.model_fields:
    if key in DERIVED_KEYS:
      assert key not in data, f"derived key {key} must not be in base.yml"
      continue
    assert key in data, f"{key} missing from base.yml"
    default = MaxTextConfig.model_fields[key].get_default(call_default_factory=True)
    if isinstance(default, pydantic.BaseModel):
      assert data[key] == default.model_dump(), key
    else:
      expected = [list(v) if isinstance(v, tuple) else v for v in default] if isinstance(default, list) else default
      assert data[key] == expected, key
  assert set(data) == set(MaxTextConfig.model_fields) - DERIVED_KEYS


def test_every_field_is_typed_and_described():
  for cls in SECTION_CLASSES:
    for name, field in cls.model_fields.items():
      assert field.description and "\n" not in field.description, f"{cls.__name__}.{name} needs a one-line description"
      assert field.annotation is not None
  for name, field in MaxTextConfig.model_fields["lora"].annotation.model_fields.items():
    assert field.description, name
  assert "lora.enable_lora" in all_keys() and "emb_dim" not in all_keys()


def test_config_is_read_only():
  config = from_overrides(num_devices=1)
  with pytest.raises(pydantic.ValidationError):
    config.steps = 3
  with pytest.raises(pydantic.ValidationError):
    config.lora.lora_rank = 3
