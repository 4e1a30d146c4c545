"""The forward kernels' persistent grid: which CTA takes which query tile.

The kernels themselves run the walk in interpret mode (`test_sm90_fwd.py`,
`test_fp8_kernel.py`, on 2 CTAs so that each takes several tiles); here,
the tile order and the grid size.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from pallas_fa3.kernels.sm90 import pipeline
from pallas_fa3.kernels.sm90.common import QueryPlan, kv_steps
from pallas_fa3.kernels.sm90.config import Sm90ForwardConfig
from pallas_fa3.spec import AttentionSpec


def _plan(batch, seq_q, seq_kv, heads_q, heads_kv, causal):
  spec = AttentionSpec(
    batch,
    seq_q,
    seq_kv,
    heads_q,
    heads_kv,
    64,
    64,
    jnp.dtype(jnp.bfloat16),
    causal,
    0.125,
  )
  config = Sm90ForwardConfig(64, 64, 2)
  rows = config.rows_per_cta
  return QueryPlan(
    spec,
    config,
    seq_q_pad=-(-seq_q // rows) * rows,
    seq_kv_pad=-(-seq_kv // 64) * 64,
  )


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
  "dims", [(1, 1000, 1000, 4, 2), (2, 300, 700, 3, 1), (3, 128, 128, 1, 1)]
)
def test_every_tile_is_taken_once(dims, causal):
  plan = _plan(*dims, causal)
  coords = [pipeline.tile_coords(plan, t) for t in range(plan.num_tiles)]
  expected = {
    (b, h, i)
    for b in range(plan.spec.batch)
    for h in range(plan.spec.heads_q)
    for i in range(plan.num_q_tiles)
  }
  assert len(coords) == plan.num_tiles == len(expected)
  assert set(coords) == expected


def _steps(plan, q_tile):
  return int(kv_steps(plan, q_tile * plan.rows_per_cta, plan.rows_per_cta)[0])


def test_causal_tiles_come_longest_first():
  plan = _plan(2, 1000, 1200, 4, 2, True)
  lengths = [
    _steps(plan, pipeline.tile_coords(plan, t)[2])
    for t in range(plan.num_tiles)
  ]
  assert lengths == sorted(lengths, reverse=True)
  assert lengths[0] > lengths[-1]  # the order is not trivially flat


def test_non_causal_tiles_go_head_by_head():
  plan = _plan(2, 1000, 1000, 3, 1, False)
  heads = [pipeline.tile_coords(plan, t)[:2] for t in range(plan.num_tiles)]
  n_q = plan.num_q_tiles
  for t in range(plan.num_tiles):
    assert heads[t] == heads[t - t % n_q]  # a head's tiles are consecutive


@pytest.mark.parametrize("interpreted", [True, False])
def test_grid_size(interpreted):
  cap = pipeline.INTERPRET_CTAS if interpreted else pipeline.HOPPER_SMS
  for tiles in (1, 2, 7, 131, 132, 133, 5000):
    assert pipeline.num_ctas(tiles, interpreted) == min(tiles, cap)
