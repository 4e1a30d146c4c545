"""Packed sequences (`segment_ids`, `pallas_fa3.segments`): the helpers, the
pure-JAX backends against the float64 golden with the tolerance rule
(forward, lse, every gradient), tile skipping, traced ids, validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa3
from pallas_fa3 import segments
from pallas_fa3.testing import (
  Shape,
  assert_within_tolerance,
  golden_and_naive,
  random_inputs,
)

NAMES = ("out", "lse", "dq", "dk", "dv", "dsinks")
TILES = pallas_fa3.BlockwiseConfig(block_q=16, block_kv=16)


def test_ids_and_positions_from_lengths():
  ids = pallas_fa3.segment_ids_from_lengths(
    jnp.array([[3, 2, 0], [1, 4, 1]]), 7
  )
  assert ids.tolist() == [[0, 0, 0, 1, 1, -1, -1], [0, 1, 1, 1, 1, 2, -1]]
  pos = pallas_fa3.segment_positions(ids)
  assert pos.tolist() == [[0, 1, 2, 0, 1, 0, 1], [0, 0, 1, 2, 3, 0, 0]]
  with pytest.raises(ValueError, match="lengths"):
    pallas_fa3.segment_ids_from_lengths(jnp.array([[5, 5]]), 7)


def test_tile_spans_cover_every_meeting_tile(rng):
  ids = np.sort(rng.integers(0, 5, (2, 70)), axis=1).astype(np.int32)
  kv = np.sort(rng.integers(0, 5, (2, 90)), axis=1).astype(np.int32)
  first, end = segments.kv_tile_spans(segments.SegmentIds(ids, kv), 16, 16)
  for b in range(2):
    for i in range(first.shape[1]):
      rows = ids[b, i * 16 : (i + 1) * 16]
      for j in range(-(-90 // 16)):
        cols = kv[b, j * 16 : (j + 1) * 16]
        if np.intersect1d(rows, cols).size:
          assert first[b, i] <= j < end[b, i]


def _packed(rng, batch, seq, docs, pad_q=0, pad_kv=0):
  """Ids of `docs` random-length documents per row, then padding (-1 for
  queries, -2 for keys)."""
  cuts = np.sort(rng.choice(np.arange(1, seq), docs - 1, replace=False))
  ids = np.searchsorted(cuts, np.arange(seq), side="right")
  ids = np.broadcast_to(ids, (batch, seq)).astype(np.int32)
  q_ids, kv_ids = ids.copy(), ids.copy()
  if pad_q:
    q_ids[:, -pad_q:] = -1
  if pad_kv:
    kv_ids[:, -pad_kv:] = -2
  return q_ids, kv_ids


# (id, shape, causal, window, sinks, ids maker)
CASES = [
  ("docs-causal-gqa", Shape(2, 64, 64, 4, 2, 16), True, None, False, "docs"),
  ("docs-noncausal", Shape(1, 64, 64, 2, 2, 16), False, None, False, "docs"),
  ("padding", Shape(2, 64, 64, 2, 1, 16), True, None, False, "pad"),
  ("cross-sorted", Shape(2, 40, 72, 2, 2, 16), False, None, False, "cross"),
  ("docs-window", Shape(1, 64, 64, 2, 1, 16), True, (7, None), False, "docs"),
  ("padding-sinks", Shape(1, 64, 64, 2, 2, 16), False, (9, 9), True, "pad"),
]


def _ids(kind, shape, rng):
  if kind == "docs":
    return _packed(rng, shape.batch, shape.seq_q, 4)
  if kind == "pad":
    return _packed(rng, shape.batch, shape.seq_q, 3, pad_q=9, pad_kv=13)
  q = np.sort(rng.integers(0, 3, (shape.batch, shape.seq_q)), axis=1)
  kv = np.sort(rng.integers(0, 3, (shape.batch, shape.seq_kv)), axis=1)
  return q.astype(np.int32), kv.astype(np.int32)


# The reference in float32 is the float64 golden's own algorithm; both
# backends in float32 run the bfloat16 cases' code, and the property suite
# checks them on every option mix: under -m slow here.
@pytest.mark.parametrize(
  "implementation,dtype",
  [
    ("reference", "bfloat16"),
    pytest.param("reference", "float32", marks=pytest.mark.slow),
    ("blockwise", "bfloat16"),
    pytest.param("blockwise", "float32", marks=pytest.mark.slow),
  ],
)
@pytest.mark.parametrize(
  "shape,causal,window,sinks,kind",
  [pytest.param(*c[1:], id=c[0]) for c in CASES],
)
def test_against_float64_golden(
  implementation, dtype, shape, causal, window, sinks, kind, key, rng
):
  q, k, v, dout = random_inputs(key, shape, dtype)
  ids = _ids(kind, shape, rng)
  snk = jnp.linspace(-1.0, 1.0, shape.heads_q) if sinks else None
  dlse = jax.random.normal(
    jax.random.fold_in(key, 2), (shape.batch, shape.heads_q, shape.seq_q)
  )
  config = TILES if implementation == "blockwise" else None

  @jax.jit
  def run(q, k, v, snk, ids, dout, dlse):
    f = lambda q, k, v, s: pallas_fa3.flash_attention(
      q,
      k,
      v,
      causal=causal,
      window_size=window,
      sinks=s,
      segment_ids=pallas_fa3.SegmentIds(*ids),
      return_lse=True,
      implementation=implementation,
      config=config,
    )
    (out, lse), pullback = jax.vjp(f, q, k, v, snk)
    grads = pullback((dout, dlse))
    return (out, lse) + tuple(g for g in grads if g is not None)

  got = run(q, k, v, snk, ids, dout, dlse)
  golden, naive = golden_and_naive(
    q,
    k,
    v,
    dout,
    dlse=dlse,
    causal=causal,
    window_size=window,
    sinks=snk,
    segment_ids=ids,
  )
  for name, g, n, gold in zip(NAMES, got, naive, golden):
    assert_within_tolerance(name, g, n, gold)
  if kind == "pad" and not sinks:  # padded queries: output 0, lse -inf
    assert not np.any(np.asarray(got[0][:, -9:], np.float32))
    assert np.all(np.asarray(got[1][..., -9:]) == -np.inf)
  for g in got[2:]:
    assert np.all(np.isfinite(np.asarray(g, np.float32)))


def test_blockwise_never_computes_tiles_of_other_documents(key):
  """Queries of document 0 only; V is NaN on document 1's keys: a tile of
  them computed and masked would still give 0 * NaN = NaN."""
  q, k, v, dout = random_inputs(key, Shape(1, 32, 96, 2, 1, 16), "float32")
  q_ids = jnp.zeros((1, 32), jnp.int32)
  kv_ids = jnp.concatenate(
    [jnp.zeros((1, 32), jnp.int32), jnp.ones((1, 64), jnp.int32)], axis=1
  )
  poisoned = v.at[:, 32:].set(jnp.nan)
  f = lambda q, k, v: pallas_fa3.flash_attention(
    q,
    k,
    v,
    segment_ids=(q_ids, kv_ids),
    implementation="blockwise",
    config=TILES,
  )
  out, pullback = jax.vjp(f, q, k, poisoned)
  grads = pullback(dout)
  np.testing.assert_allclose(np.asarray(out), np.asarray(f(q, k, v)), rtol=1e-6)
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g)))


def test_ids_are_traced_data_no_recompile(rng):
  q, k, v, _ = random_inputs(
    jax.random.key(0), Shape(1, 32, 32, 2, 2, 16), "float32"
  )
  fn = jax.jit(
    lambda q, k, v, ids: pallas_fa3.flash_attention(
      q, k, v, causal=True, segment_ids=(ids, ids)
    )
  )
  outs = []
  for docs in (2, 3, 5):
    ids = jnp.asarray(_packed(rng, 1, 32, docs)[0])
    outs.append(fn(q, k, v, ids))
    want = pallas_fa3.reference_attention(
      q, k, v, causal=True, segment_ids=(ids, ids)
    )
    np.testing.assert_allclose(
      np.asarray(outs[-1]), np.asarray(want), atol=1e-5
    )
  assert fn._cache_size() == 1  # pylint: disable=protected-access


@pytest.mark.parametrize(
  "segment_ids,error,match",
  [
    ("ids", TypeError, "segment_ids"),
    ((np.zeros((2, 8), np.int32),), TypeError, "segment_ids"),
    ((np.zeros((2, 8), np.int32), np.zeros((2, 9), np.int32)), ValueError, "segment_ids.kv"),
    ((np.zeros((1, 8), np.int32), np.zeros((2, 8), np.int32)), ValueError, "segment_ids.q"),
    ((np.zeros((2, 8), np.float32), np.zeros((2, 8), np.int32)), TypeError, "segment_ids.q"),
    ((np.zeros((2, 8, 1), np.int32), np.zeros((2, 8), np.int32)), ValueError, "segment_ids.q"),
  ],
)  # fmt: skip
def test_bad_segment_ids_are_errors_naming_them(segment_ids, error, match):
  q = jnp.zeros((2, 8, 2, 16))
  with pytest.raises(error, match=match):
    pallas_fa3.flash_attention(q, q, q, segment_ids=segment_ids)


def test_one_array_is_self_attention_ids(rng):
  """One int32 [batch, seq] array (MaxText/splash style) means
  SegmentIds(ids, ids), in every entry point that takes ids; refused,
  naming the lengths, for cross-attention."""
  q, k, v, _ = random_inputs(
    jax.random.key(2), Shape(2, 32, 32, 2, 1, 16), "float32"
  )
  ids = jnp.asarray(_packed(rng, 2, 32, 3)[0])
  for impl in ("reference", "blockwise"):
    got = pallas_fa3.flash_attention(
      q, k, v, causal=True, segment_ids=ids, implementation=impl
    )
    want = pallas_fa3.flash_attention(
      q, k, v, causal=True, segment_ids=(ids, ids), implementation=impl
    )
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(
    np.asarray(pallas_fa3.reference_attention(q, k, v, segment_ids=ids)),
    np.asarray(pallas_fa3.reference_attention(q, k, v, segment_ids=(ids, ids))),
  )
  with pytest.raises(ValueError, match=r"seq_q=32, seq_kv=16"):
    pallas_fa3.flash_attention(q, k[:, :16], v[:, :16], segment_ids=ids)


def test_vmap_over_ids(rng):
  q, k, v, _ = random_inputs(
    jax.random.key(1), Shape(1, 32, 32, 2, 2, 16), "float32"
  )
  ids = jnp.stack([jnp.asarray(_packed(rng, 1, 32, d)[0]) for d in (2, 4)])
  got = jax.vmap(
    lambda ids: pallas_fa3.flash_attention(q, k, v, segment_ids=(ids, ids))
  )(ids)
  for i in range(2):
    want = pallas_fa3.reference_attention(q, k, v, segment_ids=(ids[i], ids[i]))
    np.testing.assert_allclose(np.asarray(got[i]), np.asarray(want), atol=1e-5)
