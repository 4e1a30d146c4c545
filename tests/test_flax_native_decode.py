"""The native layers decode: prefill + steps == one causal call.

`FlashMultiHeadAttention(decode=True)` (nnx) and
`FlashMultiHeadDotProductAttention(decode=True)` (linen) cache K/V per kv
head and each sequence's length; a chunk of any length is attended by
`flash_attention_with_kvcache` (or `flash_attention` for a prefill). The
oracle is the same layer's full causal call on the `reference` backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax_checks import normal

from pallas_fa3.flax import (
  FlashMultiHeadAttention,
  FlashMultiHeadDotProductAttention,
)
from pallas_fa3.testing import assert_within_tolerance

_FEATURES, _HEADS, _KV_HEADS, _BATCH, _SEQ, _CACHE = 16, 4, 2, 2, 9, 12

_VARIANTS = {
  "plain": dict(),
  "window": dict(window_size=(3, None)),
  "softcap-sinks": dict(softcap=5.0, sinks=True),
}


def _layer(seed, implementation="blockwise", **kwargs):
  layer = FlashMultiHeadAttention(
    _HEADS,
    _FEATURES,
    num_kv_heads=_KV_HEADS,
    causal=True,
    rope=True,
    implementation=implementation,
    rngs=nnx.Rngs(seed),
    **kwargs,
  )
  if layer.sinks is not None:  # non-zero sinks, so that they count
    layer.sinks[...] = jnp.linspace(-1.0, 1.0, _HEADS)
  return layer


def _oracle(layer, x):
  """The layer's full causal call on the reference backend (same params)."""
  layer.implementation = "reference"
  try:
    return layer(x)
  finally:
    layer.implementation = "blockwise"


@pytest.mark.parametrize("variant", sorted(_VARIANTS))
def test_nnx_prefill_and_steps_equal_the_full_call(rng, variant):
  layer = _layer(int(rng.integers(2**30)), **_VARIANTS[variant])
  x = normal(rng, (_BATCH, _SEQ, _FEATURES))
  want = _oracle(layer, x)
  layer.init_cache((_BATCH, _CACHE, _FEATURES))
  outs = [layer(x[:, :4], decode=True, prefill=True)]
  step = nnx.jit(lambda m, t: m(t, decode=True))
  outs.append(step(layer, x[:, 4:6]))  # a chunk appended to the cache
  outs += [step(layer, x[:, i : i + 1]) for i in range(6, _SEQ)]
  got = jnp.concatenate(outs, axis=1)
  assert_within_tolerance("decode", got, want, want)
  np.testing.assert_array_equal(layer.cache_lengths[...], [_SEQ] * _BATCH)
  # GQA: the cache holds the kv heads only.
  assert layer.cached_key[...].shape == (_BATCH, _CACHE, _KV_HEADS, 4)


def test_ragged_prompts_decode_together(rng):
  """Prompts of 3 and 6 tokens, right-padded into one prefill, then steps:
  each sequence's outputs are those of its own full call."""
  layer = _layer(int(rng.integers(2**30)), window_size=(4, None))
  lengths = np.array([3, 6])
  xs = [normal(rng, (1, n + 3, _FEATURES)) for n in lengths]
  prompts = jnp.zeros((_BATCH, 6, _FEATURES))
  for b, (n, x) in enumerate(zip(lengths, xs)):
    prompts = prompts.at[b, :n].set(x[0, :n])
  layer.init_cache((_BATCH, _CACHE, _FEATURES))
  first = layer(
    prompts, decode=True, prefill=True, chunk_lengths=jnp.asarray(lengths)
  )
  tokens = lambda i: jnp.concatenate(
    [x[:, n + i : n + i + 1] for n, x in zip(lengths, xs)]
  )
  steps = [layer(tokens(i), decode=True) for i in range(3)]
  for b, (n, x) in enumerate(zip(lengths, xs)):
    want = _oracle(layer, x)[0]
    got = jnp.concatenate([first[b, :n]] + [s[b] for s in steps])
    assert_within_tolerance(f"sequence {b}", got, want, want)
  np.testing.assert_array_equal(layer.cache_lengths[...], lengths + 3)


def test_one_compilation_serves_every_step(rng):
  layer = _layer(int(rng.integers(2**30)))
  layer.init_cache((_BATCH, _CACHE, _FEATURES))
  traces = []

  @nnx.jit
  def step(m, token):
    traces.append(1)
    return m(token, decode=True)

  for _ in range(4):
    step(layer, normal(rng, (_BATCH, 1, _FEATURES)))
  assert len(traces) == 1
  np.testing.assert_array_equal(layer.cache_lengths[...], [4, 4])


def test_writing_past_the_cache_is_an_error(rng):
  layer = _layer(int(rng.integers(2**30)))
  layer.init_cache((_BATCH, 4, _FEATURES))
  with pytest.raises(ValueError, match="max_length 4"):
    layer(normal(rng, (_BATCH, 5, _FEATURES)), decode=True, prefill=True)
  layer(normal(rng, (_BATCH, 3, _FEATURES)), decode=True, prefill=True)
  with pytest.raises(ValueError, match="overflows the cache"):
    layer(normal(rng, (_BATCH, 2, _FEATURES)), decode=True)
  # Traced lengths cannot raise: the overflowing sequences are NaN.
  step = nnx.jit(lambda m, t: m(t, decode=True))
  assert bool(jnp.isnan(step(layer, normal(rng, (_BATCH, 2, _FEATURES)))).all())


@pytest.mark.parametrize(
  "call, error, match",
  [
    (lambda m, x: m(x, decode=True), ValueError, "init_cache"),
    (lambda m, x: m(x, prefill=True), ValueError, "prefill"),
    (lambda m, x: m(x, chunk_lengths=jnp.ones(2, int)), ValueError, "chunk_l"),
    (lambda m, x: m(x, x, decode=True), ValueError, "inputs_k"),
    (lambda m, x: m(x, decode=True, prefill=1), TypeError, "prefill"),
  ],
  ids=["no-cache", "prefill", "chunk_lengths", "inputs_k", "prefill-type"],
)
def test_bad_decode_calls_raise_naming_them(rng, call, error, match):
  layer = _layer(0)
  with pytest.raises(error, match=match):
    call(layer, normal(rng, (_BATCH, 2, _FEATURES)))


def test_cache_dtype_must_be_the_compute_dtype(rng):
  layer = _layer(0, dtype=jnp.bfloat16)
  layer.init_cache((_BATCH, _CACHE, _FEATURES))  # float32
  with pytest.raises(TypeError, match="dtype=bfloat16"):
    layer(normal(rng, (_BATCH, 1, _FEATURES)), decode=True)


def test_ragged_chunk_needs_a_causal_layer(rng):
  layer = FlashMultiHeadAttention(2, _FEATURES, rngs=nnx.Rngs(0))
  layer.init_cache((_BATCH, _CACHE, _FEATURES))
  with pytest.raises(ValueError, match="causal"):
    layer(
      normal(rng, (_BATCH, 3, _FEATURES)),
      decode=True,
      chunk_lengths=jnp.array([1, 3]),
    )


def _linen(**kwargs):
  """The linen layer as the tests use it (causal, RoPE, blockwise)."""
  return FlashMultiHeadDotProductAttention(
    num_heads=_HEADS,
    num_kv_heads=_KV_HEADS,
    causal=True,
    rope=True,
    implementation="blockwise",
    **kwargs,
  )


def test_linen_prefill_and_steps_under_jit(rng):
  module = _linen(softcap=5.0, sinks=True, window_size=(4, None))
  x = normal(rng, (_BATCH, _SEQ, _FEATURES))
  params = module.init(jax.random.key(int(rng.integers(2**30))), x)
  params = jax.tree.map(lambda p: p + 0.1 * jnp.ones_like(p), params)
  oracle = module.clone(implementation="reference")
  want = oracle.apply(params, x)
  decoder = module.clone(decode=True)
  cache = decoder.init(
    jax.random.key(0), jnp.zeros((_BATCH, _CACHE, _FEATURES))
  )
  cache = cache["cache"]
  assert cache["cached_key"].shape == (_BATCH, _CACHE, _KV_HEADS, 4)

  @jax.jit
  def step(cache, chunk):
    y, state = decoder.apply(
      {**params, "cache": cache}, chunk, mutable=["cache"]
    )
    return y, state["cache"]

  y, state = decoder.apply(
    {**params, "cache": cache}, x[:, :5], prefill=True, mutable=["cache"]
  )
  outs, cache = [y], state["cache"]
  for i in range(5, _SEQ):
    y, cache = step(cache, x[:, i : i + 1])
    outs.append(y)
  got = jnp.concatenate(outs, axis=1)
  assert_within_tolerance("decode", got, want, want)
  np.testing.assert_array_equal(cache["cache_lengths"], [_SEQ] * _BATCH)


def test_linen_packed_continuous_batch(rng):
  """The linen layer's continuous batch (`cu_seqlens`, a cache of 3 rows,
  the last idle): sequence 0 prefills 5 tokens beside sequence 1's 3, then
  2 and 1 more tokens; each sequence's rows equal the full causal call on
  its tokens (the reference backend)."""
  module = _linen(sinks=True)
  x = normal(rng, (2, 7, _FEATURES))
  params = module.init(jax.random.key(3), x)
  params = jax.tree.map(lambda p: p + 0.1 * jnp.ones_like(p), params)
  want = module.clone(implementation="reference").apply(params, x)
  decoder = module.clone(decode=True)
  cache = decoder.init(jax.random.key(0), jnp.zeros((3, _CACHE, _FEATURES)))
  step = jax.jit(
    lambda cache, chunk, cu: decoder.apply(
      {**params, "cache": cache},
      chunk,
      cu_seqlens=cu,
      max_seqlen_q=8,
      mutable=["cache"],
    )  # fmt: skip
  )
  first, state = step(
    cache["cache"],
    jnp.concatenate([x[0, :5], x[1, :3]]),
    jnp.array([0, 5, 8, 8]),
  )
  second, state = step(
    state["cache"],
    jnp.concatenate([x[0, 5:7], x[1, 3:4]]),
    jnp.array([0, 2, 3, 3]),
  )
  got0 = jnp.concatenate([first[:5], second[:2]])
  got1 = jnp.concatenate([first[5:8], second[2:3]])
  assert_within_tolerance("sequence 0", got0, want[0], want[0])
  assert_within_tolerance("sequence 1", got1, want[1, :4], want[1, :4])
  np.testing.assert_array_equal(state["cache"]["cache_lengths"], [7, 4, 0])
  with pytest.raises(ValueError, match="cu_seqlens"):
    decoder.init(jax.random.key(0), x[0], cu_seqlens=jnp.array([0, 7]))
