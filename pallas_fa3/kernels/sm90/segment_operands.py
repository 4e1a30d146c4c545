"""Segment ids in the sm90 kernels: their operands and refs.

The forward and dQ kernels take, per query row, the bounds `[lo, hi)` of
the keys of its segment (`segments.key_bounds`, exact when every id's keys
are contiguous, as packed documents are) and, per CTA query tile, the span
of K/V tiles those rows reach (`segments.spans_from_bounds`): the producer
streams only those; each consumer keeps its rows' bounds in registers and
masks with two compares per score, as for a two-sided window.

The dK/dV kernels take the mirror image: per key, the bounds of the queries
of its segment (`segments.query_bounds`, exact when every id's queries are
contiguous), loaded once per CTA into registers, and per K/V CTA the span
of query tiles that reach its keys. (Their shared-tile layout, with query
rows, masks by the query rows' key bounds like the dQ kernel.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa3 import segments
from pallas_fa3.kernels.sm90.common import QueryPlan, pad_axis, tile_span
from pallas_fa3.kernels.sm90.ops import KernelOps


@dataclasses.dataclass(frozen=True)
class SegmentRefs:
  """A kernel's segment refs: the bounds (global `[b, s_pad]` each, per
  query row in the forward and dQ kernels, per key in dK/dV), their shared
  tiles `[2, n, rows]` (None in dK/dV: loaded from global memory), and the
  tile spans `[2, b, tiles]`."""

  lo: Any
  hi: Any
  bounds_smem: Any
  spans: Any


def id_operands(plan: QueryPlan, lo: jax.Array, hi: jax.Array) -> tuple:
  """(lo, hi, spans): the rows' key bounds padded to whole tiles (padded
  rows see nothing) and the `[2, b, q_tiles]` K/V tile spans per CTA
  tile (the forward and dQ kernels)."""
  lo, hi = pad_axis(lo, 1, plan.seq_q_pad), pad_axis(hi, 1, plan.seq_q_pad)
  first, end = segments.spans_from_bounds(  # one span per CTA tile
    lo, hi, plan.rows_per_cta, plan.config.block_kv, plan.num_kv_blocks
  )
  return lo, hi, jnp.stack([first, end])


def dkdv_operands(plan: Any, bounds: tuple) -> tuple:
  """(lo, hi, spans) of a dK/dV kernel (`DkdvPlan`) from `bounds = (lo, hi,
  q_lo, q_hi)`: each key's query bounds padded to whole CTAs (padded keys
  are seen by no query); in the shared-tile layout, whose tiles have query
  rows, each query row's key bounds padded to whole tiles instead (cheaper
  per-row vectors, and exact too: the backward needs both kinds of ids
  contiguous). `spans`: the `[2, b, kv_ctas]` query tile spans per K/V CTA.
  """
  lo, hi, q_lo, q_hi = bounds
  first, end = query_tile_spans(plan, q_lo, q_hi)
  if plan.shared:
    rows = (pad_axis(lo, 1, plan.seq_q_pad), pad_axis(hi, 1, plan.seq_q_pad))
  else:
    rows = (
      pad_axis(q_lo, 1, plan.seq_kv_pad),
      pad_axis(q_hi, 1, plan.seq_kv_pad),
    )
  return (*rows, jnp.stack([first, end]))


def query_tile_spans(plan: Any, q_lo: jax.Array, q_hi: jax.Array) -> tuple:
  """(first, end) query tiles `[b, kv_ctas]` that reach each K/V CTA's keys
  (a contiguous superset; `end <= first` when none does)."""
  return segments.spans_from_bounds(  # one span per CTA
    pad_axis(q_lo, 1, plan.seq_kv_pad),
    pad_axis(q_hi, 1, plan.seq_kv_pad),
    plan.kv_rows_per_cta,
    plan.config.block_q,
    plan.num_q_blocks,
  )


def cta_span(seg: SegmentRefs | None, batch: Any, cta: Any) -> Any:
  """The CTA's span `(first, end)` (None without segment ids)."""
  return None if seg is None else tile_span(seg.spans, batch, cta)


def load_bounds(
  seg: SegmentRefs,
  ops: KernelOps,
  batch: Any,
  start: Any,
  n: int,
  *,
  as_rows: bool,
) -> tuple[jax.Array, jax.Array]:
  """The bounds of positions `[start, start + n)` (keys' query bounds, or
  in the shared-tile dK/dV layout query rows' key bounds) in registers,
  loaded straight from global memory: no shared tile, whose 1 KiB
  alignment the d256 kernels cannot spare. Per-row or per-column vectors of
  an accumulator."""
  return tuple(
    ops.load_global(ref.at[batch, pl.ds(start, n)], as_rows=as_rows)
    for ref in (seg.lo, seg.hi)
  )


def bounds_scratch(rows: int, blocks: int) -> tuple:
  """The rows' key bounds' shared tiles `[2, blocks, rows]` int32 (they
  arrive by TMA with the rows' other tiles)."""
  return (plgpu.SMEM((2, blocks, rows), jnp.int32),)


def tile_index(start: Any, rows: int) -> Any:
  """The tile number of the tile starting at row `start`."""
  return lax.div(start, jnp.int32(rows))
