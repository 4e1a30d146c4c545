"""Helpers of the Flax tests: run a layer forward and backward, apply the tolerance rule.

The oracle of a Flax layer is Flax's own layer with its default attention run
in float32 (same parameters, same inputs); the naive low-precision
computation is Flax's layer run in the low dtype. A float32 layer is compared
with the float32 oracle at the rule's floor (a few float32 ulps).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_fa3.testing import assert_within_tolerance, max_abs_err, tolerance

# Non-zero biases, so that loading a checkpoint is visible in the output.
BIAS_INIT = nnx.initializers.normal(0.5)

# Softmax rows are invariant to adding one value to every score, and the key
# bias adds `q . b` to a whole row: its exact gradient is 0, and any computed
# value is rounding noise at the scale of the other gradients.
ZERO_GRADIENT_PARAMS = ("key/bias",)


def flat(tree) -> dict[str, jax.Array]:
  """{"query/kernel": leaf, ...} for a nested dict or an nnx.State."""
  if isinstance(tree, nnx.State):
    tree = nnx.to_pure_dict(tree)
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {
    "/".join(str(getattr(k, "key", k)) for k in path): leaf
    for path, leaf in leaves
  }


def _loss(y, cotangent):
  return jnp.sum(y.astype(jnp.float32) * cotangent)


def nnx_forward_and_grads(module, x, cotangent, remat=False, **call_kwargs):
  """Jitted (output, {param name: gradient}) of `sum(module(x) * cotangent)`.

  With `remat`, the module call is wrapped in `nnx.remat`.
  """
  call = lambda m, x: m(x, **call_kwargs)
  call = nnx.remat(call) if remat else call

  @nnx.jit
  def run(module, x, cotangent):
    def loss(m):
      y = call(m, x)
      return _loss(y, cotangent), y

    (_, y), grads = nnx.value_and_grad(loss, has_aux=True)(module)
    return y, grads

  y, grads = run(module, x, cotangent)
  return y, flat(grads)


def linen_forward_and_grads(module, params, x, cotangent, traced_kwargs=None):
  """Jitted (output, {param name: gradient}) for a Linen module and its params.

  `traced_kwargs` (arrays, e.g. a mask) are call arguments passed through
  `jit` as arguments, so the module sees them as tracers.
  """

  @jax.jit
  def run(params, x, cotangent, traced_kwargs):
    def loss(p):
      y = module.apply(p, x, **traced_kwargs)
      return _loss(y, cotangent), y

    (_, y), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return y, grads

  y, grads = run(params, x, cotangent, traced_kwargs or {})
  return y, flat(grads["params"])


def assert_layer_within_tolerance(got, naive, golden, dtype) -> None:
  """Tolerance rule for (output, grads) triples of a layer.

  Args:
    got: (output, {name: grad}) of the layer under test.
    naive: the same from Flax's layer in `dtype` (ignored for float32).
    golden: the same from Flax's layer in float32.
    dtype: the compute dtype of `got`.
  """
  if jnp.dtype(dtype) == jnp.float32:
    naive = golden  # float32 is itself the oracle: only the floor remains
  (out, grads), (n_out, n_grads), (g_out, g_grads) = got, naive, golden
  assert set(grads) == set(g_grads), (sorted(grads), sorted(g_grads))
  assert out.dtype == jnp.dtype(dtype), out.dtype
  assert_within_tolerance("output", out, n_out, g_out)
  scale = max(float(np.max(np.abs(np.asarray(g)))) for g in g_grads.values())
  for name in sorted(grads):
    if name in ZERO_GRADIENT_PARAMS:
      bound = (
        tolerance(n_grads[name], g_grads[name])
        + float(jnp.finfo(dtype).eps) * scale
      )
      err = max_abs_err(grads[name], g_grads[name])
      assert err <= bound, f"grad {name}: {err:.3g} > {bound:.3g}"
    else:
      assert_within_tolerance(
        f"grad {name}", grads[name], n_grads[name], g_grads[name]
      )


def normal(rng: np.random.Generator, shape, dtype=jnp.float32) -> jax.Array:
  """Standard-normal array of `shape` in `dtype` (rounded from float32)."""
  return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)


def random_layer_inputs(rng, shape, features, dtype):
  """(x in `dtype`, x as float32 for the oracle, float32 cotangent)."""
  x = normal(rng, tuple(shape) + (features,), dtype)
  cotangent = normal(rng, tuple(shape) + (features,))
  return x, x.astype(jnp.float32), cotangent
