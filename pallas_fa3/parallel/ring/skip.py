"""Segment ids in the ring: each step's ids, and skipping steps that cannot
meet.

A ring step attends a block of local query rows to a block of the visiting
K/V rows. With segment ids, the step's ids are the same rows of the local
query ids and of the visiting kv ids (which travel with their K/V shard).
When no batch row's query id range (min to max) overlaps its key id range,
no query of the block can see a key of it: its partial result is empty
(out 0, lse -inf) and its gradients are zero, so `unless_apart` runs the
step under `jax.lax.cond` and the false branch leaves the accumulators as
they are -- no attention work, no K/V read (under `jax.vmap` a `cond`
becomes a select and both branches run). The test is safe (it never skips
a block with a visible pair) and, for sorted (packed) ids, usually tight;
padding ids (e.g. -1) widen a block's range.

The predicate is local data: every device decides alone, and no collective
runs inside the `cond` (the ring's `ppermute`s stay outside it).
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
