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
from pallas_fa3.spec import AttentionSpec


@dataclasses.dataclass(frozen=True)
class DkdvPlan:
  """Static facts of one dK/dV kernel instance (padded lengths included)."""

  spec: AttentionSpec
  config: Sm90BackwardConfig
  seq_q_pad: int
  seq_kv_pad: int

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
  def chunk(self) -> int:
    """Head-dim columns of dK, dV one CTA accumulates."""
    return self.spec.head_dim // self.splits


def cta_position(plan: DkdvPlan) -> tuple[jax.Array, jax.Array]:
  """(first key row of the CTA, head-dim chunk it accumulates)."""
  index = lax.axis_index("kv_tiles")
  tile, chunk = lax.div(index, plan.cta_splits), lax.rem(index, plan.cta_splits)
  return tile * plan.kv_rows_per_cta, chunk


def copy_chunks(
  ref: Any, tile: tuple, dst: Any, barrier: Any, plan: DkdvPlan
) -> None:
  """TMA of the `[rows, head_dim]` tile `ref[tile]` as `splits` column
  chunks into `dst[c]`, all arriving on `barrier` (`splits` arrivals)."""
  for c in range(plan.splits):
    cols = pl.ds(c * plan.chunk, plan.chunk)
    plgpu.copy_gmem_to_smem(
      ref.at[tile + (cols,)], dst.at[c], barrier, oob_mode=compat.ZERO_FILL
    )


def first_q_tile(plan: DkdvPlan, kv0: Any) -> jax.Array:
  """The first query tile that sees any of the CTA's keys [kv0, kv0 + rows)
  (earlier ones are skipped: causal)."""
  spec, bq, nq = plan.spec, plan.config.block_q, plan.num_q_blocks
  first = masking.first_q_block_visible(spec, kv0, bq, nq)
  return jnp.asarray(first, jnp.int32)


def dkdv_producer(refs: tuple, plan: DkdvPlan) -> None:
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
  first = first_q_tile(plan, cta_kv0)
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
    copy_chunks(q_ref, tile, q_smem.at[slot], full[0].at[slot], plan)
    copy_chunks(do_ref, tile, do_smem.at[slot], full[1].at[slot], plan)
    plgpu.copy_gmem_to_smem(
      lse_ref.at[row], lse_smem.at[slot], full[2].at[slot]
    )
    plgpu.copy_gmem_to_smem(dl_ref.at[row], dl_smem.at[slot], full[3].at[slot])

  @pl.loop(jnp.maximum(steps - stages, 0), steps)
  def _drain(t):
    plgpu.barrier_wait(empty.at[lax.rem(t, stages)])
