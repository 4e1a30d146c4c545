"""`stable_max`: the repeated-max fix of Qiu and Yao (arXiv 2510.04212), which
moves a score tile's stabilizing max when the row max repeats (exact in real
arithmetic, rows without ties bit for bit unchanged): its settings
(`StableMax`), their checks and the per-tile shift the blockwise backend
applies; the bias it removes and the rule: docs/numerics.md#stable_max.

Example:
  >>> import jax, pallas_fa3
  >>> q = jax.random.normal(jax.random.key(0), (1, 64, 2, 32), "bfloat16")
  >>> out = pallas_fa3.flash_attention(q, q, q, stable_max=True)
  >>> out2 = pallas_fa3.flash_attention(
  ...     q, q, q, stable_max=pallas_fa3.StableMax(beta=4.0))
  >>> out.shape == out2.shape == q.shape
  True
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# The paper's beta range is [2, 8] (its figure uses 7); the authors' code
# uses beta = 2 with ties counted within 1e-3 of the max (in units of the
# scaled scores, natural log).
DEFAULT_BETA = 2.0
DEFAULT_TIE_TOLERANCE = 1e-3

# Cap on the shift m - r_m, in powers of two, per dtype of P. bf16 and f32
# share float32's exponent range: 2^-64 is far from underflow (2^-126). In
# fp16 P's smallest normal is 2^-14 and the subnormals end at 2^-24, so a
# shift of 8 keeps the largest P normal while losing only entries below
# 2^-16 of it (less than fp16's epsilon 2^-10 relative to the row sum).
_MAX_SHIFT_LOG2 = {
  jnp.dtype(jnp.bfloat16): 64.0,
  jnp.dtype(jnp.float32): 64.0,
  jnp.dtype(jnp.float16): 8.0,
}


@dataclasses.dataclass(frozen=True)
class StableMax:
  """Settings of the repeated-max fix (hashable: part of a static config).

  Attributes:
    beta: the multiplier of a positive repeated max, > 1 (paper: 2..8).
    tie_tolerance: entries within this of the tile's max (in units of the
      scaled scores, `softmax_scale * q . k`) count as ties; >= 0.
  """

  beta: float = DEFAULT_BETA
  tie_tolerance: float = DEFAULT_TIE_TOLERANCE

  def __post_init__(self) -> None:
    for name, low, strict in (
      ("beta", 1.0, True),
      ("tie_tolerance", 0.0, False),
    ):
      value = getattr(self, name)
      if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, numbers.Real
      ):
        raise TypeError(
          f"StableMax.{name} must be a real number; got"
          f" {value!r} of type {type(value).__name__}"
        )
      value = float(value)
      if not math.isfinite(value) or value < low or (strict and value == low):
        bound = f"> {low}" if strict else f">= {low}"
        raise ValueError(
          f"StableMax.{name} must be finite and {bound}; got"
          f" {getattr(self, name)!r}"
        )
      object.__setattr__(self, name, value)


def check_stable_max(stable_max: Any) -> StableMax | None:
  """Validates `flash_attention(stable_max=...)`: None/False, True or a StableMax."""
  if (
    stable_max is None
    or stable_max is False
    or (isinstance(stable_max, np.bool_) and not stable_max)
  ):
    return None
  if stable_max is True or isinstance(stable_max, np.bool_):
    return StableMax()
  if isinstance(stable_max, StableMax):
    return stable_max
  raise TypeError(
    "stable_max must be None, a bool or a pallas_fa3.StableMax; got"
    f" {stable_max!r} of type {type(stable_max).__name__}"
  )


def max_shift_log2(p_dtype: Any) -> float:
  """The cap on `m - r_m` in powers of two for P stored in `p_dtype`."""
  return _MAX_SHIFT_LOG2[jnp.dtype(p_dtype)]


def tile_max(
  s: jax.Array, settings: StableMax, *, unit: float, max_shift: float
) -> jax.Array:
  """The stabilizing max of each row of a score tile, per the fix.

  Args:
    s: scores `[..., block_kv]` (masked entries -inf), in any unit where the
      scaled score x is `s / unit` (1 for natural-log scores, log2(e) for the
      base-2 scores of the exp2 kernels).
    settings: beta and the tie tolerance (natural-log units).
    unit: see `s`.
    max_shift: cap on `m - r_m`, in the units of `s`.

  Returns:
    m `[...]`, >= the row max, equal to it where the row has no tie, and -inf
    for rows whose every entry is masked.
  """
  r_m = s.max(axis=-1)
  ties = (s >= (r_m - settings.tie_tolerance * unit)[..., None]).sum(axis=-1)
  repeated = (ties > 1) & jnp.isfinite(r_m)
  shift = jnp.where(r_m > 0, (settings.beta - 1.0) * r_m, -r_m)
  shift = jnp.where(repeated, jnp.minimum(shift, max_shift), 0.0)
  return r_m + shift.astype(r_m.dtype)
