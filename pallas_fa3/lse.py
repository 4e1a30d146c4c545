"""The log-sum-exp residual: natural log outside, base 2 inside, and the
split-KV merge. Every backend returns lse in natural log (float32 `[batch,
heads_q, seq_q]`); the kernels and the blockwise twin keep their running max
in base 2, and `natural_from_log2` converts so that the backward's round
trip is exact where float32 allows (large logits). A decode backend may cut
each sequence's keys into ranges; `combine_splits` merges their partial
outputs and lses (with the sinks as one more term that has no value).
docs/numerics.md#large-logits
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_fa3.spec import LOG2E

LN2 = math.log(2.0)


def _step(x: jax.Array, up: bool) -> jax.Array:
  """The float32 next to finite `x` towards +inf (`up`) or -inf."""
  bits = lax.bitcast_convert_type(x, jnp.int32)
  away = (x >= 0) == up  # away from zero: one more in the bit pattern
  bits = jnp.where(away, bits + 1, bits - 1)
  bits = jnp.where(x == 0, jnp.where(up, 1, -(2**31) + 1), bits)
  return lax.bitcast_convert_type(bits, jnp.float32)


def log2_of(lse: jax.Array) -> jax.Array:
  """`lse * log2(e)` rounded once (not contracted into a later FMA): how
  every backward reads the residual."""
  return lax.optimization_barrier(lse * jnp.float32(LOG2E))


def natural_from_log2(t: jax.Array) -> jax.Array:
  """The natural-log lse for a base-2 one `t` (float32): of `t * ln 2` and
  its two float32 neighbours, the largest with `log2_of(lse) <= t` (the
  lower neighbour if none: then off by a rounding, which the backward's
  clamp absorbs). Infinities and NaN pass through."""
  lse = t * jnp.float32(LN2)
  up, down = _step(lse, True), _step(lse, False)
  fits = lambda c: c * jnp.float32(LOG2E) <= t
  out = jnp.where(fits(up), up, jnp.where(fits(lse), lse, down))
  return jnp.where(jnp.abs(t) < jnp.inf, out, lse)  # (no isfinite in Mosaic)


def combine_splits(
  outs: jax.Array, lses: jax.Array, sinks: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
  """(out, lse) from partials.

  Args:
    outs: float32 `[splits, ..., rows, dv]`, each normalized over its range.
    lses: float32 `[splits, ..., rows]` (natural log; -inf: empty range).
    sinks: float32 broadcasting against `lses[0]`, or None.

  Returns:
    float32 out `[..., rows, dv]` (0 where nothing is seen) and lse
    `[..., rows]` (-inf where nothing is seen and there is no sink).
  """
  top = jnp.max(lses, axis=0)
  if sinks is not None:
    top = jnp.maximum(top, sinks)
  ref = jnp.where(jnp.isfinite(top), top, 0.0)
  weights = jnp.exp(lses - ref)  # 0 for empty ranges
  total = weights.sum(axis=0)
  if sinks is not None:
    total = total + jnp.exp(sinks - ref)
  empty = total == 0.0
  lse = jnp.where(empty, -jnp.inf, ref + jnp.log(jnp.where(empty, 1.0, total)))
  scale = weights / jnp.where(empty, 1.0, total)
  out = jnp.sum(
    scale[..., None] * jnp.where(weights[..., None] > 0, outs, 0.0), axis=0
  )
  return out, lse
