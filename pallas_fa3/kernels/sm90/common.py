"""What the sm90 kernels share: register budgets, the query-tile plan and
its K/V walk, shared-memory layouts, padding, release barriers, the kernel
build settings, and the segment-id operands (per query row the bounds of
its keys, per key those of its queries, per tile the span of tiles they
reach). The K/V producer is `pipeline.kv_producer`.
docs/design_notes.md#forward-kernel
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa3 import masking, segments
from pallas_fa3.kernels.sm90 import compat, hardware
from pallas_fa3.kernels.sm90.config import NUM_CONSUMERS, Sm90ForwardConfig
from pallas_fa3.kernels.sm90.ops import KernelOps
from pallas_fa3.spec import AttentionSpec, cdiv

# setmaxnreg per warpgroup role, within the CTA's register pool
# (`hardware.split_problems`). Two consumers: FA3's split, 2 * 240 + 24 = 504
# = 3 x 168, the whole pool of a 384-thread CTA (the producer only computes
# addresses). One consumer (a 256-thread CTA): 256, and the producer keeps
# 64 of the 512. docs/design_notes.md#setmaxnreg-splits.
PRODUCER_REGS = 24
CONSUMER_REGS = 240
LONE_CONSUMER_REGS = 256
LONE_PRODUCER_REGS = 64
hardware.check_split(3, CONSUMER_REGS, PRODUCER_REGS)
hardware.check_split(2, LONE_CONSUMER_REGS, LONE_PRODUCER_REGS)


def consumer_regs(consumers: int) -> int:
  """setmaxnreg of a consumer warpgroup in a CTA with `consumers` of them."""
  return CONSUMER_REGS if consumers == 2 else LONE_CONSUMER_REGS


def producer_regs(consumers: int) -> int:
  """setmaxnreg of the producer warpgroup beside `consumers` consumers."""
  return PRODUCER_REGS if consumers == 2 else LONE_PRODUCER_REGS


@dataclasses.dataclass(frozen=True)
class QueryPlan:
  """Static facts of one kernel instance."""

  spec: AttentionSpec
  config: Sm90ForwardConfig
  seq_q_pad: int
  seq_kv_pad: int
  # Query-row blocks of `block_q` per CTA: one per consumer, or one shared
  # block (the dQ kernel with one consumer, or two sharing the rows).
  row_blocks: int = NUM_CONSUMERS

  @property
  def rows_per_cta(self) -> int:
    return self.row_blocks * self.config.block_q

  @property
  def num_kv_blocks(self) -> int:
    """K/V tiles that hold a key. Not `seq_kv_pad // block_kv`: the dQ
    kernel's keys are padded to the dK/dV kernel's CTAs, and a tile wholly
    past seq_kv, walked unmasked, put P = exp2(-lse) times zero V into dS
    (dQ stayed right, K's rows being zero; the score_mod arrays' row sums
    of dS did not) for nothing."""
    return cdiv(self.spec.seq_kv, self.config.block_kv)

  @property
  def num_q_tiles(self) -> int:
    return self.seq_q_pad // self.rows_per_cta

  @property
  def num_tiles(self) -> int:
    """Query tiles of the whole call (every batch and head)."""
    return self.spec.batch * self.spec.heads_q * self.num_q_tiles

  @property
  def needs_mask(self) -> bool:
    return self.spec.masked or self.spec.seq_kv % self.config.block_kv != 0


def kv_steps(
  plan: QueryPlan, row0: Any, rows: int
) -> tuple[jax.Array, jax.Array]:
  """(steps, unmasked steps) for the query rows [row0, row0 + rows).

  `steps` counts the leading K/V tiles any row sees (at least 1, so that a
  tile that sees nothing still runs one fully masked step and writes
  out = 0, lse = -inf); the first `unmasked` of them are visible to every
  row and skip the mask.
  """
  spec, bkv = plan.spec, plan.config.block_kv
  n = masking.num_kv_blocks_visible(spec, row0 + rows, bkv, plan.num_kv_blocks)
  n = jnp.maximum(jnp.asarray(n, jnp.int32), 1)
  full = spec.seq_kv // bkv  # tiles with no padded key
  if spec.causal:
    # Row row0 (the tile's first) sees keys up to row0 + offset.
    seen = row0 + spec.causal_offset + 1
    full = jnp.minimum(jnp.maximum(seen, 0) // bkv, full)
  return n, jnp.minimum(jnp.asarray(full, jnp.int32), n)


@dataclasses.dataclass(frozen=True)
class KvWalk:
  """A consumer's K/V walk for one query tile: step j is K/V tile
  `first + j` of the CTA's `cta_steps` tiles; the consumer takes steps
  `j < steps` (the CTA's others are for the other consumer's rows), and
  steps `lo <= j < hi` are visible to all its rows (no mask). `first` is
  0 (an int) unless the window has a left bound."""

  first: Any
  steps: Any
  cta_steps: Any
  lo: Any
  hi: Any


# From this head dim on, a forward with a left-bounded window masks every
# step in one loop: its three loops (masked, unmasked, masked) spill 4-8 B
# at d256 (the sm_90a compile), the one loop does not.
MASK_EVERY_STEP_HEAD_DIM = 256


def cta_kv_range(
  plan: QueryPlan, cta_row0: Any, span: tuple[Any, Any] | None = None
) -> tuple[Any, Any]:
  """(first K/V tile, steps) the CTA streams for its query tile at
  `cta_row0`: the tiles any of its rows sees (at least one, so that rows
  that see nothing still run one fully masked step and write out = 0).
  `span`: with segment ids, the (first, end) K/V tiles whose ids can meet
  the tile's (`segments.kv_tile_spans`), intersected with the positions'."""
  spec, bkv, n = plan.spec, plan.config.block_kv, plan.num_kv_blocks
  first, end = masking.kv_block_range(
    spec, cta_row0, cta_row0 + plan.rows_per_cta, bkv, n
  )
  if span is not None:
    first, end = jnp.maximum(first, span[0]), jnp.minimum(end, span[1])
  if spec.window_left is not None or span is not None:
    first = jnp.minimum(first, n - 1)
  return first, jnp.maximum(jnp.asarray(end, jnp.int32) - first, 1)


def kv_walk(
  plan: QueryPlan,
  cta_row0: Any,
  row0: Any,
  rows: int,
  span: tuple[Any, Any] | None = None,
) -> KvWalk:
  """The walk of a consumer with query rows `[row0, row0 + rows)` in the
  CTA whose rows start at `cta_row0` (`span`: as in `cta_kv_range`; every
  step is then masked)."""
  spec, bkv, n = plan.spec, plan.config.block_kv, plan.num_kv_blocks
  first, cta_steps = cta_kv_range(plan, cta_row0, span)
  _, end = masking.kv_block_range(spec, row0, row0 + rows, bkv, n)
  if span is not None:
    end = jnp.minimum(end, span[1])
  steps = jnp.clip(jnp.asarray(end, jnp.int32) - first, 1, cta_steps)
  if span is not None:  # the ids: no step is known to need no mask
    return KvWalk(first, steps, cta_steps, 0, jnp.int32(0))
  lo, hi = masking.kv_blocks_unmasked(spec, row0, row0 + rows, bkv)
  if spec.window_left is not None:
    lo = jnp.clip(lo - first, 0, steps)
  hi = jnp.clip(jnp.asarray(hi, jnp.int32) - first, lo, steps)
  return KvWalk(first, steps, cta_steps, lo, hi)


def tile_span(
  span_ref: Any, batch: Any, q_tile: Any, head: Any = None
) -> tuple[Any, Any]:
  """The (first, end) K/V tiles of query tile `q_tile` of `batch` from a
  `[2, b, q_tiles]` int32 spans operand (segment ids), or of `head` too
  from a `[2, b, heads, q_tiles]` one (a block mask); None without."""
  if span_ref is None:
    return None
  if len(span_ref.shape) == 4:
    return span_ref[0, batch, head, q_tile], span_ref[1, batch, head, q_tile]
  return span_ref[0, batch, q_tile], span_ref[1, batch, q_tile]


def walk_steps(
  walk: KvWalk,
  step: Callable[..., Any],
  carry: Any,
  *,
  masked: bool,
  start: int = 0,
  ahead: int = 0,
  split: bool = True,
) -> Any:
  """`step(j, carry, masked=...)` for `start <= j < walk.steps - ahead`,
  where step j handles tile `j + ahead` (the forward's step j softmaxes
  tile j + 1): tiles in `[walk.lo, walk.hi)` unmasked, the others masked
  where `masked`. A window with a left bound adds a leading masked loop;
  `split=False` masks every step in one loop instead."""
  end = walk.steps - ahead
  if masked and not split:
    return lax.fori_loop(
      start, end, functools.partial(step, masked=True), carry
    )
  if not masked:
    return lax.fori_loop(
      start, end, functools.partial(step, masked=False), carry
    )
  b = jnp.clip(walk.hi - ahead, start, end)
  a = start
  if not isinstance(walk.lo, int) or walk.lo:
    a = jnp.clip(walk.lo - ahead, start, b)
    carry = lax.fori_loop(start, a, functools.partial(step, masked=True), carry)
  carry = lax.fori_loop(a, b, functools.partial(step, masked=False), carry)
  return lax.fori_loop(b, end, functools.partial(step, masked=True), carry)


def smem_transforms(dtype: Any, head_dim: int) -> tuple:
  """Tiling and swizzle of a shared-memory tile with `head_dim`-wide rows."""
  itemsize_bits = jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(head_dim * itemsize_bits)
  return (
    plgpu.TilingTransform((8, swizzle * 8 // itemsize_bits)),
    plgpu.SwizzleTransform(swizzle),
  )


def swizzle64(dtype: Any) -> tuple:
  """Shared-memory transforms with a 64-byte swizzle (a wgmma K step of 32
  rows for 16-bit types, where the 128-byte swizzle steps 64)."""
  cols = 64 * 8 // (jnp.dtype(dtype).itemsize * 8)
  return (plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(64))


def round_up(n: int, multiple: int) -> int:
  """`n` rounded up to a multiple of `multiple`."""
  return cdiv(n, multiple) * multiple


def pad_axis(
  x: jax.Array, axis: int, length: int, value: float = 0
) -> jax.Array:
  """x padded with `value` to `length` along `axis` (no copy if already there)."""
  pad = length - x.shape[axis]
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


# Rows of a TMA box's tiling (`smem_transforms`): Mosaic needs the array's
# length along them to be a multiple of it.
TMA_TILE_ROWS = 8


def tma_extent(x: jax.Array, axis: int, tile: int) -> jax.Array:
  """x zero-padded along `axis` to at least `tile` entries and a multiple of
  `TMA_TILE_ROWS` (a copy only where it is not already), else x itself. The
  forward kernels read and write the ragged edge of a sequence by TMA, which
  fills reads past the array with zeros and drops writes past it."""
  length = max(round_up(x.shape[axis], TMA_TILE_ROWS), tile)
  return pad_axis(x, axis, length)


# Every sm90 kernel here is a cluster of one CTA: barriers declared over it
# (`consumer_release`) count one arrival per warpgroup.
CLUSTER = "cluster"


def consumer_release(num_barriers: int, consumers: int = NUM_CONSUMERS) -> Any:
  """Slot-release barriers for `consumers` warpgroups, each arriving once.

  A `plgpu.ClusterBarrier` over the one-CTA cluster: Mosaic initializes it
  with `consumers` (a plain `plgpu.Barrier` in the default lane semantics
  counts every thread, 128 per warpgroup) and one elected thread of a
  warpgroup arrives, after the warpgroup's own waits, as FA3 does.
  """
  return plgpu.ClusterBarrier(
    collective_axes=(CLUSTER,),
    num_arrivals=consumers,
    num_barriers=num_barriers,
  )


def build_kernel(
  body: Callable[[dict[str, Any]], None],
  *,
  inputs: Sequence[str],
  out_type: dict[str, Any],
  scratch: dict[str, Any],
  grid: tuple[int, ...],
  grid_names: tuple[str, ...],
  warpgroups: int,
  interpret: Any,
  optional: Sequence[str] = (),
  in_place: bool = False,
  approx_math: bool = True,
  cluster: bool = True,
  reduction_scratch_bytes: int | None = None,
) -> Callable[..., Any]:
  """`plgpu.kernel` with the settings every sm90 kernel here shares, its
  refs by name.

  `body(refs)` gets one dict: the operands named `inputs` (in the order the
  kernel is called with them), the outputs named by `out_type`'s keys (the
  kernel returns them in that order), the scratch named by `scratch`'s
  keys, and None for every name of `optional` and every scratch entry that
  is None (absent operands and scratch). `warpgroups` threads named "wg"
  (consumers first, the producer last), a one-CTA cluster (`cluster`),
  approximate math for exp2 and the reciprocal (`approx_math`), Mosaic's
  cross-warp reduction reserve (`reduction_scratch_bytes`; None: its
  default), and
  `interpret` (None, or interpret-mode parameters: a race then raises,
  `compat.fail_on_race`). `in_place` (compiled only) builds it on
  `pl.kernel`, whose operands may be `jax.new_ref`s the kernel updates in
  place (`plgpu.kernel`'s vmap wrapper takes arrays only; such a kernel has
  no vmap rule, so its caller batches it).
  """
  present = {n: t for n, t in scratch.items() if t is not None}
  names = [*inputs, *out_type, *present]
  absent = dict.fromkeys(optional) | {
    n: None for n in scratch if n not in present
  }

  def by_name(*refs: Any) -> None:
    body({**dict(zip(names, refs, strict=True)), **absent})

  # The kernel's name in profiles, dumps and PTX: the body's.
  by_name.__name__ = by_name.__qualname__ = body.__name__
  out_types = tuple(out_type.values())
  scratch_types = tuple(present.values())
  if in_place and interpret is None:
    mesh = plgpu.Mesh(
      grid=grid,
      grid_names=grid_names,
      cluster=(1,) if cluster else (),
      cluster_names=(CLUSTER,) if cluster else (),
      num_threads=warpgroups,
      thread_name="wg",
    )

    def kernel_body(*refs):
      pl.run_scoped(
        functools.partial(by_name, *refs), *scratch_types, collective_axes="wg"
      )

    return pl.kernel(
      kernel_body,
      out_type=out_types,
      mesh=mesh,
      compiler_params=compat.compiler_params(
        approx_math=approx_math, reduction_scratch_bytes=reduction_scratch_bytes
      ),
      name=body.__name__,
    )
  kernel = plgpu.kernel(
    by_name,
    out_type=out_types,
    scratch_types=scratch_types,
    grid=grid,
    grid_names=grid_names,
    num_threads=warpgroups,
    thread_name="wg",
    **(dict(cluster=(1,), cluster_names=(CLUSTER,)) if cluster else {}),
    compiler_params=compat.compiler_params(
      approx_math=approx_math, reduction_scratch_bytes=reduction_scratch_bytes
    ),
    interpret=interpret,
  )
  return compat.fail_on_race(kernel, interpret)


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
