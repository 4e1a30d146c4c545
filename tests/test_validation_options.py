"""Validation of the options: softmax_scale, causal, return_lse,
implementation and config, and backends that cannot run here.

Each error test checks the exception type *and* that the message names the
offending argument together with its value. Validation happens before
anything is traced or compiled, so these tests use tiny shapes.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_fa3 import BlockwiseConfig, flash_attention
from pallas_fa3.spec import make_spec

pytestmark = pytest.mark.newest  # the newest-JAX tier runs it all

SHAPE = (1, 4, 2, 8)  # [batch, seq, heads, head_dim]


NAMES = ("q", "k", "v")


def _operands(dtype=jnp.float32, **shapes):
  """q, k, v of `SHAPE` in `dtype`, with per-operand shape overrides."""
  return {name: jnp.zeros(shapes.get(name, SHAPE), dtype) for name in NAMES}


def _attention(**kwargs):
  """flash_attention on valid tiny operands, with keyword overrides."""
  ops = _operands()
  return flash_attention(ops["q"], ops["k"], ops["v"], **kwargs)


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
