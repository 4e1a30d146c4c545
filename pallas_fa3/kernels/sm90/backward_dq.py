"""The sm90 dQ kernel of the deterministic backward: the forward kernel's
structure (its producer streams K and V tiles), dQ accumulated in float32
registers in a fixed order.
More: docs/design_notes.md#backward-kernels.
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

from pallas_fa3.kernels.sm90 import common, compat, flex_tile, scores
from pallas_fa3.kernels.sm90.common import (
  SegmentRefs,
  bounds_scratch,
  id_operands,
)
from pallas_fa3.kernels.sm90.config import MAX_SMEM_BYTES, Sm90BackwardConfig
from pallas_fa3.kernels.sm90.config_backward import backward_kernel_smem_bytes
from pallas_fa3.kernels.sm90.ops import KernelOps
from pallas_fa3.kernels.sm90.pipeline import (
  TileWalk,
  kv_producer,
  query_span,
  query_walk,
  release_rest,
)
from pallas_fa3.spec import AttentionSpec

# A consumer's refs, by name (`build_kernel`'s dict).
_CONSUMED = (
  "q", "do", "lse", "dl", "dq", "q_smem", "do_smem", "lse_smem", "dl_smem",
  "k_smem", "v_smem", "k_full", "v_full", "k_empty", "v_empty", "tile_bar",
)  # fmt: skip


def _tile_loads(
  refs: dict[str, Any], seg: SegmentRefs | None, bars: list, b: int, at: tuple
) -> None:
  """TMA of query-row block `b`'s Q, dO, lse and delta tiles (and, with
  segment ids, its rows' key bounds) at `at = (batch, rows, head)`, one
  barrier each."""
  q_ref, do_ref, lse_ref, dl_ref, q_smem, do_smem, lse_smem, dl_smem = (
    refs[n]
    for n in (
      "q",
      "do",
      "lse",
      "dl",
      "q_smem",
      "do_smem",
      "lse_smem",
      "dl_smem",
    )
  )
  batch, rows, head = at
  tile, row = (batch, rows, head), (batch, head, rows)
  plgpu.copy_gmem_to_smem(
    q_ref.at[tile], q_smem.at[b], bars[0], oob_mode=compat.ZERO_FILL
  )
  plgpu.copy_gmem_to_smem(
    do_ref.at[tile], do_smem.at[b], bars[1], oob_mode=compat.ZERO_FILL
  )
  plgpu.copy_gmem_to_smem(lse_ref.at[row], lse_smem.at[b], bars[2])
  plgpu.copy_gmem_to_smem(dl_ref.at[row], dl_smem.at[b], bars[3])
  if seg is not None:
    for i, ref in enumerate((seg.lo, seg.hi)):
      plgpu.copy_gmem_to_smem(
        ref.at[batch, rows], seg.bounds_smem.at[i, b], bars[4 + i]
      )


def _row_bounds(
  seg: SegmentRefs | None, ops: KernelOps, b: int | Any
) -> tuple | None:
  """Block `b`'s rows' key bounds as `scores.At` takes them."""
  if seg is None:
    return None
  lo, hi = (ops.load_rows(seg.bounds_smem.at[i, b]) for i in (0, 1))
  return lo, hi, 0


def _dq_consumer(
  refs: dict[str, Any],
  plan: common.QueryPlan,
  ops: KernelOps,
  seg: SegmentRefs | None = None,
) -> None:
  """A consumer with its own `block_q` rows: dQ over its K/V steps."""
  (
    q_ref, do_ref, lse_ref, dl_ref, dq_ref, q_smem, do_smem, lse_smem,
    dl_smem, k_smem, v_smem, k_full, v_full, k_empty, v_empty, tile_bar,
  ) = (refs[n] for n in _CONSUMED)  # fmt: skip
  spec, cfg = plan.spec, plan.config
  plgpu.set_max_registers(
    common.consumer_regs(plan.row_blocks), action="increase"
  )
  wg = lax.axis_index("wg")
  batch, head = lax.axis_index("batch"), lax.axis_index("heads")
  cta_row0 = lax.axis_index("q_tiles") * plan.rows_per_cta
  row0 = cta_row0 + wg * cfg.block_q
  my_q, my_do = q_smem.at[wg], do_smem.at[wg]
  tile = (batch, pl.ds(row0, cfg.block_q), head)
  n = _TILE_LOADS + (2 if seg is not None else 0)
  bars = [tile_bar.at[n * wg + i] for i in range(n)]
  _tile_loads(refs, seg, bars, wg, tile)
  for bar in bars:
    plgpu.barrier_wait(bar)
  lse2 = ops.load_rows(lse_smem.at[wg])
  delta = ops.load_rows(dl_smem.at[wg])
  bounds = _row_bounds(seg, ops, wg)

  span = query_span(refs, seg, batch, lax.axis_index("q_tiles"), head)
  walk = common.kv_walk(plan, cta_row0, row0, cfg.block_q, span)
  # A lone consumer takes each K/V tile in halves of `block_kv / 2` keys
  # (64-byte swizzle: a half is a whole wgmma K step).
  halves = 2 if plan.row_blocks == 1 else 1
  sub = cfg.block_kv // halves

  # With a bias, dS leaves per part through two staging tiles by turns:
  # one is rewritten once its store two parts ago has read it.
  ds_out = refs.get("dbias")
  if ds_out is not None:
    ds_stage = refs["ds_stage"].at[wg]
    ds_rows = (batch, head, pl.ds(row0, cfg.block_q))

  # A score_mod's floating arrays: per row, the sum over keys of dL/d(its
  # output) times its derivative in each (`flex_tile.param_grad_axes`).
  mine = flex_tile.kernel_params(spec, "dq")
  n_params = len(mine)

  def part(j, h, slot, carry, masked):
    dq, sums = carry
    keys = pl.ds(h * sub, sub)
    k_tile, v_tile = k_smem.at[slot].at[keys], v_smem.at[slot].at[keys]
    s = ops.scores(my_q, k_tile)

    def accumulate(read_dp):  # dP = dO V^T is in flight meanwhile
      kv0 = (walk.first + j) * cfg.block_kv + h * sub
      at = scores.At(
        row0, kv0, masked=masked, bounds=bounds, flex=(refs, batch, head)
      )
      p, t, *d_params = scores.probabilities(
        ops, spec, s, lse2, at, params=n_params > 0
      )
      d_mine = [d_params[0][i] for i in mine] if n_params else []
      ds, new_sums = _ds_and_sums(p, t, read_dp, delta, sums, d_mine)
      if ds_out is not None:  # dbias: dS itself (no softcap with a bias)
        _store_ds(
          ds_stage, j * halves + h, ds, ds_out.at[ds_rows + (pl.ds(kv0, sub),)]
        )
      dq_new = ops.accumulate_pv(dq, ds.astype(spec.dtype), k_tile)
      return dq_new, new_sums

    return ops.with_scores(my_do, v_tile, accumulate)

  def step(j, carry, *, masked):
    slot = lax.rem(j, cfg.num_stages)
    plgpu.barrier_wait(k_full.at[slot])
    plgpu.barrier_wait(v_full.at[slot])
    for h in range(halves):
      carry = part(j, h, slot, carry, masked)
    plgpu.barrier_arrive(k_empty.at[slot])
    plgpu.barrier_arrive(v_empty.at[slot])
    return carry

  dq = ops.tile(jnp.zeros((cfg.block_q, spec.head_dim), jnp.float32))
  sums = tuple(
    ops.rows(jnp.zeros((cfg.block_q,), jnp.float32)) for _ in range(n_params)
  )
  dq, sums = common.walk_steps(walk, step, (dq, sums), masked=plan.needs_mask)
  for i, row_sums in enumerate(sums):  # out through shared memory
    refs["dp_stage"].at[wg, i][...] = row_sums

  release_rest(  # tiles loaded for the other consumer's rows (causal)
    None, (k_full, v_full, k_empty, v_empty), cfg.num_stages, 0,
    walk.steps, walk.cta_steps,
  )  # fmt: skip

  if ds_out is not None:  # dS = 0 on every tile my walk skipped
    _zero_skipped(
      ops, plan, walk, ds_stage.at[0], ds_out.at[ds_rows],
      [(h * sub, sub) for h in range(halves)],
    )  # fmt: skip

  my_q[...] = (dq * jnp.float32(spec.softmax_scale)).astype(spec.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(my_q, dq_ref.at[tile])
  for i in range(n_params):
    plgpu.copy_smem_to_gmem(
      refs["dp_stage"].at[wg, i],
      refs["dparams"].at[0, i, batch, head, pl.ds(row0, cfg.block_q)],
    )
  plgpu.wait_smem_to_gmem(0)


def _ds_and_sums(
  p: Any, t: Any, read_dp: Any, delta: Any, sums: tuple, derivatives: list
) -> tuple[Any, tuple]:
  """dS = P (dP - delta) (1 - t^2) g (`scores.times_derivative`; `t` the
  softcap's tanh and the score_mod's derivative g), and `sums` plus each
  row's sum of dS before g times each of `derivatives` (a score_mod's
  derivatives in its floating arrays). Without them P (1 - t^2) g is
  formed before `read_dp()` waits for dP (the wgmma still in flight)."""
  minus_delta = lambda dp: dp - lax.broadcast_in_dim(delta, p.shape, [0])
  if not derivatives:
    return scores.times_derivative(p, t) * minus_delta(read_dp()), sums
  ds = p * minus_delta(read_dp())
  sums = tuple(a + (ds * d).sum(axis=1) for a, d in zip(sums, derivatives))
  return scores.times_derivative(ds, t), sums


def _store_ds(ds_stage: Any, step: Any, ds: Any, dst: Any) -> None:
  """dbias: dS (in the staging tiles' dtype) to `dst` by TMA through the
  staging tiles `ds_stage` by turns (`step`'s), each rewritten once its
  last store has read it."""
  n = ds_stage.shape[0]
  stage = ds_stage.at[lax.rem(step, n)]
  plgpu.wait_smem_to_gmem(n - 1, wait_read_only=True)
  stage[...] = ds.astype(stage.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(stage, dst)


def _zero_skipped(
  ops: KernelOps, plan: common.QueryPlan, walk: Any, stage: Any,
  ds_out: Any, cols: list[tuple[int, int]],
) -> None:  # fmt: skip
  """dbias: zeros from the staging tile `stage` (after every store has
  read it) into the key columns `cols` (offset, width) of each K/V tile
  outside the walk, in `ds_out` (this tile's rows of dS)."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  stage[...] = ops.tile(jnp.zeros(stage.shape, stage.dtype))
  plgpu.commit_smem()

  @pl.loop(0, plan.num_kv_blocks)
  def _zero(i):
    @pl.when((i < walk.first) | (i >= walk.first + walk.steps))
    def _():
      for offset, width in cols:
        keys = pl.ds(i * plan.config.block_kv + offset, width)
        plgpu.copy_smem_to_gmem(stage, ds_out.at[:, keys])


def param_count(spec: AttentionSpec) -> int:
  """The score_mod's floating arrays whose gradients the dQ kernel sums
  (`flex_tile.kernel_params`: read by batch, head or query), 0 without."""
  return len(flex_tile.kernel_params(spec, "dq"))


def _dq_shared_consumer(
  refs: dict[str, Any],
  plan: common.QueryPlan,
  ops: KernelOps,
  w: int,
  seg: SegmentRefs | None = None,
) -> None:
  """Consumer `w` of a dQ CTA whose two consumers share one query tile: it
  accumulates dQ for head-dim half `w`.

  Per K/V step it computes its half of the key columns of S = Q K^T and
  dP = dO V^T, writes that half of dS to shared memory, meets the other
  consumer, and then reads all of dS for dQ_w += dS K[:, half w]. No GEMM is
  repeated. The dS buffers alternate by step parity (as in the dK/dV
  kernel's shared layout).
  """
  (
    q_ref, do_ref, lse_ref, dl_ref, dq_ref, q_smem, do_smem, lse_smem,
    dl_smem, k_smem, v_smem, k_full, v_full, k_empty, v_empty, tile_bar,
  ) = (refs[n] for n in _CONSUMED)  # fmt: skip
  ds_smem, xchg = refs["ds_smem"], refs["xchg"]
  spec, cfg = plan.spec, plan.config
  plgpu.set_max_registers(common.consumer_regs(2), action="increase")
  batch, head = lax.axis_index("batch"), lax.axis_index("heads")
  row0 = lax.axis_index("q_tiles") * cfg.block_q
  my_q, my_do = q_smem.at[0], do_smem.at[0]
  tile = (batch, pl.ds(row0, cfg.block_q), head)
  bars = [tile_bar.at[i] for i in range(_TILE_LOADS + 2 * (seg is not None))]
  if w == 0:  # one consumer loads the shared tiles; both wait for them
    _tile_loads(refs, seg, bars, 0, tile)
  for bar in bars:
    plgpu.barrier_wait(bar)
  lse2 = ops.load_rows(lse_smem.at[0])
  delta = ops.load_rows(dl_smem.at[0])
  bounds = _row_bounds(seg, ops, 0)

  span = query_span(refs, seg, batch, lax.axis_index("q_tiles"), head)
  walk = common.kv_walk(plan, row0, row0, cfg.block_q, span)
  half, dc = cfg.block_kv // 2, spec.head_dim // 2
  mine = pl.ds(w * half, half)  # my key columns of S, dP
  cols = pl.ds(w * dc, dc)  # my head-dim columns of dQ
  # With a bias, my half of each dS leaves through two staging
  # tiles by turns, as in `_dq_consumer`; a score_mod's floating arrays
  # get per-row sums over my key halves (the XLA side adds the two
  # consumers' sums).
  ds_out = refs.get("dbias")
  if ds_out is not None:
    ds_stage = refs["ds_stage"].at[w]
    ds_rows = (batch, head, pl.ds(row0, cfg.block_q))
  params = flex_tile.kernel_params(spec, "dq")

  def step(j, carry, *, masked):
    dq, sums = carry
    slot, buf = lax.rem(j, cfg.num_stages), lax.rem(j, 2)
    plgpu.barrier_wait(k_full.at[slot])
    plgpu.barrier_wait(v_full.at[slot])
    k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
    s = ops.scores(my_q, k_tile.at[mine])
    kv0 = (walk.first + j) * cfg.block_kv + w * half

    def gradient(read_dp):  # dP = dO V^T is in flight while P is computed
      at = scores.At(
        row0, kv0, masked=masked, bounds=bounds, flex=(refs, batch, head)
      )
      p, t, *d_params = scores.probabilities(
        ops, spec, s, lse2, at, params=bool(params)
      )
      d_mine = [d_params[0][i] for i in params] if params else []
      ds, new_sums = _ds_and_sums(p, t, read_dp, delta, sums, d_mine)
      if ds_out is not None:  # dbias: dS itself (no softcap with a bias)
        _store_ds(ds_stage, j, ds, ds_out.at[ds_rows + (pl.ds(kv0, half),)])
      return ds.astype(spec.dtype), new_sums

    ds, sums = ops.with_scores(my_do, v_tile.at[mine], gradient)
    ds_smem.at[buf].at[:, mine][...] = ds
    plgpu.commit_smem()  # my half of dS visible to both consumers' wgmmas
    plgpu.barrier_arrive(xchg)
    plgpu.barrier_wait(xchg)
    dq = ops.accumulate_ss(dq, ds_smem.at[buf], k_tile.at[:, cols])
    plgpu.barrier_arrive(k_empty.at[slot])
    plgpu.barrier_arrive(v_empty.at[slot])
    return dq, sums

  dq = ops.tile(jnp.zeros((cfg.block_q, dc), jnp.float32))
  sums = tuple(ops.rows(jnp.zeros((cfg.block_q,), jnp.float32)) for _ in params)
  dq, sums = common.walk_steps(walk, step, (dq, sums), masked=plan.needs_mask)
  for i, row_sums in enumerate(sums):  # out through shared memory
    refs["dp_stage"].at[w, i][...] = row_sums
  if ds_out is not None:  # dS = 0 on my halves of the tiles not walked
    _zero_skipped(
      ops, plan, walk, ds_stage.at[0], ds_out.at[ds_rows], [(w * half, half)]
    )

  # Both consumers passed the last rendezvous after their last read of Q:
  # each writes its half of dQ into the Q tile, and consumer 0 stores it.
  my_q.at[:, cols][...] = (dq * jnp.float32(spec.softmax_scale)).astype(
    spec.dtype
  )
  plgpu.commit_smem()
  plgpu.barrier_arrive(xchg)
  plgpu.barrier_wait(xchg)
  if w == 0:
    plgpu.copy_smem_to_gmem(my_q, dq_ref.at[tile])
  for i in range(len(params)):
    plgpu.copy_smem_to_gmem(
      refs["dp_stage"].at[w, i],
      refs["dparams"].at[w, i, batch, head, pl.ds(row0, cfg.block_q)],
    )
  plgpu.wait_smem_to_gmem(0)


# Tile loads per query-row block (Q, dO, lse, delta), one barrier each;
# segment ids add the rows' key bounds (lo, hi).
_TILE_LOADS = 4


def dq_query_plan(
  spec: AttentionSpec,
  config: Sm90BackwardConfig,
  seq_q_pad: int,
  seq_kv_pad: int,
) -> common.QueryPlan:
  """The dQ kernel's query plan: `config.dq_consumers` row blocks of its
  own, or one the two consumers share (`dq_head_splits=2`)."""
  shared = config.dq_head_splits == 2
  return common.QueryPlan(
    spec,
    config.dq_config,
    seq_q_pad,
    seq_kv_pad,
    row_blocks=1 if shared else config.dq_consumers,
  )


def dq_kernel(
  spec: AttentionSpec,
  config: Sm90BackwardConfig,
  seq_q_pad: int,
  seq_kv_pad: int,
  ops: KernelOps,
  interpret: Any,
  q_rows: int,
  flex_names: tuple[str, ...] = (),
  ds_dtype: Any = jnp.float32,
) -> Callable[..., tuple]:
  """The dQ kernel: `(q, k, v, dout, lse2, delta, segment_ids=None) ->
  (dq,)`, then with a bias dS `[b, hq, seq_q_pad, kv tiles x block_kv]`
  in `ds_dtype` (float32 where XLA sums it over the bias's broadcast axes,
  else the bias's own: dbias itself; 0 on the tiles it skips), then with a
  score_mod's floating
  arrays their per-row sums `[parts, n, b, hq, seq_q_pad]` (`_dq_consumer`;
  shared-tile, each consumer's over its key halves: 2 parts);
  q, dout and dq have `q_rows` rows (TMA reads past them zeros, drops
  writes past them). With `spec.segmented`, `segment_ids` are the query
  rows' key bounds `(lo, hi)` (`segments.key_bounds`): the CTA walks only
  the K/V tiles its rows reach and masks by them.

  `config.dq_consumers` warpgroups, each with its own `block_q` rows, or
  (`dq_head_splits=2`) two sharing one query tile's head dim.
  """
  consumers, shared = config.dq_consumers, config.dq_head_splits == 2
  plan = dq_query_plan(spec, config, seq_q_pad, seq_kv_pad)
  blocks = plan.row_blocks
  cfg = plan.config
  d, dv, st = spec.head_dim, spec.head_dim_v, cfg.num_stages
  # Halves of K/V tiles (a lone consumer) and column halves of dS (shared)
  # need the 64-byte swizzle; both wgmma operands of a GEMM share it.
  narrow = consumers == 1 or shared
  tf_of = lambda width: (
    common.swizzle64(spec.dtype)
    if narrow
    else common.smem_transforms(spec.dtype, width)
  )
  tf = tf_of(d)
  loads = _TILE_LOADS + (2 if spec.segmented else 0)

  def fa3_bwd_dq(refs: dict[str, Any]) -> None:
    seg, tiles = query_walk(spec, refs, TileWalk(plan, plan.num_tiles))
    wg = lax.axis_index("wg")
    if shared:
      for w in range(consumers):
        pl.when(wg == w)(
          functools.partial(_dq_shared_consumer, refs, plan, ops, w, seg)
        )
    else:
      pl.when(wg < consumers)(
        functools.partial(_dq_consumer, refs, plan, ops, seg)
      )

    @pl.when(wg == consumers)
    def _():
      # One query tile per CTA: the forward's K/V producer without a walk.
      kv_producer(
        tuple(
          refs[n]
          for n in ("k", "v", "k_smem", "v_smem", "k_full", "v_full")
          + ("k_empty", "v_empty")
        ),
        tiles,
        registers=common.producer_regs(consumers),
      )

  per_block = lambda width: plgpu.SMEM(
    (blocks, cfg.block_q, width), spec.dtype, transforms=tf_of(width)
  )
  ring = lambda width: plgpu.SMEM(
    (st, cfg.block_kv, width), spec.dtype, transforms=tf_of(width)
  )
  scratch = dict(
    q_smem=per_block(d),
    do_smem=per_block(dv),
    lse_smem=plgpu.SMEM((blocks, cfg.block_q), jnp.float32),
    dl_smem=plgpu.SMEM((blocks, cfg.block_q), jnp.float32),
    k_smem=ring(d),
    v_smem=ring(dv),
    k_full=plgpu.Barrier(num_barriers=st),
    v_full=plgpu.Barrier(num_barriers=st),
    k_empty=plgpu.Barrier(num_arrivals=consumers, num_barriers=st),
    v_empty=plgpu.Barrier(num_arrivals=consumers, num_barriers=st),
    # Q, dO, lse, delta (and the rows' key bounds) per query-row block
    tile_bar=plgpu.Barrier(num_barriers=loads * blocks),
    ds_smem=None,
    xchg=None,
    bounds_smem=None,
  )
  if shared:  # dS by step parity, and the consumers' rendezvous
    scratch.update(
      ds_smem=plgpu.SMEM(
        (2, cfg.block_q, cfg.block_kv), spec.dtype, transforms=tf
      ),
      xchg=plgpu.Barrier(num_arrivals=consumers),
    )
  if spec.segmented:  # the rows' key bounds
    scratch["bounds_smem"] = bounds_scratch(cfg.block_q, blocks)[0]
  out_type = dict(
    dq=jax.ShapeDtypeStruct((spec.batch, q_rows, spec.heads_q, d), spec.dtype)
  )
  scratch["ds_stage"] = scratch["dp_stage"] = None
  n_params = param_count(spec)
  parts = 2 if shared else 1  # consumers summing over one row's keys
  fs = spec.flex
  if fs is not None and fs.bias is not None and fs.bias_grad:  # dS: dbias
    # as `_dq_consumer` (a lone consumer's halves) or each shared one's
    sub = cfg.block_kv // (2 if consumers == 1 or shared else 1)
    # Two staging tiles each where they fit beside the kernel's (d192),
    # else one, stored before it is rewritten (shared-tile d256)
    size = jnp.dtype(ds_dtype).itemsize
    tile_bytes = blocks * parts * cfg.block_q * sub * size
    base = backward_kernel_smem_bytes(config, d, spec.dtype.itemsize, dv)["dq"]
    base += blocks * parts * n_params * cfg.block_q * 4  # (`dp_stage`)
    n_ds = 2 if base + 2 * tile_bytes <= MAX_SMEM_BYTES else 1
    if base + tile_bytes > MAX_SMEM_BYTES:
      raise NotImplementedError(
        f"bias with {config} at d={d}: its dS staging tile ({tile_bytes} B)"
        f" does not fit beside the dQ kernel's {base} B of shared memory"
      )
    scratch["ds_stage"] = plgpu.SMEM(
      (blocks * parts, n_ds, cfg.block_q, sub),
      ds_dtype,
      transforms=common.smem_transforms(ds_dtype, sub),
    )
    out_type["dbias"] = jax.ShapeDtypeStruct(
      (spec.batch, spec.heads_q, seq_q_pad, plan.num_kv_blocks * cfg.block_kv),
      ds_dtype,
    )
  if n_params:  # per row, each floating array's sum (`_dq_consumer`)
    scratch["dp_stage"] = plgpu.SMEM(
      (blocks * parts, n_params, cfg.block_q), jnp.float32
    )
    out_type["dparams"] = jax.ShapeDtypeStruct(
      (parts, n_params, spec.batch, spec.heads_q, seq_q_pad), jnp.float32
    )
  inputs = ["q", "k", "v", "do", "lse", "dl"] + ["lo", "hi", "spans"] * (
    spec.segmented
  )
  inputs += list(flex_names)  # flex_tile.kernel_operands'
  kernel = common.build_kernel(
    fa3_bwd_dq,
    inputs=inputs,
    optional=[
      n
      for n in ("lo", "hi", "spans", "bm_spans", "dbias", "dparams")
      if n not in inputs and n not in out_type
    ],
    out_type=out_type,
    scratch=scratch,
    grid=(spec.heads_q, plan.num_q_tiles, spec.batch),
    grid_names=("heads", "q_tiles", "batch"),
    warpgroups=consumers + 1,
    interpret=interpret,
  )

  def run(*args: jax.Array, segment_ids: Any = None, flex: tuple = ()) -> tuple:
    extra = () if segment_ids is None else id_operands(plan, *segment_ids)
    return tuple(kernel(*args, *extra, *flex))

  return run
