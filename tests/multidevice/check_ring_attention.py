"""ring_attention on rings of 2, 4 and 8 simulated CPU devices.

Run through `tests/test_scale_out.py` (which starts JAX with 8 simulated CPU
devices in a subprocess), or directly with
`XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu`.

Each case: out, lse, dq, dk, dv (with an lse cotangent) within the tolerance
rule of the float64 golden and of single-device flash_attention; the
compiled program moves data only by collective-permute (no all-gather,
all-to-all or reduce-scatter of the sequence). Segment ids (packed
sequences) are checked in `check_ring_segments.py`.
"""

from __future__ import annotations

import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import mesh_helpers as mh
import numpy as np
import pytest
from conftest import forward_and_grads
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_fa3
from pallas_fa3.parallel.ring import layout as ring_layout
from pallas_fa3.testing import (
  Shape,
  assert_within_tolerance,
  golden_and_naive,
  random_inputs,
)

mh.require_devices()

_CAUSAL_SHAPE = Shape(2, 128, 128, 4, 2, 32)  # 2n chunks of 8..32 tokens
_CROSS_SHAPE = Shape(2, 96, 160, 4, 2, 32)  # non-causal, seq_q != seq_kv


def _ring_run(mesh, seq_axis, causal, **options):
  """Jitted (out, lse, dq, dk, dv) of ring_attention for cotangents (dout, dlse)."""

  def run(q, k, v, dout, dlse):
    f = lambda q, k, v: pallas_fa3.ring_attention(
      q,
      k,
      v,
      mesh=mesh,
      seq_axis=seq_axis,
      causal=causal,
      return_lse=True,
      **options,
    )
    (out, lse), pullback = jax.vjp(f, q, k, v)
    return (out, lse) + tuple(pullback((dout, dlse)))

  return jax.jit(run)


def _inputs(key, shape, mesh, seq_spec, lse_spec, dtype=jnp.bfloat16):
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


def _check(
  mesh,
  shape,
  causal,
  key,
  *,
  seq_spec=P(None, "seq"),
  lse_spec=P(None, None, "seq"),
  dtype=jnp.bfloat16,
  **options,
):
  plain, sharded = _inputs(key, shape, mesh, seq_spec, lse_spec, dtype)
  compiled = _ring_run(mesh, "seq", causal, **options).lower(*sharded).compile()
  counts = mh.collectives(compiled.as_text())
  assert counts[mh.PERMUTE] > 0, counts
  for kind in (mh.ALL_GATHER, mh.ALL_TO_ALL, mh.REDUCE_SCATTER, mh.ALL_REDUCE):
    assert counts[kind] == 0, f"{kind} in the compiled program: {counts}"
  got = compiled(*sharded)
  assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, seq_spec), 4)
  assert got[1].sharding.is_equivalent_to(NamedSharding(mesh, lse_spec), 3)

  q, k, v, dout, dlse = plain
  single = forward_and_grads(None, q, k, v, dout, causal=causal, dlse=dlse)
  golden, naive = golden_and_naive(q, k, v, dout, causal=causal, dlse=dlse)
  for name, x, s, n, g in zip(mh.NAMES, got, single, naive, golden):
    assert x.dtype == s.dtype and x.shape == s.shape, name
    mh.assert_same_within_rule(name, x, s, n, g)
  return compiled, sharded, got


@pytest.mark.parametrize(
  "ring,causal",
  [
    pytest.param(2, False, id="2-full"),
    pytest.param(2, True, id="2-causal"),
    pytest.param(4, False, id="4-full"),
    # Slow: [8-causal] runs the same fori_loop ring (and the determinism
    # check); test_zigzag_layout_skips_the_permutation ring 4, causal.
    pytest.param(4, True, id="4-causal", marks=pytest.mark.slow),
    pytest.param(8, False, id="8-full"),
    pytest.param(8, True, id="8-causal"),
  ],
)
def test_ring_matches_single_device(ring, causal, key):
  shape = _CAUSAL_SHAPE if causal else _CROSS_SHAPE
  compiled, sharded, first = _check(
    mh.mesh((ring,), ("seq",)), shape, causal, key
  )
  if ring in (4, 8):  # determinism: a second run is bit-identical
    for a, b in zip(first, compiled(*sharded)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
  "axes",
  [
    "batch",
    # Slow: check_sequence_sharded's [heads-seq-causal-explicit] runs the
    # ring with heads split over another axis (causal, gradients);
    # check_ring_window::test_window_with_batch_axes[auto] ring_attention's
    # specs with a second mesh axis.
    pytest.param("heads", marks=pytest.mark.slow),
  ],
)
def test_ring_with_batch_or_head_axes(axes, key):
  """A 2 x 4 mesh: the ring on "seq", batch or heads split over the other axis."""
  mesh = mh.mesh((2, 4), ("other", "seq"))
  if axes == "batch":
    specs = dict(
      seq_spec=P("other", "seq"),
      lse_spec=P("other", None, "seq"),
      batch_axes="other",
    )
  else:
    specs = dict(
      seq_spec=P(None, "seq", "other"),
      lse_spec=P(None, "other", "seq"),
      head_axes="other",
    )
  _check(mesh, _CAUSAL_SHAPE, True, key, **specs)


def test_ring_float32_mqa(key):
  _check(
    mh.mesh((4,), ("seq",)),
    Shape(1, 64, 64, 4, 1, 16),
    True,
    key,
    dtype=jnp.float32,
  )


def test_zigzag_layout_skips_the_permutation(key):
  """Inputs already in zig-zag order: same results (permuted), fewer permutes."""
  ring, shape = 4, _CAUSAL_SHAPE
  mesh = mh.mesh((ring,), ("seq",))
  order = pallas_fa3.zigzag_order(shape.seq_q, ring)
  plain, sharded = _inputs(
    key, shape, mesh, P(None, "seq"), P(None, None, "seq")
  )
  perm = lambda x, axis=1: jnp.take(x, order, axis=axis)
  zz = [perm(x) for x in sharded[:4]] + [perm(sharded[4], 2)]
  run = _ring_run(mesh, "seq", True, layout="zigzag")
  got = run(*zz)
  q, k, v, dout, dlse = plain
  golden, naive = golden_and_naive(q, k, v, dout, causal=True, dlse=dlse)
  for name, x, n, g in zip(mh.NAMES, got, naive, golden):
    axis = 2 if name == "lse" else 1
    assert_within_tolerance(name, x, perm(n, axis), perm(g, axis))

  def permutes(layout):
    fwd = jax.jit(
      functools.partial(
        pallas_fa3.ring_attention,
        mesh=mesh,
        seq_axis="seq",
        causal=True,
        layout=layout,
      )
    )
    return mh.collectives(fwd.lower(*sharded[:3]).compile().as_text())[
      mh.PERMUTE
    ]

  assert permutes("zigzag") < permutes("natural")


def test_zigzag_permutation_round_trip():
  """to_zigzag / from_zigzag on the shards agree with zigzag_order."""
  for ring in (2, 4, 8):
    mesh = mh.mesh((ring,), ("seq",))
    x = jnp.arange(2 * 4 * ring * 3, dtype=jnp.float32).reshape(2, 4 * ring, 3)
    shard = lambda fn: jax.jit(
      jax.shard_map(
        lambda x: fn(x, 1, "seq", ring),
        mesh=mesh,
        in_specs=P(None, "seq"),
        out_specs=P(None, "seq"),
      )
    )
    zz = shard(ring_layout.to_zigzag)(x)
    order = ring_layout.zigzag_order(4 * ring, ring)
    np.testing.assert_array_equal(np.asarray(zz), np.asarray(x)[:, order])
    back = shard(ring_layout.from_zigzag)(zz)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))


def test_eager_call_with_unsharded_inputs(key):
  mesh = mh.mesh((8,), ("seq",))
  q, k, v, _ = random_inputs(key, _CAUSAL_SHAPE, jnp.bfloat16)
  out = pallas_fa3.ring_attention(
    q, k, v, mesh=mesh, seq_axis="seq", causal=True
  )
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "seq")), 4)
  golden, naive = golden_and_naive(q, k, v, q, causal=True)
  assert_within_tolerance("out", out, naive[0], golden[0])


def test_explicit_mesh_axes(key):
  """jax.make_mesh's default axis type: shard_map's in_specs are enforced."""
  mesh = mh.mesh((2, 4), ("data", "seq"), explicit=True)
  q, k, v, _ = random_inputs(key, _CAUSAL_SHAPE, jnp.bfloat16)
  args = [
    jax.device_put(x, NamedSharding(mesh, P("data", "seq"))) for x in (q, k, v)
  ]
  out = pallas_fa3.ring_attention(
    *args, mesh=mesh, seq_axis="seq", causal=True, batch_axes="data"
  )
  golden, naive = golden_and_naive(q, k, v, q, causal=True)
  assert_within_tolerance("out", out, naive[0], golden[0])


# ---------------------------------------------------------------------------
# Bad meshes, axes and shapes: one test per error path.

_MESH = None


def _ring_mesh():
  global _MESH
  if _MESH is None:
    _MESH = mh.mesh((2, 4), ("data", "seq"))
  return _MESH


def _call(shape=Shape(2, 64, 64, 4, 2, 16), causal=True, **options):
  q, k, v, _ = random_inputs(jax.random.key(0), shape, jnp.bfloat16)
  options = {"mesh": _ring_mesh(), "seq_axis": "seq", **options}
  return pallas_fa3.ring_attention(q, k, v, causal=causal, **options)


def test_mesh_must_be_a_mesh():
  with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh"):
    _call(mesh=jax.devices())


def test_seq_axis_must_be_a_mesh_axis():
  with pytest.raises(ValueError, match=r"seq_axis='sequence' is not an axis"):
    _call(seq_axis="sequence")


def test_q_length_must_divide_into_zigzag_chunks():
  with pytest.raises(
    ValueError,
    match=r"q has sequence length 36, not a"
    r" multiple of 8 \(zig-zag",
  ):
    _call(Shape(1, 36, 36, 2, 2, 16))


def test_k_length_must_divide_over_the_ring():
  with pytest.raises(
    ValueError,
    match=r"k has sequence length 42, not a"
    r" multiple of 4",
  ):
    _call(Shape(1, 64, 42, 2, 2, 16), causal=False)


def test_causal_needs_equal_lengths():
  with pytest.raises(
    ValueError,
    match=r"causal ring attention needs q and k"
    r" of the same sequence length",
  ):
    _call(Shape(1, 64, 128, 2, 2, 16))


def test_layout_must_be_known():
  with pytest.raises(ValueError, match=r"layout must be one of"):
    _call(layout="striped")


def test_batch_axes_must_be_mesh_axes():
  with pytest.raises(ValueError, match=r"batch_axes=\('dp',\): 'dp' is not"):
    _call(batch_axes="dp")


def test_batch_axes_type():
  with pytest.raises(TypeError, match=r"batch_axes must be None, a mesh axis"):
    _call(batch_axes=0)


def test_batch_axes_cannot_reuse_seq_axis():
  with pytest.raises(
    ValueError,
    match=r"batch_axes=\('seq',\): mesh axis"
    r" 'seq' is used twice",
  ):
    _call(batch_axes="seq")


def test_head_axes_must_keep_gqa_groups_whole():
  mesh = mh.mesh((4, 2), ("model", "seq"))
  with pytest.raises(
    ValueError,
    match=r"head_axes=\('model',\) splits"
    r" heads_kv",
  ):
    _call(Shape(1, 64, 64, 8, 2, 16), mesh=mesh, head_axes="model")


def test_reference_backend_is_refused():
  with pytest.raises(
    NotImplementedError, match=r"implementation='reference' cannot run ring"
  ):
    _call(implementation="reference")


def test_undeclared_batch_split_is_refused():
  """A concrete q split over batch on "data", but batch_axes not given."""
  q, k, v, _ = random_inputs(
    jax.random.key(0), Shape(2, 64, 64, 4, 2, 16), jnp.bfloat16
  )
  shard = NamedSharding(_ring_mesh(), P("data", "seq"))
  args = [jax.device_put(x, shard) for x in (q, k, v)]
  with pytest.raises(
    ValueError,
    match=r"q is sharded along batch over mesh"
    r" axes \('data',\), but batch_axes=None",
  ):
    pallas_fa3.ring_attention(*args, mesh=_ring_mesh(), seq_axis="seq")


def test_head_dim_split_is_refused():
  q, k, v, _ = random_inputs(
    jax.random.key(0), Shape(2, 64, 64, 4, 2, 16), jnp.bfloat16
  )
  k = jax.device_put(
    k, NamedSharding(_ring_mesh(), P(None, "seq", None, "data"))
  )
  with pytest.raises(ValueError, match=r"k is sharded along head_dim"):
    pallas_fa3.ring_attention(q, k, v, mesh=_ring_mesh(), seq_axis="seq")


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_long_sequence_on_8_devices(causal, key):
  """Longer chunks (128 tokens per zig-zag chunk), several tiles per step."""
  _check(mh.mesh((8,), ("seq",)), Shape(1, 2048, 2048, 4, 2, 64), causal, key)


def test_readme_scale_out_examples_run():
  """The README's 8-device examples (fenced as "```python multidevice")."""
  readme = pathlib.Path(__file__).resolve().parents[2] / "README.md"
  blocks = re.findall(
    r"```python multidevice\n(.*?)```", readme.read_text(), re.S
  )
  assert len(blocks) == 2, "README's scale-out examples moved?"
  for block in blocks:
    exec(compile(block, str(readme), "exec"), {})  # pylint: disable=exec-used
