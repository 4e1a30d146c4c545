"""The kernels' tile masks agree with the one masking rule."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_fa3 import masking
from pallas_fa3.spec import make_spec


@pytest.mark.parametrize(
  "seq_q,seq_kv", [(100, 300), (300, 100), (128, 128), (70, 70)]
)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, (37, 5)], ids=["nowin", "win"])
def test_visible_tile_at_matches_visible_tile(seq_q, seq_kv, causal, window):
  """Both forms, including the transposed one that splits each query index
  into `q & ~7` and `q & 7` (compares against immediates, issue 43)."""
  x = jax.ShapeDtypeStruct((1, seq_q, 1, 64), jnp.bfloat16)
  y = jax.ShapeDtypeStruct((1, seq_kv, 1, 64), jnp.bfloat16)
  spec = make_spec(x, y, y, causal=causal, window_size=window)
  rows, cols = 64, 32
  checked = 0
  for q0, kv0 in itertools.product(
    range(0, seq_q + 64, 32), range(0, seq_kv + 64, 32)
  ):
    q_idx, kv_idx = jnp.arange(rows), jnp.arange(cols)
    want = np.broadcast_to(
      np.asarray(
        masking.visible_tile(spec, q0 + q_idx[:, None], kv0 + kv_idx[None, :])
      ),
      (rows, cols),
    )
    # Query positions along dim 0 (the dQ kernel's S tile) ...
    got = masking.visible_tile_at(spec, q0, kv0, q_idx, kv_idx, (rows, cols), 0)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # ... and along dim 1 (the dK/dV kernel's S^T tile).
    got_t = masking.visible_tile_at(
      spec, q0, kv0, q_idx, kv_idx, (cols, rows), 1
    )
    np.testing.assert_array_equal(np.asarray(got_t), np.asarray(want).T)
    checked += int(np.asarray(want).any()) + int(not np.asarray(want).all())
  assert checked > 0  # both visible and hidden entries occurred


@pytest.mark.parametrize("seq_q", [64, 30])
def test_causal_alignment_already_hides_padded_keys(seq_q):
  """Why the dK/dV kernel's causal mask may skip the padded-key test."""
  x = jax.ShapeDtypeStruct((1, seq_q, 1, 64), jnp.bfloat16)
  y = jax.ShapeDtypeStruct((1, 40, 1, 64), jnp.bfloat16)
  q_idx, kv_idx = jnp.arange(64), jnp.arange(64)
  causal = make_spec(x, y, y, causal=True)
  with_pad = masking.visible_tile_at(causal, 0, 0, q_idx, kv_idx, (64, 64), 0)
  without = masking.visible_tile_at(
    causal, 0, 0, q_idx, kv_idx, (64, 64), 0, check_seq_kv=False
  )
  assert not np.asarray(with_pad)[:, 40:].any()
  np.testing.assert_array_equal(
    np.asarray(without)[:seq_q], np.asarray(with_pad)[:seq_q]
  )
  full = make_spec(x, y, y, causal=False)
  assert np.asarray(
    masking.visible_tile_at(
      full, 0, 0, q_idx, kv_idx, (64, 64), 0, check_seq_kv=False
    )
  ).all()


@pytest.mark.parametrize(
  "seq_q,seq_kv", [(130, 300), (300, 260), (256, 256), (200, 330)]
)
@pytest.mark.parametrize(
  "causal,window",
  [(True, None), (False, (200, 150)), (True, (200, None)), (False, (0, 0))],
)
def test_q_blocks_unmasked_are_the_fully_visible_query_tiles(
  seq_q, seq_kv, causal, window
):
  """The fused backward's unmasked loop (issue 43) runs exactly the query
  tiles whose every row sees every key of the key tile by the positional
  rule (padded rows and keys included: they need no mask either way)."""
  x = jax.ShapeDtypeStruct((1, seq_q, 1, 64), jnp.bfloat16)
  y = jax.ShapeDtypeStruct((1, seq_kv, 1, 64), jnp.bfloat16)
  spec = make_spec(x, y, y, causal=causal, window_size=window)
  bq, bkv = 64, 64
  nq = -(-seq_q // bq) + 1  # a kernel's padding may add a whole tile
  seen = 0
  for kv0 in range(0, seq_kv, bkv):
    lo, hi = masking.q_blocks_unmasked(spec, kv0, kv0 + bkv, bq, nq)
    got = set(range(int(lo), int(hi)))
    want = set()
    for i in range(nq):
      tile = masking.visible_tile_at(
        spec, i * bq, kv0, jnp.arange(bq), jnp.arange(bkv), (bkv, bq), 1,
        check_seq_kv=False,
      )  # fmt: skip
      if np.asarray(tile).all():
        want.add(i)
    assert got == want, (kv0, lo, hi, sorted(want))
    seen += len(want) > 0
  assert seen > 0 or window == (0, 0)  # no 64 x 64 tile fits a 1-key window
