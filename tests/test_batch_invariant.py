"""`batch_invariant=True`: a sequence's output and lse are bitwise the same
whatever else is in the batch, its place in it and the split count the
batch size would choose, in every backend (interpret with race detection
on), for `flash_attention_with_kvcache` and `flash_attention`; the split
ranges are fixed runs of keys (`kvcache.split_span`).
docs/decoding.md#batch-invariant-decoding"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa3
from pallas_fa3 import kvcache
from pallas_fa3.backends import blockwise
from pallas_fa3.kernels.sm90 import config_decode
from pallas_fa3.kvcache import make_decode_spec
from pallas_fa3.testing import (
  assert_within_tolerance,
  decode_case,
  decode_golden_and_naive,
  run_interpreted,
)

# Sub-batches of a 4-sequence batch: alone, and permuted and grown
# (repeats: a batch size whose automatic split count differs).
_SUBSETS = ([2], [3, 1, 0, 2, 1])


def _bits(x):
  return np.asarray(jnp.asarray(x, jnp.float32))


def _decode(case, idx, **options):
  """The call on the sequences `idx` of `case` (the same cache: the
  sub-batch's rows or pages)."""
  args, kwargs = case.call_args()
  q, kc, vc, k, v = args
  sub = dict(kwargs, cache_seqlens=kwargs["cache_seqlens"][idx])
  for name in ("page_table", "cache_batch_idx"):
    if kwargs[name] is not None:
      sub[name] = kwargs[name][idx]
  new = (None, None) if k is None else (k[idx], v[idx])
  return run_interpreted(
    pallas_fa3.flash_attention_with_kvcache,
    q[idx], kc, vc, *new, **sub, **options, return_lse=True,
    batch_invariant=True,
  )[:2]  # fmt: skip


# (implementation, page_size, seq_q, seq_new, num_splits, capacity)
_SLOW = pytest.mark.slow
DECODE_CASES = [
  pytest.param("interpret", None, 1, 0, 3, 384, id="interpret-contiguous"),
  pytest.param("interpret", 64, 4, 4, 3, 384, id="interpret-paged64-q4", marks=_SLOW),
  pytest.param("blockwise", None, 1, 0, None, 2560, id="blockwise-2-splits"),
  pytest.param("blockwise", 64, 8, 8, 3, 384, id="blockwise-paged64-q8", marks=_SLOW),
  pytest.param("reference", None, 2, 2, None, 384, id="reference"),
]  # fmt: skip


@pytest.mark.parametrize("impl,ps,sq,new,splits,cap", DECODE_CASES)
def test_decode_sequences_bitwise_whatever_the_batch(
  impl, ps, sq, new, splits, cap, rng
):
  """Each sub-batch's rows equal the full batch's bit for bit, and the
  full batch is still the function (float64 golden)."""
  case = decode_case(
    rng, batch=4, seq_q=sq, heads_q=8, heads_kv=2, head_dim=64,
    capacity=cap, lengths=[cap - new, 37, cap // 2 + 5, 1],
    page_size=ps, seq_new=new, batch_idx=ps is None,
  )  # fmt: skip
  options = dict(implementation=impl, num_splits=splits, causal=True)
  if impl == "interpret":
    options["config"] = pallas_fa3.Sm90DecodeConfig(64, 2)
  full = _decode(case, np.arange(4), **options)
  for idx in _SUBSETS:
    got = _decode(case, np.asarray(idx), **options)
    for name, g, f in zip(("out", "lse"), got, full):
      np.testing.assert_array_equal(
        _bits(g), _bits(f)[np.asarray(idx)], err_msg=f"{name} {idx}"
      )
  if impl == "reference":
    return
  args, kwargs = case.call_args()
  spec = make_decode_spec(*args, **kwargs, causal=True)
  if new:  # the golden reads the caches with the new tokens written
    *_, kc, vc = pallas_fa3.flash_attention_with_kvcache(
      *args, **kwargs, implementation="reference"
    )
  else:
    kc, vc = case.k_cache, case.v_cache
  golden, naive = decode_golden_and_naive(spec, case, kc, vc)
  for name, g, nv, gd in zip(("out", "lse"), full, naive, golden):
    assert_within_tolerance(name, g, nv, gd)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_interpret_decode_default_fixed_splits_bitwise(rng):
  """The kernel's own fixed runs (2048 keys: 2 ranges at 2112 slots, the
  second a partial one for the longest sequence only) in interpret mode."""
  cap = kvcache.INVARIANT_SPLIT_KEYS + 64
  case = decode_case(
    rng, batch=4, seq_q=1, heads_q=4, heads_kv=1, head_dim=64,
    capacity=cap, lengths=[cap, 700, 2050, 5], batch_idx=True,
  )  # fmt: skip
  options = dict(
    implementation="interpret", config=pallas_fa3.Sm90DecodeConfig(64, 2)
  )
  full = _decode(case, np.arange(4), **options)
  for idx in _SUBSETS:
    got = _decode(case, np.asarray(idx), **options)
    for g, f in zip(got, full):
      np.testing.assert_array_equal(_bits(g), _bits(f)[np.asarray(idx)])


def _spec(batch, capacity, **kw):
  S = jax.ShapeDtypeStruct
  q = S((batch, 1, 8, 128), jnp.bfloat16)
  kc = S((batch, capacity, 1, 128), jnp.bfloat16)
  return make_decode_spec(q, kc, kc, cache_seqlens=0, **kw)


def test_split_counts_follow_the_capacity_not_the_batch():
  """The kernel's automatic count changes with the batch; the invariant
  one is the capacity's 2048-key runs in every backend."""
  config = pallas_fa3.Sm90DecodeConfig(128, 4)
  counts = lambda **kw: {
    config_decode.default_splits(_spec(b, 8192, **kw), config)
    for b in (1, 4, 64)
  }
  assert len(counts()) > 1  # what batch_invariant removes
  assert counts(batch_invariant=True) == {8192 // 2048}
  tiles = blockwise.BlockwiseConfig()  # 128-key tiles: 16 per run
  for b in (1, 64):
    spec = _spec(b, 8192, batch_invariant=True)
    assert blockwise.BACKEND.decode_splits(spec, tiles) == 8192 // 2048


def test_split_span_boundaries_are_fixed_key_positions():
  """Split s covers keys [2048 s, 2048 (s + 1)) clipped to the visible
  tiles, whatever the sequence's own range; without batch_invariant the
  visible tiles are cut into equal runs."""
  spec = _spec(1, 8192, batch_invariant=True)
  tile = 128
  t0, t1 = jnp.int32(3), jnp.int32(40)  # keys [384, 5120)
  spans = [
    tuple(int(x) for x in kvcache.split_span(spec, t0, t1, s, 4, tile))
    for s in range(4)
  ]
  assert spans == [(3, 13), (16, 16), (32, 8), (48, 0)]  # (first, tiles)
  plain = dataclasses.replace(spec, batch_invariant=False)
  spans = [
    tuple(int(x) for x in kvcache.split_span(plain, t0, t1, s, 4, tile))
    for s in range(4)
  ]
  assert spans == [(3, 10), (13, 10), (23, 10), (33, 7)]


@pytest.mark.parametrize("impl", ["blockwise", "reference", "interpret"])
def test_flash_attention_sequences_bitwise_whatever_the_batch(impl, key):
  """flash_attention(batch_invariant=True): permuted and resized batches
  give each sequence's rows bit for bit (forward: out and lse)."""
  ks = jax.random.split(key, 3)
  b = 3
  q = jax.random.normal(ks[0], (b, 80, 4, 64), jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, 200, 2, 64), jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, 200, 2, 64), jnp.bfloat16)
  run = lambda i: run_interpreted(
    pallas_fa3.flash_attention, q[i], k[i], v[i], causal=True,
    return_lse=True, implementation=impl, batch_invariant=True,
  )  # fmt: skip
  full = run(np.arange(b))
  for idx in ([2, 0, 1, 1],):
    got = run(np.asarray(idx))
    for g, f in zip(got, full):
      np.testing.assert_array_equal(_bits(g), _bits(f)[np.asarray(idx)])


def test_flash_attention_blockwise_segments_bitwise(key):
  """With segment ids (whose skipped tiles are the batch's union of
  spans), blockwise still gives each sequence its bits."""
  ks = jax.random.split(key, 3)
  q, k, v = (jax.random.normal(x, (3, 96, 2, 64), jnp.bfloat16) for x in ks)
  ids = jnp.asarray(
    [[0] * 96, [0] * 30 + [1] * 66, [0] * 70 + [1] * 26], jnp.int32
  )
  run = lambda i: pallas_fa3.flash_attention(
    q[i], k[i], v[i], segment_ids=ids[i], causal=True, return_lse=True,
    implementation="blockwise", batch_invariant=True,
  )  # fmt: skip
  full = run(np.arange(3))
  got = run(np.asarray([0]))
  for g, f in zip(got, full):
    np.testing.assert_array_equal(_bits(g), _bits(f)[:1])


def test_batch_invariant_implies_deterministic_gradients():
  """The plan says the gradients are deterministic."""
  S = jax.ShapeDtypeStruct
  x = S((2, 128, 4, 64), jnp.bfloat16)
  text = pallas_fa3.explain(x, x, x, batch_invariant=True)
  assert "deterministic" in text.splitlines()[0]


def test_bad_batch_invariant_names_the_argument():
  x = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
  with pytest.raises(TypeError, match="batch_invariant"):
    pallas_fa3.flash_attention(x, x, x, batch_invariant="yes")
  with pytest.raises(TypeError, match="batch_invariant"):
    pallas_fa3.flash_attention_with_kvcache(
      x, x, x, cache_seqlens=1, batch_invariant=1
    )


def test_sm90_segments_refuse_batch_invariant():
  """The sm90 forward's kernel-or-twin choice is per batch: refused."""
  x = jnp.zeros((2, 64, 1, 64), jnp.bfloat16)
  ids = jnp.zeros((2, 64), jnp.int32)
  with pytest.raises(NotImplementedError, match="batch_invariant"):
    pallas_fa3.explain(
      x, x, x, segment_ids=ids, implementation="interpret",
      batch_invariant=True,
    )  # fmt: skip
