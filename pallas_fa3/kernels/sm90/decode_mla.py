"""The Hopper MLA decode kernel: DeepSeek's latent cache (`v_cache=None`:
V is the K cache's first `head_dim_v` columns, 576 / 512), FlashMLA's
layout in Pallas Mosaic GPU. One CTA per (sequence, KV head, 64-row query
tile, split), the query heads of the KV head packed into the tile's rows
as in `decode.py`. A producer warpgroup streams 64-key K tiles by TMA (a
paged cache: one page per tile) in three column chunks (V's two halves,
the RoPE columns); consumer 0 computes S = Q K^T over all 576 columns and
the online softmax, hands P and the row rescale to consumer 1 through
shared memory, and each consumer accumulates its 256 columns of O from
the same K tile (V read in place, never copied). With an e4m3 cache the
producer also converts each e4m3 tile into a float16 one, zeroing V's rows
outside the sequence. XLA merges the splits.
docs/design_notes.md#mla-decode-kernel
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa3.kernels.sm90 import compat, hardware, scores
from pallas_fa3.kernels.sm90.common import (
  PRODUCER_REGS,
  build_kernel,
  consumer_release,
  smem_transforms,
)
from pallas_fa3.kernels.sm90.config_decode import (
  DECODE_ROWS,
  MLA_CONSUMERS,
  Sm90DecodeConfig,
  mla_chunks,
  partial_rows,
)
from pallas_fa3.kernels.sm90.decode import (
  FP8_DTYPE,
  DecodePlan,
  convert_tile,
  converted_q,
  cta_walk,
  merged_output,
  pack_queries,
  query_rows,
  zero_rows_from,
)
from pallas_fa3.kernels.sm90.ops import COMPILED, INTERPRETED, KernelOps
from pallas_fa3.kvcache import DecodeSpec
from pallas_fa3.lse import natural_from_log2
from pallas_fa3.spec import LOG2E

_F32 = jnp.float32
# setmaxnreg: consumer 0 holds S, P and its half of O (64 x 256 float32:
# 128 registers a thread), consumer 1 its half of O alone; 256 + 224 + 24
# is the 384-thread CTA's pool (3 x 168).
SOFTMAX_REGS, VALUE_REGS = 256, 224
# With an e4m3 cache the producer converts 64 x 64 chunks too (32 values
# a thread, with their addresses and row masks): consumer 1 gives it
# registers (0 spills at 176 + 72).
FP8_VALUE_REGS, CONVERTER_REGS = 176, 72
for _split in (
  hardware.split_problems(3, (SOFTMAX_REGS, VALUE_REGS), PRODUCER_REGS),
  hardware.split_problems(3, (SOFTMAX_REGS, FP8_VALUE_REGS), CONVERTER_REGS),
):
  if _split:
    raise ValueError("; ".join(_split))
# The e4m3 tiles' layout: 64-byte swizzle, whose 64-column tiling divides
# the cache's 576 columns (a TMA box's tiling must divide the global
# row; 128-byte swizzle would tile by 128).
_RAW_SWIZZLE_COLS = 64
# Columns of O each consumer writes per TMA store (a float32 staging tile).
_OUT_COLS = 64


def _copy_chunks(box: Any, chunks: Any, dst: Any, slot: Any, bar: Any):
  """TMA of a K tile's global box as its `mla_chunks` column boxes into
  `dst[c].at[slot]`, each arriving on `bar` (rows past the cache: 0)."""
  for c, (c0, width) in enumerate(chunks):
    plgpu.copy_gmem_to_smem(
      box.at[:, pl.ds(c0, width)],
      dst[c].at[slot],
      bar,
      oob_mode=compat.ZERO_FILL,
    )


def _producer(refs: dict[str, Any], plan: DecodePlan) -> None:
  """Streams the split's K tiles, each as `mla_chunks` column boxes into
  one ring slot, then waits for both consumers' release of the last
  ones (no TMA in flight at exit)."""
  k_ref, pt_ref, k_full, k_empty = (
    refs[n] for n in ("k", "pages", "k_full", "k_empty")
  )
  ring = refs["k_smem"]
  plgpu.set_max_registers(PRODUCER_REGS, action="decrease")
  batch, head, _, _, _, _, first, count = cta_walk(plan, refs)
  row = refs["rows"][batch]
  stages, chunks = plan.ring_stages, mla_chunks(plan.spec)

  @pl.loop(0, count)
  def _load(j):
    slot = lax.rem(j, stages)

    @pl.when(j >= stages)
    def _():  # both consumers have read the slot's previous tile
      plgpu.barrier_wait(k_empty.at[slot])

    box = plan.tile_source(k_ref, row, pt_ref, batch, head, first + j, 0)
    _copy_chunks(box, chunks, ring, slot, k_full.at[slot])

  @pl.loop(jnp.maximum(count - stages, 0), count)
  def _drain(j):
    plgpu.barrier_wait(k_empty.at[lax.rem(j, stages)])


def _converter(refs: dict[str, Any], plan: DecodePlan, ops: KernelOps) -> None:
  """The producer with an e4m3 cache: TMA of the split's tiles into the
  e4m3 ring (`num_stages` ahead), each converted into the one float16
  slot once both consumers have released its previous tile, V's rows
  outside `[start, length)` zeroed on the way (0 x NaN is NaN).

  An e4m3 slot is refilled only after the whole warpgroup has read it
  (`commit_smem`'s warpgroup barrier); every TMA issued is waited for, and
  the last float16 tile's release is observed before exit."""
  k_ref, pt_ref, raw, raw_full = (
    refs[n] for n in ("k", "pages", "raw_k", "raw_k_full")
  )
  ring, k_full, k_empty = refs["k_smem"], refs["k_full"], refs["k_empty"]
  plgpu.set_max_registers(CONVERTER_REGS, action="decrease")
  batch, head, _, _, length, start, first, count = cta_walk(plan, refs)
  row = refs["rows"][batch]
  stages, bkv = plan.config.num_stages, plan.block_kv
  chunks = mla_chunks(plan.spec)

  def issue(j):
    slot = lax.rem(j, stages)
    box = plan.tile_source(k_ref, row, pt_ref, batch, head, first + j, 0)
    _copy_chunks(box, chunks, raw, slot, raw_full.at[slot])

  pl.loop(0, jnp.minimum(count, stages))(issue)

  @pl.loop(0, count)
  def _convert(j):
    slot, tile = lax.rem(j, stages), first + j
    plgpu.barrier_wait(raw_full.at[slot])

    @pl.when(j > 0)
    def _():  # both consumers have read the float16 slot's previous tile
      plgpu.barrier_wait(k_empty.at[0])

    valid = length - tile * bkv
    lo = None if start is None else start - tile * bkv
    partial, whole = valid < bkv, valid >= bkv
    if lo is not None:
      partial, whole = partial | (lo > 0), whole & (lo <= 0)
    for c in range(len(chunks)):
      src, dst = raw[c].at[slot], ring[c].at[0]
      if c < MLA_CONSUMERS:  # V's halves
        pl.when(partial)(
          lambda src=src, dst=dst: convert_tile(
            ops, src, dst, valid, lo, _RAW_SWIZZLE_COLS
          )
        )
        pl.when(whole)(
          lambda src=src, dst=dst: convert_tile(
            ops, src, dst, swizzle_cols=_RAW_SWIZZLE_COLS
          )
        )
      else:
        convert_tile(ops, src, dst, swizzle_cols=_RAW_SWIZZLE_COLS)
    plgpu.commit_smem()  # stores -> the wgmma's proxy; e4m3 reads finished
    plgpu.barrier_arrive(k_full.at[0])

    @pl.when(j + stages < count)
    def _():
      issue(j + stages)

  @pl.when(count > 0)
  def _():  # the consumers have read the last tile
    plgpu.barrier_wait(k_empty.at[0])


def _ring_slot(j: Any, stages: int) -> Any:
  """The consumers' ring slot of tile `j`. With one slot (an e4m3 cache's
  float16 tile) 0, through a value the compiler cannot fold (`j >= 0`): a
  constant index lets LLVM hoist S = Q K^T's 36 K descriptors out of the
  tile loop beside Q's, 72 more live registers in consumer 0 (292 B of
  spills); computed per tile they cost 36 adds, as with two slots."""
  if stages > 1:
    return lax.rem(j, stages)
  return jnp.minimum(lax.optimization_barrier(j), 0)


def _store_half(refs, plan, o, w):
  """Consumer `w`'s float32 columns `[w * dv/2, (w+1) * dv/2)` of O to
  the CTA's partial (`_piece`), through its staging tile, `_OUT_COLS` at a
  time."""
  stage = refs["o_stage"][w]
  o_ref = refs["o"].at[_piece()]
  half = plan.spec.head_dim_v // MLA_CONSUMERS
  for c in range(0, half, _OUT_COLS):
    if c:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    stage[...] = o[:, c : c + _OUT_COLS]
    plgpu.commit_smem()
    cols = pl.ds(w * half + c, _OUT_COLS)
    plgpu.copy_smem_to_gmem(_live(plan, stage), o_ref.at[:, cols])


def _live(plan, staging: Any) -> Any:
  """The rows of a 64-row staging tile a partial keeps: with one query
  tile its live rows only (`config_decode.partial_rows`, whole 8-row
  swizzle groups), else all."""
  rows = _piece_rows(plan)
  return staging if rows == DECODE_ROWS else staging.at[pl.ds(0, rows)]


def _piece_rows(plan) -> int:
  """Rows of one CTA's partial: the live rows with one query tile."""
  return DECODE_ROWS if plan.query_tiles > 1 else partial_rows(plan.spec)


def _piece() -> tuple:
  """This CTA's partial in the kernel's outputs `[query tiles x splits, b,
  hk, rows, ...]` (`_piece_rows`): indexed by grid coordinates alone (read again where
  needed, never kept live through the loop)."""
  return (
    lax.axis_index("split"),
    lax.axis_index("batch"),
    lax.axis_index("heads"),
  )


def _softmax_consumer(refs, plan, ops) -> None:
  """Consumer 0: S = Q K^T, the masked online softmax, P and the rescale
  handed to consumer 1, its own half of O, and the epilogue's 1 / l and
  lse (handed over too)."""
  spec, cfg = plan.spec, plan.config
  bkv, stages, half = cfg.block_kv, plan.ring_stages, spec.head_dim_v // 2
  ring, k_full, k_empty = refs["k_smem"], refs["k_full"], refs["k_empty"]
  q_smem, q_bar = refs["q_smem"], refs["q_bar"]
  p_smem, alpha_smem = refs["p_smem"], refs["alpha_smem"]
  p_full, p_empty = refs["p_full"], refs["p_empty"]
  plgpu.set_max_registers(SOFTMAX_REGS, action="increase")
  batch, head, split, qtile, length, start, first, count = cta_walk(plan, refs)
  # An e4m3 cache: k_descale (times Q's scale) in the scores' scale,
  # v_descale on O once.
  k_descale = refs["k_descale"][batch, head] if plan.fp8 else None
  row0 = None if qtile is None else qtile * DECODE_ROWS
  q_src = refs["q"].at[batch, head]
  if row0 is not None:
    q_src = q_src.at[pl.ds(row0, DECODE_ROWS)]
  for c, (c0, width) in enumerate(mla_chunks(spec)):
    plgpu.copy_gmem_to_smem(
      q_src.at[:, pl.ds(c0, width)], q_smem[c], q_bar.at[0]
    )
  plgpu.barrier_wait(q_bar.at[0])
  pos = query_rows(plan, ops, length, 0 if row0 is None else row0)

  def step(j, carry):
    o, m, l = carry
    slot, tile = _ring_slot(j, stages), first + j
    plgpu.barrier_wait(k_full.at[slot])
    # The tiles holding the first or last key: V's rows outside them -> 0
    # in both halves before any wgmma reads the tile (0 x NaN is NaN).
    partial = (tile + 1) * bkv > length
    lo = None
    if start is not None:
      lo = start - tile * bkv
      partial = partial | (lo > 0)

    if not plan.fp8:  # (the converter zeroes them in the float16 tile)

      @pl.when(partial)
      def _():
        for w in range(MLA_CONSUMERS):
          zero_rows_from(ops, ring[w].at[slot], length - tile * bkv, lo)

    chunks = [ring[c].at[slot] for c in range(len(ring))]
    s = ops.scores(list(q_smem), chunks)
    at = scores.At(0, tile * bkv, decode=(pos, length, start))
    x = scores.logits(ops, spec, s, at, descale=k_descale)
    p, alpha, m_new, l = scores.online_softmax(x, m, l)
    p16 = p.astype(plan.compute_dtype)

    @pl.when(j > 0)
    def _():  # consumer 1 has finished with the previous P
      plgpu.barrier_wait(p_empty.at[0])

    p_smem[...] = p16
    alpha_smem[...] = alpha
    plgpu.commit_smem()  # generic stores -> consumer 1's wgmma, its loads
    plgpu.barrier_arrive(p_full.at[0])
    o = o * lax.broadcast_in_dim(alpha, o.shape, [0])
    o = ops.accumulate_pv(o, p16, ring[0].at[slot])
    plgpu.barrier_arrive(k_empty.at[slot])
    return o, m_new, l

  o0 = ops.tile(jnp.zeros((DECODE_ROWS, half), _F32))
  m0 = ops.rows(jnp.full((DECODE_ROWS,), -jnp.inf, _F32))
  l0 = ops.rows(jnp.zeros((DECODE_ROWS,), _F32))
  o, m, l = lax.fori_loop(0, count, step, (o0, m0, l0))

  @pl.when(count > 0)
  def _():  # consumer 1's last P (its wgmma done) before the epilogue
    plgpu.barrier_wait(p_empty.at[0])

  empty = l == 0.0
  inv_l = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
  log2_l = jnp.log(jnp.where(empty, 1.0, l)) * _F32(LOG2E)
  lse_smem = refs["lse_smem"]
  lse_smem[...] = jnp.where(empty, -jnp.inf, natural_from_log2(m + log2_l))
  if plan.fp8:
    inv_l = inv_l * refs["v_descale"][batch, head]
  refs["inv_l_smem"][...] = inv_l
  plgpu.commit_smem()
  plgpu.barrier_arrive(refs["done"].at[0])
  o = o * lax.broadcast_in_dim(inv_l, o.shape, [0])
  _store_half(refs, plan, o, 0)
  plgpu.copy_smem_to_gmem(_live(plan, lse_smem), refs["lse"].at[_piece()])
  plgpu.wait_smem_to_gmem(0)


def _value_consumer(refs, plan, ops) -> None:
  """Consumer 1: its half of O from consumer 0's P (shared memory) and
  the same K tile's other V columns."""
  spec = plan.spec
  stages, half = plan.ring_stages, spec.head_dim_v // 2
  ring, k_full, k_empty = refs["k_smem"], refs["k_full"], refs["k_empty"]
  p_smem, alpha_smem = refs["p_smem"], refs["alpha_smem"]
  p_full, p_empty = refs["p_full"], refs["p_empty"]
  plgpu.set_max_registers(
    FP8_VALUE_REGS if plan.fp8 else VALUE_REGS, action="increase"
  )
  *_, count = cta_walk(plan, refs)

  def step(j, o):
    slot = _ring_slot(j, stages)
    plgpu.barrier_wait(k_full.at[slot])
    plgpu.barrier_wait(p_full.at[0])
    alpha = ops.load_rows(alpha_smem)
    o = o * lax.broadcast_in_dim(alpha, o.shape, [0])
    o = ops.accumulate_ss(o, p_smem, ring[1].at[slot])
    plgpu.barrier_arrive(p_empty.at[0])
    plgpu.barrier_arrive(k_empty.at[slot])
    return o

  o = lax.fori_loop(
    0, count, step, ops.tile(jnp.zeros((DECODE_ROWS, half), _F32))
  )
  plgpu.barrier_wait(refs["done"].at[0])
  inv_l = ops.load_rows(refs["inv_l_smem"])
  o = o * lax.broadcast_in_dim(inv_l, o.shape, [0])
  _store_half(refs, plan, o, 1)
  plgpu.wait_smem_to_gmem(0)


def build_mla_decode(plan: DecodePlan, ops: KernelOps, interpret: Any) -> Any:
  """The kernel: `(q rows, k_cache, lengths, rows, page_table[,
  k_descale, v_descale][, starts]) -> (o partials, lse partials)`; with an
  e4m3 cache Q is float16 and k_descale carries Q's scale."""
  spec, cfg = plan.spec, plan.config
  b, hk, splits = spec.batch, spec.heads_kv, plan.splits
  stages, bkv, dtype = plan.ring_stages, cfg.block_kv, plan.compute_dtype
  chunks = mla_chunks(spec)

  def fa3_mla_decode(refs: dict[str, Any]) -> None:
    # Each warpgroup computes its CTA's walk after its setmaxnreg: nothing
    # stays live across the split (the producer keeps 24 registers).
    wg = lax.axis_index("wg")
    pl.when(wg == 0)(lambda: _softmax_consumer(refs, plan, ops))
    pl.when(wg == 1)(lambda: _value_consumer(refs, plan, ops))
    producer = (
      (lambda: _converter(refs, plan, ops))
      if plan.fp8
      else (lambda: _producer(refs, plan))
    )
    pl.when(wg == MLA_CONSUMERS)(producer)

  smem = lambda shape, dt, cols: plgpu.SMEM(
    shape, dt, transforms=smem_transforms(dt, cols)
  )
  # Q lives through the loop, the output staging after it: one region.
  q_and_out = plgpu.RefUnion(
    tuple(smem((DECODE_ROWS, w), dtype, w) for _, w in chunks),
    (
      tuple(
        smem((DECODE_ROWS, _OUT_COLS), _F32, _OUT_COLS)
        for _ in range(MLA_CONSUMERS)
      ),
      plgpu.SMEM((DECODE_ROWS,), _F32),
      plgpu.SMEM((DECODE_ROWS,), _F32),
    ),
  )
  scratch = dict(
    q_and_out=q_and_out,
    k_smem=tuple(smem((stages, bkv, w), dtype, w) for _, w in chunks),
    p_smem=smem((DECODE_ROWS, bkv), dtype, bkv),
    alpha_smem=plgpu.SMEM((DECODE_ROWS,), _F32),
    q_bar=plgpu.Barrier(num_arrivals=len(chunks), num_barriers=1),
    k_full=plgpu.Barrier(num_arrivals=len(chunks), num_barriers=stages),
    k_empty=consumer_release(stages, MLA_CONSUMERS),
    p_full=consumer_release(1, 1),
    p_empty=consumer_release(1, 1),
    done=consumer_release(1, 1),
  )
  pieces = plan.query_tiles * splits  # (query tile, split) pairs
  rows = _piece_rows(plan)  # live rows only (one query tile)
  out_type = dict(
    o=jax.ShapeDtypeStruct((pieces, b, hk, rows, spec.head_dim_v), _F32),
    lse=jax.ShapeDtypeStruct((pieces, b, hk, rows), _F32),
  )
  if plan.fp8:  # TMA -> the e4m3 ring -> the converter -> one float16 slot
    raw_stages = cfg.num_stages
    scratch.update(
      raw_k=tuple(
        smem((raw_stages, bkv, w), FP8_DTYPE, _RAW_SWIZZLE_COLS)
        for _, w in chunks
      ),
      raw_k_full=plgpu.Barrier(
        num_arrivals=len(chunks), num_barriers=raw_stages
      ),
      k_full=consumer_release(stages, 1),
    )
  inputs = ["q", "k", "lengths", "rows", "pages"]
  inputs += ["k_descale", "v_descale"] * plan.fp8 + ["starts"] * spec.leftpad
  kernel = build_kernel(
    _unpack_union(fa3_mla_decode),
    inputs=inputs,
    out_type=out_type,
    scratch=scratch,
    grid=(b, hk, plan.query_tiles * splits),
    grid_names=("batch", "heads", "split"),
    warpgroups=MLA_CONSUMERS + 1,
    interpret=interpret,
    # Row reductions of the wgmma layout stay within a warp: no cross-warp
    # scratch (its 2 KiB would not fit beside Q and two 576-column stages).
    reduction_scratch_bytes=0,
  )
  return kernel


def _unpack_union(body: Any) -> Any:
  """`body(refs)` with the Q / output union split into its named parts."""

  def unpacked(refs: dict[str, Any]) -> None:
    q_chunks, (stage, lse_smem, inv_l_smem) = refs.pop("q_and_out")
    body(
      {
        **refs,
        "q_smem": tuple(q_chunks),
        "o_stage": tuple(stage),
        "lse_smem": lse_smem,
        "inv_l_smem": inv_l_smem,
      }
    )

  unpacked.__name__ = unpacked.__qualname__ = body.__name__
  return unpacked


def sm90_mla_decode(
  spec: DecodeSpec,
  config: Sm90DecodeConfig,
  splits: int,
  q: jax.Array,
  k_cache: jax.Array,
  v_cache: None,
  lengths: jax.Array,
  rows: jax.Array,
  page_table: jax.Array | None,
  sinks: jax.Array | None,
  descale: tuple[jax.Array, jax.Array] | None = None,
  flex_ops: None = None,
  starts: jax.Array | None = None,
  *,
  interpret: Any = None,
) -> tuple[jax.Array, jax.Array]:
  """Runs the MLA decode kernel and merges its splits: (out `[b, sq, hq,
  dv]` in q's dtype, lse `[b, hq, sq]` float32). Arguments as
  `decode.sm90_decode`'s (descale: an e4m3 cache's `(k_descale,
  v_descale)`, float32 `[b, hk]`, both k_descale with v_cache=None);
  v_cache and flex_ops must be None (V is k_cache's first head_dim_v
  columns, no flex: `config_decode.mla_unsupported` refuses the rest)."""
  if v_cache is not None or flex_ops is not None:
    raise NotImplementedError(
      "the MLA kernel takes v_cache=None and no flex options"
    )
  if (descale is None) == spec.fp8_cache:
    raise ValueError(
      f"descale must be given exactly for an e4m3 cache; got {descale!r}"
      f" with a {spec.cache_dtype} cache"
    )
  plan = DecodePlan(spec, config, splits)
  ops = COMPILED if interpret is None else INTERPRETED
  pages = (
    jnp.zeros((spec.batch, 1), jnp.int32) if page_table is None else page_table
  )
  q_rows, extra = pack_queries(spec, q), ()
  if plan.fp8:  # Q in float16; its scale folds into k_descale
    q_rows, q_scale = converted_q(q_rows)
    extra = (descale[0] * q_scale, descale[1])
  pieces = build_mla_decode(plan, ops, interpret)(
    q_rows,
    k_cache,
    lengths.astype(jnp.int32),
    rows.astype(jnp.int32),
    pages.astype(jnp.int32),
    *extra,
    *(() if starts is None else (starts.astype(jnp.int32),)),
  )
  # [query tiles x splits, b, hk, rows, ...] -> [splits, b, hk, tiles x rows,
  # ...] (rows: 64, or the live ones with one query tile)
  o_parts, lse_parts = (
    jnp.moveaxis(
      x.reshape((plan.query_tiles, splits) + x.shape[1:]), 0, 3
    ).reshape((splits,) + x.shape[1:3] + (-1,) + x.shape[4:])
    for x in pieces
  )
  return merged_output(spec, o_parts, lse_parts, sinks)
