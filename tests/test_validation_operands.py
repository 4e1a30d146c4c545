"""Validation of the operands q, k and v: one test per error.

Each error test checks the exception type *and* that the message names the
offending operand together with its shape or dtype. Rules that apply to each
of q, k and v are parametrized over the three operands, so a message that
names the wrong tensor (a copy-pasted "q ...") fails the test. Validation
happens before anything is traced, so these tests use tiny shapes.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_fa3 import flash_attention
from pallas_fa3.spec import MAX_HEAD_DIM, make_spec

pytestmark = pytest.mark.newest  # the newest-JAX tier runs it all

SHAPE = (1, 4, 2, 8)  # [batch, seq, heads, head_dim]


NAMES = ("q", "k", "v")


AXES = ("batch", "seq", "heads", "head_dim")


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


# ---------------------------------------------------------------------------
# Operands: type, rank, dtype, empty axes, head_dim limit.


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("rank", [2, 3, 5])
def test_wrong_rank_names_operand_and_shape(name, rank):
  shape = (1, 4, 2, 8, 3)[:rank]
  ops = _operands(**{name: shape})
  with pytest.raises(
    ValueError,
    match=(
      rf"^{name} must have rank 4 .*\[batch, seq, heads, head_dim\];"
      rf" got shape {re.escape(str(shape))} \(rank {rank}\)"
    ),
  ):
    flash_attention(**ops)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
  "bad",
  [
    pytest.param(np.zeros(SHAPE, np.float32).tolist(), id="list"),
    pytest.param(tuple(np.zeros(SHAPE[:1])), id="tuple"),
    pytest.param(1.0, id="float"),
    pytest.param(None, id="None"),
  ],
)
def test_non_array_operand(name, bad):
  ops = _operands()
  ops[name] = bad
  with pytest.raises(
    TypeError,
    match=(
      rf"^{name} must be an array of shape \[batch, seq, heads, head_dim\];"
      rf" got {type(bad).__name__}$"
    ),
  ):
    flash_attention(**ops)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.uint8, jnp.bool_])
def test_integer_or_bool_operand(name, dtype):
  ops = _operands()
  ops[name] = jnp.zeros(SHAPE, dtype)
  with pytest.raises(
    TypeError,
    match=(
      rf"^{name} has dtype {jnp.dtype(dtype)}; supported dtypes are"
      r" float16, bfloat16, float32$"
    ),
  ):
    flash_attention(**ops)


@pytest.mark.parametrize("name", NAMES)
def test_float64_numpy_operand_is_taken_as_jnp_asarray_takes_it(name):
  # Without x64, jnp.asarray(float64 numpy) is float32: so is the call.
  ops = _operands()
  ops[name] = np.ones(SHAPE, np.float64)
  out = flash_attention(**ops)
  assert out.dtype == jnp.float32
  want = flash_attention(**{n: jnp.asarray(x) for n, x in ops.items()})
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


def test_float64_numpy_operands_follow_x64():
  x = np.zeros(SHAPE, np.float64)
  assert flash_attention(x, x, x).dtype == jnp.float32
  with jax.enable_x64(True):
    # Now jnp.asarray keeps float64, the golden's precision: refused.
    with pytest.raises(TypeError, match=r"^q has dtype float64"):
      flash_attention(x, x, x)


@pytest.mark.parametrize("odd", NAMES)
def test_mixed_dtypes_name_every_dtype(odd):
  ops = _operands(jnp.bfloat16)
  ops[odd] = jnp.zeros(SHAPE, jnp.float32)
  with pytest.raises(
    TypeError, match=r"^q, k and v must have the same dtype"
  ) as e:
    flash_attention(**ops)
  msg = str(e.value)
  for name in NAMES:
    want = "float32" if name == odd else "bfloat16"
    assert f"{name}.dtype={want}" in msg, msg


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("axis", range(4), ids=AXES)
def test_empty_axis(name, axis):
  shape = _with_axis(axis, 0)
  ops = _operands(**{name: shape})
  with pytest.raises(
    ValueError,
    match=(
      rf"^{name} has an empty {AXES[axis]} axis \(axis {axis}\):"
      rf" shape {re.escape(str(shape))}"
    ),
  ):
    flash_attention(**ops)


def test_empty_sequence_of_both_k_and_v():
  shape = _with_axis(1, 0)
  ops = _operands(k=shape, v=shape)
  with pytest.raises(ValueError, match=r"^k has an empty seq axis \(axis 1\)"):
    flash_attention(**ops)


@pytest.mark.parametrize("name", NAMES)
def test_head_dim_over_limit(name):
  d = MAX_HEAD_DIM + 1
  shape = _with_axis(3, d)
  ops = _operands(**{name: shape})
  with pytest.raises(
    ValueError,
    match=(
      rf"^{name} head_dim {d} exceeds the maximum {MAX_HEAD_DIM};"
      rf" shape {re.escape(str(shape))}$"
    ),
  ):
    flash_attention(**ops)


def test_head_dim_over_limit_for_q_and_k_together():
  shape = _with_axis(3, 512)
  ops = _operands(q=shape, k=shape)
  with pytest.raises(
    ValueError, match=r"^q head_dim 512 exceeds the maximum 256"
  ):
    flash_attention(**ops)


def test_head_dim_at_limit_is_accepted():
  shape = _with_axis(3, MAX_HEAD_DIM)
  spec = make_spec(**_operands(q=shape, k=shape, v=shape))
  assert spec.head_dim == spec.head_dim_v == MAX_HEAD_DIM


# ---------------------------------------------------------------------------
# Shapes that disagree between operands.


@pytest.mark.parametrize("odd", NAMES)
def test_mismatched_batch(odd):
  shape = _with_axis(0, 3)
  ops = _operands(**{odd: shape})
  with pytest.raises(
    ValueError,
    match=(
      r"^q, k and v must have the same batch size; got .*"
      + _shape_re(odd, shape)
    ),
  ):
    flash_attention(**ops)


@pytest.mark.parametrize("odd", ["k", "v"])
def test_mismatched_kv_sequence(odd):
  shape = _with_axis(1, 5)
  ops = _operands(**{odd: shape})
  with pytest.raises(
    ValueError,
    match=(
      r"^k and v must have the same sequence length \(axis 1\); got .*"
      + _shape_re(odd, shape)
    ),
  ):
    flash_attention(**ops)


def test_different_q_and_kv_sequence_is_accepted():
  spec = make_spec(**_operands(q=_with_axis(1, 3)))
  assert (spec.seq_q, spec.seq_kv) == (3, 4)


@pytest.mark.parametrize("odd", ["q", "k"])
def test_mismatched_qk_head_dim(odd):
  shape = _with_axis(3, 16)
  ops = _operands(**{odd: shape})
  with pytest.raises(
    ValueError,
    match=(
      r"^q and k must have the same head_dim \(axis 3\); got .*"
      + _shape_re(odd, shape)
    ),
  ):
    flash_attention(**ops)


def test_v_head_dim_may_differ():
  spec = make_spec(**_operands(v=_with_axis(3, 16)))
  assert (spec.head_dim, spec.head_dim_v) == (8, 16)
  assert spec.out_shape == (1, 4, 2, 16)


@pytest.mark.parametrize("odd", ["k", "v"])
def test_mismatched_kv_heads(odd):
  shape = _with_axis(2, 1)
  ops = _operands(**{odd: shape})
  with pytest.raises(
    ValueError,
    match=(
      r"^k and v must have the same number of heads \(axis 2\); got .*"
      + _shape_re(odd, shape)
    ),
  ):
    flash_attention(**ops)


@pytest.mark.parametrize("hq,hk", [(3, 2), (2, 4), (6, 4)])
def test_query_heads_not_a_multiple_of_kv_heads(hq, hk):
  ops = _operands(q=_with_axis(2, hq), k=_with_axis(2, hk), v=_with_axis(2, hk))
  with pytest.raises(
    ValueError,
    match=(
      rf"^q heads \({hq}\) must be a multiple of k/v heads \({hk}\).*"
      + _shape_re("q", _with_axis(2, hq))
      + ".*"
      + _shape_re("k", _with_axis(2, hk))
    ),
  ):
    flash_attention(**ops)
