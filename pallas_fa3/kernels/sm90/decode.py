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
the sinks) and unpacks the rows (`decode_call.sm90_decode`). With an e4m3
cache the second warpgroup converts tiles to float16 (`decode_fp8`).
Design: docs/design_notes.md#decode-kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa3.kernels.sm90 import compat, config_decode, decode_fp8, hardware
from pallas_fa3.kernels.sm90.common import (
  LONE_CONSUMER_REGS,
  LONE_PRODUCER_REGS,
  build_kernel,
  consumer_release,
  scaled_once,
  smem_transforms,
)
from pallas_fa3.kernels.sm90.config_decode import (
  DECODE_ROWS,
  Sm90DecodeConfig,
  out_cols,
)
from pallas_fa3.kernels.sm90.ops import KernelOps
from pallas_fa3.kvcache_spec import DecodeSpec, key_range
from pallas_fa3.lse import natural_from_log2
from pallas_fa3.spec import LOG2E

_F32 = jnp.float32
hardware.check_split(2, LONE_CONSUMER_REGS, LONE_PRODUCER_REGS)


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

  @property
  def fp8(self) -> bool:
    """An e4m3 cache: the converter warpgroup feeds float16 tiles."""
    return self.spec.fp8_cache

  @property
  def compute_dtype(self) -> Any:
    """Q's, K's, V's and P's dtype in the products."""
    return decode_fp8.COMPUTE_DTYPE if self.fp8 else self.spec.dtype

  @property
  def ring_stages(self) -> int:
    """Depth of the ring the consumer reads."""
    if self.fp8:
      return config_decode.converted_stages(self.spec)
    return self.config.num_stages

  def tile_source(self, cache_ref: Any, row: Any, pt_ref: Any, batch: Any,
                  head: Any, tile: Any, part: int) -> Any:  # fmt: skip
    """The global-memory box of part `part` of K/V tile `tile`: a
    contiguous row's `[block_kv, d]` slice, or one page (or a page's
    slice)."""
    spec, bkv = self.spec, self.block_kv
    if not spec.paged:
      return cache_ref.at[row, pl.ds(tile * bkv, bkv), head]
    ps = spec.page_size
    if self.pages_per_tile > 1:  # whole pages (past the table: past the
      # capacity, hence the length, and clamped to a real page)
      index = tile * self.pages_per_tile + part
      page = pt_ref[batch, jnp.minimum(index, spec.pages_per_seq - 1)]
      return cache_ref.at[page, pl.ds(0, ps), head]
    key0 = tile * bkv  # a page holds one or more tiles (clamped as above)
    index = lax.div(key0, jnp.int32(ps))
    page = pt_ref[batch, jnp.minimum(index, spec.pages_per_seq - 1)]
    return cache_ref.at[page, pl.ds(lax.rem(key0, jnp.int32(ps)), bkv), head]


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
        src = plan.tile_source(
          src_ref, row, pt_ref, batch, head, first + j, part
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
  batch, head, split, length, first, count, descale = scalars
  bkv, stages = cfg.block_kv, plan.ring_stages
  k_descale, v_descale = descale if plan.fp8 else (None, None)
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
    # while only O is live in registers; the converter does it for e4m3).
    if not plan.fp8:
      plgpu.barrier_wait(v_full.at[slot])
      pl.when((tile + 1) * bkv > length)(
        lambda: _zero_rows_from(ops, v_smem.at[slot], length - tile * bkv)
      )
    plgpu.barrier_wait(k_full.at[slot])
    s = ops.scores(q_smem, k_smem.at[slot])
    plgpu.barrier_arrive(k_empty.at[slot])
    # (a DecodeSpec serves as well as an AttentionSpec)
    t, scale_log2 = decode_fp8.descaled(spec, s, k_descale)
    x = jnp.where(mask_for(tile), scaled_once(t, scale_log2), -jnp.inf)
    m_new = jnp.maximum(m, x.max(axis=1))
    m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_ref)
    p = jnp.exp2(x - lax.broadcast_in_dim(m_ref, x.shape, [0]))
    l = l * alpha + p.sum(axis=1)
    o = o * lax.broadcast_in_dim(alpha, o.shape, [0])
    if plan.fp8:
      plgpu.barrier_wait(v_full.at[slot])
    o = ops.accumulate_pv(o, p.astype(plan.compute_dtype), v_smem.at[slot])
    plgpu.barrier_arrive(v_empty.at[slot])
    return o, m_new, l

  o0 = ops.tile(jnp.zeros((DECODE_ROWS, spec.head_dim_v), _F32))
  m0 = ops.rows(jnp.full((DECODE_ROWS,), -jnp.inf, _F32))
  l0 = ops.rows(jnp.zeros((DECODE_ROWS,), _F32))
  o, m, l = lax.fori_loop(0, count, step, (o0, m0, l0))

  empty = l == 0.0
  inv_l = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
  if v_descale is not None:
    inv_l = inv_l * v_descale
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


def build_decode(plan: DecodePlan, ops: KernelOps, interpret: Any) -> Any:
  """The kernel: `(q rows, k_cache, v_cache, lengths, rows, page_table[,
  k_descale, v_descale]) -> (o partials, lse partials)`."""
  spec, cfg = plan.spec, plan.config
  b, hk, splits = spec.batch, spec.heads_kv, plan.splits
  stages, bkv = plan.ring_stages, cfg.block_kv
  n_in = 8 if plan.fp8 else 6  # + k_descale, v_descale `[b, hk]`

  def fa3_decode(*refs):
    q_ref, k_ref, v_ref, len_ref, row_ref, pt_ref = refs[:6]
    o_ref, lse_ref, q_smem, o_smem, lse_smem, q_bar = refs[n_in : n_in + 6]
    raw = refs[n_in + 6 : n_in + 10] if plan.fp8 else ()  # e4m3 rings
    k_smem, v_smem, k_full, v_full, k_empty, v_empty = refs[-6:]
    batch, head = lax.axis_index("batch"), lax.axis_index("heads")
    split = lax.axis_index("split")
    length = len_ref[batch]
    first, count = split_tiles(plan, length, split)
    descale = tuple(r[batch, head] for r in refs[6:n_in])
    wg = lax.axis_index("wg")

    @pl.when(wg == 0)
    def _():
      _consumer(
        (q_ref, o_ref, lse_ref, q_smem, k_smem, v_smem, o_smem, lse_smem)
        + (k_full, v_full, k_empty, v_empty, q_bar),
        plan,
        ops,
        (batch, head, split, length, first, count, descale),
      )

    @pl.when(wg == 1)
    def _():
      ring = (k_smem, v_smem, k_full, v_full, k_empty, v_empty)
      if plan.fp8:
        decode_fp8.converter(
          (k_ref, v_ref, pt_ref) + raw + ring,
          plan,
          ops,
          (batch, head, row_ref[batch], first, count, length),
        )
      else:
        _producer(
          (k_ref, v_ref, pt_ref, k_smem, v_smem, k_full, v_full)
          + (k_empty, v_empty),
          plan,
          (batch, head, row_ref[batch], first, count),
        )

  d, dv, dtype = spec.head_dim, spec.head_dim_v, plan.compute_dtype
  ring_of = lambda cols: plgpu.SMEM(
    (stages, bkv, cols), dtype, transforms=smem_transforms(dtype, cols)
  )
  if plan.fp8:  # TMA -> e4m3 rings -> converter -> float16 rings
    ring = decode_fp8.scratch(plan)
  else:
    full = lambda: plgpu.Barrier(
      num_arrivals=plan.pages_per_tile, num_barriers=stages
    )
    ring = (ring_of(d), ring_of(dv), full(), full())
    ring += (consumer_release(stages, 1), consumer_release(stages, 1))
  scratch = (
    plgpu.SMEM((DECODE_ROWS, d), dtype, transforms=smem_transforms(dtype, d)),
    plgpu.SMEM(
      (DECODE_ROWS, out_cols(dv)),
      _F32,
      transforms=smem_transforms(_F32, out_cols(dv)),
    ),
    plgpu.SMEM((DECODE_ROWS,), _F32),
    plgpu.Barrier(num_barriers=1),  # Q
  ) + ring
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
