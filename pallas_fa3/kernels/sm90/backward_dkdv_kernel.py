"""Builds the sm90 dK/dV kernel (`backward_dkdv`) and its fused form
(`backward_fused`: dQ by reduce-add as well): scratch, warpgroup roles and
grid.
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

from pallas_fa3.kernels.sm90.backward_dkdv import (
  dkdv_consumer,
  dkdv_shared_consumer,
)
from pallas_fa3.kernels.sm90.backward_dkdv_plan import DkdvPlan, dkdv_producer
from pallas_fa3.kernels.sm90.backward_fused import (
  DqSink,
  fused_consumer,
  sink_scratch,
)
from pallas_fa3.kernels.sm90.common import (
  build_kernel,
  consumer_release,
  smem_transforms,
  swizzle64,
)
from pallas_fa3.kernels.sm90.ops import KernelOps
from pallas_fa3.kernels.sm90.segment_operands import (
  SegmentRefs,
  dkdv_operands,
)


def _consumers(
  plan: DkdvPlan,
  ops: KernelOps,
  refs: tuple,
  extra: tuple,
  dq_ref: Any,
  seg: SegmentRefs | None,
) -> None:
  """Runs this warpgroup's consumer. `extra` are the scratch refs past the
  common ones: shared, P, dS and their rendezvous, then fused the dQ
  staging; own tiles fused, the dQ staging, the dS^T tiles and the
  interpreter's exchange barrier. `seg`: segment ids' refs (or None)."""
  consumers, wg = plan.config.dkdv_consumers, lax.axis_index("wg")
  if plan.shared:
    p_smem, ds_smem, xchg, *staging = extra
    sink = DqSink(plan, ops, dq_ref, staging[0]) if plan.fused else None
    full, empty, kv_bar = refs[-3:]
    for w in range(consumers):
      pl.when(wg == w)(
        functools.partial(
          dkdv_shared_consumer,
          refs[:-3] + (p_smem, ds_smem, full, empty, kv_bar, xchg),
          plan,
          ops,
          w,
          sink,
          seg,
        )
      )
  elif plan.fused:
    dq_smem, ds_smem, *xchg = extra
    sink = DqSink(plan, ops, dq_ref, dq_smem, xchg[0] if xchg else None)
    for w in range(consumers):
      pl.when(wg == w)(
        functools.partial(fused_consumer, refs, sink, ds_smem, plan, w, seg)
      )
  else:
    pl.when(wg < consumers)(
      functools.partial(dkdv_consumer, refs, plan, ops, seg)
    )


def dkdv_kernel(
  plan: DkdvPlan, ops: KernelOps, interpret: Any, kv_rows: int
) -> Callable[..., Any]:
  """The dK/dV kernel, `(q, k, v, dout, lse2, delta) -> (dk, dv)`, or with
  `plan.fused` `(q, k, v, dout, lse2, delta, dq) -> (dk, dv)` (`dq` a
  float32 `jax.new_ref` accumulator, updated in place) compiled and
  `(q, k, v, dout, lse2, delta) -> (dq_slab, dk, dv)` interpreted
  (`backward_fused.sum_slab`). k, v, dk and dv have `kv_rows` rows (TMA
  reads past them zeros, drops writes). With `spec.segmented` it takes
  `segment_ids=(lo, hi, q_lo, q_hi)`, the query rows' key bounds and the
  keys' query bounds (`segments.key_bounds`, `segments.query_bounds`): a
  CTA walks only the query tiles that reach its keys and masks by them."""
  spec, cfg = plan.spec, plan.config
  st, consumers, splits = cfg.num_stages, cfg.dkdv_consumers, plan.splits
  # The 64-byte swizzle where tiles are cut in halves (one for every
  # operand of a GEMM); else each tile's own width.
  narrow = plan.q_halves > 1 or plan.shared
  tf_of = lambda width: (
    swizzle64(spec.dtype) if narrow else smem_transforms(spec.dtype, width)
  )
  tf = tf_of(plan.chunk)
  kv_tiles = 1 if plan.shared else consumers

  def fa3_bwd_dkdv(q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, *refs):
    rest = list(refs)
    ids = [rest.pop(0) for _ in range(3)] if spec.segmented else None
    dq_ref = rest.pop(0) if plan.fused else None
    dk_ref, dv_ref, *scratch = rest
    (k_smem, v_smem, q_smem, do_smem, lse_smem, dl_smem) = scratch[:6]
    # Fused: one "full" barrier per slot for all four loads (one wait).
    n_full = 1 if plan.fused else 4
    full = tuple(scratch[6 : 6 + n_full])
    empty, kv_bar = scratch[6 + n_full : 8 + n_full]
    extra = tuple(scratch[8 + n_full :])
    seg = None
    if spec.segmented:  # the keys' query bounds, read from global memory
      seg = SegmentRefs(ids[0], ids[1], None, ids[2])
    refs = (k_ref, v_ref, dk_ref, dv_ref, k_smem, v_smem, q_smem, do_smem)
    refs += (lse_smem, dl_smem, full, empty, kv_bar)
    _consumers(plan, ops, refs, extra, dq_ref, seg)

    @pl.when(lax.axis_index("wg") == consumers)
    def _():
      dkdv_producer(
        (q_ref, do_ref, lse_ref, dl_ref, q_smem, do_smem, lse_smem, dl_smem)
        + (full * (4 // n_full), empty),
        plan,
        seg,
      )

  chunked = lambda n, rows, of_v: plgpu.SMEM(
    (n, splits, rows, plan.width(of_v)),
    spec.dtype,
    transforms=tf_of(plan.width(of_v)),
  )
  scratch = (
    chunked(kv_tiles, cfg.block_kv, False),  # K
    chunked(kv_tiles, cfg.block_kv, True),  # V
    chunked(st, cfg.block_q, False),  # Q
    chunked(st, cfg.block_q, True),  # dO
    plgpu.SMEM((st, cfg.block_q), jnp.float32),
    plgpu.SMEM((st, cfg.block_q), jnp.float32),
  )
  # "full" barriers per slot: Q, dO (one TMA per head-dim chunk), lse,
  # delta; fused, one barrier counting all of them.
  if plan.fused:
    scratch += (plgpu.Barrier(num_arrivals=2 * splits + 2, num_barriers=st),)
  else:
    scratch += (
      plgpu.Barrier(num_arrivals=splits, num_barriers=st),
      plgpu.Barrier(num_arrivals=splits, num_barriers=st),
      plgpu.Barrier(num_barriers=st),
      plgpu.Barrier(num_barriers=st),
    )
  scratch += (
    # Slot releases: the fused kernel's arrive once per consumer warpgroup.
    consumer_release(st, consumers)
    if plan.fused
    else plgpu.Barrier(num_arrivals=consumers, num_barriers=st),
    # K, V of each K/V tile (one TMA per head-dim chunk)
    plgpu.Barrier(num_arrivals=splits, num_barriers=2 * kv_tiles),
  )
  if plan.shared:  # P and dS by step parity, and the consumers' rendezvous
    exchange = lambda: plgpu.SMEM(
      (2, cfg.block_q, cfg.block_kv), spec.dtype, transforms=tf
    )
    scratch += (exchange(), exchange(), plgpu.Barrier(num_arrivals=consumers))
  if plan.fused:
    scratch += sink_scratch(plan, interpret is not None, tf)
  out_type = tuple(
    jax.ShapeDtypeStruct((spec.batch, kv_rows, spec.heads_kv, d), spec.dtype)
    for d in (spec.head_dim, spec.head_dim_v)
  )
  if plan.fused and interpret is not None:
    slab = (plan.kv_ctas * plan.dq_parts, spec.batch, plan.seq_q_pad)
    slab += (spec.heads_q, spec.head_dim)
    out_type = (jax.ShapeDtypeStruct(slab, jnp.float32),) + out_type
  kernel = build_kernel(
    fa3_bwd_dkdv,
    out_type=out_type,
    scratch=scratch,
    grid=(spec.heads_kv, plan.kv_ctas * plan.cta_splits, spec.batch),
    grid_names=("heads", "kv_tiles", "batch"),
    warpgroups=consumers + 1,
    interpret=interpret,
    in_place=plan.fused,
  )

  def run(*args: Any, segment_ids: Any = None) -> Any:
    if segment_ids is None:
      return kernel(*args)
    extra = dkdv_operands(plan, segment_ids)
    return kernel(*args[:6], *extra, *args[6:])

  return run
