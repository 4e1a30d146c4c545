"""Every validation path of the public API, one test per error.

Each error test checks the exception type *and* that the message names the
offending argument together with its shape or value. Rules that apply to each
of q, k and v are parametrized over the three operands, so a message that
names the wrong tensor (a copy-pasted "q ...") fails the test.

Validation happens before anything is traced or compiled, so these tests use
tiny shapes and, except for the few positive tests, compile nothing.
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
from pallas_fa3.spec import MAX_HEAD_DIM, make_spec

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


def _attention(**kwargs):
  """flash_attention on valid tiny operands, with keyword overrides."""
  ops = _operands()
  return flash_attention(ops["q"], ops["k"], ops["v"], **kwargs)


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


# ---------------------------------------------------------------------------
# softmax_scale.


@pytest.mark.parametrize(
  "scale",
  [
    math.nan,
    math.inf,
    -math.inf,
    0,
    0.0,
    -0.0,
    -1.0,
    -1,
    np.float32(np.nan),
    np.float32(-2.0),
    np.array(0.0),
    jnp.array(jnp.inf),
  ],
  ids=repr,
)
def test_non_finite_or_non_positive_scale(scale):
  # The message shows the offending value (an array's item).
  shown = scale.item() if isinstance(scale, (np.ndarray, jax.Array)) else scale
  with pytest.raises(
    ValueError,
    match=(
      r"^softmax_scale must be finite and positive; got "
      + re.escape(repr(shown))
      + "$"
    ),
  ):
    _attention(softmax_scale=scale)


@pytest.mark.parametrize(
  "scale",
  [
    "0.5",
    b"0.5",
    True,
    False,
    np.True_,
    np.array(True),
    complex(0.5, 0),
    [0.5],
    object(),
  ],
  ids=[
    "str",
    "bytes",
    "True",
    "False",
    "np.True_",
    "np-array-True",
    "complex",
    "list",
    "object",
  ],
)
def test_non_numeric_or_bool_scale(scale):
  # Names the value and its type (for a 0-d array, of the item it holds).
  shown = scale.item() if isinstance(scale, np.ndarray) else scale
  with pytest.raises(
    TypeError,
    match=(
      r"^softmax_scale must be a real number or None; got "
      + re.escape(f"{shown!r} of type {type(shown).__name__}")
      + "$"
    ),
  ):
    _attention(softmax_scale=scale)


@pytest.mark.parametrize(
  "scale", [np.array([0.5, 0.5]), jnp.ones((2, 1))], ids=["numpy", "jax"]
)
def test_array_scale_with_several_elements(scale):
  with pytest.raises(
    TypeError,
    match=(
      r"^softmax_scale must be a scalar; got an array of shape "
      + re.escape(str(tuple(scale.shape)))
    ),
  ):
    _attention(softmax_scale=scale)


def test_traced_scale_is_a_type_error():
  ops = _operands()

  @jax.jit
  def f(q, k, v, scale):
    return flash_attention(q, k, v, softmax_scale=scale)

  with pytest.raises(
    TypeError,
    match=(
      r"^softmax_scale must be a concrete Python number, not a traced value"
      r".*static argument"
    ),
  ):
    f(ops["q"], ops["k"], ops["v"], 0.5)


@pytest.mark.parametrize("scale", [1e39, 1e300, 1e-50])
def test_scale_overflowing_float32_is_rejected(scale):
  with pytest.raises(ValueError, match=r"softmax_scale"):
    make_spec(**_operands(), softmax_scale=scale)


# ---------------------------------------------------------------------------
# causal, return_lse, implementation, config.


@pytest.mark.parametrize(
  "causal",
  [1, 0, 1.0, "yes", "", None, [True], jnp.array(True)],
  ids=lambda c: type(c).__name__ + ":" + repr(c)[:20],
)
def test_non_bool_causal(causal):
  with pytest.raises(
    TypeError,
    match=(
      rf"^causal must be a bool; got {re.escape(repr(causal))}"
      rf" of type {type(causal).__name__}$"
    ),
  ):
    _attention(causal=causal)


@pytest.mark.parametrize(
  "return_lse",
  [1, 0, "yes", None, 1.0],
  ids=lambda c: type(c).__name__ + ":" + repr(c),
)
def test_non_bool_return_lse(return_lse):
  with pytest.raises(
    TypeError,
    match=(
      rf"^return_lse must be a bool; got {re.escape(repr(return_lse))}"
      rf" of type {type(return_lse).__name__}$"
    ),
  ):
    _attention(return_lse=return_lse)


@pytest.mark.parametrize(
  "implementation",
  [
    "bogus",
    "Blockwise",
    "",
    " reference",
    "pallas",
  ],
)
def test_unknown_implementation(implementation):
  with pytest.raises(
    ValueError,
    match=(
      r"^implementation must be None or one of \('mosaic', 'interpret',"
      rf" 'blockwise', 'reference'\); got {re.escape(repr(implementation))}$"
    ),
  ):
    _attention(implementation=implementation)


@pytest.mark.parametrize(
  "implementation",
  [
    3,
    True,
    b"blockwise",
    ["blockwise"],
    ("blockwise",),
  ],
  ids=lambda i: type(i).__name__,
)
def test_non_string_implementation(implementation):
  with pytest.raises(
    TypeError,
    match=(
      r"^implementation must be None or a string, one of .*; got "
      + re.escape(repr(implementation))
      + " of type"
    ),
  ):
    _attention(implementation=implementation)


@pytest.mark.parametrize(
  "config",
  [object(), "x", 64, BlockwiseConfig],
  ids=["object", "str", "int", "the-class"],
)
def test_wrong_config_type_for_blockwise(config):
  with pytest.raises(
    TypeError,
    match=(
      rf"^config={re.escape(repr(config))} does not fit:"
      r" implementation='blockwise' takes a BlockwiseConfig$"
    ),
  ):
    _attention(implementation="blockwise", config=config)


def test_config_for_backend_that_takes_none():
  config = BlockwiseConfig()
  with pytest.raises(
    TypeError,
    match=(
      rf"^config={re.escape(repr(config))} does not fit:"
      r" implementation='reference' takes no config$"
    ),
  ):
    _attention(implementation="reference", config=config)


@pytest.mark.parametrize("config", [object(), "x"], ids=["object", "str"])
def test_wrong_config_type_with_automatic_choice(config):
  with pytest.raises(
    TypeError,
    match=(
      rf"^config={re.escape(repr(config))} fits no automatically chosen"
      r" backend \(.*blockwise: implementation='blockwise' takes a"
      r" BlockwiseConfig\)$"
    ),
  ):
    _attention(config=config)


@pytest.mark.parametrize("field", ["block_q", "block_kv"])
@pytest.mark.parametrize("value", [0, -1, -128, 8193, 10**9])
def test_blockwise_config_out_of_range(field, value):
  with pytest.raises(
    ValueError,
    match=(rf"^BlockwiseConfig\.{field} must be in \[1, 8192\]; got {value}$"),
  ):
    BlockwiseConfig(**{field: value})


@pytest.mark.parametrize("field", ["block_q", "block_kv"])
@pytest.mark.parametrize(
  "value",
  [True, False, 64.0, 1.5, "64", None],
  ids=lambda v: type(v).__name__ + ":" + repr(v),
)
def test_blockwise_config_non_int(field, value):
  with pytest.raises(
    TypeError,
    match=(
      rf"^BlockwiseConfig\.{field} must be an int; got {re.escape(repr(value))}"
      rf" of type {type(value).__name__}$"
    ),
  ):
    BlockwiseConfig(**{field: value})


def test_blockwise_config_limits_are_accepted():
  assert BlockwiseConfig(block_q=1, block_kv=8192) == BlockwiseConfig(1, 8192)


# ---------------------------------------------------------------------------
# Backends that cannot run here.


def test_mosaic_not_available_says_why():
  if jax.default_backend() == "gpu":
    pytest.skip("checks a machine without a Hopper GPU")
  with pytest.raises(
    NotImplementedError,
    match=(
      r"^implementation='mosaic' cannot run here: no GPU: the default JAX"
      r" backend is 'cpu'.*implementation='interpret'"
    ),
  ):
    x = jnp.ones((1, 64, 2, 64), jnp.bfloat16)  # a call the kernel serves
    flash_attention(x, x, x, implementation="mosaic")


def test_kernel_backends_refuse_what_the_kernel_does_not_serve():
  with pytest.raises(
    NotImplementedError,
    match=(
      r"^implementation='interpret' cannot run this call: dtype float32 is"
      r" not served by the kernel"
    ),
  ):
    _attention(implementation="interpret")


@pytest.mark.parametrize("implementation", ["mosaic", "interpret"])
def test_unavailable_backend_with_bad_inputs_reports_the_inputs(implementation):
  # Input errors come first: they are the caller's bug on any machine.
  ops = _operands(k=SHAPE[:3])
  with pytest.raises(ValueError, match=r"^k must have rank 4"):
    flash_attention(**ops, implementation=implementation)


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
