"""The reference and the golden reject what flash_attention rejects, and
the inputs that must be accepted (numpy arrays and scalars, bool-likes, GQA,
shape descriptors) are.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_fa3 import BlockwiseConfig, flash_attention, reference_attention
from pallas_fa3.reference import golden_attention
from pallas_fa3.spec import make_spec

pytestmark = pytest.mark.newest  # the newest-JAX tier runs it all

SHAPE = (1, 4, 2, 8)  # [batch, seq, heads, head_dim]


NAMES = ("q", "k", "v")


def _operands(dtype=jnp.float32, **shapes):
  """q, k, v of `SHAPE` in `dtype`, with per-operand shape overrides."""
  return {name: jnp.zeros(shapes.get(name, SHAPE), dtype) for name in NAMES}


def _with_axis(axis: int, size: int, shape=SHAPE) -> tuple[int, ...]:
  out = list(shape)
  out[axis] = size
  return tuple(out)


def _shape_re(name: str, shape) -> str:
  """Regex for `name.shape=(...)` as the shared shape summary prints it."""
  return re.escape(f"{name}.shape={tuple(shape)}")


def _attention(**kwargs):
  """flash_attention on valid tiny operands, with keyword overrides."""
  ops = _operands()
  return flash_attention(ops["q"], ops["k"], ops["v"], **kwargs)


# ---------------------------------------------------------------------------
# The reference and the golden share the helper.


def _bad_cases():
  ok = _operands()
  bf = _operands(jnp.bfloat16)
  return [
    pytest.param(
      dict(ok, k=jnp.zeros(SHAPE[:3])),
      {},
      ValueError,
      r"^k must have rank 4",
      id="k-rank",
    ),
    pytest.param(
      dict(ok, v=jnp.zeros(_with_axis(1, 5))),
      {},
      ValueError,
      r"^k and v must have the same sequence length.*"
      + _shape_re("v", _with_axis(1, 5)),
      id="kv-seq",
    ),
    pytest.param(
      dict(bf, k=jnp.zeros(SHAPE)),
      {},
      TypeError,
      r"k\.dtype=float32",
      id="mixed-dtype",
    ),
    pytest.param(
      dict(ok, v=np.zeros(SHAPE, np.int32)),
      {},
      TypeError,
      r"^v has dtype int32",
      id="int32",
    ),
    pytest.param(
      dict(ok, q=jnp.zeros(_with_axis(1, 0))),
      {},
      ValueError,
      r"^q has an empty seq axis",
      id="empty-seq",
    ),
    pytest.param(
      ok,
      {"softmax_scale": math.nan},
      ValueError,
      r"^softmax_scale must be finite and positive; got nan",
      id="scale-nan",
    ),
    pytest.param(
      ok,
      {"causal": 1},
      TypeError,
      r"^causal must be a bool; got 1",
      id="causal-int",
    ),
  ]


@pytest.mark.parametrize(
  "fn",
  [reference_attention, golden_attention],
  ids=["reference_attention", "golden_attention"],
)
@pytest.mark.parametrize("ops,kwargs,exc,pattern", _bad_cases())
def test_reference_and_golden_reject_the_same_inputs(
  fn, ops, kwargs, exc, pattern
):
  with pytest.raises(exc, match=pattern):
    fn(ops["q"], ops["k"], ops["v"], **kwargs)


# ---------------------------------------------------------------------------
# Inputs that must be accepted.


@pytest.mark.parametrize(
  "dtype", [np.float32, np.float16], ids=["float32", "float16"]
)
def test_numpy_inputs_are_accepted(dtype):
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal(SHAPE).astype(dtype) for _ in range(3))
  out = flash_attention(q, k, v)
  assert out.shape == SHAPE and out.dtype == jnp.dtype(dtype)
  want = reference_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
  tol = 1e-5 if dtype == np.float32 else 5e-3
  np.testing.assert_allclose(
    np.asarray(out, np.float32),
    np.asarray(want, np.float32),
    atol=tol,
    rtol=tol,
  )


@pytest.mark.parametrize(
  "scale",
  [
    np.float32(0.25),
    np.float64(0.25),
    np.array(0.25),
    np.array([0.25]),
    jnp.array(0.25),
    jnp.float32(0.25),
    0.25,
    1 / 4,
  ],
  ids=lambda s: type(s).__name__,
)
def test_scalar_scale_forms_are_accepted(scale):
  spec = make_spec(**_operands(), softmax_scale=scale)
  assert spec.softmax_scale == 0.25
  assert type(spec.softmax_scale) is float  # hashable static value


def test_numpy_and_jax_scalar_scale_match_python_float():
  ops = _operands()
  ops["q"] = jax.random.normal(jax.random.key(0), SHAPE)
  ops["k"] = jax.random.normal(jax.random.key(1), SHAPE)
  ops["v"] = jax.random.normal(jax.random.key(2), SHAPE)
  want = flash_attention(**ops, softmax_scale=0.25)
  for scale in (np.float32(0.25), jnp.array(0.25, jnp.float32)):
    got = flash_attention(**ops, softmax_scale=scale)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_integer_scale_is_accepted():
  assert make_spec(**_operands(), softmax_scale=2).softmax_scale == 2.0


def test_default_scale_is_inverse_sqrt_head_dim():
  spec = make_spec(**_operands())
  assert spec.softmax_scale == pytest.approx(1 / math.sqrt(SHAPE[3]))


def test_scale_passed_as_static_argument_under_jit():
  ops = _operands()
  f = jax.jit(
    lambda q, k, v, scale: flash_attention(q, k, v, softmax_scale=scale),
    static_argnames="scale",
  )
  out = f(ops["q"], ops["k"], ops["v"], scale=0.5)
  assert out.shape == SHAPE


@pytest.mark.parametrize("causal", [True, False, np.True_, np.False_], ids=repr)
def test_bool_like_causal_is_accepted(causal):
  spec = make_spec(**_operands(), causal=causal)
  assert spec.causal is bool(causal)


@pytest.mark.parametrize(
  "hq,hk", [(8, 2), (8, 1), (8, 8)], ids=["GQA-8/2", "MQA-8/1", "MHA-8/8"]
)
def test_query_heads_multiple_of_kv_heads_accepted(hq, hk):
  q = jnp.ones(_with_axis(2, hq))
  kv = jnp.ones(_with_axis(2, hk))
  spec = make_spec(q, kv, kv)
  assert (spec.heads_q, spec.heads_kv, spec.group_size) == (hq, hk, hq // hk)
  if hk != hq:
    out = flash_attention(q, kv, kv)
    assert out.shape == _with_axis(2, hq)
    # All-ones operands: every query attends uniformly to ones.
    np.testing.assert_allclose(np.asarray(out), 1.0, rtol=1e-6)


def test_shape_dtype_struct_is_not_an_array():
  ops = _operands()
  ops["k"] = jax.ShapeDtypeStruct(ops["k"].shape, ops["k"].dtype)
  with pytest.raises(
    TypeError, match=r"^k must be an array .* got ShapeDtypeStruct"
  ):
    flash_attention(**ops)


def test_numpy_bool_return_lse_is_accepted():
  out, lse = _attention(return_lse=np.True_)
  assert lse.shape == (out.shape[0], out.shape[2], out.shape[1])


def test_blockwise_config_accepts_numpy_ints():
  cfg = BlockwiseConfig(block_q=np.int64(32), block_kv=np.int32(16))
  assert cfg == BlockwiseConfig(32, 16) and type(cfg.block_q) is int
  assert hash(cfg) == hash(BlockwiseConfig(32, 16))


def test_make_spec_reads_shape_descriptors():
  """make_spec only reads shapes and dtypes: ShapeDtypeStructs describe a call."""
  sds = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  spec = make_spec(
    sds((2, 10, 4, 64)), sds((2, 12, 2, 64)), sds((2, 12, 2, 32)), causal=True
  )
  assert (spec.group_size, spec.causal_offset, spec.out_shape) == (
    2,
    2,
    (2, 10, 4, 32),
  )
  with pytest.raises(ValueError, match=r"^k must have rank 4"):
    make_spec(sds((2, 10, 4, 64)), sds((12, 2, 64)), sds((2, 12, 2, 32)))
