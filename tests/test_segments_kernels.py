"""Segment ids in the sm90 forward kernel, on a CPU: interpret mode against
the float64 golden (contiguous ids: the kernel's per-row key bounds; other
ids: the blockwise twin, chosen on the device), the bounds themselves, and
the CUDA lowering of `jax.grad` through `mosaic` (the forward kernel, the
backward said to be the blockwise recomputation, no `[sq, skv]` tensor)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import pallas_fa3
from pallas_fa3 import segments
from pallas_fa3.testing import (
  Shape,
  assert_lowered_attention,
  assert_within_tolerance,
  golden_and_naive,
  random_inputs,
)

_TIMEOUT_S = 300


def test_key_bounds_are_each_rows_segment(rng):
  kv = np.array([[0, 0, 1, 1, 1, 2, -2, -2]], np.int32)
  q = np.array([[1, 0, 2, -1, 5, 1, 1, 0]], np.int32)
  lo, hi, contiguous = segments.key_bounds((q, kv))
  for i in range(8):
    keys = np.nonzero(kv[0] == q[0, i])[0]
    want = (keys.min(), keys.max() + 1) if keys.size else (0, 0)
    got = (int(lo[0, i]), int(hi[0, i]))
    assert got == want or (want == (0, 0) and got[0] >= got[1])
  assert bool(contiguous)
  split = np.array([[0, 1, 0, 1, 1, 1, 1, 1]], np.int32)  # id 0 twice
  assert not bool(segments.key_bounds((q, split))[2])


# (shape, causal, window, sinks, contiguous kv ids)
CASES = [
  (Shape(2, 256, 256, 2, 1, 64), True, None, False, True),
  (Shape(1, 200, 330, 2, 2, 64), False, (40, None), True, True),
  (Shape(1, 192, 192, 2, 1, 64), False, None, False, False),
]


@pytest.mark.timeout(_TIMEOUT_S)
@pytest.mark.parametrize(
  "shape,causal,window,sinks,contiguous",
  CASES,
  ids=["packed-causal-gqa", "padded-window-sinks", "interleaved-ids"],
)
def test_interpret_forward_against_float64_golden(
  shape, causal, window, sinks, contiguous, rng, key
):
  q, k, v, dout = random_inputs(key, shape, jnp.bfloat16)
  b, sq, skv = shape.batch, shape.seq_q, shape.seq_kv
  q_ids = np.sort(rng.integers(0, 4, (b, sq)), axis=1).astype(np.int32)
  kv_ids = np.sort(rng.integers(0, 4, (b, skv)), axis=1).astype(np.int32)
  q_ids[:, -7:] = -1  # padded queries
  if not contiguous:  # every id's keys in two runs
    kv_ids = np.broadcast_to(np.arange(skv) % 3, (b, skv)).astype(np.int32)
  snk = jnp.linspace(-1.0, 1.0, shape.heads_q) if sinks else None
  options = dict(causal=causal, window_size=window, segment_ids=(q_ids, kv_ids))
  out, lse = pallas_fa3.flash_attention(
    q, k, v, sinks=snk, return_lse=True, implementation="interpret", **options
  )
  golden, naive = golden_and_naive(q, k, v, dout, sinks=snk, **options)
  for name, g, n, gold in zip(("out", "lse"), (out, lse), naive, golden):
    assert_within_tolerance(name, g, n, gold)
  assert not np.any(np.asarray(out[:, -7:], np.float32))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_grad_through_mosaic_lowers_with_segment_ids(head_dim):
  q = jax.ShapeDtypeStruct((2, 512, 4, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 640, 2, head_dim), jnp.bfloat16)
  q_ids = jax.ShapeDtypeStruct((2, 512), jnp.int32)
  kv_ids = jax.ShapeDtypeStruct((2, 640), jnp.int32)

  def loss(q, k, v, q_ids, kv_ids):
    out = pallas_fa3.flash_attention(
      q, k, v, causal=True, segment_ids=(q_ids, kv_ids), implementation="mosaic"
    )
    return out.astype(jnp.float32).sum()

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    exported = export.export(
      jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["cuda"]
    )(q, kv, kv, q_ids, kv_ids)
  # The forward kernel; the gradients by the blockwise recomputation, said.
  assert_lowered_attention(
    exported.mlir_module(), kernels=1, seq_q=512, seq_kv=640
  )
  assert any("segment_ids" in str(w.message) for w in caught)
