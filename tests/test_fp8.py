"""FP8 (e4m3) forward on a CPU: rotation, quantization, twin, kernel, API.

Tiers for the kernel, as for the bf16 one: CUDA lowering of every FP8
config (`jax.export`, the primary check: the interpreter accepts FP8
layouts that lowering rejects), the deviceless sm_90a compile with zero
spills (`test_every_fp8_config_compiles_without_spills`, where the CUDA
packages are installed), and interpret mode where the interpreter runs the
FP8 path (it does in 0.10.2), compared with the blockwise twin.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import pallas_fa3
from pallas_fa3 import fp8, masking
from pallas_fa3.backends import blockwise_fp8
from pallas_fa3.kernels.sm90 import (
  compat,
  config_fp8 as sm90_fp8_config,
  forward_fp8 as sm90_fwd_fp8,
)
from pallas_fa3.kernels.sm90.config import Sm90ForwardConfig
from pallas_fa3.numerics import fp8_methods
from pallas_fa3.reference import golden_attention
from pallas_fa3.spec import LOG2E, make_spec
from pallas_fa3.testing import (
  Shape,
  assert_lowered_attention,
  max_abs_err,
  random_inputs,
)

_INTERPRET_TIMEOUT_S = 300


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
  # Each tile's amax lands exactly on 448: the scale is amax / 448.
  tiles = (
    np.pad(np.abs(xs), [(0, 0), (0, 20), (0, 0), (0, 0)])
    .reshape(2, 5, 64, 3, 64)
    .max(axis=(2, 4))
    .transpose(0, 2, 1)
  )
  np.testing.assert_allclose(np.asarray(scale), tiles / 448.0, rtol=1e-6)
  assert np.max(np.abs(np.asarray(x8, np.float32))) == 448.0


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


# -- the blockwise twin against the golden ---------------------------------------


def _naive_fp8(spec, x: fp8.FP8Inputs, block_q, block_kv):
  """Materialized attention on the dequantized operands, P through e4m3 with
  the 2^8 offset against the global row max (float64 otherwise): the
  "naive low-precision" side of the tolerance rule, seeing what the kernel
  sees (same rotation, same quantization, P in FP8)."""
  f64 = lambda a: np.asarray(a, np.float64)
  q = f64(fp8.dequantize_tiles(x.q, x.q_scale, block_q))
  k = f64(fp8.dequantize_tiles(x.k, x.k_scale, block_kv))
  v = f64(
    fp8.dequantize_tiles(
      jnp.transpose(x.v_t, (0, 3, 1, 2)), x.v_scale, block_kv
    )
  )
  g = spec.group_size
  qg = q.reshape(spec.batch, spec.seq_q, spec.heads_kv, g, spec.head_dim)
  s = np.einsum("bqhgd,bkhd->bhgqk", qg, k) * spec.softmax_scale * LOG2E
  mask = np.asarray(
    masking.visible(spec, np.arange(spec.seq_q), np.arange(spec.seq_kv))
  )
  s = np.where(mask, s, -np.inf)
  m = s.max(axis=-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  p = np.exp2(s - m + 8.0)
  p8 = np.asarray(
    jnp.asarray(p, jnp.float32).astype(jnp.float8_e4m3fn), np.float64
  )
  l = p.sum(axis=-1, keepdims=True)
  o = np.einsum("bhgqk,bkhd->bqhgd", p8, v) / np.where(l == 0, 1, l).transpose(
    0, 3, 1, 2, 4
  )
  return o.reshape(spec.out_shape)


_TWIN_CASES = [
  # (shape, causal, (block_q, block_kv))
  (Shape(1, 200, 330, 4, 2, 64), False, (64, 64)),  # GQA, ragged
  (Shape(2, 130, 400, 2, 1, 128), True, (64, 128)),  # MQA, causal sq < skv
  (Shape(1, 300, 110, 2, 2, 64), True, (64, 64)),  # rows without keys
  (Shape(1, 96, 160, 2, 1, 256), False, (64, 64)),  # d 256
  (Shape(1, 1, 17, 2, 1, 64), True, (64, 128)),  # one query row
]


@pytest.mark.parametrize(
  "shape,causal,tiles", _TWIN_CASES, ids=lambda x: str(x)
)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_blockwise_fp8_matches_golden(shape, causal, tiles, dtype, key):
  q, k, v, _ = random_inputs(key, shape, dtype)
  config = pallas_fa3.BlockwiseConfig(*tiles)
  out, lse = pallas_fa3.flash_attention(
    q,
    k,
    v,
    causal=causal,
    fp8=True,
    return_lse=True,
    config=config,
    implementation="blockwise",
  )
  assert (
    out.dtype == dtype and out.shape == q.shape and lse.dtype == jnp.float32
  )
  golden, golden_lse = golden_attention(q, k, v, causal=causal)
  spec = make_spec(q, k, v, causal=causal)
  x = fp8.quantize(q, k, v, block_q=tiles[0], block_kv=tiles[1])
  naive = _naive_fp8(spec, x, *tiles)
  np.testing.assert_array_equal(
    np.isneginf(np.asarray(lse)), np.isneginf(golden_lse)
  )
  bound = 2 * max_abs_err(naive, golden) + 1e-3
  assert max_abs_err(out, golden) <= bound
  # lse: the scores carry e4m3 error from Q and K (relative 2^-4 per factor).
  assert max_abs_err(lse, golden_lse) <= 0.1
  if causal and shape.seq_q > shape.seq_kv:
    assert np.all(np.asarray(out[:, : shape.seq_q - shape.seq_kv]) == 0)


def test_blockwise_fp8_is_deterministic_and_jittable(key):
  q, k, v, _ = random_inputs(key, Shape(1, 150, 150, 2, 1, 64), jnp.bfloat16)
  f = jax.jit(
    lambda q, k, v: pallas_fa3.flash_attention(
      q, k, v, causal=True, fp8=True, implementation="blockwise"
    )
  )
  np.testing.assert_array_equal(np.float32(f(q, k, v)), np.float32(f(q, k, v)))
  # The automatic choice on a machine without a Hopper GPU is the twin, with
  # the FP8 kernel's default tiles for the head dim (so it rounds as the GPU).
  if jax.default_backend() != "gpu":
    tiles = sm90_fp8_config.default_fp8_forward_config(64)
    twin = pallas_fa3.flash_attention(
      q,
      k,
      v,
      causal=True,
      fp8=True,
      implementation="blockwise",
      config=pallas_fa3.BlockwiseConfig(tiles.block_q, tiles.block_kv),
    )
    auto = pallas_fa3.flash_attention(q, k, v, causal=True, fp8=True)
    np.testing.assert_array_equal(np.float32(auto), np.float32(twin))


def test_low_level_entry_matches_the_high_level_one(key):
  q, k, v, _ = random_inputs(key, Shape(1, 100, 200, 4, 2, 128), jnp.float16)
  cfg = pallas_fa3.FP8Config(key=7)
  x = fp8.quantize(q, k, v, block_q=64, block_kv=128, config=cfg)
  low = fp8.flash_attention_fp8(
    *x,
    causal=True,
    return_lse=True,
    implementation="blockwise",
    out_dtype=jnp.float16,
  )
  high = pallas_fa3.flash_attention(
    q, k, v, causal=True, fp8=cfg, return_lse=True, implementation="blockwise"
  )
  for a, b in zip(low, high):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- numerics acceptance (FA3 Table 3 setup) ------------------------------------


def test_fp8_error_beats_per_tensor_baseline_by_2x():
  """At d=128: ours <= the paper's 9.1e-3 and at least 2x below per-tensor FP8.

  seq 4096 x 2 heads: over five input draws the ratio measured 2.24-2.36
  (it grows with sequence length; at seq 2048 it is ~2.0-2.2, see
  benchmarks/RESULTS.md).
  """
  r = fp8_methods.error_table(
    jax.random.key(0),
    1,
    4096,
    2,
    128,
    methods=("baseline FP8 per-tensor", "ours FP8"),
  )
  assert r["ours FP8"] <= 9.1e-3, r
  assert r["baseline FP8 per-tensor"] >= 2.0 * r["ours FP8"], r


# -- the kernel in interpret mode -----------------------------------------------


def _interpret_fp8(spec, config, x):
  params = compat.interpret_params(detect_races=True)
  try:
    with compat.capture_race_report() as report:
      out = jax.block_until_ready(
        sm90_fwd_fp8.sm90_forward_fp8(spec, config, *x, interpret=params)
      )
  except Exception:
    compat.reset_interpret_state()
    raise
  assert not compat.races_found(), report.getvalue()[-3000:]
  return out


@pytest.mark.timeout(_INTERPRET_TIMEOUT_S)
@pytest.mark.parametrize(
  "shape,causal,config",
  [
    # GQA, ragged kv, non-causal: 6 K/V steps through 2 slots (the ring wraps).
    (Shape(1, 200, 330, 2, 1, 64), False, Sm90ForwardConfig(64, 64, 2)),
    # causal, sq > skv (rows without keys), 128-column tiles, 3 stages.
    (Shape(1, 200, 140, 2, 2, 64), True, Sm90ForwardConfig(64, 128, 3)),
  ],
  ids=str,
)
def test_interpret_kernel_is_the_blockwise_twin(shape, causal, config, key):
  q, k, v, _ = random_inputs(key, shape, jnp.bfloat16)
  spec = make_spec(q, k, v, causal=causal)
  x = fp8.quantize(q, k, v, block_q=config.block_q, block_kv=config.block_kv)
  out, lse = _interpret_fp8(spec, config, x)
  twin = blockwise_fp8.blockwise_forward_fp8(
    spec, config.block_q, config.block_kv, *x
  )
  # Same tiles, scales, exp2 and e4m3 rounding of P; only summation order
  # differs (within one bf16 ulp of the output, float32 ulps of the lse).
  np.testing.assert_allclose(
    np.float32(out), np.float32(twin[0]), atol=2**-8, rtol=2**-7
  )
  np.testing.assert_allclose(
    np.asarray(lse), np.asarray(twin[1]), atol=1e-5, rtol=1e-6
  )
  golden = golden_attention(q, k, v, causal=causal)[0]
  assert (
    max_abs_err(out, golden)
    <= 2
    * max_abs_err(_naive_fp8(spec, x, config.block_q, config.block_kv), golden)
    + 1e-3
  )


# -- tier 2: lowering for CUDA ---------------------------------------------------


def _fp8_configs():
  for d in sm90_fp8_config.FP8_HEAD_DIMS:
    for config in sm90_fp8_config.fp8_forward_config_space(d):
      yield pytest.param(
        d,
        config,
        id=f"d{d}-{config.block_q}x{config.block_kv}x{config.num_stages}",
      )


def _lower_fp8(spec, config):
  f8, f32 = sm90_fwd_fp8.FP8_DTYPE, jnp.float32
  b, hq, hk, d = spec.batch, spec.heads_q, spec.heads_kv, spec.head_dim
  n_q, n_kv = (
    -(-spec.seq_q // config.block_q),
    -(-spec.seq_kv // config.block_kv),
  )
  shapes = [
    jax.ShapeDtypeStruct(s, t)
    for s, t in (
      ((b, spec.seq_q, hq, d), f8),
      ((b, spec.seq_kv, hk, d), f8),
      ((b, hk, d, spec.seq_kv), f8),
      ((b, hq, n_q), f32),
      ((b, hk, n_kv), f32),
      ((b, hk, n_kv), f32),
    )
  ]
  fn = jax.jit(lambda *a: sm90_fwd_fp8.sm90_forward_fp8(spec, config, *a))
  return export.export(fn, platforms=["cuda"])(*shapes)


@pytest.mark.parametrize("head_dim,config", list(_fp8_configs()))
def test_every_fp8_config_lowers_for_cuda(head_dim, config):
  for causal, (sq, skv, hq, hk), dtype in (
    (True, (1000, 1100, 4, 2), jnp.bfloat16),
    (False, (257, 320, 3, 1), jnp.float16),
  ):
    q = jax.ShapeDtypeStruct((2, sq, hq, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((2, skv, hk, head_dim), dtype)
    spec = make_spec(q, kv, kv, causal=causal)
    assert sm90_fp8_config.fp8_forward_unsupported(spec, config) is None
    text = _lower_fp8(spec, config).mlir_module()
    assert_lowered_attention(text, kernels=1, seq_q=sq, seq_kv=skv)


def test_fp8_smem_estimate_is_exactly_what_mosaic_allocates():
  config, d = Sm90ForwardConfig(128, 256, 4), 256
  reason = sm90_fp8_config.fp8_forward_config_unsupported(config, d)
  assert reason and "shared memory" in reason
  q = jax.ShapeDtypeStruct((1, 512, 2, d), jnp.bfloat16)
  with pytest.raises(ValueError, match="exceeds available shared memory") as e:
    _lower_fp8(make_spec(q, q, q), config)
  used = int(re.search(r"smem_bytes=(\d+)", str(e.value)).group(1))
  assert used == sm90_fp8_config.fp8_forward_smem_bytes(config, d)


def test_flash_attention_fp8_mosaic_exports_quantization_and_kernel():
  q = jax.ShapeDtypeStruct((2, 1000, 8, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 1100, 2, 128), jnp.bfloat16)
  f = jax.jit(
    lambda q, k, v: pallas_fa3.flash_attention(
      q, k, v, causal=True, fp8=True, implementation="mosaic"
    )
  )
  exported = export.export(f, platforms=["cuda"])(q, kv, kv)
  assert_lowered_attention(
    exported.mlir_module(), kernels=1, seq_q=1000, seq_kv=1100
  )
  assert exported.out_avals[0].shape == q.shape
  assert exported.out_avals[0].dtype == jnp.bfloat16


# -- gradients, capability and validation ----------------------------------------


def test_gradients_through_fp8_raise(key):
  q, k, v, _ = random_inputs(key, Shape(1, 64, 64, 2, 1, 64), jnp.bfloat16)
  loss = lambda q: (
    pallas_fa3.flash_attention(q, k, v, fp8=True, implementation="blockwise")
    .astype(jnp.float32)
    .sum()
  )
  with pytest.raises(NotImplementedError, match="gradients through FP8"):
    jax.grad(loss)(q)
  x = fp8.quantize(q, k, v, block_q=64, block_kv=128)
  low = lambda s: (
    fp8.flash_attention_fp8(
      x.q, x.k, x.v_t, s, x.k_scale, x.v_scale, implementation="blockwise"
    )
    .astype(jnp.float32)
    .sum()
  )
  with pytest.raises(NotImplementedError, match="gradients through FP8"):
    jax.grad(low)(x.q_scale)


def test_visible_keys_end_is_the_mask_rule():
  for sq, skv, causal in ((70, 100, True), (100, 70, True), (50, 60, False)):
    q = jax.ShapeDtypeStruct((1, sq, 1, 8), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, skv, 1, 8), jnp.float32)
    spec = make_spec(q, kv, kv, causal=causal)
    rows = jnp.arange(sq)
    end = np.asarray(masking.visible_keys_end(spec, rows))
    want = np.asarray(masking.visible(spec, rows, jnp.arange(skv + 8)))
    np.testing.assert_array_equal(
      np.arange(skv + 8)[None, :] < end[:, None],
      np.broadcast_to(want, (sq, skv + 8)),
    )


@pytest.mark.parametrize(
  "call,error,match",
  [
    (
      dict(fp8="yes"),
      TypeError,
      r"fp8 must be a bool or a pallas_fa3\.FP8Config",
    ),
    (
      dict(fp8=True, implementation="reference"),
      NotImplementedError,
      r"implementation='reference' cannot run this call: the reference has no FP8 path",
    ),
    (
      dict(fp8=True, implementation="blockwise", config=Sm90ForwardConfig()),
      TypeError,
      r"takes a BlockwiseConfig",
    ),
    (
      dict(
        fp8=True,
        implementation="interpret",
        config=pallas_fa3.BlockwiseConfig(),
      ),
      TypeError,
      r"takes a Sm90Config or Sm90ForwardConfig",
    ),
    (
      dict(fp8=True, implementation="interpret", dtype=jnp.float32),
      NotImplementedError,
      r"output dtype float32",
    ),
    (
      dict(fp8=True, implementation="interpret", d=96),
      NotImplementedError,
      r"head_dim 96 is not one of the FP8 kernel's",
    ),
    (
      dict(
        fp8=True,
        implementation="interpret",
        config=Sm90ForwardConfig(64, 128, 3),
      ),
      NotImplementedError,
      r"spills registers",
    ),
  ],
)
def test_fp8_call_errors_say_why(call, error, match):
  d = call.pop("d", 128)
  x = jnp.ones((1, 64, 2, d), call.pop("dtype", jnp.bfloat16))
  with pytest.raises(error, match=match):
    pallas_fa3.flash_attention(x, x, x, **call)


def test_eager_fp8_mosaic_without_a_gpu_says_why():
  if jax.default_backend() == "gpu":
    pytest.skip("checks a machine without a GPU")
  x = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match=r"'mosaic' cannot run here"):
    pallas_fa3.flash_attention(x, x, x, fp8=True, implementation="mosaic")


def _quantized(d=64, sq=100, skv=130):
  x = jnp.ones((1, sq, 2, d), jnp.bfloat16)
  kv = jnp.ones((1, skv, 1, d), jnp.bfloat16)
  return fp8.quantize(x, kv, kv, block_q=64, block_kv=128)


@pytest.mark.parametrize(
  "mutate,kwargs,error,match",
  [
    (
      lambda x: x._replace(q=x.q.astype(jnp.bfloat16)),
      {},
      TypeError,
      r"q8 must have dtype float8_e4m3fn",
    ),
    (lambda x: x._replace(k=x.k[0]), {}, ValueError, r"k8 must have rank 4"),
    (
      lambda x: x._replace(v_t=jnp.transpose(x.v_t, (0, 3, 1, 2))),
      {},
      ValueError,
      r"v8_t must be V transposed",
    ),
    (
      lambda x: x._replace(q_scale=x.q_scale[..., :1]),
      {},
      ValueError,
      r"q_scale must have shape \(1, 2, 2\) \(one scale per block_q=64",
    ),
    (
      lambda x: x._replace(v_scale=x.v_scale.astype(jnp.bfloat16)),
      {},
      TypeError,
      r"v_scale must have dtype float32",
    ),
    (
      lambda x: x,
      dict(out_dtype=jnp.int8),
      TypeError,
      r"out_dtype must be one of",
    ),
    (
      lambda x: x,
      dict(
        config=pallas_fa3.BlockwiseConfig(64, 64), implementation="blockwise"
      ),
      ValueError,
      r"k_scale must have shape \(1, 1, 3\) \(one scale per block_kv=64",
    ),
  ],
)
def test_low_level_entry_validation_names_the_argument(
  mutate, kwargs, error, match
):
  with pytest.raises(error, match=match):
    fp8.flash_attention_fp8(*mutate(_quantized()), **kwargs)


@pytest.mark.parametrize(
  "kwargs,error,match",
  [
    (dict(block_q=0, block_kv=64), ValueError, r"block_q must be >= 1"),
    (dict(block_q=64, block_kv=64.0), TypeError, r"block_kv must be an int"),
    (
      dict(block_q=64, block_kv=64, config=True),
      TypeError,
      r"config must be a pallas_fa3\.FP8Config",
    ),
  ],
)
def test_quantize_validation_names_the_argument(kwargs, error, match):
  x = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
  with pytest.raises(error, match=match):
    fp8.quantize(x, x, x, **kwargs)
