"""The log-sum-exp residual: natural log outside, base 2 inside.

Every backend returns lse in natural log (float32 `[batch, heads_q, seq_q]`);
the kernels and the blockwise twin keep their running max in base 2 and
their backward reads `lse2 = round(lse * log2(e))`. At large logits
(|scores| ~ 1e10, where one ulp is ~1000) a naive conversion `(m2 + log2 l)
* ln 2` does not come back to `m2 + log2 l` when multiplied by log2(e):
the backward's P for a row's max would be `exp2(-1000) = 0` instead of 1.
`natural_from_log2` picks, among the float32 neighbours of the naive value,
the largest whose product with log2(e) does not exceed the base-2 value, so
the round trip is exact where float32 allows (the backward clamps P's
exponent at 0). docs/numerics.md#large-logits.
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
