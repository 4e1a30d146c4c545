"""ring_attention with segment ids (packed sequences) on 8 simulated CPU
devices.

Run through `tests/test_scale_out.py` (8 simulated CPU devices in a
subprocess), or directly with
`XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu`.

Each case: out, lse, dq, dk, dv (with an lse cotangent) within the tolerance
rule of the float64 golden and of single-device
`flash_attention(segment_ids=...)`, for random document lengths with and
without padding, causal (natural and zig-zag layouts) and not, with a batch
axis; the compiled program moves data only by collective-permute. Steps
whose ids cannot meet are skipped: NaN K/V on a shard no query meets never
reaches a result, and every backend call of the ring sits in a `lax.cond`.
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
from pallas_fa3.testing import Shape, golden_and_naive, random_inputs

mh.require_devices()

_CAUSAL_SHAPE = Shape(2, 128, 128, 4, 2, 32)  # 2n chunks of 8..32 tokens
_CROSS_SHAPE = Shape(2, 96, 160, 4, 2, 32)  # non-causal, seq_q != seq_kv


def ring_run(mesh, seq_axis, causal, **options):
  """Jitted (out, lse, dq, dk, dv) of ring_attention for cotangents (dout,
  dlse) and segment ids `ids` (a (q_ids, kv_ids) tuple)."""

  def run(q, k, v, dout, dlse, ids):
    f = lambda q, k, v: pallas_fa3.ring_attention(
      q,
      k,
      v,
      mesh=mesh,
      seq_axis=seq_axis,
      causal=causal,
      return_lse=True,
      segment_ids=ids,
      **options,
    )
    (out, lse), pullback = jax.vjp(f, q, k, v)
    return (out, lse) + tuple(pullback((dout, dlse)))

  return jax.jit(run)


def inputs(key, shape, mesh, seq_spec, lse_spec, dtype=jnp.bfloat16):
  """(q, k, v, dout, dlse) plain, and sharded along the sequence."""
  q, k, v, dout = random_inputs(key, shape, dtype)
  dlse = jax.random.normal(
    jax.random.fold_in(key, 1), (shape.batch, shape.heads_q, shape.seq_q)
  )
  plain = (q, k, v, dout, dlse)
  sharded = [
    jax.device_put(x, NamedSharding(mesh, seq_spec)) for x in plain[:4]
  ]
  sharded.append(jax.device_put(dlse, NamedSharding(mesh, lse_spec)))
  return plain, sharded


def _doc_ids(rng, batch, seq, docs):
  """Sorted ids of `docs` random-length documents in each batch row."""
  rows = []
  for _ in range(batch):
    cuts = np.sort(rng.choice(np.arange(1, seq), docs - 1, replace=False))
    rows.append(np.searchsorted(cuts, np.arange(seq), side="right"))
  return np.asarray(rows, np.int32)


def _packed(rng, shape, docs, pad_q=0, pad_kv=0):
  """(q_ids, kv_ids): the same documents for q and k when their lengths
  agree (else drawn apart); the last `pad_q` queries -1, `pad_kv` keys -2
  (padding: they match nothing)."""
  q_ids = _doc_ids(rng, shape.batch, shape.seq_q, docs)
  kv_ids = (
    q_ids.copy()
    if shape.seq_q == shape.seq_kv
    else _doc_ids(rng, shape.batch, shape.seq_kv, docs)
  )
  if pad_q:
    q_ids[:, -pad_q:] = -1
  if pad_kv:
    kv_ids[:, -pad_kv:] = -2
  return q_ids, kv_ids


@functools.partial(jax.jit, static_argnames="causal")
def _single_with_ids(q, k, v, dout, dlse, ids, causal):
  """(out, lse, dq, dk, dv) of single-device flash_attention with ids."""
  f = lambda q, k, v: pallas_fa3.flash_attention(
    q, k, v, causal=causal, return_lse=True, segment_ids=ids
  )
  (out, lse), pullback = jax.vjp(f, q, k, v)
  return (out, lse) + tuple(pullback((dout, dlse)))


# (id, mesh shape, Shape, causal, layout, documents, q padding, kv padding);
# a 2-D mesh splits the batch over its "other" axis.
SEGMENT_CASES = [
  ("full", (8,), Shape(1, 128, 128, 4, 2, 16), False, "natural", 6, 0, 0),
  ("full-cross-padded", (8,), _CROSS_SHAPE, False, "natural", 4, 11, 29),
  ("causal-padded", (8,), _CAUSAL_SHAPE, True, "natural", 5, 13, 13),
  ("causal-zigzag", (8,), _CAUSAL_SHAPE, True, "zigzag", 7, 9, 9),
  ("causal-batch-axes", (2, 4), _CAUSAL_SHAPE, True, "natural", 3, 20, 20),
]


@pytest.mark.parametrize(
  "mesh_shape,shape,causal,layout,docs,pad_q,pad_kv",
  [pytest.param(*c[1:], id=c[0]) for c in SEGMENT_CASES],
)
def test_ring_with_segment_ids(
  mesh_shape, shape, causal, layout, docs, pad_q, pad_kv, key, rng
):
  """out, lse and every gradient against the float64 golden and the
  single-device call with the same ids (the tolerance rule); padded
  queries give out 0 and lse -inf; ids in the caller's layout (zig-zag
  included) are permuted with the tokens; still permutes only."""
  if len(mesh_shape) == 2:
    mesh = mh.mesh(mesh_shape, ("other", "seq"))
    seq_spec, lse_spec = P("other", "seq"), P("other", None, "seq")
    options = dict(batch_axes="other")
  else:
    mesh = mh.mesh(mesh_shape, ("seq",))
    seq_spec, lse_spec, options = P(None, "seq"), P(None, None, "seq"), {}
  plain, sharded = inputs(key, shape, mesh, seq_spec, lse_spec)
  q, k, v, dout, dlse = plain
  ids = tuple(jnp.asarray(x) for x in _packed(rng, shape, docs, pad_q, pad_kv))
  single = _single_with_ids(q, k, v, dout, dlse, ids, causal)
  golden, naive = golden_and_naive(
    q, k, v, dout, causal=causal, dlse=dlse, segment_ids=ids
  )

  order = None
  if layout == "zigzag":
    order = pallas_fa3.zigzag_order(shape.seq_q, dict(mesh.shape)["seq"])

  def perm(x, axis=1):  # the caller's layout
    return x if order is None else np.take(np.asarray(x), order, axis=axis)

  args = [jnp.asarray(perm(x)) for x in sharded[:4]]
  args.append(jnp.asarray(perm(sharded[4], 2)))
  args = [
    jax.device_put(x, NamedSharding(mesh, spec))
    for x, spec in zip(args, (seq_spec,) * 4 + (lse_spec,))
  ]
  id_sharding = NamedSharding(mesh, P(seq_spec[0], "seq"))
  id_args = tuple(jax.device_put(perm(x), id_sharding) for x in ids)
  run = ring_run(mesh, "seq", causal, layout=layout, **options)
  compiled = run.lower(*args, id_args).compile()
  counts = mh.collectives(compiled.as_text())
  for kind in (mh.ALL_GATHER, mh.ALL_TO_ALL, mh.REDUCE_SCATTER, mh.ALL_REDUCE):
    assert counts[kind] == 0, f"{kind} in the compiled program: {counts}"
  got = compiled(*args, id_args)
  for name, x, s, n, g in zip(mh.NAMES, got, single, naive, golden):
    axis = 2 if name == "lse" else 1
    assert x.dtype == s.dtype and x.shape == s.shape, name
    mh.assert_same_within_rule(
      name, x, perm(s, axis), perm(n, axis), perm(g, axis)
    )
  empty = np.isneginf(perm(np.asarray(golden[1]), 2))  # [b, h, s]
  assert empty.any() == bool(pad_q)
  assert np.all(np.isneginf(np.asarray(got[1])[empty]))
  rows = np.swapaxes(empty, 1, 2)  # [b, s, h]
  assert not np.any(np.asarray(got[0], np.float32)[rows])
  for g in got[2:]:
    assert np.all(np.isfinite(np.asarray(g, np.float32)))


def _dead_positions(seq, ring, device, causal):
  """The natural positions of `device`'s shard in the ring's own layout."""
  if not causal:
    size = seq // ring
    return np.arange(device * size, (device + 1) * size)
  return pallas_fa3.zigzag_order(seq, ring).reshape(ring, -1)[device]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_segment_skip_never_touches_a_shard_no_query_meets(causal, key, rng):
  """K and V are NaN on one device's whole shard (its zig-zag chunks if
  causal), whose kv ids (99) no query has: every step that block takes part
  in is skipped, so the results are bit-identical to those with finite K/V
  there, and dK, dV are 0 there."""
  ring, shape = 8, Shape(1, 128, 128, 2, 2, 16)
  mesh = mh.mesh((ring,), ("seq",))
  q, k, v, dout = random_inputs(key, shape, jnp.float32)
  dlse = jax.random.normal(jax.random.fold_in(key, 1), (1, 2, shape.seq_q))
  q_ids, kv_ids = _packed(rng, shape, 5)
  dead = _dead_positions(shape.seq_q, ring, 3, causal)
  kv_ids[:, dead] = 99
  ids = (jnp.asarray(q_ids), jnp.asarray(kv_ids))
  k_bad, v_bad = (x.at[:, dead].set(jnp.nan) for x in (k, v))
  run = ring_run(mesh, "seq", causal)
  got = run(q, k_bad, v_bad, dout, dlse, ids)
  want = run(q, k, v, dout, dlse, ids)
  for name, x, y in zip(mh.NAMES, got, want):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
  for g in got[3:]:  # dk, dv
    assert not np.any(np.asarray(g)[:, dead])


def _conds_around_attention(jaxpr) -> int:
  """How many `cond`s of `jaxpr` (nested ones too, and inside the attention
  primitive `pallas_fa3.vjp` binds) hold a backend call (the blockwise
  backend's: a `dot_general`; the ring's own merges have none)."""

  def subs(eqn):
    for val in eqn.params.values():
      for x in val if isinstance(val, (tuple, list)) else (val,):
        if hasattr(x, "eqns"):
          yield x
        elif hasattr(getattr(x, "jaxpr", None), "eqns"):
          yield x.jaxpr
        elif "traced" in getattr(x, "params", {}):  # `vjp.Attention`'s body
          yield x.params["traced"].jaxpr.jaxpr

  def calls(jaxpr):
    return any(
      e.primitive.name == "dot_general" or any(map(calls, subs(e)))
      for e in jaxpr.eqns
    )

  count = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "cond" and any(map(calls, subs(eqn))):
      count += 1
    count += sum(map(_conds_around_attention, subs(eqn)))
  return count


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_segment_skip_is_a_cond_around_every_step(causal):
  """Every backend call of the ring (forward and backward) sits in a
  `lax.cond` with segment ids: the first step, the fori_loop body's step
  and the peeled last one (2 blocks each after the first if causal)."""
  mesh = mh.mesh((8,), ("seq",))
  q, k, v, dout = random_inputs(
    jax.random.key(0), Shape(1, 64, 64, 2, 2, 16), jnp.float32
  )
  ids = (jnp.zeros((1, 64), jnp.int32),) * 2

  def conds(segment_ids):
    f = lambda q, k, v: pallas_fa3.ring_attention(
      q, k, v, mesh=mesh, seq_axis="seq", causal=causal, segment_ids=segment_ids
    )
    grads = lambda q, k, v: jax.vjp(f, q, k, v)[1](dout)
    return _conds_around_attention(jax.make_jaxpr(grads)(q, k, v).jaxpr)

  per_pass = 5 if causal else 3
  assert conds(ids) == 2 * per_pass
  assert conds(None) == 0


def test_segment_ids_are_checked():
  q, k, v, _ = random_inputs(
    jax.random.key(0), Shape(2, 64, 64, 4, 2, 16), jnp.bfloat16
  )
  call = lambda ids: pallas_fa3.ring_attention(
    q, k, v, mesh=mh.mesh((8,), ("seq",)), seq_axis="seq", segment_ids=ids
  )
  q_ids = jnp.zeros((2, 64), jnp.int32)
  with pytest.raises(ValueError, match=r"segment_ids.kv must have shape"):
    call((q_ids, jnp.zeros((2, 32), jnp.int32)))
  with pytest.raises(TypeError, match=r"segment_ids must be None"):
    call("ids")
  # One array: self-attention ids, as flash_attention takes them.
  np.testing.assert_array_equal(
    np.asarray(call(q_ids)), np.asarray(call((q_ids, q_ids)))
  )
