"""Shared fixtures: the backends under test, fresh keys, and one call helper."""

from __future__ import annotations

import itertools
import os
import zlib

# The suite runs in parallel (pytest -n auto): on a GPU, workers share it, so
# none may take XLA's default 75% of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Most of the suite's time is XLA compiling small programs that run once:
# LLVM at -O0 (the HLO passes, fusion and collectives are unchanged) cuts a
# test's time by 20-35% on a CPU. Set before JAX reads it, so subprocesses
# (the multi-device suites, the CLI) inherit it; override with false.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "true")

from pallas_fa3.backends import interpret_pool  # starts no JAX backend

# The interpret-mode tests need more XLA CPU threads than a 2-core machine
# has by default (else the interpreter's warpgroups can deadlock): asked for
# before JAX creates its CPU client. The 8-device suites run no kernel in
# interpret mode and are 9% faster without (tests/test_scale_out.py).
if os.environ.get("PALLAS_FA3_TESTS_NO_INTERPRET") != "1":
  assert interpret_pool.reserve(), interpret_pool.shortfall()

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position

# In case a plugin imported JAX before the variable above was set.
jax.config.update(
  "jax_disable_most_optimizations",
  os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"].lower() in ("1", "true"),
)
import jax.numpy as jnp
import numpy as np
import pytest
from slow_cases import SLOW_CASES

# A test whose xdist worker crashes runs once more (tests/crash_rerun.py).
pytest_plugins = ["crash_rerun"]

import pallas_fa3
from pallas_fa3 import backends
from pallas_fa3.spec import make_spec
from pallas_fa3.testing import Shape

# Every backend runs the same suite; one that cannot serve a call is skipped
# with its own reason (`mosaic` without a Hopper GPU), so the suite switches
# them on by itself. `interpret` (the kernels emulated on a CPU, seconds per
# CTA) is left to the kernels' own tests (tests/test_sm90_*.py: ragged,
# causal, GQA, head dims, ring wrapping, gradients through the API).
ALL_IMPLEMENTATIONS = ("blockwise", "reference", "mosaic")

_counter = itertools.count()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by mark
def pytest_collection_modifyitems(config, items):
  """Marks `slow_cases.SLOW_CASES` slow; an entry whose test function was
  collected but not the case itself is a stale name: an error."""
  ids = {item.nodeid for item in items}
  functions = {i.split("[")[0] for i in ids}
  stale = [
    c for c in SLOW_CASES if c.split("[")[0] in functions and c not in ids
  ]
  if stale:
    raise pytest.UsageError(f"tests/slow_cases.py names no case: {stale}")
  for item in items:
    if item.nodeid in SLOW_CASES:
      item.add_marker(pytest.mark.slow)
  # The modules of the longest tests (the 8-device subprocess, the aot
  # tier's compile, the device-check rehearsal: 45-160 s each) run first,
  # whole (their module fixtures once): with `--dist worksteal` the other
  # worker then shares the short tests left at the end instead of waiting
  # on a long one that started late.
  items.sort(key=lambda i: i.nodeid.split("::")[0] not in _LONG_MODULES)


_LONG_MODULES = (
  "tests/test_scale_out.py",
  "tests/test_sm90_aot.py",
  "tests/test_device_check.py",
)


@pytest.fixture
def key(request):
  """A fresh PRNG key per test, derived from the test's id (reproducible)."""
  seed = zlib.crc32(request.node.nodeid.encode()) + next(_counter)
  return jax.random.key(seed % (2**31))


@pytest.fixture
def rng(request) -> np.random.Generator:
  """Fresh numpy inputs per test, seeded by the test's id (reproducible).

  numpy, not jax.random: eager jax.random compiles once per new shape, which
  costs more than the whole test on a small CPU.
  """
  return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def skip_if_unsupported(
  implementation: str, q, k, v, causal=False, softmax_scale=None
):
  spec = make_spec(q, k, v, causal=causal, softmax_scale=softmax_scale)
  backend = backends.get(implementation)
  reason = backend.device_reason() or backends.unsupported_reason(
    implementation, spec
  )
  if reason:
    pytest.skip(f"{implementation}: {reason}")


def forward_and_grads(
  implementation,
  q,
  k,
  v,
  dout,
  *,
  causal=False,
  softmax_scale=None,
  config=None,
  dlse=None,
  deterministic=False,
):
  """Jitted (out, lse, dq, dk, dv) of `flash_attention` for cotangents (dout, dlse)."""

  @jax.jit
  def run(q, k, v, dout, dlse):
    f = lambda q, k, v: pallas_fa3.flash_attention(
      q,
      k,
      v,
      causal=causal,
      softmax_scale=softmax_scale,
      return_lse=True,
      implementation=implementation,
      config=config,
      deterministic=deterministic,
    )
    (out, lse), pullback = jax.vjp(f, q, k, v)
    dlse = jnp.zeros_like(lse) if dlse is None else dlse
    return (out, lse) + tuple(pullback((dout, dlse)))

  return run(q, k, v, dout, dlse)


def case_id(*parts) -> str:
  """The one pytest id format: shapes as `Shape` prints them, dtypes by name,
  sm90 tilings as `64x128x2` (backward: plus consumers/splits), head dims as
  `d128`, other values by `str`; parts joined with "-".

  Usable as `ids=case_id` (one part per parameter) or called with several.
  """
  return "-".join(_part_id(p) for p in parts)


def _part_id(value) -> str:
  if isinstance(value, Shape):
    return str(value)
  if isinstance(value, pallas_fa3.Sm90BackwardConfig):
    c = value
    return (
      f"{c.block_q}x{c.block_kv}x{c.num_stages}-c{c.dkdv_consumers}"
      f"h{c.dkdv_head_splits}q{c.dq_consumers}h{c.dq_head_splits}"
    )
  if isinstance(value, pallas_fa3.Sm90ForwardConfig):
    tiles = f"{value.block_q}x{value.block_kv}x{value.num_stages}"
    return tiles + ("" if value.overlap else "-serial")
  if isinstance(value, bool):
    return "causal" if value else "full"
  if isinstance(value, int):
    return f"d{value}"
  try:
    return jnp.dtype(value).name
  except TypeError:
    return getattr(value, "__name__", None) or str(value)
