"""Sliding windows, softcap and sinks in the Flax layers and make_attention_fn.

The layers must compute exactly `flash_attention` of their own projections
with the options forwarded (and, within the tolerance rule, the float32
`reference_attention`); `make_attention_fn` must compute Flax's top-left
aligned window, checked against a float64 numpy attention with an explicit
mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn, nnx
from flax_checks import BIAS_INIT, flat, normal

import pallas_fa3
from pallas_fa3.flax import (
  FlashAttentionFallbackWarning,
  FlashMultiHeadAttention,
  FlashMultiHeadDotProductAttention,
  make_attention_fn,
)
from pallas_fa3.testing import assert_within_tolerance

_FEATURES, _HEADS, _KV_HEADS, _BATCH, _SEQ = 32, 4, 2, 2, 11

# One case per option, then all of them with GQA and causal.
_OPTIONS = {
  "window": dict(window_size=(3, 2)),
  "softcap": dict(softcap=2.0),
  "sinks": dict(sinks=True),
  "all-causal-gqa": dict(
    causal=True, window_size=(4, None), softcap=5.0, sinks=True
  ),
}


def _attention_kwargs(options, sinks):
  """flash_attention's keywords for the layer `options` and sink values."""
  kwargs = {k: v for k, v in options.items() if k != "sinks"}
  return dict(kwargs, sinks=sinks)


def _nnx_layer(options, rng, **kwargs):
  kv_heads = _KV_HEADS if options.get("causal") else None
  layer = FlashMultiHeadAttention(
    _HEADS,
    _FEATURES,
    num_kv_heads=kv_heads,
    bias_init=BIAS_INIT,
    rngs=nnx.Rngs(int(rng.integers(2**30))),
    **options,
    **kwargs,
  )
  if layer.sinks is not None:  # non-zero sinks: a visible contribution
    layer.sinks[...] = normal(rng, (_HEADS,))
  return layer


@pytest.mark.parametrize("options", _OPTIONS.values(), ids=_OPTIONS.keys())
def test_nnx_layer_is_flash_attention_of_its_projections(rng, options):
  layer = _nnx_layer(options, rng)
  x = normal(rng, (_BATCH, _SEQ, _FEATURES))
  q, k, v = layer.query(x), layer.key(x), layer.value(x)
  sinks = None if layer.sinks is None else layer.sinks[...]
  kwargs = _attention_kwargs(options, sinks)
  got = layer(x)
  np.testing.assert_array_equal(
    got, layer.out(pallas_fa3.flash_attention(q, k, v, **kwargs))
  )
  want = layer.out(pallas_fa3.reference_attention(q, k, v, **kwargs))
  assert_within_tolerance("out", got, want, want)
  # Each option changes the function: without them the output differs.
  plain = layer.out(pallas_fa3.flash_attention(q, k, v, causal=layer.causal))
  assert float(jnp.max(jnp.abs(plain - got))) > 1e-3


@pytest.mark.parametrize("options", _OPTIONS.values(), ids=_OPTIONS.keys())
def test_linen_layer_is_flash_attention_of_its_projections(rng, options):
  kv_heads = _KV_HEADS if options.get("causal") else None
  module = FlashMultiHeadDotProductAttention(
    num_heads=_HEADS, num_kv_heads=kv_heads, **options
  )
  x = normal(rng, (_BATCH, _SEQ, _FEATURES))
  params = module.init(jax.random.key(int(rng.integers(2**30))), x)
  params = jax.tree.map(lambda p: p + 0.5 * normal(rng, p.shape), params)
  got = jax.jit(module.apply)(params, x)
  p = params["params"]
  hi = jax.lax.Precision.HIGHEST
  q, k, v = (
    jnp.einsum("bsf,fhd->bshd", x, p[name]["kernel"], precision=hi)
    + p[name]["bias"]
    for name in ("query", "key", "value")
  )
  kwargs = _attention_kwargs(options, p.get("sinks"))
  o = pallas_fa3.reference_attention(q, k, v, **kwargs)
  want = (
    jnp.einsum("bshd,hdf->bsf", o, p["out"]["kernel"], precision=hi)
    + p["out"]["bias"]
  )
  assert_within_tolerance("out", got, want, want)


# ---------------------------------------------------------------------------
# The sinks parameter.


def test_sinks_parameter_is_float32_zeros_and_learns(rng):
  layer = FlashMultiHeadAttention(
    _HEADS,
    _FEATURES,
    num_kv_heads=_KV_HEADS,
    causal=True,
    sinks=True,
    param_dtype=jnp.bfloat16,
    rngs=nnx.Rngs(0),
  )
  sinks = layer.sinks[...]
  assert sinks.shape == (_HEADS,) and sinks.dtype == jnp.float32
  np.testing.assert_array_equal(sinks, np.zeros(_HEADS))
  x = normal(rng, (_BATCH, _SEQ, _FEATURES), jnp.bfloat16)
  ct = normal(rng, (_BATCH, _SEQ, _FEATURES))
  loss = lambda m: jnp.sum(m(x).astype(jnp.float32) * ct)
  grads = flat(nnx.jit(nnx.grad(loss))(layer))
  assert grads["sinks"].shape == (_HEADS,)
  assert bool(jnp.all(jnp.isfinite(grads["sinks"])))
  assert bool(jnp.all(grads["sinks"] != 0)), grads["sinks"]
  # Without sinks the parameters are exactly Flax's.
  no_sinks = FlashMultiHeadAttention(_HEADS, _FEATURES, rngs=nnx.Rngs(0))
  flax_layer = nnx.MultiHeadAttention(
    _HEADS, _FEATURES, decode=False, rngs=nnx.Rngs(0)
  )
  assert set(flat(nnx.state(no_sinks, nnx.Param))) == set(
    flat(nnx.state(flax_layer, nnx.Param))
  )


def test_linen_sinks_parameter_is_float32_zeros_and_learns(rng):
  module = FlashMultiHeadDotProductAttention(
    num_heads=_HEADS, sinks=True, param_dtype=jnp.bfloat16
  )
  x = normal(rng, (_BATCH, _SEQ, _FEATURES))
  params = module.init(jax.random.key(0), x)
  sinks = params["params"]["sinks"]
  assert sinks.shape == (_HEADS,) and sinks.dtype == jnp.float32
  np.testing.assert_array_equal(sinks, np.zeros(_HEADS))
  ct = normal(rng, (_BATCH, _SEQ, _FEATURES))
  loss = lambda p: jnp.sum(module.apply(p, x).astype(jnp.float32) * ct)
  grad = jax.jit(jax.grad(loss))(params)["params"]["sinks"]
  assert bool(jnp.all(grad != 0)), grad
  plain = FlashMultiHeadDotProductAttention(num_heads=_HEADS)
  assert "sinks" not in plain.init(jax.random.key(0), x)["params"]


# ---------------------------------------------------------------------------
# Bad values: each error names its argument.

_BAD_OPTIONS = [
  (dict(window_size=3), TypeError, "window_size"),
  (dict(window_size=(1, 2, 3)), ValueError, "window_size"),
  (dict(window_size=(-2, None)), ValueError, "window_size"),
  (dict(window_size=(1.5, None)), TypeError, "window_size"),
  (dict(softcap=-1.0), ValueError, "softcap"),
  (dict(softcap="50"), TypeError, "softcap"),
  (dict(sinks="yes"), TypeError, "sinks"),
]


@pytest.mark.parametrize("kwargs, error, match", _BAD_OPTIONS)
def test_nnx_bad_options_raise_at_construction(kwargs, error, match):
  with pytest.raises(error, match=match):
    FlashMultiHeadAttention(_HEADS, _FEATURES, rngs=nnx.Rngs(0), **kwargs)


@pytest.mark.parametrize("kwargs, error, match", _BAD_OPTIONS)
def test_linen_bad_options_raise_at_init(kwargs, error, match):
  x = jnp.ones((1, 3, _FEATURES))
  with pytest.raises(error, match=match):
    FlashMultiHeadDotProductAttention(num_heads=_HEADS, **kwargs).init(
      jax.random.key(0), x
    )


# ---------------------------------------------------------------------------
# make_attention_fn(window_size=, softcap=): Flax's top-left alignment.


def _numpy_attention(q, k, v, window, causal, softcap):
  """Float64 top-left attention: query i sees key j iff i - left <= j <=
  i + right (and j <= i if causal); a row that sees no key outputs the mean
  of the values (Flax's convention, which the adapter keeps)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  group = q.shape[-2] // k.shape[-2]
  k, v = (np.repeat(x, group, axis=-2) for x in (k, v))
  s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  if softcap:
    s = softcap * np.tanh(s / softcap)
  i = np.arange(q.shape[1])[:, None]
  j = np.arange(k.shape[1])[None, :]
  left, right = window
  visible = np.ones((q.shape[1], k.shape[1]), bool)
  if left is not None:
    visible &= j >= i - left
  if right is not None:
    visible &= j <= i + right
  if causal:
    visible &= j <= i
  s = np.where(visible, s, -np.inf)
  m = np.max(s, axis=-1, keepdims=True)
  p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
  denom = np.sum(p, axis=-1, keepdims=True)
  p = np.where(denom > 0, p / np.where(denom > 0, denom, 1.0), 1 / k.shape[1])
  return np.einsum("bhqk,bkhd->bqhd", p, v)


# (seq_q, seq_kv, window, causal): square; keys sliced off (seq_q < seq_kv
# with a right bound); queries that see nothing (seq_q > seq_kv + left);
# causal both ways; one-sided windows.
_TOP_LEFT_CASES = [
  (7, 7, (2, 1), False),
  (4, 11, (1, 2), False),
  (12, 5, (2, 0), False),
  (5, 11, (3, None), True),
  (11, 5, (2, None), True),
  (9, 4, (None, 1), False),
]


@pytest.mark.parametrize(
  "seq_q, seq_kv, window, causal",
  _TOP_LEFT_CASES,
  ids=[f"q{c[0]}-kv{c[1]}-w{c[2]}-c{int(c[3])}" for c in _TOP_LEFT_CASES],
)
def test_window_and_softcap_are_top_left_aligned(
  rng, seq_q, seq_kv, window, causal
):
  q = normal(rng, (2, seq_q, 4, 8))
  k, v = normal(rng, (2, seq_kv, 2, 8)), normal(rng, (2, seq_kv, 2, 8))
  fn = make_attention_fn(window_size=window, softcap=3.0)
  got = fn(q, k, v, is_causal=causal)
  want = _numpy_attention(q, k, v, window, causal, 3.0)
  assert got.shape == want.shape
  assert_within_tolerance("out", got, want, want)


def test_nnx_flax_layer_with_window_matches_the_native_layer(rng):
  """Self-attention: the adapter's window is the native layer's window."""
  options = dict(window_size=(3, None), softcap=4.0)
  flax_layer = nnx.MultiHeadAttention(
    _HEADS,
    _FEATURES,
    num_kv_heads=_KV_HEADS,
    decode=False,
    bias_init=BIAS_INIT,
    rngs=nnx.Rngs(int(rng.integers(2**30))),
    attention_fn=make_attention_fn(**options),
  )
  ours = FlashMultiHeadAttention(
    _HEADS,
    _FEATURES,
    num_kv_heads=_KV_HEADS,
    causal=True,
    rngs=nnx.Rngs(0),
    **options,
  )
  nnx.update(ours, nnx.state(flax_layer, nnx.Param))
  x = normal(rng, (_BATCH, _SEQ, _FEATURES))
  np.testing.assert_array_equal(flax_layer(x, is_causal=True), ours(x))


def test_linen_flax_layer_with_window_under_jit(rng):
  """Declared causal (a traced mask) with a window, inside Linen's module."""
  options = dict(window_size=(2, None), softcap=3.0)
  x = normal(rng, (_BATCH, _SEQ, _FEATURES))
  flax_module = nn.MultiHeadDotProductAttention(
    num_heads=_HEADS, attention_fn=make_attention_fn(causal=True, **options)
  )
  ours = FlashMultiHeadDotProductAttention(
    num_heads=_HEADS, causal=True, **options
  )
  params = flax_module.init(jax.random.key(0), x)
  mask = nn.make_causal_mask(x[..., 0])
  got = jax.jit(lambda p, m: flax_module.apply(p, x, mask=m))(params, mask)
  np.testing.assert_allclose(
    got, jax.jit(ours.apply)(params, x), rtol=1e-6, atol=1e-6
  )


def test_window_and_softcap_never_fall_back(rng):
  """Flax's attention has no window or softcap: unsupported calls raise."""
  q, k = normal(rng, (2, 7, 4, 8)), normal(rng, (2, 7, 4, 8))
  bias = normal(rng, (2, 4, 7, 7))
  for options, word in (
    (dict(window_size=(2, None)), "window_size"),
    (dict(softcap=5.0), "softcap"),
  ):
    fn = make_attention_fn(on_unsupported="fallback", **options)
    with pytest.raises(NotImplementedError, match=word) as e:
      fn(q, k, k, bias=bias)
    assert "bias" in str(e.value)
  # Without them the same call falls back (the rule is unchanged).
  with pytest.warns(FlashAttentionFallbackWarning, match="bias"):
    make_attention_fn(on_unsupported="fallback")(q, k, k, bias=bias)


def test_make_attention_fn_options_and_off_values(rng):
  q, k = normal(rng, (2, 7, 4, 8)), normal(rng, (2, 7, 2, 8))
  plain = make_attention_fn()(q, k, k, is_causal=True)
  # softcap 0.0 is off; a window covering every key is no window.
  np.testing.assert_array_equal(
    make_attention_fn(softcap=0.0, window_size=(None, None))(
      q, k, k, is_causal=True
    ),
    plain,
  )
  fn = make_attention_fn("reference", window_size=(2, 0), softcap=1.5)
  assert "window_size=(2, 0)" in fn.__doc__ and "softcap=1.5" in fn.__doc__
  want = pallas_fa3.flash_attention(
    q,
    k,
    k,
    causal=True,
    window_size=(2, None),
    softcap=1.5,
    implementation="reference",
  )
  np.testing.assert_allclose(fn(q, k, k), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(window_size=(1, 2, 3)), ValueError, "window_size"),
    (dict(window_size=(None, -2)), ValueError, "window_size"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(sinks=jnp.zeros(4)), TypeError, "sinks"),
  ],
)
def test_make_attention_fn_bad_options(kwargs, error, match):
  with pytest.raises(error, match=match):
    make_attention_fn(**kwargs)
