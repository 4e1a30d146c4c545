"""`pallas-fa3 bench` on a busy machine: each case's fastest call is
reported beside its median, a wide spread is flagged and warned of (issue
64: a forward printed slower than its forward+backward, min 92 ms vs median
151 ms, without a word), and cheap cases take more calls. Synthetic
timings: nothing is compiled or run."""

import pytest

from pallas_fa3.tools import cli
from pallas_fa3.tools.bench import (
  command,
  impls,
  report,
  runner,
  specs,
  terminal,
  timing,
)


def _timed(mode: str, min_ms: float, median_ms: float, runs: int = 3):
  """A blockwise record of a CPU-sweep-like case, timed as given."""
  spec = specs.BenchSpec(
    f"{mode}-s2048", 1, 2048, 2048, 2, 2, 64, False, "bf16", mode
  )
  rec = runner._base_record(impls.REGISTRY["blockwise"], spec)  # pylint: disable=protected-access
  rec.update(
    status="ok",
    time_min_ms=min_ms,
    time_median_ms=median_ms,
    time_max_ms=median_ms * 1.1,
    runs=runs,
    tflops=rec["flops"] / (median_ms * 1e-3) / 1e12,
    temp_mib=4.5,
  )
  return rec


def _result(records: list[dict]) -> dict:
  env = dict(device="cpu cpu", jax="0.11.2", jaxlib="0.11.2", date="today")
  env.update(platform_version=None, git_commit=None, command="pallas-fa3")
  return dict(
    records=records,
    settings=dict(runs=3),
    matmul_peak_tflops=None,
    sweep_wall_s=1.0,
    environment=env,
  )


def test_a_busy_machines_spread_is_flagged_and_warned_of():
  # The run: the forward's median (151 ms) above the forward+
  # backward's, its fastest call 92 ms.
  busy = _timed("fwd", 92.0, 151.0)
  quiet = _timed("fwd+bwd", 120.0, 125.0, runs=5)
  result = _result([busy, quiet])
  assert report.spread(busy) == pytest.approx(151 / 92)
  assert report.noisy(result["records"]) == [busy]

  text = terminal.text(result, "blockwise")
  flat = " ".join(text.split())
  assert f"more than {report.NOISY_SPREAD:g}x the fastest" in flat, text
  assert "in 1 of 2 cases" in flat, text
  assert "blockwise fwd-s2048: min 92 ms, median 151 ms" in flat, text
  assert "fwd+bwd-s2048: min" not in flat, text
  # The noisy cell is marked; the other is not.
  rows = [line for line in text.splitlines() if line.startswith("64 ")]
  assert [r.endswith("*") for r in rows] == [True, False], text
  assert "fwd bf16: GFLOP/s, median of 3 runs" in text, text
  assert "fwd+bwd bf16: GFLOP/s, median of 5 runs" in text, text
  assert max(map(len, text.splitlines())) <= terminal.WIDTH

  md = report.markdown(result, "blockwise")
  assert "(noisy) (151 ms, min 92)" in md, md
  assert "(125 ms, min 120)" in md, md
  assert "**Noisy timings: in 1 of 2 cases" in md, md
  assert "median and fastest ms of 3-5 runs" in md, md


def test_no_warning_where_the_spread_is_narrow():
  result = _result([_timed("fwd", 10.0, 11.0), _timed("fwd+bwd", 30, 31)])
  assert report.noise_warning(result["records"]) is None
  text = terminal.text(result, "blockwise")
  assert "Noisy" not in text and "*" not in text, text
  assert "Noisy" not in report.markdown(result, "blockwise")
  # Records of older runs (no min, no run count) are not judged.
  old = _timed("fwd", 10.0, 50.0)
  del old["time_min_ms"], old["runs"]
  assert report.spread(old) is None
  assert report.runs_label([old], 3) == "3"


class _Clock:
  """time.perf_counter for `time_calls`: each timed call takes `call_s`."""

  def __init__(self, call_s: float):
    self.now, self.call_s, self.reads = 0.0, call_s, 0

  def __call__(self) -> float:
    self.reads += 1
    if self.reads % 2 == 0:  # the read after a call
      self.now += self.call_s
    return self.now


@pytest.mark.parametrize(
  "call_s,cheap_s,calls",
  [
    (0.01, timing.CHEAP_S, 3 * timing.MORE_RUNS),  # cheap: up to 5x runs
    (0.06, 0.25, 5),  # until the calls add up to 0.25 s
    (0.1, 0.25, 3),  # 3 calls are 0.3 s: no more
    (0.01, 0.0, 3),  # --runs given: exactly its runs
  ],
)
def test_cheap_cases_take_more_calls(monkeypatch, call_s, cheap_s, calls):
  monkeypatch.setattr(timing.time, "perf_counter", _Clock(call_s))
  got = []
  times = timing.time_calls(
    lambda *args: got.append(args), [(1,), (2,)], 0, 3, cheap_s
  )
  assert len(times) == calls == len(got)
  assert got[:3] == [(1,), (2,), (1,)]  # the input sets rotate
  assert times == pytest.approx([call_s] * calls)


def test_more_calls_only_where_runs_is_unset():
  def settings(*argv):
    args = cli.build_parser().parse_args(["bench", *argv])
    return command.settings_from(args, "cpu")

  assert settings()["cheap_s"] == timing.CHEAP_S
  assert settings()["runs"] == runner.DEFAULT_RUNS["cpu"]
  assert settings("--runs", "3")["cheap_s"] == 0.0
