"""SFT documents: conversations rendered with a Jinja chat template, split into prompt and completion pieces."""

from __future__ import annotations

import functools
from typing import Any

from maxtext.errors import ConfigError, DataError

# (text, trainable): completion pieces are trained on; prompt pieces may get zero loss weight.
Piece = tuple[str, bool]


def resolve_chat_template(chat_template: str, chat_template_path: str, tokenizer_template: str | None) -> str | None:
  """The template text: chat_template, else the file at chat_template_path, else the tokenizer's own (or None)."""
  if chat_template and chat_template_path:
    raise ConfigError("chat_template and chat_template_path are both set; set only one")
  if chat_template_path:
    try:
      with open(chat_template_path, encoding="utf-8") as f:
        return f.read()
    except (OSError, UnicodeDecodeError) as e:
      raise ConfigError(f"chat_template_path '{chat_template_path}' cannot be read ({type(e).__name__}); fix the path") from None
  return chat_template or tokenizer_template


@functools.lru_cache(maxsize=8)
def compile_template(source: str):
  """A sandboxed Jinja template (as Hugging Face renders chat templates); a syntax error is a ConfigError."""
  import jinja2
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
  env.globals["raise_exception"] = raise_exception
  try:
    return env.from_string(source)
  except jinja2.exceptions.TemplateSyntaxError as e:
    raise ConfigError(f"chat template has a syntax error at line {e.lineno}: {e.message}; fix chat_template or chat_template_path") from None


def check_messages(messages: Any, where: str) -> list[dict[str, str]]:
  """A list of {'role', 'content'} turns with string values, else a DataError naming where."""
  if not isinstance(messages, list) or not messages:
    raise DataError(f"{where}: messages must be a non-empty list of {{role, content}} turns; fix the record")
  for turn in messages:
    if not isinstance(turn, dict) or not isinstance(turn.get("role"), str) or not isinstance(turn.get("content"), str):
      raise DataError(f"{where}: each turn needs string 'role' and 'content' fields, got {str(turn)[:60]!r}; fix the record")
  return [{"role": t["role"], "content": t["content"]} for t in messages]


def render_messages(messages: list[dict[str, str]], template_source: str, special_tokens: dict[str, str], where: str) -> list[Piece]:
  """Split the rendered conversation into pieces; assistant replies (after any generation prompt) are trainable.

  Renders growing prefixes of the conversation, so each template must render a prefix of the conversation as a
  prefix of the whole (true of ordinary chat templates).
  """
  import jinja2

  template = compile_template(template_source)

  def render(turns: list[dict[str, str]], generation_prompt: bool) -> str:
    if not turns and not generation_prompt:
      return ""
    try:
      return template.render(messages=turns, add_generation_prompt=generation_prompt, **special_tokens)
    except jinja2.exceptions.TemplateError as e:
      raise DataError(f"{where}: the chat template failed ({e}); fix the record or the template") from None

  pieces: list[Piece] = []
  done = ""
  for k, turn in enumerate(messages):
    if turn["role"] == "assistant":
      header = render(messages[:k], True)
      full = render(messages[: k + 1], False)
      _append(pieces, _suffix(done, header, where), False)
      _append(pieces, _suffix(header, full, where), True)
    else:
      full = render(messages[: k + 1], False)
      _append(pieces, _suffix(done, full, where), False)
    done = full
  return pieces


def prompt_completion(prompt: str, completion: str) -> list[Piece]:
  """Plain prompt/completion columns (no template): the prompt is context, the completion is trained on."""
  pieces: list[Piece] = []
  _append(pieces, prompt, False)
  _append(pieces, completion, True)
  return pieces


def _suffix(prefix: str, text: str, where: str) -> str:
  if not text.startswith(prefix):
    raise DataError(f"{where}: the chat template does not render conversations prefix by prefix; use a template whose output only grows turn by turn")
  return text[len(prefix) :]


def _append(pieces: list[Piece], text: str, trainable: bool) -> None:
  if text:
    pieces.append((text, trainable))
