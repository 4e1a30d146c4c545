"""The device check, rehearsed on a CPU (`benchmarks/device_check.sh`).

On a machine without a Hopper GPU every GPU step runs its rehearsal (the
same command lines with zero time budgets, test collection), so this checks
the script's syntax, that everything it runs imports under this JAX, that a
hung step is killed at its limit with the rest still run, and that every
step leaves its files. Skipped on a Hopper GPU, where the script is the
real thing (minutes of GPU time).
"""

from __future__ import annotations

import csv
import json
import os
import pathlib
import subprocess
import sys

import pytest

from pallas_fa3 import backends

_ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(
  backends.hopper_reason() is None,
  reason="on a Hopper GPU the script is the real check",
)
@pytest.mark.parametrize(
  "quick",
  [True, pytest.param(False, marks=pytest.mark.slow)],  # same steps, longer
  ids=["quick", "full"],
)
@pytest.mark.timeout(300)
def test_device_check_rehearsal_kills_a_hung_step(tmp_path, quick):
  env = dict(
    os.environ,
    OUT=str(tmp_path),
    PYTHON=sys.executable,
    DEVICE_CHECK_SELFTEST="1",
    JAX_PLATFORMS="cpu",
  )
  cmd = ["bash", str(_ROOT / "benchmarks" / "device_check.sh")]
  run = subprocess.run(
    cmd + (["--quick"] if quick else []),
    env=env,
    capture_output=True,
    text=True,
    timeout=280,
  )
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  with open(tmp_path / "steps.tsv") as f:
    steps = {r["step"]: r for r in csv.DictReader(f, delimiter="\t")}
  hang = steps.pop("selftest_hang")
  assert hang["exit"] == "124" and int(hang["seconds"]) < 15
  assert list(steps) == [
    "versions",
    "smoke",
    "causal",
    "gpu_tests",
    "bench_fwd",
    "bench_bwd",
    "decode",
    "decode_mla",
    "decode_modes",
    "varlen",
    "ragged_decode",
    "jvp",
    "fp8_speed",
    "grid",
    "headline",
  ]
  # The smoke step's own hung item (DEVICE_CHECK_SELFTEST) is killed at
  # its timeout and reported as a hang: the step fails, the rest run.
  assert steps.pop("smoke")["exit"] == "1"
  assert all(r["exit"] == "0" for r in steps.values()), steps
  smoke = {
    r["item"]: r for r in json.loads((tmp_path / "smoke.json").read_text())
  }
  assert smoke.pop("selftest hang")["status"] == "hang"
  assert smoke and all(r["status"] == "skipped" for r in smoke.values())
  for name in (
    "versions.json",
    "smoke.json",
    "causal.json",
    "headline.md",
    "bench_fwd/results.json",
    "bench_bwd/results.json",
    "decode/results.json",
    "decode_modes/results.json",
    "varlen/varlen.json",
    "fp8/fp8.json",
    "grid/grid.json",
  ):
    assert (tmp_path / name).exists(), name
  assert "collected" in (tmp_path / "gpu_tests.txt").read_text()
  # The decode step's cases (the GPU grid's headline points) are listed.
  headline = (tmp_path / "headline.md").read_text()
  assert "Decoding" in headline and "b64 L8192 32/8 d128" in headline
  # issue 67's rows: q_len 4, 8, 16, batch-invariant and flex decode
  modes = json.loads((tmp_path / "decode_modes/results.json").read_text())
  names = {r["spec"] for r in modes["records"]}
  for part in ("-q4-", "-q8-", "-q16-", "-invariant", "-alibi_doc"):
    assert any(part in n for n in names), (part, names)
  # issue 68's rows: the varlen table and the ragged call's timing
  assert "ours varlen" in (tmp_path / "varlen/varlen.md").read_text()
  assert "ragged call" in (tmp_path / "ragged_decode.txt").read_text()
