"""FlashAttention-3 backward kernels for Hopper (sm90) in Pallas Mosaic GPU.

Gradients by recomputation from the residuals (out, lse), after FA2/FA3:
`delta = rowsum(dO * O) - dlse`, `P = exp2(S * scale * log2(e) - lse2)`,
`dV = P^T dO`, `dP = dO V^T`, `dS = P * (dP - delta)`, `dK = scale dS^T Q`,
`dQ = scale dS K`. Two kernels, each warp specialized like the forward (one
producer warpgroup streaming tiles by TMA through a `num_stages` ring, two
consumer warpgroups computing with wgmma):

- **dK/dV kernel**, parallel over K/V tiles and kv heads: each consumer
  holds its own `block_kv` rows of K and V and float32 dK, dV accumulators;
  the producer streams Q, dO, lse and delta tiles of every query head of the
  GQA group and every query tile that sees the keys (causal: earlier query
  tiles are never loaded; only the diagonal ones are masked). dK/dV of the
  group are summed in registers: no repeated K/V, no atomics. The dP^T wgmma
  is issued before the exponentials of P^T, so they overlap.
- **dQ kernel**, parallel over query tiles: the forward's structure (its
  producer streams K and V), accumulating dQ in float32 registers.

Why a separate dQ kernel rather than FA3's float32 atomic adds of dQ from
the dK/dV kernel: it costs two more GEMMs per tile (S and dP are recomputed:
7 instead of 5), but dQ is then summed in a fixed order, so every gradient is
bitwise reproducible on every run (`deterministic=True` costs nothing
extra), it needs no dQ accumulator in HBM and no conversion pass, and it
runs in JAX 0.10.2's GPU interpreter, which has no atomics. FA3 itself
pays a similar price for its deterministic mode (ordered semaphores). To be
measured against an atomic variant when a GPU is available.

`delta` and the base-2 lse (`+inf` for rows that see no key, so their P is
exactly 0) are prepared in plain JAX (one fused elementwise pass over O and
dO, memory-bound and small next to the kernels).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa3 import masking
from pallas_fa3.config import NUM_CONSUMERS, Sm90BackwardConfig
from pallas_fa3.kernels import compat, sm90_fwd
from pallas_fa3.kernels._ops import COMPILED, INTERPRETED, KernelOps
from pallas_fa3.spec import LOG2E, AttentionSpec

_PRODUCER_REGS = sm90_fwd._PRODUCER_REGS
_CONSUMER_REGS = sm90_fwd._CONSUMER_REGS
# With one consumer warpgroup the producer gives up all it can: 232 + 24 =
# 256 registers per thread slot of 2 x 128 threads (24 is setmaxnreg's minimum).
_LONE_PRODUCER_REGS = 24


def _producer_regs(consumers: int) -> int:
  return _PRODUCER_REGS if consumers == 2 else _LONE_PRODUCER_REGS


@dataclasses.dataclass(frozen=True)
class _Plan:
  spec: AttentionSpec
  config: Sm90BackwardConfig
  seq_q_pad: int
  seq_kv_pad: int

  @property
  def num_q_blocks(self) -> int:
    return self.seq_q_pad // self.config.block_q

  @property
  def kv_rows_per_cta(self) -> int:
    return self.config.dkdv_consumers * self.config.block_kv


def _q_range(plan: _Plan, kv0):
  """(first, first unmasked) query tile for the CTA's keys [kv0, kv0 + rows).

  Query tiles before `first` see none of the keys (skipped); tiles from
  `first` to `full` see some (masked); later ones see all of them.
  """
  spec, bq, nq = plan.spec, plan.config.block_q, plan.num_q_blocks
  first = masking.first_q_block_visible(spec, kv0, bq, nq)
  if not spec.causal:
    return jnp.int32(0), jnp.int32(0)
  # Row r sees every CTA key iff r + offset >= kv0 + rows - 1.
  need = kv0 + plan.kv_rows_per_cta - 1 - spec.causal_offset
  full = jnp.clip(-(-jnp.maximum(need, 0) // bq), first, nq)
  return jnp.asarray(first, jnp.int32), jnp.asarray(full, jnp.int32)


def _dkdv_consumer(refs, plan: _Plan, ops: KernelOps):
  (k_ref, v_ref, dk_ref, dv_ref, k_smem, v_smem, q_smem, do_smem, lse_smem,
   dl_smem, full, empty, kv_bar) = refs
  spec, cfg = plan.spec, plan.config
  plgpu.set_max_registers(_CONSUMER_REGS, action="increase")
  consumers = cfg.dkdv_consumers
  wg = lax.axis_index("wg")
  batch, kv_head = lax.axis_index("batch"), lax.axis_index("heads")
  cta_kv0 = lax.axis_index("kv_tiles") * plan.kv_rows_per_cta
  kv0 = cta_kv0 + wg * cfg.block_kv
  rows = (batch, pl.ds(kv0, cfg.block_kv), kv_head)
  my_k, my_v = k_smem.at[wg], v_smem.at[wg]
  plgpu.copy_gmem_to_smem(k_ref.at[rows], my_k, kv_bar.at[wg])
  plgpu.copy_gmem_to_smem(v_ref.at[rows], my_v, kv_bar.at[consumers + wg])
  plgpu.barrier_wait(kv_bar.at[wg])
  plgpu.barrier_wait(kv_bar.at[consumers + wg])

  first, full_from = _q_range(plan, cta_kv0)
  per_head = plan.num_q_blocks - first
  scale_log2 = jnp.float32(spec.softmax_scale * LOG2E)
  shape = (cfg.block_kv, cfg.block_q)

  def step(qi, carry, *, base, masked):
    dk, dv = carry
    slot = lax.rem(base + qi - first, cfg.num_stages)
    for i in range(4):
      plgpu.barrier_wait(full[i].at[slot])
    s_t = ops.scores(my_k, q_smem.at[slot])  # S^T = K Q^T, [block_kv, block_q]
    s_t = s_t * scale_log2 - lax.broadcast_in_dim(
        ops.load_cols(lse_smem.at[slot]), shape, [1])

    p_t = jnp.exp2(s_t)
    if masked:
      mask = masking.visible_tile(spec, qi * cfg.block_q + ops.iota(shape, 1),
                                  kv0 + ops.iota(shape, 0))
      p_t = jnp.where(mask, p_t, 0.0)
    p_t = p_t.astype(spec.dtype)  # only the rounded P^T stays live
    dv = ops.accumulate_pv(dv, p_t, do_smem.at[slot])
    dp_t = ops.scores(my_v, do_smem.at[slot])  # dP^T = V dO^T
    # Loaded only now: a column vector costs 16 registers per thread in the
    # wgmma layout, and the dK, dV accumulators leave few to spare.
    delta = ops.load_cols(dl_smem.at[slot])
    ds_t = p_t.astype(jnp.float32) * (dp_t - lax.broadcast_in_dim(delta, shape, [1]))
    dk = ops.accumulate_pv(dk, ds_t.astype(spec.dtype), q_smem.at[slot])
    out = (dk, dv)
    plgpu.barrier_arrive(empty.at[slot])
    return out

  def per_group_head(h, carry):
    base = h * per_head
    if spec.causal:  # only causal needs a mask here (padded keys: see below)
      carry = lax.fori_loop(first, full_from, functools.partial(
          step, base=base, masked=True), carry)
    return lax.fori_loop(full_from, plan.num_q_blocks, functools.partial(
        step, base=base, masked=False), carry)

  zeros = ops.tile(jnp.zeros((cfg.block_kv, spec.head_dim), jnp.float32))
  dk, dv = lax.fori_loop(0, spec.group_size, per_group_head, (zeros, zeros))
  my_v[...] = dv.astype(spec.dtype)  # K and V tiles are done: reuse them
  my_k[...] = (dk * jnp.float32(spec.softmax_scale)).astype(spec.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(my_k, dk_ref.at[rows])
  plgpu.copy_smem_to_gmem(my_v, dv_ref.at[rows])
  plgpu.wait_smem_to_gmem(0)


def _dkdv_producer(refs, plan: _Plan):
  (q_ref, do_ref, lse_ref, dl_ref, q_smem, do_smem, lse_smem, dl_smem, full,
   empty) = refs
  spec, cfg = plan.spec, plan.config
  plgpu.set_max_registers(_producer_regs(cfg.dkdv_consumers), action="decrease")
  batch, kv_head = lax.axis_index("batch"), lax.axis_index("heads")
  cta_kv0 = lax.axis_index("kv_tiles") * plan.kv_rows_per_cta
  first, _ = _q_range(plan, cta_kv0)
  per_head = plan.num_q_blocks - first
  steps = spec.group_size * per_head
  stages = cfg.num_stages

  @pl.loop(0, steps)
  def _load(t):
    slot = lax.rem(t, stages)
    head = kv_head * spec.group_size + lax.div(t, per_head)
    q0 = (first + lax.rem(t, per_head)) * cfg.block_q

    @pl.when(t >= stages)
    def _():
      plgpu.barrier_wait(empty.at[slot])

    tile = (batch, pl.ds(q0, cfg.block_q), head)
    row = (batch, head, pl.ds(q0, cfg.block_q))
    plgpu.copy_gmem_to_smem(q_ref.at[tile], q_smem.at[slot], full[0].at[slot])
    plgpu.copy_gmem_to_smem(do_ref.at[tile], do_smem.at[slot], full[1].at[slot])
    plgpu.copy_gmem_to_smem(lse_ref.at[row], lse_smem.at[slot], full[2].at[slot])
    plgpu.copy_gmem_to_smem(dl_ref.at[row], dl_smem.at[slot], full[3].at[slot])

  @pl.loop(jnp.maximum(steps - stages, 0), steps)
  def _drain(t):
    plgpu.barrier_wait(empty.at[lax.rem(t, stages)])


def _dkdv_kernel(plan: _Plan, ops: KernelOps, interpret):
  spec, cfg = plan.spec, plan.config
  d, st, consumers = spec.head_dim, cfg.num_stages, cfg.dkdv_consumers
  tf = sm90_fwd._smem_transforms(spec.dtype, d)

  def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, dk_ref, dv_ref,
             k_smem, v_smem, q_smem, do_smem, lse_smem, dl_smem, q_full,
             do_full, lse_full, dl_full, empty, kv_bar):
    wg = lax.axis_index("wg")
    full = (q_full, do_full, lse_full, dl_full)

    @pl.when(wg < consumers)
    def _():
      _dkdv_consumer((k_ref, v_ref, dk_ref, dv_ref, k_smem, v_smem, q_smem,
                      do_smem, lse_smem, dl_smem, full, empty, kv_bar), plan, ops)

    @pl.when(wg == consumers)
    def _():
      _dkdv_producer((q_ref, do_ref, lse_ref, dl_ref, q_smem, do_smem,
                      lse_smem, dl_smem, full, empty), plan)

  scratch = (
      plgpu.SMEM((consumers, cfg.block_kv, d), spec.dtype, transforms=tf),
      plgpu.SMEM((consumers, cfg.block_kv, d), spec.dtype, transforms=tf),
      plgpu.SMEM((st, cfg.block_q, d), spec.dtype, transforms=tf),
      plgpu.SMEM((st, cfg.block_q, d), spec.dtype, transforms=tf),
      plgpu.SMEM((st, cfg.block_q), jnp.float32),
      plgpu.SMEM((st, cfg.block_q), jnp.float32),
      # "full" barriers per slot: Q, dO, lse, delta (one TMA each).
      plgpu.Barrier(num_barriers=st), plgpu.Barrier(num_barriers=st),
      plgpu.Barrier(num_barriers=st), plgpu.Barrier(num_barriers=st),
      plgpu.Barrier(num_arrivals=consumers, num_barriers=st),
      plgpu.Barrier(num_barriers=2 * consumers),  # K, V tile per consumer
  )
  kv_shape = (spec.batch, plan.seq_kv_pad, spec.heads_kv, d)
  return plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct(kv_shape, spec.dtype),) * 2,
      scratch_types=scratch,
      grid=(spec.heads_kv, plan.seq_kv_pad // plan.kv_rows_per_cta, spec.batch),
      grid_names=("heads", "kv_tiles", "batch"),
      num_threads=consumers + 1,
      thread_name="wg",
      compiler_params=compat.compiler_params(approx_math=True),
      interpret=interpret,
  )


def _dq_consumer(refs, plan: sm90_fwd._Plan, ops: KernelOps):
  (q_ref, do_ref, lse_ref, dl_ref, dq_ref, q_smem, do_smem, lse_smem, dl_smem,
   k_smem, v_smem, k_full, v_full, k_empty, v_empty, tile_bar) = refs
  spec, cfg = plan.spec, plan.config
  plgpu.set_max_registers(_CONSUMER_REGS, action="increase")
  wg = lax.axis_index("wg")
  batch, head = lax.axis_index("batch"), lax.axis_index("heads")
  cta_row0 = lax.axis_index("q_tiles") * cfg.rows_per_cta
  row0 = cta_row0 + wg * cfg.block_q
  my_q, my_do = q_smem.at[wg], do_smem.at[wg]
  tile = (batch, pl.ds(row0, cfg.block_q), head)
  row = (batch, head, pl.ds(row0, cfg.block_q))
  bars = [tile_bar.at[4 * wg + i] for i in range(4)]
  plgpu.copy_gmem_to_smem(q_ref.at[tile], my_q, bars[0])
  plgpu.copy_gmem_to_smem(do_ref.at[tile], my_do, bars[1])
  plgpu.copy_gmem_to_smem(lse_ref.at[row], lse_smem.at[wg], bars[2])
  plgpu.copy_gmem_to_smem(dl_ref.at[row], dl_smem.at[wg], bars[3])
  for bar in bars:
    plgpu.barrier_wait(bar)
  lse2 = ops.load_rows(lse_smem.at[wg])
  delta = ops.load_rows(dl_smem.at[wg])

  steps, unmasked = sm90_fwd._kv_steps(plan, row0, cfg.block_q)
  cta_steps, _ = sm90_fwd._kv_steps(plan, cta_row0, cfg.rows_per_cta)
  scale_log2 = jnp.float32(spec.softmax_scale * LOG2E)
  shape = (cfg.block_q, cfg.block_kv)

  def step(j, dq, *, masked):
    slot = lax.rem(j, cfg.num_stages)
    plgpu.barrier_wait(k_full.at[slot])
    s = ops.scores(my_q, k_smem.at[slot])
    plgpu.barrier_wait(v_full.at[slot])

    def body(read_dp):  # dP = dO V^T is in flight meanwhile
      p = jnp.exp2(s * scale_log2 - lax.broadcast_in_dim(lse2, shape, [0]))
      if masked:
        mask = masking.visible_tile(spec, row0 + ops.iota(shape, 0),
                                    j * cfg.block_kv + ops.iota(shape, 1))
        p = jnp.where(mask, p, 0.0)
      ds = p * (read_dp() - lax.broadcast_in_dim(delta, shape, [0]))
      return ops.accumulate_pv(dq, ds.astype(spec.dtype), k_smem.at[slot])

    dq = ops.with_scores(my_do, v_smem.at[slot], body)
    plgpu.barrier_arrive(k_empty.at[slot])
    plgpu.barrier_arrive(v_empty.at[slot])
    return dq

  dq = ops.tile(jnp.zeros((cfg.block_q, spec.head_dim), jnp.float32))
  dq = lax.fori_loop(0, unmasked, functools.partial(step, masked=False), dq)
  dq = lax.fori_loop(unmasked, steps, functools.partial(
      step, masked=plan.needs_mask), dq)

  @pl.loop(steps, cta_steps)
  def _drain(j):  # tiles loaded for the other consumer's rows (causal)
    slot = lax.rem(j, cfg.num_stages)
    plgpu.barrier_wait(k_full.at[slot])
    plgpu.barrier_wait(v_full.at[slot])
    plgpu.barrier_arrive(k_empty.at[slot])
    plgpu.barrier_arrive(v_empty.at[slot])

  my_q[...] = (dq * jnp.float32(spec.softmax_scale)).astype(spec.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(my_q, dq_ref.at[tile])
  plgpu.wait_smem_to_gmem(0)


def _dq_kernel(plan: sm90_fwd._Plan, ops: KernelOps, interpret):
  spec, cfg = plan.spec, plan.config
  d, st = spec.head_dim, cfg.num_stages
  tf = sm90_fwd._smem_transforms(spec.dtype, d)

  def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, dq_ref, q_smem,
             do_smem, lse_smem, dl_smem, k_smem, v_smem, k_full, v_full,
             k_empty, v_empty, tile_bar):
    wg = lax.axis_index("wg")

    @pl.when(wg < NUM_CONSUMERS)
    def _():
      _dq_consumer((q_ref, do_ref, lse_ref, dl_ref, dq_ref, q_smem, do_smem,
                    lse_smem, dl_smem, k_smem, v_smem, k_full, v_full, k_empty,
                    v_empty, tile_bar), plan, ops)

    @pl.when(wg == NUM_CONSUMERS)
    def _():
      sm90_fwd._producer((k_ref, v_ref, k_smem, v_smem, k_full, v_full,
                          k_empty, v_empty), plan)

  per_consumer = lambda: plgpu.SMEM((NUM_CONSUMERS, cfg.block_q, d), spec.dtype,
                                    transforms=tf)
  ring = lambda: plgpu.SMEM((st, cfg.block_kv, d), spec.dtype, transforms=tf)
  scratch = (
      per_consumer(), per_consumer(),
      plgpu.SMEM((NUM_CONSUMERS, cfg.block_q), jnp.float32),
      plgpu.SMEM((NUM_CONSUMERS, cfg.block_q), jnp.float32),
      ring(), ring(),
      plgpu.Barrier(num_barriers=st), plgpu.Barrier(num_barriers=st),
      plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=st),
      plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=st),
      plgpu.Barrier(num_barriers=4 * NUM_CONSUMERS),  # Q, dO, lse, delta
  )
  return plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct(
          (spec.batch, plan.seq_q_pad, spec.heads_q, d), spec.dtype),
      scratch_types=scratch,
      grid=(spec.heads_q, plan.num_q_tiles, spec.batch),
      grid_names=("heads", "q_tiles", "batch"),
      num_threads=NUM_CONSUMERS + 1,
      thread_name="wg",
      compiler_params=compat.compiler_params(approx_math=True),
      interpret=interpret,
  )


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _pad_axis(x, axis: int, length: int, value=0.0):
  pad = length - x.shape[axis]
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def sm90_backward(spec: AttentionSpec, config: Sm90BackwardConfig,
                  q, k, v, out, lse, dout, dlse, *, interpret=None):
  """(dq, dk, dv) by the two backward kernels; `dlse` is the lse cotangent.

  `interpret`: None compiles for sm90; interpret-mode parameters run the
  same kernels on a CPU.
  """
  ops = COMPILED if interpret is None else INTERPRETED
  sq_pad = _round_up(spec.seq_q, 2 * config.block_q)
  skv_pad = _round_up(spec.seq_kv, config.dkdv_consumers * config.block_kv)
  delta = jnp.einsum("bqhd,bqhd->bhq", dout.astype(jnp.float32),
                     out.astype(jnp.float32)) - dlse.astype(jnp.float32)
  # Rows that see no key (lse = -inf) and padded rows: lse2 = +inf, P = 0.
  lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * jnp.float32(LOG2E))
  lse2 = _pad_axis(lse2, 2, sq_pad, jnp.inf)
  delta = _pad_axis(delta, 2, sq_pad)
  qp, dop = _pad_axis(q, 1, sq_pad), _pad_axis(dout, 1, sq_pad)
  kp, vp = _pad_axis(k, 1, skv_pad), _pad_axis(v, 1, skv_pad)
  dkdv_plan = _Plan(spec, config, sq_pad, skv_pad)
  dk, dv = _dkdv_kernel(dkdv_plan, ops, interpret)(qp, kp, vp, dop, lse2, delta)
  dq_plan = sm90_fwd._Plan(spec, config.dq_config, sq_pad, skv_pad)
  dq = _dq_kernel(dq_plan, ops, interpret)(qp, kp, vp, dop, lse2, delta)
  return (dq[:, :spec.seq_q], dk[:, :spec.seq_kv], dv[:, :spec.seq_kv])
