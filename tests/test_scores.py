"""The Hopper kernels' one score pipeline (`kernels/sm90/scores.py`) against
the semantics layer's definitions in float64, on tiles outside a kernel
(the interpreted leaf ops), and the rule that no kernel writes its own."""

from __future__ import annotations

import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_fa3 import masking
from pallas_fa3.kernels.sm90 import scores
from pallas_fa3.kernels.sm90.ops import INTERPRETED as OPS
from pallas_fa3.spec import LOG2E, AttentionSpec

BQ, BKV = 64, 32


def _spec(causal, window, softcap, seq_q=200, seq_kv=300):
  return AttentionSpec(
    batch=1, seq_q=seq_q, seq_kv=seq_kv, heads_q=1, heads_kv=1, head_dim=64,
    head_dim_v=64, dtype=jnp.bfloat16, causal=causal, softmax_scale=0.125,
    window_size=window, softcap=softcap,
  )  # fmt: skip


def _golden_logits(spec, s, q0, kv0):
  """float64 base-2 logits of the tile, hidden ones -inf."""
  s = s.astype(np.float64) * spec.softmax_scale
  if spec.softcap is not None:
    s = spec.softcap * np.tanh(s / spec.softcap)
  x = s * LOG2E
  q_pos = q0 + np.arange(s.shape[0])
  kv_pos = kv0 + np.arange(s.shape[1])
  seen = np.asarray(masking.visible(spec, jnp.asarray(q_pos), kv_pos))
  seen = np.broadcast_to(seen, s.shape)
  return np.where(seen, x, -np.inf), seen


CASES = [
  (True, None, None),
  (True, (40, 0), None),
  (False, (16, 24), 20.0),
  (False, None, 5.0),
  (True, None, 30.0),
]


@pytest.mark.parametrize("causal,window,softcap", CASES)
@pytest.mark.parametrize("q0,kv0", [(0, 0), (64, 96), (128, 160), (192, 288)])
def test_logits_match_the_float64_definition(causal, window, softcap, q0, kv0):
  spec = _spec(causal, window, softcap)
  s = np.random.default_rng(q0 + kv0).normal(0, 8, (BQ, BKV)).astype(np.float32)
  at = scores.At(q0, kv0, masked=True)
  x = np.asarray(scores.logits(OPS, spec, jnp.asarray(s), at))
  want, seen = _golden_logits(spec, s, q0, kv0)
  np.testing.assert_array_equal(np.isinf(x), ~seen)
  np.testing.assert_allclose(x[seen], want[seen], rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("causal,window,softcap", CASES)
def test_probabilities_transposed_tile_is_the_transpose(
  causal, window, softcap
):
  """S^T with keys as rows (the dK/dV consumers) gives P^T bit for bit."""
  spec = _spec(causal, window, softcap)
  q0, kv0 = 128, 160
  s = np.random.default_rng(1).normal(0, 8, (BQ, BKV)).astype(np.float32)
  want, seen = _golden_logits(spec, s, q0, kv0)
  lse2 = np.where(seen.any(1), np.log2(np.exp2(want).sum(1)), 0.0)
  lse2 = jnp.asarray(lse2, jnp.float32)
  p, ctx = scores.probabilities(
    OPS, spec, jnp.asarray(s), lse2, scores.At(q0, kv0, masked=True)
  )
  p_t, ctx_t = scores.probabilities(
    OPS, spec, jnp.asarray(s.T), lambda: lse2,
    scores.At(q0, kv0, q_axis=1, masked=True),
  )  # fmt: skip
  np.testing.assert_array_equal(np.asarray(p_t), np.asarray(p).T)
  rows = seen.any(1)
  np.testing.assert_allclose(
    np.asarray(p)[rows], np.exp2(want - np.asarray(lse2)[:, None])[rows],
    rtol=1e-5, atol=1e-7,
  )  # fmt: skip
  assert (np.asarray(p)[~seen] == 0).all()
  if softcap is None:
    assert ctx is None and ctx_t is None
  else:  # the softcap's derivative: 1 - tanh^2 of the scaled score
    d = scores.times_derivative(jnp.ones_like(p), ctx)
    t = np.tanh(s.astype(np.float64) * spec.softmax_scale / softcap)
    np.testing.assert_allclose(np.asarray(d), 1 - t * t, rtol=1e-5, atol=1e-6)


def test_segment_bounds_replace_the_positional_rule():
  spec = _spec(True, None, None)
  rng = np.random.default_rng(2)
  lo = rng.integers(0, 200, BQ).astype(np.int32)
  hi = (lo + rng.integers(0, 80, BQ)).astype(np.int32)
  kv0 = 96
  mask = scores.builtin_mask(
    OPS, spec, (BQ, BKV),
    scores.At(0, kv0, masked=True, bounds=(jnp.asarray(lo), jnp.asarray(hi), 0)),
  )  # fmt: skip
  keys = kv0 + np.arange(BKV)
  want = (keys[None] >= lo[:, None]) & (keys[None] < hi[:, None])
  np.testing.assert_array_equal(np.asarray(mask), want)
  # per key (transposed tile): queries in [lo, hi) of each key row
  mask_t = scores.builtin_mask(
    OPS, spec, (BKV, BQ),
    scores.At(
      0, kv0, q_axis=1, masked=True,
      bounds=(jnp.asarray(lo[:BKV]), jnp.asarray(hi[:BKV]), 0),
    ),
  )  # fmt: skip
  queries = np.arange(BQ)
  want_t = (queries[None] >= lo[:BKV, None]) & (queries[None] < hi[:BKV, None])
  np.testing.assert_array_equal(np.asarray(mask_t), want_t)
  assert scores.builtin_mask(OPS, spec, (BQ, BKV), scores.At(0, kv0)) is None


@pytest.mark.parametrize(
  "causal,window,start",
  [(False, None, None), (True, None, None), (True, (50, 0), None),
   (False, (20, 8), 170)],
)  # fmt: skip
def test_decode_rows_see_their_cache(causal, window, start):
  """Decode rows: keys below the cache length, from cache_leftpad's start,
  up to each row's own position (causal) and inside its window."""
  spec = _spec(causal, window, None, seq_q=4, seq_kv=300)
  length = jnp.int32(180)
  pos = 176 + np.arange(BQ) // 16  # 4 queries x a GQA group of 16
  kv0 = 160  # the tile holding the last key
  at = scores.At(0, kv0, decode=(jnp.asarray(pos), length, start))
  mask = np.asarray(scores.builtin_mask(OPS, spec, (BQ, BKV), at))
  keys, rows = kv0 + np.arange(BKV)[None], pos[:, None]
  want = np.broadcast_to(keys < 180, (BQ, BKV))
  if causal:
    want = want & (keys <= rows)
  if start is not None:
    want = want & (keys >= start)
  if window is not None:
    want = want & (keys >= rows - window[0]) & (keys <= rows + window[1])
  np.testing.assert_array_equal(mask, want)


def test_descale_folds_into_the_scale_and_the_tanh():
  s = jnp.asarray(np.random.default_rng(3).normal(0, 8, (BQ, BKV)), jnp.float32)
  for softcap in (None, 10.0):
    spec = _spec(False, None, softcap)
    t, k = scores.softcapped(spec, s * 0.5, jnp.float32(2.0))
    t0, k0 = scores.softcapped(spec, s)
    np.testing.assert_allclose(
      np.asarray(t * k), np.asarray(t0 * k0), rtol=1e-6
    )


KERNELS = pathlib.Path(scores.__file__).parent


@pytest.mark.parametrize(
  "written",
  ["jnp.tanh(", "visible_tile_at(", "within_bounds(", "LOG2E * spec.softcap"],
)
def test_no_kernel_writes_its_own_score_pipeline(written):
  """Softcap and the built-in masks are written in scores.py alone (flex
  options in flex_tile.py): a new kernel or modifier goes through them."""
  owners = {"scores.py", "flex_tile.py"}
  found = [
    f.name
    for f in sorted(KERNELS.glob("*.py"))
    if f.name not in owners and written in f.read_text()
  ]
  assert not found, f"{written} written outside scores.py in {found}"
