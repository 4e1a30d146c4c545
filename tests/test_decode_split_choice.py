"""The decode kernel's split-KV sized to the work (issue 67 item 3): the
automatic count fills its last wave (the fewest K/V tiles on the busiest
SM, ties to the fewest splits), its reasons as a table, and partials of
the live rows only. docs/decoding.md#split-kv"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_fa3.kernels.sm90 import config_decode as cd
from pallas_fa3.kvcache import make_decode_spec


def _spec(b, n, hq, hk, sq=1, d=128, **kw):
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  return make_decode_spec(
    s(b, sq, hq, d), s(b, n, hk, d), s(b, n, hk, d), cache_seqlens=n - sq,
    causal=True, **kw,
  )  # fmt: skip


SHAPES = [
  (4, 8192, 32, 8),
  (64, 8192, 32, 8),
  (1, 131072, 32, 8),
  (8, 32768, 64, 8),
  (2, 16384, 16, 1),
  (3, 1000, 6, 2),
  (200, 4096, 8, 1),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_count_streams_the_fewest_tiles_on_the_busiest_sm(shape):
  spec = _spec(*shape)
  config = cd.default_decode_config(spec)
  choices = cd.split_choices(spec, config)
  chosen = cd.default_splits(spec, config)
  best = min(c.steps for c in choices)
  pick = choices[chosen - 1]
  assert pick.splits == chosen and pick.steps <= best * 1.02
  # the fewest splits of those as good
  assert all(c.steps > best * 1.02 for c in choices[: chosen - 1])
  assert all(c.tiles >= cd.MIN_SPLIT_TILES for c in choices[1:])
  table = cd.split_table(spec, config)
  assert f"| {chosen} (chosen) | {pick.ctas} |" in table


def test_a_small_batch_fills_one_wave_instead_of_two_and_a_bit():
  """batch 4 x 8 KV heads x 8k (perfcmp's decode case): 4 ranges, 128
  CTAs in 0.97 waves, where 'fill the SMs twice' took 9 (2.18 waves)."""
  spec = _spec(4, 8192, 32, 8)
  config = cd.default_decode_config(spec)
  choices = cd.split_choices(spec, config)
  assert cd.default_splits(spec, config) == 4
  assert choices[3].ctas == 128 and choices[3].steps == 16
  assert choices[8].ctas == 288 and choices[8].steps == 24


@pytest.mark.parametrize(
  "hq,hk,sq,rows",
  [(32, 8, 1, 8), (32, 8, 4, 16), (32, 8, 16, 64), (64, 8, 16, 128),
   (8, 8, 1, 8), (16, 1, 3, 48)],
)  # fmt: skip
def test_partials_hold_the_live_rows_only(hq, hk, sq, rows):
  spec = _spec(2, 1024, hq, hk, sq)
  assert cd.partial_rows(spec) == rows
  config = cd.default_decode_config(spec)
  live = cd.query_tiles(spec) * 64 if rows >= 64 else rows
  per_split = 2 * cd.grid_heads(spec) * live * (128 + 1) * 4
  assert cd.split_choices(spec, config)[0].partial_bytes == per_split
