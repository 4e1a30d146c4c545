"""Every interpret path runs the kernels themselves, in one executable,
repeatedly, without hanging (the interpreter's old deadlocks were XLA's CPU
thread pool: docs/design_notes.md#the-interpreters-thread-pool): gradients
with segment ids (forward and backward kernels), FP8 (the quantization
kernel, then the FP8 attention kernel), forward + backward, two
independent kernels, and the decode kernel beside the forward. No fallback
is taken (warnings are errors), no race is found, and the results match
the float64 golden or the kernels' twin."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa3
from pallas_fa3 import segments
from pallas_fa3.kernels.sm90 import compat
from pallas_fa3.testing import (
  Shape,
  assert_within_tolerance,
  golden_and_naive,
  random_inputs,
)

pytestmark = pytest.mark.newest  # the newest-JAX tier runs it all

_REPEATS = 3
_TIMEOUT_S = 300


def _repeat(fn, *args):
  """`fn(*args)` `_REPEATS` times (one compile), race detection on; the
  last result."""
  for _ in range(_REPEATS):
    try:
      with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        with compat.capture_race_report() as report:
          result = jax.block_until_ready(fn(*args))
    except Exception:
      compat.reset_interpret_state()
      raise
    assert not compat.races_found(), report.getvalue()[-3000:]
  return result


@pytest.mark.timeout(_TIMEOUT_S)
def test_segment_id_gradients_run_the_kernels(key):
  shape = Shape(1, 128, 128, 2, 1, 64)
  q, k, v, dout = random_inputs(key, shape, jnp.bfloat16)
  ids = segments.segment_ids_from_lengths(jnp.array([[50, 60]]), 128)

  def fwd_bwd(q, k, v):
    f = lambda q, k, v: pallas_fa3.flash_attention(
      q, k, v, causal=True, segment_ids=ids, implementation="interpret"
    )
    out, pullback = jax.vjp(f, q, k, v)
    return (out,) + pullback(dout)

  got = _repeat(jax.jit(fwd_bwd), q, k, v)
  golden, naive = golden_and_naive(
    q, k, v, dout, causal=True, segment_ids=(ids, ids)
  )
  for name, g, n, gold in zip(
    ("out", "dq", "dk", "dv"),
    got,
    (naive[0], *naive[2:]),
    (golden[0], *golden[2:]),
  ):
    assert_within_tolerance(name, g, n, gold)


@pytest.mark.timeout(_TIMEOUT_S)
def test_fp8_quantization_kernel_then_attention_kernel(key):
  q, k, v, _ = random_inputs(key, Shape(1, 192, 192, 4, 2, 128), jnp.bfloat16)
  run = lambda impl: jax.jit(
    lambda q, k, v: pallas_fa3.flash_attention(
      q, k, v, causal=True, fp8=True, implementation=impl
    )
  )
  got = _repeat(run("interpret"), q, k, v)
  twin = run("blockwise")(q, k, v)
  np.testing.assert_allclose(
    np.asarray(got, np.float32), np.asarray(twin, np.float32), atol=2e-2
  )


@pytest.mark.timeout(_TIMEOUT_S)
def test_forward_and_backward_in_one_executable(key):
  shape = Shape(1, 130, 200, 4, 2, 64)
  q, k, v, dout = random_inputs(key, shape, jnp.bfloat16)

  def fwd_bwd(q, k, v):
    f = lambda q, k, v: pallas_fa3.flash_attention(
      q, k, v, causal=True, implementation="interpret"
    )
    out, pullback = jax.vjp(f, q, k, v)
    return (out,) + pullback(dout)

  got = _repeat(jax.jit(fwd_bwd), q, k, v)
  golden, naive = golden_and_naive(q, k, v, dout, causal=True)
  for name, g, n, gold in zip(
    ("out", "dq", "dk", "dv"),
    got,
    (naive[0], *naive[2:]),
    (golden[0], *golden[2:]),
  ):
    assert_within_tolerance(name, g, n, gold)


@pytest.mark.timeout(_TIMEOUT_S)
def test_independent_kernels_and_the_decode_kernel_in_one_executable(key):
  """Two independent forward kernels (different calls, no data between
  them) and a decode kernel, one executable."""
  a = random_inputs(key, Shape(1, 128, 128, 2, 1, 64), jnp.bfloat16)
  b = random_inputs(
    jax.random.fold_in(key, 1), Shape(1, 64, 192, 2, 2, 64), jnp.bfloat16
  )
  cache = jnp.concatenate([a[1], a[1]], axis=1)  # [1, 256, 1, 64]

  def three(a, b, cache):
    first = pallas_fa3.flash_attention(
      *a[:3], causal=True, implementation="interpret"
    )
    second = pallas_fa3.flash_attention(*b[:3], implementation="interpret")
    third = pallas_fa3.flash_attention_with_kvcache(
      a[0][:, :1], cache, cache, cache_seqlens=200, implementation="interpret"
    )
    return first, second, third

  got = _repeat(jax.jit(three), a, b, cache)
  for out, (q, k, v, dout), opts in (
    (got[0], a, dict(causal=True)),
    (got[1], b, {}),
  ):
    golden, naive = golden_and_naive(q, k, v, dout, **opts)
    assert_within_tolerance("out", out, naive[0], golden[0])
  want = pallas_fa3.flash_attention_with_kvcache(
    a[0][:, :1], cache, cache, cache_seqlens=200, implementation="reference"
  )
  np.testing.assert_allclose(
    np.asarray(got[2], np.float32), np.asarray(want, np.float32), atol=2e-2
  )
