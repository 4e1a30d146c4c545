"""Segment ids in the sm90 forward kernel: its operands and refs.

The kernel takes, per query row, the bounds `[lo, hi)` of the keys of its
segment (`segments.key_bounds`, exact when every id's keys are contiguous,
as packed documents are) and, per CTA query tile, the span of K/V tiles
those rows reach (`segments.spans_from_bounds`): the producer streams only
those; each consumer keeps its rows' bounds in registers and masks with two
compares per score, as for a two-sided window.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pallas_fa3 import segments
from pallas_fa3.kernels.sm90.common import QueryPlan, pad_axis


@dataclasses.dataclass(frozen=True)
class SegmentRefs:
  """A consumer's segment refs: the rows' key bounds (global `[b, sq_pad]`
  each), their shared tile `[2, consumers, block_q]`, and the K/V tile
  spans `[2, b, q_tiles]`."""

  lo: Any
  hi: Any
  bounds_smem: Any
  spans: Any


def id_operands(plan: QueryPlan, lo: jax.Array, hi: jax.Array) -> tuple:
  """(lo, hi, spans): the bounds padded to whole tiles (padded rows see
  nothing) and the `[2, b, q_tiles]` K/V tile spans per CTA tile."""
  first, end = segments.spans_from_bounds(
    lo, hi, plan.rows_per_cta, plan.config.block_kv, plan.num_kv_blocks
  )
  return (
    pad_axis(lo, 1, plan.seq_q_pad),
    pad_axis(hi, 1, plan.seq_q_pad),
    jnp.stack([first, end]),
  )


def bounds_mask(
  cols: jax.Array, lo: jax.Array, hi: jax.Array, kv0: Any, shape: tuple
) -> jax.Array:
  """`lo[row] <= kv0 + col < hi[row]` over a `shape` tile from the column
  index vector and the rows' bounds (no index tile in registers)."""
  keys = lax.broadcast_in_dim(cols, shape, [1])
  first = lax.broadcast_in_dim(lo - kv0, shape, [0])
  return (keys >= first) & (keys < lax.broadcast_in_dim(hi - kv0, shape, [0]))
