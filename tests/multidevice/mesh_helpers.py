"""Shared by the multi-device suites: the device guard, meshes, HLO and tolerance checks."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from pallas_fa3.testing import max_abs_err, tolerance

NUM_DEVICES = 8

# Collective ops of XLA's HLO text, by the name they print under.
ALL_GATHER, ALL_TO_ALL, PERMUTE = (
  "all-gather",
  "all-to-all",
  "collective-permute",
)
ALL_REDUCE, REDUCE_SCATTER = "all-reduce", "reduce-scatter"
ALL_COLLECTIVES = (ALL_GATHER, ALL_TO_ALL, PERMUTE, ALL_REDUCE, REDUCE_SCATTER)

NAMES = ("out", "lse", "dq", "dk", "dv")


def require_devices() -> None:
  """Skips the calling module unless JAX sees 8 devices."""
  if jax.device_count() < NUM_DEVICES:
    pytest.skip(
      f"needs {NUM_DEVICES} devices, JAX sees {jax.device_count()}; run"
      " through tests/test_scale_out.py, or set XLA_FLAGS="
      f"--xla_force_host_platform_device_count={NUM_DEVICES} JAX_PLATFORMS=cpu",
      allow_module_level=True,
    )


def mesh(shape: tuple[int, ...], names: tuple[str, ...], explicit=False):
  """A mesh over the first prod(shape) devices, Auto axes unless `explicit`."""
  kind = AxisType.Explicit if explicit else AxisType.Auto
  devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
  return jax.sharding.Mesh(devices, names, axis_types=(kind,) * len(names))


def collectives(hlo_text: str) -> dict[str, int]:
  """How many instructions of each collective kind a compiled HLO text has."""
  counts = {}
  for kind in ALL_COLLECTIVES:
    # "= f32[...] all-gather(" or an async "all-gather-start(".
    counts[kind] = sum(
      1
      for line in hlo_text.splitlines()
      if f" {kind}(" in line or f" {kind}-start(" in line
    )
  return counts


def assert_same_within_rule(name, got, single, naive, golden) -> None:
  """The tolerance rule for `got`, and |got - single| within the same bound
  plus one unit in the last place of `single`'s dtype at its largest
  entry: the ring and Ulysses add per-step (per-copy) gradients, each
  rounded to the input dtype, in float32, where one device has a single
  float32 sum, so a value near a rounding midpoint can round to the two
  neighbours (3 of 25 seeds of check_ring_segments' full-cross-padded dV,
  each both within the rule of the golden: benchmarks/RESULTS.md)."""
  bound = tolerance(naive, golden)
  err_golden = max_abs_err(got, golden)
  err_single = max_abs_err(got, single)
  assert err_golden <= bound, (
    f"{name}: max|got - golden| = {err_golden:.3g} exceeds 2 x naive error"
    f" + floor = {bound:.3g}"
  )
  ulp = _ulp(single)
  assert err_single <= bound + ulp, (
    f"{name}: max|got - single device| = {err_single:.3g} exceeds the"
    f" rule's bound {bound:.3g} + one ulp {ulp:.3g}"
  )


def _ulp(x) -> float:
  """The spacing of `x`'s dtype at its largest finite magnitude."""
  x = np.abs(np.asarray(x))
  return float(np.spacing(x[np.isfinite(x)].max(initial=0)))
