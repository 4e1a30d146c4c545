"""`pallas_fa3.varlen.shard`: a packed varlen batch split by whole sequences
over 8 data-parallel devices (issue 68), each device running
`flash_attention_varlen` on its own sequences under `jax.shard_map`. The
outputs and gradients (through `shard`'s gather) equal the single-device
call's, every sequence lands whole on one device, the pieces are balanced,
and the per-device program communicates nothing.

Run through `tests/test_scale_out.py`, or directly with
`XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import mesh_helpers as mh
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_fa3
from pallas_fa3 import varlen

mh.require_devices()

HQ, HK, D = 4, 2, 32


def _packed(seed: int, n: int = 16):
  rng = np.random.default_rng(seed)
  lq = rng.integers(0, 40, n)
  lk = lq + rng.integers(0, 20, n)  # chunks of queries over longer contexts
  lq[3] = 0  # an empty sequence
  cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
  cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
  tq, tk = int(cu_q[-1]) + 3, int(cu_k[-1]) + 2  # padded buffers
  q = jnp.asarray(rng.standard_normal((tq, HQ, D)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((tk, HK, D)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((tk, HK, D)), jnp.float32)
  dout = jnp.asarray(rng.standard_normal((tq, HQ, D)), jnp.float32)
  return cu_q, cu_k, q, k, v, dout


@pytest.mark.parametrize(
  "causal", [True, pytest.param(False, marks=pytest.mark.slow)]
)
def test_shard_by_sequences_matches_one_device(causal):
  cu_q, cu_k, q, k, v, dout = _packed(0)
  mesh = mh.mesh((8,), ("data",))
  attend = functools.partial(
    pallas_fa3.flash_attention_varlen, causal=causal, implementation="blockwise"
  )
  local = jax.shard_map(
    lambda q, k, v, cq, ck: attend(q[0], k[0], v[0], cq[0], ck[0])[None],
    mesh=mesh,
    in_specs=P("data"),
    out_specs=P("data"),
    check_vma=False,  # (flex's evaluator mixes varying and scalar indices)
  )

  def sharded(q, k, v):
    s = varlen.shard(q, k, v, cu_q, cu_k, 8)
    place = lambda x: jax.lax.with_sharding_constraint(
      x, NamedSharding(mesh, P("data"))
    )
    pieces = [place(x) for x in s[:5]]
    return varlen.unshard(local(*pieces), s)

  def single(q, k, v):
    return attend(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k))

  results = []
  for f in (sharded, single):
    out, pull = jax.jit(lambda *a, f=f: jax.vjp(f, *a))(q, k, v)
    results.append((out,) + pull(dout))
  for name, got, want in zip(mh.NAMES[:1] + mh.NAMES[2:], *results):
    np.testing.assert_allclose(got, want, atol=2e-5, err_msg=name)

  # Whole sequences per piece, balanced; nothing communicated per piece.
  s = varlen.shard(q, k, v, cu_q, cu_k, 8)
  lq, lk = np.diff(cu_q), np.diff(cu_k)
  pieces_q = np.diff(np.asarray(s.cu_seqlens_q), axis=1)
  pieces_k = np.diff(np.asarray(s.cu_seqlens_k), axis=1)
  assert sorted(pieces_q[pieces_q + pieces_k > 0].tolist()) == sorted(
    lq[lq + lk > 0].tolist()
  )
  work = (pieces_q * pieces_k).sum(1)
  assert work.max() <= 2 * max(work.mean(), (lq * lk).max())
  hlo = (
    jax.jit(local)
    .lower(*(jax.device_put(x, NamedSharding(mesh, P("data"))) for x in s[:5]))
    .compile()
    .as_text()
  )
  assert not any(mh.collectives(hlo).values()), mh.collectives(hlo)


def test_shard_refuses_what_it_cannot_plan():
  cu_q, cu_k, q, k, v, _ = _packed(1)
  with pytest.raises(ValueError, match="fits no shard within capacity_q=8"):
    varlen.shard(q, k, v, cu_q, cu_k, 8, capacity_q=8)
  with pytest.raises(TypeError, match="cu_seqlens_q must be concrete"):
    jax.jit(lambda c: varlen.shard(q, k, v, c, cu_k, 8))(cu_q)
  with pytest.raises(ValueError, match="shards must be an int >= 1"):
    varlen.shard(q, k, v, cu_q, cu_k, 0)
