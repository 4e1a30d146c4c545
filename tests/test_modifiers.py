"""Sliding windows, softcap and sinks (`pallas_fa3.modifiers`): the mask
rule against a brute-force one, every pure-JAX backend against the float64
golden with the tolerance rule (forward, lse, every gradient and d/dsinks),
the bit-exact plain call for a window that covers everything, validation,
refusals and transforms. The kernels: tests/test_modifiers_kernels.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import case_id

import pallas_fa3
from pallas_fa3 import masking
from pallas_fa3.spec import make_spec
from pallas_fa3.testing import (
  Shape,
  assert_within_tolerance,
  golden_and_naive,
  random_inputs,
)

NAMES = ("out", "lse", "dq", "dk", "dv", "dsinks")
TILES = pallas_fa3.BlockwiseConfig(block_q=16, block_kv=16)


def _brute_mask(sq, skv, causal, window):
  """The issue's rule, one pair at a time."""
  mask = np.zeros((sq, skv), bool)
  for i in range(sq):
    p = i + skv - sq
    for j in range(skv):
      ok = not causal or j <= p
      if window is not None:
        left, right = window
        ok &= left is None or j >= p - left
        ok &= right is None or j <= p + right
      mask[i, j] = ok
  return mask


@pytest.mark.parametrize("sq,skv", [(9, 9), (5, 12), (12, 5)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
  "window", [None, (2, None), (None, 3), (1, 2), (0, 0), (0, None), (30, 30)]
)
def test_mask_matches_the_rule(sq, skv, causal, window):
  x = jax.ShapeDtypeStruct((1, sq, 1, 8), jnp.float32)
  k = jax.ShapeDtypeStruct((1, skv, 1, 8), jnp.float32)
  spec = make_spec(x, k, k, causal=causal, window_size=window)
  got = np.asarray(masking.visible(spec, jnp.arange(sq), jnp.arange(skv)))
  got = np.broadcast_to(got, (sq, skv))
  np.testing.assert_array_equal(got, _brute_mask(sq, skv, causal, window))
  # Tile ranges never drop a visible pair.
  want = _brute_mask(sq, skv, causal, window)
  for b in (2, 4):
    for i0 in range(0, sq, b):
      first, end = (
        int(x)
        for x in masking.kv_block_range(spec, i0, i0 + b, 3, -(-skv // 3))
      )
      cols = np.nonzero(want[i0 : i0 + b].any(axis=0))[0]
      if cols.size:
        assert first * 3 <= cols.min() and cols.max() < end * 3


# (shape, causal, window, softcap, sinks): the cases.
CASES = [
  (Shape(1, 40, 40, 2, 2, 16), False, (5, None), None, False),  # left only
  (Shape(1, 40, 40, 2, 2, 16), False, (None, 6), None, False),  # right only
  (Shape(1, 40, 40, 2, 2, 16), False, (7, 3), None, False),  # both
  (Shape(1, 40, 40, 2, 2, 16), False, (0, 0), None, False),  # diagonal
  (Shape(1, 50, 30, 2, 1, 16), True, (4, None), None, False),  # sq > skv
  (Shape(1, 30, 50, 2, 1, 16), True, (9, None), None, False),  # sq < skv
  (Shape(2, 33, 47, 4, 2, 16), True, None, 2.0, False),  # softcap, GQA
  (Shape(1, 50, 30, 2, 1, 16), True, None, None, True),  # empty rows
  (Shape(1, 36, 36, 4, 2, 16, 24), False, (6, 2), 5.0, True),  # all, dv
  (Shape(1, 60, 40, 4, 1, 16), True, (3, None), 1.0, True),  # all, MQA
]


# The reference in float32 is the float64 golden's own algorithm; both
# backends in float32 run the bfloat16 cases' code, and the property suite
# checks them on every option mix: under -m slow here.
@pytest.mark.parametrize(
  "implementation,dtype",
  [
    ("reference", "bfloat16"),
    pytest.param("reference", "float32", marks=pytest.mark.slow),
    ("blockwise", "bfloat16"),
    pytest.param("blockwise", "float32", marks=pytest.mark.slow),
  ],
)
@pytest.mark.parametrize(
  "shape,causal,window,softcap,sinks",
  [pytest.param(*c, id=case_id(*c)) for c in CASES],
)
def test_against_float64_golden(
  implementation, dtype, shape, causal, window, softcap, sinks, key
):
  q, k, v, dout = random_inputs(key, shape, dtype)
  snk = None
  if sinks:
    snk = jax.random.normal(jax.random.fold_in(key, 1), (shape.heads_q,)) * 2
  dlse = jax.random.normal(
    jax.random.fold_in(key, 2), (shape.batch, shape.heads_q, shape.seq_q)
  )
  options = dict(causal=causal, window_size=window, softcap=softcap)
  config = TILES if implementation == "blockwise" else None

  @jax.jit
  def run(q, k, v, snk, dout, dlse):
    f = lambda q, k, v, s: pallas_fa3.flash_attention(
      q,
      k,
      v,
      sinks=s,
      return_lse=True,
      implementation=implementation,
      config=config,
      **options,
    )
    (out, lse), pullback = jax.vjp(f, q, k, v, snk)
    return (out, lse) + tuple(
      g for g in pullback((dout, dlse)) if g is not None
    )

  got = run(q, k, v, snk, dout, dlse)
  golden, naive = golden_and_naive(
    q, k, v, dout, dlse=dlse, sinks=snk, **options
  )
  assert len(got) == len(golden) == len(naive) == (6 if sinks else 5)
  for name, g, n, gold in zip(NAMES, got, naive, golden):
    assert_within_tolerance(name, g, n, gold)
  if sinks and shape.seq_q > shape.seq_kv and causal:
    # Rows that see no key: output 0 and lse = their head's sink.
    empty = shape.seq_q - shape.seq_kv
    assert not np.any(np.asarray(got[0][:, :empty], np.float32))
    np.testing.assert_allclose(
      np.asarray(got[1][0, :, :empty]),
      np.broadcast_to(np.asarray(snk)[:, None], (shape.heads_q, empty)),
      rtol=1e-6,
    )


@pytest.mark.parametrize("implementation", ["reference", "blockwise"])
@pytest.mark.parametrize("causal", [False, True])
def test_window_covering_everything_is_the_plain_call(implementation, causal):
  q, k, v, _ = random_inputs(
    jax.random.key(0), Shape(1, 24, 40, 2, 1, 16), "bfloat16"
  )
  plain = pallas_fa3.flash_attention(
    q, k, v, causal=causal, return_lse=True, implementation=implementation
  )
  for window in ((39, 23), (100, None), (None, 1000), (None, None)):
    got = pallas_fa3.flash_attention(
      q,
      k,
      v,
      causal=causal,
      window_size=window,
      return_lse=True,
      implementation=implementation,
    )
    for a, b in zip(got, plain):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_blockwise_never_computes_tiles_outside_the_window(key):
  """V is NaN on every key no query's window reaches: a tile computed and
  masked would still give 0 * NaN = NaN (forward and gradients)."""
  q, k, v, dout = random_inputs(key, Shape(1, 32, 256, 2, 1, 16), "float32")
  visible_from = 256 - 32 - 20  # the first query sits at 224, sees 20 back
  poisoned = v.at[:, : visible_from // 16 * 16].set(jnp.nan)
  f = lambda q, k, v: pallas_fa3.flash_attention(
    q,
    k,
    v,
    causal=True,
    window_size=(20, None),
    implementation="blockwise",
    config=TILES,
  )
  out, pullback = jax.vjp(f, q, k, poisoned)
  dq, dk, dv = pullback(dout)
  clean = f(q, k, v)
  np.testing.assert_allclose(np.asarray(out), np.asarray(clean), rtol=1e-6)
  for g in (dq, dk, dv):
    assert np.all(np.isfinite(np.asarray(g)))
  assert not np.any(np.asarray(dk[:, : visible_from - 16]))


@pytest.mark.parametrize("implementation", ["reference", "blockwise"])
def test_fa3_window_convention_minus_one_is_unbounded(implementation):
  """FA2/FA3/fa4-jax code runs unchanged: (-1, -1) is no window, (-1, 0)
  causal (bottom-right), (w, -1) a left bound alone; bit for bit the same
  as None."""
  q, k, v, _ = random_inputs(
    jax.random.key(1), Shape(1, 24, 40, 2, 1, 16), "bfloat16"
  )
  call = lambda **kw: pallas_fa3.flash_attention(
    q, k, v, return_lse=True, implementation=implementation, **kw
  )
  for got, want in (
    (call(window_size=(-1, -1)), call()),
    (call(window_size=(-1, 0)), call(causal=True)),
    (call(window_size=(5, -1)), call(window_size=(5, None))),
    (call(window_size=[-1, 3]), call(window_size=(None, 3))),
    (call(window_size=(-1, -1), causal=True), call(causal=True)),
  ):
    for a, b in zip(got, want):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert make_spec(q, k, k, window_size=(-1, 0)).window_size == (None, 0)


@pytest.mark.parametrize(
  "window,error",
  [
    ((-2, 3), ValueError),
    ((3, -5), ValueError),
    ((1, 2, 3), ValueError),
    ((1.5, 2), TypeError),
    ((True, 2), TypeError),
    ("12", TypeError),
    (5, TypeError),
  ],
)
def test_bad_window_size_is_an_error_naming_it(window, error):
  q = jnp.zeros((1, 8, 2, 16))
  with pytest.raises(error, match="window_size"):
    pallas_fa3.flash_attention(q, q, q, window_size=window)


@pytest.mark.parametrize(
  "softcap,error",
  [(-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
   ("3", TypeError), (True, TypeError)],
)  # fmt: skip
def test_bad_softcap_is_an_error_naming_it(softcap, error):
  q = jnp.zeros((1, 8, 2, 16))
  with pytest.raises(error, match="softcap"):
    pallas_fa3.flash_attention(q, q, q, softcap=softcap)


@pytest.mark.parametrize(
  "sinks,error",
  [
    (np.zeros((3,), np.float32), ValueError),
    (np.zeros((1, 2), np.float32), ValueError),
    (np.zeros((), np.float32), ValueError),
    (np.zeros((2,), np.int32), TypeError),
    ([0.0, 0.0], TypeError),
  ],
)
def test_bad_sinks_are_an_error_naming_them(sinks, error):
  q = jnp.zeros((1, 8, 2, 16))
  with pytest.raises(error, match="sinks"):
    pallas_fa3.flash_attention(q, q, q, sinks=sinks)


def test_softcap_zero_is_off():
  q, k, v, _ = random_inputs(
    jax.random.key(1), Shape(1, 16, 16, 2, 2, 16), "float32"
  )
  a = pallas_fa3.flash_attention(q, k, v, softcap=0.0)
  b = pallas_fa3.flash_attention(q, k, v)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_stable_max_with_a_window_raises():
  q = jnp.zeros((1, 16, 2, 16))
  with pytest.raises(NotImplementedError, match="window_size"):
    pallas_fa3.flash_attention(
      q, q, q, window_size=(2, 2), stable_max=True, implementation="blockwise"
    )


def test_transforms_compose(key):
  """vmap (sinks shared or batched), checkpoint, grad in every input, jit,
  deterministic, and export for the CPU."""
  shape = Shape(2, 24, 24, 4, 2, 16)
  q, k, v, _ = random_inputs(key, shape, "float32")
  sinks = jnp.linspace(-1.0, 1.0, 4)
  opts = dict(
    causal=True, window_size=(5, None), softcap=3.0, deterministic=True
  )

  def loss(q, k, v, s):
    out, lse = pallas_fa3.flash_attention(
      q, k, v, sinks=s, return_lse=True, **opts
    )
    return (out**2).sum() + lse.sum()

  grads = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2, 3)))(
    q, k, v, sinks
  )
  ref = jax.grad(
    lambda q, k, v, s: (
      lambda o: (o[0] ** 2).sum() + o[1].sum()
    )(
      pallas_fa3.reference_attention(
        q, k, v, sinks=s, return_lse=True, causal=True, window_size=(5, None),
        softcap=3.0,
      )
    ),
    argnums=(0, 1, 2, 3),
  )(q, k, v, sinks)  # fmt: skip
  for g, r in zip(grads, ref):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-4)
  # vmap over a leading axis, sinks shared and batched.
  qs = jnp.stack([q, 2 * q])
  shared = jax.vmap(
    lambda q: pallas_fa3.flash_attention(q, k, v, sinks=sinks, **opts)
  )(qs)
  per = jax.vmap(
    lambda q, s: pallas_fa3.flash_attention(q, k, v, sinks=s, **opts)
  )(qs, jnp.stack([sinks, -sinks]))
  for i, s in enumerate((sinks, -sinks)):
    one = pallas_fa3.flash_attention(qs[i], k, v, sinks=s, **opts)
    np.testing.assert_allclose(np.asarray(per[i]), np.asarray(one), atol=1e-6)
  np.testing.assert_allclose(
    np.asarray(shared[0]),
    np.asarray(pallas_fa3.flash_attention(q, k, v, sinks=sinks, **opts)),
    atol=1e-6,
  )
  exported = jax.export.export(
    jax.jit(
      lambda q, k, v, s: pallas_fa3.flash_attention(q, k, v, sinks=s, **opts)
    )
  )(q, k, v, sinks)
  np.testing.assert_allclose(
    np.asarray(exported.call(q, k, v, sinks)), np.asarray(shared[0]), atol=1e-6
  )


def test_sinks_gradient_keeps_the_sinks_dtype():
  q, k, v, _ = random_inputs(
    jax.random.key(3), Shape(1, 16, 16, 2, 2, 16), "bfloat16"
  )
  sinks = jnp.zeros((2,), jnp.bfloat16)
  g = jax.grad(
    lambda s: (
      pallas_fa3.flash_attention(q, k, v, sinks=s).astype(jnp.float32).sum()
    )
  )(sinks)
  assert g.dtype == jnp.bfloat16 and g.shape == (2,)


@pytest.mark.parametrize(
  "options",
  [
    dict(window_size=(4, 0)),
    dict(softcap=5.0),
    dict(sinks=np.asarray([0.5, -1.0], np.float32)),
  ],
  ids=["window_size", "softcap", "sinks"],
)
def test_ring_attention_takes_modifiers(options):
  """ring_attention serves the modifiers (issue 33; tests/multidevice has
  the sharded cases): on one device it computes flash_attention."""
  q, k, v, _ = random_inputs(
    jax.random.key(5), Shape(1, 8, 8, 2, 2, 16), "float32"
  )
  mesh = jax.make_mesh((1,), ("seq",))
  got = pallas_fa3.ring_attention(q, k, v, mesh=mesh, seq_axis="seq", **options)
  want = pallas_fa3.flash_attention(
    q, k, v, implementation="reference", **options
  )
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
