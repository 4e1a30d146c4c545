"""The windowed ring on 8 simulated CPU devices (issue 33): K/V travel only
as far as the window reaches, hidden blocks do no work, segment ids and
windows together, both layouts, batch axes, and the refusals.

Run through `tests/test_scale_out.py` (8 simulated CPU devices in a
subprocess), or directly with
`XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import mesh_helpers as mh
import numpy as np
import pytest
import ring_helpers as rh
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_fa3
from pallas_fa3 import modifiers
from pallas_fa3.parallel.ring import plan as ring_plan
from pallas_fa3.spec import make_spec
from pallas_fa3.testing import (
  Shape,
  assert_within_tolerance,
  golden_and_naive,
  random_inputs,
)

mh.require_devices()

_SHAPE = Shape(1, 128, 128, 4, 2, 16)  # 16 tokens a shard on 8 devices
_SHARD = 16
_O = rh.Options


def _mesh(ring=8, explicit=False):
  return mh.mesh((ring,), ("seq",), explicit=explicit)


def _ring(mesh, options, **kwargs):
  return rh.seq_parallel_run(pallas_fa3.ring_attention, mesh, options, **kwargs)


@pytest.mark.parametrize(
  "options,layout",
  [
    pytest.param(_O(True, (20, None), documents=5), "natural", id="causal"),
    pytest.param(_O(False, (13, 6), documents=4), "zigzag", id="both-zigzag"),
  ],
)
def test_window_with_segment_ids(options, layout, key, rng):
  """Windows and packed documents together, in either layout (ids and
  tokens in the caller's order)."""
  mesh = _mesh()
  plain = rh.inputs(key, _SHAPE, options, rng)
  order = None
  if layout == "zigzag":
    order = pallas_fa3.zigzag_order(_SHAPE.seq_q, 8)

  def perm(x, axis=1):
    return x if order is None else jnp.take(jnp.asarray(x), order, axis=axis)

  q, k, v, sinks, ids, dout, dlse = plain
  args = [perm(x) for x in (q, k, v)] + [sinks, perm(ids), perm(dout)]
  args.append(perm(dlse, 2))
  got = _ring(mesh, options, layout=layout)(*args)
  rh.assert_matches_golden(
    got, plain, options, perm if order is not None else None
  )


def _permutes(mesh, window, causal=True):
  fwd = jax.jit(
    functools.partial(
      pallas_fa3.ring_attention,
      mesh=mesh,
      seq_axis="seq",
      causal=causal,
      window_size=window,
    )
  )
  q, k, v, _ = random_inputs(jax.random.key(0), _SHAPE, jnp.bfloat16)
  return mh.collectives(fwd.lower(q, k, v).compile().as_text())[mh.PERMUTE]


def _plan(window, causal, layout="natural"):
  """The ring plan of `_SHAPE` on 8 devices with this window."""
  spec = make_spec(*random_inputs(jax.random.key(0), _SHAPE, "bfloat16")[:3])
  canonical = modifiers.check_window_size(
    window, seq_q=spec.seq_q, seq_kv=spec.seq_kv, causal=causal
  )
  spec = dataclasses.replace(spec, causal=causal, window_size=canonical)
  return ring_plan.make_plan(spec, _mesh(), "seq", (), (), layout, None, None)


def test_a_window_within_one_shard_sends_kv_one_step():
  """Window 8 < 16 tokens a shard: K/V go to the next device only (one
  transfer each, no zig-zag permutation), against the causal ring's
  whole round plus its permutation."""
  mesh = _mesh()
  plan = lambda window, causal=True: _plan(window, causal)
  assert plan((8, None)).blocks.hops == (1, 0)
  assert plan((20, None)).blocks.hops == (2, 0)  # 20 reaches 2 shards back
  assert plan((9, 23), False).blocks.hops == (1, 2)
  assert plan((None, 30), False).blocks.hops == (7, 0)  # all of the left
  windowed, full = _permutes(mesh, (8, None)), _permutes(mesh, None)
  assert 0 < windowed <= 2 < full, (windowed, full)


def test_hidden_shards_are_never_read(key, rng):
  """K and V are NaN on device 0's shard; with window 20 (< 2 shards) no
  query on devices 3.. sees it: their out, lse and dq, and dK/dV of the
  keys only they see, are bit-identical to a run with finite K/V."""
  options = _O(True, (20, None))
  plain = rh.inputs(key, _SHAPE, options, rng, jnp.float32)
  q, k, v, sinks, ids, dout, dlse = plain
  k_bad, v_bad = (x.at[:, :_SHARD].set(jnp.nan) for x in (k, v))
  run = _ring(_mesh(), options)
  got = run(q, k_bad, v_bad, sinks, ids, dout, dlse)
  want = run(q, k, v, sinks, ids, dout, dlse)
  far = slice(3 * _SHARD, None)
  for name, x, y in zip(rh.NAMES, got, want):
    x, y = np.asarray(x), np.asarray(y)
    rows = (
      (slice(None), slice(None), far) if name == "lse" else (slice(None), far)
    )
    np.testing.assert_array_equal(x[rows], y[rows], err_msg=name)
  assert np.isnan(np.asarray(got[0])[:, _SHARD : 2 * _SHARD]).any()


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_window_with_batch_axes(explicit, key, rng):
  """A 2 x 4 mesh, batch split over "other": the window's ring on "seq"."""
  mesh = mh.mesh((2, 4), ("other", "seq"), explicit=explicit)
  options = _O(True, (40, None), softcap=5.0)
  shape = Shape(2, 128, 128, 4, 2, 16)
  plain = rh.inputs(key, shape, options, rng)
  q, k, v, sinks, ids, dout, dlse = plain
  seq = NamedSharding(mesh, P("other", "seq"))
  args = [jax.device_put(x, seq) for x in (q, k, v)] + [sinks, ids]
  args += [jax.device_put(dout, seq)]
  args += [jax.device_put(dlse, NamedSharding(mesh, P("other", None, "seq")))]
  got = _ring(mesh, options, batch_axes="other")(*args)
  rh.assert_matches_golden(got, plain, options)


def test_plans_choose_their_order():
  """Left-bounded windows run in natural order (no permutation of natural
  inputs), causal rings and right-only windows in zig-zag order."""
  plan = _plan
  assert plan((20, None), True).order == "natural"
  assert not plan((20, None), True).reorder
  assert plan((20, None), True, "zigzag").reorder
  assert plan(None, True).order == "zigzag"
  assert plan((None, 30), False).order == "zigzag"
  assert plan(None, False, "zigzag").order == "zigzag"  # no mask: as given
  text = plan((20, None), True).describe()
  assert "2 step(s) forward and 0 backward of 7" in text, text
  assert "whole ring" in plan(None, True).describe()


# ---------------------------------------------------------------------------
# Lengths and refusals.


def _call(shape=_SHAPE, key=None, **options):
  key = jax.random.key(0) if key is None else key
  q, k, v, _ = random_inputs(key, shape, jnp.bfloat16)
  options = {"mesh": _mesh(), "seq_axis": "seq", **options}
  return pallas_fa3.ring_attention(q, k, v, **options)


def test_natural_window_needs_whole_shards_only(key):
  """Causal with a left window in natural order: no zig-zag chunks, so 72
  tokens (9 a shard) are fine; the zig-zag layout needs 16s."""
  shape = Shape(1, 72, 72, 2, 2, 16)
  q, k, v, dout = random_inputs(key, shape, jnp.bfloat16)
  out = _call(shape, key, causal=True, window_size=(11, None))
  golden, naive = golden_and_naive(
    q, k, v, dout, causal=True, window_size=(11, None)
  )
  assert_within_tolerance("out", out, naive[0], golden[0])
  with pytest.raises(
    ValueError, match=r"q has sequence length 72, not a multiple of 16"
  ):
    _call(shape, causal=True, window_size=(11, None), layout="zigzag")


def test_reference_backend_is_refused_with_a_window():
  with pytest.raises(
    NotImplementedError, match=r"implementation='reference' cannot run ring"
  ):
    _call(causal=True, window_size=(20, None), implementation="reference")


def test_bad_window_names_the_argument():
  with pytest.raises(TypeError, match=r"window_size must be None or a pair"):
    _call(window_size=20)


def test_bad_sinks_name_the_argument():
  with pytest.raises(
    ValueError, match=r"sinks must have shape \[heads_q\] = \(4,\)"
  ):
    _call(sinks=jnp.zeros((3,)))
