"""The FP8 quantization kernel (`kernels/sm90/quantize.py`) on a CPU.

Interpret mode (race detection on) must give its pure-JAX twin's bits,
`e4m3.quantize_inputs`; every tile it serves lowers for CUDA; the calls it
does not serve take the twin. The deviceless compile (spills, and the
temporaries of an `fp8=True` call) is in `test_sm90_aot.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import pallas_fa3
from pallas_fa3.kernels.sm90 import compat, quantize as quant_kernel
from pallas_fa3.quant import e4m3, hadamard
from pallas_fa3.spec import make_spec
from pallas_fa3.testing import lowered_kernel_count

_INTERPRET = compat.interpret_params(detect_races=True)


def _inputs(key, b, s, hq, hk, d, dtype):
  kq, kk, kv = jax.random.split(jax.random.key(key), 3)
  # Outliers make the tiles' scales differ (and the rotation matter).
  q = jax.random.normal(kq, (b, s, hq, d)) * jnp.where(
    jax.random.bernoulli(kq, 0.01, (b, s, hq, d)), 30.0, 1.0
  )
  k = jax.random.normal(kk, (b, s, hk, d)) * 0.5
  v = jax.random.normal(kv, (b, s, hk, d)) * 4.0
  return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def _assert_same_bits(got: e4m3.FP8Inputs, want: e4m3.FP8Inputs) -> None:
  for name, a, b in zip(want._fields, got, want):
    if a is None or b is None:
      assert a is None and b is None, name
      continue
    assert a.shape == b.shape and a.dtype == b.dtype, name
    np.testing.assert_array_equal(
      np.asarray(a.astype(jnp.float32)),
      np.asarray(b.astype(jnp.float32)),
      err_msg=name,
    )


@pytest.mark.parametrize(
  "d, block_q, block_kv, s, dtype, rotation",
  [
    (128, 64, 128, 256, jnp.bfloat16, True),
    (128, 128, 64, 190, jnp.float16, True),  # ragged: a partial tile
    (64, 64, 128, 300, jnp.bfloat16, True),
    (256, 64, 128, 130, jnp.bfloat16, True),
    (128, 64, 128, 200, jnp.bfloat16, False),
    (64, 64, 256, 100, jnp.float16, True),  # shorter than a tile
  ],
)
def test_interpret_kernel_gives_the_twins_bits(
  d, block_q, block_kv, s, dtype, rotation
):
  q, k, v = _inputs(d + s, 2, s, 4, 2, d, dtype)
  kw = dict(
    block_q=block_q,
    block_kv=block_kv,
    block_quantization=True,
    rotation=rotation,
  )
  got = quant_kernel.quantize_inputs_kernel(
    q, k, v, jax.random.key(3), interpret=_INTERPRET, **kw
  )
  assert not compat.races_found()
  _assert_same_bits(got, e4m3.quantize_inputs(q, k, v, jax.random.key(3), **kw))


def test_twin_rotation_is_the_randomized_hadamard():
  """The matmul rotation equals the fast Walsh-Hadamard transform (16-bit
  inputs: exact products), and dequantizing gives back the rotated input."""
  for d in (64, 96, 128, 256):
    x = jax.random.normal(jax.random.key(d), (1, 40, 2, d), jnp.bfloat16)
    signs = hadamard.rotation_signs(jax.random.key(1), d)
    y = e4m3.rotate_for_quantization(x, signs)
    np.testing.assert_allclose(
      np.asarray(y), np.asarray(hadamard.rotate(x, signs)), rtol=0, atol=1e-6
    )
    m = np.asarray(e4m3.rotation_matrix(signs), np.float64) / np.sqrt(d & -d)
    np.testing.assert_allclose(m @ m.T, np.eye(d), atol=1e-12)


def test_calls_the_kernel_does_not_serve_take_the_twin():
  q, k, v = _inputs(0, 1, 128, 2, 2, 128, jnp.float32)
  for dtype, block_quantization in ((jnp.float32, True), (jnp.bfloat16, False)):
    args = (q.astype(dtype), k.astype(dtype), v.astype(dtype))
    kw = dict(
      block_q=64,
      block_kv=128,
      block_quantization=block_quantization,
      rotation=True,
    )
    got = quant_kernel.quantize_inputs_kernel(
      *args, jax.random.key(0), interpret=_INTERPRET, **kw
    )
    _assert_same_bits(got, e4m3.quantize_inputs(*args, jax.random.key(0), **kw))


def test_kernel_unsupported_names_the_reason():
  x = jnp.zeros((1, 64, 1, 128), jnp.float32)
  assert "float32" in quant_kernel.kernel_unsupported(x, 64)
  x = x.astype(jnp.bfloat16)
  assert quant_kernel.kernel_unsupported(x, 64) is None
  assert "96" in quant_kernel.kernel_unsupported(x, 96)
  assert "head_dim 96" in quant_kernel.kernel_unsupported(
    jnp.zeros((1, 64, 1, 96), jnp.bfloat16), 64
  )
  with pytest.raises(ValueError, match="tile rows 96"):
    quant_kernel.quantize_tensor(x, 96)
  with pytest.raises(ValueError, match="no rotation or residual"):
    quant_kernel.quantize_tensor(x, 64, signs=jnp.ones(128), transpose=True)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("rows", [64, 128])
@pytest.mark.parametrize("transpose", [False, True])
def test_quantization_kernel_lowers_for_cuda(d, rows, transpose):
  x = jax.ShapeDtypeStruct((2, 1000, 4, d), jnp.bfloat16)
  signs = None if transpose else jnp.ones(d, jnp.float32)
  f = jax.jit(
    lambda x: quant_kernel.quantize_tensor(
      x, rows, signs=signs, transpose=transpose
    )
  )
  exported = export.export(f, platforms=["cuda"])(x)
  assert lowered_kernel_count(exported.mlir_module()) == 1
  x8, scale = exported.out_avals
  assert x8.dtype == jnp.float8_e4m3fn
  assert x8.shape == ((2, 4, d, 1000) if transpose else (2, 1000, 4, d))
  assert scale.shape == (2, 4, -(-1000 // rows))


def _interpret_attention(q, k, v, fp8_config, causal):
  """The twin's quantization, then the FP8 attention kernel in interpret
  mode and its blockwise twin, each called on its own (interpreted kernels
  sharing one executable with other work can deadlock the interpreter)."""
  from pallas_fa3.backends.blockwise import fp8 as blockwise_fp8
  from pallas_fa3.kernels.sm90 import config_fp8, forward_fp8

  config = config_fp8.default_fp8_forward_config(q.shape[-1])
  x = e4m3.quantize_inputs(
    q,
    k,
    v,
    fp8_config.prng_key(),
    block_q=config.block_q,
    block_kv=config.block_kv,
    block_quantization=True,
    rotation=True,
    q_residual=fp8_config.q_residual,
  )
  spec = make_spec(q, k, v, causal=causal, fp8=fp8_config)
  out, lse = forward_fp8.sm90_forward_fp8(
    spec, config, *x, interpret=_INTERPRET
  )
  assert not compat.races_found()
  twin = blockwise_fp8.blockwise_forward_fp8(
    spec, config.block_q, config.block_kv, *x
  )
  return (out, lse), twin


@pytest.mark.timeout(300)
def test_interpret_attention_on_the_passs_output_equals_the_blockwise_twin():
  q, k, v = _inputs(7, 1, 192, 4, 2, 128, jnp.bfloat16)
  (out, lse), (ref, ref_lse) = _interpret_attention(
    q, k, v, pallas_fa3.FP8Config(), causal=True
  )
  f32 = lambda a: np.asarray(a, np.float32)
  # Same operands and steps; only exp2 and summation order may differ.
  np.testing.assert_allclose(f32(out), f32(ref), rtol=0, atol=2e-2)
  np.testing.assert_allclose(f32(lse), f32(ref_lse), rtol=0, atol=1e-4)


# -- Q's rounding residual (FP8Config(q_residual=True)) ---------------------------


def test_q_residual_config_is_validated():
  assert pallas_fa3.FP8Config(q_residual=True).q_residual is True
  with pytest.raises(TypeError, match="q_residual"):
    pallas_fa3.FP8Config(q_residual="yes")


def test_q_residual_kernel_gives_the_twins_bits_and_the_residual_is_exact():
  q, k, v = _inputs(11, 1, 200, 4, 2, 128, jnp.bfloat16)
  kw = dict(
    block_q=64,
    block_kv=128,
    block_quantization=True,
    rotation=True,
    q_residual=True,
  )
  got = quant_kernel.quantize_inputs_kernel(
    q, k, v, jax.random.key(1), interpret=_INTERPRET, **kw
  )
  want = e4m3.quantize_inputs(q, k, v, jax.random.key(1), **kw)
  _assert_same_bits(got, want)
  # Q ~ (q8 + residual) * scale, far closer than q8 * scale alone.
  signs = hadamard.rotation_signs(jax.random.key(1), 128)
  y = np.asarray(e4m3.rotate_for_quantization(q, signs), np.float64)
  hi = np.asarray(e4m3.dequantize_tiles(want.q, want.q_scale, 64), np.float64)
  both = np.asarray(
    e4m3.dequantize_tiles(want.q, want.q_scale, 64)
    + e4m3.dequantize_tiles(want.q_residual, want.q_scale, 64),
    np.float64,
  )
  assert np.abs(both - y).max() < np.abs(hi - y).max() / 8


@pytest.mark.timeout(300)
def test_q_residual_attention_kernel_matches_the_twin_and_cuts_the_error():
  from pallas_fa3.tools.numerics import fp8_methods, metrics

  q, k, v, golden, key = fp8_methods.draw(jax.random.key(2), 1, 256, 2, 128)
  err = {}
  for residual in (False, True):
    cfg = pallas_fa3.FP8Config(key=key, q_residual=residual)
    (out, _), (twin, _) = _interpret_attention(q, k, v, cfg, causal=False)
    np.testing.assert_allclose(
      np.asarray(out, np.float32), np.asarray(twin, np.float32), atol=2e-3
    )
    err[residual] = metrics.rmse(twin, golden)
  assert err[True] < 0.9 * err[False], err


def test_q_residual_lowers_for_cuda_and_d256_is_refused():
  f = lambda d: jax.jit(
    lambda q, k, v: pallas_fa3.flash_attention(
      q,
      k,
      v,
      causal=True,
      fp8=pallas_fa3.FP8Config(q_residual=True),
      implementation="mosaic",
    )
  )
  x = jax.ShapeDtypeStruct((1, 512, 4, 128), jnp.bfloat16)
  exported = export.export(f(128), platforms=["cuda"])(x, x, x)
  assert lowered_kernel_count(exported.mlir_module()) == 4
  x = jax.ShapeDtypeStruct((1, 512, 4, 256), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="q_residual"):
    export.export(f(256), platforms=["cuda"])(x, x, x)


def test_flash_attention_fp8_checks_q_residual():
  from pallas_fa3 import fp8

  q, k, v = _inputs(3, 1, 128, 2, 2, 64, jnp.bfloat16)
  x = fp8.quantize(
    q,
    k,
    v,
    block_q=64,
    block_kv=128,
    config=pallas_fa3.FP8Config(q_residual=True),
  )
  out = fp8.flash_attention_fp8(
    *x[:6], q_residual=x.q_residual, implementation="blockwise"
  )
  assert out.shape == q.shape
  with pytest.raises(ValueError, match="q_residual"):
    fp8.flash_attention_fp8(
      *x[:6], q_residual=x.q_residual[:, :64], implementation="blockwise"
    )
