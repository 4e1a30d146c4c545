"""The FP8 (e4m3) FlashAttention-3 forward kernel for Hopper (sm90): the
bf16 kernel's pipeline (`pipeline.py`) on operands quantized by
`pallas_fa3.fp8.quantize` (e4m3 Q, K and V^T `[b, hk, d, skv]`, one float32
scale per tile). The Q and K scales fold into the softmax scale, O stays in
units of the current V tile's scale, and P, offset by 2^8 into the e4m3
range, is staged through shared memory for the P V wgmma; its leaf ops
(`Fp8Ops`), the query tile and the kernel's build are here.
`backends/blockwise/fp8.py` is the step-for-step twin.
docs/design_notes.md#fp8-forward-kernel
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa3.kernels.sm90 import compat, hardware, scores
from pallas_fa3.kernels.sm90.common import (
  MASK_EVERY_STEP_HEAD_DIM,
  QueryPlan,
  SegmentRefs,
  bounds_scratch,
  build_kernel,
  consumer_release,
  id_operands,
  kv_walk,
  pad_axis,
  smem_transforms,
  tile_span,
  tma_extent,
  walk_steps,
)
from pallas_fa3.kernels.sm90.config import NUM_CONSUMERS, Sm90ForwardConfig
from pallas_fa3.kernels.sm90.config_fp8 import out_cols
from pallas_fa3.kernels.sm90.ops import KernelOps
from pallas_fa3.kernels.sm90.pipeline import (
  Tile,
  TileWalk,
  Turns,
  kv_producer,
  num_ctas,
  query_walk,
  release_rest,
  run_consumer,
  turn_barriers,
)
from pallas_fa3.quant.e4m3 import (
  FP8_DTYPE,
  P_LOG2_OFFSET,
  finalize_fp8,
  online_softmax_fp8,
  v_scale_ratios,
)
from pallas_fa3.spec import LOG2E, AttentionSpec, cdiv

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Fp8Ops(KernelOps):
  """The FP8 kernel's products (everything else is inherited).

  Interpreted: e4m3 operands are upcast to float32 before the dot (exact:
  a product of two e4m3 values is exact in float32), float32 accumulation,
  as the wgmma does.
  """

  # The products of `scores_then_pv` and `accumulate_pv`: e4m3 Q, K; P in
  # shared memory and V^T, both k-major as FP8 wgmma requires.
  def _dot_qk(self, q_smem: Any, k_smem: Any) -> jax.Array:
    return jnp.dot(
      q_smem[...].astype(_F32),
      k_smem[...].astype(_F32).T,
      preferred_element_type=_F32,
    )

  def _dot_pv(self, p_smem: Any, vt_smem: Any) -> jax.Array:
    return jnp.dot(
      p_smem[...].astype(_F32),
      vt_smem[...].astype(_F32).T,
      preferred_element_type=_F32,
    )

  def _wgmma_pv(self, acc: Any, p_smem: Any, vt_smem: Any) -> None:
    plgpu.wgmma(acc, p_smem, vt_smem.transpose((1, 0)))


# The K/V ring's barriers, in `pipeline.kv_producer`'s order.
_RING = ("k_full", "v_full", "k_empty", "v_empty")


def sink_seed(
  ops: Fp8Ops, sinks_ref: Any, batch: Any, head: Any, rows: int
) -> tuple[jax.Array, jax.Array]:
  """(m, l) a row starts from: -inf and 0, or the sink in base 2 and its
  term in l (P's units: the 2^8 offset)."""
  if sinks_ref is None:
    return (
      ops.rows(jnp.full((rows,), -jnp.inf, _F32)),
      ops.rows(jnp.zeros((rows,), _F32)),
    )
  sink2 = sinks_ref[batch, head] * jnp.float32(LOG2E)
  return (
    ops.rows(jnp.broadcast_to(sink2, (rows,))),
    ops.rows(jnp.full((rows,), 2.0**P_LOG2_OFFSET, _F32)),
  )


def vt_cols(vt_ref: Any, batch: Any, kv_head: Any, cols: Any) -> Any:
  """One V^T tile: `[d, block_kv]` columns of the transposed `[b, h, d, s]` V."""
  return vt_ref.at[batch, kv_head, :, cols]


COMPILED_FP8 = Fp8Ops(interpreted=False)
INTERPRETED_FP8 = Fp8Ops(interpreted=True)


def query_tile(
  refs: dict[str, Any],
  seg: SegmentRefs | None,
  plan: QueryPlan,
  ops: Fp8Ops,
  turns: Turns,
  tile: Tile,
  base: jax.Array,
) -> None:
  """One query tile: S = Q K^T, softmax, O += P V over its K/V steps, K/V
  step j in ring slot `(base + j) % num_stages`. `refs["q"]`: Q, or Q and
  its rounding residual (S = Q K^T + Q_res K^T, two chained wgmma). As the
  bf16 kernel: the walk starts at a window's first tile, masks come from
  the positions or (segment ids, `seg`) the rows' key bounds, softcap is
  fused into the scores, sinks seed the running max."""
  q_refs, qs_ref, ks_ref, vs_ref, vr_ref, o_ref, lse_ref = (
    refs[n]
    for n in ("q", "q_scale", "k_scale", "v_scale", "v_ratio", "o", "lse")
  )
  q_smem_all, o_smem_all, p_smem_all, k_smem, vt_smem, lse_smem = (
    refs[n]
    for n in ("q_smem", "o_smem", "p_smem", "k_smem", "vt_smem", "lse_smem")
  )
  k_full, v_full, k_empty, v_empty = (refs[n] for n in _RING)
  q_bar, sinks_ref = refs["q_bar"], refs["sinks"]
  spec, cfg = plan.spec, plan.config
  wg = turns.wg
  batch, head, kv_head = tile.batch, tile.head, tile.kv_head
  row0 = tile.row0 + wg * cfg.block_q
  q_smem, p_smem = q_smem_all.at[wg], p_smem_all.at[wg]
  stages = cfg.num_stages

  def slot_of(j):
    return lax.rem(base + j, stages)

  for t, q_ref in enumerate(q_refs):  # one arrival each on the Q barrier
    plgpu.copy_gmem_to_smem(
      q_ref.at[batch, pl.ds(row0, cfg.block_q), head],
      q_smem.at[t],
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
  q_terms = tuple(q_smem.at[t] for t in range(len(q_refs)))
  # The Q tile's descale, folded with K's into the softmax scale.
  q_scale = qs_ref[batch, head, lax.div(row0, jnp.int32(cfg.block_q))]
  plgpu.barrier_wait(q_bar.at[wg])
  if seg is not None:
    bounds = tuple(ops.load_rows(seg.bounds_smem.at[i, wg]) for i in (0, 1))
    span = tile_span(seg.spans, batch, lax.div(tile.row0, plan.rows_per_cta))

  walk = kv_walk(plan, tile.row0, row0, cfg.block_q, span)
  shape = (cfg.block_q, cfg.block_kv)

  def mask_for(j):
    """Step j's mask (the bf16 kernel's rule, `scores.builtin_mask`)."""
    kv0 = (walk.first + j) * cfg.block_kv
    at = scores.query_tile_at(spec, row0, kv0, masked=True, bounds=bounds)
    return scores.builtin_mask(ops, spec, shape, at)

  last_kv = plan.seq_kv_pad // cfg.block_kv - 1

  def scales(j):
    """(K descale, sv_{j-1} / sv_j) of K/V step j (clamped: a prefetch past
    the last step reads the last)."""
    j = jnp.minimum(walk.first + j, last_kv)
    return ks_ref[batch, kv_head, j], vr_ref[batch, kv_head, j]

  def softmax(j, m, l, s, masked, sc):
    """Softmax of S_j with its scales `sc` (loaded a step ahead): (P_j in
    float32, O's rescale factor, m, l)."""
    k_scale, v_ratio = sc
    s, step = scores.softcapped(spec, s, q_scale * k_scale)
    p, alpha, m, l = online_softmax_fp8(
      s, m, l, scale_log2=step, mask=mask_for(j) if masked else None
    )
    # O stays in units of the current V tile's scale.
    return p, alpha * v_ratio, m, l

  def store_p(p):
    p_smem[...] = p.astype(FP8_DTYPE)
    plgpu.commit_smem()  # P visible to the wgmma (async proxy)

  # S_0 and its softmax (FA3's order as in the bf16 kernel, with P_j in
  # shared memory: it is stored only once the P V wgmma reading the previous
  # P is done).
  first = slot_of(0)
  sc0, sc1 = scales(0), scales(1)
  turns.wait()
  plgpu.barrier_wait(k_full.at[first])
  s0 = ops.with_scores(
    q_terms,
    (k_smem.at[first],) * len(q_terms),
    lambda read: (turns.pass_on(), read())[1],
  )
  plgpu.barrier_arrive(k_empty.at[first])
  m0, l0 = sink_seed(ops, sinks_ref, batch, head, cfg.block_q)
  p0, _, m0, l0 = softmax(0, m0, l0, s0, plan.needs_mask, sc0)
  store_p(p0)
  o0 = ops.tile(jnp.zeros((cfg.block_q, spec.head_dim), jnp.float32))
  like = (ops.tile(jnp.zeros(shape, jnp.float32)), m0, m0, l0)

  def step(j, carry, *, masked: bool):
    o, m, l, sc = carry
    ahead = scales(j + 2)  # used by the next step: its latency is hidden
    slot, nslot = slot_of(j), slot_of(j + 1)
    turns.wait()
    plgpu.barrier_wait(k_full.at[nslot])
    plgpu.barrier_wait(v_full.at[slot])

    def with_s(s):
      plgpu.barrier_arrive(k_empty.at[nslot])
      return softmax(j + 1, m, l, s, masked, sc)

    o, (p, rescale, m, l) = ops.scores_then_pv(
      q_terms,
      (k_smem.at[nslot],) * len(q_terms),
      o,
      p_smem,
      vt_smem.at[slot],
      like,
      issued=turns.pass_on,
      with_s=with_s,
    )
    plgpu.barrier_arrive(v_empty.at[slot])
    store_p(p)
    return o * lax.broadcast_in_dim(rescale, o.shape, [0]), m, l, ahead

  o, m, l, _ = walk_steps(
    walk,
    step,
    (o0, m0, l0, sc1),
    masked=plan.needs_mask,
    ahead=1,
    split=spec.head_dim < MASK_EVERY_STEP_HEAD_DIM,  # as the bf16 kernel
  )
  steps = walk.steps
  last = slot_of(steps - 1)
  turns.wait()
  plgpu.barrier_wait(v_full.at[last])
  o = ops.accumulate_pv(o, p_smem, vt_smem.at[last], issued=turns.pass_on)
  plgpu.barrier_arrive(v_empty.at[last])
  ring = (k_full, v_full, k_empty, v_empty)
  release_rest(turns, ring, stages, base, steps, walk.cta_steps)
  last_tile = jnp.minimum(walk.first + steps - 1, last_kv)
  out, lse = finalize_fp8(o, m, l, vs_ref[batch, kv_head, last_tile])
  o_smem, lse_wg = o_smem_all.at[wg], lse_smem.at[wg]
  lse_wg[...] = lse
  # O leaves in column chunks through one staging tile (d = 256: half of
  # it), each rewritten once the previous chunk's store has read it.
  cols = o_smem.shape[-1]
  for c in range(spec.head_dim // cols):
    if c:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    o_smem[...] = out[:, c * cols : (c + 1) * cols].astype(spec.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(
      o_smem,
      o_ref.at[batch, pl.ds(row0, cfg.block_q), head, pl.ds(c * cols, cols)],
    )
  plgpu.copy_smem_to_gmem(
    lse_wg, lse_ref.at[batch, head, pl.ds(row0, cfg.block_q)]
  )


# setmaxnreg per role: 2 x 232 + 40 = 504, the 384-thread CTA's whole pool
# (240/32 asked for 512: its increase would never have completed). 232/40
# compiles every FP8 config without spills, 240/24 spilled two (the
# producer): docs/design_notes.md#setmaxnreg-splits.
CONSUMER_REGS = 232
PRODUCER_REGS = 40
hardware.check_split(NUM_CONSUMERS + 1, CONSUMER_REGS, PRODUCER_REGS)


def _build(
  plan: QueryPlan, ops: Fp8Ops, interpret: Any, q_rows: int, terms: int
) -> Callable:
  spec, cfg = plan.spec, plan.config
  walk = TileWalk(
    plan, num_ctas(plan.num_tiles, ops.interpreted, cfg.persistent)
  )
  d = spec.head_dim
  qk_transforms = smem_transforms(FP8_DTYPE, d)
  seq_transforms = smem_transforms(FP8_DTYPE, cfg.block_kv)  # P and V^T rows

  def fa3_fwd_fp8(refs: dict[str, Any]) -> None:
    refs = dict(refs, q=tuple(refs.pop(f"q{t}") for t in range(terms)))
    seg, tiles_walk = query_walk(spec, refs, walk)
    turns = () if refs["turns"] is None else (refs["turns"],)
    wg = lax.axis_index("wg")

    @pl.when(wg < NUM_CONSUMERS)
    def _():
      run_consumer(
        tiles_walk,
        turns,
        CONSUMER_REGS,
        lambda *at: query_tile(refs, seg, plan, ops, *at),
      )

    @pl.when(wg == NUM_CONSUMERS)
    def _():
      kv_producer(
        (refs["k"], refs["vt"], refs["k_smem"], refs["vt_smem"])
        + tuple(refs[n] for n in _RING),
        tiles_walk,
        registers=PRODUCER_REGS,
        v_tile=vt_cols,
      )

  (turns,) = turn_barriers(ops.interpreted) or (None,)  # (named compiled)
  scratch = dict(
    q_smem=plgpu.SMEM(
      (NUM_CONSUMERS, terms, cfg.block_q, d),
      FP8_DTYPE,
      transforms=qk_transforms,
    ),
    o_smem=plgpu.SMEM(
      (NUM_CONSUMERS, cfg.block_q, out_cols(d)),
      spec.dtype,
      transforms=smem_transforms(spec.dtype, out_cols(d)),
    ),
    p_smem=plgpu.SMEM(
      (NUM_CONSUMERS, cfg.block_q, cfg.block_kv),
      FP8_DTYPE,
      transforms=seq_transforms,
    ),
    k_smem=plgpu.SMEM(
      (cfg.num_stages, cfg.block_kv, d), FP8_DTYPE, transforms=qk_transforms
    ),
    vt_smem=plgpu.SMEM(
      (cfg.num_stages, d, cfg.block_kv), FP8_DTYPE, transforms=seq_transforms
    ),
    lse_smem=plgpu.SMEM((NUM_CONSUMERS, cfg.block_q), _F32),
    k_full=plgpu.Barrier(num_barriers=cfg.num_stages),  # (TMA)
    v_full=plgpu.Barrier(num_barriers=cfg.num_stages),
    k_empty=consumer_release(cfg.num_stages),  # one arrival per consumer
    v_empty=consumer_release(cfg.num_stages),
    # Q tile(s) per consumer (and its rows' key bounds: one arrival each)
    q_bar=plgpu.Barrier(
      num_arrivals=terms + (2 if spec.segmented else 0),
      num_barriers=NUM_CONSUMERS,
    ),
    turns=turns,  # the pingpong's mbarriers in interpret mode
    bounds_smem=(
      bounds_scratch(cfg.block_q, NUM_CONSUMERS)[0] if spec.segmented else None
    ),
  )
  out_type = dict(
    o=jax.ShapeDtypeStruct((spec.batch, q_rows, spec.heads_q, d), spec.dtype),
    # Padded to whole tiles, as in the bf16 kernel (a bulk copy's bound).
    lse=jax.ShapeDtypeStruct((spec.batch, spec.heads_q, plan.seq_q_pad), _F32),
  )
  inputs = [f"q{t}" for t in range(terms)]
  inputs += ["k", "vt", "q_scale", "k_scale", "v_scale", "v_ratio"]
  inputs += ["sinks"] * spec.sinks + ["lo", "hi", "spans"] * spec.segmented
  optional = [n for n in ("sinks", "lo", "hi", "spans") if n not in inputs]
  return build_kernel(
    fa3_fwd_fp8,
    inputs=inputs,
    optional=optional,
    out_type=out_type,
    scratch=scratch,
    grid=walk.grid[0],
    grid_names=walk.grid[1],
    warpgroups=NUM_CONSUMERS + 1,
    interpret=interpret,
  )


def sm90_forward_fp8(
  spec: AttentionSpec,
  config: Sm90ForwardConfig,
  q8: jax.Array,
  k8: jax.Array,
  v8t: jax.Array,
  q_scale: jax.Array,
  k_scale: jax.Array,
  v_scale: jax.Array,
  q_residual: jax.Array | None = None,
  *,
  interpret: Any = None,
  sinks: jax.Array | None = None,
  segment_ids: Any = None,
) -> tuple[jax.Array, jax.Array]:
  """Runs the FP8 forward kernel (the fields of `FP8Inputs` in order).

  Args:
    spec: the call; `spec.dtype` is the output dtype (bf16 or fp16).
    config: the tiling; its block_q / block_kv are the quantization tiles.
    q8: `[b, sq, hq, d]` e4m3.  k8: `[b, skv, hk, d]` e4m3.
    v8t: `[b, hk, d, skv]` e4m3 (V transposed: sequence-contiguous).
    q_scale: `[b, hq, ceil(sq / block_q)]` float32.
    k_scale, v_scale: `[b, hk, ceil(skv / block_kv)]` float32, positive.
    q_residual: None, or Q's rounding residual `[b, sq, hq, d]` e4m3 in
      q_scale's units (`FP8Config(q_residual=True)`).
    interpret: None compiles for sm90; interpret-mode parameters run the same
      kernel on a CPU.
    sinks: float32 `[b, hq]` when `spec.sinks`.
    segment_ids: with `spec.segmented`, each query row's key bounds
      `(lo, hi)` as the bf16 kernel takes them (`segments.kernel_bounds`).

  Returns:
    (out `[b, sq, hq, d]` in `spec.dtype`, float32 lse `[b, hq, sq]`).
  """
  tile_q = config.rows_per_cta
  plan = QueryPlan(
    spec,
    config,
    seq_q_pad=cdiv(spec.seq_q, tile_q) * tile_q,
    seq_kv_pad=cdiv(spec.seq_kv, config.block_kv) * config.block_kv,
  )
  ops = COMPILED_FP8 if interpret is None else INTERPRETED_FP8
  n_q_tiles = plan.seq_q_pad // config.block_q
  v_scale = v_scale.astype(_F32)
  # Ragged edges of Q and K by TMA, as in the bf16 kernel.
  qs = [
    tma_extent(q, 1, config.block_q) for q in (q8, q_residual) if q is not None
  ]
  out, lse = _build(plan, ops, interpret, qs[0].shape[1], len(qs))(
    *qs,
    tma_extent(k8, 1, config.block_kv),
    # V^T's sequence runs along its swizzled rows, whose tiling is a whole
    # block here: it stays padded (the quantization pass writes it anyway).
    pad_axis(v8t, 3, plan.seq_kv_pad),
    pad_axis(q_scale.astype(_F32), 2, n_q_tiles, 1.0),
    k_scale.astype(_F32),
    v_scale,
    v_scale_ratios(v_scale),
    *(() if sinks is None else (sinks.astype(_F32),)),
    *(() if segment_ids is None else id_operands(plan, *segment_ids)),
  )
  return out[:, : spec.seq_q], lse[:, :, : spec.seq_q]
