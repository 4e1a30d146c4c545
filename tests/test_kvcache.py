"""`flash_attention_with_kvcache` on the pure-JAX backends (reference,
blockwise) against the float64 golden of every logical sequence, with
FA3's tolerance rule: contiguous and paged caches (pages shuffled), lengths
0 to full, GQA groups, seq_q 1/4/16 with causal, window, softcap, sinks,
cache_batch_idx, appended tokens (the caches checked slot by slot), every
num_splits the same function, NaN and Inf past every length; one
compilation for many lengths; in-place updates under donation; the
refusals. The Hopper kernel's tiers: tests/test_kvcache_kernel.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa3
from pallas_fa3.kvcache import cache_rows, gather, make_decode_spec
from pallas_fa3.testing import (
  assert_within_tolerance,
  decode_case,
  decode_golden_and_naive,
)

BACKENDS = ("reference", "blockwise")

# (batch, seq_q, heads_q, heads_kv, d, capacity, lengths, page_size, seq_new,
#  batch_idx, options)
CASES = [
  pytest.param(
    3, 1, 8, 2, 64, 256, [0, 100, 256], None, 0, False, dict(causal=True),
    id="contiguous-g4-q1-lengths0-to-full",
  ),
  pytest.param(
    2, 4, 8, 1, 64, 256, [37, 250], 16, 2, False, dict(causal=True),
    id="paged16-mqa-q4-append",
  ),
  pytest.param(
    2, 16, 4, 4, 32, 192, [0, 150], 64, 16, False, dict(causal=True),
    id="paged64-mha-q16-prefill-chunk-from-empty",
  ),
  pytest.param(
    3, 1, 16, 2, 64, 320, [5, 200, 319], None, 1, True,
    dict(window_size=(50, 0), softcap=8.0),
    id="batch-idx-g8-window-softcap-append",
  ),
  pytest.param(
    2, 4, 8, 2, 64, 256, [60, 190], 32, 0, False,
    dict(causal=True, sinks=True),
    id="paged32-sinks",
  ),
  pytest.param(
    2, 2, 4, 2, 64, 128, [10, 120], None, 0, False, {},
    id="not-causal",
  ),
]  # fmt: skip


def _run(case, impl, splits, options, sinks=None):
  args, kwargs = case.call_args()
  return pallas_fa3.flash_attention_with_kvcache(
    *args,
    **kwargs,
    **options,
    sinks=sinks,
    return_lse=True,
    num_splits=splits,
    implementation=impl,
  )


@pytest.mark.parametrize("b,sq,hq,hk,d,cap,lengths,ps,new,idx,options", CASES)
@pytest.mark.parametrize("impl", BACKENDS)
def test_against_float64_golden(
  b, sq, hq, hk, d, cap, lengths, ps, new, idx, options, impl, rng
):
  options = dict(options)
  sinks = None
  if options.pop("sinks", False):
    sinks = jnp.asarray(rng.normal(size=hq), jnp.float32)
  case = decode_case(
    rng,
    batch=b,
    seq_q=sq,
    heads_q=hq,
    heads_kv=hk,
    head_dim=d,
    capacity=cap,
    lengths=lengths,
    page_size=ps,
    seq_new=new,
    batch_idx=idx,
  )
  args, kwargs = case.call_args()
  spec = make_decode_spec(*args, **kwargs, **options, sinks=sinks is not None)
  first = None
  for splits in (1, 3) if impl == "blockwise" else (1,):
    result = _run(case, impl, splits, options, sinks)
    out, lse = result[:2]
    caches = result[2:] if new else (case.k_cache, case.v_cache)
    golden, naive = decode_golden_and_naive(spec, case, *caches, sinks)
    for name, got, n, g in zip(("out", "lse"), (out, lse), naive, golden):
      assert_within_tolerance(f"{name} splits={splits}", got, n, g)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    if first is None:
      first = (out, lse)
    else:  # every split count: the same function (to rounding)
      np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(first[0], np.float32),
        atol=2e-2,
      )  # fmt: skip


def test_appended_tokens_land_in_their_slots(rng):
  """k/v written at cache_seqlens[b] + i of each sequence, through the page
  table or cache_batch_idx; every other slot unchanged (NaN compared as
  NaN); tokens past the capacity are dropped."""
  for ps, idx in ((None, True), (16, False)):
    case = decode_case(
      rng, batch=3, seq_q=2, heads_q=4, heads_kv=2, head_dim=32,
      capacity=64, lengths=[0, 30, 62], page_size=ps, seq_new=3,
      batch_idx=idx,
    )  # fmt: skip
    args, kwargs = case.call_args()
    # 62 + 3 overflows (64): refused when the lengths are concrete...
    with pytest.raises(ValueError, match="overflows the cache"):
      pallas_fa3.flash_attention_with_kvcache(*args, **kwargs)
    # ...and written up to the capacity when traced (that sequence: NaN).
    call = jax.jit(
      lambda a, kw: pallas_fa3.flash_attention_with_kvcache(*a, **kw)
    )
    out, k2, v2 = call(args, kwargs)
    spec = make_decode_spec(*args, **{**kwargs, "cache_seqlens": 0})
    rows = cache_rows(spec, case.cache_batch_idx)
    for cache, new, old in (
      (k2, case.k, case.k_cache),
      (v2, case.v, case.v_cache),
    ):
      got = np.asarray(gather(spec, cache, rows, case.page_table), np.float32)
      before = np.asarray(gather(spec, old, rows, case.page_table), np.float32)
      want = before.copy()
      for b, n in enumerate(case.cache_seqlens):
        m = min(3, 64 - n)
        want[b, n : n + m] = np.asarray(new[b, :m], np.float32)
      np.testing.assert_array_equal(got, want)
    out = np.asarray(out, np.float32)
    assert np.all(np.isfinite(out[:2])) and np.all(np.isnan(out[2]))


def _pages_case(rng):
  """Two sequences of 40 and 10 tokens (+1 appended) in 16-token pages of a
  9-page cache; sequence 0 reads its table's first 3 entries, sequence 1
  its first one."""
  return decode_case(
    rng, batch=2, seq_q=1, heads_q=4, heads_kv=2, head_dim=32,
    capacity=64, lengths=[40, 10], page_size=16, seq_new=1,
  )  # fmt: skip


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
@pytest.mark.parametrize("entry", [99, 9, -1], ids=["99", "9", "-1"])
def test_out_of_range_page_table_entries_are_errors(impl, entry, rng):
  """A concrete page_table entry that is no page of the cache is a
  ValueError naming the entry and the bound (it once read page 8, the
  last); entries past a sequence's tokens are never read, so padding
  there is fine and changes nothing."""
  case = _pages_case(rng)
  args, kwargs = case.call_args()
  call = lambda pt: pallas_fa3.flash_attention_with_kvcache(
    *args, **{**kwargs, "page_table": pt}, implementation=impl
  )
  bad = case.page_table.at[0, 2].set(entry)
  with pytest.raises(
    ValueError,
    match=rf"page_table\[0, 2\] = {entry} is not a page of k_cache, which has 9 pages \(0..8\)",
  ):
    call(bad)  # fmt: skip
  padded = case.page_table.at[1, 1:].set(entry)  # past sequence 1's 11 tokens
  for got, want in zip(call(padded), call(case.page_table)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
@pytest.mark.parametrize("entry", [5, -1], ids=["5", "-1"])
def test_out_of_range_cache_batch_idx_is_an_error(impl, entry, rng):
  """cache_batch_idx=[0, 5] over a 3-row cache once read row 2."""
  case = decode_case(
    rng, batch=2, seq_q=1, heads_q=4, heads_kv=2, head_dim=32,
    capacity=64, lengths=[40, 10], batch_idx=True,
  )  # fmt: skip
  args, kwargs = case.call_args()
  kwargs["cache_batch_idx"] = case.cache_batch_idx.at[1].set(entry)
  with pytest.raises(
    ValueError,
    match=rf"cache_batch_idx\[1\] = {entry} is not a row of k_cache, which has 3 rows \(0..2\)",
  ):
    pallas_fa3.flash_attention_with_kvcache(*args, **kwargs, implementation=impl)  # fmt: skip


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
def test_traced_out_of_range_indices_give_nan_rows(impl, rng):
  """Traced indices cannot raise: the sequence that reads a page (a row)
  the cache lacks gets NaN rows, the others their own output, and its new
  token is written nowhere (never into another sequence's page)."""
  case = _pages_case(rng)
  args, kwargs = case.call_args()
  step = jax.jit(
    lambda a, kw: pallas_fa3.flash_attention_with_kvcache(
      *a, **kw, implementation=impl
    )
  )
  want_out, want_k, _ = step(args, kwargs)
  for entry in (99, -1):
    # Sequence 0's third page holds its tokens 32..40 and the new one.
    table = case.page_table.at[0, 2].set(entry)
    out, k2, _ = step(args, {**kwargs, "page_table": table})
    out = np.asarray(out, np.float32)
    assert np.all(np.isnan(out[0]))
    np.testing.assert_array_equal(out[1], np.asarray(want_out[1], np.float32))
    # The cache is the valid call's but for sequence 0's new token (token
    # 40: slot 8 of its third page), which is written nowhere.
    page = int(case.page_table[0, 2])
    want = want_k.at[page, 8].set(case.k_cache[page, 8])
    np.testing.assert_array_equal(
      np.asarray(k2, np.float32), np.asarray(want, np.float32)
    )
  rows = decode_case(
    rng, batch=2, seq_q=1, heads_q=4, heads_kv=2, head_dim=32,
    capacity=64, lengths=[40, 10], batch_idx=True,
  )  # fmt: skip
  args, kwargs = rows.call_args()
  for entry in (5, -1):
    row0 = int(rows.cache_batch_idx[0])
    kw = {**kwargs, "cache_batch_idx": jnp.asarray([row0, entry], jnp.int32)}
    out = np.asarray(step(args, kw), np.float32)
    assert np.all(np.isnan(out[1])) and np.all(np.isfinite(out[0]))


@pytest.mark.parametrize("impl", BACKENDS)
def test_one_compilation_serves_every_length(impl, rng):
  case = decode_case(
    rng, batch=2, seq_q=1, heads_q=4, heads_kv=2, head_dim=32,
    capacity=128, lengths=[3, 9], page_size=32,
  )  # fmt: skip
  step = jax.jit(
    lambda q, kc, vc, n, pt: pallas_fa3.flash_attention_with_kvcache(
      q, kc, vc, cache_seqlens=n, page_table=pt, causal=True,
      implementation=impl,
    )
  )  # fmt: skip
  for n in ([3, 9], [0, 128], [64, 1]):
    step(case.q, case.k_cache, case.v_cache, jnp.asarray(n), case.page_table)
  assert step._cache_size() == 1  # pylint: disable=protected-access


def test_donated_caches_are_updated_in_place(rng):
  """Jitted with the caches donated, the appended tokens are written into
  the donated buffers: the compiled step aliases them to its outputs and
  copies no cache."""
  case = decode_case(
    rng, batch=2, seq_q=1, heads_q=4, heads_kv=2, head_dim=32,
    capacity=4096, lengths=[3, 9], seq_new=1,
  )  # fmt: skip

  def step(kc, vc, q, k, v, n):
    return pallas_fa3.flash_attention_with_kvcache(
      q, kc, vc, k, v, cache_seqlens=n, causal=True
    )

  args = (
    case.k_cache,
    case.v_cache,
    case.q,
    case.k,
    case.v,
    jnp.asarray([3, 9]),
  )
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile()
  text = compiled.as_text()
  assert "input_output_alias" in text or "must-alias" in text, text[:2000]
  cache_type = "bf16[2,4096,2,32]"
  copies = [
    line
    for line in text.splitlines()
    if " copy(" in line and cache_type in line
  ]
  assert not copies, copies
  before = case.k_cache.unsafe_buffer_pointer()
  out, kc, vc = compiled(*args)
  assert kc.unsafe_buffer_pointer() == before
  assert case.k_cache.is_deleted()


def test_gradients_are_refused_naming_the_function(rng):
  case = decode_case(
    rng, batch=1, seq_q=1, heads_q=2, heads_kv=1, head_dim=32,
    capacity=64, lengths=[10],
  )  # fmt: skip
  f = lambda q: (
    pallas_fa3.flash_attention_with_kvcache(
      q, case.k_cache, case.v_cache, cache_seqlens=10
    )
    .astype(jnp.float32)
    .sum()
  )
  with pytest.raises(NotImplementedError, match="flash_attention_with_kvcache"):
    jax.grad(f)(case.q)


def test_rows_that_see_no_key_give_zero_and_the_sink(rng):
  """A sequence of length 0, and queries a window leaves without keys."""
  case = decode_case(
    rng, batch=2, seq_q=4, heads_q=2, heads_kv=1, head_dim=32,
    capacity=64, lengths=[0, 2],
  )  # fmt: skip
  args, kwargs = case.call_args()
  for impl in BACKENDS:
    out, lse = pallas_fa3.flash_attention_with_kvcache(
      *args, **kwargs, causal=True, return_lse=True, implementation=impl
    )
    assert not np.any(np.asarray(out[0], np.float32))
    assert np.all(np.isneginf(np.asarray(lse[0])))
    # Sequence 1 has 2 keys and 4 queries: queries 0, 1 see none.
    assert np.all(np.isneginf(np.asarray(lse[1, :, :2])))
    sinks = jnp.asarray([0.5, -1.0])
    out, lse = pallas_fa3.flash_attention_with_kvcache(
      *args, **kwargs, causal=True, sinks=sinks, return_lse=True,
      implementation=impl,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(lse[0]), [[0.5] * 4, [-1.0] * 4])


def _bad_calls():
  q = jnp.zeros((2, 1, 4, 32), jnp.bfloat16)
  kc = jnp.zeros((2, 64, 2, 32), jnp.bfloat16)
  pt = jnp.zeros((2, 4), jnp.int32)
  pk = jnp.zeros((9, 16, 2, 32), jnp.bfloat16)
  n = jnp.array([1, 2])
  call = pallas_fa3.flash_attention_with_kvcache
  yield (
    "rank",
    lambda: call(q[0], kc, kc, cache_seqlens=n),
    ValueError,
    "q must have rank 4",
  )
  yield (
    "heads",
    lambda: call(
      jnp.zeros((2, 1, 3, 32), jnp.bfloat16), kc, kc, cache_seqlens=n
    ),
    ValueError,
    r"q heads \(3\) must be a multiple",
  )
  yield (
    "head_dim",
    lambda: call(
      jnp.zeros((2, 1, 4, 16), jnp.bfloat16), kc, kc, cache_seqlens=n
    ),
    ValueError,
    "head_dim must equal q's",
  )
  yield (
    "dtype",
    lambda: call(q.astype(jnp.float32), kc, kc, cache_seqlens=n),
    TypeError,
    "k_cache must have q's dtype",
  )
  yield (
    "k-without-v",
    lambda: call(q, kc, kc, kc[:, :1], cache_seqlens=n),
    ValueError,
    "k and v must be given together",
  )
  yield (
    "new-shape",
    lambda: call(q, kc, kc, kc[:, :1, :1], kc[:, :1, :1], cache_seqlens=n),
    ValueError,
    "k and v must have shapes",
  )
  yield (
    "seqlens-shape",
    lambda: call(q, kc, kc, cache_seqlens=jnp.array([1, 2, 3])),
    ValueError,
    r"cache_seqlens must have shape \[batch\]",
  )
  yield (
    "seqlens-dtype",
    lambda: call(q, kc, kc, cache_seqlens=jnp.array([1.0, 2.0])),
    TypeError,
    "cache_seqlens must be int32",
  )
  for name, bad in (("list", [1, 2]), ("float", 1.0)):
    yield (
      f"seqlens-{name}",
      lambda bad=bad: call(q, kc, kc, cache_seqlens=bad),
      TypeError,
      r"cache_seqlens must be a Python int or an int32 array of shape"
      r" \[batch\] = \(2,\)",
    )
  # A cache in [batch, heads_kv, cache_len, head_dim]: the message says
  # which layout is expected.
  yield (
    "cache-layout",
    lambda: call(q, kc.swapaxes(1, 2), kc.swapaxes(1, 2), cache_seqlens=n),
    ValueError,
    r"kv heads \(64\).*layout is \[batch_cache, cache_len, heads_kv,"
    r" head_dim\], and this one looks like \[batch_cache, heads_kv,"
    r" cache_len, head_dim\]",
  )
  yield (
    "paged-layout",
    lambda: call(
      q, pk.swapaxes(1, 2), pk.swapaxes(1, 2), cache_seqlens=n, page_table=pt
    ),
    ValueError,
    r"looks like \[num_pages, heads_kv, page_size, head_dim\]",
  )
  yield (
    "seqlens-overflow",
    lambda: call(q, kc, kc, cache_seqlens=64, k=kc[:, :1], v=kc[:, :1]),
    ValueError,
    "overflows the cache",
  )
  yield (
    "page-table-dtype",
    lambda: call(q, pk, pk, cache_seqlens=n, page_table=pt.astype(jnp.float32)),
    TypeError,
    "page_table must be int32",
  )
  yield (
    "page-table-shape",
    lambda: call(q, pk, pk, cache_seqlens=n, page_table=pt[:1]),
    ValueError,
    "page_table must have shape",
  )
  yield (
    "page-table-and-idx",
    lambda: call(q, pk, pk, cache_seqlens=n, page_table=pt, cache_batch_idx=n),
    ValueError,
    "page_table and cache_batch_idx",
  )
  yield (
    "cache-batch",
    lambda: call(q, kc[:1], kc[:1], cache_seqlens=n),
    ValueError,
    "k_cache's batch",
  )
  yield (
    "batch-idx-shape",
    lambda: call(
      q, kc, kc, cache_seqlens=n, cache_batch_idx=jnp.zeros(3, jnp.int32)
    ),
    ValueError,
    r"cache_batch_idx must have shape",
  )
  yield (
    "num-splits",
    lambda: call(q, kc, kc, cache_seqlens=n, num_splits=0),
    ValueError,
    "num_splits must be >= 1",
  )
  yield (
    "sinks",
    lambda: call(q, kc, kc, cache_seqlens=n, sinks=jnp.zeros(3)),
    ValueError,
    "sinks must have shape",
  )
  yield (
    "window",
    lambda: call(q, kc, kc, cache_seqlens=n, window_size=(-2, 0)),
    ValueError,
    "window_size",
  )
  yield (
    "implementation",
    lambda: call(q, kc, kc, cache_seqlens=n, implementation="cuda"),
    ValueError,
    "implementation must be",
  )
  yield (
    "config",
    lambda: call(
      q,
      kc,
      kc,
      cache_seqlens=n,
      implementation="blockwise",
      config=pallas_fa3.Sm90DecodeConfig(),
    ),
    TypeError,
    "takes a BlockwiseConfig",
  )
  q64 = jnp.zeros((2, 1, 4, 64), jnp.bfloat16)
  kc64 = jnp.zeros((2, 64, 2, 64), jnp.bfloat16)
  yield (
    "mosaic-here",
    lambda: call(q64, kc64, kc64, cache_seqlens=n, implementation="mosaic"),
    NotImplementedError,
    "'mosaic' cannot run here",
  )
  yield (
    "mosaic-head-dim",
    lambda: call(q, kc, kc, cache_seqlens=n, implementation="mosaic"),
    NotImplementedError,
    "head_dim 32 is not one of the kernel's",
  )


@pytest.mark.parametrize(
  "name,fn,error,match", [pytest.param(*c, id=c[0]) for c in _bad_calls()]
)
def test_bad_calls_are_errors_naming_the_argument(name, fn, error, match):
  if name == "mosaic-here" and jax.default_backend() == "gpu":
    pytest.skip("a GPU is present")
  with pytest.raises(error, match=match):
    fn()


def test_automatic_choice_without_a_gpu_is_blockwise():
  from pallas_fa3.backends import explain_choice

  q = jnp.zeros((1, 1, 4, 64), jnp.bfloat16)
  kc = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
  spec = make_decode_spec(q, kc, kc, cache_seqlens=5)
  choices = dict(explain_choice(spec))
  if jax.default_backend() != "gpu":
    assert choices["mosaic"] and choices["blockwise"] is None
