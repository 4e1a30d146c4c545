"""FlashAttention-3 forward kernel for Hopper (sm90) in Pallas Mosaic GPU.

A persistent grid (`pipeline.py`: one CTA per SM, causal tiles longest
first) of query tiles of `2 * block_q` rows of one (batch, head): a producer
warpgroup streams K/V tiles by TMA into a `num_stages` ring that runs on
across tiles; two consumer warpgroups compute S = Q K^T, an exp2 online
softmax and O += P V with wgmma, in pingpong (`pipeline.Turns`), in FA3's
order: the softmax of S_{j+1} runs while P_j V_j is in flight (or, with
`overlap=False`, each step's S, softmax and P V in turn). Fully masked
K/V tiles are skipped, fully visible ones are not masked; GQA heads share
their K/V head; ragged sequences are padded to whole tiles. The leaf
operations that differ in interpret mode are `ops.KernelOps`.
Design and measurements: docs/design_notes.md#forward-kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa3.kernels.sm90 import compat, flex_tile, scores
from pallas_fa3.kernels.sm90.common import (
  CONSUMER_REGS,
  MASK_EVERY_STEP_HEAD_DIM,
  PRODUCER_REGS,
  QueryPlan,
  SegmentRefs,
  bounds_scratch,
  build_kernel,
  consumer_release,
  id_operands,
  kv_walk,
  smem_transforms,
  tma_extent,
  walk_steps,
)
from pallas_fa3.kernels.sm90.config import (
  NUM_CONSUMERS,
  Sm90ForwardConfig,
  forward_qo_layout,
)
from pallas_fa3.kernels.sm90.ops import COMPILED, INTERPRETED, KernelOps
from pallas_fa3.kernels.sm90.pipeline import (
  Tile,
  TileWalk,
  Turns,
  kv_producer,
  num_ctas,
  query_span,
  query_walk,
  release_rest,
  run_consumer,
  turn_barriers,
)
from pallas_fa3.lse import natural_from_log2
from pallas_fa3.spec import LOG2E, AttentionSpec, cdiv

# The widest dv at which O's rescale moves between the GEMM issues (`step`).
EARLY_RESCALE_MAX_DV = 64

# The K/V ring's barriers, in `pipeline.kv_producer`'s order.
_RING = ("k_full", "v_full", "k_empty", "v_empty")


def _query_tile(
  refs: dict[str, Any],
  qo: tuple[Any, Any],
  seg: SegmentRefs | None,
  plan: QueryPlan,
  ops: KernelOps,
  turns: Turns,
  tile: Tile,
  base: jax.Array,
) -> None:
  """One query tile in FA3's order: in its pingpong turn the consumer issues
  S_{j+1} = Q K_{j+1}^T and O += P_j V_j, then runs the softmax of S_{j+1}
  while P_j V_j is still in flight (`config.overlap`; else `serial_step`).
  K/V step j sits in ring slot
  `(base + j) % num_stages`. `qo`: this consumer's Q and O tiles
  (`config.forward_qo_layout`)."""
  q_ref, sinks_ref, k_smem, v_smem = (
    refs[n] for n in ("q", "sinks", "k_smem", "v_smem")
  )
  q_bar = refs["q_bar"]
  q_smem, o_smem = qo
  ring = tuple(refs[n] for n in _RING)
  k_full, v_full, k_empty, v_empty = ring
  spec, cfg = plan.spec, plan.config
  wg = turns.wg
  batch, head = tile.batch, tile.head
  row0 = tile.row0 + wg * cfg.block_q
  stages = cfg.num_stages

  def slot_of(j):
    return lax.rem(base + j, stages)

  plgpu.copy_gmem_to_smem(
    q_ref.at[batch, pl.ds(row0, cfg.block_q), head],
    q_smem,
    q_bar.at[wg],
    oob_mode=compat.ZERO_FILL,
  )
  span = bounds = None
  if seg is not None:  # the rows' key bounds arrive on the Q barrier too
    for i, ref in enumerate((seg.lo, seg.hi)):
      plgpu.copy_gmem_to_smem(
        ref.at[batch, pl.ds(row0, cfg.block_q)],
        seg.bounds_smem.at[i, wg],
        q_bar.at[wg],
      )
  plgpu.barrier_wait(q_bar.at[wg])
  if seg is not None:
    bounds = tuple(ops.load_rows(seg.bounds_smem.at[i, wg]) for i in (0, 1))
  if seg is not None or refs.get("bm_spans") is not None:
    q_tile = lax.div(tile.row0, jnp.int32(plan.rows_per_cta))
    span = query_span(refs, seg, batch, q_tile, head)

  walk = kv_walk(plan, tile.row0, row0, cfg.block_q, span)
  # A flex function's loads run ahead of the wgmma they would wait for: its
  # reads by batch / head before the loop, the rest of a step's before the
  # step's P V issues (model B, d128: ALiBi 1.20 -> 1.05x the plain forward,
  # a dense bias 1.20 -> 1.06, T5 buckets 1.18 -> 1.08). Not with a block
  # mask: its branch on the tile's state keeps the exp2s out from under the
  # wgmma anyway (1.15 -> 1.21 with the loads ahead).
  prefetching = spec.flex is not None and spec.flex.block is None
  scalars = None
  if spec.flex is not None:
    shape = (cfg.block_q, cfg.block_kv)
    scalars = flex_tile.preload_scalars(
      spec, refs, ops, shape, row0, batch, head
    )

  def softmax(s, j, m, l, *, masked: bool, fetched=None):
    at = scores.query_tile_at(
      spec, row0, (walk.first + j) * cfg.block_kv, masked=masked,
      bounds=bounds, flex=(refs, batch, head),
    )  # fmt: skip
    x = scores.logits(
      ops, spec, s, at, scalars=scalars, fetched=fetched,
      float_differences=max(spec.head_dim, spec.head_dim_v)
      <= flex_tile.FLOAT_DIFFERENCE_MAX_HEAD_DIM,
    )  # fmt: skip
    return scores.online_softmax(x, m, l)

  def qk(slot):  # S = Q K^T in this consumer's turn, K released
    plgpu.barrier_wait(k_full.at[slot])
    s = ops.with_scores(
      q_smem, k_smem.at[slot], lambda read: (turns.pass_on(), read())[1]
    )
    plgpu.barrier_arrive(k_empty.at[slot])
    return s

  if sinks_ref is None:
    m0 = ops.rows(jnp.full((cfg.block_q,), -jnp.inf, jnp.float32))
    l0 = ops.rows(jnp.zeros((cfg.block_q,), jnp.float32))
  else:  # the sink seeds the running max and sum: exp2(sink2 - m) in l
    sink2 = sinks_ref[batch, head] * jnp.float32(LOG2E)
    m0 = ops.rows(jnp.broadcast_to(sink2, (cfg.block_q,)))
    l0 = ops.rows(jnp.ones((cfg.block_q,), jnp.float32))
  o0 = ops.tile(jnp.zeros((cfg.block_q, spec.head_dim_v), jnp.float32))
  split = (
    max(spec.head_dim, spec.head_dim_v) < MASK_EVERY_STEP_HEAD_DIM
    # (a flex mask applies at every step: one loop, not three copies)
    and spec.flex is None
  )

  def finish(o, m, l):  # the other consumer's K/V tiles, then O and lse
    release_rest(turns, ring, stages, base, walk.steps, walk.cta_steps)
    lse_smem = refs["lse_smem"].at[wg]
    _epilogue(
      plan, o, m, l, o_smem, lse_smem, refs["o"], refs["lse"], batch, head, row0
    )

  def serial_step(j, carry, *, masked: bool):
    # `overlap=False`: S_j, its softmax, then P_j V_j waited for; no P
    # lives across the next S (one turn per step, as `release_rest` takes).
    o, m, l = carry
    slot = slot_of(j)
    turns.wait()
    p, alpha, m, l = softmax(qk(slot), j, m, l, masked=masked)
    o = o * lax.broadcast_in_dim(alpha, o.shape, [0])
    plgpu.barrier_wait(v_full.at[slot])
    o = ops.accumulate_pv(o, p.astype(spec.dtype), v_smem.at[slot])
    plgpu.barrier_arrive(v_empty.at[slot])
    return o, m, l

  if not cfg.overlap:
    o, m, l = walk_steps(
      walk, serial_step, (o0, m0, l0), masked=plan.needs_mask, split=split
    )
    return finish(o, m, l)

  # S_0 and its softmax: O starts at 0, so no P V is in flight yet.
  turns.wait()
  s0 = qk(slot_of(0))
  p0, _, m0, l0 = softmax(s0, 0, m0, l0, masked=plan.needs_mask)
  # The shapes `scores_then_pv` returns: P, alpha, m, l in float32.
  like = (ops.tile(jnp.zeros(s0.shape, jnp.float32)), m0, m0, l0)

  # Where the softmax, not the tensor core, bounds a step (dv <= 64 at up
  # to 128 keys), O's rescale by tile j's alpha runs between the issues of
  # S_{j+1} and P_j V_j, while S computes, instead of after the step's last
  # wait (the carry's `a`): perfcmp's model B per block, d64 causal 1243 ->
  # 1210 cycles; at 192 keys 1151 -> 1165, so not there (RESULTS, issue 43).
  early = spec.head_dim_v <= EARLY_RESCALE_MAX_DV and cfg.block_kv <= 128

  def step(j, carry, *, masked: bool):
    # Tile j + 1's scores and softmax with tile j's P V in flight.
    o, p, m, l, *a = carry
    slot, nslot = slot_of(j), slot_of(j + 1)
    fetched = None
    if prefetching:  # tile j + 1's loads, before P_j V_j issues
      kv0 = (walk.first + j + 1) * cfg.block_kv
      fetched = flex_tile.prefetch(
        spec, refs, ops, (cfg.block_q, cfg.block_kv), row0, kv0, batch, head,
        scalars,
      )  # fmt: skip
    turns.wait()
    plgpu.barrier_wait(k_full.at[nslot])
    plgpu.barrier_wait(v_full.at[slot])

    def with_s(s):
      plgpu.barrier_arrive(k_empty.at[nslot])  # K_{j+1} read: release it
      return softmax(s, j + 1, m, l, masked=masked, fetched=fetched)

    o, (p, alpha, m, l) = ops.scores_then_pv(
      q_smem,
      k_smem.at[nslot],
      o,
      p,
      v_smem.at[slot],
      like,
      issued=turns.pass_on,
      with_s=with_s,
      o_scale=a[0] if early else None,
    )
    plgpu.barrier_arrive(v_empty.at[slot])
    if early:
      return o, p.astype(spec.dtype), m, l, alpha
    o = o * lax.broadcast_in_dim(alpha, o.shape, [0])
    return o, p.astype(spec.dtype), m, l

  # Step j softmaxes tile j + 1.
  carry = (o0, p0.astype(spec.dtype), m0, l0)
  carry += (ops.rows(jnp.ones_like(l0)),) * early  # (O holds zeros)
  carry = walk_steps(
    walk, step, carry, masked=plan.needs_mask, ahead=1, split=split
  )
  o, p, m, l, *a = carry
  if early:
    o = o * lax.broadcast_in_dim(a[0], o.shape, [0])
  last = slot_of(walk.steps - 1)
  turns.wait()
  plgpu.barrier_wait(v_full.at[last])
  o = ops.accumulate_pv(o, p, v_smem.at[last], issued=turns.pass_on)
  plgpu.barrier_arrive(v_empty.at[last])
  finish(o, m, l)


def _epilogue(
  plan: QueryPlan, o, m, l, o_smem, lse_smem, o_ref, lse_ref, batch, head, row0
) -> None:
  """Normalizes O, writes it and the lse through shared memory by TMA (not
  waited for here)."""
  cfg = plan.config
  empty = l == 0.0
  inv_l = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
  chunk = 64
  for c in range(0, o.shape[1], chunk):
    part = o[:, c : c + chunk]
    o_smem[:, c : c + chunk] = (
      part * lax.broadcast_in_dim(inv_l, part.shape, [0])
    ).astype(plan.spec.dtype)
  log2_l = jnp.log(jnp.where(empty, 1.0, l)) * jnp.float32(LOG2E)
  lse_smem[...] = jnp.where(empty, -jnp.inf, natural_from_log2(m + log2_l))
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(
    o_smem, o_ref.at[batch, pl.ds(row0, cfg.block_q), head]
  )
  plgpu.copy_smem_to_gmem(
    lse_smem, lse_ref.at[batch, head, pl.ds(row0, cfg.block_q)]
  )


def _build(
  plan: QueryPlan,
  ops: KernelOps,
  interpret: Any,
  q_rows: int,
  flex_names: tuple[str, ...] = (),
) -> Callable:
  spec, cfg = plan.spec, plan.config
  walk = TileWalk(
    plan, num_ctas(plan.num_tiles, ops.interpreted, cfg.persistent)
  )
  d, dv = spec.head_dim, spec.head_dim_v
  layout = forward_qo_layout(cfg, d, spec.dtype.itemsize, dv)
  tmas = 3 if spec.segmented else 1  # TMA copies per Q barrier phase

  def fa3_fwd(refs: dict[str, Any]) -> None:
    qo = refs["qo_smem"]
    if layout == "shared":  # Q's tiles, then O's on the way out
      qo = (qo, qo)
    seg, tiles = query_walk(spec, refs, walk)
    turns = () if refs["turns"] is None else (refs["turns"],)
    wg = lax.axis_index("wg")

    def consumer(qo):  # qo: this consumer's Q and O tiles
      run_consumer(
        tiles,
        turns,
        CONSUMER_REGS,
        lambda *at: _query_tile(refs, qo, seg, plan, ops, *at),
      )

    if layout == "per_consumer":  # a union per consumer: refs by warpgroup
      for w, union in enumerate(qo):
        pl.when(wg == w)(functools.partial(consumer, tuple(union)))
    else:
      q_all, o_all = qo
      pl.when(wg < NUM_CONSUMERS)(
        lambda: consumer((q_all.at[wg], o_all.at[wg]))
      )

    @pl.when(wg == NUM_CONSUMERS)
    def _():
      kv_producer(
        (refs["k"], refs["v"], refs["k_smem"], refs["v_smem"])
        + tuple(refs[n] for n in _RING),
        tiles,
        registers=PRODUCER_REGS,
      )

  ring = lambda width: plgpu.SMEM(
    (cfg.num_stages, cfg.block_kv, width),
    spec.dtype,
    transforms=smem_transforms(spec.dtype, width),
  )
  tiles = lambda width, *n: plgpu.SMEM(
    (*n, cfg.block_q, width),
    spec.dtype,
    transforms=smem_transforms(spec.dtype, width),
  )
  # O is written once the consumer's last wgmma has read its Q.
  if layout == "shared":
    qo = tiles(d, NUM_CONSUMERS)
  elif layout == "separate":
    qo = (tiles(d, NUM_CONSUMERS), tiles(dv, NUM_CONSUMERS))
  else:
    qo = tuple(
      plgpu.RefUnion(tiles(d), tiles(dv)) for _ in range(NUM_CONSUMERS)
    )
  (turns,) = turn_barriers(ops.interpreted) or (None,)  # (named compiled)
  scratch = dict(
    qo_smem=qo,
    k_smem=ring(d),
    v_smem=ring(dv),
    lse_smem=plgpu.SMEM((NUM_CONSUMERS, cfg.block_q), jnp.float32),
    k_full=plgpu.Barrier(num_barriers=cfg.num_stages),  # (TMA)
    v_full=plgpu.Barrier(num_barriers=cfg.num_stages),
    k_empty=consumer_release(cfg.num_stages),  # one arrival per consumer
    v_empty=consumer_release(cfg.num_stages),
    # Q tile per consumer (and its rows' key bounds: one arrival each)
    q_bar=plgpu.Barrier(num_arrivals=tmas, num_barriers=NUM_CONSUMERS),
    turns=turns,  # the pingpong's mbarriers in interpret mode
    bounds_smem=(
      bounds_scratch(cfg.block_q, NUM_CONSUMERS)[0] if spec.segmented else None
    ),
  )
  out_type = dict(
    o=jax.ShapeDtypeStruct((spec.batch, q_rows, spec.heads_q, dv), spec.dtype),
    # The lse tile's store is a plain bulk copy, whose bound is the end of
    # the whole buffer, not of a row: its buffer is padded to whole tiles.
    lse=jax.ShapeDtypeStruct(
      (spec.batch, spec.heads_q, plan.seq_q_pad), jnp.float32
    ),
  )
  inputs = ["q", "k", "v"] + ["sinks"] * spec.sinks
  inputs += ["lo", "hi", "spans"] * spec.segmented  # the rows' key bounds
  inputs += list(flex_names)  # flex_tile.kernel_operands'
  optional = [
    n for n in ("sinks", "lo", "hi", "spans", "bm_spans") if n not in inputs
  ]
  return build_kernel(
    fa3_fwd,
    inputs=inputs,
    optional=optional,
    out_type=out_type,
    scratch=scratch,
    grid=walk.grid[0],
    grid_names=walk.grid[1],
    warpgroups=NUM_CONSUMERS + 1,
    interpret=interpret,
  )


def sm90_forward(
  spec: AttentionSpec,
  config: Sm90ForwardConfig,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  interpret: Any = None,
  sinks: jax.Array | None = None,
  segment_ids: Any = None,
  flex: Any = None,
) -> tuple[jax.Array, jax.Array]:
  """Runs the forward kernel.

  Args:
    spec: the call (bf16/fp16).
    config: the tiling.
    q: `[b, sq, hq, d]`.
    k: `[b, skv, hk, d]`.
    v: `[b, skv, hk, dv]` (dv may differ from d: Q's and O's tiles then
      do not share a buffer, `config.forward_qo_layout`).
    interpret: None compiles for sm90; interpret-mode parameters
      (`compat.interpret_params(...)`) run the same kernel on a CPU.
    sinks: float32 `[b, hq]` when `spec.sinks`.
    segment_ids: with `spec.segmented`, each query row's key bounds
      `(lo, hi)`, narrowed by the causal/window rule
      (`segments.kernel_bounds`, exact for contiguous ids): the CTA walks
      only the K/V tiles its rows reach and masks by the bounds alone.
    flex: `spec.flex`'s operands (`flex.FlexOperands`): score_mod and
      mask_mod traced into the tile loop, a block mask's empty tiles
      skipped by the producer (`flex_tile`).

  Returns:
    (out `[b, sq, hq, dv]` in `spec.dtype`, float32 lse `[b, hq, sq]`).
  """
  tile_q = config.rows_per_cta
  plan = QueryPlan(
    spec,
    config,
    seq_q_pad=cdiv(spec.seq_q, tile_q) * tile_q,
    seq_kv_pad=cdiv(spec.seq_kv, config.block_kv) * config.block_kv,
  )
  ops = COMPILED if interpret is None else INTERPRETED
  # Ragged edges by TMA (zero-filled reads, dropped writes): no padded copy
  # unless a length is shorter than one tile or not a multiple of 8.
  q = tma_extent(q, 1, config.block_q)
  extra = {}
  if spec.flex is not None:
    extra = flex_tile.kernel_operands(
      spec,
      flex,
      q_pad=plan.seq_q_pad,
      kv_pad=plan.seq_kv_pad,
      rows_per_cta=tile_q,
      block_kv=config.block_kv,
      tile_rows=config.block_q,
    )
  out, lse = _build(plan, ops, interpret, q.shape[1], tuple(extra))(
    q,
    tma_extent(k, 1, config.block_kv),
    tma_extent(v, 1, config.block_kv),
    *(() if sinks is None else (sinks.astype(jnp.float32),)),
    *(() if segment_ids is None else id_operands(plan, *segment_ids)),
    *extra.values(),
  )
  return out[:, : spec.seq_q], lse[:, :, : spec.seq_q]
