"""Tier 3: the deviceless sm_90a compile of every supported kernel config.

Runs Mosaic GPU and ptxas on the CPU (no driver) and asserts zero register
spill bytes for every config the heuristics may pick. Needs
jax-cuda12-plugin, jax-cuda12-pjrt and nvidia-cuda-nvcc-cu12 at the installed
jax version; skipped, saying so, where they are absent. The same sweep as a
command: `JAX_PLATFORMS=cpu python -m pallas_fa3.kernels.aot`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pallas_fa3.kernels import aot

_needs_packages = pytest.mark.skipif(aot.missing_packages() is not None,
                                     reason=str(aot.missing_packages()))


def test_ptxas_report_parser():
  text = ("ptxas info    : Function properties for k\n"
          "    0 bytes stack frame, 24 bytes spill stores, 16 bytes spill loads\n"
          "ptxas info    : Used 168 registers, used 16 barriers\n")
  assert aot._parse_ptxas(text) == (168, 24, 16)
  with pytest.raises(RuntimeError, match="no ptxas report"):
    aot._parse_ptxas("nothing here")


@_needs_packages
@pytest.mark.timeout(1200)
def test_every_supported_config_compiles_without_spills():
  # A fresh process: the CUDA plugin must see JAX_PLATFORMS=cpu at start-up.
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  run = subprocess.run([sys.executable, "-m", "pallas_fa3.kernels.aot"],
                       env=env, capture_output=True, text=True, timeout=1100)
  assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
  assert "0 config(s) spill" in run.stdout
