"""ulysses_attention on 4 and 8 simulated CPU devices (issue 33).

Run through `tests/test_scale_out.py` (8 simulated CPU devices in a
subprocess), or directly with
`XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu`.

Each case: out, lse, dq, dk, dv (and d/dsinks) with an lse cotangent within
the tolerance rule of the float64 golden; the compiled program moves data
by all-to-all and has no all-gather of q, k or v (segment ids, int32
`[batch, seq]`, are gathered whole); out and the gradients come back
sharded like q. MHA, GQA whose groups split evenly, MQA and groups that
straddle devices (kv heads repeated), causal and not, modifiers, batch and
head axes, Explicit axes, the reference backend; then the refusals.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import mesh_helpers as mh
import pytest
import ring_helpers as rh
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_fa3
from pallas_fa3.parallel import ulysses
from pallas_fa3.testing import Shape, random_inputs

mh.require_devices()

_O = rh.Options

# (id, mesh shape over ("other", "seq"), q/k/v spec, shape, options, extra)
CASES = [
  (
    "mha-full-8",
    (1, 8),
    P(None, "seq"),
    Shape(1, 128, 128, 8, 8, 16),
    _O(),
    {},
  ),
  (
    "gqa-causal-8",
    (1, 8),
    P(None, "seq"),
    Shape(1, 128, 128, 16, 8, 16),
    _O(True),
    {},
  ),
  (
    "mqa-causal-4",
    (1, 4),
    P(None, "seq"),
    Shape(2, 64, 64, 8, 1, 16),
    _O(True),
    {},
  ),
  (
    "straddling-groups-4",
    (1, 4),
    P(None, "seq"),
    Shape(1, 64, 64, 12, 6, 16),
    _O(False),
    {},
  ),
  (
    "modifiers-cross-4",
    (1, 4),
    P(None, "seq"),
    Shape(2, 64, 96, 8, 2, 16),
    _O(False, (10, 20), 4.0, True),
    {},
  ),
  (
    "ids-window-causal-8",
    (1, 8),
    P(None, "seq"),
    Shape(1, 128, 128, 8, 2, 16),
    _O(True, (24, None), documents=4),
    {},
  ),
  (
    "batch-axes-explicit",
    (2, 4),
    P("other", "seq"),
    Shape(2, 64, 64, 8, 4, 16),
    _O(True, sinks=True),
    dict(batch_axes="other", explicit=True),
  ),
  (
    "head-axes-reference",
    (2, 4),
    P(None, "seq", "other"),
    Shape(1, 64, 64, 8, 2, 16),
    _O(True),
    dict(head_axes="other", implementation="reference"),
  ),
]
# Left to -m slow, beside the default case that runs the same code:
# gqa-causal-8's path (no kv repeat, one kv head a device, 2 head chunks,
# causal) is batch-axes-explicit's; causal on 8 devices, Auto axes:
# ids-window-causal-8.
_SLOW = ("gqa-causal-8",)


def _run(mesh, options, **kwargs):
  return rh.seq_parallel_run(
    pallas_fa3.ulysses_attention, mesh, options, **kwargs
  )


def _gathers(hlo: str) -> list[str]:
  """The element types of every all-gather's result."""
  return re.findall(r"= \(?(\w+)\[[\d,]*\][^ ]* all-gather(?:-start)?\(", hlo)


@pytest.mark.parametrize(
  "mesh_shape,spec,shape,options,extra",
  [
    pytest.param(
      *c[1:], id=c[0], marks=pytest.mark.slow if c[0] in _SLOW else ()
    )
    for c in CASES
  ],
)
def test_ulysses_matches_golden(
  mesh_shape, spec, shape, options, extra, key, rng
):
  extra = dict(extra)
  mesh = mh.mesh(
    mesh_shape, ("other", "seq"), explicit=extra.pop("explicit", False)
  )
  plain = rh.inputs(key, shape, options, rng)
  q, k, v, sinks, ids, dout, dlse = plain
  entries = tuple(spec) + (None,) * (4 - len(tuple(spec)))
  seq = NamedSharding(mesh, spec)
  lse = NamedSharding(mesh, P(entries[0], entries[2], "seq"))
  args = [jax.device_put(x, seq) for x in (q, k, v)] + [sinks]
  if ids is not None:
    ids = jax.device_put(ids, NamedSharding(mesh, P(entries[0], "seq")))
  args += [ids, jax.device_put(dout, seq), jax.device_put(dlse, lse)]
  compiled = _run(mesh, options, **extra).lower(*args).compile()
  hlo = compiled.as_text()
  counts = mh.collectives(hlo)
  assert counts[mh.ALL_TO_ALL] > 0, counts
  assert counts[mh.PERMUTE] == 0, counts
  assert all(t == "s32" for t in _gathers(hlo)), _gathers(hlo)
  assert bool(_gathers(hlo)) == bool(options.documents), counts
  got = compiled(*args)
  for name, x in zip(rh.NAMES[:5], got):
    want = lse if name == "lse" else seq
    assert x.sharding.is_equivalent_to(want, x.ndim), (name, x.sharding)
  rh.assert_matches_golden(got, plain, options)


def test_kv_repeat_keeps_groups_whole():
  """The fewest repetitions after which every device gets whole groups."""
  assert ulysses.kv_repeat(16, 8, 8) == 1  # kv heads split evenly
  assert ulysses.kv_repeat(8, 1, 4) == 4  # MQA: one copy per device
  assert ulysses.kv_repeat(8, 2, 8) == 4  # fewer kv heads than devices
  assert ulysses.kv_repeat(12, 6, 4) == 2  # groups of 2 straddle devices
  assert ulysses.kv_repeat(8, 8, 8) == 1


# ---------------------------------------------------------------------------
# Refusals: one test per error path.


def _call(shape=Shape(1, 64, 64, 8, 2, 16), mesh_shape=(8,), **options):
  q, k, v, _ = random_inputs(jax.random.key(0), shape, jnp.bfloat16)
  mesh = mh.mesh(mesh_shape, ("seq",) if len(mesh_shape) == 1 else ("m", "seq"))
  return pallas_fa3.ulysses_attention(
    q, k, v, mesh=mesh, seq_axis="seq", **options
  )


def test_heads_that_do_not_split_are_refused():
  with pytest.raises(ValueError, match=r"heads_q=6, not a multiple of 8"):
    _call(Shape(1, 64, 64, 6, 2, 16))


def test_heads_per_head_axes_shard_must_split():
  with pytest.raises(
    ValueError,
    match=r"heads_q=4 \(2 per head_axes shard\), not a multiple of 4",
  ):
    _call(Shape(1, 64, 64, 4, 2, 16), mesh_shape=(2, 4), head_axes="m")


def test_lengths_must_split():
  with pytest.raises(
    ValueError, match=r"k has sequence length 60, not a multiple of 8"
  ):
    _call(Shape(1, 64, 60, 8, 2, 16))


def test_seq_axis_must_be_a_mesh_axis():
  q, k, v, _ = random_inputs(
    jax.random.key(0), Shape(1, 64, 64, 8, 2, 16), "bfloat16"
  )
  with pytest.raises(ValueError, match=r"seq_axis='sp' is not an axis"):
    pallas_fa3.ulysses_attention(
      q, k, v, mesh=mh.mesh((8,), ("seq",)), seq_axis="sp"
    )


def test_bad_options_name_the_argument():
  with pytest.raises(TypeError, match=r"window_size must be None or a pair"):
    _call(window_size=4)
  with pytest.raises(ValueError, match=r"sinks must have shape \[heads_q\]"):
    _call(sinks=jnp.zeros((3,)))
  with pytest.raises(TypeError, match=r"return_lse must be a bool"):
    _call(return_lse="yes")
