"""Split-KV (flash-decoding): merging the partial results of key ranges.

A decode backend may cut each sequence's keys into `num_splits` ranges and
attend to each on its own, giving per range a float32 output normalized
over that range and its natural-log lse (-inf for a range that sees no
key). The whole is their log-sum-exp merge, with the sinks (if any) as one
more term that has no value:

    lse = log(sum_s exp(lse_s) + exp(sink)),  out = sum_s exp(lse_s - lse) out_s

Shared by the blockwise twin and the Hopper decode kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
