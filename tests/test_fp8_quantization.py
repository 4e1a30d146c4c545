"""FP8 (e4m3) on a CPU: the randomized Hadamard rotation, tile
quantization and FP8Config.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa3
from pallas_fa3 import fp8
from pallas_fa3.testing import (
  Shape,
  random_inputs,
)

# -- the randomized Hadamard transform -------------------------------------------


def _sylvester(n: int) -> np.ndarray:
  h = np.ones((1, 1))
  while h.shape[0] < n:
    h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
  return h


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fast_hadamard_is_the_normalized_sylvester_matrix(d):
  h = np.asarray(fp8.hadamard_transform(jnp.eye(d)), np.float64)
  np.testing.assert_allclose(h, _sylvester(d) / np.sqrt(d), atol=1e-7)
  np.testing.assert_allclose(h @ h.T, np.eye(d), atol=1e-6)


def test_hadamard_on_a_head_dim_that_is_not_a_power_of_two():
  m = np.asarray(fp8.hadamard_transform(jnp.eye(96)), np.float64)
  np.testing.assert_allclose(m @ m.T, np.eye(96), atol=1e-6)  # I_3 (x) H_32
  np.testing.assert_allclose(
    m[:32, :32], _sylvester(32) / np.sqrt(32), atol=1e-7
  )


@pytest.mark.parametrize("d", [64, 128, 256])
def test_rotation_preserves_the_scores(d, key):
  kq, kk, ks = jax.random.split(key, 3)
  q = jax.random.normal(kq, (2, 33, 3, d))
  k = jax.random.normal(kk, (2, 47, 3, d))
  signs = fp8.rotation_signs(ks, d)
  assert set(np.unique(np.asarray(signs))) == {-1.0, 1.0}
  dot = lambda a, b: np.einsum(
    "bqhd,bkhd->bhqk", np.asarray(a, np.float64), np.asarray(b, np.float64)
  )
  rotated = dot(fp8.rotate(q, signs), fp8.rotate(k, signs))
  # (QM)(KM)^T = Q M M^T K^T = QK^T; float32 rounding of the transform only.
  np.testing.assert_allclose(rotated, dot(q, k), atol=2e-4 * np.sqrt(d))
  # ...and the rotation actually mixes the features.
  assert not np.allclose(
    np.asarray(fp8.rotate(q, signs)), np.asarray(q), atol=0.1
  )


def test_rotation_spreads_an_outlier_across_the_row():
  x = jnp.zeros((1, 1, 1, 128)).at[..., 5].set(100.0)
  y = np.asarray(fp8.rotate(x, fp8.rotation_signs(jax.random.key(0), 128)))
  np.testing.assert_allclose(np.abs(y), 100.0 / np.sqrt(128), rtol=1e-6)


# -- quantization --------------------------------------------------------------


def test_quantize_round_trip_error_bound(key):
  x = jax.random.normal(key, (2, 300, 3, 64)) * jnp.exp(
    jax.random.normal(jax.random.split(key)[0], (2, 300, 3, 1))
  )
  x8, scale = fp8.quantize_tiles(x, 64)
  assert x8.dtype == jnp.float8_e4m3fn and scale.shape == (2, 3, 5)
  back = np.asarray(fp8.dequantize_tiles(x8, scale, 64), np.float64)
  xs = np.asarray(x, np.float64)
  # e4m3: 3 mantissa bits, round to nearest -> relative error <= 2^-4 for
  # normal values; absolute <= 2^-10 * scale in the subnormal range.
  per_row = np.repeat(np.asarray(scale).transpose(0, 2, 1), 64, axis=1)[:, :300]
  bound = np.maximum(2.0**-4 * np.abs(xs), 2.0**-10 * per_row[..., None])
  assert np.all(np.abs(back - xs) <= bound * (1 + 1e-6))
  # The scale is the smallest power of two with 448 * scale >= the tile's
  # amax (exact to divide by): each tile's amax lands in (224, 448].
  tiles = (
    np.pad(np.abs(xs), [(0, 0), (0, 20), (0, 0), (0, 0)])
    .reshape(2, 5, 64, 3, 64)
    .max(axis=(2, 4))
    .transpose(0, 2, 1)
  )
  sc = np.asarray(scale, np.float64)
  np.testing.assert_array_equal(np.exp2(np.round(np.log2(sc))), sc)
  assert np.all(448.0 * sc >= tiles) and np.all(224.0 * sc < tiles)
  top = np.max(np.abs(np.asarray(x8, np.float32)))
  assert 224.0 < top <= 448.0
  # The per-tensor baseline's option: amax / 448 exactly.
  _, plain = fp8.quantize_tiles(x, 64, pow2=False)
  np.testing.assert_allclose(np.asarray(plain), tiles / 448.0, rtol=1e-6)


def test_quantize_per_tensor_and_zero_tiles():
  x = jnp.zeros((1, 128, 2, 64)).at[0, 70, 1, 3].set(-7.0)
  x8, scale = fp8.quantize_tiles(x, 64, per_tensor=True)
  np.testing.assert_array_equal(np.asarray(scale), 7.0 / 448.0)
  _, scale = fp8.quantize_tiles(x, 64)  # all-zero tiles get scale 1
  np.testing.assert_array_equal(
    np.asarray(scale), [[[1.0, 1.0], [1.0, 7 / 448]]]
  )


def test_quantize_layout_and_options(key):
  q, k, v, _ = random_inputs(key, Shape(2, 100, 130, 4, 2, 64), jnp.bfloat16)
  x = fp8.quantize(q, k, v, block_q=64, block_kv=64)
  assert x.q.shape == q.shape and x.k.shape == k.shape
  assert x.v_t.shape == (2, 2, 64, 130)  # [b, hk, d, skv]: sequence-contiguous
  assert x.q_scale.shape == (
    2,
    4,
    2,
  ) and x.k_scale.shape == x.v_scale.shape == (2, 2, 3)
  # V is never rotated: its transpose dequantizes back to v.
  v_back = fp8.dequantize_tiles(
    jnp.transpose(x.v_t, (0, 3, 1, 2)), x.v_scale, 64
  )
  np.testing.assert_allclose(v_back, np.float32(v), rtol=2**-4, atol=1e-2)
  # Rotation off: Q dequantizes back to q; block quantization off: one scale.
  plain = fp8.quantize(
    q,
    k,
    v,
    block_q=64,
    block_kv=64,
    config=pallas_fa3.FP8Config(rotation=False, block_quantization=False),
  )
  np.testing.assert_allclose(
    fp8.dequantize_tiles(plain.q, plain.q_scale, 64),
    np.float32(q),
    rtol=2**-4,
    atol=1e-2,
  )
  assert len(np.unique(np.asarray(plain.k_scale))) == 1
  # Rotation on: Q K^T survives quantization to e4m3 resolution.
  s = lambda a, b: np.einsum("bqhd,bkhd->bhqk", a, b)
  got = s(
    np.asarray(fp8.dequantize_tiles(x.q, x.q_scale, 64))[:, :, ::2],
    np.asarray(fp8.dequantize_tiles(x.k, x.k_scale, 64)),
  )
  want = s(np.float32(q)[:, :, ::2], np.float32(k))
  assert np.sqrt(np.mean((got - want) ** 2)) < 0.1 * np.sqrt(np.mean(want**2))


def test_fp8_config_keys():
  a = pallas_fa3.FP8Config(key=3)
  assert a == pallas_fa3.FP8Config(key=3) and hash(a) == hash(
    pallas_fa3.FP8Config(key=3)
  )
  b = pallas_fa3.FP8Config(key=jax.random.key(3))
  assert hash(b) == hash(pallas_fa3.FP8Config(key=jax.random.key(3)))
  signs = lambda c: np.asarray(fp8.rotation_signs(c.prng_key(), 64))
  np.testing.assert_array_equal(signs(a), signs(b))
  assert not np.array_equal(signs(a), signs(pallas_fa3.FP8Config(key=4)))
  np.testing.assert_array_equal(
    signs(pallas_fa3.FP8Config(key=jax.random.PRNGKey(3))), signs(a)
  )
  with pytest.raises(AttributeError):
    a.rotation = False


def test_fp8_config_with_a_jax_key_runs_like_its_seed(key):
  # A key array once reached the partitioned call as a closed-over constant.
  q, k, v, _ = random_inputs(key, Shape(1, 64, 64, 2, 1, 64), jnp.bfloat16)
  attend = lambda seed: np.float32(
    pallas_fa3.flash_attention(
      q, k, v, fp8=pallas_fa3.FP8Config(key=seed), implementation="blockwise"
    )
  )
  by_seed = attend(3)
  for seed in (jax.random.key(3), jax.random.PRNGKey(3)):
    np.testing.assert_array_equal(attend(seed), by_seed)


@pytest.mark.parametrize(
  "kwargs,error,match",
  [
    (dict(rotation=1), TypeError, r"FP8Config\.rotation must be a bool"),
    (
      dict(block_quantization="yes"),
      TypeError,
      r"FP8Config\.block_quantization must be a bool",
    ),
    (dict(key=1.5), TypeError, r"FP8Config\.key must be an int seed"),
    (dict(key=True), TypeError, r"FP8Config\.key must be an int seed"),
    (
      dict(key=jnp.zeros((3,))),
      TypeError,
      r"FP8Config\.key must be an int seed",
    ),
  ],
)
def test_fp8_config_validation_names_the_field(kwargs, error, match):
  with pytest.raises(error, match=match):
    pallas_fa3.FP8Config(**kwargs)


def test_fp8_config_refuses_a_traced_key():
  with pytest.raises(TypeError, match=r"FP8Config\.key must be concrete"):
    jax.jit(lambda k: pallas_fa3.FP8Config(key=k).rotation)(jax.random.key(0))
