"""The sm90 dK/dV kernel, fused with dQ or not (`fa3_bwd_dkdv`): the
default backward (`deterministic=False`) runs it fused, FA3's five GEMMs
per (query tile, key tile) pair with the float32 dQ tile TMA-reduce-added
into an accumulator (`DqSink`); deterministic calls run it beside the dQ
kernel (`backward_dq`). Parallel over (kv head, K/V tile, batch, head-dim
chunk): consumer warpgroups hold K/V tiles and float32 dK, dV (or, in the
shared layout of d = 128, 192, 256, one K/V tile whose head dim they split,
exchanging P and dS through shared memory); the producer streams Q, dO, lse
and delta tiles of every query head of the GQA group. Its plan
(`DkdvPlan`), producer, consumers and build are here.
docs/design_notes.md#backward-kernels
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

from pallas_fa3 import masking
from pallas_fa3.kernels.sm90 import compat, flex_tile, scores
from pallas_fa3.kernels.sm90.common import (
  SegmentRefs,
  build_kernel,
  consumer_regs,
  consumer_release,
  cta_span,
  dkdv_operands,
  load_bounds,
  producer_regs,
  smem_transforms,
  swizzle64,
  tile_index,
  tile_span,
)
from pallas_fa3.kernels.sm90.config import Sm90BackwardConfig
from pallas_fa3.kernels.sm90.config_backward import fused_dq_cols
from pallas_fa3.kernels.sm90.ops import KernelOps, SmemA
from pallas_fa3.spec import AttentionSpec

# From this head dim on, the dK/dV kernel walks every query tile of a block
# mask's keys (masked): the span's two loaded scalars stay live through the
# loop (a computed range is rematerialized) and spill 40/24 B at d256 (the
# sm_90a compile; 0 at d64-d192).
SPANLESS_HEAD_DIM = 256


def group_zero(spec: AttentionSpec, step: Any) -> Any:
  """0, as an index for the consumers' K and V tiles. With a GQA group (a
  loop over its query heads around the steps) it is `step >> 31` (steps
  count from 0), a zero the compiler cannot prove: the K/V wgmma
  descriptors then stay one add from a base per step instead of being
  hoisted out of both loops, where they spilled (d128: 72-100 B causal;
  benchmarks/RESULTS.md, issue 43). Without a group, the Python 0."""
  return lax.shift_right_arithmetic(step, 31) if spec.group_size > 1 else 0


@dataclasses.dataclass(frozen=True)
class DkdvPlan:
  """Static facts of one dK/dV kernel instance (padded lengths included)."""

  spec: AttentionSpec
  config: Sm90BackwardConfig
  seq_q_pad: int
  seq_kv_pad: int
  # The fused kernel (`fused_consumer`): dQ by reduce-add as well.
  fused: bool = False

  @property
  def num_q_blocks(self) -> int:
    return self.seq_q_pad // self.config.block_q

  @property
  def shared(self) -> bool:
    """Two consumers share one K/V tile, each owning half of dK/dV's head
    dim; else each consumer owns its K/V tile (and a split is across CTAs)."""
    return self.config.dkdv_consumers == 2 and self.splits == 2

  @property
  def walks_block_mask_spans(self) -> bool:
    """Whether the walk skips a block mask's empty query tiles: not from
    `SPANLESS_HEAD_DIM` on (`flex_tile.kernel_operands`' `bm_qspans`)."""
    return max(self.spec.head_dim, self.spec.head_dim_v) < SPANLESS_HEAD_DIM

  @property
  def kv_rows_per_cta(self) -> int:
    return self.config.block_kv * (
      1 if self.shared else self.config.dkdv_consumers
    )

  @property
  def cta_splits(self) -> int:
    """CTAs per K/V tile (head-dim chunks split across CTAs)."""
    return 1 if self.shared else self.splits

  @property
  def splits(self) -> int:
    """Head-dim chunks of dK and dV (`config.dkdv_head_splits`)."""
    return self.config.dkdv_head_splits

  @property
  def q_halves(self) -> int:
    """Query tiles are taken in 2 halves by CTA-split (register-tight) configs."""
    return 2 if self.cta_splits > 1 else 1

  @property
  def kv_ctas(self) -> int:
    """CTAs along the keys (times `cta_splits` in the grid)."""
    return self.seq_kv_pad // self.kv_rows_per_cta

  @property
  def dq_cols(self) -> int:
    """Head-dim columns of one consumer's dQ tile (fused)."""
    return fused_dq_cols(
      self.config, self.spec.head_dim, self.spec.dtype.itemsize
    )

  @property
  def dq_by_cols(self) -> bool:
    """Fused: each consumer adds dQ for its share of the head dim over all
    of the CTA's keys (after exchanging dS); else the whole head dim over
    its own keys."""
    return self.dq_cols < self.spec.head_dim

  @property
  def dq_parts(self) -> int:
    """dQ tiles per CTA and query tile that cover the same columns."""
    return 1 if self.dq_by_cols else self.config.dkdv_consumers

  @property
  def chunk(self) -> int:
    """Head-dim columns of K, Q and dK in one chunk (`head_dim / splits`)."""
    return self.spec.head_dim // self.splits

  @property
  def chunk_v(self) -> int:
    """Head-dim columns of V, dO and dV in one chunk (`head_dim_v /
    splits`)."""
    return self.spec.head_dim_v // self.splits

  def width(self, of_v: bool) -> int:
    """`chunk_v` for V, dO, dV tiles, else `chunk`."""
    return self.chunk_v if of_v else self.chunk


def cta_position(plan: DkdvPlan) -> tuple[jax.Array, jax.Array]:
  """(first key row of the CTA, head-dim chunk it accumulates)."""
  index = lax.axis_index("kv_tiles")
  tile, chunk = lax.div(index, plan.cta_splits), lax.rem(index, plan.cta_splits)
  return tile * plan.kv_rows_per_cta, chunk


def copy_chunks(
  ref: Any, tile: tuple, dst: Any, barrier: Any, plan: DkdvPlan, of_v: bool
) -> None:
  """TMA of the `[rows, head_dim(_v)]` tile `ref[tile]` (`of_v`: V or dO)
  as `splits` column chunks into `dst[c]`, all arriving on `barrier`
  (`splits` arrivals)."""
  width = plan.width(of_v)
  for c in range(plan.splits):
    cols = pl.ds(c * width, width)
    plgpu.copy_gmem_to_smem(
      ref.at[tile + (cols,)], dst.at[c], barrier, oob_mode=compat.ZERO_FILL
    )


# The kernel's operands, the tiles its producer streams (and their shared
# memory), and what every consumer reads, by name.
_INPUTS = ("q", "k", "v", "do", "lse", "dl")
_STREAMED = (
  "q", "do", "lse", "dl", "q_smem", "do_smem", "lse_smem", "dl_smem",
)  # fmt: skip
_CONSUMED = (
  "k", "v", "dk", "dv", "k_smem", "v_smem", "q_smem", "do_smem", "lse_smem",
  "dl_smem", "full", "empty", "kv_bar",
)  # fmt: skip


def own_kv_tile(refs: dict[str, Any], plan: DkdvPlan, w: Any) -> tuple:
  """Loads consumer `w`'s K/V tile (`block_kv` keys, as head-dim chunks
  `[splits, block_kv, chunk]`) and waits for it. Returns (its first key,
  its global rows, its K chunks, its V chunks)."""
  k_ref, v_ref, k_smem, v_smem, kv_bar = (
    refs[n] for n in ("k", "v", "k_smem", "v_smem", "kv_bar")
  )
  consumers, block_kv = plan.config.dkdv_consumers, plan.config.block_kv
  batch, kv_head = lax.axis_index("batch"), lax.axis_index("heads")
  cta_kv0, _ = cta_position(plan)
  kv0 = cta_kv0 + w * block_kv
  rows = (batch, pl.ds(kv0, block_kv), kv_head)
  my_k, my_v = k_smem.at[w], v_smem.at[w]
  copy_chunks(k_ref, rows, my_k, kv_bar.at[w], plan, of_v=False)
  copy_chunks(v_ref, rows, my_v, kv_bar.at[consumers + w], plan, of_v=True)
  plgpu.barrier_wait(kv_bar.at[w])
  plgpu.barrier_wait(kv_bar.at[consumers + w])
  return kv0, rows, my_k, my_v


def store_dkdv(
  plan: DkdvPlan, dk: Any, dv: Any, staging: tuple, dst: tuple
) -> None:
  """Writes float32 dK (scaled) and dV in the input dtype through the
  shared `staging` tiles (K, V tiles no longer read) to the global `dst`
  tiles, and waits for the stores."""
  out_k, out_v = staging
  out_v[...] = dv.astype(plan.spec.dtype)
  out_k[...] = (dk * jnp.float32(plan.spec.softmax_scale)).astype(
    plan.spec.dtype
  )
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out_k, dst[0])
  plgpu.copy_smem_to_gmem(out_v, dst[1])
  plgpu.wait_smem_to_gmem(0)


def q_tile_range(
  plan: DkdvPlan, kv0: Any, seg: Any = None, bm_spans: Any = None
) -> tuple[jax.Array, jax.Array]:
  """(first query tile, query tiles per head) that see any of the CTA's
  keys `[kv0, kv0 + kv_rows_per_cta)`; the others (causal diagonal, window,
  with segment ids `seg` other documents, and outside a block mask's span
  `bm_spans`, `flex_tile.kernel_operands`' `bm_qspans`) are skipped. The
  count may be 0: no row sees these keys."""
  spec, bq, nq = plan.spec, plan.config.block_q, plan.num_q_blocks
  batch, cta = lax.axis_index("batch"), tile_index(kv0, plan.kv_rows_per_cta)
  if seg is not None:  # spans of bounds with the positions folded in
    first, end = cta_span(seg, batch, cta)
  else:
    first, end = masking.q_block_range(
      spec, kv0, kv0 + plan.kv_rows_per_cta, bq, nq
    )
  if bm_spans is not None:  # the group's non-empty tiles of a block mask
    span = tile_span(bm_spans, batch, cta, lax.axis_index("heads"))
    first, end = jnp.maximum(first, span[0]), jnp.minimum(end, span[1])
  first = jnp.asarray(first, jnp.int32)
  return first, jnp.maximum(jnp.asarray(end, jnp.int32) - first, 0)


def unmasked_from(
  plan: DkdvPlan, kv0: Any, first: Any, end: Any, seg: Any
) -> Any:
  """FA3's causal split of a consumer's query tiles `[first, end)`: the
  first that sees every key of its tile from `kv0` (the steps from it on
  need no mask), or None where the split does not apply (a window, an
  offset that is not a whole number of tiles, segment ids, flex or a GQA
  group: those spilled or gained nothing, RESULTS issue 43)."""
  spec, cfg = plan.spec, plan.config
  if not (
    spec.causal
    and spec.window_size is None
    and all(spec.causal_offset % t == 0 for t in (cfg.block_q, cfg.block_kv))
    and seg is None
    and spec.flex is None
    and spec.group_size == 1
  ):
    return None
  lo, _ = masking.q_blocks_unmasked(  # no left window: the rest
    spec, kv0, kv0 + cfg.block_kv, cfg.block_q, plan.num_q_blocks
  )
  return jnp.clip(lo, first, end)


def dkdv_producer(
  refs: dict[str, Any], plan: DkdvPlan, seg: Any = None
) -> None:
  """Streams Q, dO, lse and delta tiles of every visible query tile of every
  query head of the group."""
  q_ref, do_ref, lse_ref, dl_ref, q_smem, do_smem, lse_smem, dl_smem = (
    refs[n] for n in _STREAMED
  )
  empty = refs["empty"]
  full = refs["full"] * (4 // len(refs["full"]))  # fused: one for all four
  spec, cfg = plan.spec, plan.config
  plgpu.set_max_registers(producer_regs(cfg.dkdv_consumers), action="decrease")
  batch, kv_head = lax.axis_index("batch"), lax.axis_index("heads")
  cta_kv0, _ = cta_position(plan)
  first, per_head = q_tile_range(plan, cta_kv0, seg, refs.get("bm_qspans"))
  steps = spec.group_size * per_head
  stages = cfg.num_stages

  # `stages` more turns than loads: the last ones only wait for the last
  # slots' releases (the drain inside the loop: after it, the empty
  # barriers' address stayed live through the loop and spilled from the
  # producer's 24 registers, d128 with softcap or a causal split).
  @pl.loop(0, steps + stages)
  def _load(t):
    slot = lax.rem(t, stages)

    @pl.when(t >= stages)
    def _():
      plgpu.barrier_wait(empty.at[slot])

    @pl.when(t < steps)
    def _():
      head = kv_head * spec.group_size + lax.div(t, per_head)
      q0 = (first + lax.rem(t, per_head)) * cfg.block_q
      tile = (batch, pl.ds(q0, cfg.block_q), head)
      row = (batch, head, pl.ds(q0, cfg.block_q))
      copy_chunks(q_ref, tile, q_smem.at[slot], full[0].at[slot], plan, False)
      copy_chunks(do_ref, tile, do_smem.at[slot], full[1].at[slot], plan, True)
      plgpu.copy_gmem_to_smem(
        lse_ref.at[row], lse_smem.at[slot], full[2].at[slot]
      )
      plgpu.copy_gmem_to_smem(
        dl_ref.at[row], dl_smem.at[slot], full[3].at[slot]
      )


def dkdv_consumer(
  refs: dict[str, Any], plan: DkdvPlan, ops: KernelOps, seg: Any = None
) -> None:
  """A consumer owning its K/V tile: dK, dV (chunk `chunk`) over its steps
  (`seg`: segment ids' `SegmentRefs`, per-key query bounds)."""
  (
    k_ref, v_ref, dk_ref, dv_ref, k_smem, v_smem, q_smem, do_smem, lse_smem,
    dl_smem, full, empty, kv_bar,
  ) = (refs[n] for n in _CONSUMED)  # fmt: skip
  spec, cfg = plan.spec, plan.config
  consumers = cfg.dkdv_consumers
  plgpu.set_max_registers(consumer_regs(consumers), action="increase")
  cta_kv0, chunk = cta_position(plan)
  # K, V tiles as head-dim chunks [splits, block_kv, chunk]: S^T and dP^T
  # contract over all of them, dK and dV are accumulated for chunk `chunk`.
  wg = lax.axis_index("wg")
  kv0, rows, my_k, my_v = own_kv_tile(refs, plan, wg)
  k_chunks = [my_k.at[c] for c in range(plan.splits)]
  v_chunks = [my_v.at[c] for c in range(plan.splits)]
  bounds = None
  if seg is not None:  # my keys' query bounds, as per-row vectors
    bounds = load_bounds(
      seg, ops, lax.axis_index("batch"), kv0, cfg.block_kv, as_rows=True
    )

  first, per_head = q_tile_range(plan, cta_kv0, seg, refs.get("bm_qspans"))
  # CTA-split head dims take each query tile in halves of `block_q / 2`
  # rows (64-byte swizzle: a half is a whole wgmma K step).
  halves = plan.q_halves
  sub = cfg.block_q // halves
  shape = (cfg.block_kv, sub)
  # A score_mod's floating arrays read by key position: per key (my rows),
  # the sum over queries of dL/d(its output) times its derivative in each
  # (`flex_tile.param_grad_axes`), per query head.
  mine = () if plan.fused else flex_tile.kernel_params(spec, "dkdv")
  # S^T and dP^T in flight together (tokamax's order: d128 B-lock 1.12 ->
  # 1.03 of tokamax's) hold both tiles: with segment ids' bounds (32-40 B),
  # a softcap's tanh (4 B), a causal or window mask (4-8 B at 8 heads) or
  # a user's function beside them it spilled, so those keep S^T alone
  # first (RESULTS, issue 66).
  early_dp = (
    seg is None
    and spec.softcap is None
    and spec.flex is None
    and not spec.masked
  )

  def part(qi, h, slot, carry, masked, group_head, accs=None, release=None):
    dk, dv, sums = carry
    rows_h = pl.ds(h * sub, sub)
    q_parts = [q_smem.at[slot, c].at[rows_h] for c in range(plan.splits)]
    do_parts = [do_smem.at[slot, c].at[rows_h] for c in range(plan.splits)]
    k_parts, v_parts = k_chunks, v_chunks
    if spec.group_size > 1:  # K, V per step (`group_zero`)
      z = group_zero(spec, qi)
      k_parts = [k_smem.at[wg + z, c] for c in range(plan.splits)]
      v_parts = [v_smem.at[wg + z, c] for c in range(plan.splits)]
    q0 = qi * cfg.block_q + h * sub
    head = lax.axis_index("heads") * spec.group_size + group_head

    def probabilities(s_t):
      """P^T (rounded), P^T times the score's derivative (rounded) and a
      score_mod's derivatives in its arrays, from S^T = K Q^T [block_kv,
      sub]."""
      # Causal/window only: padded keys' rows of dK, dV are sliced off.
      at = scores.At(
        q0, kv0, q_axis=1, masked=masked,
        bounds=None if bounds is None else (*bounds, 0), check_seq_kv=False,
        flex=(refs, lax.axis_index("batch"), head),
      )  # fmt: skip
      lse_t = lambda: ops.load_cols(lse_smem.at[slot].at[rows_h])
      p_t, ctx, *d_params = scores.probabilities(
        ops, spec, s_t, lse_t, at, params=bool(mine)
      )
      d_params = d_params[0] if mine else None
      # Softcap: dS^T takes P^T (1 - t^2), rounded like P^T (and a
      # score_mod's derivative).
      pg_t = None
      if ctx is not None:
        pg_t = scores.times_derivative(p_t, ctx).astype(spec.dtype)
      p_t = p_t.astype(spec.dtype)  # only the rounded P^T stays live
      pg_t = p_t if pg_t is None else pg_t
      return p_t, pg_t, d_params

    def ds_and_sums(p_t, pg_t, d_params, dp_t):
      """dS^T (rounded) from dP^T = V dO^T, and the arrays' sums."""
      delta = ops.load_cols(dl_smem.at[slot].at[rows_h])
      dp_t = dp_t - lax.broadcast_in_dim(delta, shape, [1])
      ds_t = (pg_t.astype(jnp.float32) * dp_t).astype(spec.dtype)
      # dS before the score_mod's own derivative, times each's
      pre = p_t.astype(jnp.float32) * dp_t if mine else None
      return (ds_t,) + tuple(
        a + (pre * d_params[j]).sum(axis=1) for a, j in zip(sums, mine)
      )

    do_chunk = do_smem.at[slot, chunk].at[rows_h]
    if accs is not None:  # `pipelined` (no mask): dK's GEMM left in flight
      dk_acc, dv_acc = accs

      def grads_p(read_s, read_dp):
        s_t = read_s()  # also waits for the last step's dK
        release()
        p_t, pg_t, d_params = probabilities(s_t)
        dv_new = ops.mma(dv_acc, p_t, do_chunk)
        dp_t = read_dp(wait_n=1)
        return dv_new, ds_and_sums(p_t, pg_t, d_params, dp_t)[0]

      dv_acc, ds_t = ops.score_pair(
        (k_parts, q_parts), (v_parts, do_parts), grads_p
      )
      ops.mma_wait(0)  # dV: only dK (and dS^T) in flight into the next step
      dk_acc = ops.mma(dk_acc, ds_t, q_smem.at[slot, chunk].at[rows_h])
      return dk_acc, dv_acc
    if early_dp:
      # dP^T issued right after S^T: its GEMM runs under P's exp2, and dP^T
      # is read at depth 1 under P^T dO (dV), dS^T under dS^T Q (dK).
      def grads(read_s, read_dp):
        p_t, pg_t, d_params = probabilities(read_s())
        return ops.accumulate_pv_then(
          dv,
          p_t,
          do_chunk,
          lambda: ds_and_sums(p_t, pg_t, d_params, read_dp(wait_n=1)),
          (ops.tile(jnp.zeros(shape, spec.dtype)),) + sums,
        )

      dv, (ds_t, *new_sums) = ops.score_pair(
        (k_parts, q_parts), (v_parts, do_parts), grads
      )
    else:  # S^T alone; dP^T issued and waited for after P^T dO
      p_t, pg_t, d_params = probabilities(ops.scores(k_parts, q_parts))
      dv = ops.accumulate_pv(dv, p_t, do_chunk)
      ds_t, *new_sums = ds_and_sums(
        p_t, pg_t, d_params, ops.scores(v_parts, do_parts)
      )
    dk = ops.accumulate_pv(dk, ds_t, q_smem.at[slot, chunk].at[rows_h])
    return dk, dv, tuple(new_sums)

  def step(qi, carry, *, base, masked, group_head):
    slot = lax.rem(base + qi - first, cfg.num_stages)
    for bar in full:
      plgpu.barrier_wait(bar.at[slot])
    for h in range(halves):
      carry = part(qi, h, slot, carry, masked, group_head)
    # lse and delta were read by ordinary loads (generic proxy) and TMA
    # refills the slot: a proxy fence orders the two before the release.
    plgpu.commit_smem()
    plgpu.barrier_arrive(empty.at[slot])
    return carry

  end = first + per_head

  def per_group_head(h, carry):
    base = h * per_head
    zero_rows = lambda: ops.rows(jnp.zeros((cfg.block_kv,), jnp.float32))
    # Causal/window: every step masks (exact on visible tiles too); a
    # separate masked loop spilled (docs/design_notes.md#backward-kernels);
    # `pipelined` below splits the plain causal calls.
    dk, dv, sums = lax.fori_loop(
      first,
      end,
      functools.partial(step, base=base, masked=spec.masked, group_head=h),
      carry + (tuple(zero_rows() for _ in mine),),
    )
    if mine:  # this head's sums, out through shared memory
      stage = refs["dp_stage"].at[wg]
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last head's
      for i, row_sums in enumerate(sums):
        stage.at[i][...] = row_sums
      plgpu.commit_smem()
      head = lax.axis_index("heads") * spec.group_size + h

      @pl.when(chunk == 0)  # (CTA-split head dims: every chunk has them)
      def _():
        for i in range(len(mine)):
          plgpu.copy_smem_to_gmem(
            stage.at[i],
            refs["dparams"].at[
              0, i, lax.axis_index("batch"), head, pl.ds(kv0, cfg.block_kv)
            ],
          )

    return dk, dv

  # One query head a K/V head, whole query tiles, no flex, softcap or
  # segment ids: the unmasked steps keep dK's GEMM in flight into the next
  # step, whose S^T wait covers it before the last step's slot is released
  # (tokamax's order; d128 B-lock 1.03 -> 0.99 of tokamax's not causal,
  # 1.11 -> 1.00 causal, RESULTS), instead of a wait for dK at the end of
  # every step. With a mask, only FA3's causal split (`unmasked_from`):
  # the diagonal's masked steps first, waited, in the loop above.
  pipelined = (
    seg is None
    and spec.softcap is None
    and spec.flex is None
    and not plan.fused
    and spec.group_size == 1
    and halves == 1
  )
  start = first
  if pipelined and spec.masked:
    start = unmasked_from(plan, kv0, first, end, seg)
    pipelined = start is not None

  def pipelined_steps(accs):
    stages = cfg.num_stages

    def step_p(qi, accs, prev):  # prev: the last step's slot (-1: none)
      slot = lax.rem(qi - first, stages)
      for bar in full:
        plgpu.barrier_wait(bar.at[slot])

      def release():  # the last step's slot: its dK GEMM is done
        @pl.when(prev >= 0)
        def _():
          plgpu.commit_smem()  # lse, delta read by ordinary loads
          plgpu.barrier_arrive(empty.at[prev])

      accs = part(qi, 0, slot, (None, None, ()), False, 0, accs, release)
      return accs, slot

    # The last slot carried out of the loop (recomputed after it, its
    # operands stayed live through the loop and spilled 4 B at 8 heads).
    accs, last = ops.accumulating_loop(start, end, step_p, accs, jnp.int32(-1))
    ops.mma_wait(0)

    @pl.when(last >= 0)
    def _():
      plgpu.commit_smem()
      plgpu.barrier_arrive(empty.at[last])

    return accs

  zeros = lambda w: ops.tile(jnp.zeros((cfg.block_kv, w), jnp.float32))
  if pipelined:
    dk, dv, _ = lax.fori_loop(  # the masked diagonal (causal), waited
      first,
      start,
      functools.partial(step, base=0, masked=True, group_head=0),
      (zeros(plan.chunk), zeros(plan.chunk_v), ()),
    )
    dk, dv = ops.with_accumulators((dk, dv), pipelined_steps)
  else:
    dk, dv = lax.fori_loop(
      0,
      spec.group_size,
      per_group_head,
      (zeros(plan.chunk), zeros(plan.chunk_v)),
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
  refs: dict[str, Any],
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
    k_ref, v_ref, dk_ref, dv_ref, k_smem, v_smem, q_smem, do_smem, lse_smem,
    dl_smem, full, empty, kv_bar,
  ) = (refs[n] for n in _CONSUMED)  # fmt: skip
  p_smem, ds_smem, xchg = refs["p_smem"], refs["ds_smem"], refs["xchg"]
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

  first, per_head = q_tile_range(plan, kv0, seg, refs.get("bm_qspans"))
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
      at = scores.At(
        qi * cfg.block_q, kv0 + w * half, masked=spec.masked, bounds=bounds,
        check_seq_kv=False, flex=(refs, batch, kv_head * spec.group_size + h),
      )  # fmt: skip
      p, t = scores.probabilities(
        ops, spec, read_s(), ops.load_rows(lse_smem.at[slot]), at
      )
      pg = None
      if t is not None:
        pg = scores.times_derivative(p, t).astype(spec.dtype)
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


def sink_scratch(
  plan: DkdvPlan, interpreted: bool, transforms: tuple
) -> dict[str, Any]:
  """Shared memory of the fused kernel's dQ: staging tiles per consumer;
  own layout: dS^T tiles by step parity (in K's `transforms`: one wgmma
  reads both); the interpreter's exchange barrier."""
  cfg, consumers = plan.config, plan.config.dkdv_consumers
  scratch = dict(
    dq_smem=plgpu.SMEM(
      (consumers, cfg.block_q, plan.dq_cols),
      jnp.float32,
      transforms=smem_transforms(jnp.float32, plan.dq_cols),
    ),
  )
  if not plan.shared:
    scratch["dst_smem"] = plgpu.SMEM(
      (2, consumers, cfg.block_kv, cfg.block_q),
      plan.spec.dtype,
      transforms=transforms,
    )
    if interpreted and plan.dq_by_cols:
      scratch["dq_xchg"] = plgpu.Barrier(num_arrivals=consumers)
  return scratch


def fused_consumer(
  refs: dict[str, Any],
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
    k_ref, v_ref, dk_ref, dv_ref, k_smem, v_smem, q_smem, do_smem, lse_smem,
    dl_smem, full, empty, kv_bar,
  ) = (refs[n] for n in _CONSUMED)  # fmt: skip
  spec, cfg, ops = plan.spec, plan.config, sink.ops
  consumers = cfg.dkdv_consumers
  plgpu.set_max_registers(consumer_regs(consumers), action="increase")
  batch, kv_head = lax.axis_index("batch"), lax.axis_index("heads")
  cta_kv0, _ = cta_position(plan)
  kv0, rows, k_chunks, v_chunks = own_kv_tile(refs, plan, w)
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

  first, per_head = q_tile_range(plan, cta_kv0, seg, refs.get("bm_qspans"))
  shape = (cfg.block_kv, cfg.block_q)
  cols = pl.ds(w * plan.dq_cols, plan.dq_cols)
  # dQ = dS K: over both consumers' keys for my columns, or over mine.
  sources = range(consumers) if plan.dq_by_cols else (w,)

  def step(qi, carry, *, h, masked):
    dk, dv = carry
    t = h * per_head + qi - first
    slot, buf = lax.rem(t, cfg.num_stages), lax.rem(t, 2)
    for bar in full:
      plgpu.barrier_wait(bar.at[slot])
    q_tile, do_tile = q_smem.at[slot, 0], do_smem.at[slot, 0]

    def grads(read_s, read_dp):
      # flex: a mask_mod, a block mask, a score_mod (its derivative in
      # t_t); no bias or learnable arrays (`fused_flex_unsupported`).
      at = scores.At(
        qi * cfg.block_q, kv0, q_axis=1, masked=masked, bounds=bounds,
        check_seq_kv=False, flex=(refs, batch, kv_head * spec.group_size + h),
      )  # fmt: skip
      p_t, t_t = scores.probabilities(
        ops, spec, read_s(), ops.load_cols(lse_smem.at[slot]), at
      )
      delta = ops.load_cols(dl_smem.at[slot])
      # P^T (1 - t^2) with softcap, times a score_mod's derivative
      pg_t = scores.times_derivative(p_t, t_t)
      ds_t = pg_t * (read_dp() - lax.broadcast_in_dim(delta, shape, [1]))
      return p_t.astype(spec.dtype), ds_t.astype(spec.dtype)

    z = group_zero(spec, t)  # K, V per step with a GQA group
    k_at = lambda c: k_smem.at[c + z, 0]
    p_t, ds_t = ops.score_pair(
      (k_at(w), q_tile), (v_smem.at[w + z, 0], do_tile), grads
    )

    def exchange():  # my dS^T for the dQ wgmma (mine and the other's)
      ds_smem.at[buf, w][...] = ds_t
      plgpu.commit_smem()  # also fences the lse, delta reads of the slot
      if plan.dq_by_cols:
        sink.rendezvous()

    dq_terms = [
      (2, SmemA(ds_smem.at[buf, c], transposed=True), k_at(c)) for c in sources
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

  # Causal, with a whole number of tiles as its offset: the query tiles
  # that see all of my keys skip the mask in a loop of their own (FA3's
  # split, `unmasked_from`; d128 windows and other offsets spilled 84-452
  # B, a GQA group 88-112 B): elsewhere every step masks in one loop.
  end = first + per_head
  lo = unmasked_from(plan, kv0, first, end, seg)

  def per_group_head(h, carry):
    run = lambda a, b, masked, c: lax.fori_loop(
      a, b, functools.partial(step, h=h, masked=masked), c
    )
    if lo is None:
      return run(first, end, spec.masked, carry)
    carry = run(first, lo, True, carry)
    return run(lo, end, False, carry)

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
  the query tile spans the CTAs walked, `[2, b, kv_ctas]` with segment
  ids, `[2, b, heads_kv, kv_ctas]` with a block mask)."""
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
  # [c, 1, 1]: per CTA, then per batch and query head (1: all)
  starts = jnp.asarray([r[0] for r in ranges], jnp.int32)[:, None, None]
  ends = jnp.asarray([r[1] for r in ranges], jnp.int32)[:, None, None]
  if spans is not None:
    if spans.ndim == 3:  # [2, b, c] -> [2, c, b, 1]
      spans = jnp.moveaxis(spans, 2, 1)[..., None]
    else:  # [2, b, hk, c] -> [2, c, b, hq]
      spans = jnp.repeat(jnp.moveaxis(spans, 3, 1), spec.group_size, axis=3)
    starts = jnp.maximum(starts, spans[0])
    ends = jnp.minimum(ends, spans[1])
  starts = jnp.repeat(starts * bq, plan.dq_parts, axis=0)
  ends = jnp.repeat(ends * bq, plan.dq_parts, axis=0)
  rows = jnp.arange(slab.shape[2], dtype=jnp.int32)[None, None, :, None]
  written = (rows >= starts[:, :, None]) & (rows < ends[:, :, None])
  return jnp.where(written[..., None], slab, 0.0).sum(0)


def _consumers(
  plan: DkdvPlan, ops: KernelOps, refs: dict[str, Any], seg: SegmentRefs | None
) -> None:
  """Runs this warpgroup's consumer (`seg`: segment ids' refs, or None)."""
  consumers, wg = plan.config.dkdv_consumers, lax.axis_index("wg")
  if plan.shared:
    sink = None
    if plan.fused:
      sink = DqSink(plan, ops, refs["dq"], refs["dq_smem"])
    for w in range(consumers):
      pl.when(wg == w)(
        functools.partial(dkdv_shared_consumer, refs, plan, ops, w, sink, seg)
      )
  elif plan.fused:
    sink = DqSink(plan, ops, refs["dq"], refs["dq_smem"], refs["dq_xchg"])
    for w in range(consumers):
      pl.when(wg == w)(
        functools.partial(
          fused_consumer, refs, sink, refs["dst_smem"], plan, w, seg
        )
      )
  else:
    pl.when(wg < consumers)(
      functools.partial(dkdv_consumer, refs, plan, ops, seg)
    )


def dkdv_kernel(
  plan: DkdvPlan,
  ops: KernelOps,
  interpret: Any,
  kv_rows: int,
  flex_names: tuple[str, ...] = (),
) -> Callable[..., Any]:
  """The dK/dV kernel, `(q, k, v, dout, lse2, delta) -> (dk, dv)`, or with
  `plan.fused` `(q, k, v, dout, lse2, delta, dq) -> (dk, dv)` (`dq` a
  float32 `jax.new_ref` accumulator, updated in place) compiled and
  `(q, k, v, dout, lse2, delta) -> (dq_slab, dk, dv)` interpreted
  (`sum_slab`). k, v, dk and dv have `kv_rows` rows (TMA
  reads past them zeros, drops writes). With `spec.segmented` it takes
  `segment_ids=(lo, hi, q_lo, q_hi)`, the query rows' key bounds and the
  keys' query bounds (`segments.key_bounds`, `segments.query_bounds`): a
  CTA walks only the query tiles that reach its keys and masks by them.
  With a score_mod's floating arrays read by key position
  (`flex_tile.kernel_params`), it also returns their per-key sums
  `[1, n, b, hq, seq_kv_pad]` (the dQ kernel's layout, one part)."""
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

  def fa3_bwd_dkdv(refs: dict[str, Any]) -> None:
    # Fused: one "full" barrier per slot for all four loads (one wait).
    refs = dict(refs, full=tuple(refs.pop(n) for n in full_names))
    seg = None
    if spec.segmented:  # the keys' query bounds, read from global memory
      seg = SegmentRefs(refs["lo"], refs["hi"], None, refs["spans"])
    _consumers(plan, ops, refs, seg)

    @pl.when(lax.axis_index("wg") == consumers)
    def _():
      dkdv_producer(refs, plan, seg)

  chunked = lambda n, rows, of_v: plgpu.SMEM(
    (n, splits, rows, plan.width(of_v)),
    spec.dtype,
    transforms=tf_of(plan.width(of_v)),
  )
  scratch = dict(
    k_smem=chunked(kv_tiles, cfg.block_kv, False),
    v_smem=chunked(kv_tiles, cfg.block_kv, True),
    q_smem=chunked(st, cfg.block_q, False),
    do_smem=chunked(st, cfg.block_q, True),
    lse_smem=plgpu.SMEM((st, cfg.block_q), jnp.float32),
    dl_smem=plgpu.SMEM((st, cfg.block_q), jnp.float32),
  )
  # "full" barriers per slot: Q, dO (one TMA per head-dim chunk), lse,
  # delta; fused, one barrier counting all of them.
  if plan.fused:
    full_names = ("full",)
    scratch["full"] = plgpu.Barrier(
      num_arrivals=2 * splits + 2, num_barriers=st
    )
  else:
    full_names = ("q_full", "do_full", "lse_full", "dl_full")
    scratch.update(
      q_full=plgpu.Barrier(num_arrivals=splits, num_barriers=st),
      do_full=plgpu.Barrier(num_arrivals=splits, num_barriers=st),
      lse_full=plgpu.Barrier(num_barriers=st),
      dl_full=plgpu.Barrier(num_barriers=st),
    )
  scratch.update(
    # Slot releases: the fused kernel's arrive once per consumer warpgroup.
    empty=consumer_release(st, consumers)
    if plan.fused
    else plgpu.Barrier(num_arrivals=consumers, num_barriers=st),
    # K, V of each K/V tile (one TMA per head-dim chunk)
    kv_bar=plgpu.Barrier(num_arrivals=splits, num_barriers=2 * kv_tiles),
    p_smem=None,
    ds_smem=None,
    xchg=None,
  )
  if plan.shared:  # P and dS by step parity, and the consumers' rendezvous
    exchange = lambda: plgpu.SMEM(
      (2, cfg.block_q, cfg.block_kv), spec.dtype, transforms=tf
    )
    scratch.update(
      p_smem=exchange(),
      ds_smem=exchange(),
      xchg=plgpu.Barrier(num_arrivals=consumers),
    )
  scratch.update(dict.fromkeys(("dq_smem", "dst_smem", "dq_xchg")))
  if plan.fused:
    scratch.update(sink_scratch(plan, interpret is not None, tf))
  dkdv_out = {
    n: jax.ShapeDtypeStruct((spec.batch, kv_rows, spec.heads_kv, d), spec.dtype)
    for n, d in (("dk", spec.head_dim), ("dv", spec.head_dim_v))
  }
  inputs = list(_INPUTS) + ["lo", "hi", "spans"] * spec.segmented
  inputs += list(flex_names)  # flex_tile.kernel_operands'
  out_type = dkdv_out
  n_params = 0 if plan.fused else len(flex_tile.kernel_params(spec, "dkdv"))
  scratch["dp_stage"] = None
  if n_params:  # per key, each floating array's sum (`dkdv_consumer`)
    if plan.shared:
      raise NotImplementedError(
        "score_mod's floating arrays read by key position in the shared-tile"
        " dK/dV kernel (dkdv_head_splits=2): their gradients"
      )
    scratch["dp_stage"] = plgpu.SMEM(
      (consumers, n_params, cfg.block_kv), jnp.float32
    )
    out_type = dict(
      dkdv_out,
      dparams=jax.ShapeDtypeStruct(
        (1, n_params, spec.batch, spec.heads_q, plan.seq_kv_pad), jnp.float32
      ),
    )
  if plan.fused and interpret is None:  # the accumulator, updated in place
    inputs.append("dq")
  elif plan.fused:  # the slab its tiles are stored to
    slab = (plan.kv_ctas * plan.dq_parts, spec.batch, plan.seq_q_pad)
    slab += (spec.heads_q, spec.head_dim)
    out_type = {"dq": jax.ShapeDtypeStruct(slab, jnp.float32), **dkdv_out}
  optional = ("lo", "hi", "spans", "dq", "bm_qspans", "dparams")
  optional = [n for n in optional if n not in inputs]
  optional = [n for n in optional if n not in out_type]
  kernel = build_kernel(
    fa3_bwd_dkdv,
    inputs=inputs,
    optional=optional,
    out_type=out_type,
    scratch=scratch,
    grid=(spec.heads_kv, plan.kv_ctas * plan.cta_splits, spec.batch),
    grid_names=("heads", "kv_tiles", "batch"),
    warpgroups=consumers + 1,
    interpret=interpret,
    in_place=plan.fused,
  )

  def run(*args: Any, segment_ids: Any = None, flex: tuple = ()) -> Any:
    extra = () if segment_ids is None else dkdv_operands(plan, segment_ids)
    return kernel(*args[:6], *extra, *flex, *args[6:])

  return run
