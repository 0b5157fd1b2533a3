"""Bridges to other projects' tools: lm_eval_backend is maxtext as an lm-evaluation-harness model (`--model maxtext`)."""

from __future__ import annotations

import importlib.util

from maxtext.errors import ConfigError


def require_lm_eval() -> None:
  """lm-evaluation-harness must be installed (the `harness` extra); else a one-line ConfigError saying how."""
  if importlib.util.find_spec("lm_eval") is None:
    raise ConfigError("lm-evaluation-harness is not installed; install it with pip install -e '.[harness]' (or pip install lm_eval==0.4.13)")
