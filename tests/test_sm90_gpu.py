"""The sm90 kernels on a real Hopper GPU: configs against the golden, fwd and bwd.

Skipped without an sm90 GPU (the CPU tiers are in test_sm90_fwd.py and
test_sm90_aot.py). What only a GPU shows: true TMA/wgmma asynchrony, the
barrier protocol under real concurrency (a hang is a timeout), tensor-core
accumulation and approximate exp2. Run by `benchmarks/device_check.sh`.

Sized for scarce GPU time (`testing.gpu_tier()`): each config is compiled
once per shape and run on several input sets; every config of the space is
checked in bf16 on a causal, GQA, ragged shape; the default config of each
head dim also non-causal MQA and in fp16. `PALLAS_FA3_GPU_TIER=quick` keeps
only the default configs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import case_id

from pallas_fa3 import backends, reference
from pallas_fa3.kernels.sm90 import (
  backward as sm90_bwd,
  config as sm90_config,
  config_backward as sm90_bwd_config,
  forward as sm90_fwd,
)
from pallas_fa3.spec import make_spec
from pallas_fa3.testing import (
  Shape,
  assert_within_tolerance,
  golden_and_naive,
  gpu_tier,
  random_inputs,
)

pytestmark = [
  pytest.mark.skipif(
    backends.hopper_reason() is not None,
    reason=f"needs an sm90 GPU: {backends.hopper_reason()}",
  ),
  pytest.mark.timeout(120),
]

_SEEDS = 3  # input sets through each compiled kernel


def _shapes(head_dim: int, default: bool):
  # Ragged both ways, GQA, causal with sq < skv; then non-causal MQA.
  yield True, Shape(2, 777, 1000, 4, 2, head_dim)
  if default:
    yield False, Shape(1, 300, 513, 2, 1, head_dim)
    # 144 query tiles of 128 rows, more than an H100/H200 has SMs: CTAs of
    # the persistent grid walk two tiles each, the ring running on.
    yield True, Shape(3, 700, 700, 8, 2, head_dim)


def _spec(shape: Shape, dtype: str, causal: bool, deterministic=False):
  struct = lambda s, h, d: jax.ShapeDtypeStruct((shape.batch, s, h, d), dtype)
  return make_spec(
    struct(shape.seq_q, shape.heads_q, shape.head_dim),
    struct(shape.seq_kv, shape.heads_kv, shape.head_dim),
    struct(shape.seq_kv, shape.heads_kv, shape.dv),
    causal=causal,
    deterministic=deterministic,
  )


def _cases(space, default_of):
  for d in sm90_config.KERNEL_HEAD_DIMS:
    q = jax.ShapeDtypeStruct((1, 128, 1, d), jnp.bfloat16)
    default = default_of(make_spec(q, q, q))
    for config in space(d):
      is_default = config == default
      if gpu_tier() == "quick" and not is_default:
        continue
      for dtype in ("bfloat16", "float16") if is_default else ("bfloat16",):
        yield pytest.param(
          dtype, d, config, is_default, id=case_id(dtype, d, config)
        )


@pytest.mark.parametrize(
  "dtype,head_dim,config,default",
  list(
    _cases(sm90_config.forward_config_space, sm90_config.default_forward_config)
  ),
)
def test_forward_configs_match_golden(dtype, head_dim, config, default):
  key = jax.random.key(head_dim * 1000 + config.block_kv + config.num_stages)
  for causal, shape in _shapes(head_dim, default):
    spec = _spec(shape, dtype, causal)
    f = jax.jit(lambda q, k, v: sm90_fwd.sm90_forward(spec, config, q, k, v))
    for _ in range(_SEEDS):
      key, sub = jax.random.split(key)
      q, k, v, dout = random_inputs(sub, shape, jnp.dtype(dtype))
      out, lse = f(q, k, v)
      golden, naive = golden_and_naive(q, k, v, dout, causal=causal)
      assert np.all(np.isfinite(np.asarray(out, np.float32)))
      assert_within_tolerance("out", out, naive[0], golden[0])
      assert_within_tolerance("lse", lse, naive[1], golden[1])


def test_rows_without_keys_and_determinism():
  shape = Shape(1, 600, 200, 2, 1, 128)
  q, k, v, _ = random_inputs(jax.random.key(1), shape, jnp.bfloat16)
  spec = make_spec(q, k, v, causal=True)
  config = sm90_config.default_forward_config(spec)
  f = jax.jit(lambda q, k, v: sm90_fwd.sm90_forward(spec, config, q, k, v))
  out, lse = f(q, k, v)
  assert np.all(np.asarray(out[:, :400]) == 0)
  assert np.all(np.isneginf(np.asarray(lse[..., :400])))
  again = f(q, k, v)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(again[0]))


def _backward_cases():
  """Both backward spaces: the fused kernel's and the deterministic one's."""
  for det in (False, True):
    space = lambda d, det=det: sm90_bwd_config.backward_config_space(d, 2, det)
    default_of = lambda spec, det=det: sm90_bwd_config.default_backward_config(
      dataclasses.replace(spec, deterministic=det)
    )
    for param in _cases(space, default_of):
      yield pytest.param(
        *param.values, det, id=f"{param.id}-{'det' if det else 'fused'}"
      )


@pytest.mark.parametrize(
  "dtype,head_dim,config,default,deterministic", list(_backward_cases())
)
def test_backward_configs_match_golden(
  dtype, head_dim, config, default, deterministic
):
  key = jax.random.key(head_dim * 7 + config.block_q + config.num_stages)
  for causal, shape in _shapes(head_dim, default):
    spec = _spec(shape, dtype, causal, deterministic)
    f = jax.jit(lambda *a: sm90_bwd.sm90_backward(spec, config, *a))
    for seed in range(_SEEDS):
      key, sub = jax.random.split(key)
      q, k, v, dout = random_inputs(sub, shape, jnp.dtype(dtype))
      out, lse = reference.reference_forward(spec, q, k, v)
      args = (q, k, v, out.astype(q.dtype), lse, dout, jnp.zeros_like(lse))
      grads = f(*args)
      golden, naive = golden_and_naive(q, k, v, dout, causal=causal)
      for name, x, n, g in zip(
        ("dq", "dk", "dv"), grads, naive[2:], golden[2:]
      ):
        assert_within_tolerance(name, x, n, g)
      if seed == 0 and deterministic:  # bitwise reproducible
        for name, x, y in zip(("dq", "dk", "dv"), grads, f(*args)):
          np.testing.assert_array_equal(
            np.asarray(x), np.asarray(y), err_msg=name
          )
