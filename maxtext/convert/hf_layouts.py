"""One tensor rule (a Hugging Face name <-> our parameter path) and the exact layout transforms between the two: transposes
and reshapes only, so HF -> maxtext -> HF round trips bit for bit."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

Array = np.ndarray


@dataclasses.dataclass(frozen=True)
class Rule:
  ours: str  # path under a layer (or global)
  hf: str  # HF name; '{j}' for an expert index
  to_ours: Callable[[Array], Array]
  to_hf: Callable[[Array], Array]
  experts: bool = False  # ours is stacked over experts [n, ...]; hf has one tensor per expert
  part: tuple[int, int] | None = None  # (k, n): ours is to_ours(hf)[..., k::n], the k-th of n interleaved column sets (gpt-oss gate_up)


def identity(x: Array) -> Array:
  return x


def transpose(x: Array) -> Array:
  return np.ascontiguousarray(x.T)


def linear_to_ours(in_shape: tuple[int, ...], out_shape: tuple[int, ...], w: Array) -> Array:
  return np.ascontiguousarray(w.T).reshape(*in_shape, *out_shape)


def linear_to_hf(in_shape: tuple[int, ...], out_shape: tuple[int, ...], w: Array) -> Array:
  return np.ascontiguousarray(w.reshape(int(np.prod(in_shape)), int(np.prod(out_shape))).T)


def linear(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> tuple[Callable, Callable]:
  """HF Linear weight [out, in] <-> our kernel in_shape + out_shape (partials, so that a sliced reader can see the shapes)."""
  return functools.partial(linear_to_ours, in_shape, out_shape), functools.partial(linear_to_hf, in_shape, out_shape)


def bias_to_ours(shape: tuple[int, ...], b: Array) -> Array:
  return np.ascontiguousarray(b).reshape(shape)


def bias_to_hf(shape: tuple[int, ...], b: Array) -> Array:
  return np.ascontiguousarray(b).reshape(-1)


def bias(shape: tuple[int, ...]) -> tuple[Callable, Callable]:
  """HF bias [prod(shape)] <-> our bias of shape."""
  return functools.partial(bias_to_ours, shape), functools.partial(bias_to_hf, shape)


def conv_to_ours(w: Array) -> Array:
  return np.ascontiguousarray(w[:, 0, :].T)


def conv_to_hf(w: Array) -> Array:
  return np.ascontiguousarray(w.T[:, None, :])


def halves_to_interleaved(x: Array) -> Array:
  """[..., 2 n] of two halves -> [..., 2 n] with the halves' columns interleaved (so Rule.part takes each half)."""
  return np.ascontiguousarray(x.reshape(*x.shape[:-1], 2, -1).swapaxes(-1, -2).reshape(x.shape))


def interleaved_to_halves(x: Array) -> Array:
  return np.ascontiguousarray(x.reshape(*x.shape[:-1], -1, 2).swapaxes(-1, -2).reshape(x.shape))


def experts_to_ours(x: Array) -> Array:
  """Stacked per-expert Linear weights [E, out, in] -> our [E, in, out]."""
  return np.ascontiguousarray(np.swapaxes(x, -1, -2))


def scalar_to_ours(x):
  return x.reshape(())


def scalar_to_hf(x):
  return x.reshape(1)
