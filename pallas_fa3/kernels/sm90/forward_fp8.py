"""FP8 (e4m3) FlashAttention-3 forward kernel for Hopper (sm90), Pallas Mosaic GPU.

The bf16 kernel's pipeline (`forward`) on operands quantized by
`pallas_fa3.fp8.quantize`: e4m3 Q, K and V^T (`[b, hk, d, skv]`, k-major as
FP8 wgmma requires) with one float32 scale per tile. The Q and K scales
fold into the softmax scale; O is kept in units of the current V tile's
scale and rescaled by `sv_{j-1} / sv_j`. P is offset by 2^8 into the e4m3
range and staged through shared memory for the P V wgmma. The output is in
`spec.dtype`; `backends/blockwise_fp8.py` is the step-for-step twin.
Design and measurements: docs/design_notes.md#fp8-forward-kernel.
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

from pallas_fa3 import masking
from pallas_fa3.kernels import hopper
from pallas_fa3.kernels.sm90 import compat
from pallas_fa3.kernels.sm90.common import (
  QueryPlan,
  build_kernel,
  consumer_release,
  kv_steps,
  pad_axis,
  smem_transforms,
  tma_extent,
)
from pallas_fa3.kernels.sm90.config import NUM_CONSUMERS, Sm90ForwardConfig
from pallas_fa3.kernels.sm90.config_fp8 import out_cols
from pallas_fa3.kernels.sm90.ops_fp8 import (
  COMPILED_FP8,
  INTERPRETED_FP8,
  Fp8Ops,
)
from pallas_fa3.kernels.sm90.persistent import (
  Tile,
  TileWalk,
  kv_producer,
  num_ctas,
  run_consumer,
)
from pallas_fa3.kernels.sm90.pingpong import Turns, release_rest, turn_barriers
from pallas_fa3.quant.e4m3 import (
  FP8_DTYPE,
  finalize_fp8,
  online_softmax_fp8,
  v_scale_ratios,
)
from pallas_fa3.spec import LOG2E, AttentionSpec

_F32 = jnp.float32
# setmaxnreg per role: 2 x 232 + 40 = 504, the 384-thread CTA's whole pool
# (240/32 asked for 512: its increase would never have completed). 232/40
# compiles every FP8 config without spills, 240/24 spilled two (the
# producer): docs/design_notes.md#setmaxnreg-splits.
CONSUMER_REGS = 232
PRODUCER_REGS = 40
hopper.check_split(NUM_CONSUMERS + 1, CONSUMER_REGS, PRODUCER_REGS)


def _query_tile(
  refs: tuple,
  plan: QueryPlan,
  ops: Fp8Ops,
  turns: Turns,
  tile: Tile,
  base: jax.Array,
) -> None:
  """One query tile: S = Q K^T, softmax, O += P V over its K/V steps, K/V
  step j in ring slot `(base + j) % num_stages`. `q_refs`: Q, or Q and its
  rounding residual (S = Q K^T + Q_res K^T, two chained wgmma)."""
  (
    q_refs,
    qs_ref,
    ks_ref,
    vs_ref,
    vr_ref,
    o_ref,
    lse_ref,
    q_smem_all,
    o_smem_all,
    p_smem_all,
    k_smem,
    vt_smem,
    lse_smem,
    k_full,
    v_full,
    k_empty,
    v_empty,
    q_bar,
  ) = refs
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
  q_terms = tuple(q_smem.at[t] for t in range(len(q_refs)))
  # The Q tile's descale, folded into the softmax scale.
  q_scale = qs_ref[batch, head, lax.div(row0, jnp.int32(cfg.block_q))]
  scale_log2 = jnp.float32(spec.softmax_scale * LOG2E) * q_scale
  plgpu.barrier_wait(q_bar.at[wg])

  steps, unmasked = kv_steps(plan, row0, cfg.block_q)
  cta_steps, _ = kv_steps(plan, tile.row0, plan.rows_per_cta)
  shape = (cfg.block_q, cfg.block_kv)
  # The mask as one per-row bound against the column index: one compare per
  # element, few live registers.
  keys_end = ops.rows(
    masking.visible_keys_end(spec, row0 + ops.row_index(cfg.block_q))
  )

  def mask_for(j):  # 1-D vectors broadcast: no index tile in registers
    return lax.broadcast_in_dim(ops.col_index(cfg.block_kv), shape, [1]) < (
      lax.broadcast_in_dim(keys_end - j * cfg.block_kv, shape, [0])
    )

  last_kv = plan.seq_kv_pad // cfg.block_kv - 1

  def scales(j):
    """(K descale, sv_{j-1} / sv_j) of K/V step j (clamped: a prefetch past
    the last step reads the last)."""
    j = jnp.minimum(j, last_kv)
    return ks_ref[batch, kv_head, j], vr_ref[batch, kv_head, j]

  def softmax(j, m, l, s, masked, sc):
    """Softmax of S_j with its scales `sc` (loaded a step ahead): (P_j in
    float32, O's rescale factor, m, l)."""
    k_scale, v_ratio = sc
    p, alpha, m, l = online_softmax_fp8(
      s,
      m,
      l,
      scale_log2=scale_log2 * k_scale,
      mask=mask_for(j) if masked else None,
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
  m0 = ops.rows(jnp.full((cfg.block_q,), -jnp.inf, jnp.float32))
  l0 = ops.rows(jnp.zeros((cfg.block_q,), jnp.float32))
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

  split = jnp.clip(unmasked - 1, 0, steps - 1)
  carry = (o0, m0, l0, sc1)
  carry = lax.fori_loop(0, split, functools.partial(step, masked=False), carry)
  carry = lax.fori_loop(
    split, steps - 1, functools.partial(step, masked=plan.needs_mask), carry
  )
  o, m, l, _ = carry
  last = slot_of(steps - 1)
  turns.wait()
  plgpu.barrier_wait(v_full.at[last])
  o = ops.accumulate_pv(o, p_smem, vt_smem.at[last], issued=turns.pass_on)
  plgpu.barrier_arrive(v_empty.at[last])
  ring = (k_full, v_full, k_empty, v_empty)
  release_rest(turns, ring, stages, base, steps, cta_steps)
  out, lse = finalize_fp8(o, m, l, vs_ref[batch, kv_head, steps - 1])
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


def _vt_cols(vt_ref: Any, batch: Any, kv_head: Any, cols: Any) -> Any:
  """One V^T tile: `[d, block_kv]` columns of the transposed `[b, h, d, s]` V."""
  return vt_ref.at[batch, kv_head, :, cols]


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

  def fa3_fwd_fp8(*refs):
    q_refs, refs = refs[:terms], refs[terms:]
    k_ref, vt_ref, qs_ref, ks_ref, vs_ref, vr_ref, o_ref, lse_ref = refs[:8]
    scratch = refs[8:]
    # scratch: q, o, p, k, V^T, lse tiles; k/v full and empty; q; turns.
    tiles, ring, q_bar, turns = (
      scratch[:6],
      scratch[6:10],
      scratch[10],
      scratch[11:],
    )
    wg = lax.axis_index("wg")

    @pl.when(wg < NUM_CONSUMERS)
    def _():
      refs = (q_refs, qs_ref, ks_ref, vs_ref, vr_ref, o_ref, lse_ref)
      run_consumer(
        walk,
        turns,
        CONSUMER_REGS,
        lambda *at: _query_tile((*refs, *tiles, *ring, q_bar), plan, ops, *at),
      )

    @pl.when(wg == NUM_CONSUMERS)
    def _():
      kv_producer(
        (k_ref, vt_ref, tiles[3], tiles[4], *ring),
        walk,
        registers=PRODUCER_REGS,
        v_tile=_vt_cols,
      )

  scratch = (
    plgpu.SMEM(
      (NUM_CONSUMERS, terms, cfg.block_q, d),
      FP8_DTYPE,
      transforms=qk_transforms,
    ),
    plgpu.SMEM(
      (NUM_CONSUMERS, cfg.block_q, out_cols(d)),
      spec.dtype,
      transforms=smem_transforms(spec.dtype, out_cols(d)),
    ),
    plgpu.SMEM(
      (NUM_CONSUMERS, cfg.block_q, cfg.block_kv),
      FP8_DTYPE,
      transforms=seq_transforms,
    ),
    plgpu.SMEM(
      (cfg.num_stages, cfg.block_kv, d), FP8_DTYPE, transforms=qk_transforms
    ),
    plgpu.SMEM(
      (cfg.num_stages, d, cfg.block_kv), FP8_DTYPE, transforms=seq_transforms
    ),
    plgpu.SMEM((NUM_CONSUMERS, cfg.block_q), _F32),
    plgpu.Barrier(num_barriers=cfg.num_stages),  # k_full (TMA)
    plgpu.Barrier(num_barriers=cfg.num_stages),  # v_full (TMA)
    consumer_release(cfg.num_stages),  # k_empty: one arrival per consumer
    consumer_release(cfg.num_stages),  # v_empty
    # Q tile(s) per consumer
    plgpu.Barrier(num_arrivals=terms, num_barriers=NUM_CONSUMERS),
    *turn_barriers(ops.interpreted),  # pingpong (named barriers compiled)
  )
  out_type = (
    jax.ShapeDtypeStruct((spec.batch, q_rows, spec.heads_q, d), spec.dtype),
    # Padded to whole tiles, as in the bf16 kernel (a bulk copy's bound).
    jax.ShapeDtypeStruct((spec.batch, spec.heads_q, plan.seq_q_pad), _F32),
  )
  return build_kernel(
    fa3_fwd_fp8,
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

  Returns:
    (out `[b, sq, hq, d]` in `spec.dtype`, float32 lse `[b, hq, sq]`).
  """
  tile_q = config.rows_per_cta
  plan = QueryPlan(
    spec,
    config,
    seq_q_pad=-(-spec.seq_q // tile_q) * tile_q,
    seq_kv_pad=-(-spec.seq_kv // config.block_kv) * config.block_kv,
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
  )
  return out[:, : spec.seq_q], lse[:, :, : spec.seq_q]
