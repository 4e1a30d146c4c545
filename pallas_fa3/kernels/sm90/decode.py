"""The Hopper decode kernel: attention of a few new queries over a KV cache
(split-KV flash-decoding, GQA-packed, contiguous or paged) in Pallas Mosaic
GPU.

One CTA per (sequence, KV head, split). Its 64 query rows are the KV head's
group: `heads_q / heads_kv` query heads times `seq_q`, row `i * g + h`
(packed by XLA before the kernel), so each K/V tile is read once for the
whole group. A producer warpgroup streams the split's K/V tiles by TMA
through a `num_stages` ring (a paged cache: one TMA per page, the page
from the page table); one consumer warpgroup computes S = Q K^T with wgmma,
masks by the sequence's length, causal rule and window, runs the online
softmax (base 2, the scores scaled once: `common.scaled_once`) and adds
P V. In the tile holding a sequence's last key, V's rows past the length
are zeroed in shared memory first (0 x NaN is NaN: the cache past a length
may hold anything). The CTA writes its range's float32 output, normalized
over the range, and its lse; XLA merges the splits (`decode_combine`, with
the sinks) and unpacks the rows. Design: docs/design_notes.md#decode-kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa3.decode_combine import combine_splits
from pallas_fa3.kernels import hopper
from pallas_fa3.kernels.sm90 import compat
from pallas_fa3.kernels.sm90.common import (
  LONE_CONSUMER_REGS,
  LONE_PRODUCER_REGS,
  build_kernel,
  consumer_release,
  pad_axis,
  scaled_once,
  smem_transforms,
  softcapped,
)
from pallas_fa3.kernels.sm90.config_decode import (
  DECODE_ROWS,
  Sm90DecodeConfig,
  out_cols,
)
from pallas_fa3.kernels.sm90.ops import COMPILED, INTERPRETED, KernelOps
from pallas_fa3.kvcache_spec import DecodeSpec, key_range
from pallas_fa3.lse import natural_from_log2
from pallas_fa3.spec import LOG2E

_F32 = jnp.float32
hopper.check_split(2, LONE_CONSUMER_REGS, LONE_PRODUCER_REGS)


@dataclasses.dataclass(frozen=True)
class DecodePlan:
  """Static facts of one decode kernel instance."""

  spec: DecodeSpec
  config: Sm90DecodeConfig
  splits: int

  @property
  def block_kv(self) -> int:
    return self.config.block_kv

  @property
  def pages_per_tile(self) -> int:
    """TMA copies per K (or V) tile: whole pages, or 1 (a page holds
    several tiles, or the cache is contiguous)."""
    if self.spec.paged and self.spec.page_size < self.block_kv:
      return self.block_kv // self.spec.page_size
    return 1


def split_tiles(plan: DecodePlan, length: Any, split: Any) -> tuple[Any, Any]:
  """(first tile, tiles) of split `split` of a sequence of `length` keys:
  its visible keys' tiles (`key_range`) cut into `plan.splits` equal
  ranges, as the blockwise twin cuts them (`blockwise_decode.split_ranges`)."""
  bkv = plan.block_kv
  first, end = key_range(plan.spec, length)
  t0 = jnp.asarray(first, jnp.int32) // bkv
  t1 = jnp.maximum(lax.div(end + bkv - 1, jnp.int32(bkv)), t0)
  per = lax.div(t1 - t0 + plan.splits - 1, jnp.int32(plan.splits))
  lo = t0 + split * per
  return lo, jnp.clip(t1 - lo, 0, per)


def _tile_source(plan: DecodePlan, cache_ref: Any, row: Any, pt_ref: Any,
                 batch: Any, head: Any, tile: Any, part: int) -> Any:  # fmt: skip
  """The global-memory box of part `part` of K/V tile `tile`: a contiguous
  row's `[block_kv, d]` slice, or one page (or a page's slice)."""
  spec, bkv = plan.spec, plan.block_kv
  if not spec.paged:
    return cache_ref.at[row, pl.ds(tile * bkv, bkv), head]
  ps = spec.page_size
  if plan.pages_per_tile > 1:  # whole pages (past the table: past the
    # capacity, hence the length, and clamped to a real page)
    index = tile * plan.pages_per_tile + part
    page = pt_ref[batch, jnp.minimum(index, spec.pages_per_seq - 1)]
    return cache_ref.at[page, pl.ds(0, ps), head]
  key0 = tile * bkv  # a page holds one or more tiles
  page = pt_ref[batch, lax.div(key0, jnp.int32(ps))]
  return cache_ref.at[page, pl.ds(lax.rem(key0, jnp.int32(ps)), bkv), head]


def _producer(refs: tuple, plan: DecodePlan, scalars: tuple) -> None:
  """Streams the split's K/V tiles into the ring, then waits until the
  consumer has released the last ones (no TMA in flight at exit)."""
  k_ref, v_ref, pt_ref, k_smem, v_smem, k_full, v_full, k_empty, v_empty = refs
  batch, head, row, first, count = scalars
  stages, parts = plan.config.num_stages, plan.pages_per_tile
  rows = plan.block_kv // parts
  plgpu.set_max_registers(LONE_PRODUCER_REGS, action="decrease")

  @pl.loop(0, count)
  def _load(j):
    slot = lax.rem(j, stages)
    for src_ref, dst, full, empty in (
      (k_ref, k_smem, k_full, k_empty),
      (v_ref, v_smem, v_full, v_empty),
    ):

      @pl.when(j >= stages)
      def _():  # the slot's previous tile has been read
        plgpu.barrier_wait(empty.at[slot])

      for part in range(parts):
        src = _tile_source(
          plan, src_ref, row, pt_ref, batch, head, first + j, part
        )
        plgpu.copy_gmem_to_smem(
          src,
          dst.at[slot, pl.ds(part * rows, rows)] if parts > 1 else dst.at[slot],
          full.at[slot],
          oob_mode=compat.ZERO_FILL,
        )

  @pl.loop(jnp.maximum(count - stages, 0), count)
  def _drain(j):
    slot = lax.rem(j, stages)
    plgpu.barrier_wait(k_empty.at[slot])
    plgpu.barrier_wait(v_empty.at[slot])


# Rows x columns of V zeroed at a time (few registers next to O).
_ZERO_CHUNK = 64


def _zero_rows_from(ops: KernelOps, tile_ref: Any, valid: Any) -> None:
  """Zeroes rows `valid..` of a `[block_kv, dv]` shared-memory V tile in
  64 x 64 chunks, and fences the stores for the wgmma that reads it."""
  rows, cols = tile_ref.shape
  step = _ZERO_CHUNK if cols % _ZERO_CHUNK == 0 else cols
  for r in range(0, rows, _ZERO_CHUNK):
    keep_rows = ops.row_index(_ZERO_CHUNK) + r < valid
    for c in range(0, cols, step):
      chunk = tile_ref.at[pl.ds(r, _ZERO_CHUNK), pl.ds(c, step)]
      if ops.interpreted:
        values = chunk[...]
      else:
        values = compat.load_with_layout(chunk, plgpu.Layout.WGMMA)
      keep = lax.broadcast_in_dim(keep_rows, values.shape, [0])
      chunk[...] = jnp.where(keep, values, jnp.zeros_like(values))
  plgpu.commit_smem()  # generic stores -> the async proxy of the wgmma


def _consumer(refs: tuple, plan: DecodePlan, ops: KernelOps, scalars: tuple):
  """The query rows' online softmax over the split's tiles, and the
  epilogue (float32 output normalized over the split, its lse)."""
  (q_ref, o_ref, lse_ref, q_smem, k_smem, v_smem, o_smem, lse_smem) = refs[:8]
  k_full, v_full, k_empty, v_empty, q_bar = refs[8:]
  spec, cfg = plan.spec, plan.config
  batch, head, split, length, first, count = scalars
  bkv, stages = cfg.block_kv, cfg.num_stages
  plgpu.set_max_registers(LONE_CONSUMER_REGS, action="increase")
  plgpu.copy_gmem_to_smem(q_ref.at[batch, head], q_smem, q_bar.at[0])
  plgpu.barrier_wait(q_bar.at[0])

  # Row r is query r // g: it sits at position length - seq_q + r // g.
  rows = ops.row_index(DECODE_ROWS)
  pos = length - spec.seq_q + lax.div(rows, jnp.int32(spec.group_size))

  def mask_for(tile):
    keys = tile * bkv + ops.col_index(bkv)
    ok = lambda a, b: lax.broadcast_in_dim(a, (DECODE_ROWS, bkv), [b])
    mask = ok(keys < length, 1)
    rpos = lambda off: ok(pos + off, 0)
    if spec.window_right is not None:
      mask = mask & (ok(keys, 1) <= rpos(spec.window_right))
    if spec.window_left is not None:
      mask = mask & (ok(keys, 1) >= rpos(-spec.window_left))
    return mask

  def step(j, carry):
    o, m, l = carry
    slot, tile = lax.rem(j, stages), first + j
    # The tile holding the last key: V's rows past the length -> 0 (first,
    # while only O is live in registers).
    plgpu.barrier_wait(v_full.at[slot])
    pl.when((tile + 1) * bkv > length)(
      lambda: _zero_rows_from(ops, v_smem.at[slot], length - tile * bkv)
    )
    plgpu.barrier_wait(k_full.at[slot])
    s = ops.scores(q_smem, k_smem.at[slot])
    plgpu.barrier_arrive(k_empty.at[slot])
    t, scale_log2 = softcapped(spec, s)  # (a DecodeSpec serves as well)
    x = jnp.where(mask_for(tile), scaled_once(t, scale_log2), -jnp.inf)
    m_new = jnp.maximum(m, x.max(axis=1))
    m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_ref)
    p = jnp.exp2(x - lax.broadcast_in_dim(m_ref, x.shape, [0]))
    l = l * alpha + p.sum(axis=1)
    o = o * lax.broadcast_in_dim(alpha, o.shape, [0])
    o = ops.accumulate_pv(o, p.astype(spec.dtype), v_smem.at[slot])
    plgpu.barrier_arrive(v_empty.at[slot])
    return o, m_new, l

  o0 = ops.tile(jnp.zeros((DECODE_ROWS, spec.head_dim_v), _F32))
  m0 = ops.rows(jnp.full((DECODE_ROWS,), -jnp.inf, _F32))
  l0 = ops.rows(jnp.zeros((DECODE_ROWS,), _F32))
  o, m, l = lax.fori_loop(0, count, step, (o0, m0, l0))

  empty = l == 0.0
  inv_l = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
  o = o * lax.broadcast_in_dim(inv_l, o.shape, [0])
  log2_l = jnp.log(jnp.where(empty, 1.0, l)) * _F32(LOG2E)
  lse_smem[...] = jnp.where(empty, -jnp.inf, natural_from_log2(m + log2_l))
  # O leaves in column chunks through one float32 staging tile, each
  # rewritten once the previous chunk's store has read it.
  cols = o_smem.shape[1]
  for c in range(0, spec.head_dim_v, cols):
    if c:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    o_smem[...] = o[:, c : c + cols]
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(
      o_smem, o_ref.at[split, batch, head, :, pl.ds(c, cols)]
    )
  plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, batch, head])
  plgpu.wait_smem_to_gmem(0)


def _build(plan: DecodePlan, ops: KernelOps, interpret: Any) -> Any:
  spec, cfg = plan.spec, plan.config
  b, hk, splits = spec.batch, spec.heads_kv, plan.splits
  stages, bkv = cfg.num_stages, cfg.block_kv

  def fa3_decode(q_ref, k_ref, v_ref, len_ref, row_ref, pt_ref, *refs):
    o_ref, lse_ref, q_smem, k_smem, v_smem, o_smem, lse_smem = refs[:7]
    k_full, v_full, k_empty, v_empty, q_bar = refs[7:]
    batch, head = lax.axis_index("batch"), lax.axis_index("heads")
    split = lax.axis_index("split")
    length = len_ref[batch]
    first, count = split_tiles(plan, length, split)
    wg = lax.axis_index("wg")

    @pl.when(wg == 0)
    def _():
      _consumer(
        (q_ref, o_ref, lse_ref, q_smem, k_smem, v_smem, o_smem, lse_smem)
        + (k_full, v_full, k_empty, v_empty, q_bar),
        plan,
        ops,
        (batch, head, split, length, first, count),
      )

    @pl.when(wg == 1)
    def _():
      _producer(
        (
          k_ref,
          v_ref,
          pt_ref,
          k_smem,
          v_smem,
          k_full,
          v_full,
          k_empty,
          v_empty,
        ),
        plan,
        (batch, head, row_ref[batch], first, count),
      )

  d, dv = spec.head_dim, spec.head_dim_v
  scratch = (
    plgpu.SMEM(
      (DECODE_ROWS, d), spec.dtype, transforms=smem_transforms(spec.dtype, d)
    ),
    plgpu.SMEM(
      (stages, bkv, d), spec.dtype, transforms=smem_transforms(spec.dtype, d)
    ),
    plgpu.SMEM(
      (stages, bkv, dv), spec.dtype, transforms=smem_transforms(spec.dtype, dv)
    ),
    plgpu.SMEM(
      (DECODE_ROWS, out_cols(dv)),
      _F32,
      transforms=smem_transforms(_F32, out_cols(dv)),
    ),
    plgpu.SMEM((DECODE_ROWS,), _F32),
    plgpu.Barrier(num_arrivals=plan.pages_per_tile, num_barriers=stages),
    plgpu.Barrier(num_arrivals=plan.pages_per_tile, num_barriers=stages),
    consumer_release(stages, consumers=1),
    consumer_release(stages, consumers=1),
    plgpu.Barrier(num_barriers=1),  # Q
  )
  out_type = (
    jax.ShapeDtypeStruct((splits, b, hk, DECODE_ROWS, dv), _F32),
    jax.ShapeDtypeStruct((splits, b, hk, DECODE_ROWS), _F32),
  )
  return build_kernel(
    fa3_decode,
    out_type=out_type,
    scratch=scratch,
    grid=(b, hk, splits),
    grid_names=("batch", "heads", "split"),
    warpgroups=2,
    interpret=interpret,
  )


def pack_queries(spec: DecodeSpec, q: jax.Array) -> jax.Array:
  """`[b, sq, hq, d]` -> `[b, hk, 64, d]`: row `i * g + h` is query i of
  head `kv_head * g + h`; padded rows are zeros."""
  b, sq, hk, g = spec.batch, spec.seq_q, spec.heads_kv, spec.group_size
  rows = q.reshape(b, sq, hk, g, spec.head_dim).transpose(0, 2, 1, 3, 4)
  return pad_axis(rows.reshape(b, hk, sq * g, spec.head_dim), 2, DECODE_ROWS)


def unpack_rows(spec: DecodeSpec, x: jax.Array) -> jax.Array:
  """`[b, hk, 64, ...]` -> `[b, sq, hq, ...]` (the inverse of
  `pack_queries` on the first `sq * g` rows)."""
  b, sq, hk, g = spec.batch, spec.seq_q, spec.heads_kv, spec.group_size
  x = x[:, :, : sq * g].reshape((b, hk, sq, g) + x.shape[3:])
  return jnp.moveaxis(x, 2, 1).reshape((b, sq, spec.heads_q) + x.shape[4:])


def sm90_decode(
  spec: DecodeSpec,
  config: Sm90DecodeConfig,
  splits: int,
  q: jax.Array,
  k_cache: jax.Array,
  v_cache: jax.Array,
  lengths: jax.Array,
  rows: jax.Array,
  page_table: jax.Array | None,
  sinks: jax.Array | None,
  *,
  interpret: Any = None,
) -> tuple[jax.Array, jax.Array]:
  """Runs the decode kernel and merges its splits.

  Args: as `backends.decode.DecodeBackend.run` (lengths: each sequence's
    keys, appended tokens included; rows: the contiguous cache rows;
    sinks: float32 `[b, hq]` or None); `interpret`: None compiles for
    sm90, interpret-mode parameters run the same kernel on a CPU.

  Returns:
    (out `[b, sq, hq, dv]` in q's dtype, lse `[b, hq, sq]` float32).
  """
  plan = DecodePlan(spec, config, splits)
  ops = COMPILED if interpret is None else INTERPRETED
  pages = (
    jnp.zeros((spec.batch, 1), jnp.int32) if page_table is None else page_table
  )
  o_parts, lse_parts = _build(plan, ops, interpret)(
    pack_queries(spec, q),
    k_cache,
    v_cache,
    lengths.astype(jnp.int32),
    rows.astype(jnp.int32),
    pages.astype(jnp.int32),
  )
  sink = None
  if sinks is not None:  # per packed row: head kv_head * g + r % g
    g = spec.group_size
    per_head = sinks.reshape(spec.batch, spec.heads_kv, 1, g)
    sink = jnp.broadcast_to(
      per_head, (spec.batch, spec.heads_kv, spec.seq_q, g)
    ).reshape(spec.batch, spec.heads_kv, spec.seq_q * g)
    sink = pad_axis(sink, 2, DECODE_ROWS)
  out, lse = combine_splits(o_parts, lse_parts, sink)
  out = unpack_rows(spec, out).astype(spec.dtype)
  lse = jnp.moveaxis(unpack_rows(spec, lse[..., None])[..., 0], 1, 2)
  return out, lse
