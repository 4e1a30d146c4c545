"""`flash_attention_with_kvcache(rotary_cos=, rotary_sin=,
rotary_interleaved=)`, FA3's in-call rotary embedding: every backend
against RoPE applied by hand (numpy, float64) to q and the appended k at
FA3's positions, then a call without it; the appended slots of the cache
hold the rotated k; the refusals name the argument."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa3
from pallas_fa3.kernels.sm90 import compat
from pallas_fa3.kvcache import make_decode_spec
from pallas_fa3.testing import (
  assert_within_tolerance,
  decode_case,
  decode_golden_and_naive,
)

_TIMEOUT_S = 300


def _tables(rng, seqlen_ro, rotary_dim):
  angle = rng.uniform(0, 2 * np.pi, size=(seqlen_ro, rotary_dim // 2))
  return np.cos(angle), np.sin(angle)


def _rope_by_hand(x, cos, sin, positions, interleaved):
  """x `[b, s, h, d]` rotated in float64 at positions `[b, s]`; the
  features past rotary_dim unchanged."""
  x = np.asarray(x, np.float64)
  half = cos.shape[1]
  out = x.copy()
  for b in range(x.shape[0]):
    for s in range(x.shape[1]):
      c, sn = cos[positions[b, s]], sin[positions[b, s]]
      for i in range(half):
        a, bb = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        x1, x2 = x[b, s, :, a], x[b, s, :, bb]
        out[b, s, :, a] = x1 * c[i] - x2 * sn[i]
        out[b, s, :, bb] = x1 * sn[i] + x2 * c[i]
  return out


def _by_hand(case, cos, sin, interleaved, per_token):
  """(q, k) rotated at FA3's positions, in the case's dtype."""
  n = np.asarray(case.cache_seqlens)
  sq, snew = case.q.shape[1], case.k.shape[1]
  kpos = n[:, None] + np.arange(snew)[None, :]
  qpos = n[:, None] + (
    np.arange(sq)[None, :] if per_token else 0 * np.arange(sq)[None, :]
  )
  dtype = case.q.dtype
  q = jnp.asarray(_rope_by_hand(case.q, cos, sin, qpos, interleaved), dtype)
  k = jnp.asarray(_rope_by_hand(case.k, cos, sin, kpos, interleaved), dtype)
  return q, k


# (page_size, seq_q = seq_new, heads_q, heads_kv, d, rotary_dim, options)
CASES = [
  pytest.param(None, 1, 8, 2, 64, 64, dict(causal=True), id="contiguous-full-causal-q1"),
  pytest.param(16, 4, 4, 1, 64, 32, dict(causal=True), id="paged16-half-rotary-q4"),
  pytest.param(None, 3, 4, 2, 32, 16, {}, id="not-causal-q-at-one-position"),
  pytest.param(32, 2, 4, 2, 64, 64, dict(window_size=(40, 8)), id="paged32-window"),
]  # fmt: skip


@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("ps,sq,hq,hk,d,rd,options", CASES)
@pytest.mark.parametrize("impl", ["reference", "blockwise"])
def test_rotary_equals_rope_by_hand(
  impl, ps, sq, hq, hk, d, rd, options, interleaved, rng
):
  cap = 128
  case = decode_case(
    rng, batch=2, seq_q=sq, heads_q=hq, heads_kv=hk, head_dim=d, capacity=cap,
    lengths=[5, cap - sq - 3], page_size=ps, seq_new=sq, dtype=jnp.float32,
  )  # fmt: skip
  cos, sin = _tables(rng, cap + 7, rd)
  args, kwargs = case.call_args()
  per_token = bool(options.get("causal") or options.get("window_size"))
  out, lse, kc, vc = pallas_fa3.flash_attention_with_kvcache(
    *args, **kwargs, **options, return_lse=True, implementation=impl,
    rotary_cos=jnp.asarray(cos, jnp.float32),
    rotary_sin=jnp.asarray(sin, jnp.float32),
    rotary_interleaved=interleaved,
  )  # fmt: skip
  q_ro, k_ro = _by_hand(case, cos, sin, interleaved, per_token)
  want = pallas_fa3.flash_attention_with_kvcache(
    q_ro, case.k_cache, case.v_cache, k_ro, case.v, **kwargs, **options,
    return_lse=True, implementation=impl,
  )  # fmt: skip
  np.testing.assert_allclose(np.asarray(out), np.asarray(want[0]), atol=2e-5)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want[1]), atol=2e-5)
  # The cache holds the rotated keys at the appended slots, V untouched.
  np.testing.assert_allclose(np.asarray(kc), np.asarray(want[2]), atol=2e-6)
  np.testing.assert_array_equal(np.asarray(vc), np.asarray(want[3]))
  if rd < d:  # the features past rotary_dim pass through
    np.testing.assert_array_equal(
      np.asarray(q_ro)[..., rd:], np.asarray(case.q)[..., rd:]
    )


@pytest.mark.timeout(_TIMEOUT_S)
@pytest.mark.parametrize(
  "ps,interleaved",
  [(None, True), (64, False)],
  ids=["contiguous-gptj", "paged64-neox"],
)
def test_interpret_rotary_against_float64_golden(ps, interleaved, rng):
  """The kernel's call (bf16) against the golden of the by-hand rotated
  inputs, with the tolerance rule (race detection on)."""
  cap, sq = 256, 2
  case = decode_case(
    rng, batch=2, seq_q=sq, heads_q=8, heads_kv=2, head_dim=64, capacity=cap,
    lengths=[70, 200], page_size=ps, seq_new=sq,
  )  # fmt: skip
  cos, sin = _tables(rng, cap, 64)
  args, kwargs = case.call_args()
  try:
    with compat.capture_race_report() as report:
      out, lse, kc, vc = pallas_fa3.flash_attention_with_kvcache(
        *args, **kwargs, causal=True, return_lse=True,
        implementation="interpret", rotary_interleaved=interleaved,
        rotary_cos=jnp.asarray(cos, jnp.bfloat16),
        rotary_sin=jnp.asarray(sin, jnp.bfloat16),
        config=pallas_fa3.Sm90DecodeConfig(block_kv=64, num_stages=2),
      )  # fmt: skip
      jax.block_until_ready(out)
  except Exception:
    compat.reset_interpret_state()
    raise
  assert not compat.races_found(), report.getvalue()[-3000:]
  c16 = np.asarray(jnp.asarray(cos, jnp.bfloat16), np.float64)
  s16 = np.asarray(jnp.asarray(sin, jnp.bfloat16), np.float64)
  q_ro, k_ro = _by_hand(case, c16, s16, interleaved, per_token=True)
  hand = dataclasses.replace(case, q=q_ro, k=k_ro)
  spec = make_decode_spec(*hand.call_args()[0], **kwargs, causal=True)
  golden, naive = decode_golden_and_naive(spec, hand, kc, vc)
  for name, got, nv, g in zip(("out", "lse"), (out, lse), naive, golden):
    assert_within_tolerance(name, got, nv, g)


def _small(rng, **kw):
  return decode_case(
    rng, batch=2, seq_q=1, heads_q=4, heads_kv=2, head_dim=32, capacity=64,
    lengths=[3, 10], seq_new=1, **kw,
  )  # fmt: skip


@pytest.mark.parametrize(
  "change,error,match",
  [
    (dict(rotary_sin=None), ValueError, "rotary_cos and rotary_sin must be given together"),
    (dict(rotary_cos=np.ones((64, 8))), ValueError, "the same shape"),
    (dict(rotary_cos=np.ones((64, 20)), rotary_sin=np.ones((64, 20))), ValueError, "exceeds head_dim 32"),
    (dict(rotary_cos=np.ones((63, 16)), rotary_sin=np.ones((63, 16))), ValueError, "63 rows"),
    (dict(rotary_cos=np.ones((64, 16), np.int32), rotary_sin=np.ones((64, 16), np.int32)), TypeError, "rotary_cos must be a float"),
    (dict(rotary_cos=np.ones((64,)), rotary_sin=np.ones((64,))), ValueError, r"\[seqlen_ro, rotary_dim / 2\]"),
    (dict(rotary_interleaved="yes"), TypeError, "rotary_interleaved"),
  ],
  ids=["one-table", "shapes-differ", "rotary-dim-past-head-dim", "too-few-rows", "int-tables", "rank-1", "interleaved-not-bool"],
)  # fmt: skip
def test_rotary_bad_input_names_the_argument(change, error, match, rng):
  case = _small(rng)
  args, kwargs = case.call_args()
  tables = dict(rotary_cos=np.ones((64, 16), np.float32), rotary_sin=np.ones((64, 16), np.float32))  # fmt: skip
  with pytest.raises(error, match=match):
    pallas_fa3.flash_attention_with_kvcache(
      *args, **kwargs, **{**tables, **change}, implementation="reference"
    )


def test_rotary_needs_appended_tokens_and_a_v_cache(rng):
  tables = dict(rotary_cos=np.ones((64, 16), np.float32), rotary_sin=np.ones((64, 16), np.float32))  # fmt: skip
  case = _small(rng)
  args, kwargs = case.call_args()
  with pytest.raises(ValueError, match="new tokens k"):
    pallas_fa3.flash_attention_with_kvcache(*args[:3], **kwargs, **tables)
  mla = decode_case(
    rng, batch=2, seq_q=1, heads_q=4, heads_kv=1, head_dim=32, head_dim_v=16,
    capacity=64, lengths=[3, 10], seq_new=1, v_in_k=True,
  )  # fmt: skip
  args, kwargs = mla.call_args()
  with pytest.raises(ValueError, match="v_cache=None"):
    pallas_fa3.flash_attention_with_kvcache(*args, **kwargs, **tables)


def test_rotary_under_jit_with_traced_lengths_compiles_once(rng):
  """Traced cache_seqlens: the positions follow them (one compilation)."""
  case = _small(rng, dtype=jnp.float32)
  cos, sin = _tables(rng, 64, 32)
  args, kwargs = case.call_args()
  traces = []

  @jax.jit
  def step(n):
    traces.append(1)
    return pallas_fa3.flash_attention_with_kvcache(
      *args, **{**kwargs, "cache_seqlens": n}, causal=True,
      rotary_cos=jnp.asarray(cos, jnp.float32), rotary_sin=jnp.asarray(sin, jnp.float32),
      implementation="blockwise",
    )[0]  # fmt: skip

  for n in ([3, 10], [7, 1]):
    got = step(jnp.asarray(n, jnp.int32))
    hand = dataclasses.replace(case, cache_seqlens=np.asarray(n, np.int32))
    q_ro, k_ro = _by_hand(hand, cos, sin, True, per_token=True)
    want = pallas_fa3.flash_attention_with_kvcache(
      q_ro, case.k_cache, case.v_cache, k_ro, case.v,
      **{**kwargs, "cache_seqlens": jnp.asarray(n, jnp.int32)}, causal=True,
      implementation="blockwise",
    )[0]  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
  assert len(traces) == 1
