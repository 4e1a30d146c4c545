"""Races fail CI: every interpreted kernel checks itself for a race once it
has run (`compat.fail_on_race`, built into every sm90 kernel), and the
forward kernel's shared-memory layout keeps each consumer's O tile off the
other consumer's Q tile (issue 41: one union of both consumers' tiles laid
O_1 over Q_0 at head_dim_v != head_dim, which interpret mode computed right
and hardware would not)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa3.kernels.sm90 import common, compat, config as sm90_config
from pallas_fa3.kernels.sm90.config import (
  KERNEL_HEAD_DIMS,
  NUM_CONSUMERS,
  SMEM_ALIGN,
)

_TIMEOUT_S = 120


def _two_writers(racy: bool):
  """A two-warpgroup kernel whose warpgroups both write one shared buffer
  (`racy`), or only the first does."""

  def body(refs):
    wg = lax.axis_index("wg")
    smem = refs["smem"]

    @pl.when(wg >= 0 if racy else wg == 0)
    def _():
      smem[...] = jnp.full(smem.shape, 1.0, jnp.float32)

  return common.build_kernel(
    body,
    inputs=(),
    out_type={"o": jax.ShapeDtypeStruct((128,), jnp.float32)},
    scratch={"smem": plgpu.SMEM((128,), jnp.float32)},
    grid=(1,),
    grid_names=("x",),
    warpgroups=2,
    interpret=compat.interpret_params(detect_races=True),
  )


@pytest.mark.timeout(_TIMEOUT_S)
def test_an_interpreted_race_fails_the_call():
  """Nothing for a test to forget: the call itself raises."""
  jax.block_until_ready(_two_writers(racy=False)())
  assert not compat.races_found()
  try:
    with compat.capture_race_report() as report:
      with pytest.raises(Exception, match="found a race in the kernel"):
        jax.block_until_ready(_two_writers(racy=True)())
  finally:
    compat.reset_interpret_state()
  assert "RACE DETECTED" in report.getvalue()


def overlapping_consumers(ranges) -> list[str]:
  """Pairs (consumer w's O, consumer w''s Q, w != w') whose bytes meet."""
  meet = lambda a, b: a.start < b.stop and b.start < a.stop
  return [
    f"O_{w} {o.start}..{o.stop} meets Q_{x} {ranges[x][0].start}.."
    f"{ranges[x][0].stop}"
    for w, (_, o) in enumerate(ranges)
    for x in range(len(ranges))
    if x != w and meet(o, ranges[x][0])
  ]


_PAIRS = list(itertools.product(KERNEL_HEAD_DIMS, KERNEL_HEAD_DIMS))


@pytest.mark.parametrize("d,dv", _PAIRS, ids=[f"{d}-{v}" for d, v in _PAIRS])
def test_no_consumers_o_tile_meets_another_consumers_q_tile(d, dv):
  """Over every config that fits (the autotuning space) at every head-dim
  pair: consumer w's O bytes never meet another consumer's Q bytes (nothing
  orders two consumers there), each tile lies inside its allocation, and
  the layout the estimate charges is the one the ranges describe."""
  space = sm90_config.forward_config_space(d, 2, dv)
  assert space, (d, dv)
  for config in space:
    ranges = sm90_config.forward_qo_ranges(config, d, 2, dv)
    assert len(ranges) == NUM_CONSUMERS
    assert not overlapping_consumers(ranges), (config, ranges)
    for q, o in ranges:
      assert len(q) == config.block_q * d * 2
      assert len(o) == config.block_q * dv * 2
    layout = sm90_config.forward_qo_layout(config, d, 2, dv)
    assert (layout == "shared") == (d == dv), (config, layout)
    if layout == "shared":  # O over its own Q
      assert all(q.start == o.start for q, o in ranges)


def test_the_check_flags_one_union_of_both_consumers_tiles():
  """The layout the kernel had (`RefUnion(tiles(d), tiles(dv))`, members at
  offset 0, consumer w at w x its own tile) fails the check at 192/128 and
  64/128: the check can fail."""
  for d, dv in ((192, 128), (64, 128)):
    bq = 64
    old = [
      (
        range(w * bq * d * 2, (w + 1) * bq * d * 2),
        range(w * bq * dv * 2, (w + 1) * bq * dv * 2),
      )
      for w in range(NUM_CONSUMERS)
    ]
    assert overlapping_consumers(old), (d, dv)


def _one_union_bytes(config, d, dv):
  """The old estimate: one union of both consumers' tiles (2 x block_q x
  max(d, dv)), the rings, the lse rows, Mosaic's reserve, the barriers."""
  align = lambda n: -(-n // SMEM_ALIGN) * SMEM_ALIGN
  bq, bkv, st = config.block_q, config.block_kv, config.num_stages
  return (
    align(NUM_CONSUMERS * bq * max(d, dv) * 2)
    + align(st * bkv * d * 2)
    + align(st * bkv * dv * 2)
    + align(NUM_CONSUMERS * bq * 4)
    + sm90_config.RESERVED_SMEM
    + (4 * st + NUM_CONSUMERS) * sm90_config.BARRIER_BYTES
  )


def test_no_config_needs_more_shared_memory_than_the_one_union():
  """So every config that fit before still fits: separate buffers only
  where they fit, else per-consumer unions of the old union's bytes."""
  for d, dv in _PAIRS:
    for bq, bkv, st in itertools.product(
      sm90_config.BLOCK_Q_CHOICES,
      sm90_config.BLOCK_KV_CHOICES,
      sm90_config.STAGE_CHOICES,
    ):
      config = sm90_config.Sm90ForwardConfig(bq, bkv, st)
      new = sm90_config.forward_smem_bytes(config, d, 2, dv)
      old = _one_union_bytes(config, d, dv)
      layout = sm90_config.forward_qo_layout(config, d, 2, dv)
      if layout == "per_consumer":
        assert new == old, (d, dv, config)
      else:
        assert new <= sm90_config.MAX_SMEM_BYTES or new == old, config
