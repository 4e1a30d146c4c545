"""FP8 (e4m3) forward on a CPU: the blockwise twin, the kernel in
interpret mode, and CUDA lowering.

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
from pallas_fa3.backends.blockwise import fp8 as blockwise_fp8
from pallas_fa3.kernels.sm90 import (
  compat,
  config_fp8 as sm90_fp8_config,
  forward_fp8 as sm90_fwd_fp8,
)
from pallas_fa3.kernels.sm90.config import Sm90ForwardConfig
from pallas_fa3.reference import golden_attention
from pallas_fa3.spec import LOG2E, make_spec
from pallas_fa3.testing import (
  Shape,
  assert_lowered_attention,
  max_abs_err,
  random_inputs,
)

_INTERPRET_TIMEOUT_S = 300


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
  with np.errstate(divide="ignore"):
    lse = (m + np.log2(l) - 8.0)[..., 0] / LOG2E  # [b, hk, g, sq]
  lse = np.where(l[..., 0] == 0, -np.inf, lse)
  return o.reshape(spec.out_shape), lse.reshape(
    spec.batch, spec.heads_q, spec.seq_q
  )


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
  naive, naive_lse = _naive_fp8(spec, x, *tiles)
  np.testing.assert_array_equal(
    np.isneginf(np.asarray(lse)), np.isneginf(golden_lse)
  )
  bound = 2 * max_abs_err(naive, golden) + 1e-3
  assert max_abs_err(out, golden) <= bound
  # lse: the scores carry e4m3 error from Q and K; the same rule, against
  # the materialized lse of the same quantized operands.
  assert max_abs_err(lse, golden_lse) <= (
    2 * max_abs_err(naive_lse, golden_lse) + 1e-3
  )
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
    * max_abs_err(
      _naive_fp8(spec, x, config.block_q, config.block_kv)[0], golden
    )
    + 1e-3
  )


# -- tier 2: lowering for CUDA ---------------------------------------------------


def _fp8_configs():
  # The default run lowers the first config of each head dim (the defaults
  # are compiled by the aot tier); the rest under -m slow.
  for d in sm90_fp8_config.FP8_HEAD_DIMS:
    for i, config in enumerate(sm90_fp8_config.fp8_forward_config_space(d)):
      yield pytest.param(
        d,
        config,
        id=f"d{d}-{config.block_q}x{config.block_kv}x{config.num_stages}",
        marks=[] if i == 0 else [pytest.mark.slow],
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
  # The quantization kernel once per tensor, then the attention kernel.
  assert_lowered_attention(
    exported.mlir_module(), kernels=4, seq_q=1000, seq_kv=1100
  )
  assert exported.out_avals[0].shape == q.shape
  assert exported.out_avals[0].dtype == jnp.bfloat16
