"""One dispatch path: the registry, `Sm90Config(forward=, backward=)`, and the
errors a call gets when no backend can serve it."""

from __future__ import annotations

import typing
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import pallas_fa3
from pallas_fa3 import backends
from pallas_fa3.kernels.sm90 import (
  backward as sm90_bwd,
  config_backward as sm90_bwd_config,
)
from pallas_fa3.spec import make_spec
from pallas_fa3.testing import (
  Shape,
  assert_lowered_attention,
  assert_within_tolerance,
  golden_and_naive,
  random_inputs,
  run_interpreted,
)


def test_names_come_from_the_registry():
  names = tuple(b.name for b in backends.BACKENDS)
  assert pallas_fa3.IMPLEMENTATIONS == names
  assert typing.get_args(pallas_fa3.Implementation) == names
  assert len(set(names)) == len(names)
  assert backends.AUTO_ORDER == ("mosaic", "blockwise")


def test_fp8_is_served_by_the_same_registry():
  spec = make_spec(
    *(jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.bfloat16),) * 3,
    fp8=pallas_fa3.FP8Config(),
  )
  assert backends.unsupported_reason("blockwise", spec) is None
  assert backends.unsupported_reason("interpret", spec) is None
  assert "no FP8 path" in backends.unsupported_reason("reference", spec)
  q = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="reference.*no FP8 path"):
    pallas_fa3.flash_attention(q, q, q, fp8=True, implementation="reference")


def test_only_the_interpreter_is_not_partitionable():
  assert [b.name for b in backends.BACKENDS if not b.partitionable] == [
    "interpret"
  ]


def _shapes(sq, skv, d=64):
  q = jax.ShapeDtypeStruct((1, sq, 2, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, skv, 1, d), jnp.bfloat16)
  return q, kv


def _lower_grad(config, sq=192, skv=256):
  q, kv = _shapes(sq, skv)

  def loss(q, k, v):
    out = pallas_fa3.flash_attention(
      q, k, v, causal=True, config=config, implementation="mosaic"
    )
    return out.astype(jnp.float32).sum()

  f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  return export.export(f, platforms=["cuda"])(q, kv, kv).mlir_module()


@pytest.mark.parametrize(
  "config,want",
  [
    (None, None),
    (pallas_fa3.Sm90ForwardConfig(), None),
    (pallas_fa3.Sm90Config(), None),
    (
      pallas_fa3.Sm90Config(
        backward=pallas_fa3.Sm90BackwardConfig(num_stages=3)
      ),
      pallas_fa3.Sm90BackwardConfig(num_stages=3),
    ),
  ],
  ids=["none", "bare-forward", "empty", "chosen"],
)
def test_backward_tiling_is_reachable_from_flash_attention(
  monkeypatch, config, want
):
  """The backward kernel gets `Sm90Config.backward` (default: the
  heuristic); the forward and the fused backward are two kernels."""
  seen = []
  real = sm90_bwd.sm90_backward

  def spy(spec, tiling, *args, **kwargs):
    seen.append(tiling)
    return real(spec, tiling, *args, **kwargs)

  monkeypatch.setattr(sm90_bwd, "sm90_backward", spy)
  jax.clear_caches()  # the backward must be traced again, not reused
  text = _lower_grad(config)
  assert_lowered_attention(text, kernels=2, seq_q=192, seq_kv=256)
  q, kv = _shapes(192, 256)
  default = sm90_bwd_config.default_backward_config(
    make_spec(q, kv, kv, causal=True)
  )
  assert seen == [want or default]


def test_interpret_gradients_with_a_chosen_backward_tiling(key):
  shape = Shape(1, 130, 130, 2, 1, 64)
  q, k, v, dout = random_inputs(key, shape, jnp.bfloat16)
  config = pallas_fa3.Sm90Config(
    forward=pallas_fa3.Sm90ForwardConfig(block_kv=64),
    backward=pallas_fa3.Sm90BackwardConfig(dkdv_consumers=1, dq_consumers=1),
  )
  f = lambda q, k, v: pallas_fa3.flash_attention(
    q, k, v, causal=True, implementation="interpret", config=config
  )

  def fwd_bwd(q, k, v):
    out, pullback = jax.vjp(f, q, k, v)
    return (out,) + pullback(dout)

  got = run_interpreted(fwd_bwd, q, k, v)  # done before the golden starts
  golden, naive = golden_and_naive(q, k, v, dout, causal=True)
  for name, x, n, g in zip(
    ("out", "dq", "dk", "dv"),
    got,
    (naive[0],) + naive[2:],
    (golden[0],) + golden[2:],
  ):
    assert_within_tolerance(name, x, n, g)


def test_a_backward_tiling_that_does_not_fit_is_refused():
  q = jnp.ones((1, 64, 2, 256), jnp.bfloat16)
  config = pallas_fa3.Sm90Config(
    backward=pallas_fa3.Sm90BackwardConfig(
      block_q=128, block_kv=128, num_stages=4
    )
  )
  with pytest.raises(NotImplementedError, match="Sm90BackwardConfig.*256"):
    pallas_fa3.flash_attention(
      q, q, q, implementation="interpret", config=config
    )


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(forward=pallas_fa3.Sm90BackwardConfig()), "Sm90Config.forward"),
    (dict(backward=pallas_fa3.Sm90ForwardConfig()), "Sm90Config.backward"),
    (dict(forward=64), "Sm90Config.forward"),
  ],
)
def test_sm90_config_parts_are_typed(kwargs, match):
  with pytest.raises(TypeError, match=match):
    pallas_fa3.Sm90Config(**kwargs)


def test_a_config_of_another_backend_is_a_type_error():
  q = jnp.ones((1, 16, 1, 64), jnp.bfloat16)
  with pytest.raises(
    TypeError, match="takes a Sm90Config or Sm90ForwardConfig"
  ):
    pallas_fa3.flash_attention(
      q, q, q, implementation="interpret", config=pallas_fa3.BlockwiseConfig()
    )
  with pytest.raises(TypeError, match="takes a BlockwiseConfig"):
    pallas_fa3.flash_attention(
      q, q, q, implementation="blockwise", config=pallas_fa3.Sm90Config()
    )


def test_fp8_has_no_backward_tiling():
  q = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
  config = pallas_fa3.Sm90Config(backward=pallas_fa3.Sm90BackwardConfig())
  with pytest.raises(NotImplementedError, match="backward must be None"):
    pallas_fa3.flash_attention(
      q, q, q, fp8=True, implementation="interpret", config=config
    )


@pytest.mark.parametrize("implementation", ["blockwise", "reference"])
def test_second_order_gradients_say_they_are_not_supported(implementation):
  q = jax.random.normal(jax.random.key(0), (1, 16, 1, 16), jnp.float32)
  first = lambda q: jax.grad(
    lambda q: pallas_fa3.flash_attention(
      q, q, q, implementation=implementation
    ).sum()
  )(q)
  with pytest.raises(NotImplementedError, match="no higher-order derivatives"):
    jax.grad(lambda q: first(q).sum())(q)


def test_first_order_gradients_still_work_under_jit_and_vmap():
  q = jax.random.normal(jax.random.key(1), (2, 1, 16, 1, 16), jnp.float32)
  loss = lambda q: pallas_fa3.flash_attention(q, q, q).sum()
  g = jax.jit(jax.vmap(jax.grad(loss)))(q)
  assert g.shape == q.shape and bool(jnp.isfinite(g).all())


def test_numpy_float64_is_computed_in_float32():
  x = np.random.default_rng(0).standard_normal((1, 24, 2, 16))
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no silent-truncation warning either
    out = pallas_fa3.flash_attention(x, x, x, causal=True)
  want = pallas_fa3.flash_attention(
    *(jnp.asarray(x, jnp.float32),) * 3, causal=True
  )
  assert out.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
