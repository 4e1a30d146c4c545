"""`flash_attention_with_kvcache(cu_seqlens_q=, max_seqlen_q=,
cu_seqlens_k_new=)`, a ragged batch (continuous batching): random mixes of
prefill chunks and decode tokens (1, 0, several) over contiguous and paged
caches (NaN past every sequence's tokens), against each sequence run alone
through the uniform call (same backend) and a float64 golden, appended k/v
written per sequence, cache_leftpad, traced cu_seqlens under jit, the
interpret kernels with race detection, and every validation error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa3
from pallas_fa3.testing import assert_within_tolerance, run_interpreted

_HQ, _HK, _D = 4, 2, 32


def _cu(lengths):
  return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


def _mix(rng, n):
  """n sequences' new-query counts: prefill chunks (1-40), single decode
  tokens, idle sequences (0) and speculative runs (2-4)."""
  kinds = rng.permutation(np.resize([0, 1, 2, 3], n))
  draw = {0: lambda: rng.integers(1, 41), 1: lambda: 1, 2: lambda: 0}
  draw[3] = lambda: rng.integers(2, 5)
  return np.array([draw[int(k)]() for k in kinds], np.int32)


class _Case:
  """Packed q `[total_q]`, new k/v `[total_new]`, caches holding
  `cached[i]` tokens of sequence i (slots before `pads[i]`, past its
  tokens and in unused pages: NaN keys, Inf values)."""

  def __init__(self, rng, lens_q, lens_new, cached, capacity, page_size,
               pads=None, batch_idx=False, dtype=jnp.float32, d=_D):  # fmt: skip
    n, self.d = len(lens_q), d
    self.lens_q, self.lens_new = np.asarray(lens_q), np.asarray(lens_new)
    self.cached = np.asarray(cached, np.int32)
    self.pads = np.zeros(n, np.int32) if pads is None else np.asarray(pads)
    normal = lambda *s: rng.normal(size=s).astype(np.float32)
    self.page_table = self.rows = None
    if page_size:
      pps = capacity // page_size
      pages = n * pps + 1
      kc, vc = (
        normal(pages, page_size, _HK, d),
        normal(pages, page_size, _HK, d),
      )
      self.page_table = rng.permutation(pages)[: n * pps].reshape(n, pps)
      used = np.zeros(pages, bool)
      used[self.page_table.ravel()] = True
      kc[~used], vc[~used] = np.nan, np.inf
    else:
      rows = n + int(batch_idx)
      kc, vc = normal(rows, capacity, _HK, d), normal(rows, capacity, _HK, d)
      self.rows = rng.permutation(rows)[:n] if batch_idx else np.arange(n)
    self.page_size, self.capacity = page_size, capacity
    for i in range(n):
      for t in [*range(self.pads[i]), *range(self.cached[i], capacity)]:
        kc[self.slot(i, t)], vc[self.slot(i, t)] = np.nan, np.inf
    self.dtype = np.dtype(dtype)
    array = lambda x: jnp.asarray(x, dtype)
    self.k_cache, self.v_cache = array(kc), array(vc)
    self.q = array(normal(int(self.lens_q.sum()), _HQ, d))
    self.k = array(normal(int(self.lens_new.sum()), _HK, d))
    self.v = array(normal(int(self.lens_new.sum()), _HK, d))
    self.cu_q, self.cu_k = _cu(self.lens_q), _cu(self.lens_new)

  def slot(self, i, t):
    if self.page_size:
      return int(self.page_table[i, t // self.page_size]), t % self.page_size
    return int(self.rows[i]), t

  def cache_args(self):
    kw = dict(cache_seqlens=jnp.asarray(self.cached))
    if self.page_size:
      kw["page_table"] = jnp.asarray(self.page_table, jnp.int32)
    elif not np.array_equal(self.rows, np.arange(len(self.rows))):
      kw["cache_batch_idx"] = jnp.asarray(self.rows, jnp.int32)
    return kw

  def keys(self, i, dtype):
    """Sequence i's logical keys and values (cache then new) and their
    positions, in `dtype`."""
    pos = np.arange(self.pads[i], self.cached[i])
    kc, vc = np.asarray(self.k_cache), np.asarray(self.v_cache)
    at = [self.slot(i, int(t)) for t in pos]
    a, b = int(self.cu_k[i]), int(self.cu_k[i + 1])
    k = np.concatenate([np.array([kc[s] for s in at]).reshape(-1, _HK, self.d), np.asarray(self.k[a:b])])  # fmt: skip
    v = np.concatenate([np.array([vc[s] for s in at]).reshape(-1, _HK, self.d), np.asarray(self.v[a:b])])  # fmt: skip
    kpos = np.arange(self.pads[i], self.cached[i] + b - a)
    return k.astype(dtype), v.astype(dtype), kpos


def _attention(case, dtype, causal=False, window_size=None):
  """(out `[total_q, hq, d]`, lse `[hq, total_q]`) computed in `dtype`
  per sequence (float64: the golden; the inputs' dtype: the naive; in
  NumPy, bfloat16 in JAX op by op, NumPy's einsum has none)."""
  xp = jnp if dtype == jnp.bfloat16 else np
  outs, lses = [], []
  for i in range(len(case.lens_q)):
    a, b = int(case.cu_q[i]), int(case.cu_q[i + 1])
    if a == b:
      continue
    k, v, kpos = (xp.asarray(x) for x in case.keys(i, dtype))
    q = xp.asarray(np.asarray(case.q[a:b]).astype(dtype))
    scale = xp.asarray(1 / np.sqrt(case.d), dtype)
    length = case.cached[i] + case.lens_new[i]
    qpos = length - (b - a) + np.arange(b - a)
    k, v = xp.repeat(k, _HQ // _HK, 1), xp.repeat(v, _HQ // _HK, 1)
    s = xp.einsum("qhd,khd->hqk", q, k) * scale
    ok = np.ones((b - a, len(kpos)), bool)
    d = np.asarray(kpos)[None, :] - qpos[:, None]
    if causal:
      ok &= d <= 0
    if window_size is not None:
      ok &= (d >= -window_size[0]) & (d <= window_size[1])
    s = xp.where(ok[None], s, -np.inf)
    m = xp.max(s, -1, keepdims=True, initial=-np.inf)
    m = xp.where(xp.isfinite(m), m, 0)
    e = xp.exp(s - m)
    l = e.sum(-1, keepdims=True)
    p = e / xp.where(l == 0, 1, l)
    outs.append(np.asarray(xp.einsum("hqk,khd->qhd", p, v), np.float64))
    lse = xp.where(l == 0, -np.inf, m + xp.log(xp.where(l == 0, 1, l)))
    lses.append(np.asarray(lse[..., 0], np.float64))
  return np.concatenate(outs), np.concatenate(lses, axis=1)


def _ragged(case, impl, with_new=True, **options):
  return pallas_fa3.flash_attention_with_kvcache(
    case.q, case.k_cache, case.v_cache,
    case.k if with_new else None, case.v if with_new else None,
    **case.cache_args(), cu_seqlens_q=case.cu_q,
    max_seqlen_q=int(case.lens_q.max()),
    cu_seqlens_k_new=case.cu_k if with_new else None,
    return_lse=True, implementation=impl, **options,
  )  # fmt: skip


def _alone(case, impl, i, **options):
  """Sequence i's (out, lse) through the uniform call, batch 1."""
  a, b = int(case.cu_q[i]), int(case.cu_q[i + 1])
  c, d = int(case.cu_k[i]), int(case.cu_k[i + 1])
  kw = dict(cache_seqlens=jnp.asarray(case.cached[i : i + 1]))
  if case.page_size:
    kw["page_table"] = jnp.asarray(case.page_table[i : i + 1], jnp.int32)
  else:
    kw["cache_batch_idx"] = jnp.asarray(case.rows[i : i + 1], jnp.int32)
  if case.pads.any():
    kw["cache_leftpad"] = jnp.asarray(case.pads[i : i + 1])
  new = (case.k[None, c:d], case.v[None, c:d]) if d > c else (None, None)
  result = pallas_fa3.flash_attention_with_kvcache(
    case.q[None, a:b], case.k_cache, case.v_cache, *new, **kw,
    return_lse=True, implementation=impl, **options,
  )  # fmt: skip
  return result[0][0], result[1][0]


def _check(case, impl, out, lse, caches, alone=True, **options):
  golden = _attention(case, np.float64, **options)
  naive = _attention(case, case.dtype.type, **options)
  assert_within_tolerance("out", out, naive[0], golden[0])
  assert_within_tolerance("lse", lse, naive[1], golden[1])
  for i in range(len(case.lens_q)):  # the new tokens are in the caches
    c = int(case.cu_k[i])
    for j in range(int(case.lens_new[i])):
      at = case.slot(i, int(case.cached[i]) + j)
      np.testing.assert_array_equal(caches[0][at], case.k[c + j])
      np.testing.assert_array_equal(caches[1][at], case.v[c + j])
  if not alone:
    return
  for i in range(len(case.lens_q)):
    a, b = int(case.cu_q[i]), int(case.cu_q[i + 1])
    if a < b:
      o, l = _alone(case, impl, i, **options)
      np.testing.assert_allclose(out[a:b], o, atol=2e-6, rtol=0)
      np.testing.assert_allclose(lse[:, a:b], l, atol=2e-6, rtol=0)


# (page_size, capacity, options)
LAYOUTS = [
  pytest.param(None, 96, dict(causal=True), id="contiguous-causal"),
  pytest.param(1, 64, dict(causal=True), id="page1-causal"),
  pytest.param(16, 96, {}, id="page16-not-causal"),
  pytest.param(64, 128, dict(window_size=(24, 0)), id="page64-window"),
  pytest.param(256, 256, dict(causal=True), id="page256-causal", marks=pytest.mark.slow),
]  # fmt: skip


# Every layout in blockwise; the reference on two in the default run.
MIXES = [
  pytest.param("blockwise", *p.values, id=f"blockwise-{p.id}", marks=p.marks)
  for p in LAYOUTS
] + [
  pytest.param(
    "reference", *p.values, id=f"reference-{p.id}",
    marks=() if p.values[0] in (None, 16) else pytest.mark.slow,
  )
  for p in LAYOUTS
]  # fmt: skip


@pytest.mark.parametrize("impl,page_size,capacity,options", MIXES)
def test_ragged_mix_against_alone_and_golden(
  rng, impl, page_size, capacity, options
):
  lens = _mix(rng, 6)
  lens[0] = max(lens[0], 1)  # at least one query somewhere
  cached = rng.integers(0, capacity - 40, size=6)
  case = _Case(rng, lens, lens, cached, capacity, page_size)
  out, lse, *caches = _ragged(case, impl, **options)
  alone = impl == "blockwise"  # (the reference: the golden alone)
  _check(case, impl, out, lse, caches, alone=alone, **options)


@pytest.mark.parametrize(
  "impl", [pytest.param("reference", marks=pytest.mark.slow), "blockwise"]
)
def test_ragged_new_keys_apart_from_queries_and_leftpad(rng, impl):
  # Speculative verification beside prefill: 3 queries over 1 new key,
  # 1 query over 0 new keys (the cache alone), an idle sequence that
  # still appends 2 keys, a chunk of 17 over its 17 keys.
  lens_q, lens_new = [3, 1, 0, 17], [1, 0, 2, 17]
  case = _Case(
    rng, lens_q, lens_new, [30, 12, 5, 40], 64, None, pads=[4, 0, 2, 11],
    batch_idx=True,
  )  # fmt: skip
  leftpad = jnp.asarray(case.pads, jnp.int32)
  out, lse, *caches = _ragged(case, impl, causal=True, cache_leftpad=leftpad)
  _check(case, impl, out, lse, caches, causal=True)


def test_ragged_without_new_keys(rng):
  case = _Case(rng, [5, 1, 0, 2], [0, 0, 0, 0], [20, 33, 7, 1], 48, 16)
  out, lse = _ragged(case, "blockwise", with_new=False, causal=True)
  _check(case, "blockwise", out, lse, (case.k_cache, case.v_cache), causal=True)  # fmt: skip


@pytest.mark.parametrize(
  "interleaved", [True, pytest.param(False, marks=pytest.mark.slow)]
)
def test_ragged_rotary_against_alone(rng, interleaved):
  # FA3's positions: new key j of sequence i at cache_seqlens[i] + j, its
  # queries the same (causal), as each sequence alone in the uniform call.
  case = _Case(rng, [6, 1, 0, 3], [6, 1, 0, 3], [10, 25, 4, 0], 48, 16)
  angles = rng.uniform(0, 6, size=(48, 8)).astype(np.float32)
  tables = dict(
    rotary_cos=jnp.asarray(np.cos(angles)),
    rotary_sin=jnp.asarray(np.sin(angles)),
    rotary_interleaved=interleaved,
    causal=True,
  )
  out, lse, kc, _ = _ragged(case, "blockwise", **tables)
  for i in (0, 1, 3):
    a, b = int(case.cu_q[i]), int(case.cu_q[i + 1])
    o, l = _alone(case, "blockwise", i, **tables)
    np.testing.assert_allclose(out[a:b], o, atol=2e-6, rtol=0)
    np.testing.assert_allclose(lse[:, a:b], l, atol=2e-6, rtol=0)
  # The rotated keys are in the cache: not the unrotated ones.
  at = case.slot(0, int(case.cached[0]) + 1)
  assert not np.allclose(kc[at], case.k[1])


def test_ragged_mla_one_cache(rng):
  # v_cache None (MLA's layout): V is the K cache's first head_dim_v
  # columns; the new k alone is written.
  case = _Case(rng, [4, 1, 0], [4, 1, 0], [9, 30, 2], 48, 16)
  run = lambda q, k, kw: pallas_fa3.flash_attention_with_kvcache(
    q, case.k_cache, None, k, head_dim_v=16, causal=True, return_lse=True,
    implementation="blockwise", **kw,
  )  # fmt: skip
  out, lse, kc = run(
    case.q, case.k, dict(**case.cache_args(), cu_seqlens_q=case.cu_q)
  )
  assert out.shape == (5, _HQ, 16)
  for i in (0, 1):
    a, b = int(case.cu_q[i]), int(case.cu_q[i + 1])
    kw = dict(cache_seqlens=jnp.asarray(case.cached[i : i + 1]))
    kw["page_table"] = jnp.asarray(case.page_table[i : i + 1], jnp.int32)
    o, l, _ = run(case.q[None, a:b], case.k[None, a:b], kw)
    np.testing.assert_allclose(out[a:b], o[0], atol=2e-6, rtol=0)
    np.testing.assert_allclose(lse[:, a:b], l[0], atol=2e-6, rtol=0)
    at = case.slot(i, int(case.cached[i]))
    np.testing.assert_array_equal(kc[at], case.k[a])


def test_traced_cu_seqlens_and_padded_buffer(rng):
  # Under jit the packing is traced (one compilation for every mix); the
  # tokens past cu_seqlens_q[-1] (NaN here) give 0 and lse -inf.
  case = _Case(rng, [4, 1, 2], [4, 1, 2], [9, 20, 3], 32, None)
  fn = jax.jit(
    lambda q, cu: pallas_fa3.flash_attention_with_kvcache(
      q,
      case.k_cache,
      case.v_cache,
      case.k,
      case.v,
      cache_seqlens=jnp.asarray(case.cached),
      cu_seqlens_q=cu,
      max_seqlen_q=8,
      causal=True,
      return_lse=True,
      implementation="blockwise",
    )  # fmt: skip
  )
  q = jnp.concatenate([case.q, jnp.full((3, _HQ, _D), jnp.nan)])
  out, lse, kc, vc = fn(q, case.cu_q)
  assert np.all(np.asarray(out[7:]) == 0) and np.all(np.isneginf(lse[:, 7:]))
  _check(case, "blockwise", out[:7], lse[:, :7], (kc, vc), alone=False, causal=True)  # fmt: skip
  # An invalid traced packing (decreasing) is NaN, never a wrong result.
  out, *_ = fn(q, jnp.asarray([0, 4, 3, 7], jnp.int32))
  assert np.all(np.isnan(np.asarray(out[:7])))


def test_interpret_kernel_ragged(rng):
  case = _Case(
    rng, [3, 1, 0], [3, 1, 0], [17, 40, 2], 64, 16, dtype=jnp.bfloat16, d=64
  )
  out, lse, *caches = run_interpreted(_ragged, case, "interpret", causal=True)
  _check(case, "interpret", out, lse, caches, alone=False, causal=True)


def _bad_call(case, **over):
  args = dict(
    k=case.k, v=case.v, cache_seqlens=jnp.asarray(case.cached),
    cu_seqlens_q=case.cu_q, implementation="reference",
  )  # fmt: skip
  args.update(over)
  return pallas_fa3.flash_attention_with_kvcache(
    case.q, case.k_cache, case.v_cache, **args
  )


@pytest.mark.parametrize(
  "over,error,match",
  [
    (dict(cu_seqlens_q=jnp.asarray([0, 2, 1, 3], jnp.int32)), ValueError, r"cu_seqlens_q must be non-decreasing.*\[0, 2, 1, 3\]"),
    (dict(cu_seqlens_q=jnp.asarray([1, 2, 2, 3], jnp.int32)), ValueError, r"cu_seqlens_q must start at 0"),
    (dict(cu_seqlens_q=jnp.asarray([0.0, 1, 2, 3])), TypeError, r"cu_seqlens_q must have an integer dtype.*float32"),
    (dict(cu_seqlens_q=jnp.zeros((2, 2), jnp.int32)), ValueError, r"cu_seqlens_q must have shape .*\(2, 2\)"),
    (dict(cu_seqlens_q=jnp.asarray([0], jnp.int32)), ValueError, r"cu_seqlens_q .*n >= 1"),
    (dict(cu_seqlens_q=jnp.asarray([0, 2, 2, 9], jnp.int32)), ValueError, r"cu_seqlens_q\[-1\] = 9 exceeds the 3 tokens of q"),
    (dict(max_seqlen_q=1), ValueError, r"max_seqlen_q=1 is smaller than the longest sequence \(2\)"),
    (dict(max_seqlen_q=jnp.int32(4)), TypeError, r"max_seqlen_q must be a static Python int"),
    (dict(cache_seqlens=jnp.asarray([1, 2], jnp.int32)), ValueError, r"cache_seqlens has 2 sequences \(shape \(2,\)\) but cu_seqlens_q has 3"),
    (dict(k=jnp.zeros((2, _HK, _D)), v=jnp.zeros((2, _HK, _D))), ValueError, r"k has 2 tokens .* cu_seqlens_q, its packing .* ends at 3"),
    (dict(cu_seqlens_k_new=jnp.asarray([0, 1, 2], jnp.int32)), ValueError, r"cu_seqlens_k_new must have shape \(4,\); got \(3,\)"),
    (dict(cu_seqlens_k_new=jnp.asarray([0, 1, 2, 5], jnp.int32)), ValueError, r"cu_seqlens_k_new\[-1\] = 5 exceeds the 3 tokens of k and v"),
    (dict(v=jnp.zeros((2, _HK, _D))), ValueError, r"v must be \[total_k_new.*got shape \(2, 2, 32\)"),
    (dict(cache_seqlens=jnp.asarray([1, 2, 32], jnp.int32)), ValueError, r"cache_seqlens"),
    (dict(k=None, v=None, cu_seqlens_k_new=jnp.asarray([0, 1, 2, 3], jnp.int32)), ValueError, r"cu_seqlens_k_new need k"),
    (dict(cu_seqlens_q=None, max_seqlen_q=4), ValueError, r"need cu_seqlens_q"),
    (dict(rotary_cos=jnp.ones((16, 8)), rotary_sin=jnp.ones((16, 8))), ValueError, r"rotary_cos"),
    (dict(k=None, v=None, rotary_cos=jnp.ones((32, 8)), rotary_sin=jnp.ones((32, 8))), ValueError, r"new tokens k and v"),
  ],
)  # fmt: skip
def test_bad_input_names_the_argument(rng, over, error, match):
  case = _Case(rng, [2, 0, 1], [2, 0, 1], [3, 4, 5], 32, None)
  with pytest.raises(error, match=match):
    _bad_call(case, **over)


def test_e4m3_cache_append_against_alone(rng):
  # New tokens divided by their sequence's descales and rounded into the
  # e4m3 cache, as the uniform call does for each sequence alone.
  case = _Case(rng, [5, 1, 0, 2], [5, 1, 0, 2], [7, 20, 3, 0], 32, 16,
               dtype=jnp.bfloat16)  # fmt: skip
  q8 = pallas_fa3.quantize_kv_cache(
    case.k_cache, case.v_cache, cache_seqlens=jnp.asarray(case.cached),
    page_table=jnp.asarray(case.page_table, jnp.int32),
  )  # fmt: skip
  case.k_cache, case.v_cache = q8.k_cache, q8.v_cache
  extra = dict(k_descale=q8.k_descale, v_descale=q8.v_descale, causal=True)
  out, lse, kc, vc = _ragged(case, "blockwise", **extra)
  for i in (0, 1, 3):
    a, b = int(case.cu_q[i]), int(case.cu_q[i + 1])
    kw = dict(
      k_descale=q8.k_descale[i : i + 1], v_descale=q8.v_descale[i : i + 1]
    )
    o, l = _alone(case, "blockwise", i, causal=True, **kw)
    np.testing.assert_allclose(np.asarray(out[a:b], np.float32), np.asarray(o, np.float32), atol=1e-2, rtol=0)  # fmt: skip
    np.testing.assert_allclose(lse[:, a:b], l, atol=1e-5, rtol=0)
    c = int(case.cu_k[i])
    for j in range(int(case.lens_new[i])):  # the tokens' e4m3 rounding
      at = case.slot(i, int(case.cached[i]) + j)
      want = np.asarray(case.k[c + j], np.float32) / np.asarray(q8.k_descale[i])[:, None]  # fmt: skip
      np.testing.assert_array_equal(kc[at], jnp.asarray(np.clip(want, -448, 448)).astype(kc.dtype))  # fmt: skip
