"""The FP8 kernel on a real Hopper GPU: every FP8 config against its twin and the golden.

Skipped without an sm90 GPU (the CPU tiers are in test_fp8_kernel.py). What only a
GPU shows: FP8 wgmma (its accumulation), the P staging through shared memory
under real asynchrony, approximate exp2, the barrier protocol under real
concurrency (a hang is a timeout). Run by `benchmarks/device_check.sh`;
`PALLAS_FA3_GPU_TIER=quick` keeps only the default config of each head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_fa3 import backends, fp8
from pallas_fa3.backends.blockwise import fp8 as blockwise_fp8
from pallas_fa3.kernels.sm90 import (
  config_fp8 as sm90_fp8_config,
  forward_fp8 as sm90_fwd_fp8,
)
from pallas_fa3.reference import golden_attention
from pallas_fa3.spec import make_spec
from pallas_fa3.testing import Shape, gpu_tier, max_abs_err, random_inputs

pytestmark = [
  pytest.mark.skipif(
    backends.hopper_reason() is not None,
    reason=f"needs an sm90 GPU: {backends.hopper_reason()}",
  ),
  pytest.mark.timeout(120),
]


def _configs():
  for d in sm90_fp8_config.FP8_HEAD_DIMS:
    for config in sm90_fp8_config.fp8_forward_config_space(d):
      if (
        gpu_tier() == "quick"
        and config != sm90_fp8_config.default_fp8_forward_config(d)
      ):
        continue
      yield pytest.param(
        d,
        config,
        id=f"d{d}-{config.block_q}x{config.block_kv}x{config.num_stages}",
      )


def _rms(x) -> float:
  return float(np.sqrt(np.mean(np.square(np.asarray(x, np.float64)))))


@pytest.mark.parametrize("head_dim,config", list(_configs()))
def test_every_fp8_config_matches_its_twin(head_dim, config):
  key = jax.random.key(head_dim * 1000 + config.block_kv + config.num_stages)
  default = config == sm90_fp8_config.default_fp8_forward_config(head_dim)
  cases = [(True, Shape(2, 777, 1000, 4, 2, head_dim))]
  if default:
    cases.append((False, Shape(1, 300, 513, 2, 1, head_dim)))
  for causal, shape in cases:
    key, sub = jax.random.split(key)
    q, k, v, _ = random_inputs(sub, shape, jnp.bfloat16)
    spec = make_spec(q, k, v, causal=causal)
    x = fp8.quantize(q, k, v, block_q=config.block_q, block_kv=config.block_kv)
    out, lse = jax.jit(
      lambda *a: sm90_fwd_fp8.sm90_forward_fp8(spec, config, *a)
    )(*x)
    twin_out, twin_lse = jax.jit(
      lambda *a: blockwise_fp8.blockwise_forward_fp8(
        spec, config.block_q, config.block_kv, *a
      )
    )(*x)
    golden, golden_lse = golden_attention(q, k, v, causal=causal)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    np.testing.assert_array_equal(
      np.isneginf(np.asarray(lse)), np.isneginf(golden_lse)
    )
    # The GPU and the twin differ by exp2 (approximate), the wgmma's
    # accumulation and P entries that round to the other e4m3 neighbour:
    # small against the FP8 error itself.
    err_twin = _rms(np.float32(twin_out) - golden)
    assert _rms(np.float32(out) - np.float32(twin_out)) <= 0.1 * err_twin
    assert abs(_rms(np.float32(out) - golden) - err_twin) <= 0.05 * err_twin
    assert max_abs_err(lse, twin_lse) <= 1e-3


def test_fp8_rows_without_keys_and_determinism():
  shape = Shape(1, 600, 200, 2, 1, 128)
  q, k, v, _ = random_inputs(jax.random.key(1), shape, jnp.bfloat16)
  spec = make_spec(q, k, v, causal=True)
  config = sm90_fp8_config.default_fp8_forward_config(128)
  x = fp8.quantize(q, k, v, block_q=config.block_q, block_kv=config.block_kv)
  f = jax.jit(lambda *a: sm90_fwd_fp8.sm90_forward_fp8(spec, config, *a))
  out, lse = f(*x)
  assert np.all(np.asarray(out[:, :400]) == 0)
  assert np.all(np.isneginf(np.asarray(lse[..., :400])))
  again = f(*x)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(again[0]))


@pytest.mark.parametrize("head_dim", sm90_fp8_config.FP8_HEAD_DIMS)
def test_quantization_kernel_matches_its_twin(head_dim):
  """The kernel's rotation accumulates in the wgmma's order, the twin's in
  XLA's: the float32 values may differ in the last bit, so a handful of
  e4m3 entries may round the other way; the power-of-two scales agree."""
  from pallas_fa3.kernels.sm90 import quantize as quant_kernel
  from pallas_fa3.quant import e4m3

  shape = Shape(2, 1000, 1000, 4, 2, head_dim)
  q, k, v, _ = random_inputs(jax.random.key(head_dim), shape, jnp.bfloat16)
  config = sm90_fp8_config.default_fp8_forward_config(head_dim)
  kw = dict(
    block_q=config.block_q,
    block_kv=config.block_kv,
    block_quantization=True,
    rotation=True,
    q_residual=head_dim <= 128,
  )
  got = jax.jit(lambda *a: quant_kernel.quantize_inputs_kernel(*a, **kw))(
    q, k, v, jax.random.key(0)
  )
  want = jax.jit(lambda *a: e4m3.quantize_inputs(*a, **kw))(
    q, k, v, jax.random.key(0)
  )
  for name, a, b in zip(want._fields, got, want):
    if b is None:
      assert a is None, name
      continue
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape, name
    if name.endswith("scale"):
      assert np.mean(a != b) <= 0.01, name
    else:
      assert np.mean(a != b) <= 1e-3, name
