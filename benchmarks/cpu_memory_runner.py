"""Parent side of `cpu_memory.py`: environment header, cases in subprocesses.

`run_case(case)` runs one case as two fresh `cpu_memory.py --worker`
subprocesses (memory with a fixed mmap threshold, then timing) and merges
their results; `environment` describes the machine for the JSON output.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time

from cpu_memory_worker import REPO_ROOT

# The script whose `--worker` mode runs one case; it prints its result JSON
# on one line after this tag.
SCRIPT = os.path.join(
  os.path.dirname(os.path.abspath(__file__)), "cpu_memory.py"
)
RESULT_TAG = "CPU_MEMORY_RESULT_JSON:"


def environment(argv: list[str]) -> dict:
  """The JSON's environment header: date, machine, versions, git, command."""

  def version(pkg):
    try:
      return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
      return None

  cpu_model = None
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu_model = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  mem_total = None
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemTotal:"):
          mem_total = int(line.split()[1]) * 1024
  except OSError:
    pass
  git = {}
  try:
    git["commit"] = subprocess.run(
      ["git", "rev-parse", "HEAD"],
      cwd=REPO_ROOT,
      capture_output=True,
      text=True,
      check=True,
    ).stdout.strip()
    git["dirty_pallas_fa3"] = bool(
      subprocess.run(
        ["git", "status", "--porcelain", "pallas_fa3"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
      ).stdout.strip()
    )
  except (OSError, subprocess.CalledProcessError):
    pass
  return dict(
    date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    platform=platform.platform(),
    machine=platform.machine(),
    cpu_model=cpu_model,
    cpu_count=os.cpu_count(),
    cpu_affinity=len(os.sched_getaffinity(0)),
    mem_total_gib=None if mem_total is None else round(mem_total / 2**30, 1),
    python=platform.python_version(),
    jax=version("jax"),
    jaxlib=version("jaxlib"),
    numpy=version("numpy"),
    git=git,
    command=shlex.join([sys.executable] + argv),
    xla_flags=os.environ.get("XLA_FLAGS"),
  )


def _run_worker(case: dict, timeout_s: float, extra_env: dict) -> dict:
  """One role of `case` in a fresh `cpu_memory.py --worker` subprocess."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
    p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p
  )
  env.update(extra_env)
  cmd = [
    sys.executable,
    SCRIPT,
    "--worker",
    json.dumps(case),
  ]
  t0 = time.perf_counter()
  try:
    proc = subprocess.run(
      cmd, capture_output=True, text=True, timeout=timeout_s, env=env
    )
  except subprocess.TimeoutExpired:
    return dict(
      case=case, error=f"{case['role']}: timed out after {timeout_s:.0f} s"
    )
  wall = time.perf_counter() - t0
  for line in proc.stdout.splitlines():
    if line.startswith(RESULT_TAG):
      res = json.loads(line[len(RESULT_TAG) :])
      res["subprocess_wall_s"] = wall
      return res
  tail = (proc.stderr or proc.stdout)[-2000:]
  return dict(
    case=case,
    error=f"{case['role']} worker exit code {proc.returncode}: {tail}",
  )


def run_case(case: dict, timeout_s: float, mmap_threshold: int | None) -> dict:
  """Two fresh subprocesses: memory (fixed mmap threshold), then timing."""
  extra = (
    {}
    if not mmap_threshold
    else {"MALLOC_MMAP_THRESHOLD_": str(mmap_threshold)}
  )
  mem = _run_worker(dict(case, role="memory"), timeout_s, extra)
  if "error" in mem or "skipped" in mem:
    return dict(mem, case=case, memory=mem, timing=None)
  tim = _run_worker(dict(case, role="time"), timeout_s, {})
  merged = dict(
    case=case,
    memory=mem,
    timing=tim,
    compiled=mem["compiled"],
    hwm_reset_ok=mem["hwm_reset_ok"],
    hwm_note=mem["hwm_note"],
  )
  for key in ("peak_delta_first_kib", "peak_delta_max_kib"):
    merged[key] = mem[key]
  if "error" in tim:
    merged["error"] = tim["error"]
  else:
    for key in ("time_median_s", "time_min_s", "time_max_s", "times_s"):
      merged[key] = tim[key]
    merged["loadavg_before"] = tim["loadavg_before"]
  return merged
