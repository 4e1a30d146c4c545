"""make_attention_fn inside Flax's own attention layers (nnx and linen) vs Flax's attention."""

from __future__ import annotations

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn, nnx
from flax_checks import (
  BIAS_INIT,
  assert_layer_within_tolerance,
  linen_forward_and_grads,
  nnx_forward_and_grads,
  normal,
  random_layer_inputs,
)

import pallas_fa3
from pallas_fa3.flax import FlashAttentionFallbackWarning, make_attention_fn
from pallas_fa3.testing import assert_within_tolerance

_FEATURES, _HEADS, _BATCH, _SEQ = 32, 4, 2, 13
_QKV_SHAPE = (2, 7, 4, 8)  # [batch, seq, heads, head_dim] for direct calls


def _qkv(rng, shape=_QKV_SHAPE, kv_heads=None, seq_kv=None, dtype=jnp.float32):
  *batch, s, h, d = shape
  kv_shape = (*batch, seq_kv or s, kv_heads or h, d)
  return (
    normal(rng, shape, dtype),
    normal(rng, kv_shape, dtype),
    normal(rng, kv_shape, dtype),
  )


# ---------------------------------------------------------------------------
# Equivalence inside Flax's layers: output and parameter gradients.


# Pruned product: MQA is GQA with one group, which the core suite covers.
@pytest.mark.parametrize(
  "heads_kv, causal, dtype",
  [
    (_HEADS, False, jnp.float32),  # MHA
    (2, True, jnp.bfloat16),  # GQA
  ],
  ids=["mha-f32", "gqa-causal-bf16"],
)
def test_nnx_layer_matches_flax(rng, heads_kv, causal, dtype):
  x, x32, ct = random_layer_inputs(rng, (_BATCH, _SEQ), _FEATURES, dtype)
  seed = int(rng.integers(2**30))

  def layer(dtype, **kwargs):
    return nnx.MultiHeadAttention(
      _HEADS,
      _FEATURES,
      num_kv_heads=heads_kv,
      dtype=dtype,
      decode=False,
      bias_init=BIAS_INIT,
      rngs=nnx.Rngs(seed),
      **kwargs,
    )

  ours = layer(dtype, attention_fn=make_attention_fn("blockwise"))
  got = nnx_forward_and_grads(ours, x, ct, is_causal=causal)
  golden = nnx_forward_and_grads(layer(None), x32, ct, is_causal=causal)
  naive = (
    golden
    if dtype == jnp.float32
    else nnx_forward_and_grads(layer(dtype), x, ct, is_causal=causal)
  )
  assert_layer_within_tolerance(got, naive, golden, dtype)


def test_linen_layer_matches_flax(rng):
  dtype = jnp.bfloat16
  x, x32, ct = random_layer_inputs(rng, (_BATCH, _SEQ), _FEATURES, dtype)
  # Under jit the mask is a tracer: flash attention serves it only because
  # the attention_fn declares it causal (and checks it on device).
  traced = {"mask": nn.make_causal_mask(x[..., 0])}
  module = lambda dtype, **kw: nn.MultiHeadDotProductAttention(
    num_heads=_HEADS, dtype=dtype, bias_init=nn.initializers.normal(0.5), **kw
  )
  params = module(None).init(jax.random.key(int(rng.integers(2**30))), x32)
  ours = module(dtype, attention_fn=make_attention_fn(causal=True))
  got = linen_forward_and_grads(ours, params, x, ct, traced)
  golden = linen_forward_and_grads(module(None), params, x32, ct, traced)
  naive = linen_forward_and_grads(module(dtype), params, x, ct, traced)
  assert_layer_within_tolerance(got, naive, golden, dtype)


def _numpy_attention(q, k, v, visible=None):
  """Float64 softmax(q k^T / sqrt(d)) v with an explicit [seq_q, seq_kv] mask."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  group = q.shape[-2] // k.shape[-2]
  k, v = (np.repeat(x, group, axis=-2) for x in (k, v))
  s = np.einsum("...qhd,...khd->...hqk", q, k) / np.sqrt(q.shape[-1])
  if visible is not None:
    s = np.where(visible, s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("...hqk,...khd->...qhd", p / p.sum(-1, keepdims=True), v)


def test_extra_and_missing_batch_axes(rng):
  fn = make_attention_fn()
  q, k, v = _qkv(rng, shape=(2, 3, 5, 2, 8))  # two batch axes
  for args in ((q, k, v), (q[0, 0], k[0, 0], v[0, 0])):  # and none
    got = fn(*args)
    want = _numpy_attention(*args)
    assert got.shape == want.shape
    assert_within_tolerance("out", got, want, want)


@pytest.mark.parametrize("seq_q, seq_kv", [(5, 9), (9, 5)])
def test_is_causal_is_top_left_aligned_like_flax(rng, seq_q, seq_kv):
  """Flax's is_causal is tril(ones(seq_q, seq_kv)), also when seq_q != seq_kv."""
  q, k, v = _qkv(rng, shape=(2, seq_q, 4, 8), kv_heads=2, seq_kv=seq_kv)
  want = _numpy_attention(q, k, v, np.tril(np.ones((seq_q, seq_kv), bool)))
  assert_within_tolerance(
    "out", make_attention_fn()(q, k, v, is_causal=True), want, want
  )


def test_dtype_argument_casts_like_flax(rng):
  q, k, v = _qkv(rng)
  got = make_attention_fn()(q, k, v, dtype=jnp.bfloat16)
  low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  naive = jax.jit(
    pallas_fa3.reference_attention, static_argnames=("intermediate_dtype",)
  )(*low, intermediate_dtype=jnp.bfloat16)
  assert got.dtype == jnp.bfloat16
  assert_within_tolerance("out", got, naive, _numpy_attention(*low))


def test_concrete_masks_are_recognised(rng):
  """Outside jit: all-True is no mask, tril is causal; no fallback needed."""
  q, k, v = _qkv(rng)
  fn = make_attention_fn(on_unsupported="raise")
  causal = nnx.make_causal_mask(jnp.ones(q.shape[:2]))  # float 0/1 [b, 1, s, s]
  np.testing.assert_array_equal(
    fn(q, k, v, mask=causal), fn(q, k, v, is_causal=True)
  )
  everything = jnp.ones((1, 1, q.shape[1], k.shape[1]), bool)
  np.testing.assert_array_equal(fn(q, k, v, mask=everything), fn(q, k, v))


def test_implementation_and_options_are_forwarded(rng):
  q, k, v = _qkv(rng)
  got = make_attention_fn("reference", softmax_scale=0.3)(q, k, v)
  want = pallas_fa3.flash_attention(
    q, k, v, softmax_scale=0.3, implementation="reference"
  )
  np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------
# What flash attention cannot compute: raise, or Flax's attention + a warning.


def _unsupported_call(feature, rng):
  """(call(attention_fn) -> out, the feature's word in the messages)."""
  q, k, v = _qkv(rng)
  if feature == "bias":
    bias = normal(rng, (2, 4, 7, 7))
    return lambda fn: fn(q, k, v, bias=bias), "bias"
  assert feature == "dropout"
  return lambda fn: fn(
    q,
    k,
    v,
    dropout_rate=0.5,
    deterministic=False,
    dropout_rng=jax.random.key(3),
  ), "dropout"


# Masks are no such feature: any mask runs (tests/test_flax_segments.py).
_FEATURES_UNSUPPORTED = ("bias", "dropout")


@pytest.mark.parametrize("feature", _FEATURES_UNSUPPORTED)
def test_unsupported_raises_naming_the_feature(rng, feature):
  call, word = _unsupported_call(feature, rng)
  with pytest.raises(NotImplementedError, match=word):
    call(make_attention_fn())  # "raise" is the default


@pytest.mark.parametrize("feature", _FEATURES_UNSUPPORTED)
def test_unsupported_falls_back_to_flax_with_a_warning(rng, feature):
  call, word = _unsupported_call(feature, rng)
  with pytest.warns(FlashAttentionFallbackWarning, match=word):
    got = call(make_attention_fn(on_unsupported="fallback"))
  np.testing.assert_allclose(
    got, call(nnx.dot_product_attention), rtol=1e-6, atol=1e-6
  )


def test_fallback_warns_once_per_feature(rng):
  call, _ = _unsupported_call("bias", rng)
  fn = make_attention_fn(on_unsupported="fallback")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    call(fn)
    call(fn)
  assert [w.category for w in caught] == [FlashAttentionFallbackWarning]


def test_fallback_applies_the_softmax_scale_option(rng):
  q, k, v = _qkv(rng)
  zero_bias = jnp.zeros((1, 1, 7, 7))  # unsupported: forces the fallback
  fn = make_attention_fn(on_unsupported="fallback", softmax_scale=0.3)
  with pytest.warns(FlashAttentionFallbackWarning):
    fallback = fn(q, k, v, bias=zero_bias)
  want = pallas_fa3.reference_attention(q, k, v, softmax_scale=0.3)
  assert_within_tolerance("fallback", fallback, want, want)
  assert_within_tolerance("flash", fn(q, k, v), want, want)


# Flax's own sow path (what the fallback runs) is deprecated outside
# nnx.capture in flax 0.12; that is Flax's warning, not ours.
@pytest.mark.filterwarnings(
  "ignore:Using 'Module.sow\\(\\)':DeprecationWarning"
)
@pytest.mark.parametrize("on_unsupported", ["raise", "fallback"])
def test_nnx_sow_weights(rng, on_unsupported):
  x, _, _ = random_layer_inputs(rng, (_BATCH, 5), _FEATURES, jnp.float32)
  layer = lambda **kw: nnx.MultiHeadAttention(
    _HEADS, _FEATURES, decode=False, rngs=nnx.Rngs(0), **kw
  )
  ours = layer(attention_fn=make_attention_fn(on_unsupported=on_unsupported))
  if on_unsupported == "raise":
    with pytest.raises(NotImplementedError, match="sow"):
      ours(x, sow_weights=True)
    return
  flax_layer = layer()
  with pytest.warns(FlashAttentionFallbackWarning, match="sow"):
    got = ours(x, sow_weights=True)
  np.testing.assert_array_equal(got, flax_layer(x, sow_weights=True))
  weights = nnx.pop(ours, nnx.Intermediate)["attention_weights"]
  want = nnx.pop(flax_layer, nnx.Intermediate)["attention_weights"]
  np.testing.assert_array_equal(weights.get_value()[0], want.get_value()[0])


@pytest.mark.parametrize("on_unsupported", ["raise", "fallback"])
def test_linen_sow_weights(rng, on_unsupported):
  x, _, _ = random_layer_inputs(rng, (_BATCH, 5), _FEATURES, jnp.float32)
  flax_module = nn.MultiHeadDotProductAttention(num_heads=_HEADS)
  ours = nn.MultiHeadDotProductAttention(
    num_heads=_HEADS,
    attention_fn=make_attention_fn(on_unsupported=on_unsupported),
  )
  params = flax_module.init(jax.random.key(0), x)
  apply = lambda m: m.apply(
    params, x, sow_weights=True, mutable=["intermediates"]
  )
  if on_unsupported == "raise":
    with pytest.raises(NotImplementedError, match="sow"):
      apply(ours)
    return
  with pytest.warns(FlashAttentionFallbackWarning, match="sow"):
    got, state = apply(ours)
  want, want_state = apply(flax_module)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(
    state["intermediates"]["attention_weights"][0],
    want_state["intermediates"]["attention_weights"][0],
  )


def test_deterministic_dropout_uses_flash_attention(rng):
  q, k, v = _qkv(rng)
  fn = make_attention_fn(on_unsupported="raise")
  np.testing.assert_array_equal(
    fn(q, k, v, dropout_rate=0.5, deterministic=True), fn(q, k, v)
  )


def test_head_dim_over_the_limit_is_unsupported(rng):
  q, k, v = _qkv(rng, shape=(1, 3, 1, pallas_fa3.spec.MAX_HEAD_DIM + 8))
  with pytest.raises(NotImplementedError, match="head_dim"):
    make_attention_fn()(q, k, v)


# ---------------------------------------------------------------------------
# make_attention_fn(causal=True): the declaration that lets traced masks in.


def test_declared_causal_without_a_mask_is_causal(rng):
  q, k, v = _qkv(rng)
  np.testing.assert_array_equal(
    make_attention_fn(causal=True)(q, k, v),
    make_attention_fn()(q, k, v, is_causal=True),
  )


def test_declared_causal_traced_mask(rng):
  q, k, v = _qkv(rng)
  fn = make_attention_fn(causal=True)
  run = jax.jit(lambda m: fn(q, k, v, mask=m))
  causal = nnx.make_causal_mask(jnp.ones(q.shape[:2]))
  np.testing.assert_allclose(run(causal), fn(q, k, v), rtol=1e-6, atol=1e-6)
  # A traced mask that breaks the promise cannot raise: the output is NaN.
  assert bool(jnp.all(jnp.isnan(run(jnp.ones_like(causal)))))


def test_declared_causal_concrete_mask_that_is_not_causal_raises(rng):
  q, k, v = _qkv(rng)
  with pytest.raises(ValueError, match="causal=True"):
    make_attention_fn(causal=True)(q, k, v, mask=jnp.ones((1, 1, 7, 7), bool))


# ---------------------------------------------------------------------------
# Signature and bad options.


@pytest.mark.parametrize(
  "flax_fn",
  [nnx.dot_product_attention, nn.dot_product_attention],
  ids=["nnx", "linen"],
)
def test_accepts_every_keyword_of_flax_attention(flax_fn):
  """Linen filters keywords by signature; nnx passes its own unconditionally."""
  ours = set(inspect.signature(make_attention_fn()).parameters)
  assert set(inspect.signature(flax_fn).parameters) <= ours


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(on_unsupported="ignore"), ValueError, "on_unsupported"),
    (dict(implementation="cuda"), ValueError, "implementation"),
    (dict(causal=1), TypeError, "causal"),
    (dict(return_lse=True), TypeError, "return_lse"),
    (dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
  ],
)
def test_bad_options(kwargs, error, match):
  with pytest.raises(error, match=match):
    make_attention_fn(**kwargs)


def test_mask_that_does_not_broadcast(rng):
  q, k, v = _qkv(rng)
  with pytest.raises(ValueError, match="mask"):
    make_attention_fn()(q, k, v, mask=jnp.ones((3, 1, 7, 7), bool))
