"""Interpret mode and XLA's CPU thread pool: too small a pool raises (eager
and traced) instead of deadlocking; `reserve()` sizes it before JAX starts
and cannot once it has (docs/design_notes.md#the-interpreters-thread-pool).
"""

from __future__ import annotations

import os
import subprocess
import sys

from pallas_fa3.backends import interpret_pool

_SMALL_POOL = """
import jax, jax.numpy as jnp, pallas_fa3
q = jnp.ones((1, 64, 1, 64), jnp.bfloat16)
for name, f in [
  ("eager", lambda: pallas_fa3.flash_attention(q, q, q, implementation="interpret")),
  ("jit", lambda: jax.jit(lambda q: pallas_fa3.flash_attention(
      q, q, q, implementation="interpret"))(q)),
]:
  try:
    f()
    print(name, "ran")
  except Exception as e:
    print(name, type(e).__name__, "PJRT_NPROC=6" in str(e))
"""


def _python(code: str, **env: str) -> str:
  run = subprocess.run(
    [sys.executable, "-c", code],
    env=dict(os.environ, JAX_PLATFORMS="cpu", **env),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert run.returncode == 0, run.stderr[-3000:]
  return run.stdout


def test_too_small_a_pool_raises_naming_the_fix():
  out = _python(_SMALL_POOL, PJRT_NPROC="2")
  assert "eager NotImplementedError True" in out, out
  assert "jit RuntimeError True" in out, out


def test_reserve_before_and_after_jax_starts():
  code = (
    "import os; from pallas_fa3.backends import interpret_pool as p;"
    " print(p.reserve(), os.environ.get('PJRT_NPROC'));"
    " import jax; jax.numpy.ones(1).block_until_ready();"
    " os.environ['PJRT_NPROC'] = '2'; print(p.reserve(), p.shortfall() is None)"
  )
  env = {
    k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")
  }
  run = subprocess.run(
    [sys.executable, "-c", code],
    env=dict(env, JAX_PLATFORMS="cpu"),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert run.returncode == 0, run.stderr[-3000:]
  first, second = run.stdout.split("\n")[:2]
  if len(os.sched_getaffinity(0)) < interpret_pool.REQUIRED_THREADS:
    assert first == f"True {interpret_pool.REQUIRED_THREADS}"
  assert second == "False False"  # JAX has started: too late to resize


def test_this_suite_reserved_enough_threads():
  assert interpret_pool.shortfall() is None
