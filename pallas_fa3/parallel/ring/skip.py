"""Segment ids in the ring: each step's ids (the same rows of the local query
ids and of the visiting kv ids), and `unless_apart`, which skips under
`jax.lax.cond` a step whose ids cannot meet (no attention work, no K/V
read; a local predicate, with no collective inside the `cond`):
docs/design_notes.md#ring-attention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallas_fa3.segments import SegmentIds


def rows(x: Any, start: Any, size: int, axis: int = 1) -> Any:
  """`size` rows of `x` from `start` along `axis` (None stays None; every
  row is `x` itself)."""
  if x is None:
    return None
  if isinstance(start, int) and start == 0 and size == x.shape[axis]:
    return x
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def block_ids(
  q_ids: jax.Array | None, kv_ids: jax.Array | None
) -> SegmentIds | None:
  """The ids of one step's block, or None without segment ids."""
  if q_ids is None:
    return None
  return SegmentIds(q_ids, kv_ids)


def can_meet(ids: SegmentIds) -> jax.Array:
  """Whether some batch row's query and key id ranges overlap (bool
  scalar): False means no query of the block sees any key of it."""
  q_lo, q_hi = ids.q.min(axis=1), ids.q.max(axis=1)
  kv_lo, kv_hi = ids.kv.min(axis=1), ids.kv.max(axis=1)
  return jnp.any((q_lo <= kv_hi) & (kv_lo <= q_hi))


def unless_apart(
  ids: SegmentIds | None, step: Callable[[Any], Any], state: Any
) -> Any:
  """`step(state)`, or `state` unchanged when `ids` cannot meet (a real
  skip: `lax.cond`); `step(state)` as is without ids."""
  if ids is None:
    return step(state)
  return jax.lax.cond(can_meet(ids), step, lambda s: s, state)
