"""SFT documents: conversations (rendered by maxtext.data.chat_template) and prompt/completion columns, as pieces."""

from __future__ import annotations

from typing import Any

from maxtext.data.chat_template import Piece, TemplateSource
from maxtext.errors import ConfigError, DataError

__all__ = ["Piece", "TemplateSource", "check_messages", "prompt_completion", "resolve_chat_template"]


def resolve_chat_template(chat_template: str, chat_template_path: str, tokenizer_template: str | None, tokenizer_path: str) -> TemplateSource | None:
  """The template: chat_template, else the file at chat_template_path, else the tokenizer's own (or None)."""
  if chat_template and chat_template_path:
    raise ConfigError("chat_template and chat_template_path are both set; set only one")
  if chat_template_path:
    try:
      with open(chat_template_path, encoding="utf-8") as f:
        return TemplateSource(f.read(), f"chat_template_path '{chat_template_path}'")
    except (OSError, UnicodeDecodeError) as e:
      raise ConfigError(f"chat_template_path '{chat_template_path}' cannot be read ({type(e).__name__}); fix the path") from None
  if chat_template:
    return TemplateSource(chat_template, "chat_template")
  if tokenizer_template:
    return TemplateSource(tokenizer_template, f"the tokenizer's own template in '{tokenizer_path}'")
  return None


def check_messages(messages: Any, where: str) -> list[dict[str, str]]:
  """A list of {'role', 'content'} turns with string values, else a DataError naming where."""
  if not isinstance(messages, list) or not messages:
    raise DataError(f"{where}: messages must be a non-empty list of {{role, content}} turns; fix the record")
  for turn in messages:
    if not isinstance(turn, dict) or not isinstance(turn.get("role"), str) or not isinstance(turn.get("content"), str):
      raise DataError(f"{where}: each turn needs string 'role' and 'content' fields, got {str(turn)[:60]!r}; fix the record")
  return [{"role": t["role"], "content": t["content"]} for t in messages]


def prompt_completion(prompt: str, completion: str) -> list[Piece]:
  """Plain prompt/completion columns (no template): the prompt is context, the completion is trained on."""
  pieces: list[Piece] = []
  _append(pieces, prompt, False)
  _append(pieces, completion, True)
  return pieces


def _append(pieces: list[Piece], text: str, trainable: bool) -> None:
  if text:
    pieces.append((text, trainable))
