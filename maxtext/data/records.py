"""Raw records -> fields: JSON objects, serialized tf.train.Example protos (decoded without TensorFlow), dicts."""

from __future__ import annotations

import json
import struct
from typing import Any

from maxtext.errors import DataError


def decode_record(raw: Any, where: str) -> dict[str, Any]:
  """A record as a dict: dicts pass through; bytes are a JSON object or a tf.train.Example."""
  if isinstance(raw, dict):
    return raw
  if isinstance(raw, (bytes, bytearray, memoryview)):
    data = bytes(raw)
    if data[:1] == b"{":
      try:
        obj = json.loads(data)
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{where}: malformed JSON record ({getattr(e, 'msg', type(e).__name__)}); fix or remove the record") from None
      if isinstance(obj, dict):
        return obj
    try:
      return parse_tf_example(data)
    except ValueError as e:
      raise DataError(f"{where}: not a JSON object or tf.train.Example record ({e}); write records in one of these formats") from None
  raise DataError(f"{where}: unsupported record type {type(raw).__name__}; records must be JSON objects or tf.train.Example protos")


# --- tf.train.Example wire format -------------------------------------------------------------
# Example{features=1: Features{feature=1: map<string, Feature>}}; map entry{key=1, value=2};
# Feature{bytes_list=1: BytesList{value=1 (repeated bytes)}, float_list=2, int64_list=3}.


def parse_tf_example(data: bytes) -> dict[str, Any]:
  """Decode a serialized tf.train.Example: bytes features -> bytes (one value) or list of bytes; numeric -> list."""
  out: dict[str, Any] = {}
  for field, wire, value in _fields(data):
    if field != 1 or wire != 2:
      continue
    for f2, w2, entry in _fields(value):
      if f2 != 1 or w2 != 2:
        continue
      key, feature = "", b""
      for f3, w3, v3 in _fields(entry):
        if f3 == 1 and w3 == 2:
          key = bytes(v3).decode("utf-8")
        elif f3 == 2 and w3 == 2:
          feature = v3
      out[key] = _feature_value(feature)
  return out


def _feature_value(feature: bytes) -> Any:
  for kind, wire, payload in _fields(feature):
    if wire != 2:
      continue
    if kind == 1:
      values = [bytes(v) for f, w, v in _fields(payload) if f == 1 and w == 2]
      return values[0] if len(values) == 1 else values
    if kind == 2:
      packed = b"".join(bytes(v) for f, w, v in _fields(payload) if f == 1 and w == 2)
      return list(struct.unpack(f"<{len(packed) // 4}f", packed[: len(packed) // 4 * 4]))
    if kind == 3:
      packed = b"".join(bytes(v) for f, w, v in _fields(payload) if f == 1 and w == 2)
      values, pos = [], 0
      while pos < len(packed):
        v, pos = _varint(packed, pos)
        values.append(v - (1 << 64) if v >= 1 << 63 else v)
      return values
  return []


def _varint(data: bytes, pos: int) -> tuple[int, int]:
  result, shift = 0, 0
  while True:
    if pos >= len(data):
      raise ValueError("truncated varint")
    b = data[pos]
    pos += 1
    result |= (b & 0x7F) << shift
    if not b & 0x80:
      return result, pos
    shift += 7
    if shift > 63:
      raise ValueError("varint too long")


def _fields(data: bytes):
  """(field number, wire type, value) of each field of a protobuf message."""
  pos, end = 0, len(data)
  while pos < end:
    tag, pos = _varint(data, pos)
    field, wire = tag >> 3, tag & 7
    if wire == 0:
      value, pos = _varint(data, pos)
    elif wire == 1:
      value, pos = data[pos : pos + 8], pos + 8
    elif wire == 2:
      length, pos = _varint(data, pos)
      if pos + length > end:
        raise ValueError("truncated field")
      value, pos = data[pos : pos + length], pos + length
    elif wire == 5:
      value, pos = data[pos : pos + 4], pos + 4
    else:
      raise ValueError(f"bad wire type {wire}")
    yield field, wire, value


def encode_tf_example(features: dict[str, str | bytes]) -> bytes:
  """Serialize text features as a tf.train.Example (for writing ArrayRecord test and conversion data)."""

  def ld(field: int, payload: bytes) -> bytes:
    return _encode_varint(field << 3 | 2) + _encode_varint(len(payload)) + payload

  entries = b""
  for key, value in features.items():
    raw = value.encode("utf-8") if isinstance(value, str) else value
    feature = ld(1, ld(1, raw))
    entries += ld(1, ld(1, key.encode("utf-8")) + ld(2, feature))
  return ld(1, entries)


def _encode_varint(n: int) -> bytes:
  out = bytearray()
  while True:
    b = n & 0x7F
    n >>= 7
    out.append(b | (0x80 if n else 0))
    if not n:
      return bytes(out)


# --- fields -> text ---------------------------------------------------------------------------


def text_field(record: dict[str, Any], column: str, where: str) -> str:
  """The text in record[column]; a missing or non-text column is a DataError naming where."""
  if column not in record:
    keys = ", ".join(sorted(map(str, record))[:8]) or "none"
    raise DataError(f"{where}: no column '{column}' (columns: {keys}); set train_data_columns to the text column")
  value = record[column]
  if isinstance(value, bytes):
    try:
      return value.decode("utf-8")
    except UnicodeDecodeError:
      raise DataError(f"{where}: column '{column}' holds bytes that are not UTF-8 text; set train_data_columns to a text column") from None
  if isinstance(value, str):
    return value
  if value is None:
    return ""
  raise DataError(f"{where}: column '{column}' is not text ({type(value).__name__}); set train_data_columns to a text column")
