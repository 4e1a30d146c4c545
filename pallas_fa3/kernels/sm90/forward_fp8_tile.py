"""One query tile of the FP8 forward kernel's consumers (`forward_fp8`):
the K/V walk with the scores' descale, masks, softcap and sinks, the online
softmax with P offset into e4m3 and staged through shared memory, and the
epilogue.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa3 import masking
from pallas_fa3.kernels.sm90 import compat
from pallas_fa3.kernels.sm90.common import (
  MASK_EVERY_STEP_HEAD_DIM,
  QueryPlan,
  kv_walk,
  tile_span,
  walk_steps,
)
from pallas_fa3.kernels.sm90.ops_fp8 import (
  Fp8Ops,
  sink_seed,
)
from pallas_fa3.kernels.sm90.persistent import (
  Tile,
)
from pallas_fa3.kernels.sm90.pingpong import Turns, release_rest
from pallas_fa3.quant.e4m3 import (
  FP8_DTYPE,
  finalize_fp8,
  online_softmax_fp8,
)
from pallas_fa3.spec import LOG2E


def query_tile(
  refs: tuple,
  plan: QueryPlan,
  ops: Fp8Ops,
  turns: Turns,
  tile: Tile,
  base: jax.Array,
) -> None:
  """One query tile: S = Q K^T, softmax, O += P V over its K/V steps, K/V
  step j in ring slot `(base + j) % num_stages`. `q_refs`: Q, or Q and its
  rounding residual (S = Q K^T + Q_res K^T, two chained wgmma). As the
  bf16 kernel: the walk starts at a window's first tile, masks come from
  the positions or (segment ids, `seg`) the rows' key bounds, softcap is
  fused into the scores, sinks (`sinks_ref`) seed the running max."""
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
    sinks_ref,
    seg,
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
  span = bounds = None
  if seg is not None:  # the rows' key bounds arrive on the Q barrier too
    for i, ref in enumerate((seg.lo, seg.hi)):
      plgpu.copy_gmem_to_smem(
        ref.at[batch, pl.ds(row0, cfg.block_q)],
        seg.bounds_smem.at[i, wg],
        q_bar.at[wg],
      )
  q_terms = tuple(q_smem.at[t] for t in range(len(q_refs)))
  # The Q tile's descale, folded into the softmax scale.
  q_scale = qs_ref[batch, head, lax.div(row0, jnp.int32(cfg.block_q))]
  scale_log2 = jnp.float32(spec.softmax_scale * LOG2E) * q_scale
  plgpu.barrier_wait(q_bar.at[wg])
  if seg is not None:
    bounds = tuple(ops.load_rows(seg.bounds_smem.at[i, wg]) for i in (0, 1))
    span = tile_span(seg.spans, batch, lax.div(tile.row0, plan.rows_per_cta))

  walk = kv_walk(plan, tile.row0, row0, cfg.block_q, span)
  shape = (cfg.block_q, cfg.block_kv)
  check_seq_kv = spec.window_right != 0  # as the bf16 kernel

  def mask_for(j):
    """Step j's mask from 1-D index vectors (no index tile in registers)."""
    kv0 = (walk.first + j) * cfg.block_kv
    cols = ops.col_index(cfg.block_kv)
    if bounds is not None:  # positions folded into the bounds
      return masking.within_bounds(cols, *bounds, kv0, shape)
    return masking.visible_tile_at(
      spec, row0, kv0, ops.row_index(cfg.block_q), cols, shape, 0,
      check_seq_kv=check_seq_kv,
    )  # fmt: skip

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
    step = scale_log2 * k_scale
    if spec.softcap is not None:  # cap * tanh(scaled / cap), in base 2
      s = jnp.tanh(s * (step / jnp.float32(LOG2E * spec.softcap)))
      step = jnp.float32(spec.softcap * LOG2E)
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
