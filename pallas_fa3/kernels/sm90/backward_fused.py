"""The fused sm90 backward (`deterministic=False`): the dK/dV kernel that
also computes dQ, FA3's five GEMMs per (query tile, key tile) pair.

Per query tile a consumer computes S^T = K Q^T and dP^T = V dO^T (issued
together, waited apart), P^T and dS^T, then issues dV += P^T dO and
dK += dS^T Q from registers, writes dS^T to shared memory and issues
dQ = dS K, all under one wait. The float32 dQ tile goes through shared
memory to a TMA reduce-add into a float32 `[b, sq, hq, d]` accumulator,
converted afterwards. Two consumers owning keys at d = 128 (FA3's layout,
outside the config space: it spills with GQA) share dS through shared
memory and each adds half of dQ's head dim over all of the CTA's keys;
otherwise each adds its own keys' dQ over the whole head dim. The
shared-tile layout (d = 128, 192) is `backward_dkdv`'s with a sink. The
interpreter has no reduce-add: there each dQ tile is stored to its own
slot of a slab that XLA sums (`DqSink`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
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
  smem_transforms,
  softcap_grad,
)
from pallas_fa3.kernels.sm90.ops import KernelOps, SmemA
from pallas_fa3.kernels.sm90.segment_operands import load_bounds

# Hardware barrier of the consumers' dS exchange (the forward's turns use 8
# and 9; Mosaic 0-4).
_EXCHANGE_BARRIER = 10


@dataclasses.dataclass(frozen=True)
class DqSink:
  """Where a fused consumer's dQ tiles go.

  Compiled, `dq_ref` is the float32 accumulator `[b, q_rows, hq, d]` and
  each tile is TMA reduce-added into it. Interpreted, `dq_ref` is a slab
  `[kv_ctas * dq_parts, b, sq_pad, hq, d]`: each tile is stored to its own
  slot and `sum_slab` adds them. `xchg` is the interpreter's stand-in for
  the exchange's named barrier (None compiled).
  """

  plan: DkdvPlan
  ops: KernelOps
  dq_ref: Any
  dq_smem: Any  # [consumers, block_q, dq_cols] float32
  xchg: Any = None

  def rendezvous(self) -> None:
    """Both consumers of the CTA meet (the dS exchange)."""
    if self.xchg is not None:
      plgpu.barrier_arrive(self.xchg)
      plgpu.barrier_wait(self.xchg)
    else:
      compat.named_barrier(_EXCHANGE_BARRIER, 2 * 128, sync=True)

  def flush(self, dq: jax.Array, batch: Any, q0: Any, head: Any, w: int):
    """Adds consumer `w`'s float32 dQ tile for query rows `q0 +
    [0, block_q)` of `head`. Its staging buffer is rewritten only after the
    previous reduce has read it."""
    plan, cfg = self.plan, self.plan.config
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    staged = self.dq_smem.at[w]
    staged[...] = dq
    plgpu.commit_smem()
    cols = pl.ds(w * plan.dq_cols if plan.dq_by_cols else 0, plan.dq_cols)
    tile = (batch, pl.ds(q0, cfg.block_q), head, cols)
    if self.ops.interpreted:
      part = lax.axis_index("kv_tiles") * plan.dq_parts
      if not plan.dq_by_cols:
        part = part + w
      plgpu.copy_smem_to_gmem(staged, self.dq_ref.at[(part,) + tile])
    else:
      plgpu.copy_smem_to_gmem(staged, self.dq_ref.at[tile], reduction_op="add")


def sink_scratch(plan: DkdvPlan, interpreted: bool, transforms: tuple) -> tuple:
  """Shared memory of the fused kernel's dQ: staging tiles per consumer;
  own layout: dS^T tiles by step parity (in K's `transforms`: one wgmma
  reads both); the interpreter's exchange barrier."""
  cfg, consumers = plan.config, plan.config.dkdv_consumers
  scratch = (
    plgpu.SMEM(
      (consumers, cfg.block_q, plan.dq_cols),
      jnp.float32,
      transforms=smem_transforms(jnp.float32, plan.dq_cols),
    ),
  )
  if not plan.shared:
    scratch += (
      plgpu.SMEM(
        (2, consumers, cfg.block_kv, cfg.block_q),
        plan.spec.dtype,
        transforms=transforms,
      ),
    )
    if interpreted and plan.dq_by_cols:
      scratch += (plgpu.Barrier(num_arrivals=consumers),)
  return scratch


def fused_consumer(
  refs: tuple,
  sink: DqSink,
  ds_smem: Any,
  plan: DkdvPlan,
  w: int,
  seg: Any = None,
) -> None:
  """Consumer `w` owning its K/V tile (`block_kv` keys): dK, dV over the
  whole head dim and its dQ tiles, for every query tile of every query
  head of the group (`seg`: segment ids' refs, per-key query bounds)."""
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
  spec, cfg, ops = plan.spec, plan.config, sink.ops
  consumers = cfg.dkdv_consumers
  plgpu.set_max_registers(consumer_regs(consumers), action="increase")
  batch, kv_head = lax.axis_index("batch"), lax.axis_index("heads")
  cta_kv0, _ = cta_position(plan)
  kv0, rows, k_chunks, v_chunks = own_kv_tile(
    (k_ref, v_ref, k_smem, v_smem, kv_bar), plan, w
  )
  if plan.dq_by_cols:
    # My dQ wgmma reads the other consumers' K tiles too: wait for their
    # TMA myself rather than rely on ordering through their waits and the
    # exchange barrier (an mbarrier phase may be waited by any thread).
    for c in range(consumers):
      if c != w:
        plgpu.barrier_wait(kv_bar.at[c])
  my_k, my_v = k_chunks.at[0], v_chunks.at[0]  # fused: no head-dim split
  bounds = None
  if seg is not None:  # my keys' query bounds, as per-row vectors
    bounds = load_bounds(seg, ops, batch, kv0, cfg.block_kv, as_rows=True)
    bounds = (*bounds, 0)

  first, per_head = q_tile_range(plan, cta_kv0, seg)
  shape = (cfg.block_kv, cfg.block_q)
  cols = pl.ds(w * plan.dq_cols, plan.dq_cols)
  # dQ = dS K: over both consumers' keys for my columns, or over mine.
  sources = range(consumers) if plan.dq_by_cols else (w,)

  def step(qi, carry, *, h):
    dk, dv = carry
    t = h * per_head + qi - first
    slot, buf = lax.rem(t, cfg.num_stages), lax.rem(t, 2)
    for bar in full:
      plgpu.barrier_wait(bar.at[slot])
    q_tile, do_tile = q_smem.at[slot, 0], do_smem.at[slot, 0]

    def grads(read_s, read_dp):
      p_t, t_t = row_probabilities(
        ops,
        spec,
        read_s(),
        ops.load_cols(lse_smem.at[slot]),
        qi * cfg.block_q,
        kv0,
        masked=spec.masked,
        check_seq_kv=False,
        q_axis=1,
        bounds=bounds,
      )
      delta = ops.load_cols(dl_smem.at[slot])
      pg_t = softcap_grad(p_t, t_t)  # P^T (1 - t^2) with softcap
      ds_t = pg_t * (read_dp() - lax.broadcast_in_dim(delta, shape, [1]))
      return p_t.astype(spec.dtype), ds_t.astype(spec.dtype)

    p_t, ds_t = ops.score_pair((my_k, q_tile), (my_v, do_tile), grads)

    def exchange():  # my dS^T for the dQ wgmma (mine and the other's)
      ds_smem.at[buf, w][...] = ds_t
      plgpu.commit_smem()  # also fences the lse, delta reads of the slot
      if plan.dq_by_cols:
        sink.rendezvous()

    dq_terms = [
      (2, SmemA(ds_smem.at[buf, c], transposed=True), k_smem.at[c, 0])
      for c in sources
    ]
    if plan.dq_by_cols:
      dq_terms = [(i, a, b.at[:, cols]) for i, a, b in dq_terms]
    dv, dk, dq = ops.accumulate(
      (dv, dk, (cfg.block_q, plan.dq_cols)),
      [(0, p_t, do_tile), (1, ds_t, q_tile)] + dq_terms,
      first=2,
      between=exchange,
    )
    plgpu.barrier_arrive(empty.at[slot])
    head = kv_head * spec.group_size + h
    sink.flush(dq, batch, qi * cfg.block_q, head, w)
    return dk, dv

  def per_group_head(h, carry):
    return lax.fori_loop(
      first, first + per_head, functools.partial(step, h=h), carry
    )

  zeros = lambda c: ops.tile(jnp.zeros((cfg.block_kv, c), jnp.float32))
  dk, dv = lax.fori_loop(
    0,
    spec.group_size,
    per_group_head,
    (zeros(spec.head_dim), zeros(spec.head_dim_v)),
  )
  if plan.dq_by_cols:
    sink.rendezvous()  # the other consumer's last dQ wgmma has read my K
  # K, V are done: stage dK, dV in them.
  store_dkdv(plan, dk, dv, (my_k, my_v), (dk_ref.at[rows], dv_ref.at[rows]))


def sum_slab(
  plan: DkdvPlan, slab: jax.Array, spans: jax.Array | None = None
) -> jax.Array:
  """The interpreter's dQ slab summed over its slots (slots a CTA never
  wrote, query tiles that see none of its keys, are left out; `spans`:
  with segment ids, the `[2, b, kv_ctas]` query tile spans the CTAs
  walked)."""
  spec, bq = plan.spec, plan.config.block_q
  with jax.ensure_compile_time_eval():  # static: Python ints under jit
    ranges = [
      tuple(
        int(x)
        for x in masking.q_block_range(
          spec,
          c * plan.kv_rows_per_cta,
          (c + 1) * plan.kv_rows_per_cta,
          bq,
          plan.num_q_blocks,
        )
      )
      for c in range(plan.kv_ctas)
    ]
  starts = jnp.asarray([r[0] for r in ranges], jnp.int32)[:, None]  # [c, 1]
  ends = jnp.asarray([r[1] for r in ranges], jnp.int32)[:, None]
  if spans is not None:  # [c, b]
    starts = jnp.maximum(starts, spans[0].T)
    ends = jnp.minimum(ends, spans[1].T)
  starts = jnp.repeat(starts * bq, plan.dq_parts, axis=0)
  ends = jnp.repeat(ends * bq, plan.dq_parts, axis=0)
  rows = jnp.arange(slab.shape[2], dtype=jnp.int32)[None, None, :]
  written = (rows >= starts[..., None]) & (rows < ends[..., None])
  return jnp.where(written[..., None, None], slab, 0.0).sum(0)
