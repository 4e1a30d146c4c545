"""FP8 (e4m3) through the API on a CPU: the numerics acceptance against
per-tensor FP8 (FA3 Table 3 setup), gradients, capability and validation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa3
from pallas_fa3 import fp8, masking
from pallas_fa3.kernels.sm90.config import Sm90ForwardConfig
from pallas_fa3.spec import make_spec
from pallas_fa3.testing import (
  Shape,
  random_inputs,
)
from pallas_fa3.tools.numerics import fp8_methods

pytestmark = pytest.mark.newest  # the newest-JAX tier runs it all

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
        config=Sm90ForwardConfig(128, 128, 2),
      ),
      NotImplementedError,
      r"registers of tiles per thread in the FP8 consumer",
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
