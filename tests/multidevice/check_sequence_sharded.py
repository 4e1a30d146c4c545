"""flash_attention with q, k, v sharded along the sequence (issue 33): it
runs the ring by itself, on 8 simulated CPU devices.

Run through `tests/test_scale_out.py` (8 simulated CPU devices in a
subprocess), or directly with
`XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu`.

Each case: out, lse, dq, dk, dv (and d/dsinks) with an lse cotangent within
the tolerance rule of the float64 golden, under `jax.jit` on Auto and
Explicit mesh axes, with batch or heads split over another axis; the
compiled program has no all-gather or all-to-all (K/V move by
collective-permute; the sinks' gradient adds an all-reduce of `[batch,
heads]` partial sums); out and the gradients come back sharded like q.
Then `context.explain`, and the layouts and options it refuses.
"""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import mesh_helpers as mh
import pytest
import ring_helpers as rh
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_fa3
from pallas_fa3.parallel import context
from pallas_fa3.testing import (
  Shape,
  assert_within_tolerance,
  golden_and_naive,
  random_inputs,
)

mh.require_devices()

_AXES = ("data", "seq")
_O = rh.Options

# (id, mesh shape over ("data", "seq"), q/k/v spec, shape, options, explicit)
CASES = [
  (
    "seq8-causal-gqa",
    (1, 8),
    P(None, "seq"),
    Shape(1, 128, 128, 8, 2, 16),
    _O(True),
    False,
  ),
  (
    "batch-seq-full-cross",
    (2, 4),
    P("data", "seq"),
    Shape(2, 64, 96, 4, 2, 16),
    _O(False),
    False,
  ),
  (
    "heads-seq-causal-explicit",
    (2, 4),
    P(None, "seq", "data"),
    Shape(1, 64, 64, 4, 2, 16),
    _O(True),
    True,
  ),
  (
    "modifiers-batch-seq",
    (2, 4),
    P("data", "seq"),
    Shape(2, 64, 64, 4, 2, 16),
    _O(True, (12, None), 5.0, True, documents=3),
    False,
  ),
  (
    "modifiers-seq8-explicit",
    (1, 8),
    P(None, "seq"),
    Shape(1, 128, 128, 4, 1, 16),
    _O(False, (9, 14), 4.0, True),
    True,
  ),
]


def _run(options: rh.Options):
  def attend(q, k, v, sinks, ids):
    return pallas_fa3.flash_attention(
      q,
      k,
      v,
      causal=options.causal,
      window_size=options.window_size,
      softcap=options.softcap,
      sinks=sinks,
      segment_ids=ids,
      return_lse=True,
    )

  return jax.jit(rh.vjp_run(attend))


@pytest.mark.parametrize(
  "mesh_shape,spec,shape,options,explicit",
  [pytest.param(*c[1:], id=c[0]) for c in CASES],
)
def test_sequence_sharded_flash_attention_runs_the_ring(
  mesh_shape, spec, shape, options, explicit, key, rng
):
  mesh = mh.mesh(mesh_shape, _AXES, explicit=explicit)
  plain = rh.inputs(key, shape, options, rng)
  q, k, v, sinks, ids, dout, dlse = plain
  entries = tuple(spec) + (None,) * (4 - len(tuple(spec)))
  seq = NamedSharding(mesh, spec)
  lse = NamedSharding(mesh, P(entries[0], entries[2], entries[1]))
  args = [jax.device_put(x, seq) for x in (q, k, v)] + [sinks]
  if ids is not None:
    ids = jax.device_put(ids, NamedSharding(mesh, P(entries[0], "seq")))
  args += [ids, jax.device_put(dout, seq), jax.device_put(dlse, lse)]
  compiled = _run(options).lower(*args).compile()
  allowed = (mh.PERMUTE,) + ((mh.ALL_REDUCE,) if options.sinks else ())
  counts = rh.assert_collectives(compiled.as_text(), allowed)
  assert counts[mh.PERMUTE] > 0, counts
  got = compiled(*args)
  for name, x in zip(rh.NAMES[:5], got):
    want = lse if name == "lse" else seq
    assert x.sharding.is_equivalent_to(want, x.ndim), (name, x.sharding)
  rh.assert_matches_golden(got, plain, options)


# Slow: [seq8-causal-gqa] runs the same ring (mesh (1, 8), causal, Auto
# axes) under jit; the refusals' [eager] cases check concrete arrays'
# shardings at trace time.
@pytest.mark.slow
def test_eager_call_on_sequence_sharded_arrays(key):
  """Concrete sharded arrays, no jit of the caller's: the same ring."""
  mesh = mh.mesh((1, 8), _AXES)
  shape = Shape(1, 128, 128, 4, 2, 16)
  q, k, v, dout = random_inputs(key, shape, jnp.bfloat16)
  seq = NamedSharding(mesh, P(None, "seq"))
  out = pallas_fa3.flash_attention(
    *(jax.device_put(x, seq) for x in (q, k, v)), causal=True
  )
  assert out.sharding.is_equivalent_to(seq, 4)
  golden, naive = golden_and_naive(q, k, v, dout, causal=True)
  assert_within_tolerance("out", out, naive[0], golden[0])


def test_explain_says_which_scheme_runs():
  mesh = mh.mesh((2, 4), _AXES)
  struct = lambda shape, spec: jax.ShapeDtypeStruct(
    shape, "bfloat16", sharding=NamedSharding(mesh, spec)
  )
  x = struct((2, 256, 4, 16), P("data", "seq"))
  text = context.explain(x, x, x, causal=True)
  assert text.startswith("ring over mesh axis 'seq' (4 devices): causal"), text
  assert "batch split 2 ways" in text, text
  text = context.explain(x, x, x, causal=True, window_size=(32, 0))
  assert "natural order" in text and "1 step(s) forward" in text, text
  h = struct((2, 256, 4, 16), P("data", None, "seq"))
  text = context.explain(h, h, h)
  assert text.startswith("shard-local blockwise on every device"), text
  text = context.explain(x, x, x, implementation="reference")
  assert text.startswith("refused: implementation='reference'"), text
  plain = jax.ShapeDtypeStruct((2, 256, 4, 16), "bfloat16")
  assert context.explain(plain, plain, plain).startswith("one device")


# ---------------------------------------------------------------------------
# Refusals: one test per error path, known at trace time (concrete arrays:
# eager; Explicit axes) as ValueError / NotImplementedError, under jit with
# automatic axes at compile time as JaxRuntimeError with the same message.

_MODES = ("eager", "jit", "explicit_jit")


def _call_with(mode, mesh_shape, specs, shape, **options):
  mesh = mh.mesh(mesh_shape, _AXES, explicit=mode == "explicit_jit")
  q, k, v, _ = random_inputs(jax.random.key(0), shape, jnp.bfloat16)
  args = [
    jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip((q, k, v), specs)
  ]
  fn = lambda q, k, v: pallas_fa3.flash_attention(q, k, v, **options)
  return fn(*args) if mode == "eager" else jax.jit(fn)(*args)


def _raises(mode, error):
  return pytest.raises(error if mode != "jit" else jax.errors.JaxRuntimeError)


@pytest.mark.parametrize("mode", _MODES)
def test_sequence_split_over_two_axes_is_refused(mode):
  spec = P(None, ("data", "seq"))
  with _raises(mode, ValueError) as info:
    _call_with(mode, (2, 4), (spec,) * 3, Shape(1, 64, 64, 2, 2, 16))
  assert "ring over one mesh axis" in str(info.value)


@pytest.mark.parametrize("mode", _MODES)
def test_kv_split_while_q_is_not_is_refused(mode):
  specs = (P(), P(None, "seq"), P(None, "seq"))
  with _raises(mode, ValueError) as info:
    _call_with(mode, (2, 4), specs, Shape(1, 64, 64, 2, 2, 16))
  assert "k is sharded along its sequence axis" in str(info.value)


@pytest.mark.parametrize("mode", _MODES)
def test_lengths_the_ring_cannot_split_are_refused(mode):
  spec = P(None, "seq")  # causal: 2 x 4 zig-zag chunks, 36 is not 8s
  with _raises(mode, ValueError) as info:
    _call_with(
      mode, (2, 4), (spec,) * 3, Shape(1, 36, 36, 2, 2, 16), causal=True
    )
  assert "q has sequence length 36, not a multiple of 8" in str(info.value)


def test_reference_backend_is_refused_on_a_sequence_split():
  spec = P(None, "seq")
  with pytest.raises(NotImplementedError, match=r"implementation='reference'"):
    _call_with(
      "eager",
      (2, 4),
      (spec,) * 3,
      Shape(1, 64, 64, 2, 2, 16),
      implementation="reference",
    )


def test_fp8_is_refused_on_a_sequence_split():
  spec = P(None, "seq")
  with pytest.raises(NotImplementedError, match=r"fp8 with q sharded along"):
    _call_with(
      "eager", (2, 4), (spec,) * 3, Shape(1, 64, 64, 2, 2, 16), fp8=True
    )


def test_scale_out_page_example_runs():
  """docs/scale_out.md's 8-device example (fenced "```python multidevice")."""
  page = pathlib.Path(__file__).resolve().parents[2] / "docs" / "scale_out.md"
  blocks = re.findall(
    r"```python multidevice\n(.*?)```", page.read_text(), re.S
  )
  assert len(blocks) == 1, "the page's example moved?"
  scope: dict = {}
  exec(compile(blocks[0], str(page), "exec"), scope)  # pylint: disable=exec-used
  out, mesh = scope["out"], scope["mesh"]
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("data", "seq")), 4)
