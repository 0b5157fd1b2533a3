"""decode's use_chat_template: the prompt as one user turn of the chat template (chat_template, chat_template_path or
the tokenizer's own), followed by its generation prompt, and the token that ends the template's assistant turn."""

from __future__ import annotations

from typing import Any

from maxtext.errors import ConfigError


def render_prompt(config: Any, tokenizer: Any) -> tuple[str, int | None]:
  """(the templated prompt text, the id of the template's end-of-turn token, None when it is not one token)."""
  from maxtext.data.chat_template import ChatTemplate
  from maxtext.data.sft import resolve_chat_template

  source = resolve_chat_template(config.chat_template, config.chat_template_path, tokenizer.chat_template, tokenizer.path)
  if source is None:
    raise ConfigError(
      f"use_chat_template=true but the tokenizer '{tokenizer.path}' has no chat template; set chat_template or chat_template_path, or drop use_chat_template"
    )
  template = ChatTemplate(source)
  try:  # an empty assistant reply: the pieces before it are the prompt, what it renders is the end of a turn
    turns = [{"role": "user", "content": config.prompt}, {"role": "assistant", "content": ""}]
    pieces = template.pieces(turns, tokenizer.special_tokens, "decode's prompt")
  finally:
    template.close()
  prompt = "".join(text for text, trainable in pieces if not trainable)
  end = tokenizer.encode("".join(text for text, trainable in pieces if trainable).strip())
  return prompt, (end[0] if len(end) == 1 else None)
