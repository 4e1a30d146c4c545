"""Forward mode under sharding (issue 69), on 2 and 8 simulated CPU devices:
`jax.jvp` of `flash_attention` inside a batch-sharded `jax.shard_map` and
under `jit` with batch-sharded inputs, of `ring_attention` and of
`ulysses_attention`, each equal to the single-device jvp within the
tolerance rule of the float64 golden; and `jax.grad` of a loss holding a
jvp (sCM/MeanFlow) inside the shard_map.

Run through `tests/test_scale_out.py`, or directly with
`XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import mesh_helpers as mh
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_fa3

mh.require_devices()

B, S, HQ, HK, D = 8, 64, 4, 2, 16


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  shapes = [(B, S, HQ, D), (B, S, HK, D), (B, S, HK, D)]
  x = tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes)
  u = tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes)
  return x, u


def _attn(q, k, v):
  return pallas_fa3.flash_attention(
    q, k, v, causal=True, return_lse=True, implementation="blockwise"
  )


def _single():
  x, u = _inputs()
  return x, u, jax.jit(lambda x, u: jax.jvp(_attn, x, u))(x, u)


def _assert_close(got, want):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


@pytest.mark.parametrize("devices", [2, 8])
def test_jvp_in_a_batch_sharded_shard_map(devices):
  x, u, want = _single()
  mesh = mh.mesh((devices,), ("data",))
  spec = P("data")
  f = jax.shard_map(
    lambda x, u: jax.jvp(_attn, x, u),
    mesh=mesh,
    in_specs=((spec,) * 3, (spec,) * 3),
    out_specs=((spec, spec), (spec, spec)),
  )
  _assert_close(jax.jit(f)(x, u), want)


def test_jvp_under_jit_with_batch_sharded_inputs():
  x, u, want = _single()
  mesh = mh.mesh((8,), ("data",))
  put = lambda t: jax.device_put(t, NamedSharding(mesh, P("data")))
  got = jax.jit(lambda x, u: jax.jvp(_attn, x, u))(put(x), put(u))
  _assert_close(got, want)


def test_grad_of_a_loss_holding_a_jvp_in_a_shard_map():
  x, u = _inputs()
  mesh = mh.mesh((2,), ("data",))

  def loss(q, k, v):
    out, dout = jax.jvp(lambda q: _attn(q, k, v)[0], (q,), (jnp.sin(q),))
    return jnp.sum((out - 0.5 * jax.lax.stop_gradient(dout)) ** 2)

  spec = P("data")
  sharded = jax.shard_map(
    jax.grad(loss, argnums=(0, 1, 2)),
    mesh=mesh,
    in_specs=(spec,) * 3,
    out_specs=(spec,) * 3,
  )
  _assert_close(jax.jit(sharded)(*x), jax.jit(jax.grad(loss, (0, 1, 2)))(*x))


@pytest.mark.parametrize("kind", ["ring", "ulysses"])
def test_jvp_of_sequence_parallel_attention(kind):
  x, u, want = _single()
  mesh = mh.mesh((4,), ("seq",))
  fn = pallas_fa3.ring_attention if kind == "ring" else (
    pallas_fa3.ulysses_attention
  )  # fmt: skip
  f = lambda q, k, v: fn(
    q, k, v, mesh=mesh, seq_axis="seq", causal=True, return_lse=True,
    implementation="blockwise",
  )  # fmt: skip
  put = lambda t: jax.device_put(t, NamedSharding(mesh, P(None, "seq")))
  got = jax.jit(lambda x, u: jax.jvp(f, x, u))(put(x), put(u))
  _assert_close(got, want)
