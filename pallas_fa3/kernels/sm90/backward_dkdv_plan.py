"""The dK/dV kernel's plan (static facts of one instance), its tile
helpers and its producer warpgroup (`backward_dkdv` builds the kernel).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa3 import masking
from pallas_fa3.kernels.sm90 import compat
from pallas_fa3.kernels.sm90.common import producer_regs
from pallas_fa3.kernels.sm90.config import Sm90BackwardConfig
from pallas_fa3.kernels.sm90.config_backward import fused_dq_cols
from pallas_fa3.kernels.sm90.segment_operands import cta_span, tile_index
from pallas_fa3.spec import AttentionSpec


@dataclasses.dataclass(frozen=True)
class DkdvPlan:
  """Static facts of one dK/dV kernel instance (padded lengths included)."""

  spec: AttentionSpec
  config: Sm90BackwardConfig
  seq_q_pad: int
  seq_kv_pad: int
  # The fused kernel (`backward_fused`): dQ by reduce-add as well.
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


def own_kv_tile(refs: tuple, plan: DkdvPlan, w: Any) -> tuple:
  """Loads consumer `w`'s K/V tile (`block_kv` keys, as head-dim chunks
  `[splits, block_kv, chunk]`) and waits for it. `refs` are (k_ref, v_ref,
  k_smem, v_smem, kv_bar). Returns (its first key, its global rows, its K
  chunks, its V chunks)."""
  k_ref, v_ref, k_smem, v_smem, kv_bar = refs
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
  plan: DkdvPlan, kv0: Any, seg: Any = None
) -> tuple[jax.Array, jax.Array]:
  """(first query tile, query tiles per head) that see any of the CTA's
  keys `[kv0, kv0 + kv_rows_per_cta)`; the others (causal diagonal, window,
  and with segment ids `seg` other documents) are skipped. The count may
  be 0: no row sees these keys."""
  spec, bq, nq = plan.spec, plan.config.block_q, plan.num_q_blocks
  if seg is not None:  # spans of bounds with the positions folded in
    batch = lax.axis_index("batch")
    first, end = cta_span(seg, batch, tile_index(kv0, plan.kv_rows_per_cta))
  else:
    first, end = masking.q_block_range(
      spec, kv0, kv0 + plan.kv_rows_per_cta, bq, nq
    )
  first = jnp.asarray(first, jnp.int32)
  return first, jnp.maximum(jnp.asarray(end, jnp.int32) - first, 0)


def dkdv_producer(refs: tuple, plan: DkdvPlan, seg: Any = None) -> None:
  """Streams Q, dO, lse and delta tiles of every visible query tile of every
  query head of the group."""
  (
    q_ref,
    do_ref,
    lse_ref,
    dl_ref,
    q_smem,
    do_smem,
    lse_smem,
    dl_smem,
    full,
    empty,
  ) = refs
  spec, cfg = plan.spec, plan.config
  plgpu.set_max_registers(producer_regs(cfg.dkdv_consumers), action="decrease")
  batch, kv_head = lax.axis_index("batch"), lax.axis_index("heads")
  cta_kv0, _ = cta_position(plan)
  first, per_head = q_tile_range(plan, cta_kv0, seg)
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
    copy_chunks(q_ref, tile, q_smem.at[slot], full[0].at[slot], plan, False)
    copy_chunks(do_ref, tile, do_smem.at[slot], full[1].at[slot], plan, True)
    plgpu.copy_gmem_to_smem(
      lse_ref.at[row], lse_smem.at[slot], full[2].at[slot]
    )
    plgpu.copy_gmem_to_smem(dl_ref.at[row], dl_smem.at[slot], full[3].at[slot])

  @pl.loop(jnp.maximum(steps - stages, 0), steps)
  def _drain(t):
    plgpu.barrier_wait(empty.at[lax.rem(t, stages)])
