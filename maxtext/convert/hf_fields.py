"""Typed reads of a Hugging Face config.json's fields.

Every field maxtext derives a config key from is read through `HFFields`: a required field that is missing or null,
a bool where a number belongs (JSON's `true` is not 1 layer), a string where a number belongs ("ten", "2"), a number
out of range or a section that is not an object is a one-line ConfigError naming the file and the field, never a
KeyError, a ValueError or a silent cast.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from maxtext.errors import ConfigError

REQUIRED: Any = object()  # the default of a field that must be present


class HFFields:
  """The fields of one JSON object of a config.json (the file itself, or a section such as rope_scaling).

  source names the file in messages; prefix is the section's path ('rope_scaling.'); names overrides the name a
  message gives a key (a merged section whose keys come from two places). A null field counts as absent.
  """

  def __init__(self, values: Mapping[str, Any], source: str = "config.json", prefix: str = "", names: Mapping[str, str] | None = None) -> None:
    self.values, self.source, self.prefix, self.names = values, source, prefix, dict(names or {})

  def name(self, key: str) -> str:
    """How messages name the field: "config.json's rope_scaling.factor"."""
    return f"{self.source}'s {self.names.get(key, self.prefix + key)}"

  def has(self, key: str) -> bool:
    return self.values.get(key) is not None

  def _value(self, key: str, default: Any) -> Any:
    value = self.values.get(key)
    if value is None and default is REQUIRED:
      state = "is null" if key in self.values else "is missing"
      raise ConfigError(f"{self.name(key)} {state}; maxtext needs it to build the model: fix the file or re-download the model")
    return value

  def _bad(self, key: str, value: Any, want: str) -> ConfigError:
    shown = json.dumps(value, default=str)  # as the file writes it: true, "ten"
    shown = shown if len(shown) <= 80 else f"{shown[:80]}... ({len(shown)} characters)"
    return ConfigError(f"{self.name(key)} is {shown}, not {want}; fix the file or re-download the model")

  def int(self, key: str, default: Any = REQUIRED, minimum: int = 1) -> Any:
    """A whole number >= minimum (4096.0 reads as 4096; true, "2" and 2.5 are errors); default when absent."""
    value = self._value(key, default)
    if value is None:
      return default
    whole = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value) and value.is_integer())
    if isinstance(value, bool) or not whole or value < minimum:
      raise self._bad(key, value, f"a whole number >= {minimum}")
    return int(value)

  def number(self, key: str, default: Any = REQUIRED, minimum: float | None = None, positive: bool = False) -> Any:
    """A finite number (> 0 with positive, >= minimum with minimum); default when absent."""
    value = self._value(key, default)
    if value is None:
      return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (positive and value <= 0) or (minimum is not None and value < minimum):
      raise self._bad(key, value, "a number > 0" if positive else f"a number >= {minimum}" if minimum is not None else "a finite number")
    return float(value)

  def flag(self, key: str, default: bool) -> bool:
    """true or false; default when absent."""
    value = self._value(key, default)
    if value is None:
      return default
    if not isinstance(value, bool):
      raise self._bad(key, value, "true or false")
    return value

  def text(self, key: str, default: Any = REQUIRED) -> Any:
    """A string; default when absent."""
    value = self._value(key, default)
    if value is None:
      return default
    if not isinstance(value, str):
      raise self._bad(key, value, "a string")
    return value

  def texts(self, key: str) -> list[str] | None:
    """A list of strings; None when absent."""
    value = self.values.get(key)
    if value is None:
      return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
      raise self._bad(key, value, "a list of strings")
    return value

  def section(self, key: str) -> HFFields:
    """The JSON object under key (empty when absent or null)."""
    value = self.values.get(key)
    if value is None:
      value = {}
    if not isinstance(value, Mapping):
      raise self._bad(key, value, "an object of settings")
    return HFFields(value, self.source, f"{self.names.get(key, self.prefix + key)}.")
