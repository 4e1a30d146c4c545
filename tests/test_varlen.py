"""`flash_attention_varlen` (FA3's varlen call on the packed layout) against a
float64 golden computed sequence by sequence in NumPy (forward and
gradients; the tolerance rule against naive low-precision attention over
the same per-sequence mask): FA3-like length pairs, random `cu_seqlens`
with empty sequences, MHA/GQA/MQA, head dims, dv != d, causal, windows,
softcap, sinks, seqused, padded buffers with NaN in the padding, flex
functions seeing per-sequence indices, FP8, transformations (jit with one
compilation for every packing, vmap, remat), the interpret-mode kernels
with race detection, and every validation error."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa3
from pallas_fa3 import varlen
from pallas_fa3.testing import assert_within_tolerance, run_interpreted

IMPLEMENTATIONS = ("blockwise", "reference")
SLOW = pytest.mark.slow


def _slow_but(*fast):
  """Parameters as pytest.params: all but `fast` marked slow."""
  return lambda values: [
    v if v in fast else pytest.param(v, marks=SLOW) for v in values
  ]


def _cu(lengths) -> np.ndarray:
  return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _lengths(rng, n: int, max_q: int, max_k: int, empty: bool = True):
  """Random lengths of n sequences (some empty when `empty`), FA3's test
  style: each up to its side's maximum."""
  low = 0 if empty else 1
  lq = rng.integers(low, max_q + 1, n)
  lk = rng.integers(low, max_k + 1, n)
  if empty and n > 2:
    lq[1] = 0  # an empty sequence, always
  return lq, lk


def _allowed(lq, lk, causal, window):
  """FA3's per-sequence rule: bottom-right causal / window, `[lq, lk]`."""
  i = np.arange(lq)[:, None] + lk - lq  # each query's diagonal key
  j = np.arange(lk)[None, :]
  ok = np.ones((lq, lk), bool)
  left, right = (None, None) if window is None else window
  left = None if left in (None, -1) else left
  right = None if right in (None, -1) else right
  if causal:
    right = 0 if right is None else min(right, 0)
  if right is not None:
    ok &= j <= i + right
  if left is not None:
    ok &= j >= i - left
  return ok


def golden(
  q, k, v, dout, cu_q, cu_k, *, used_q=None, used_k=None, causal=False,
  window=None, softcap=None, sinks=None, scale=None, mod=None, allow=None,
):  # fmt: skip
  """float64 (out, lse, dq, dk, dv, dsinks) of each sequence alone.

  `mod(x, s, h, i, j) -> (y, dy/dx)` a score_mod of sequence s (numpy,
  broadcasting `h [hq,1,1]`, `i [1,lq,1]`, `j [1,1,lk]`); `allow(s, h, i,
  j) -> bool` a mask_mod."""
  q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
  tq, hq, d = q.shape
  hk, dv = k.shape[1], v.shape[2]
  g = hq // hk
  scale = 1 / math.sqrt(d) if scale is None else scale
  out = np.zeros((tq, hq, dv))
  lse = np.full((hq, tq), -np.inf)
  dq, dk, dvv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
  dsinks = np.zeros(hq)
  snk = None if sinks is None else np.asarray(sinks, np.float64)
  for s in range(len(cu_q) - 1):
    q0, k0 = cu_q[s], cu_k[s]
    lq = cu_q[s + 1] - q0 if used_q is None else used_q[s]
    lk = cu_k[s + 1] - k0 if used_k is None else used_k[s]
    if lq == 0:
      continue
    if snk is not None:
      lse[:, q0 : q0 + lq] = snk[:, None]
    if lk == 0:
      continue
    qs = q[q0 : q0 + lq].transpose(1, 0, 2)  # [hq, lq, d]
    ks = np.repeat(k[k0 : k0 + lk].transpose(1, 0, 2), g, 0)
    vs = np.repeat(v[k0 : k0 + lk].transpose(1, 0, 2), g, 0)
    dos = dout[q0 : q0 + lq].transpose(1, 0, 2)
    x = scale * qs @ ks.transpose(0, 2, 1)
    dx = np.ones_like(x)
    if softcap:
      t = np.tanh(x / softcap)
      x, dx = softcap * t, 1 - t**2
    h = np.arange(hq)[:, None, None]
    i, j = np.arange(lq)[None, :, None], np.arange(lk)[None, None, :]
    if mod is not None:
      x, dm = mod(x, s, h, i, j)
      dx = dx * dm
    ok = np.broadcast_to(_allowed(lq, lk, causal, window), x.shape)
    if allow is not None:
      ok = ok & allow(s, h, i, j)
    x = np.where(ok, x, -np.inf)
    m = np.max(x, -1, keepdims=True)
    if snk is not None:
      m = np.maximum(m, snk[:, None, None])
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(x - m)
    total = e.sum(-1, keepdims=True)
    if snk is not None:
      total = total + np.exp(snk[:, None, None] - m)
    seen = total > 0
    p = np.where(seen, e / np.where(seen, total, 1), 0)
    o = p @ vs
    rows = slice(q0, q0 + lq)
    out[rows] = o.transpose(1, 0, 2)
    lse[:, rows] = np.where(
      seen, np.log(np.where(seen, total, 1)) + m, -np.inf
    )[..., 0]
    delta = (dos * o).sum(-1, keepdims=True)
    dp = dos @ vs.transpose(0, 2, 1)
    ds = p * (dp - delta) * dx
    dq[rows] = (scale * ds @ ks).transpose(1, 0, 2)
    dks = (scale * ds.transpose(0, 2, 1) @ qs).reshape(hk, g, lk, d).sum(1)
    dvs = (p.transpose(0, 2, 1) @ dos).reshape(hk, g, lk, dv).sum(1)
    dk[k0 : k0 + lk] = dks.transpose(1, 0, 2)
    dvv[k0 : k0 + lk] = dvs.transpose(1, 0, 2)
    if snk is not None:
      p_sink = np.exp(snk[:, None] - lse[:, rows])
      dsinks -= (p_sink * delta[..., 0]).sum(-1)
  return out, lse, dq, dk, dvv, dsinks


def naive(q, k, v, dout, cu_q, cu_k, *, sinks=None, **options):
  """The same function in the inputs' dtype (every intermediate rounded):
  `reference_attention` over the packed layout with the golden's
  per-sequence mask as a dense mask_mod, (out, lse, dq, dk, dv, dsinks)."""
  allowed = np.zeros((q.shape[0], k.shape[0]), bool)
  for s in range(len(cu_q) - 1):
    lq, lk = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
    allowed[cu_q[s] : cu_q[s + 1], cu_k[s] : cu_k[s + 1]] = _allowed(
      lq, lk, options.get("causal", False), options.get("window")
    )
  dense = jnp.asarray(allowed)
  softcap = options.get("softcap")

  def f(q, k, v, sinks):
    return pallas_fa3.reference_attention(
      q[None], k[None], v[None], sinks=sinks, softcap=softcap,
      mask_mod=lambda b, h, i, j: dense[i, j], return_lse=True,
      intermediate_dtype=q.dtype,
    )  # fmt: skip

  @jax.jit
  def fwd_bwd(q, k, v, sinks, dout):
    (o, lse), pull = jax.vjp(f, q, k, v, sinks)
    grads = pull((dout[None].astype(o.dtype), jnp.zeros_like(lse)))
    return (o[0], lse[0]) + grads

  return fwd_bwd(q, k, v, sinks, dout)


def _inputs(rng, tq, tk, hq, hk, d, dv, dtype, pad_q=0, pad_k=0):
  shapes = ((tq + pad_q, hq, d), (tk + pad_k, hk, d), (tk + pad_k, hk, dv))
  q, k, v = (rng.standard_normal(s).astype(np.float32) for s in shapes)
  dout = rng.standard_normal((tq + pad_q, hq, dv)).astype(np.float32)
  if pad_q:
    q[tq:], dout[tq:] = np.nan, np.nan  # poison: must reach nothing
  if pad_k:
    k[tk:], v[tk:] = np.nan, np.inf
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v, dout))


def _check(name, got, gold, naive_, rows_q, rows_k, floor=64):
  """The tolerance rule over the used rows; the unused ones exactly 0."""
  got = np.asarray(got, np.float64)
  masks = {"q": rows_q, "k": rows_k}
  side = "k" if name in ("dk", "dv") else "q"
  used = masks[side]
  axis = 1 if name == "lse" else 0
  take = lambda x: np.compress(used, np.asarray(x, np.float64), axis=axis)
  assert_within_tolerance(name, take(got), take(naive_), take(gold), floor)
  if name not in ("lse",):
    rest = np.compress(~used, got, axis=axis)
    assert np.all(rest == 0), f"{name} is not 0 on unused tokens"


def _run_case(
  rng, impl, lq, lk, hq, hk, d, dv, dtype, *, causal=False, window=None,
  softcap=None, sinks=False, pad=(0, 0), same_cu=False, used=None,
):  # fmt: skip
  cu_q, cu_k = _cu(lq), _cu(lk)
  if same_cu:
    cu_k = cu_q
  tq, tk = int(cu_q[-1]), int(cu_k[-1])
  q, k, v, dout = _inputs(rng, tq, tk, hq, hk, d, dv, dtype, *pad)
  snk = jnp.asarray(rng.standard_normal(hq), jnp.float32) if sinks else None
  cu_q_dev = jnp.asarray(cu_q)
  cu_k_dev = cu_q_dev if same_cu else jnp.asarray(cu_k)
  used_q = used_k = None
  if used is not None:
    used_q = np.minimum(np.diff(cu_q), used[0]).astype(np.int32)
    used_k = np.minimum(np.diff(cu_k), used[1]).astype(np.int32)
  options = dict(causal=causal, window_size=window, softcap=softcap)

  def f(q, k, v, snk):
    return pallas_fa3.flash_attention_varlen(
      q, k, v, cu_q_dev, cu_k_dev, sinks=snk, return_lse=True,
      implementation=impl,
      seqused_q=None if used_q is None else jnp.asarray(used_q),
      seqused_k=None if used_k is None else jnp.asarray(used_k),
      **options,
    )  # fmt: skip

  @jax.jit
  def fwd_bwd(q, k, v, snk, dout):
    (out, lse), pull = jax.vjp(f, q, k, v, snk)
    return out, lse, pull((dout, jnp.zeros_like(lse)))

  out, lse, grads = fwd_bwd(q, k, v, snk, dout)
  gold = golden(
    q, k, v, dout, cu_q, cu_k, used_q=used_q, used_k=used_k, causal=causal,
    window=window, softcap=softcap, sinks=snk,
  )  # fmt: skip
  # The naive run sees each sequence's used tokens only (zeros elsewhere).
  rows_q = _used_rows(cu_q, used_q, q.shape[0])
  rows_k = _used_rows(cu_k, used_k, k.shape[0])
  zero = lambda x, rows: jnp.where(rows[:, None, None], x, 0)
  nv = naive(
    zero(q, rows_q), zero(k, rows_k), zero(v, rows_k), zero(dout, rows_q),
    cu_q, cu_k, sinks=snk, causal=causal, window=window, softcap=softcap,
  ) if used is None and min(tq, tk) else None  # fmt: skip
  names = ("out", "lse", "dq", "dk", "dv")
  results = (out, lse) + tuple(grads[:3])
  for j, (name, x) in enumerate(zip(names, results)):
    ref = gold[j] if nv is None else nv[j]
    _check(name, x, gold[j], ref, rows_q, rows_k)
  if sinks:
    ref = gold[5] if nv is None else nv[5]
    assert_within_tolerance("dsinks", grads[3], ref, gold[5])
  return out


def _used_rows(cu, used, total):
  rows = np.zeros(total, bool)
  for s in range(len(cu) - 1):
    n = cu[s + 1] - cu[s] if used is None else used[s]
    rows[cu[s] : cu[s] + n] = True
  return rows


# FA3's hopper varlen grid, scaled down: (max seq_q, max seq_k) pairs.
SEQLEN_PAIRS = [(1, 3), (2, 1), (17, 5), (64, 40), (33, 113)]
_FAST_PAIRS = (("blockwise", (33, 113)), ("reference", (1, 3)))


@pytest.mark.parametrize(
  "impl,pair",
  [
    (i, p) if (i, p) in _FAST_PAIRS else pytest.param(i, p, marks=SLOW)
    for i in IMPLEMENTATIONS
    for p in SEQLEN_PAIRS
  ],
  ids=str,
)
def test_random_packings_causal_gqa(impl, pair, rng):
  lq, lk = _lengths(rng, 4, *pair)
  _run_case(rng, impl, lq, lk, 4, 2, 32, 32, jnp.float32, causal=True)


# (name, heads q/kv, d, dv, options)
CASES = {
  "mha-d64-noncausal-padded": (2, 2, 64, 64, dict(pad=(5, 3))),
  "mqa-d128-dv64-window": (4, 1, 128, 64, dict(window=(7, 3))),
  "gqa-d256-causal-window-softcap": (
    4,
    2,
    256,
    256,
    dict(causal=True, window=(9, None), softcap=5.0),
  ),  # fmt: skip
  "gqa-d96-dv160-sinks-padded": (
    4,
    2,
    96,
    160,
    dict(sinks=True, causal=True, pad=(4, 2)),
  ),  # fmt: skip
  "self-aligned-causal-window": (
    2,
    1,
    64,
    64,
    dict(same_cu=True, causal=True, window=(5, None)),
  ),  # fmt: skip
  "seqused": (2, 1, 32, 32, dict(causal=True, used=(9, 13))),
}


_FAST_CASES = (
  ("blockwise", "gqa-d96-dv160-sinks-padded"),
  ("blockwise", "self-aligned-causal-window"),
  ("reference", "gqa-d256-causal-window-softcap"),
  ("reference", "mqa-d128-dv64-window"),
  ("reference", "seqused"),
)


@pytest.mark.parametrize(
  "impl,case",
  [
    (i, c) if (i, c) in _FAST_CASES else pytest.param(i, c, marks=SLOW)
    for i in IMPLEMENTATIONS
    for c in CASES
  ],
)
def test_options_against_golden(impl, case, rng):
  hq, hk, d, dv, options = CASES[case]
  lq, lk = _lengths(rng, 5, 40, 48)
  if options.get("same_cu"):
    lk = lq
  _run_case(rng, impl, lq, lk, hq, hk, d, dv, jnp.float32, **options)


@pytest.mark.parametrize("impl", _slow_but("blockwise")(IMPLEMENTATIONS))
def test_bfloat16(impl, rng):
  lq, lk = _lengths(rng, 4, 70, 90)
  _run_case(
    rng, impl, lq, lk, 4, 1, 64, 64, jnp.bfloat16, causal=True, pad=(3, 3)
  )


def test_aligned_and_per_token_rules_agree(rng):
  """The built-in diagonal (the same cu_seqlens array) and the per-token
  mask_mod (equal values in another array, traced) compute one function."""
  lens = np.array([5, 0, 31, 12], np.int32)
  cu = jnp.asarray(_cu(lens))
  q, k, v, _ = _inputs(rng, 48, 48, 2, 2, 32, 32, jnp.float32)
  f = lambda cu_k: pallas_fa3.flash_attention_varlen(
    q, k, v, cu, cu_k, causal=True, window_size=(6, None)
  )
  assert "own diagonal" in varlen.explain(q, k, v, cu, cu, causal=True)
  aligned = f(cu)
  per_token = jax.jit(f)(cu + 0)
  np.testing.assert_allclose(aligned, per_token, atol=2e-6)


def test_jit_one_compilation_for_every_packing(rng):
  q, k, v, _ = _inputs(rng, 64, 80, 2, 1, 32, 32, jnp.float32)
  traces = []

  @jax.jit
  def f(q, k, v, cu_q, cu_k):
    traces.append(1)
    return pallas_fa3.flash_attention_varlen(
      q, k, v, cu_q, cu_k, max_seqlen_q=64, max_seqlen_k=80, causal=True
    )

  for _ in range(2):
    lq, lk = _lengths(rng, 3, 20, 25)
    cu_q, cu_k = _cu(lq), _cu(lk)
    out = f(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k))
    gold = golden(q, k, v, jnp.zeros_like(q), cu_q, cu_k, causal=True)[0]
    np.testing.assert_allclose(out, gold, atol=1e-5)
  assert len(traces) == 1


def test_vmap_and_remat_over_an_outer_axis(rng):
  """vmap over two packings (cu_seqlens batched too; the per-token rule),
  its gradients, and jax.checkpoint inside: each example's equal the
  unbatched call's. (grad of checkpoint of vmap fails for every
  flash_attention call, not only varlen: JAX's VmapOf has no transpose.)"""
  cu = jnp.asarray(np.stack([_cu(_lengths(rng, 3, 10, 10)[0]) for _ in "ab"]))
  x = [_inputs(rng, 30, 30, 2, 1, 16, 16, jnp.float32) for _ in range(2)]
  q, k, v, dout = (jnp.stack(t) for t in zip(*x))

  def attend(q, k, v, cu):
    return pallas_fa3.flash_attention_varlen(q, k, v, cu, cu + 0, causal=True)

  def grads(q, k, v, cu, dout):
    out, pull = jax.vjp(lambda *a: attend(*a, cu), q, k, v)
    return (out,) + pull(dout)

  @jax.jit
  def batched(q, k, v, cu, dout):
    out, pull = jax.vjp(lambda *a: jax.vmap(attend)(*a, cu), q, k, v)
    return (out,) + pull(dout)

  remat = jax.jit(jax.vmap(jax.checkpoint(grads)))(q, k, v, cu, dout)
  batched = batched(q, k, v, cu, dout)
  one = jax.jit(grads)
  for i in range(2):
    want = one(q[i], k[i], v[i], cu[i], dout[i])
    for got, again, w in zip(batched, remat, want):
      np.testing.assert_allclose(got[i], w, atol=2e-5)
      np.testing.assert_allclose(again[i], w, atol=2e-5)


def test_deterministic_is_bitwise(rng):
  lq, lk = _lengths(rng, 4, 30, 30)
  cu_q, cu_k = jnp.asarray(_cu(lq)), jnp.asarray(_cu(lk))
  q, k, v, dout = _inputs(
    rng, int(lq.sum()), int(lk.sum()), 2, 1, 32, 32, jnp.float32
  )

  @jax.jit
  def grads(q, k, v, dout):
    f = lambda q, k, v: pallas_fa3.flash_attention_varlen(
      q, k, v, cu_q, cu_k, causal=True, deterministic=True
    )
    out, pull = jax.vjp(f, q, k, v)
    return (out,) + pull(dout)

  for a, b in zip(grads(q, k, v, dout), grads(q, k, v, dout)):
    assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("impl", _slow_but("blockwise")(IMPLEMENTATIONS))
def test_flex_sees_sequence_index_and_positions(impl, rng):
  """score_mod and mask_mod get `batch` = the sequence index and positions
  inside the sequence: a per-sequence gain, ALiBi on in-sequence
  distances, a mask of each sequence's own prefix length; forward,
  dq/dk/dv and the gain's gradient against the golden."""
  lq, lk = np.array([7, 0, 19, 12]), np.array([9, 4, 19, 20])
  cu_q, cu_k = _cu(lq), _cu(lk)
  q, k, v, dout = _inputs(rng, 38, 52, 4, 2, 32, 32, jnp.float32)
  gain = jnp.asarray([0.5, 1.0, 1.5, 2.0], jnp.float32)
  slopes = pallas_fa3.mods.alibi_slopes(4)
  prefix = jnp.asarray([3, 1, 5, 2], jnp.int32)

  @jax.jit
  def f(q, k, v, gain):
    return pallas_fa3.flash_attention_varlen(
      q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), causal=True,
      implementation=impl,
      score_mod=lambda s, b, h, i, j: s * gain[b]
      - slopes[h] * jnp.abs(i - j).astype(s.dtype),
      mask_mod=lambda b, h, i, j: (j >= prefix[b]) | (i == j),
    )  # fmt: skip

  out, pull = jax.jit(lambda *a: jax.vjp(f, *a))(q, k, v, gain)
  dq, dk, dv, dgain = pull(dout)
  sl, g64 = np.asarray(slopes, np.float64), np.asarray(gain, np.float64)

  def mod(x, s, h, i, j):
    return x * g64[s] - sl[h] * np.abs(i - j), g64[s]

  allow = lambda s, h, i, j: (j >= int(prefix[s])) | (i == j)
  gold = golden(
    q, k, v, dout, cu_q, cu_k, causal=True, mod=mod, allow=allow
  )  # fmt: skip
  rows_q, rows_k = np.ones(38, bool), np.ones(52, bool)
  for name, got, g in zip(
    ("out", "dq", "dk", "dv"), (out, dq, dk, dv), gold[:1] + gold[2:5]
  ):
    _check(name, got, g, g, rows_q, rows_k, floor=256)
  # d/dgain[s] = sum over sequence s's visible pairs of dS * x_raw.
  eps = 1e-3
  for s in (0, 2):
    bump = jnp.zeros(4).at[s].set(eps)
    fd = (f(q, k, v, gain + bump) - f(q, k, v, gain - bump)) / (2 * eps)
    np.testing.assert_allclose(
      float(dgain[s]), float((fd * dout).sum()), rtol=2e-2, atol=2e-3
    )


def test_fp8_aligned_and_refused_otherwise(rng):
  """FP8 runs where queries and keys are aligned (segment ids and the
  built-in diagonal: the packed FP8 call); the per-token rule refuses."""
  lens = np.array([40, 0, 88], np.int32)
  cu = jnp.asarray(_cu(lens))
  q, k, v, _ = _inputs(rng, 128, 128, 2, 2, 64, 64, jnp.bfloat16)
  out = pallas_fa3.flash_attention_varlen(
    q, k, v, cu, cu, causal=True, fp8=True, implementation="blockwise"
  )
  packed = pallas_fa3.flash_attention(
    q[None], k[None], v[None], causal=True, fp8=True,
    implementation="blockwise",
    segment_ids=pallas_fa3.segment_ids_from_lengths(lens[None], 128),
  )  # fmt: skip
  np.testing.assert_array_equal(np.asarray(out), np.asarray(packed[0]))
  gold = golden(q, k, v, q, _cu(lens), _cu(lens), causal=True)[0]
  err = np.abs(np.asarray(out, np.float64) - gold).max()
  assert err < 0.1 * np.abs(gold).max(), err
  with pytest.raises(NotImplementedError, match="fp8"):
    pallas_fa3.flash_attention_varlen(
      q, k, v, cu, jnp.asarray([0, 50, 50, 128]), causal=True, fp8=True
    )


def test_invalid_traced_packing_gives_nan(rng):
  q, k, v, _ = _inputs(rng, 16, 16, 2, 1, 16, 16, jnp.float32)
  f = jax.jit(
    lambda cu: pallas_fa3.flash_attention_varlen(q, k, v, cu, cu, causal=True)
  )
  assert np.all(np.isfinite(f(jnp.asarray([0, 9, 16], jnp.int32))))
  for bad in ([0, 9, 5], [0, 9, 17], [1, 9, 16]):
    assert np.all(np.isnan(f(jnp.asarray(bad, jnp.int32))))
  grad = jax.jit(
    jax.grad(
      lambda q, cu: pallas_fa3.flash_attention_varlen(q, k, v, cu, cu).sum()
    )
  )(q, jnp.asarray([0, 9, 5], jnp.int32))
  assert np.all(np.isnan(grad))


_Q = jnp.zeros((10, 2, 16))
_CU = jnp.asarray([0, 4, 10], jnp.int32)


@pytest.mark.parametrize(
  "kwargs,error,match",
  [
    (dict(cu_seqlens_q=jnp.asarray([0, 6, 4])), ValueError, r"cu_seqlens_q must be non-decreasing.*\[0, 6, 4\]"),
    (dict(cu_seqlens_k=jnp.asarray([0, -1, 10])), ValueError, r"cu_seqlens_k must be non-decreasing"),
    (dict(cu_seqlens_q=jnp.asarray([2, 4, 10])), ValueError, r"cu_seqlens_q must start at 0"),
    (dict(cu_seqlens_k=jnp.asarray([0, 4, 12])), ValueError, r"cu_seqlens_k\[-1\] = 12 exceeds the 10 tokens"),
    (dict(cu_seqlens_k=jnp.asarray([0, 4, 6, 10])), ValueError, r"cu_seqlens_k must have shape \(3,\); got \(4,\)"),
    (dict(cu_seqlens_q=jnp.asarray([0.0, 4.0, 10.0])), TypeError, r"cu_seqlens_q must have an integer dtype.*float32"),
    (dict(cu_seqlens_q=jnp.asarray([[0, 4, 10]])), ValueError, r"cu_seqlens_q must have shape \[n \+ 1\]; got \(1, 3\)"),
    (dict(cu_seqlens_q=jnp.asarray([0])), ValueError, r"n >= 1"),
    (dict(cu_seqlens_q=[0.5, 4, 10]), TypeError, r"cu_seqlens_q must have an integer dtype.*float64"),
    (dict(cu_seqlens_q="0,4,10"), TypeError, r"cu_seqlens_q must be an int32 array; got str"),
    (dict(max_seqlen_q=5), ValueError, r"max_seqlen_q=5 is smaller than the longest sequence \(6\)"),
    (dict(max_seqlen_k=jnp.int32(8)), TypeError, r"max_seqlen_k must be a static"),
    (dict(seqused_q=jnp.asarray([1, 2, 3])), ValueError, r"seqused_q must have shape \(2,\); got \(3,\)"),
    (dict(seqused_k=jnp.asarray([5, 2])), ValueError, r"seqused_k must lie in \[0, length\].*\[5, 2\]"),
    (dict(q=jnp.zeros((10, 2, 16, 1))), ValueError, r"q must be \[total_q, heads, head_dim\]; got shape \(10, 2, 16, 1\)"),
    (dict(v=jnp.zeros((9, 2, 16))), ValueError, r"k and v must have the same total_k.*\(9, 2, 16\)"),
    (dict(window_size=(3,)), ValueError, r"window_size"),
  ],
)  # fmt: skip
def test_bad_input_names_the_argument(kwargs, error, match):
  args = dict(q=_Q, k=_Q, v=_Q, cu_seqlens_q=_CU, cu_seqlens_k=_CU)
  args.update(kwargs)
  call = {
    n: args.pop(n) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")
  }
  with pytest.raises(error, match=match):
    pallas_fa3.flash_attention_varlen(*call.values(), **args)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
  "same_cu",
  [False, pytest.param(True, marks=pytest.mark.slow)],
  ids=["per-token", "aligned"],
)
def test_interpret_kernels_against_golden(same_cu, rng):
  """The sm90 kernels in interpret mode (a race fails the test): a query
  tile spanning sequences, an empty sequence, NaN padding; forward and
  gradients against the golden."""
  lq = np.array([30, 0, 70, 20])
  lk = lq if same_cu else np.array([60, 10, 70, 50])
  cu_q, cu_k = _cu(lq), _cu(lk)
  cu_q_dev = jnp.asarray(cu_q)
  cu_k_dev = cu_q_dev if same_cu else jnp.asarray(cu_k)
  tq, tk = int(cu_q[-1]), int(cu_k[-1])
  pad = (128 - tq, (128 if same_cu else 192) - tk)
  q, k, v, dout = _inputs(rng, tq, tk, 4, 2, 64, 64, jnp.bfloat16, *pad)
  f = lambda q, k, v: pallas_fa3.flash_attention_varlen(
    q, k, v, cu_q_dev, cu_k_dev, causal=True, implementation="interpret"
  )

  def fwd_bwd(q, k, v):
    out, pull = jax.vjp(f, q, k, v)
    return (out,) + pull(dout)

  got = run_interpreted(fwd_bwd, q, k, v)
  gold = golden(q, k, v, dout, cu_q, cu_k, causal=True)
  rows_q, rows_k = (
    _used_rows(cu_q, None, 128),
    _used_rows(cu_k, None, k.shape[0]),
  )
  zero = lambda x, rows: jnp.where(rows[:, None, None], x, 0)
  nv = naive(
    zero(q, rows_q), zero(k, rows_k), zero(v, rows_k), zero(dout, rows_q),
    cu_q, cu_k, causal=True,
  )  # fmt: skip
  for name, x, g, n in zip(
    ("out", "dq", "dk", "dv"), got, gold[:1] + gold[2:5], nv[:1] + nv[2:5]
  ):
    _check(name, x, g, n, rows_q, rows_k)


def test_cu_seqlens_of_rows():
  ids = np.array([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, -1, -1]], np.int32)
  cu = np.asarray(varlen.cu_seqlens_of_rows(jnp.asarray(ids)))
  assert cu.tolist() == [0, 2, 5, 6, 10, 12] + [12] * 7
  with pytest.raises(ValueError, match=r"segment_ids must be \[batch, seq\]"):
    varlen.cu_seqlens_of_rows(jnp.zeros(4, jnp.int32))


def test_eager_calls_trace_once(monkeypatch, rng):
  """Eager calls of one shape and options (the per-token rule's mask_mod a
  new closure in each trace) trace the packed call once, not per call."""
  traces = []
  packed = varlen._packed
  monkeypatch.setattr(
    varlen, "_packed", lambda *a, **kw: traces.append(1) or packed(*a, **kw)
  )
  monkeypatch.setattr(
    varlen, "_attend_jit", jax.jit(varlen._attend, static_argnums=0)
  )
  q, k, v, _ = _inputs(rng, 24, 30, 2, 1, 16, 16, jnp.float32)
  for cu_k in ([0, 10, 30], [0, 20, 30]):
    pallas_fa3.flash_attention_varlen(
      q, k, v, jnp.asarray([0, 8, 24]), jnp.asarray(cu_k), causal=True
    )
  assert len(traces) == 1


def test_cu_seqlens_as_lists_or_numpy(rng):
  q, k, v, _ = _inputs(rng, 10, 10, 2, 1, 16, 16, jnp.float32)
  want = pallas_fa3.flash_attention_varlen(q, k, v, _CU, _CU, causal=True)
  for cu in ([0, 4, 10], np.array([0, 4, 10], np.int32)):
    got = pallas_fa3.flash_attention_varlen(q, k, v, cu, cu, causal=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
