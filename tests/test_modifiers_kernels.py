"""Windows, softcap and sinks in the sm90 kernels, on a CPU.

Interpret mode (race detection on) runs the forward kernel and both
backwards (fused; dK/dV + dQ) through `flash_attention` against the float64
golden with the tolerance rule; V poisoned with NaN where no window reaches
shows that those K/V tiles are never loaded. Lowering checks that
`jax.grad` through `mosaic` with each feature is all kernels (no fallback)
and holds no `[seq_q, seq_kv]` tensor.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import case_id
from jax import export

import pallas_fa3
from pallas_fa3.kernels.sm90 import compat
from pallas_fa3.testing import (
  Shape,
  assert_lowered_attention,
  assert_within_tolerance,
  golden_and_naive,
  random_inputs,
  run_interpreted,
)

_TIMEOUT_S = 300
NAMES = ("out", "lse", "dq", "dk", "dv", "dsinks")

# (shape, causal, window, softcap, sinks, deterministic)
CASES = [
  # left bound: the walk starts past tile 0 (sq < skv, GQA), dK/dV + dQ
  (Shape(1, 256, 384, 2, 1, 64), True, (100, None), None, False, True),
  # both sides, not causal, ragged kv (padded keys in a window), fused
  (Shape(1, 200, 330, 2, 2, 64), False, (40, 30), None, False, False),
  # the diagonal only, with sinks (every row sees one key)
  (Shape(1, 192, 192, 2, 1, 64), False, (0, 0), None, True, False),
  # softcap with GQA and causal, fused
  (Shape(1, 256, 256, 4, 2, 64), True, None, 3.0, False, False),
  # sinks with rows that see no key (sq > skv), dK/dV + dQ
  (Shape(1, 300, 200, 2, 1, 64), True, None, None, True, True),
  # all three, sq > skv, fused
  (Shape(1, 384, 256, 2, 1, 64), True, (50, None), 5.0, True, False),
  # all three at d128 with GQA: the fused kernel's shared-tile layout
  # (FA3's own tiles spill there, issue 43)
  (Shape(1, 200, 256, 4, 2, 128), True, (100, None), 5.0, True, False),
  # softcap at d128 with GQA, deterministic: the shared tile (issue 43)
  (Shape(1, 200, 256, 4, 2, 128), True, None, 5.0, False, True),
]


@pytest.mark.timeout(_TIMEOUT_S)
@pytest.mark.parametrize(
  "shape,causal,window,softcap,sinks,deterministic",
  [pytest.param(*c, id=case_id(*c)) for c in CASES],
)
def test_interpret_against_float64_golden(
  shape, causal, window, softcap, sinks, deterministic, key
):
  q, k, v, dout = random_inputs(key, shape, jnp.bfloat16)
  snk = None
  if sinks:
    snk = jax.random.normal(jax.random.fold_in(key, 1), (shape.heads_q,)) * 2
  dlse = jax.random.normal(
    jax.random.fold_in(key, 2), (shape.batch, shape.heads_q, shape.seq_q)
  )
  options = dict(causal=causal, window_size=window, softcap=softcap)

  def f(q, k, v, s):
    return pallas_fa3.flash_attention(
      q,
      k,
      v,
      sinks=s,
      return_lse=True,
      implementation="interpret",
      deterministic=deterministic,
      **options,
    )

  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no fallback to the blockwise backward
    try:
      with compat.capture_race_report() as report:
        (out, lse), pullback = jax.vjp(f, q, k, v, snk)
        grads = jax.block_until_ready(pullback((dout, dlse)))
    except Exception:
      compat.reset_interpret_state()
      raise
  assert not compat.races_found(), report.getvalue()[-3000:]
  got = (out, lse) + tuple(g for g in grads if g is not None)
  golden, naive = golden_and_naive(
    q, k, v, dout, dlse=dlse, sinks=snk, **options
  )
  for name, g, n, gold in zip(NAMES, got, naive, golden):
    assert_within_tolerance(name, g, n, gold)


@pytest.mark.timeout(_TIMEOUT_S)
@pytest.mark.parametrize("deterministic", [False, True])
def test_interpret_never_loads_tiles_outside_the_window(deterministic, key):
  """V is NaN on every key no query's window reaches (whole K/V tiles): a
  tile loaded and masked would still give 0 * NaN = NaN."""
  q, k, v, dout = random_inputs(key, Shape(1, 64, 512, 2, 1, 64), "bfloat16")
  poisoned = v.at[:, :256].set(jnp.nan)  # queries at 448.. see 448 - 60..
  f = lambda q, k, v: pallas_fa3.flash_attention(
    q,
    k,
    v,
    causal=True,
    window_size=(60, None),
    implementation="interpret",
    deterministic=deterministic,
  )

  def fwd_bwd(q, k, v):
    out, pullback = jax.vjp(f, q, k, v)
    return (out, *pullback(dout))

  out, dq, dk, dv = run_interpreted(fwd_bwd, q, k, poisoned)
  clean = pallas_fa3.flash_attention(
    q, k, v, causal=True, window_size=(60, None), implementation="blockwise"
  )
  np.testing.assert_allclose(
    np.asarray(out, np.float32), np.asarray(clean, np.float32), atol=2e-2
  )
  for g in (dq, dk, dv):
    assert np.all(np.isfinite(np.asarray(g, np.float32)))
  assert not np.any(np.asarray(dv[:, :256], np.float32))


@pytest.mark.parametrize(
  "options",
  [
    # One at a time under -m slow: "all" runs the same code together.
    pytest.param(
      dict(causal=True, window_size=(256, None)), marks=pytest.mark.slow
    ),
    dict(window_size=(128, 64)),
    pytest.param(dict(causal=True, softcap=30.0), marks=pytest.mark.slow),
    pytest.param(dict(causal=True, sinks=True), marks=pytest.mark.slow),
    dict(causal=True, window_size=(100, None), softcap=20.0, sinks=True),
  ],
  ids=["window-causal", "window-both", "softcap", "sinks", "all"],
)
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize(
  "head_dim", [pytest.param(64, marks=pytest.mark.slow), 128]
)  # d64: the same modifier code at other tiles (under -m slow)
def test_grad_through_mosaic_lowers_to_kernels(
  options, deterministic, head_dim
):
  options = dict(options)
  sinks = options.pop("sinks", False)
  q = jax.ShapeDtypeStruct((2, 512, 4, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 640, 2, head_dim), jnp.bfloat16)
  s = jax.ShapeDtypeStruct((4,), jnp.float32)

  def loss(q, k, v, s):
    out, lse = pallas_fa3.flash_attention(
      q,
      k,
      v,
      sinks=s if sinks else None,
      return_lse=True,
      implementation="mosaic",
      deterministic=deterministic,
      **options,
    )
    return out.astype(jnp.float32).sum() + lse.sum()

  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no fallback to the blockwise backward
    exported = export.export(
      jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))), platforms=["cuda"]
    )(q, kv, kv, s)
  # The forward, then the fused backward or dK/dV + dQ.
  assert_lowered_attention(
    exported.mlir_module(),
    kernels=3 if deterministic else 2,
    seq_q=q.shape[1],
    seq_kv=kv.shape[1],
  )
