"""The sm90 forward-tangent kernel: forward-mode differentiation's tangents
of out and lse in one pass over K/V, given the call's own out and lse.

With the forward's lse known, P = exp(S - lse) needs no online softmax: per
K/V tile a consumer issues S = Q K^T and S' = Q' K^T + Q K'^T, forms P
while S' computes, issues P V' and, while that runs, P o S' (in natural
units, through the softcap's and score_mod's derivatives, with a bias's
and the score_mod's arrays' tangents) and its row sum; then (P o S') V.
At the end O' = acc - rowsum(P o S') O and lse' = rowsum(P o S') (plus a
sink's `exp(sink - lse) sink'`). The dQ kernel's structure: a producer
streams K with K' and V with V' side by side into a 2-stage ring, one or
two consumers own 64 query rows each, one CTA per query tile.
docs/design_notes.md#forward-mode-one-primitive-two-rules.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa3.kernels.sm90 import common, compat, flex_tile, scores
from pallas_fa3.kernels.sm90.common import (
  QueryPlan,
  bounds_scratch,
  id_operands,
  pad_axis,
  round_up,
  tma_extent,
)
from pallas_fa3.kernels.sm90.config import MAX_SMEM_BYTES
from pallas_fa3.kernels.sm90.ops import COMPILED, INTERPRETED, KernelOps
from pallas_fa3.kernels.sm90.pipeline import (
  TileWalk,
  kv_producer,
  query_span,
  query_walk,
  release_rest,
)
from pallas_fa3.lse import log2_of
from pallas_fa3.spec import AttentionSpec

# The widest head dim the kernel takes: at d256 its lone consumer (the
# 64 x 256 float32 O' accumulator, S and S' of 32 keys) spills 140/168 B.
MAX_HEAD_DIM = 192

# The widest head dim at which two consumers form the score_mod's tangent
# along its arrays' (one more tile beside S', P and O') on 64-key tiles:
# at d128 that spilled 24/36 B (12/20 with P V' waited first, 8/16 with
# the tile in bf16), so there the tiles take 32 keys (0 spills, model B
# unchanged: the tensor core bounds it either way).
SCORE_TANGENTS_MAX_HEAD_DIM = 64

# O's tile is read and O' written back in 64-column chunks (one 128-byte
# swizzle atom of 16-bit values).
_CHUNK = 64


@dataclasses.dataclass(frozen=True)
class Sm90TangentConfig:
  """Tiling of the tangent kernel (`tangent_config` picks it).

  Attributes:
    block_q: query rows per consumer warpgroup.
    block_kv: keys per K/V tile (each stage holds K, K', V and V').
    num_stages: slots of the K/V ring.
    consumers: consumer warpgroups, each with its own rows (1 or 2).
  """

  block_q: int = 64
  block_kv: int = 64
  num_stages: int = 2
  consumers: int = 2
  # (`QueryPlan`'s walk: one CTA per query tile, no pingpong)
  persistent = False
  overlap = False

  @property
  def rows_per_cta(self) -> int:
    return self.consumers * self.block_q


def tangent_config(spec: AttentionSpec) -> Sm90TangentConfig:
  """The tangent kernel's tiling. Up to d = dv = 128: two consumers of 64
  rows and 64-key tiles (S, S', P, P o S' and the float32 O' accumulator
  in 240 registers; Q, Q', O and two stages of K, K', V, V' fill shared
  memory at d128), 32-key tiles where a score_mod's arrays' tangents add
  a tile at d128 (`SCORE_TANGENTS_MAX_HEAD_DIM`). Wider (d192): one
  consumer and 32-key tiles, so that Q, Q', O and the ring fit in shared
  memory and the 64 x dv O' accumulator beside S and S' in its 256
  registers."""
  d = max(spec.head_dim, spec.head_dim_v)
  if d <= 128:
    if d > SCORE_TANGENTS_MAX_HEAD_DIM and _score_tangents(spec):
      return Sm90TangentConfig(block_kv=32)
    return Sm90TangentConfig()
  return Sm90TangentConfig(block_kv=32, consumers=1)


def smem_bytes(spec: AttentionSpec, config: Sm90TangentConfig) -> int:
  """Shared memory of the tangent kernel: per consumer Q, Q' and O (O'
  leaves through O's tile), per stage K, K', V, V', per row two float32
  (lse2, then lse'; the sink's term) and with segment ids two int32, and
  1 KiB for barriers and alignment."""
  d, dv, rows = spec.head_dim, spec.head_dim_v, config.block_q
  tiles = config.consumers * rows * (2 * d + dv)
  ring = config.num_stages * config.block_kv * 2 * (d + dv)
  per_row = 2 * 4 + 2 * 4 * spec.segmented
  bytes_ = (tiles + ring) * spec.dtype.itemsize
  return bytes_ + config.consumers * rows * per_row + 1024


def tangent_unsupported(
  spec: AttentionSpec, config: Sm90TangentConfig
) -> str | None:
  """Why the kernel cannot compute `spec`'s tangents (None: it can)."""
  if spec.fp8 is not None:
    return "fp8"
  fs = spec.flex
  if fs is not None:
    reason = flex_tile.kernel_unsupported(spec, config.block_q, config.block_kv)
    if reason is not None:
      return reason
    if _score_tangents(spec):  # its jvp along its arrays' tangents
      try:
        flex_tile.plan(
          fs.score_mod, True, spec.seq_q, spec.seq_kv, grad="params",
          relative=True,
        )  # fmt: skip
      except flex_tile.Refused as e:
        return f"tangents of the score_mod's arrays: {e}"
  if spec.stable_max is not None:
    return "stable_max"
  d, dv = spec.head_dim, spec.head_dim_v
  if d % _CHUNK or dv % _CHUNK:
    return f"head dims {d}/{dv}: the tangent kernel takes multiples of 64"
  if max(d, dv) > MAX_HEAD_DIM:
    return (
      f"head dims {d}/{dv}: the tangent kernel's one consumer spills above"
      f" {MAX_HEAD_DIM} (140/168 B at d256, the sm_90a compile)"
    )
  need = smem_bytes(spec, config)
  if need > MAX_SMEM_BYTES:
    return (
      f"head dims {d}/{dv}: the tangent kernel's tiles need {need} B of"
      f" shared memory, more than {MAX_SMEM_BYTES}"
    )
  return None


def _score_tangents(spec: AttentionSpec) -> bool:
  """Whether the score_mod has floating arrays (their tangents then enter
  S': `sm90_forward_tangent`'s `score_tangents`)."""
  fs = spec.flex
  return bool(
    fs is not None
    and fs.score_mod is not None
    and flex_tile.float_positions(fs.score_mod)
  )


def _consumer(
  refs: dict[str, Any], plan: QueryPlan, ops: KernelOps, seg: Any
) -> None:
  """A consumer with its own `block_q` rows: O' and lse' over its walk."""
  spec, cfg = plan.spec, plan.config
  k_smem, v_smem = refs["k_smem"], refs["v_smem"]
  k_full, v_full, k_empty, v_empty = (
    refs[n] for n in ("k_full", "v_full", "k_empty", "v_empty")
  )
  plgpu.set_max_registers(
    common.consumer_regs(cfg.consumers), action="increase"
  )
  wg = lax.axis_index("wg")
  batch, head = lax.axis_index("batch"), lax.axis_index("heads")
  q_tile = lax.axis_index("q_tiles")
  cta_row0 = q_tile * plan.rows_per_cta
  row0 = cta_row0 + wg * cfg.block_q
  rows = pl.ds(row0, cfg.block_q)
  q_pair, o_tile = refs["q_smem"].at[wg], refs["o_smem"].at[wg]
  rows_smem = refs["rows_smem"].at[wg]  # lse2 (then lse'), the sink's term
  bar = refs["tile_bar"].at[wg]

  tile = (batch, rows, head)
  for i, name in enumerate(("q", "dq")):
    plgpu.copy_gmem_to_smem(
      refs[name].at[tile], q_pair.at[i], bar, oob_mode=compat.ZERO_FILL
    )
  plgpu.copy_gmem_to_smem(
    refs["o"].at[tile], o_tile, bar, oob_mode=compat.ZERO_FILL
  )
  plgpu.copy_gmem_to_smem(
    refs["lse"].at[batch, head, rows], rows_smem.at[0], bar
  )
  if refs["seed"] is not None:
    plgpu.copy_gmem_to_smem(
      refs["seed"].at[batch, head, rows], rows_smem.at[1], bar
    )
  if seg is not None:
    for i, ref in enumerate((seg.lo, seg.hi)):
      plgpu.copy_gmem_to_smem(
        ref.at[batch, rows], seg.bounds_smem.at[i, wg], bar
      )
  plgpu.barrier_wait(bar)
  lse2 = ops.load_rows(rows_smem.at[0])
  bounds = None
  if seg is not None:
    bounds = (*(ops.load_rows(seg.bounds_smem.at[i, wg]) for i in (0, 1)), 0)

  span = query_span(refs, seg, batch, q_tile, head)
  walk = common.kv_walk(plan, cta_row0, row0, cfg.block_q, span)
  scale = jnp.float32(spec.softmax_scale)
  shape = (cfg.block_q, cfg.block_kv)
  params = _score_tangents(spec)
  # The shapes `then` below returns: P o S' for the GEMM, its row sum.
  like = (
    ops.tile(jnp.zeros(shape, spec.dtype)),
    ops.rows(jnp.zeros((cfg.block_q,), jnp.float32)),
  )

  def step(j, carry, *, masked):
    acc, r = carry
    slot = lax.rem(j, cfg.num_stages)
    kv0 = (walk.first + j) * cfg.block_kv
    k_pair, v_pair = k_smem.at[slot], v_smem.at[slot]
    plgpu.barrier_wait(k_full.at[slot])

    def body(read_s, read_sdot):  # S' computes while P is formed
      at = scores.At(
        row0, kv0, masked=masked, bounds=bounds, flex=(refs, batch, head)
      )
      p, t, *arrays_dot = scores.probabilities(
        ops, spec, read_s(), lse2, at, params=params
      )
      # The score_mod's tangent along its arrays' (one tile per array).
      extra = sum(arrays_dot[0]) if arrays_dot else None
      bias_dot = None
      if refs.get("dbias") is not None:  # the bias's tangent tile
        bias_dot = flex_tile.kernel_bias(
          spec, {"bias": refs["dbias"]}, ops, shape, row0, kv0, batch, head
        )
      plgpu.barrier_wait(v_full.at[slot])

      def then(in_flight=1):  # P o S' in natural units, its row sum,
        # while P V' (`in_flight` groups issued after S') computes
        sdot = read_sdot(wait_n=in_flight)
        plgpu.barrier_arrive(k_empty.at[slot])  # K, K' read
        return _p_times_tangent(p, sdot * scale, t, bias_dot, extra, spec.dtype)

      if cfg.consumers == 1:  # (d > 128) P V' not in flight meanwhile:
        # the accumulator, P and P o S' at once spilled 140/168 B at d256
        ps, rows_ps = then(0)  # (no group after S': wait for all)
        (acc_new,) = ops.accumulate(
          (acc,),
          [(0, p.astype(spec.dtype), v_pair.at[1]), (0, ps, v_pair.at[0])],
        )
      else:
        acc_new, (ps, rows_ps) = ops.accumulate_pv_then(
          acc, p.astype(spec.dtype), v_pair.at[1], then, like
        )
        acc_new = ops.accumulate_pv(acc_new, ps, v_pair.at[0])
      plgpu.barrier_arrive(v_empty.at[slot])  # V, V' read
      return acc_new, r + rows_ps

    return ops.score_pair(
      (q_pair.at[0], k_pair.at[0]),
      ((q_pair.at[1], q_pair.at[0]), (k_pair.at[0], k_pair.at[1])),
      body,
    )

  acc = ops.tile(jnp.zeros((cfg.block_q, spec.head_dim_v), jnp.float32))
  r = ops.rows(jnp.zeros((cfg.block_q,), jnp.float32))
  acc, r = common.walk_steps(walk, step, (acc, r), masked=plan.needs_mask)

  release_rest(  # tiles streamed for the other consumer's rows (causal)
    None, (k_full, v_full, k_empty, v_empty), cfg.num_stages, 0,
    walk.steps, walk.cta_steps,
  )  # fmt: skip

  if refs["seed"] is not None:  # the sink's exp(sink - lse) sink'
    r = r + ops.load_rows(rows_smem.at[1])
  # O' = acc - lse' O, written over O's tile chunk by chunk.
  for c in range(0, spec.head_dim_v, _CHUNK):
    chunk = o_tile.at[:, pl.ds(c, _CHUNK)]
    if ops.interpreted:
      o = chunk[...]
    else:
      o = compat.load_with_layout(chunk, plgpu.Layout.WGMMA)
    part = acc[:, c : c + _CHUNK]
    chunk[...] = (
      part - lax.broadcast_in_dim(r, part.shape, [0]) * o.astype(jnp.float32)
    ).astype(spec.dtype)
  rows_smem.at[0][...] = r  # (lse2 has long been read: registers)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_tile, refs["dout"].at[tile])
  plgpu.copy_smem_to_gmem(rows_smem.at[0], refs["dlse"].at[batch, head, rows])
  plgpu.wait_smem_to_gmem(0)


def _p_times_tangent(
  p: Any, sdot: Any, ctx: Any, dbias: Any, darrays: Any, dtype: Any
) -> tuple:
  """(P o S' rounded for the GEMM, its float32 row sum): `sdot` the raw
  scores' tangent times the scale, `ctx` `scores.probabilities`' (the
  softcap's tanh t, or (t, the score_mod's derivative g)), `dbias` the
  bias's tangent tile, `darrays` the score_mod's tangent along its arrays'
  (None: none): S' = g ((1 - t^2) sdot + dbias) + darrays, the bias added
  after the softcap and before the score_mod."""
  cap, g = ctx if isinstance(ctx, tuple) else (ctx, None)
  x = sdot if cap is None else sdot * (1.0 - cap * cap)
  if dbias is not None:
    x = x + dbias
  if g is not None:
    x = x * g
  ps = p * (x if darrays is None else x + darrays)
  return ps.astype(dtype), ps.sum(axis=1)


def _build(
  plan: QueryPlan,
  ops: KernelOps,
  interpret: Any,
  q_rows: int,
  flex_names: tuple[str, ...] = (),
) -> Callable:
  spec, cfg = plan.spec, plan.config
  d, dv, st = spec.head_dim, spec.head_dim_v, cfg.num_stages
  consumers = cfg.consumers
  walk = TileWalk(plan, plan.num_tiles)

  def fa3_fwd_tangent(refs: dict[str, Any]) -> None:
    seg, tiles = query_walk(spec, refs, walk)
    wg = lax.axis_index("wg")
    pl.when(wg < consumers)(functools.partial(_consumer, refs, plan, ops, seg))

    @pl.when(wg == consumers)
    def _():
      kv_producer(
        (
          (refs["k"], refs["dk"]),
          (refs["v"], refs["dv"]),
          *(refs[n] for n in ("k_smem", "v_smem", "k_full", "v_full")),
          *(refs[n] for n in ("k_empty", "v_empty")),
        ),
        tiles,
        registers=common.producer_regs(consumers),
      )

  tf = lambda width: common.smem_transforms(spec.dtype, width)
  loads = 4 + spec.sinks + 2 * spec.segmented  # TMA copies per tile barrier
  scratch = dict(
    q_smem=plgpu.SMEM(
      (consumers, 2, cfg.block_q, d), spec.dtype, transforms=tf(d)
    ),
    o_smem=plgpu.SMEM(
      (consumers, cfg.block_q, dv), spec.dtype, transforms=tf(dv)
    ),
    rows_smem=plgpu.SMEM((consumers, 2, cfg.block_q), jnp.float32),
    k_smem=plgpu.SMEM((st, 2, cfg.block_kv, d), spec.dtype, transforms=tf(d)),
    # A 32-key V tile is a P V GEMM's whole K: the 64-byte swizzle's step.
    v_smem=plgpu.SMEM(
      (st, 2, cfg.block_kv, dv),
      spec.dtype,
      transforms=tf(dv) if cfg.block_kv >= 64 else common.swizzle64(spec.dtype),
    ),
    k_full=plgpu.Barrier(num_arrivals=2, num_barriers=st),  # K and K'
    v_full=plgpu.Barrier(num_arrivals=2, num_barriers=st),
    k_empty=plgpu.Barrier(num_arrivals=consumers, num_barriers=st),
    v_empty=plgpu.Barrier(num_arrivals=consumers, num_barriers=st),
    tile_bar=plgpu.Barrier(num_arrivals=loads, num_barriers=consumers),
    bounds_smem=(
      bounds_scratch(cfg.block_q, consumers)[0] if spec.segmented else None
    ),
  )
  out_type = dict(
    dout=jax.ShapeDtypeStruct(
      (spec.batch, q_rows, spec.heads_q, dv), spec.dtype
    ),
    dlse=jax.ShapeDtypeStruct(
      (spec.batch, spec.heads_q, plan.seq_q_pad), jnp.float32
    ),
  )
  inputs = ["q", "k", "v", "o", "lse", "dq", "dk", "dv"]
  inputs += ["seed"] * spec.sinks + ["lo", "hi", "spans"] * spec.segmented
  inputs += list(flex_names)  # flex_tile.kernel_operands'
  return common.build_kernel(
    fa3_fwd_tangent,
    inputs=inputs,
    optional=[
      n for n in ("seed", "lo", "hi", "spans", "bm_spans") if n not in inputs
    ],
    out_type=out_type,
    scratch=scratch,
    grid=walk.grid[0],
    grid_names=walk.grid[1],
    warpgroups=consumers + 1,
    interpret=interpret,
    # No cross-warp reduction (row sums stay in a warp): d128's tiles fill
    # the rest of shared memory.
    reduction_scratch_bytes=0,
  )


def sm90_forward_tangent(
  spec: AttentionSpec,
  config: Sm90TangentConfig,
  primals: tuple,
  result: tuple[jax.Array, jax.Array],
  tangents: tuple,
  *,
  interpret: Any = None,
  segment_ids: Any = None,
  flex: Any = None,
  dbias: Any = None,
  score_tangents: tuple | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Runs the tangent kernel.

  Args:
    spec: the call (bf16/fp16; what it takes: `tangent_unsupported`).
    config: the tiling (`tangent_config`).
    primals: `(q, k, v, sinks)` as the forward takes them (sinks float32
      `[b, hq]` or None).
    result: the forward's `(out [b, sq, hq, dv], lse [b, hq, sq])`.
    tangents: `(q', k', v', sinks')`, the primals' shapes and dtypes
      (sinks' None without sinks).
    interpret: None compiles for sm90; interpret-mode parameters run the
      same kernel on a CPU.
    segment_ids: with `spec.segmented`, each query row's key bounds
      `(lo, hi)` (`segments.kernel_bounds`, exact for contiguous ids).
    flex: `spec.flex`'s operands (`flex.FlexOperands`): a mask_mod, a
      block mask, a score_mod, a bias, read as the dQ kernel reads them
      (the score_mod's derivative chains S' into its scores).
    dbias: the bias's tangent (its shape) where `spec.flex.bias_grad`.
    score_tangents: the tangents of the score_mod's floating arrays, in
      their order (zeros where one has none), where it has any.

  Returns:
    (out' `[b, sq, hq, dv]` in `spec.dtype`, float32 lse' `[b, hq, sq]`);
    0 for rows that see no key.
  """
  q, k, v, sinks = primals
  dq, dk, dv, dsinks = tangents
  out, lse = result
  rows = config.rows_per_cta
  plan = QueryPlan(
    spec,
    config,
    seq_q_pad=round_up(spec.seq_q, rows),
    seq_kv_pad=round_up(spec.seq_kv, config.block_kv),
    row_blocks=config.consumers,
  )
  ops = COMPILED if interpret is None else INTERPRETED
  seen = lse != -jnp.inf
  # Rows that see no key, and padded rows: lse2 = +inf, P = 0.
  lse2 = pad_axis(
    jnp.where(seen, log2_of(lse), jnp.inf), 2, plan.seq_q_pad, jnp.inf
  )
  extra = ()
  if spec.sinks:  # the sink's share of each row, times its tangent
    sink = sinks.astype(jnp.float32)[:, :, None]
    seed = jnp.where(
      seen,
      jnp.exp(sink - jnp.where(seen, lse, 0.0))
      * dsinks.astype(jnp.float32)[:, :, None],
      0.0,
    )
    extra += (pad_axis(seed, 2, plan.seq_q_pad),)
  if segment_ids is not None:
    extra += id_operands(plan, *segment_ids)
  if _score_tangents(spec) and score_tangents is None:
    raise ValueError(
      "score_tangents: the score_mod has floating arrays; pass their"
      " tangents (zeros where they have none)"
    )
  fx = {}
  if spec.flex is not None:  # as the dQ kernel takes them
    fx = flex_tile.kernel_operands(
      spec, flex, q_pad=plan.seq_q_pad, kv_pad=plan.seq_kv_pad,
      rows_per_cta=rows, block_kv=config.block_kv,
      grad="params" if _score_tangents(spec) else True,
      tile_rows=config.block_q, param_tangents=score_tangents,
    )  # fmt: skip
    if dbias is not None:  # padded as the bias: whole tiles by plain loads
      fx["dbias"] = jnp.pad(
        dbias,
        [(0, 0), (0, 0)]
        + [(0, n - m) for n, m in zip(fx["bias"].shape[2:], dbias.shape[2:])],
      )
  by_q = lambda x: tma_extent(x, 1, config.block_q)
  by_kv = lambda x: tma_extent(x, 1, config.block_kv)
  qp = by_q(q)
  dout, dlse = _build(plan, ops, interpret, qp.shape[1], tuple(fx))(
    qp, by_kv(k), by_kv(v), by_q(out.astype(spec.dtype)), lse2,
    by_q(dq.astype(spec.dtype)), by_kv(dk.astype(spec.dtype)),
    by_kv(dv.astype(spec.dtype)), *extra, *fx.values(),
  )  # fmt: skip
  return dout[:, : spec.seq_q], dlse[:, :, : spec.seq_q]
