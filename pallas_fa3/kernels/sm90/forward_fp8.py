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

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa3.kernels.sm90 import hardware
from pallas_fa3.kernels.sm90.common import (
  QueryPlan,
  build_kernel,
  consumer_release,
  pad_axis,
  smem_transforms,
  tma_extent,
)
from pallas_fa3.kernels.sm90.config import NUM_CONSUMERS, Sm90ForwardConfig
from pallas_fa3.kernels.sm90.config_fp8 import out_cols
from pallas_fa3.kernels.sm90.forward_fp8_tile import query_tile
from pallas_fa3.kernels.sm90.ops_fp8 import (
  COMPILED_FP8,
  INTERPRETED_FP8,
  Fp8Ops,
  vt_cols,
)
from pallas_fa3.kernels.sm90.persistent import (
  TileWalk,
  kv_producer,
  num_ctas,
  run_consumer,
)
from pallas_fa3.kernels.sm90.pingpong import turn_barriers
from pallas_fa3.kernels.sm90.segment_operands import (
  SegmentRefs,
  bounds_scratch,
  id_operands,
)
from pallas_fa3.quant.e4m3 import (
  FP8_DTYPE,
  v_scale_ratios,
)
from pallas_fa3.spec import AttentionSpec

_F32 = jnp.float32
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

  def fa3_fwd_fp8(*refs):
    q_refs, refs = refs[:terms], list(refs[terms:])
    k_ref, vt_ref, qs_ref, ks_ref, vs_ref, vr_ref = refs[:6]
    rest = refs[6:]
    sinks_ref = rest.pop(0) if spec.sinks else None
    ids = [rest.pop(0) for _ in range(3)] if spec.segmented else None
    o_ref, lse_ref, *scratch = rest
    # scratch: q, o, p, k, V^T, lse tiles; k/v full and empty; q; turns;
    # with segment ids, the rows' bounds last.
    tiles, ring, q_bar, turns = (
      scratch[:6],
      scratch[6:10],
      scratch[10],
      scratch[11:],
    )
    seg, tiles_walk = None, walk
    if spec.segmented:  # (lo, hi, spans) and the bounds' shared tile
      *turns, bounds_smem = turns
      seg = SegmentRefs(ids[0], ids[1], bounds_smem, ids[2])
      tiles_walk = dataclasses.replace(walk, spans=ids[2])
    wg = lax.axis_index("wg")

    @pl.when(wg < NUM_CONSUMERS)
    def _():
      refs = (q_refs, qs_ref, ks_ref, vs_ref, vr_ref, o_ref, lse_ref)
      extra = (q_bar, sinks_ref, seg)
      run_consumer(
        tiles_walk,
        turns,
        CONSUMER_REGS,
        lambda *at: query_tile((*refs, *tiles, *ring, *extra), plan, ops, *at),
      )

    @pl.when(wg == NUM_CONSUMERS)
    def _():
      kv_producer(
        (k_ref, vt_ref, tiles[3], tiles[4], *ring),
        tiles_walk,
        registers=PRODUCER_REGS,
        v_tile=vt_cols,
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
    # Q tile(s) per consumer (and its rows' key bounds: one arrival each)
    plgpu.Barrier(
      num_arrivals=terms + (2 if spec.segmented else 0),
      num_barriers=NUM_CONSUMERS,
    ),
    *turn_barriers(ops.interpreted),  # pingpong (named barriers compiled)
  )
  if spec.segmented:
    scratch += bounds_scratch(cfg.block_q, NUM_CONSUMERS)
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
    *(() if sinks is None else (sinks.astype(_F32),)),
    *(() if segment_ids is None else id_operands(plan, *segment_ids)),
  )
  return out[:, : spec.seq_q], lse[:, :, : spec.seq_q]
