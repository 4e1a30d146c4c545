"""Shared fixtures: the backends under test, fresh keys, and one call helper."""

from __future__ import annotations

import itertools
import zlib

import jax
import jax.numpy as jnp
import pytest

import pallas_fa3
from pallas_fa3 import backends
from pallas_fa3.spec import make_spec

# Every backend runs the same suite; one that cannot serve a call is skipped
# with its own reason (the kernels' backends until their issues land, or
# `mosaic` without a Hopper GPU), so the suite switches them on by itself.
ALL_IMPLEMENTATIONS = ("blockwise", "reference", "interpret", "mosaic")

_counter = itertools.count()


@pytest.fixture
def key(request):
  """A fresh PRNG key per test, derived from the test's id (reproducible)."""
  seed = zlib.crc32(request.node.nodeid.encode()) + next(_counter)
  return jax.random.key(seed % (2**31))


# GPU interpret mode simulates every warpgroup, barrier and copy in Python:
# each call costs a compile of the emulation plus seconds per CTA on a CPU,
# three kernels (forward, dK/dV, dQ) per case with gradients.
# The shared suite runs it on the shapes with at most this many CTAs; the
# kernel's own interpret tests (test_sm90_fwd.py) cover ragged, causal, GQA,
# head dims and ring wrapping at small sizes.
_INTERPRET_MAX_CTAS = 2


def _interpret_ctas(spec) -> int:
  config = backends.get("interpret").default_config(spec)
  return spec.batch * spec.heads_q * -(-spec.seq_q // config.rows_per_cta)


def skip_if_unsupported(implementation: str, q, k, v, causal=False,
                        softmax_scale=None):
  spec = make_spec(q, k, v, causal=causal, softmax_scale=softmax_scale)
  backend = backends.get(implementation)
  reason = backend.device_reason() or backend.unsupported(spec)
  if reason:
    pytest.skip(f"{implementation}: {reason}")
  if implementation == "interpret" and (
      ctas := _interpret_ctas(spec)) > _INTERPRET_MAX_CTAS:
    pytest.skip(f"interpret: {ctas} CTAs is minutes of CPU emulation (the"
                f" shared suite runs at most {_INTERPRET_MAX_CTAS})")


def forward_and_grads(implementation, q, k, v, dout, *, causal=False,
                      softmax_scale=None, config=None, dlse=None):
  """Jitted (out, lse, dq, dk, dv) of `flash_attention` for cotangents (dout, dlse)."""

  @jax.jit
  def run(q, k, v, dout, dlse):
    f = lambda q, k, v: pallas_fa3.flash_attention(
        q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True,
        implementation=implementation, config=config)
    (out, lse), pullback = jax.vjp(f, q, k, v)
    dlse = jnp.zeros_like(lse) if dlse is None else dlse
    return (out, lse) + tuple(pullback((dout, dlse)))

  return run(q, k, v, dout, dlse)
