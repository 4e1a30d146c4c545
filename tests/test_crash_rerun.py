"""tests/crash_rerun.py: a test whose xdist worker crashes once passes on
its rerun (said in the summary); one that crashes twice fails."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

_HERE = pathlib.Path(__file__).resolve().parent
_TESTS = """
import os, pathlib, signal

def test_crashes_once():
  marker = pathlib.Path(os.environ["CRASH_MARKER"])
  if not marker.exists():
    marker.write_text("crashed")
    os.kill(os.getpid(), signal.SIGSEGV)

def test_crashes_always():
  if os.environ.get("CRASH_ALWAYS") == "1":
    os.kill(os.getpid(), signal.SIGSEGV)
"""


def _run(tmp_path: pathlib.Path, always: bool) -> subprocess.CompletedProcess:
  (tmp_path / "test_crashing.py").write_text(_TESTS)
  env = dict(
    os.environ,
    PYTHONPATH=str(_HERE),
    CRASH_MARKER=str(tmp_path / "marker"),
    CRASH_ALWAYS="1" if always else "0",
  )
  cmd = [sys.executable, "-m", "pytest", "-n", "2", "-p", "crash_rerun"]
  cmd += ["-p", "no:cacheprovider", "-q", "test_crashing.py"]
  return subprocess.run(
    cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
  )


def test_a_test_that_crashes_once_passes_on_its_rerun(tmp_path):
  run = _run(tmp_path, always=False)
  assert run.returncode == 0, run.stdout[-2000:]
  assert "2 passed, 1 rerun" in run.stdout
  assert "test_crashes_once: ran again on a fresh worker" in run.stdout


def test_a_test_that_crashes_twice_fails(tmp_path):
  run = _run(tmp_path, always=True)
  assert run.returncode == 1, run.stdout[-2000:]
  assert "FAILED test_crashing.py::test_crashes_always" in run.stdout
  assert "test_crashes_always: crashed again: failed" in run.stdout
