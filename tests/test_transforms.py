"""flash_attention under JAX transformations: jit, vmap, grad, checkpoint, export.

(Random shapes, dtypes, options and tilings against the golden:
test_property_golden.py.)"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ALL_IMPLEMENTATIONS, skip_if_unsupported

import pallas_fa3
from pallas_fa3.testing import Shape, random_inputs

_SHAPE = Shape(1, 70, 90, 4, 2, 64)


def _loss_fn(implementation, causal=True):
  def loss(q, k, v, dout):
    out = pallas_fa3.flash_attention(
      q, k, v, causal=causal, implementation=implementation
    )
    return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

  return loss


def _assert_trees_close(a, b, rtol=2e-6, atol=2e-6):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(
      np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol, atol=atol
    )


@pytest.mark.parametrize("implementation", ALL_IMPLEMENTATIONS)
def test_jit_with_static_options(implementation, key):
  q, k, v, _ = random_inputs(key, _SHAPE, jnp.float32)
  skip_if_unsupported(implementation, q, k, v, True)

  @functools.partial(jax.jit, static_argnames=("causal", "scale"))
  def f(q, k, v, causal, scale):
    return pallas_fa3.flash_attention(
      q, k, v, causal=causal, softmax_scale=scale, implementation=implementation
    )

  eager = pallas_fa3.flash_attention(
    q, k, v, causal=True, softmax_scale=0.2, implementation=implementation
  )
  np.testing.assert_array_equal(
    np.asarray(f(q, k, v, True, 0.2)), np.asarray(eager)
  )


@pytest.mark.parametrize("implementation", ALL_IMPLEMENTATIONS)
def test_vmap_matches_a_loop(implementation, key):
  """vmap over an extra leading axis, of the forward and of the gradients."""
  stacked = [
    random_inputs(jax.random.fold_in(key, i), _SHAPE, jnp.float32)
    for i in range(3)
  ]
  q, k, v, dout = (jnp.stack(x) for x in zip(*stacked))
  skip_if_unsupported(implementation, q[0], k[0], v[0], True)
  fwd = lambda q, k, v: pallas_fa3.flash_attention(
    q, k, v, causal=True, return_lse=True, implementation=implementation
  )
  grad = jax.grad(_loss_fn(implementation), argnums=(0, 1, 2))
  batched = (
    jax.jit(jax.vmap(fwd))(q, k, v),
    jax.jit(jax.vmap(grad))(q, k, v, dout),
  )
  for i in range(3):
    single = fwd(q[i], k[i], v[i]), grad(q[i], k[i], v[i], dout[i])
    _assert_trees_close(jax.tree.map(lambda x: x[i], batched), single)


@pytest.mark.parametrize("implementation", ALL_IMPLEMENTATIONS)
def test_checkpoint(implementation, key):
  """jax.checkpoint (remat) recomputes the forward and gives the same grads."""
  q, k, v, dout = random_inputs(key, _SHAPE, jnp.bfloat16)
  skip_if_unsupported(implementation, q, k, v, True)
  loss = _loss_fn(implementation)
  plain = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, dout)
  policy = jax.checkpoint_policies.nothing_saveable
  remat = jax.jit(
    jax.grad(jax.checkpoint(loss, policy=policy), argnums=(0, 1, 2))
  )(q, k, v, dout)
  for a, b in zip(plain, remat):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_checkpoint_inside_a_layer_stack(key):
  """Remat around a small two-layer stack, as a model would use it."""
  q, k, v, dout = random_inputs(key, _SHAPE, jnp.float32)

  def layer(x, kv):
    return pallas_fa3.flash_attention(x, kv, kv[..., :64], causal=True) + x

  def model(x):
    kv = x[:, :, ::2]  # [b, sq, 2, d]: GQA with 4 query heads
    return jnp.sum(layer(layer(x, kv), kv) * dout)

  plain = jax.grad(model)(q)
  remat = jax.grad(jax.checkpoint(model))(q)
  np.testing.assert_allclose(
    np.asarray(plain), np.asarray(remat), rtol=1e-6, atol=1e-6
  )


@pytest.mark.parametrize("implementation", ["blockwise", "reference"])
def test_export_round_trip(implementation, key):
  """jax.export of forward and full gradient, serialized, deserialized, called."""
  q, k, v, dout = random_inputs(key, _SHAPE, jnp.bfloat16)
  specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v, dout)]
  fwd = jax.jit(
    lambda q, k, v, dout: pallas_fa3.flash_attention(
      q, k, v, causal=True, return_lse=True, implementation=implementation
    )
  )
  grad = jax.jit(jax.grad(_loss_fn(implementation), argnums=(0, 1, 2)))
  for fn in (fwd, grad):
    exported = jax.export.export(fn, platforms=["cpu", "cuda"])(*specs)
    restored = jax.export.deserialize(exported.serialize())
    assert restored.platforms == ("cpu", "cuda")
    # bf16 outputs: allow one bf16 ulp for a differently fused compile.
    _assert_trees_close(
      restored.call(q, k, v, dout), fn(q, k, v, dout), rtol=1e-2, atol=1e-2
    )
