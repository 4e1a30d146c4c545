"""A pytest plugin: a test whose xdist worker crashes runs once more.

XLA's CPU compiler has segfaulted in long-lived CI workers (three times,
each inside `backend_compile_and_load`: a test's bf16 golden, a GPT decode
program) where the same test passes alone and in its own file. A test
whose worker crashes runs again on the fresh worker xdist starts; a second
crash fails it, and the run's summary names every crash.
(tests/test_crash_rerun.py runs it on tests that crash.)
"""

from __future__ import annotations

import pytest

_CRASHES: dict[str, int] = {}


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
  _CRASHES[crashitem] = _CRASHES.get(crashitem, 0) + 1
  if _CRASHES[crashitem] == 1:
    sched.mark_test_pending(crashitem)
    report.outcome = "rerun"


def pytest_report_teststatus(report, config):
  if report.outcome == "rerun":
    return "rerun", "R", ("RERUN (its worker crashed)", {"yellow": True})
  return None


def pytest_terminal_summary(terminalreporter):
  for nodeid, n in _CRASHES.items():
    terminalreporter.write_line(
      f"worker crash while running {nodeid}: "
      + ("ran again on a fresh worker" if n == 1 else "crashed again: failed"),
      yellow=True,
    )
