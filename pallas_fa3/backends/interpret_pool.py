"""Enough XLA CPU threads for the Pallas GPU interpreter not to deadlock: its
warpgroups' blocking host callbacks can hold every thread of XLA's CPU pool
(one per core unless `PJRT_NPROC` says otherwise), and the pool is sized
once and slows ordinary CPU work when larger, so nothing here resizes it
behind a caller's back: `reserve()` asks for enough threads before JAX's
first computation, and `check()` makes an interpret call on too small a
pool raise instead of hang: docs/design_notes.md#the-interpreters-thread-pool.
"""

from __future__ import annotations

import os

# Most warpgroups an interpreted kernel runs: the quantization kernel at
# 256 rows (4); the attention kernels run 2 consumers and a producer.
MAX_WARPGROUPS = 4
# Each warpgroup may hold a pool thread while blocked, the enclosing
# program holds one, and one more keeps the non-blocking work moving.
REQUIRED_THREADS = MAX_WARPGROUPS + 2

# XLA reads these, in this order, for its CPU pool size (else the cores).
_POOL_ENV = ("PJRT_NPROC", "NPROC")


def pool_threads() -> int:
  """The size of XLA's CPU thread pool by XLA's own rule: `PJRT_NPROC`, then
  `NPROC`, else the cores this process may run on. (Read from the
  environment now: right unless it changed after JAX created its client.)"""
  for name in _POOL_ENV:
    value = os.environ.get(name, "")
    if value.strip().isdigit():
      return int(value)
  return len(os.sched_getaffinity(0))


def _backends_initialized() -> bool:
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top

  return xla_bridge.backends_are_initialized()


def reserve() -> bool:
  """Asks XLA for a CPU pool of `REQUIRED_THREADS` threads if it would be
  smaller, when JAX has not created its clients yet. Returns whether the
  pool is (or will be) large enough for interpret mode."""
  if pool_threads() >= REQUIRED_THREADS:
    return True
  if _backends_initialized():
    return False
  os.environ["PJRT_NPROC"] = str(REQUIRED_THREADS)
  return True


def shortfall() -> str | None:
  """Why interpret mode could deadlock in this process, or None."""
  threads = pool_threads()
  if threads >= REQUIRED_THREADS:
    return None
  return (
    f"XLA's CPU thread pool has {threads} threads and the Pallas GPU"
    f" interpreter needs {REQUIRED_THREADS}: its warpgroups block in host"
    " callbacks on that pool and can deadlock with fewer. Set"
    f" PJRT_NPROC={REQUIRED_THREADS} in the environment, or call"
    " pallas_fa3.backends.interpret_pool.reserve(), before JAX's first"
    " computation"
  )


def check() -> None:
  """Raises RuntimeError, saying how to fix it, when the pool is too small
  for interpret mode (called as an interpret call is traced)."""
  reason = shortfall()
  if reason:
    raise RuntimeError(
      f"implementation='interpret' cannot run safely: {reason}"
    )
