"""FlashMultiHeadAttention (nnx), FlashMultiHeadDotProductAttention (linen) and RoPE.

The layers load Flax's checkpoints and match Flax's layers (the float32 Flax
layer is the oracle, the low-dtype Flax layer the naive computation of the
tolerance rule), under nnx/jax jit, grad and remat/checkpoint.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn, nnx
from flax_checks import (
  BIAS_INIT,
  assert_layer_within_tolerance,
  flat,
  linen_forward_and_grads,
  nnx_forward_and_grads,
  normal,
  random_layer_inputs,
)

import pallas_fa3.flax
from pallas_fa3.flax import (
  FlashMultiHeadAttention,
  FlashMultiHeadDotProductAttention,
  apply_rope,
  rope,
)
from pallas_fa3.testing import assert_within_tolerance

_FEATURES, _HEADS, _BATCH, _SEQ = 32, 4, 2, 11


def _flax_nnx(dtype=None, seed=0, **kwargs):
  return nnx.MultiHeadAttention(
    _HEADS,
    _FEATURES,
    dtype=dtype,
    decode=False,
    bias_init=BIAS_INIT,
    rngs=nnx.Rngs(seed),
    **kwargs,
  )


def _ours_loaded_from(flax_layer, dtype=None, **kwargs):
  """Our nnx layer (another seed) with the Flax layer's parameters loaded."""
  ours = FlashMultiHeadAttention(
    _HEADS,
    _FEATURES,
    num_kv_heads=flax_layer.num_kv_heads,
    dtype=dtype,
    rngs=nnx.Rngs(12345),
    **kwargs,
  )
  nnx.update(ours, nnx.state(flax_layer, nnx.Param))
  return ours


def _shapes(state):
  return {name: (x.shape, x.dtype) for name, x in flat(state).items()}


# ---------------------------------------------------------------------------
# Parameters: Flax's names, shapes and initial values.


@pytest.mark.parametrize("num_kv_heads", [None, 2])
def test_nnx_parameters_are_flax_parameters(num_kv_heads):
  kwargs = dict(
    qkv_features=16,
    out_features=24,
    num_kv_heads=num_kv_heads,
    param_dtype=jnp.bfloat16,
  )
  flax_layer = nnx.MultiHeadAttention(
    _HEADS, _FEATURES, decode=False, rngs=nnx.Rngs(7), **kwargs
  )
  ours = FlashMultiHeadAttention(_HEADS, _FEATURES, rngs=nnx.Rngs(7), **kwargs)
  want, got = nnx.state(flax_layer, nnx.Param), nnx.state(ours, nnx.Param)
  assert _shapes(got) == _shapes(want)
  # Same creation order as Flax: one seed gives one initialization.
  for name, value in flat(want).items():
    np.testing.assert_array_equal(flat(got)[name], value, err_msg=name)


def test_linen_parameters_are_flax_parameters():
  x = jnp.ones((_BATCH, _SEQ, _FEATURES))
  kwargs = dict(num_heads=_HEADS, qkv_features=16, out_features=24)
  init = lambda m: jax.eval_shape(m.init, jax.random.key(0), x)
  assert _shapes(init(FlashMultiHeadDotProductAttention(**kwargs))) == _shapes(
    init(nn.MultiHeadDotProductAttention(**kwargs))
  )


# ---------------------------------------------------------------------------
# Equivalence with Flax's layers, checkpoint loaded: outputs and gradients.


@pytest.mark.parametrize(
  "num_kv_heads, causal, dtype, remat",
  [
    (None, True, jnp.float32, False),  # MHA
    (2, False, jnp.bfloat16, True),  # GQA, under nnx.remat
  ],
  ids=["mha-causal-f32", "gqa-bf16-remat"],
)
def test_nnx_layer_matches_flax(rng, num_kv_heads, causal, dtype, remat):
  """nnx.jit + nnx.value_and_grad (+ nnx.remat) of our layer vs Flax's."""
  x, x32, ct = random_layer_inputs(rng, (_BATCH, _SEQ), _FEATURES, dtype)
  seed = int(rng.integers(2**30))
  golden_layer = _flax_nnx(seed=seed, num_kv_heads=num_kv_heads)
  ours = _ours_loaded_from(golden_layer, dtype, causal=causal)
  got = nnx_forward_and_grads(ours, x, ct, remat=remat)
  golden = nnx_forward_and_grads(golden_layer, x32, ct, is_causal=causal)
  naive = (
    golden
    if dtype == jnp.float32
    else nnx_forward_and_grads(
      _flax_nnx(dtype, seed=seed, num_kv_heads=num_kv_heads),
      x,
      ct,
      is_causal=causal,
    )
  )
  assert_layer_within_tolerance(got, naive, golden, dtype)


def test_linen_layer_matches_flax_causal_bf16_remat(rng):
  """jax.jit + jax.value_and_grad of our layer under nn.remat vs Flax's."""
  dtype = jnp.bfloat16
  x, x32, ct = random_layer_inputs(rng, (_BATCH, _SEQ), _FEATURES, dtype)
  flax_module = lambda dtype: nn.MultiHeadDotProductAttention(
    num_heads=_HEADS, dtype=dtype, bias_init=nn.initializers.normal(0.5)
  )
  params = flax_module(None).init(jax.random.key(0), x32)
  mask = {"mask": nn.make_causal_mask(x[..., 0])}
  ours = nn.remat(FlashMultiHeadDotProductAttention)(
    num_heads=_HEADS, dtype=dtype, causal=True
  )
  got = linen_forward_and_grads(ours, params, x, ct)
  golden = linen_forward_and_grads(flax_module(None), params, x32, ct, mask)
  naive = linen_forward_and_grads(flax_module(dtype), params, x, ct, mask)
  assert_layer_within_tolerance(got, naive, golden, dtype)


def test_linen_gqa_matches_flax_nnx_gqa(rng):
  """Linen has no GQA layer: nnx's, with the linen params, is the oracle."""
  x, x32, ct = random_layer_inputs(rng, (_BATCH, _SEQ), _FEATURES, jnp.float32)
  ours = FlashMultiHeadDotProductAttention(num_heads=_HEADS, num_kv_heads=2)
  params = ours.init(jax.random.key(1), x)
  params = jax.tree.map(lambda p: p + normal(rng, p.shape) * 0.1, params)
  flax_layer = _flax_nnx(num_kv_heads=2)
  nnx.update(flax_layer, nnx.State(params["params"]))
  got = linen_forward_and_grads(ours, params, x, ct)
  golden = nnx_forward_and_grads(flax_layer, x32, ct)
  assert_layer_within_tolerance(got, golden, golden, jnp.float32)


@pytest.mark.parametrize("case", ["extra-batch-axes", "cross-attention"])
def test_nnx_forward_matches_flax_f32(rng, case):
  flax_layer = _flax_nnx(num_kv_heads=2)
  ours = _ours_loaded_from(flax_layer)
  if case == "extra-batch-axes":
    args = (normal(rng, (2, 3, 5, _FEATURES)),)
  else:
    args = (
      normal(rng, (_BATCH, 5, _FEATURES)),
      normal(rng, (_BATCH, 9, _FEATURES)),
    )
  want = flax_layer(*args)
  assert_within_tolerance("out", ours(*args), want, want)


# ---------------------------------------------------------------------------
# Transformations.


def test_jax_jit_grad_and_checkpoint_match_nnx(rng):
  """The layer as a pure function of its state (nnx.split/merge) under jax.*."""
  x = normal(rng, (_BATCH, _SEQ, _FEATURES))
  ct = normal(rng, (_BATCH, _SEQ, _FEATURES))
  layer = FlashMultiHeadAttention(
    _HEADS, _FEATURES, num_kv_heads=2, causal=True, rope=True, rngs=nnx.Rngs(0)
  )
  want_out, want_grads = nnx_forward_and_grads(layer, x, ct)
  graphdef, params = nnx.split(layer)
  apply = jax.checkpoint(lambda p: nnx.merge(graphdef, p)(x))

  def loss(p):
    y = apply(p)
    return jnp.sum(y * ct), y

  (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  np.testing.assert_allclose(out, want_out, rtol=1e-6, atol=1e-6)
  for name, g in flat(grads).items():
    np.testing.assert_allclose(
      g, want_grads[name], rtol=1e-5, atol=1e-5, err_msg=name
    )


# ---------------------------------------------------------------------------
# RoPE.


def _numpy_rope(x, positions, base=rope.DEFAULT_ROPE_BASE):
  """Reference: pairs (x[i], x[i + d/2]) as complex numbers times e^{i p theta_i}."""
  x = np.asarray(x, np.float64)
  half = x.shape[-1] // 2
  theta = base ** (-2.0 * np.arange(half) / x.shape[-1])
  angle = np.asarray(positions, np.float64)[..., None, None] * theta
  z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * angle)
  return np.concatenate([z.real, z.imag], axis=-1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rope_matches_the_complex_rotation(rng, dtype):
  x = normal(rng, (2, 6, 3, 8), dtype)
  positions = jnp.asarray(rng.integers(0, 4096, (2, 6)))
  got = apply_rope(x, positions)
  assert got.dtype == x.dtype
  want = _numpy_rope(x, positions)
  # float32 rotation, then one rounding to the dtype (angles up to 4096 rad
  # keep ~1e-4 absolute in float32).
  atol = max(float(jnp.finfo(dtype).eps) * 4, 1e-4)
  np.testing.assert_allclose(
    np.asarray(got, np.float64),
    want,
    atol=atol,
    rtol=float(jnp.finfo(dtype).eps),
  )


def test_rope_scores_depend_on_relative_position(rng):
  q, k = normal(rng, (1, 1, 1, 16)), normal(rng, (1, 1, 1, 16))
  score = lambda i, j: float(
    jnp.sum(apply_rope(q, jnp.array([i])) * apply_rope(k, jnp.array([j])))
  )
  np.testing.assert_allclose(score(3, 1), score(103, 101), rtol=1e-4)
  np.testing.assert_allclose(score(0, 0), float(jnp.sum(q * k)), rtol=1e-5)


def test_rope_positions_default_and_broadcast(rng):
  x = normal(rng, (2, 5, 2, 4))
  arange = apply_rope(x, None)
  np.testing.assert_array_equal(arange, apply_rope(x, jnp.arange(5)))
  np.testing.assert_array_equal(
    arange, apply_rope(x, jnp.broadcast_to(jnp.arange(5), (2, 5)))
  )


def test_nnx_rope_layer_matches_flax_with_rope_applied(rng):
  x = normal(rng, (_BATCH, _SEQ, _FEATURES))
  positions = jnp.asarray(rng.integers(0, 100, (_BATCH, _SEQ)))
  roped = lambda t: jnp.asarray(_numpy_rope(t, positions), jnp.float32)
  flax_layer = _flax_nnx(
    attention_fn=lambda q, k, v, **kw: nnx.dot_product_attention(
      roped(q), roped(k), v, **kw
    )
  )
  ours = _ours_loaded_from(flax_layer, rope=True)
  want = flax_layer(x)
  assert_within_tolerance("out", ours(x, positions=positions), want, want)


# ---------------------------------------------------------------------------
# Bad arguments: each error names its argument.


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(qkv_features=30), ValueError, "qkv_features"),
    (dict(num_kv_heads=3), ValueError, "num_kv_heads"),
    (dict(num_kv_heads=0), ValueError, "num_kv_heads"),
    (dict(causal="yes"), TypeError, "causal"),
    (dict(rope=True, qkv_features=12), ValueError, "head_dim"),  # head_dim 3
    (dict(rope_base=1.0), ValueError, "rope_base"),
    (dict(implementation="cuda"), ValueError, "implementation"),
  ],
)
def test_nnx_bad_constructor_arguments(kwargs, error, match):
  with pytest.raises(error, match=match):
    FlashMultiHeadAttention(_HEADS, _FEATURES, rngs=nnx.Rngs(0), **kwargs)


def test_linen_bad_arguments_at_init():
  x = jnp.ones((1, 3, _FEATURES))
  with pytest.raises(ValueError, match="num_kv_heads"):
    FlashMultiHeadDotProductAttention(num_heads=4, num_kv_heads=3).init(
      jax.random.key(0), x
    )


def test_nnx_bad_call_arguments():
  layer = FlashMultiHeadAttention(
    _HEADS, _FEATURES, rope=True, rngs=nnx.Rngs(0)
  )
  x = jnp.ones((1, 3, _FEATURES))
  with pytest.raises(ValueError, match="inputs_q"):
    layer(jnp.ones((1, 3, _FEATURES + 1)))
  with pytest.raises(ValueError, match="inputs_k"):
    layer(x, None, x)
  with pytest.raises(ValueError, match="positions"):
    layer(x, positions=jnp.arange(4))
  with pytest.raises(TypeError, match="positions"):
    layer(x, positions=jnp.arange(3.0))
  with pytest.raises(ValueError, match="seq_q == seq_kv"):
    layer(x, jnp.ones((1, 4, _FEATURES)))
  no_rope = FlashMultiHeadAttention(_HEADS, _FEATURES, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="rope=True"):
    no_rope(x, positions=jnp.arange(3))


# ---------------------------------------------------------------------------
# Public names and runnable examples.


def test_public_names():
  assert sorted(pallas_fa3.flax.__all__) == sorted(
    [
      "FlashAttentionFallbackWarning",
      "FlashMultiHeadAttention",
      "FlashMultiHeadDotProductAttention",
      "apply_rope",
      "make_attention_fn",
    ]
  )
