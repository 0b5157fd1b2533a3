"""Learning-rate schedules: linear warmup, then cosine or warmup-stable-decay (wsd).

The schedule spans learning_rate_schedule_steps; past its end the rate is 0 (as in MaxText).
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

from maxtext.config import MaxTextConfig


def _cosine(init: float, final: float, steps: int) -> optax.Schedule:
  def schedule(count):
    frac = jnp.minimum(count / max(steps, 1), 1.0)
    return final + (init - final) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))

  return schedule


def learning_rate_schedule(config: MaxTextConfig) -> optax.Schedule:
  """step -> learning rate (a jnp scalar); pure and jittable."""
  peak = config.learning_rate
  final = peak * config.learning_rate_final_fraction
  total = config.learning_rate_schedule_steps
  warmup = int(config.warmup_steps_fraction * total)
  pieces: list[optax.Schedule] = [optax.linear_schedule(0.0, peak, warmup)] if warmup else []
  boundaries: list[int] = [warmup] if warmup else []
  rest = total - warmup
  if config.lr_schedule_type == "cosine":
    pieces.append(_cosine(peak, final, rest))
  else:
    decay = int(config.wsd_decay_steps_fraction * total)
    stable = rest - decay
    pieces.append(optax.constant_schedule(peak))
    boundaries.append(warmup + stable)
    decay_fn = optax.linear_schedule(peak, final, decay) if config.wsd_decay_style == "linear" else _cosine(peak, final, decay)
    pieces.append(decay_fn)
  boundaries.append(total)
  pieces.append(optax.constant_schedule(0.0))
  # join_schedules passes each piece the count relative to its boundary.
  return optax.join_schedules(pieces, boundaries[: len(pieces) - 1])
