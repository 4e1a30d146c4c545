"""Tier 3: the deviceless sm_90a compile of every supported kernel config.

Runs Mosaic GPU and ptxas on the CPU (no driver) and asserts zero register
spill bytes for every config the heuristics may pick. Needs
jax-cuda12-plugin, jax-cuda12-pjrt and nvidia-cuda-nvcc-cu12 at the installed
jax version; skipped, saying so, where they are absent. The same sweep as a
command: `JAX_PLATFORMS=cpu python -m pallas_fa3.kernels.aot`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pallas_fa3.kernels import aot

_needs_packages = pytest.mark.skipif(aot.missing_packages() is not None,
                                     reason=str(aot.missing_packages()))


def test_ptxas_report_parser():
  text = ("ptxas warning : Registers are spilled to local memory in function"
          " 'k', 24 bytes spill stores, 16 bytes spill loads\n"
          "ptxas info    : Function properties for k\n"
          "    0 bytes stack frame, 24 bytes spill stores, 16 bytes spill loads\n"
          "ptxas info    : Used 168 registers, used 16 barriers\n")
  assert aot._parse_ptxas(text) == (168, 24, 16)
  with pytest.raises(RuntimeError, match="no ptxas report"):
    aot._parse_ptxas("nothing here")


@pytest.fixture(scope="module")
def sweep_reports(tmp_path_factory):
  # A fresh process: the CUDA plugin must see JAX_PLATFORMS=cpu at start-up.
  out = tmp_path_factory.mktemp("aot") / "reports.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  run = subprocess.run([sys.executable, "-m", "pallas_fa3.kernels.aot",
                        "--json", str(out)], env=env, capture_output=True,
                       text=True, timeout=1700)
  assert out.exists(), run.stdout[-4000:] + run.stderr[-4000:]
  return {r["name"]: r for r in json.loads(out.read_text())}


def _spills(reports, prefix):
  return {n: (r["spill_store_bytes"], r["spill_load_bytes"])
          for n, r in reports.items() if n.startswith(prefix)
          and (r["spill_store_bytes"] or r["spill_load_bytes"])}


@_needs_packages
@pytest.mark.timeout(1800)
def test_every_forward_config_compiles_without_spills(sweep_reports):
  assert any(n.startswith("fwd") for n in sweep_reports)
  assert _spills(sweep_reports, "fwd") == {}


@_needs_packages
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_every_backward_config_compiles_without_spills(sweep_reports, head_dim):
  prefix = f"bwd d={head_dim} "
  assert any(n.startswith(prefix) for n in sweep_reports)
  assert _spills(sweep_reports, prefix) == {}
