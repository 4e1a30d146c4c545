"""The sm90 kernels on a real Hopper GPU: every supported config, fwd and bwd.

Skipped without an sm90 GPU (the CPU tiers are in test_sm90_fwd.py and
test_sm90_aot.py). What only a GPU shows: true TMA/wgmma asynchrony, the
barrier protocol under real concurrency (a hang is a timeout), tensor-core
accumulation and approximate exp2. Run by `benchmarks/device_check.sh`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_fa3 import backends
from pallas_fa3 import config as kernel_config
from pallas_fa3.kernels import sm90_fwd
from pallas_fa3.spec import make_spec
from pallas_fa3.testing import (Shape, assert_within_tolerance, backward_config_id,
                                golden_and_naive, random_inputs)

pytestmark = [
    pytest.mark.skipif(backends.hopper_reason() is not None,
                       reason=f"needs an sm90 GPU: {backends.hopper_reason()}"),
    pytest.mark.timeout(120),
]


def _configs():
  for dtype in ("bfloat16", "float16"):
    for d in kernel_config.KERNEL_HEAD_DIMS:
      for config in kernel_config.forward_config_space(d):
        yield pytest.param(dtype, d, config, id=f"{dtype}-d{d}-{config.block_q}x"
                           f"{config.block_kv}x{config.num_stages}")


@pytest.mark.parametrize("dtype,head_dim,config", list(_configs()))
def test_every_config_matches_golden(dtype, head_dim, config):
  key = jax.random.key(head_dim * 1000 + config.block_kv + config.num_stages)
  # Ragged both ways, GQA, causal with sq < skv, then non-causal MQA.
  for causal, shape in ((True, Shape(2, 777, 1000, 4, 2, head_dim)),
                        (False, Shape(1, 300, 513, 2, 1, head_dim))):
    key, sub = jax.random.split(key)
    q, k, v, dout = random_inputs(sub, shape, jnp.dtype(dtype))
    spec = make_spec(q, k, v, causal=causal)
    out, lse = jax.jit(lambda q, k, v: sm90_fwd.sm90_forward(
        spec, config, q, k, v))(q, k, v)
    golden, naive = golden_and_naive(q, k, v, dout, causal=causal)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert_within_tolerance("out", out, naive[0], golden[0])
    assert_within_tolerance("lse", lse, naive[1], golden[1])


def test_rows_without_keys_and_determinism():
  shape = Shape(1, 600, 200, 2, 1, 128)
  q, k, v, _ = random_inputs(jax.random.key(1), shape, jnp.bfloat16)
  spec = make_spec(q, k, v, causal=True)
  config = kernel_config.default_forward_config(spec)
  f = jax.jit(lambda q, k, v: sm90_fwd.sm90_forward(spec, config, q, k, v))
  out, lse = f(q, k, v)
  assert np.all(np.asarray(out[:, :400]) == 0)
  assert np.all(np.isneginf(np.asarray(lse[..., :400])))
  again = f(q, k, v)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(again[0]))


def _bwd_configs():
  for dtype in ("bfloat16", "float16"):
    for d in kernel_config.KERNEL_HEAD_DIMS:
      for config in kernel_config.backward_config_space(d):
        yield pytest.param(dtype, d, config, id=backward_config_id(dtype, d, config))


@pytest.mark.parametrize("dtype,head_dim,config", list(_bwd_configs()))
def test_every_backward_config_matches_golden(dtype, head_dim, config):
  from pallas_fa3 import reference
  from pallas_fa3.kernels import sm90_bwd
  key = jax.random.key(head_dim * 7 + config.block_q + config.num_stages)
  for causal, shape in ((True, Shape(2, 777, 1000, 4, 2, head_dim)),
                        (False, Shape(1, 300, 513, 2, 1, head_dim))):
    key, sub = jax.random.split(key)
    q, k, v, dout = random_inputs(sub, shape, jnp.dtype(dtype))
    spec = make_spec(q, k, v, causal=causal)
    out, lse = reference.reference_forward(spec, q, k, v)
    grads = jax.jit(lambda *a: sm90_bwd.sm90_backward(spec, config, *a))(
        q, k, v, out.astype(q.dtype), lse, dout, jnp.zeros_like(lse))
    again = jax.jit(lambda *a: sm90_bwd.sm90_backward(spec, config, *a))(
        q, k, v, out.astype(q.dtype), lse, dout, jnp.zeros_like(lse))
    golden, naive = golden_and_naive(q, k, v, dout, causal=causal)
    for name, x, y, n, g in zip(("dq", "dk", "dv"), grads, again, naive[2:],
                                golden[2:]):
      assert_within_tolerance(name, x, n, g)
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
