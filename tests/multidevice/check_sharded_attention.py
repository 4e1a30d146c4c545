"""flash_attention under jit with q, k, v sharded over batch and/or heads (8 devices).

Run through `tests/test_scale_out.py` (which starts JAX with 8 simulated CPU
devices in a subprocess), or directly with
`XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu`.

Each case: outputs and gradients (with an lse cotangent) within the
tolerance rule of the float64 golden and of the single-device call; the
compiled program has no collective at all (every device computes its own
shard; nothing is gathered or resharded); outputs and gradients keep the
inputs' sharding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import mesh_helpers as mh
import numpy as np
import pytest
from conftest import forward_and_grads
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_fa3
from pallas_fa3.testing import Shape, golden_and_naive, random_inputs

mh.require_devices()

_AXES = ("data", "model")

# (id, mesh shape over ("data", "model"), q/k/v spec, shape, causal).
CASES = [
  (
    "1x8_heads",
    (1, 8),
    P(None, None, "model"),
    Shape(2, 48, 64, 16, 8, 32),
    True,
  ),
  (
    "2x4_batch_heads",
    (2, 4),
    P("data", None, "model"),
    Shape(4, 64, 40, 8, 4, 32),
    False,
  ),
  # Batch over a tuple of mesh axes (8 x 1 ways); MQA; ragged lengths.
  (
    "8x1_batch_mqa",
    (8, 1),
    P(("data", "model")),
    Shape(8, 33, 47, 4, 1, 32),
    True,
  ),
]


def _lse_spec(spec: P) -> P:
  entries = tuple(spec) + (None,) * (4 - len(tuple(spec)))
  return P(entries[0], entries[2], None)


def _sharded_run(q, k, v, dout, dlse, *, causal):
  (out, lse), pullback = jax.vjp(
    lambda q, k, v: pallas_fa3.flash_attention(
      q, k, v, causal=causal, return_lse=True
    ),
    q,
    k,
    v,
  )
  return (out, lse) + tuple(pullback((dout, dlse)))


def _check(mesh, spec, shape, causal, key):
  q, k, v, dout = random_inputs(key, shape, jnp.bfloat16)
  dlse = jax.random.normal(
    jax.random.fold_in(key, 1), (shape.batch, shape.heads_q, shape.seq_q)
  )
  seq, lse = NamedSharding(mesh, spec), NamedSharding(mesh, _lse_spec(spec))
  args = [jax.device_put(x, seq) for x in (q, k, v, dout)]
  args.append(jax.device_put(dlse, lse))
  fn = jax.jit(lambda *a: _sharded_run(*a, causal=causal))
  compiled = fn.lower(*args).compile()
  found = {
    kind: n for kind, n in mh.collectives(compiled.as_text()).items() if n
  }
  assert not found, f"collectives in the compiled program: {found}"
  got = compiled(*args)

  for name, x in zip(mh.NAMES, got):
    want = lse if name == "lse" else seq
    assert x.sharding.is_equivalent_to(want, x.ndim), (
      f"{name} comes back as {x.sharding}, not {want}"
    )
  single = forward_and_grads(None, q, k, v, dout, causal=causal, dlse=dlse)
  golden, naive = golden_and_naive(q, k, v, dout, causal=causal, dlse=dlse)
  for name, x, s, n, g in zip(mh.NAMES, got, single, naive, golden):
    mh.assert_same_within_rule(name, x, s, n, g)


@pytest.mark.parametrize(
  "case_id,mesh_shape,spec,shape,causal", CASES, ids=[c[0] for c in CASES]
)
def test_sharded_matches_single_device(
  case_id, mesh_shape, spec, shape, causal, key
):
  del case_id
  _check(mh.mesh(mesh_shape, _AXES), spec, shape, causal, key)


def test_explicit_mesh_axes(key):
  """jax.make_mesh's default axis type: the layout is in the types."""
  _check(
    mh.mesh((2, 4), _AXES, explicit=True),
    P("data", None, "model"),
    Shape(4, 64, 40, 8, 4, 32),
    True,
    key,
  )


def test_kv_replicated_while_q_is_head_sharded(key):
  """k/v replicated, q split over heads: k/v are sliced, never gathered.

  (Within the tolerance rule, not bit for bit: XLA's CPU dots on the
  per-device shapes may round differently from the whole call's.)"""
  mesh = mh.mesh((1, 8), _AXES)
  shape = Shape(1, 32, 48, 16, 8, 32)
  q, k, v, dout = random_inputs(key, shape, jnp.bfloat16)
  q_sh = jax.device_put(q, NamedSharding(mesh, P(None, None, "model")))
  fn = jax.jit(lambda q, k, v: pallas_fa3.flash_attention(q, k, v))
  compiled = fn.lower(q_sh, k, v).compile()
  assert mh.collectives(compiled.as_text())[mh.ALL_GATHER] == 0
  out = compiled(q_sh, k, v)
  single = pallas_fa3.flash_attention(q, k, v)
  golden, naive = golden_and_naive(q, k, v, dout)
  mh.assert_same_within_rule("out", out, single, naive[0], golden[0])


def test_inside_a_user_shard_map(key):
  """flash_attention inside shard_map (default check_vma=True) runs locally."""
  mesh = mh.mesh((2, 4), _AXES)
  spec = P("data", None, "model")
  shape = Shape(4, 40, 40, 8, 4, 32)
  q, k, v, _ = random_inputs(key, shape, jnp.bfloat16)
  local = jax.shard_map(
    lambda q, k, v: pallas_fa3.flash_attention(q, k, v, causal=True),
    mesh=mesh,
    in_specs=(spec,) * 3,
    out_specs=spec,
  )
  out = jax.jit(local)(q, k, v)
  single = pallas_fa3.flash_attention(q, k, v, causal=True)
  assert jnp.array_equal(out, single)


# ---------------------------------------------------------------------------
# Shardings that cannot run shard-locally: one test per error path (a
# sequence split runs the ring: check_sequence_sharded.py). Known at
# trace time (concrete arrays: eager call; Explicit axes) they raise
# ValueError; under jit with automatic axes the partitioner raises the same
# message at compile time, as a JaxRuntimeError.


def _call_with(mode, specs, shape, key):
  mesh = mh.mesh((2, 4), _AXES, explicit=mode == "explicit_jit")
  q, k, v, _ = random_inputs(key, shape, jnp.bfloat16)
  args = [
    jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip((q, k, v), specs)
  ]
  if mode == "eager":
    return pallas_fa3.flash_attention(*args)
  return jax.jit(pallas_fa3.flash_attention)(*args)


_MODES = [
  ("eager", ValueError),
  ("jit", jax.errors.JaxRuntimeError),
  ("explicit_jit", ValueError),
]


@pytest.mark.parametrize("mode,error", _MODES, ids=[m for m, _ in _MODES])
def test_head_dim_sharding_is_refused(mode, error, key):
  with pytest.raises(error, match=r"k is sharded along its head_dim axis"):
    _call_with(
      mode,
      (P(), P(None, None, None, "model"), P()),
      Shape(2, 32, 32, 4, 4, 16),
      key,
    )


@pytest.mark.parametrize("mode,error", _MODES, ids=[m for m, _ in _MODES])
def test_head_sharding_that_splits_gqa_groups_is_refused(mode, error, key):
  q_spec = P(None, None, "model")  # 8 query heads 4 ways; k, v: 2 heads
  with pytest.raises(error, match=r"heads_kv=2 heads, not a multiple of 4"):
    _call_with(mode, (q_spec, P(), P()), Shape(2, 32, 32, 8, 2, 16), key)


@pytest.mark.parametrize("explicit", [False, True])
def test_window_softcap_sinks_shard_over_batch_and_heads(explicit, key):
  """The sinks operand shards with the heads (and is broadcast over the
  batch); q, k, v are never gathered; out, lse and every gradient
  (d/dsinks too) match the single-device call."""
  mesh = mh.mesh((2, 4), _AXES, explicit=explicit)
  shape = Shape(4, 40, 56, 8, 4, 32)
  q, k, v, dout = random_inputs(key, shape, jnp.bfloat16)
  sinks = jax.random.normal(jax.random.fold_in(key, 3), (8,))
  opts = dict(causal=True, window_size=(9, None), softcap=4.0)

  def run(q, k, v, s, dout):
    f = lambda q, k, v, s: pallas_fa3.flash_attention(
      q, k, v, sinks=s, return_lse=True, **opts
    )
    (out, lse), pullback = jax.vjp(f, q, k, v, s)
    return (out, lse) + tuple(pullback((dout, jnp.zeros_like(lse))))

  spec = NamedSharding(mesh, P("data", None, "model"))
  args = [jax.device_put(x, spec) for x in (q, k, v)]
  args += [jax.device_put(sinks, NamedSharding(mesh, P("model")))]
  args += [jax.device_put(dout, spec)]
  compiled = jax.jit(run).lower(*args).compile()
  gathers = [
    line
    for line in compiled.as_text().splitlines()
    if " all-gather(" in line or " all-gather-start(" in line
  ]
  # At most d/dsinks' [batch, heads] partial sums: no operand is gathered.
  assert all("[4,8]" in line or "[4,2]" in line for line in gathers), gathers
  got = compiled(*args)
  single = jax.jit(run)(q, k, v, sinks, dout)
  for name, x, s in zip(mh.NAMES + ("dsinks",), got, single):
    assert jnp.allclose(
      x.astype(jnp.float32), s.astype(jnp.float32), atol=1e-2, rtol=1e-2
    ), name


# ---------------------------------------------------------------------------
# jax.grad inside a user's shard_map with operands of different types:
# replicated (not varying) sinks or K/V beside a sharded q. Each cotangent
# must have its primal's type, and the gradient of a replicated operand is
# the sum over the devices (fa4-jax's and jax-linear-attention's suites).

_B, _H, _S = P("x"), P(None, None, "x"), P(None, "x")
_SHARD_MAP_CASES = {
  # (q, k, v, sinks) specs; sinks "closed" = closed over, not an operand.
  "sinks-replicated": ((_B, _B, _B, P()), Shape(8, 24, 24, 4, 2, 16), {}),
  "sinks-closed-over": ((_B, _B, _B, "closed"), Shape(8, 24, 24, 4, 2, 16), {}),
  "kv-replicated-q-seq": ((_S, P(), P(), None), Shape(2, 64, 40, 4, 2, 16), {}),
  "mqa-kv-replicated-q-heads": (
    (_H, P(), P(), None),
    Shape(2, 24, 40, 8, 1, 16),
    dict(causal=True),
  ),
}


# The default run has every case on 8 devices and one on a size-1 mesh
# axis; the rest, the same code on 2 devices (or 1), are slow (siblings:
# the same case on 8, and [mqa-kv-replicated-q-heads-1]).
_SHARD_MAP_DEFAULT = {
  8: tuple(_SHARD_MAP_CASES),
  1: ("mqa-kv-replicated-q-heads",),
}


@pytest.mark.parametrize(
  "case,devices",
  [
    pytest.param(
      case,
      devices,
      id=f"{case}-{devices}",
      marks=()
      if case in _SHARD_MAP_DEFAULT.get(devices, ())
      else pytest.mark.slow,
    )
    for case in _SHARD_MAP_CASES
    for devices in (1, 2, 8)
  ],
)
def test_grad_inside_shard_map_with_replicated_operands(case, devices, key):
  (q_spec, k_spec, v_spec, s_spec), shape, opts = _SHARD_MAP_CASES[case]
  mesh = mh.mesh((devices,), ("x",))
  q, k, v, _ = random_inputs(key, shape, jnp.float32)
  sinks = None
  if s_spec is not None:
    sinks = jax.random.normal(jax.random.fold_in(key, 2), (shape.heads_q,))

  def local_loss(q, k, v, *s):
    s = s[0] if s else sinks
    out = pallas_fa3.flash_attention(q, k, v, sinks=s, **opts)
    return jax.lax.psum(jnp.sum(out * jnp.cos(out)), "x")

  operands = (q, k, v) + ((sinks,) if s_spec not in (None, "closed") else ())
  specs = (q_spec, k_spec, v_spec) + ((s_spec,) if len(operands) == 4 else ())
  sharded = jax.shard_map(local_loss, mesh=mesh, in_specs=specs, out_specs=P())
  argnums = tuple(range(len(operands)))
  got = jax.jit(jax.value_and_grad(sharded, argnums=argnums))(*operands)

  def whole_loss(q, k, v, *s):
    s = s[0] if s else sinks
    out = pallas_fa3.flash_attention(q, k, v, sinks=s, **opts)
    return jnp.sum(out * jnp.cos(out))

  want = jax.jit(jax.value_and_grad(whole_loss, argnums=argnums))(*operands)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got[1], want[1]):
    assert g.shape == w.shape, name
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("explicit", [False, True])
def test_mqa_with_head_sharded_queries(explicit, key):
  """MQA's one kv head with q split over heads: every device holds the kv
  head (K/V replicated over the head axis), dK/dV are summed over it;
  forward and gradients as the single-device call."""
  mesh = mh.mesh((2, 4), _AXES, explicit=explicit)
  shape = Shape(2, 40, 56, 8, 1, 32)
  q, k, v, dout = random_inputs(key, shape, jnp.bfloat16)
  dlse = jax.random.normal(
    jax.random.fold_in(key, 1), (shape.batch, shape.heads_q, shape.seq_q)
  )
  heads = NamedSharding(mesh, P("data", None, "model"))
  kv = NamedSharding(mesh, P("data"))
  args = [jax.device_put(q, heads)]
  args += [jax.device_put(x, kv) for x in (k, v)]
  args += [
    jax.device_put(dout, heads),
    jax.device_put(dlse, NamedSharding(mesh, P("data", "model"))),
  ]
  compiled = (
    jax.jit(lambda *a: _sharded_run(*a, causal=True)).lower(*args).compile()
  )
  assert mh.collectives(compiled.as_text())[mh.ALL_GATHER] == 0
  got = compiled(*args)
  single = forward_and_grads(None, q, k, v, dout, causal=True, dlse=dlse)
  golden, naive = golden_and_naive(q, k, v, dout, causal=True, dlse=dlse)
  for name, x, s, n, g in zip(mh.NAMES, got, single, naive, golden):
    mh.assert_same_within_rule(name, x, s, n, g)
