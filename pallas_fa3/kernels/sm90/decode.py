"""The Hopper decode kernel: a few new queries over a KV cache (split-KV
flash-decoding, GQA-packed, contiguous or paged, a 16-bit or an e4m3
cache) in Pallas Mosaic GPU. One CTA per (sequence, KV head, split); its
64 query rows are the KV head's group times seq_q, packed by XLA
(`pack_queries`), so each K/V tile is read once for the group. A producer
warpgroup streams the split's K/V tiles by TMA (a paged cache: one TMA per
page), or with an e4m3 cache converts them to float16 (`e4m3_converter`);
one consumer runs S = Q K^T, the masked online softmax and P V with wgmma;
XLA merges the splits (`lse.combine_splits`) and unpacks the rows
(`sm90_decode`). docs/design_notes.md#decode-kernel
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa3.kernels.sm90 import (
  compat,
  config_decode,
  flex_tile,
  hardware,
  scores,
)
from pallas_fa3.kernels.sm90.common import (
  LONE_CONSUMER_REGS,
  LONE_PRODUCER_REGS,
  build_kernel,
  consumer_release,
  pad_axis,
  smem_transforms,
)
from pallas_fa3.kernels.sm90.config_decode import (
  DECODE_ROWS,
  Sm90DecodeConfig,
  out_cols,
)
from pallas_fa3.kernels.sm90.ops import COMPILED, INTERPRETED, KernelOps
from pallas_fa3.kvcache import DecodeSpec, gather, key_range, split_span
from pallas_fa3.lse import combine_splits, natural_from_log2
from pallas_fa3.spec import LOG2E, cdiv

FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
COMPUTE_DTYPE = jnp.dtype(jnp.float16)
# The converter holds a 64 x 128 chunk (64 values a thread) and addresses.
CONVERTER_REGS = 168
hardware.check_split(2, LONE_CONSUMER_REGS, CONVERTER_REGS)
# Q is scaled by a power of two into float16 when its amax exceeds this.
_Q_RANGE = 2.0**14
_CHUNK_ROWS = 64


def converted_q(q_rows: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(float16 Q `[b, hk, 64, d]`, its float32 scale `[b, hk]`): Q divided
  by the power of two that brings its amax under 2^14 (1 if already
  under), so that it converts to float16 without overflow."""
  amax = jnp.max(jnp.abs(q_rows.astype(jnp.float32)), axis=(2, 3))
  e = jnp.ceil(jnp.log2(jnp.maximum(amax, 1.0) / _Q_RANGE))
  scale = jnp.exp2(jnp.maximum(e, 0.0))
  q16 = q_rows.astype(jnp.float32) / scale[:, :, None, None]
  return q16.astype(COMPUTE_DTYPE), scale


def convert_tile(
  ops: KernelOps,
  src: Any,
  dst: Any,
  valid: Any = None,
  lo: Any = None,
  swizzle_cols: int | None = None,
):
  """`dst[...] = src[...]` converted to float16 in 64-row chunks, the
  e4m3 tile's swizzle width at a time (128 columns, or 64 at d192 and 32
  at d96, whose rows are not whole 128-byte spans; `swizzle_cols` when the
  tile was laid out narrower than its width allows); rows `valid..` and
  (with `lo`) rows before `lo` -> 0."""
  rows, cols = src.shape
  step = swizzle_cols or (
    plgpu.find_swizzle(cols * 8 * src.dtype.itemsize) // src.dtype.itemsize
  )
  for r in range(0, rows, _CHUNK_ROWS):
    keep = None
    if valid is not None:
      keep = _rows_between(ops.row_index(_CHUNK_ROWS) + r, lo, valid)
    for c in range(0, cols, step):
      box = (pl.ds(r, _CHUNK_ROWS), pl.ds(c, step))
      if ops.interpreted:
        x = src.at[box][...]
      else:
        x = compat.load_with_layout(src.at[box], plgpu.Layout.WGMMA)
      y = x.astype(dst.dtype)
      if keep is not None:
        y = jnp.where(lax.broadcast_in_dim(keep, y.shape, [0]), y, 0)
      dst.at[box][...] = y


def _rows_between(row: Any, lo: Any, hi: Any) -> Any:
  """`lo <= row < hi` (`lo` None: no lower bound)."""
  keep = row < hi
  return keep if lo is None else keep & (row >= lo)


def e4m3_converter(
  refs: dict[str, Any], plan: Any, ops: KernelOps, scalars: tuple
) -> None:
  """The second warpgroup with an e4m3 cache: TMA of the split's tiles into
  the e4m3 ring (`num_stages` ahead), conversion into the float16 ring.

  Every TMA it issues it also waits for, so none is in flight at exit; an
  e4m3 slot is refilled only after the whole warpgroup has read it (the
  warpgroup barrier of `commit_smem`); at the end it waits for the
  consumer's release of the last float16 tiles."""
  k_ref, v_ref, pt_ref, raw_k, raw_v, raw_k_full, raw_v_full = (
    refs[n]
    for n in ("k", "v", "pages", "raw_k", "raw_v", "raw_k_full", "raw_v_full")
  )
  k16, v16, k_full, v_full, k_empty, v_empty = (refs[n] for n in _RING)
  batch, head, row, first, count, length, start = scalars
  stages, bkv = plan.config.num_stages, plan.block_kv
  conv = config_decode.converted_stages(plan.spec)
  parts = plan.pages_per_tile
  rows = bkv // parts
  plgpu.set_max_registers(CONVERTER_REGS, action="decrease")

  def issue(j):
    slot = lax.rem(j, stages)
    for src_ref, dst, full in ((k_ref, raw_k, raw_k_full), (v_ref, raw_v, raw_v_full)):  # fmt: skip
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

  pl.loop(0, jnp.minimum(count, stages))(issue)

  @pl.loop(0, count)
  def _convert(j):
    raw, slot = lax.rem(j, stages), lax.rem(j, conv)
    valid = length - (first + j) * bkv  # V's rows past the length -> 0
    lo = None if start is None else start - (first + j) * bkv  # (leftpad)
    for src, raw_full, dst, full, empty in (
      (raw_k, raw_k_full, k16, k_full, k_empty),
      (raw_v, raw_v_full, v16, v_full, v_empty),
    ):
      plgpu.barrier_wait(raw_full.at[raw])

      @pl.when(j >= conv)
      def _():  # the consumer has read the slot's previous tile
        plgpu.barrier_wait(empty.at[slot])

      if dst is v16:
        partial, whole = valid < bkv, valid >= bkv
        if lo is not None:
          partial, whole = partial | (lo > 0), whole & (lo <= 0)
        pl.when(partial)(
          lambda: convert_tile(ops, raw_v.at[raw], v16.at[slot], valid, lo)
        )
        pl.when(whole)(lambda: convert_tile(ops, raw_v.at[raw], v16.at[slot]))
      else:
        convert_tile(ops, src.at[raw], dst.at[slot])
      plgpu.commit_smem()  # stores -> the wgmma's proxy; reads finished
      plgpu.barrier_arrive(full.at[slot])

    @pl.when(j + stages < count)
    def _():
      issue(j + stages)

  @pl.loop(jnp.maximum(count - conv, 0), count)
  def _drain(j):  # the consumer has read the last tiles (as the TMA
    slot = lax.rem(j, conv)  # producer's drain: every phase observed)
    plgpu.barrier_wait(k_empty.at[slot])
    plgpu.barrier_wait(v_empty.at[slot])


def e4m3_scratch(plan: Any) -> dict[str, Any]:
  """The e4m3 rings, the float16 rings and their barriers (after Q's and
  the output's staging, in the kernel's scratch)."""
  spec, cfg = plan.spec, plan.config
  d, dv, bkv = spec.head_dim, spec.head_dim_v, cfg.block_kv
  conv = config_decode.converted_stages(spec)
  ring = lambda n, cols, dtype: plgpu.SMEM(
    (n, bkv, cols), dtype, transforms=smem_transforms(dtype, cols)
  )
  tma = lambda: plgpu.Barrier(
    num_arrivals=plan.pages_per_tile, num_barriers=cfg.num_stages
  )
  return dict(
    raw_k=ring(cfg.num_stages, d, FP8_DTYPE),
    raw_v=ring(cfg.num_stages, dv, FP8_DTYPE),
    raw_k_full=tma(),
    raw_v_full=tma(),
    k_smem=ring(conv, d, COMPUTE_DTYPE),
    v_smem=ring(conv, dv, COMPUTE_DTYPE),
    k_full=consumer_release(conv, consumers=1),
    v_full=consumer_release(conv, consumers=1),
    k_empty=consumer_release(conv, consumers=1),
    v_empty=consumer_release(conv, consumers=1),
  )


_F32 = jnp.float32
hardware.check_split(2, LONE_CONSUMER_REGS, LONE_PRODUCER_REGS)
# The K/V ring (16-bit tiles) and its barriers, by name.
_RING = ("k_smem", "v_smem", "k_full", "v_full", "k_empty", "v_empty")


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
  def query_tiles(self) -> int:
    """64-row query tiles per (sequence, grid head): a CTA each."""
    return config_decode.query_tiles(self.spec)

  @property
  def packed(self) -> int:
    """Query heads packed into a tile's rows (1 with flex options)."""
    return config_decode.packed_heads(self.spec)

  def kv_head(self, head: Any) -> Any:
    """The KV head of grid head `head` (a query head with flex options
    that do not pack)."""
    if self.packed == self.spec.group_size:
      return head
    return lax.div(head, jnp.int32(self.spec.group_size))

  @property
  def fp8(self) -> bool:
    """An e4m3 cache: the converter warpgroup feeds float16 tiles."""
    return self.spec.fp8_cache

  @property
  def compute_dtype(self) -> Any:
    """Q's, K's, V's and P's dtype in the products."""
    return COMPUTE_DTYPE if self.fp8 else self.spec.dtype

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


def split_tiles(
  plan: DecodePlan,
  length: Any,
  split: Any,
  start: Any = 0,
  qtile: Any = None,
  span: tuple[Any, Any] | None = None,
) -> tuple[Any, Any]:
  """(first tile, tiles) of split `split` of a sequence of `length` keys
  from `start` (its cache_leftpad): its visible keys' tiles (`key_range`;
  with `qtile`, those query tile `qtile`'s queries see: causal tiles past
  them skipped; with a block mask's `span`, only its non-empty tiles' span)
  cut into `plan.splits` ranges by `kvcache.split_span`, as the blockwise
  twin cuts them."""
  bkv = plan.block_kv
  queries = None
  if qtile is not None:  # its first and last query
    g = jnp.int32(plan.packed)
    q0 = lax.div(qtile * DECODE_ROWS, g)
    q1 = jnp.minimum(
      lax.div(qtile * DECODE_ROWS + DECODE_ROWS - 1, g), plan.spec.seq_q - 1
    )
    queries = (q0, q1)
  first, end = key_range(plan.spec, length, start, queries)
  t0 = jnp.asarray(first, jnp.int32) // bkv
  t1 = lax.div(end + bkv - 1, jnp.int32(bkv))
  if span is not None:  # a block mask's empty tiles are never loaded
    t0, t1 = jnp.maximum(t0, span[0]), jnp.minimum(t1, span[1])
  t1 = jnp.maximum(t1, t0)
  return split_span(plan.spec, t0, t1, split, plan.splits, bkv)


def cta_walk(plan: DecodePlan, refs: dict[str, Any]) -> tuple:
  """This CTA's (batch, KV head, split, query tile or None with one tile,
  length, cache_leftpad start or None, first K/V tile, tiles): the grid
  is (batch, heads, query tiles x splits)."""
  batch, head = lax.axis_index("batch"), lax.axis_index("heads")
  split, qtile = lax.axis_index("split"), None
  if plan.query_tiles > 1:  # the grid's last axis walks query tiles x splits
    qtile = lax.div(split, jnp.int32(plan.splits))
    split = lax.rem(split, jnp.int32(plan.splits))
  length = refs["lengths"][batch]
  start = refs["starts"][batch] if plan.spec.leftpad else None
  span = None
  if refs.get("bm_dspans") is not None:  # `[2, b, heads_q]`
    span = refs["bm_dspans"][0, batch, head], refs["bm_dspans"][1, batch, head]
  first, count = split_tiles(
    plan, length, split, 0 if start is None else start, qtile, span
  )
  return batch, head, split, qtile, length, start, first, count


def _producer(refs: dict[str, Any], plan: DecodePlan, scalars: tuple) -> None:
  """Streams the split's K/V tiles into the ring, then waits until the
  consumer has released the last ones (no TMA in flight at exit)."""
  k_ref, v_ref, pt_ref = refs["k"], refs["v"], refs["pages"]
  k_smem, v_smem, k_full, v_full, k_empty, v_empty = (refs[n] for n in _RING)
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


def zero_rows_from(
  ops: KernelOps, tile_ref: Any, valid: Any, lo: Any = None
) -> None:
  """Zeroes rows `valid..` (and with `lo` the rows before it) of a
  `[block_kv, dv]` shared-memory V tile in 64 x 64 chunks, and fences the
  stores for the wgmma that reads it."""
  rows, cols = tile_ref.shape
  step = _ZERO_CHUNK if cols % _ZERO_CHUNK == 0 else cols
  for r in range(0, rows, _ZERO_CHUNK):
    keep_rows = _rows_between(ops.row_index(_ZERO_CHUNK) + r, lo, valid)
    for c in range(0, cols, step):
      chunk = tile_ref.at[pl.ds(r, _ZERO_CHUNK), pl.ds(c, step)]
      if ops.interpreted:
        values = chunk[...]
      else:
        values = compat.load_with_layout(chunk, plgpu.Layout.WGMMA)
      keep = lax.broadcast_in_dim(keep_rows, values.shape, [0])
      chunk[...] = jnp.where(keep, values, jnp.zeros_like(values))
  plgpu.commit_smem()  # generic stores -> the async proxy of the wgmma


def query_rows(plan: DecodePlan, ops: KernelOps, length: Any, row0: Any):
  """Per accumulator row of a query tile starting at packed row `row0`:
  the position of its query (packed row r is query r // g, at position
  length - seq_q + r // g)."""
  rows = ops.row_index(DECODE_ROWS) + row0
  g = jnp.int32(plan.packed)
  return length - plan.spec.seq_q + lax.div(rows, g)


def flex_view(spec: DecodeSpec) -> Any:
  """What `flex_tile` reads of a call, for a decode one: its flex options
  over positions `0 .. capacity` (queries and keys alike); with packed
  rows (`config_decode.flex_packs`) the functions' `packed` forms over
  packed rows `q_idx * group + h` of the KV heads."""
  fs, g = spec.flex, config_decode.packed_heads(spec)
  if g > 1:
    pack = lambda fn: None if fn is None else fn.packed(g)
    fs = dataclasses.replace(
      fs, score_mod=pack(fs.score_mod), mask_mod=pack(fs.mask_mod)
    )
  return types.SimpleNamespace(
    flex=fs, seq_q=spec.capacity * g, seq_kv=spec.capacity,
    batch=spec.batch, heads_q=config_decode.grid_heads(spec),
    softmax_scale=spec.softmax_scale, softcap=spec.softcap,
    unaligned_rows=True,  # a tile's rows start at any position
  )  # fmt: skip


def _consumer(
  refs: dict[str, Any], plan: DecodePlan, ops: KernelOps, scalars: tuple
):
  """The query rows' online softmax over the split's tiles, and the
  epilogue (float32 output normalized over the split, its lse)."""
  q_ref, o_ref, lse_ref, q_smem, o_smem, lse_smem, q_bar = (
    refs[n] for n in ("q", "o", "lse", "q_smem", "o_smem", "lse_smem", "q_bar")
  )
  k_smem, v_smem, k_full, v_full, k_empty, v_empty = (refs[n] for n in _RING)
  spec, cfg = plan.spec, plan.config
  batch, head, split, qtile, length, start, first, count, descale = scalars
  bkv, stages = cfg.block_kv, plan.ring_stages
  k_descale, v_descale = descale if plan.fp8 else (None, None)
  plgpu.set_max_registers(LONE_CONSUMER_REGS, action="increase")
  row0 = 0  # the tile's first packed row (query tile qtile)
  q_src, o_dst, lse_dst = q_ref.at[batch, head], o_ref, lse_ref
  if qtile is not None:
    row0 = qtile * DECODE_ROWS
    q_src = q_ref.at[batch, head, pl.ds(row0, DECODE_ROWS)]
  plgpu.copy_gmem_to_smem(q_src, q_smem, q_bar.at[0])
  plgpu.barrier_wait(q_bar.at[0])

  pos = query_rows(plan, ops, length, row0)

  def step(j, carry):
    o, m, l = carry
    slot, tile = lax.rem(j, stages), first + j
    # The tile holding the last key: V's rows past the length -> 0 (first,
    # while only O is live in registers; the converter does it for e4m3).
    if not plan.fp8:
      plgpu.barrier_wait(v_full.at[slot])
      partial = (tile + 1) * bkv > length
      lo = None
      if start is not None:  # and the tile holding the first key
        lo = start - tile * bkv
        partial = partial | (lo > 0)
      pl.when(partial)(
        lambda: zero_rows_from(ops, v_smem.at[slot], length - tile * bkv, lo)
      )
    plgpu.barrier_wait(k_full.at[slot])
    s = ops.scores(q_smem, k_smem.at[slot])
    plgpu.barrier_arrive(k_empty.at[slot])
    # (a DecodeSpec serves as well as an AttentionSpec.) A flex function
    # sees packed rows `q_idx * group + h` (`flex_view`), or one query head.
    at = scores.At(
      (length - spec.seq_q) * plan.packed + row0,
      tile * bkv,
      decode=(pos, length, start),
      flex=(refs, batch, head),
    )
    view = None if spec.flex is None else flex_view(spec)
    x = scores.logits(ops, spec, s, at, descale=k_descale, flex_spec=view)
    p, alpha, m_new, l = scores.online_softmax(x, m, l)
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
  # With one query tile only its live rows leave (`partial_rows`: the
  # group times seq_q in whole 8-row swizzle groups), not all 64.
  cols = o_smem.shape[1]
  live = config_decode.partial_rows(spec) if qtile is None else DECODE_ROWS
  o_src, lse_src = o_smem, lse_smem
  if live < DECODE_ROWS:
    o_src, lse_src = o_smem.at[pl.ds(0, live)], lse_smem.at[pl.ds(0, live)]
  out_rows = slice(None) if qtile is None else pl.ds(row0, DECODE_ROWS)
  for c in range(0, spec.head_dim_v, cols):
    if c:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    o_smem[...] = o[:, c : c + cols]
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(
      o_src, o_dst.at[split, batch, head, out_rows, pl.ds(c, cols)]
    )
  plgpu.copy_smem_to_gmem(lse_src, lse_dst.at[split, batch, head, out_rows])
  plgpu.wait_smem_to_gmem(0)


def build_decode(
  plan: DecodePlan, ops: KernelOps, interpret: Any, flex_names: tuple = ()
) -> Any:
  """The kernel: `(q rows, k_cache, v_cache, lengths, rows, page_table[,
  k_descale, v_descale][, starts], *flex operands) -> (o partials, lse
  partials)`; `flex_names`: `flex_tile.kernel_operands`' names."""
  spec, cfg = plan.spec, plan.config
  b, hk, splits = spec.batch, config_decode.grid_heads(spec), plan.splits
  stages, bkv = plan.ring_stages, cfg.block_kv
  qtiles = plan.query_tiles

  def fa3_decode(refs: dict[str, Any]) -> None:
    batch, head, split, qtile, length, start, first, count = cta_walk(
      plan, refs
    )
    descale = ()
    if plan.fp8:  # `[b, hk]` each
      descale = tuple(
        refs[n][batch, plan.kv_head(head)] for n in ("k_descale", "v_descale")
      )
    wg = lax.axis_index("wg")

    @pl.when(wg == 0)
    def _():
      _consumer(
        refs,
        plan,
        ops,
        (batch, head, split, qtile, length, start, first, count, descale),
      )

    @pl.when(wg == 1)
    def _():
      row = refs["rows"][batch]
      kv_head = plan.kv_head(head)
      if plan.fp8:
        e4m3_converter(
          refs, plan, ops, (batch, kv_head, row, first, count, length, start)
        )
      else:
        _producer(refs, plan, (batch, kv_head, row, first, count))

  d, dv, dtype = spec.head_dim, spec.head_dim_v, plan.compute_dtype
  ring_of = lambda cols: plgpu.SMEM(
    (stages, bkv, cols), dtype, transforms=smem_transforms(dtype, cols)
  )
  scratch = dict(
    q_smem=plgpu.SMEM(
      (DECODE_ROWS, d), dtype, transforms=smem_transforms(dtype, d)
    ),
    o_smem=plgpu.SMEM(
      (DECODE_ROWS, out_cols(dv)),
      _F32,
      transforms=smem_transforms(_F32, out_cols(dv)),
    ),
    lse_smem=plgpu.SMEM((DECODE_ROWS,), _F32),
    q_bar=plgpu.Barrier(num_barriers=1),
  )
  if plan.fp8:  # TMA -> e4m3 rings -> converter -> float16 rings
    scratch.update(e4m3_scratch(plan))
  else:
    full = lambda: plgpu.Barrier(
      num_arrivals=plan.pages_per_tile, num_barriers=stages
    )
    scratch.update(
      k_smem=ring_of(d),
      v_smem=ring_of(dv),
      k_full=full(),
      v_full=full(),
      k_empty=consumer_release(stages, 1),
      v_empty=consumer_release(stages, 1),
    )
  rows = config_decode.partial_rows(spec)  # live rows only (one tile)
  out_type = dict(
    o=jax.ShapeDtypeStruct((splits, b, hk, rows, dv), _F32),
    lse=jax.ShapeDtypeStruct((splits, b, hk, rows), _F32),
  )
  inputs = ["q", "k", "v", "lengths", "rows", "pages"]
  inputs += ["k_descale", "v_descale"] * plan.fp8 + ["starts"] * spec.leftpad
  inputs += list(flex_names)
  return build_kernel(
    fa3_decode,
    inputs=inputs,
    out_type=out_type,
    scratch=scratch,
    grid=(b, hk, qtiles * splits),
    grid_names=("batch", "heads", "split"),
    warpgroups=2,
    interpret=interpret,
  )


def repacked(spec: DecodeSpec, operands: tuple) -> tuple[DecodeSpec, tuple]:
  """(`config_decode.kernel_spec(spec)`, the decode operands `(q, k_cache,
  v_cache, lengths, rows, page_table, ...)` for it): where that is a
  contiguous call in place of `spec`'s layout, each sequence's slots
  gathered in order (pages, or its `cache_batch_idx` row) and zero-padded
  to its capacity, rows 0..b-1, no page table. The padding is never read:
  every length is within the original capacity."""
  q, k_cache, v_cache, lengths, rows, pages, *rest = operands
  kernel = config_decode.kernel_spec(spec)
  if kernel is spec:
    return spec, operands

  def view(cache):
    if cache is None:
      return None
    seqs = gather(spec, cache, rows, pages)
    return pad_axis(seqs, 1, kernel.capacity)

  k_cache, v_cache = view(k_cache), view(v_cache)
  in_order = jnp.arange(spec.batch, dtype=jnp.int32)
  return kernel, (q, k_cache, v_cache, lengths, in_order, None, *rest)


def pack_queries(spec: DecodeSpec, q: jax.Array) -> jax.Array:
  """`[b, sq, hq, d]` -> `[b, grid heads, 64 x query tiles, d]`: row
  `i * g + h` is query i of head `kv_head * g + h` (with flex options, one
  head per grid head: row i is its query i); padded rows are zeros."""
  b, sq, d = spec.batch, spec.seq_q, spec.head_dim
  g, heads = config_decode.packed_heads(spec), config_decode.grid_heads(spec)
  rows = q.reshape(b, sq, heads, g, d).transpose(0, 2, 1, 3, 4)
  padded = config_decode.query_tiles(spec) * DECODE_ROWS
  return pad_axis(rows.reshape(b, heads, sq * g, d), 2, padded)


def unpack_rows(spec: DecodeSpec, x: jax.Array) -> jax.Array:
  """`[b, grid heads, 64 x query tiles, ...]` -> `[b, sq, hq, ...]` (the
  inverse of `pack_queries` on the first `sq * g` rows)."""
  b, sq = spec.batch, spec.seq_q
  g, heads = config_decode.packed_heads(spec), config_decode.grid_heads(spec)
  x = x[:, :, : sq * g].reshape((b, heads, sq, g) + x.shape[3:])
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
  descale: tuple[jax.Array, jax.Array] | None = None,
  flex_ops: Any = None,
  starts: jax.Array | None = None,
  *,
  interpret: Any = None,
) -> tuple[jax.Array, jax.Array]:
  """Runs the decode kernel and merges its splits.

  Args: as `backends.base.Backend.decode` (lengths: each sequence's
    keys, appended tokens included; rows: the contiguous cache rows;
    sinks: float32 `[b, hq]` or None; descale: an e4m3 cache's
    `(k_descale, v_descale)`, float32 `[b, hk]`; flex_ops: None (the
    kernel serves no flex call); starts: cache_leftpad, int32 `[b]`, with
    `spec.leftpad`); `interpret`: None compiles for
    sm90, interpret-mode parameters run the same kernel on a CPU.

  Returns:
    (out `[b, sq, hq, dv]` in q's dtype, lse `[b, hq, sq]` float32).
  """
  plan = DecodePlan(spec, config, splits)
  ops = COMPILED if interpret is None else INTERPRETED
  pages = (
    jnp.zeros((spec.batch, 1), jnp.int32) if page_table is None else page_table
  )
  q_rows, extra = pack_queries(spec, q), ()
  if plan.fp8:  # Q in float16; its scale folds into k_descale
    q_rows, q_scale = converted_q(q_rows)
    extra = (descale[0] * q_scale, descale[1])
  flex = {}
  if spec.flex is not None:  # positions to the capacity, tiles past it
    positions = None
    if flex_ops.block_mask is not None:  # the queries' first and last
      last = lengths.astype(jnp.int32) - 1
      positions = (last - (spec.seq_q - 1), last)
    flex = flex_tile.kernel_operands(
      flex_view(spec), flex_ops,
      q_pad=spec.capacity * config_decode.packed_heads(spec) + DECODE_ROWS,
      kv_pad=cdiv(spec.capacity, config.block_kv) * config.block_kv,
      block_kv=config.block_kv, positions=positions,
    )  # fmt: skip
  o_parts, lse_parts = build_decode(plan, ops, interpret, tuple(flex))(
    q_rows,
    k_cache,
    v_cache,
    lengths.astype(jnp.int32),
    rows.astype(jnp.int32),
    pages.astype(jnp.int32),
    *extra,
    *(() if starts is None else (starts.astype(jnp.int32),)),
    *flex.values(),
  )
  return merged_output(spec, o_parts, lse_parts, sinks)


def merged_output(
  spec: DecodeSpec, o_parts: jax.Array, lse_parts: jax.Array, sinks: Any
) -> tuple[jax.Array, jax.Array]:
  """The splits' float32 partials `[splits, b, hk, rows, dv]` (and lse)
  merged by log-sum-exp with the sinks (float32 `[b, hq]` or None) and
  unpacked: (out `[b, sq, hq, dv]` in q's dtype, lse `[b, hq, sq]`)."""
  sink = None
  if sinks is not None:  # per packed row: head kv_head * g + r % g
    g, heads = config_decode.packed_heads(spec), config_decode.grid_heads(spec)
    per_head = sinks.reshape(spec.batch, heads, 1, g)
    sink = jnp.broadcast_to(
      per_head, (spec.batch, heads, spec.seq_q, g)
    ).reshape(spec.batch, heads, spec.seq_q * g)
    sink = pad_axis(sink, 2, o_parts.shape[3])  # the partials' rows
  out, lse = combine_splits(o_parts, lse_parts, sink)
  out = unpack_rows(spec, out).astype(spec.dtype)
  lse = jnp.moveaxis(unpack_rows(spec, lse[..., None])[..., 0], 1, 2)
  return out, lse
