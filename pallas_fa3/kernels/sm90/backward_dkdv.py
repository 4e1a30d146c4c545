"""The sm90 dK/dV kernel and its consumers (the backward's design:
`backward`; the plan and the producer: `backward_dkdv_plan`).

Parallel over (kv head, K/V tile, batch, head-dim chunk): consumer
warpgroups hold K/V tiles and float32 dK, dV; the producer streams Q, dO,
lse and delta tiles of every query head of the GQA group.
"""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa3 import masking
from pallas_fa3.kernels.sm90 import compat
from pallas_fa3.kernels.sm90.backward_dkdv_plan import (
  DkdvPlan,
  cta_position,
  own_kv_tile,
  q_tile_range,
  store_dkdv,
)
from pallas_fa3.kernels.sm90.common import (
  consumer_regs,
  row_probabilities,
  scaled_once,
  softcap_grad,
  softcapped,
)
from pallas_fa3.kernels.sm90.ops import KernelOps, SmemA
from pallas_fa3.kernels.sm90.segment_operands import load_bounds


def dkdv_consumer(
  refs: tuple, plan: DkdvPlan, ops: KernelOps, seg: Any = None
) -> None:
  """A consumer owning its K/V tile: dK, dV (chunk `chunk`) over its steps
  (`seg`: segment ids' `SegmentRefs`, per-key query bounds)."""
  (
    k_ref,
    v_ref,
    dk_ref,
    dv_ref,
    k_smem,
    v_smem,
    q_smem,
    do_smem,
    lse_smem,
    dl_smem,
    full,
    empty,
    kv_bar,
  ) = refs
  spec, cfg = plan.spec, plan.config
  consumers = cfg.dkdv_consumers
  plgpu.set_max_registers(consumer_regs(consumers), action="increase")
  cta_kv0, chunk = cta_position(plan)
  # K, V tiles as head-dim chunks [splits, block_kv, chunk]: S^T and dP^T
  # contract over all of them, dK and dV are accumulated for chunk `chunk`.
  wg = lax.axis_index("wg")
  kv0, rows, my_k, my_v = own_kv_tile(
    (k_ref, v_ref, k_smem, v_smem, kv_bar), plan, wg
  )
  k_chunks = [my_k.at[c] for c in range(plan.splits)]
  v_chunks = [my_v.at[c] for c in range(plan.splits)]
  bounds = None
  if seg is not None:  # my keys' query bounds, as per-row vectors
    bounds = load_bounds(
      seg, ops, lax.axis_index("batch"), kv0, cfg.block_kv, as_rows=True
    )

  first, per_head = q_tile_range(plan, cta_kv0, seg)
  # CTA-split head dims take each query tile in halves of `block_q / 2`
  # rows (64-byte swizzle: a half is a whole wgmma K step).
  halves = plan.q_halves
  sub = cfg.block_q // halves
  shape = (cfg.block_kv, sub)

  def part(qi, h, slot, carry, masked):
    dk, dv = carry
    rows_h = pl.ds(h * sub, sub)
    q_parts = [q_smem.at[slot, c].at[rows_h] for c in range(plan.splits)]
    do_parts = [do_smem.at[slot, c].at[rows_h] for c in range(plan.splits)]
    # S^T = K Q^T, [block_kv, sub]
    t_t, scale_log2 = softcapped(spec, ops.scores(k_chunks, q_parts))
    s_t = scaled_once(t_t, scale_log2) - lax.broadcast_in_dim(
      ops.load_cols(lse_smem.at[slot].at[rows_h]), shape, [1]
    )
    p_t = jnp.exp2(jnp.minimum(s_t, 0.0))  # as `row_probabilities`
    if masked:
      # Causal/window only: padded keys' rows of dK, dV are sliced off.
      q0 = qi * cfg.block_q + h * sub
      if bounds is not None:  # lo <= query < hi, positions folded in
        mask = masking.within_bounds(ops.col_index(sub), *bounds, q0, shape)
      else:
        mask = masking.visible_tile_at(
          spec,
          q0,
          kv0,
          ops.col_index(sub),
          ops.row_index(cfg.block_kv),
          shape,
          1,
          check_seq_kv=False,
        )
      p_t = jnp.where(mask, p_t, 0.0)
    # Softcap: dS^T takes P^T (1 - t^2), rounded like P^T.
    pg_t = None
    if spec.softcap is not None:
      pg_t = softcap_grad(p_t, t_t).astype(spec.dtype)
    p_t = p_t.astype(spec.dtype)  # only the rounded P^T stays live
    pg_t = p_t if pg_t is None else pg_t
    dv = ops.accumulate_pv(dv, p_t, do_smem.at[slot, chunk].at[rows_h])
    # dP^T = V dO^T
    dp_t = ops.scores(v_chunks, do_parts)
    # Loaded only now: the dK, dV accumulators leave few registers.
    delta = ops.load_cols(dl_smem.at[slot].at[rows_h])
    ds_t = pg_t.astype(jnp.float32) * (
      dp_t - lax.broadcast_in_dim(delta, shape, [1])
    )
    dk = ops.accumulate_pv(
      dk, ds_t.astype(spec.dtype), q_smem.at[slot, chunk].at[rows_h]
    )
    return dk, dv

  def step(qi, carry, *, base, masked):
    slot = lax.rem(base + qi - first, cfg.num_stages)
    for bar in full:
      plgpu.barrier_wait(bar.at[slot])
    for h in range(halves):
      carry = part(qi, h, slot, carry, masked)
    # lse and delta were read by ordinary loads (generic proxy) and TMA
    # refills the slot: a proxy fence orders the two before the release.
    plgpu.commit_smem()
    plgpu.barrier_arrive(empty.at[slot])
    return carry

  def per_group_head(h, carry):
    # Causal/window: every step masks (exact on visible tiles too); a
    # separate masked loop spilled (docs/design_notes.md#backward-kernels).
    base = h * per_head
    return lax.fori_loop(
      first,
      first + per_head,
      functools.partial(step, base=base, masked=spec.masked),
      carry,
    )

  zeros = lambda w: ops.tile(jnp.zeros((cfg.block_kv, w), jnp.float32))
  dk, dv = lax.fori_loop(
    0, spec.group_size, per_group_head, (zeros(plan.chunk), zeros(plan.chunk_v))
  )
  cols = pl.ds(chunk * plan.chunk, plan.chunk)
  cols_v = pl.ds(chunk * plan.chunk_v, plan.chunk_v)
  store_dkdv(  # K, V are done: stage dK, dV in them
    plan,
    dk,
    dv,
    (my_k.at[chunk], my_v.at[chunk]),
    (dk_ref.at[rows + (cols,)], dv_ref.at[rows + (cols_v,)]),
  )


def dkdv_shared_consumer(
  refs: tuple,
  plan: DkdvPlan,
  ops: KernelOps,
  w: int,
  sink: Any = None,
  seg: Any = None,
) -> None:
  """Consumer `w` of a CTA whose two consumers share one K/V tile: it
  accumulates dK, dV for head-dim chunk `w` (FA3's large-head-dim layout).

  Per step it computes its half of the key columns of S = Q K^T and
  dP = dO V^T (`[block_q, block_kv / 2]`, query rows as wgmma rows, so lse
  and delta are per-row vectors), writes that half of P and dS to shared
  memory, meets the other consumer, and then both read all of P and dS
  (transposed by the wgmma) for dV_w += P^T dO_w and dK_w += dS^T Q_w. No
  GEMM is repeated. P/dS buffers alternate by step parity: a consumer
  rewrites one only after the other has passed the next rendezvous, hence
  finished the wgmmas that read it. With a `sink` (the fused kernel) it
  also issues dQ_w = dS K_w under the same wait and hands it to the sink.
  """
  (
    k_ref,
    v_ref,
    dk_ref,
    dv_ref,
    k_smem,
    v_smem,
    q_smem,
    do_smem,
    lse_smem,
    dl_smem,
    p_smem,
    ds_smem,
    full,
    empty,
    kv_bar,
    xchg,
  ) = refs
  spec, cfg = plan.spec, plan.config
  plgpu.set_max_registers(consumer_regs(2), action="increase")
  batch, kv_head = lax.axis_index("batch"), lax.axis_index("heads")
  kv0, _ = cta_position(plan)
  rows = (batch, pl.ds(kv0, cfg.block_kv), kv_head)
  cols = pl.ds(w * plan.chunk, plan.chunk)
  cols_v = pl.ds(w * plan.chunk_v, plan.chunk_v)
  k_tile, v_tile = k_smem.at[0], v_smem.at[0]  # [splits, block_kv, chunk]
  plgpu.copy_gmem_to_smem(
    k_ref.at[rows + (cols,)],
    k_tile.at[w],
    kv_bar.at[0],
    oob_mode=compat.ZERO_FILL,
  )
  plgpu.copy_gmem_to_smem(
    v_ref.at[rows + (cols_v,)],
    v_tile.at[w],
    kv_bar.at[1],
    oob_mode=compat.ZERO_FILL,
  )
  plgpu.barrier_wait(kv_bar.at[0])
  plgpu.barrier_wait(kv_bar.at[1])
  half = cfg.block_kv // 2
  mine = pl.ds(w * half, half)  # my key columns of S, dP
  k_mine = [k_tile.at[c].at[mine] for c in range(plan.splits)]
  v_mine = [v_tile.at[c].at[mine] for c in range(plan.splits)]

  def key_bounds(q0):  # the query rows' key bounds, per-row vectors
    if seg is None:
      return None
    return (*load_bounds(seg, ops, batch, q0, cfg.block_q, as_rows=True), 0)

  first, per_head = q_tile_range(plan, kv0, seg)
  shape = (cfg.block_q, half)

  def step(qi, carry, *, h):
    dk, dv = carry
    t = h * per_head + qi - first
    slot, buf = lax.rem(t, cfg.num_stages), lax.rem(t, 2)
    for bar in full:
      plgpu.barrier_wait(bar.at[slot])
    q_tile, do_tile = q_smem.at[slot], do_smem.at[slot]
    q_chunks = [q_tile.at[c] for c in range(plan.splits)]
    do_chunks = [do_tile.at[c] for c in range(plan.splits)]

    bounds = key_bounds(qi * cfg.block_q)

    def grads(read_s, read_dp):  # dP is in flight while P is computed
      # Causal/window: masked on every tile (exact there too); padded
      # keys' rows of dK, dV are sliced off.
      p, t = row_probabilities(
        ops,
        spec,
        read_s(),
        ops.load_rows(lse_smem.at[slot]),
        qi * cfg.block_q,
        kv0 + w * half,
        masked=spec.masked,
        check_seq_kv=False,
        bounds=bounds,
      )
      pg = None if t is None else softcap_grad(p, t).astype(spec.dtype)
      p = p.astype(spec.dtype)
      pg = p if pg is None else pg
      delta = ops.load_rows(dl_smem.at[slot])
      ds = pg.astype(jnp.float32) * (
        read_dp() - lax.broadcast_in_dim(delta, shape, [0])
      )
      return p, ds.astype(spec.dtype)

    p, ds = ops.score_pair((q_chunks, k_mine), (do_chunks, v_mine), grads)
    p_smem.at[buf].at[:, mine][...] = p
    ds_smem.at[buf].at[:, mine][...] = ds
    plgpu.commit_smem()  # my halves visible to both consumers' wgmmas
    plgpu.barrier_arrive(xchg)
    plgpu.barrier_wait(xchg)
    if sink is None:
      dv = ops.accumulate_tn(dv, p_smem.at[buf], do_tile.at[w])  # P^T dO_w
      dk = ops.accumulate_tn(dk, ds_smem.at[buf], q_tile.at[w])  # dS^T Q_w
      plgpu.barrier_arrive(empty.at[slot])
      return dk, dv
    dq = ops.tile(jnp.zeros((cfg.block_q, plan.dq_cols), jnp.float32))
    dv, dk, dq = ops.accumulate(
      (dv, dk, dq),
      [
        (0, SmemA(p_smem.at[buf], transposed=True), do_tile.at[w]),
        (1, SmemA(ds_smem.at[buf], transposed=True), q_tile.at[w]),
        (2, SmemA(ds_smem.at[buf]), k_tile.at[w]),  # dS K_w
      ],
    )
    plgpu.barrier_arrive(empty.at[slot])
    head = kv_head * spec.group_size + h
    sink.flush(dq, batch, qi * cfg.block_q, head, w)
    return dk, dv

  def per_group_head(h, carry):
    return lax.fori_loop(
      first,
      first + per_head,
      functools.partial(step, h=h),
      carry,
    )

  zeros = lambda c: ops.tile(jnp.zeros((cfg.block_kv, c), jnp.float32))
  dk, dv = lax.fori_loop(
    0, spec.group_size, per_group_head, (zeros(plan.chunk), zeros(plan.chunk_v))
  )
  # My K, V chunks were last read by the other consumer before our last
  # rendezvous: reuse them for dK, dV.
  store_dkdv(
    plan,
    dk,
    dv,
    (k_tile.at[w], v_tile.at[w]),
    (dk_ref.at[rows + (cols,)], dv_ref.at[rows + (cols_v,)]),
  )
