"""ring_attention with window_size, softcap and sinks on rings of 4 and 8
simulated CPU devices (issue 33).

Run through `tests/test_scale_out.py` (8 simulated CPU devices in a
subprocess), or directly with
`XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu`.

Each case: out, lse, dq, dk, dv (and d/dsinks) with an lse cotangent within
the tolerance rule of the float64 golden; the compiled program moves q, k,
v only by collective-permute (the sinks' gradient adds one all-reduce of
`[batch, heads]` partial sums). Windows that reach past one shard, into
part of a shard, or both ways; a window on the right only; seq_q !=
seq_kv (slow). The windowed ring's own properties (how far K/V travel,
skipped blocks, layouts, segment ids) are in `check_ring_window.py`.
"""

from __future__ import annotations

import jax
import mesh_helpers as mh
import pytest
import ring_helpers as rh
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_fa3
from pallas_fa3.testing import Shape

mh.require_devices()

_SHAPE = Shape(1, 128, 128, 4, 2, 16)  # 16 tokens a shard on 8 devices
_O = rh.Options

# (id, ring size, shape, options); every modifier on 4 and 8 devices,
# causal and not.
CASES = [
  ("window-causal-8", 8, _SHAPE, _O(True, (20, None))),
  ("window-causal-4", 4, _SHAPE, _O(True, (37, None))),
  ("window-both-8", 8, _SHAPE, _O(False, (9, 23))),
  ("window-right-4", 4, _SHAPE, _O(False, (None, 30))),
  ("softcap-causal-4", 4, _SHAPE, _O(True, softcap=3.0)),
  ("softcap-full-8", 8, _SHAPE, _O(False, softcap=5.0)),
  ("sinks-full-4", 4, _SHAPE, _O(False, sinks=True)),
  ("sinks-causal-8", 8, _SHAPE, _O(True, sinks=True)),
  ("all-causal-8", 8, _SHAPE, _O(True, (24, None), 4.0, True)),
]
# Left to -m slow, beside the default cases that run the same code:
# window-both-8's streams both ways: check_sequence_sharded's
# [modifiers-seq8-explicit] (window (9, 14), 8 devices, not causal) and
# check_ring_window's [both-zigzag] ((13, 6)); a window over 2 hops:
# all-causal-8.
_SLOW = ("window-both-8",)


def ring_run(mesh, options: rh.Options, **kwargs):
  return rh.seq_parallel_run(pallas_fa3.ring_attention, mesh, options, **kwargs)


def check_case(ring, shape, options, key, rng):
  mesh = mh.mesh((ring,), ("seq",))
  plain = rh.inputs(key, shape, options, rng)
  q, k, v, sinks, ids, dout, dlse = plain
  seq = NamedSharding(mesh, P(None, "seq"))
  args = [jax.device_put(x, seq) for x in (q, k, v)]
  args += [sinks, ids, jax.device_put(dout, seq)]
  args += [jax.device_put(dlse, NamedSharding(mesh, P(None, None, "seq")))]
  compiled = ring_run(mesh, options).lower(*args).compile()
  allowed = (mh.PERMUTE,) + ((mh.ALL_REDUCE,) if options.sinks else ())
  counts = rh.assert_collectives(compiled.as_text(), allowed)
  assert counts[mh.PERMUTE] > 0, counts
  got = compiled(*args)
  assert got[0].sharding.is_equivalent_to(seq, 4)
  rh.assert_matches_golden(got, plain, options)


@pytest.mark.parametrize(
  "ring,shape,options",
  [
    pytest.param(
      *c[1:], id=c[0], marks=pytest.mark.slow if c[0] in _SLOW else ()
    )
    for c in CASES
  ],
)
def test_ring_with_modifiers(ring, shape, options, key, rng):
  check_case(ring, shape, options, key, rng)


@pytest.mark.slow
@pytest.mark.parametrize(
  "ring,options",
  [
    pytest.param(4, _O(False, (10, 40), 2.0, True), id="cross-4"),
    pytest.param(8, _O(False, (17, None)), id="cross-left-8"),
  ],
)
def test_window_with_unequal_lengths(ring, options, key, rng):
  """seq_q != seq_kv: chunks of different sizes, many partial blocks."""
  check_case(ring, Shape(1, 96, 160, 4, 2, 16), options, key, rng)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_longer_window_sweep(causal, key, rng):
  """Longer shards (128 tokens), several tiles per block, window 200."""
  options = _O(causal, (200, None if causal else 50), 6.0, True)
  check_case(8, Shape(1, 1024, 1024, 4, 2, 32), options, key, rng)
