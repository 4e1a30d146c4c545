"""make_attention_fn in Flax's decode mode, and rows that see no key.

Flax's layers decode one token per call with the mask `[batch..., 1 |
heads, 1, cache_len]`; with `make_attention_fn` as their attention_fn the
steps run flash attention (eagerly and under jit, nnx and linen, whatever
was declared) and give Flax's own layer's numbers. A row that sees no key
gives Flax's value, the mean of the values, on every route.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn, nnx
from flax_checks import BIAS_INIT, normal

from pallas_fa3.flax import FlashAttentionFallbackWarning, make_attention_fn
from pallas_fa3.testing import assert_within_tolerance

_FEATURES, _HEADS, _KV_HEADS, _BATCH, _STEPS = 16, 4, 2, 2, 5

# make_attention_fn variants a model may use; none may fall back or poison.
_FNS = {
  "default": dict(),
  "causal": dict(causal=True),
  "fallback": dict(on_unsupported="fallback"),
  "padding": dict(padding_mask=True, causal=True),
}


def _nnx_steps(layer, x, jit):
  layer.init_cache(x.shape, x.dtype)
  step = nnx.jit(lambda m, t: m(t)) if jit else (lambda m, t: m(t))
  return jnp.concatenate(
    [step(layer, x[:, i : i + 1]) for i in range(x.shape[1])], axis=1
  )


# Pruned: every variant under jit (how models decode); eagerly, causal=True
# (whose concrete decode masks were refused as "above the diagonal").
_NNX_CASES = [(v, True) for v in sorted(_FNS)] + [("causal", False)]


@pytest.mark.parametrize(
  "variant, jit",
  _NNX_CASES,
  ids=[f"{v}-{'jit' if j else 'eager'}" for v, j in _NNX_CASES],
)
def test_nnx_decode_matches_flax(rng, variant, jit):
  seed = int(rng.integers(2**30))
  layer = lambda **kw: nnx.MultiHeadAttention(
    _HEADS,
    _FEATURES,
    num_kv_heads=_KV_HEADS,
    decode=True,
    bias_init=BIAS_INIT,
    rngs=nnx.Rngs(seed),
    **kw,
  )
  x = normal(rng, (_BATCH, _STEPS, _FEATURES))
  want = _nnx_steps(layer(), x, jit)
  fn = make_attention_fn("blockwise", **_FNS[variant])
  with warnings.catch_warnings():  # flash attention, never the fallback
    warnings.simplefilter("error", FlashAttentionFallbackWarning)
    got = _nnx_steps(layer(attention_fn=fn), x, jit)
  assert not bool(jnp.isnan(got).any())
  assert_within_tolerance("steps", got, want, want)


_LINEN_CASES = [("default", True), ("causal", True), ("fallback", False)]


@pytest.mark.parametrize(
  "variant, jit",
  _LINEN_CASES,
  ids=[f"{v}-{'jit' if j else 'eager'}" for v, j in _LINEN_CASES],
)
def test_linen_decode_matches_flax(rng, variant, jit):
  """Flax's own decoding test, step by step: the decode module's steps
  equal the module's full call with the causal mask."""
  x = normal(rng, (_BATCH, _STEPS, _FEATURES))
  module = lambda **kw: nn.MultiHeadDotProductAttention(
    num_heads=_HEADS, bias_init=nn.initializers.normal(0.5), **kw
  )
  params = module().init(jax.random.key(int(rng.integers(2**30))), x)
  want = module().apply(params, x, mask=nn.make_causal_mask(x[..., 0]))
  fn = make_attention_fn("blockwise", **_FNS[variant])
  decoder = module(attention_fn=fn, decode=True)
  cache = decoder.init(jax.random.key(0), x)["cache"]

  def step(cache, token):
    y, state = decoder.apply(
      {**params, "cache": cache}, token, mutable=["cache"]
    )
    return y, state["cache"]

  step = jax.jit(step) if jit else step
  outs = []
  with warnings.catch_warnings():  # flash attention, never the fallback
    warnings.simplefilter("error", FlashAttentionFallbackWarning)
    for i in range(_STEPS):
      y, cache = step(cache, x[:, i : i + 1])
      outs.append(y)
  got = jnp.concatenate(outs, axis=1)
  assert_within_tolerance("steps", got, want, want)


def test_bf16_decode_within_the_tolerance_rule(rng):
  seed = int(rng.integers(2**30))
  layer = lambda dtype, **kw: nnx.MultiHeadAttention(
    _HEADS,
    _FEATURES,
    num_kv_heads=_KV_HEADS,
    decode=True,
    dtype=dtype,
    rngs=nnx.Rngs(seed),
    **kw,
  )
  x = normal(rng, (_BATCH, _STEPS, _FEATURES), jnp.bfloat16)
  fn = make_attention_fn("blockwise", causal=True)
  got = _nnx_steps(layer(jnp.bfloat16, attention_fn=fn), x, jit=True)
  naive = _nnx_steps(layer(jnp.bfloat16), x, jit=True)
  golden = _nnx_steps(layer(jnp.float32), x.astype(jnp.float32), jit=True)
  assert got.dtype == jnp.bfloat16
  assert_within_tolerance("steps", got, naive, golden)


# ---------------------------------------------------------------------------
# One query row: any mask is a key mask, per head too.


def _one_row_call(rng, heads_m, traced):
  q = normal(rng, (_BATCH, 1, _HEADS, 8))
  k = normal(rng, (_BATCH, 9, _KV_HEADS, 8))
  v = normal(rng, (_BATCH, 9, _KV_HEADS, 8))
  mask = rng.random((_BATCH, heads_m, 1, 9)) < 0.5
  mask[0, 0, 0, :] = False  # a row (of one head, or all) that sees no key
  mask[1, :, 0, 3] = True
  fn = make_attention_fn("blockwise", causal=True)
  call = lambda m: fn(q, k, v, mask=m)
  got = jax.jit(call)(mask) if traced else call(mask)
  return got, nnx.dot_product_attention(q, k, v, mask=mask)


@pytest.mark.parametrize("traced", [False, True], ids=["concrete", "traced"])
@pytest.mark.parametrize("heads_m", [1, _HEADS], ids=["key-mask", "per-head"])
def test_one_row_masks_are_key_masks(rng, heads_m, traced):
  got, want = _one_row_call(rng, heads_m, traced)
  assert_within_tolerance("out", got, want, want)


def test_one_row_mask_with_a_window_raises(rng):
  q, k, v = (normal(rng, (1, s, 2, 8)) for s in (1, 5, 5))
  fn = make_attention_fn(window_size=(2, 0))
  with pytest.raises(NotImplementedError, match="window_size"):
    fn(q, k, v, mask=jnp.ones((1, 1, 1, 5), bool))


def test_declared_causal_does_not_apply_to_a_decode_mask(rng):
  """A concrete decode mask (eager decoding) is not refused as "above the
  diagonal" by causal=True: one row is a key mask."""
  q, k, v = (normal(rng, (1, s, 2, 8)) for s in (1, 6, 6))
  mask = (jnp.arange(6) <= 3)[None, None, None]
  got = make_attention_fn(causal=True)(q, k, v, mask=mask)
  want = nnx.dot_product_attention(q, k, v, mask=mask)
  assert_within_tolerance("out", got, want, want)


# ---------------------------------------------------------------------------
# Rows that see no key: Flax's mean of the values, on every route.


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_padding_with_is_causal_equals_the_combined_mask(rng, cross):
  """Flax's test_causal_mask_equivalence: a padding mask with is_causal ==
  the precombined mask, through flash attention and through the fallback
  (sown weights), also where padding leaves rows empty."""
  seq_q, seq_kv = 2, (4 if cross else 2)
  q = normal(rng, (1, 1, seq_q, _HEADS, 4))
  k, v = (normal(rng, (1, 1, seq_kv, _HEADS, 4)) for _ in range(2))
  padding = np.ones((1, 1, 1, seq_q, seq_kv), bool)
  padding[..., -2:] = False
  causal = np.tril(np.ones((seq_q, seq_kv), bool))
  fn = make_attention_fn(on_unsupported="fallback")
  combined = fn(q, k, v, mask=padding & causal)
  flash = fn(q, k, v, mask=padding, is_causal=True)
  sown = nnx.capture(
    lambda m: fn(q, k, v, mask=padding, is_causal=True, module=m),
    nnx.Intermediate,
  )
  with pytest.warns(FlashAttentionFallbackWarning, match="sow"):
    fallback, _ = sown(nnx.Module())
  want = nnx.dot_product_attention(q, k, v, mask=padding & causal)
  routes = (("combined", combined), ("flash", flash), ("fallback", fallback))
  for name, got in routes:
    assert_within_tolerance(name, got, want, want)


def test_empty_rows_gradients_match_flax(rng):
  """An empty row's output is the mean of V: its gradient reaches V only."""
  q, k, v = (normal(rng, (_BATCH, 6, _HEADS, 8)) for _ in range(3))
  valid = np.arange(6)[None, :] < np.array([[4], [6]])
  mask = nnx.make_attention_mask(valid, valid)
  cotangent = normal(rng, q.shape)
  fn = make_attention_fn("blockwise")

  def grads(attention):
    loss = lambda q, k, v: jnp.sum(attention(q, k, v, mask=mask) * cotangent)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

  for name, got, want in zip(
    "qkv", grads(fn), grads(nnx.dot_product_attention)
  ):
    assert_within_tolerance(f"d{name}", got, want, want)


def test_bad_dropout_rate_raises_like_flax(rng):
  q = normal(rng, (1, 3, 2, 8))
  for rate in (-0.5, float("nan")):
    with pytest.raises(ValueError, match="dropout_rate"):
      make_attention_fn()(q, q, q, dropout_rate=rate, deterministic=False)
