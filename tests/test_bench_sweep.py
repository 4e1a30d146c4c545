"""Tests of tiny end-to-end benchmark sweeps (bf16 and FP8): the files they
write, skip reasons, the terminal summary and the plots."""

import csv
import itertools
import json
import os
import re

import pytest

from pallas_fa3.tools import cli
from pallas_fa3.tools.bench import (
  command,
  report,
  runner,
  terminal,
)


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("bench"))
  argv = [
    "--impl",
    "blockwise",
    "reference",
    "xla",
    "cudnn",
    "mosaic",
    "interpret",
    "--dtype",
    "bf16",
    "--head-dim",
    "64",
    "--seq",
    "64",
    "128",
    "--mode",
    "fwd",
    "bwd",
    "fwd+bwd",
    "--tokens",
    "128",
    "--hidden",
    "128",
    "--runs",
    "2",
    "--warmup",
    "1",
    "--input-sets",
    "2",
    "--out",
    out,
    "--no-progress",
  ]
  assert cli.main(["bench"] + argv) == 0
  return out


def test_sweep_writes_files(tiny_sweep):
  rows = report.read_csv(os.path.join(tiny_sweep, report.CSV_FILE))
  ok = [r for r in rows if r["status"] == "ok"]
  assert {r["impl"] for r in ok} == {
    "blockwise",
    "reference",
    "xla",
    "interpret",
  }
  timed = [r for r in ok if r["impl"] != "interpret"]
  # 2 seqs x 2 causal x 3 modes, each for blockwise/reference/xla; plus the
  # one interpret correctness case, which has no speed figure.
  assert len(timed) == 2 * 2 * 3 * 3 and len(ok) == len(timed) + 1
  for r in timed:
    assert float(r["tflops"]) > 0
    assert (
      float(r["time_min_ms"])
      <= float(r["time_median_ms"])
      <= float(r["time_max_ms"])
    )
    assert float(r["temp_mib"]) >= 0
  with open(os.path.join(tiny_sweep, report.JSON_FILE)) as f:
    data = json.load(f)
  for key in ("device", "jax", "date", "command", "platform_version"):
    assert data["environment"][key]
  for r in rows:  # the environment is in every row too
    assert (r["device"], r["jax"]) == (
      data["environment"]["device"],
      data["environment"]["jax"],
    )
  assert data["ours"] == "blockwise"
  assert {r["baseline"] for r in data["ratios"]} == {"reference", "xla"}
  pngs = os.listdir(os.path.join(tiny_sweep, "plots"))
  assert {
    "gflops_fwd_bf16.png",
    "gflops_bwd_bf16.png",
    "gflops_fwd_bwd_bf16.png",
  } <= set(pngs)
  with open(os.path.join(tiny_sweep, "plots", pngs[0]), "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert (
    "| mode |" in open(os.path.join(tiny_sweep, report.MARKDOWN_FILE)).read()
  )


def test_csv_is_plain(tiny_sweep):
  # It used to start with "# key: value" lines (pandas needed comment="#"):
  # the first line is the header and every row has its column count.
  with open(os.path.join(tiny_sweep, report.CSV_FILE), newline="") as f:
    lines = list(csv.reader(f))
  header = lines[0]
  assert header[:2] == ["spec", "impl"] and "device" in header, header
  assert len(lines) > 1 and all(len(row) == len(header) for row in lines)


def test_sweep_lists_every_skip_with_reason(tiny_sweep):
  rows = report.read_csv(os.path.join(tiny_sweep, report.CSV_FILE))
  skipped = [r for r in rows if r["status"] != "ok"]
  assert all(r["reason"] for r in skipped)
  assert all(r["status"] == "skipped" for r in skipped)
  by_impl = {}
  for r in skipped:
    by_impl.setdefault(r["impl"], set()).add(r["reason"].split(":")[0])
  assert "cuDNN attention needs a GPU (default backend" in by_impl["cudnn"]
  assert by_impl["mosaic"] == {"no GPU"}
  tiny = [r for r in rows if r["impl"] == "interpret"]
  assert len(tiny) == 1 and tiny[0]["note"] == (
    "correctness only, not a speed figure"
  )
  # The kernel itself, in interpret mode: it runs and reports its error.
  assert tiny[0]["status"] == "ok", tiny[0]
  # Within the flags: the grid's shortest seq and its head dim.
  assert (tiny[0]["seq_q"], tiny[0]["head_dim"]) == ("64", "64"), tiny[0]
  assert 0 < float(tiny[0]["max_abs_err"]) < 0.05


@pytest.fixture(scope="module")
def fp8_sweep(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("bench_fp8"))
  argv = [
    "--impl",
    "blockwise",
    "reference",
    "mosaic",
    "interpret",
    "--dtype",
    "fp8",
    "--head-dim",
    "64",
    "--hidden",
    "128",
    "--seq",
    "128",
    "--causal",
    "--mode",
    "fwd",
    "bwd",
    "--tokens",
    "256",
    "--runs",
    "2",
    "--warmup",
    "1",
    "--input-sets",
    "2",
    "--out",
    out,
    "--no-progress",
    "--no-plots",
  ]
  assert cli.main(["bench"] + argv) == 0
  return report.read_csv(os.path.join(out, report.CSV_FILE))


def test_fp8_times_quantization_kernel_and_total(fp8_sweep):
  # fp8 used to be skipped as "not available yet" on every backend.
  case = {(r["impl"], r["mode"]): r for r in fp8_sweep}
  fwd = case[("blockwise", "fwd")]
  assert fwd["status"] == "ok", fwd
  total_ms, quant_ms, kernel_ms = (
    float(fwd[k]) for k in ("time_median_ms", "quantize_ms", "kernel_ms")
  )
  assert total_ms > 0 and quant_ms > 0 and kernel_ms > 0
  flop = float(fwd["flops"])
  assert float(fwd["tflops"]) == pytest.approx(flop / total_ms / 1e9)
  assert float(fwd["kernel_tflops"]) == pytest.approx(flop / kernel_ms / 1e9)
  assert float(fwd["time_min_ms"]) <= total_ms <= float(fwd["time_max_ms"])
  # The FP8 kernel in interpret mode: the correctness case, against bf16.
  tiny = case[("interpret", "fwd")]
  assert tiny["status"] == "ok" and tiny["dtype"] == "fp8", tiny
  assert tiny["note"] and 0 < float(tiny["max_abs_err"]) < 0.25, tiny


def test_fp8_skips_say_why(fp8_sweep):
  skipped = [r for r in fp8_sweep if r["status"] != "ok"]
  assert all(r["status"] == "skipped" and r["reason"] for r in skipped)
  for r in skipped:
    assert not re.search(r"not available|pending|until it lands", r["reason"])
  bwd = [r for r in skipped if r["mode"] == "bwd"]
  assert {r["impl"] for r in bwd} == {"blockwise", "reference", "mosaic"}
  for r in bwd:
    if r["impl"] != "reference":
      assert r["reason"].startswith("FP8 is forward only"), r
  for r in skipped:
    if r["impl"] == "reference":
      assert "reference has no FP8 path" in r["reason"], r


def _record(impl, mode, dtype, d, causal, seq, tflops, status="ok", **kw):
  return dict(
    spec=f"{mode}-{dtype}-s{seq}-d{d}-{causal}",
    impl=impl,
    mode=mode,
    dtype=dtype,
    head_dim=d,
    causal=causal,
    seq_q=seq,
    seq_kv=seq,
    status=status,
    reason=kw.get("reason", ""),
    tflops=tflops if status == "ok" else None,
    kernel_tflops=kw.get("kernel_tflops"),
    note=kw.get("note", ""),
    max_abs_err=kw.get("max_abs_err"),
  )


def _gpu_like_result():
  """A paper-grid-like result: every GPU implementation, fp8, long reasons."""
  records = []
  for mode, dtype, d, causal, seq in itertools.product(
    ("fwd", "fwd+bwd"), ("bf16", "fp8"), (64, 256), (False, True), (512, 16384)
  ):
    for i, impl in enumerate(runner.DEFAULT_IMPLS["gpu"]):
      fp8 = dtype == "fp8"
      if fp8 and (mode != "fwd" or impl not in ("mosaic", "blockwise")):
        records.append(
          _record(
            impl,
            mode,
            dtype,
            d,
            causal,
            seq,
            None,
            "skipped",
            reason="x " * 120,
          )
        )
      else:
        records.append(
          _record(
            impl,
            mode,
            dtype,
            d,
            causal,
            seq,
            1234.5 / (i + 1),
            kernel_tflops=(1500.25 if fp8 else None),
          )
        )
  records.append(
    _record(
      "interpret",
      "fwd",
      "bf16",
      64,
      True,
      128,
      1e-6,
      note="correctness only",
      max_abs_err=0.0078,
    )
  )
  return dict(
    records=records,
    settings=dict(runs=20),
    environment=dict(device="gpu NVIDIA H200 with a long name", jax="0.11.2"),
  )


class _Recorder:
  def __init__(self):
    self.out = []

  def print(self, *objects, **kwargs):
    del kwargs
    self.out += [str(o) for o in objects]


def test_terminal_summary_fits_80_columns(tiny_sweep):
  # The rich table used to be ~180 columns wide (a column per
  # implementation with "TF/s (ms)" cells, temp MiB and every ratio).
  gpu = _gpu_like_result()
  text = terminal.text(gpu, "mosaic")
  lines = text.splitlines()
  assert max(map(len, lines)) <= 80, "\n".join(l for l in lines if len(l) > 80)
  assert "fwd fp8: TFLOP/s, median of 20 runs; cells: total/kernel" in text
  assert "1234/1500" in text  # fp8: total/kernel
  header = next(l for l in lines if l.startswith("d "))
  assert header.split() == [
    "d",
    "causal",
    "seq",
    *runner.DEFAULT_IMPLS["gpu"],
    "speedup",
  ]
  with open(os.path.join(tiny_sweep, report.JSON_FILE)) as f:
    cpu = json.load(f)
  console = _Recorder()
  terminal.print_summary(cpu, "blockwise", console)
  printed = "\n".join(console.out).splitlines()
  assert max(map(len, printed)) <= 80
  assert any("GFLOP/s" in l for l in printed)
  assert any(l.startswith("correctness only: interpret") for l in printed)


def test_plots_name_the_device_and_show_the_spread(tiny_sweep):
  # Plots used to name no device or JAX version and show medians only.
  from matplotlib.container import ErrorbarContainer

  from pallas_fa3.tools.bench import plots

  with open(os.path.join(tiny_sweep, report.JSON_FILE)) as f:
    result = json.load(f)
  env = result["environment"]
  made = plots.figures(result["records"], env)
  assert {name for name, _ in made} >= {"gflops_fwd_bf16.png"}
  for _, fig in made:
    title = fig.get_suptitle()
    assert env["device"] in title and f"JAX {env['jax']}" in title, title
    assert "fastest to slowest" in title
    bars = [
      c
      for ax in fig.axes
      for c in ax.containers
      if isinstance(c, ErrorbarContainer)
    ]
    assert bars
    for bar in bars:
      data_line, _, (segments,) = bar.lines
      for y, seg in zip(data_line.get_ydata(), segments.get_segments()):
        lo, hi = sorted(seg[:, 1])
        assert lo <= y <= hi
  # The bars are the min/max times as rates.
  r = next(
    r for r in result["records"] if r["status"] == "ok" and not r["note"]
  )
  slow, mid, fast = plots.rate_band(r)
  assert slow == pytest.approx(r["flops"] / r["time_max_ms"] / 1e9)
  assert fast == pytest.approx(r["flops"] / r["time_min_ms"] / 1e9)
  assert slow <= mid <= fast


def test_one_unit_per_figure_named_in_the_file(tiny_sweep):
  # On a CPU the terminal said GFLOP/s, summary.md "TF/s" (0.00123) and
  # the plots GFLOP/s in files named tflops_*.png.
  with open(os.path.join(tiny_sweep, report.JSON_FILE)) as f:
    result = json.load(f)
  assert report.rate_unit(result["records"]) == ("GFLOP/s", 1e3)
  console = _Recorder()
  terminal.print_summary(result, "blockwise", console)
  printed = "\n".join(console.out)
  assert "GFLOP/s" in printed and "TFLOP" not in printed, printed
  md = open(os.path.join(tiny_sweep, report.MARKDOWN_FILE)).read()
  assert "- cells: GFLOP/s" in md and "TF/s" not in md and "TFLOP" not in md
  header = next(l for l in md.splitlines() if l.startswith("| mode |"))
  assert "| blockwise GFLOP/s (ms) |" in header, header
  # The same figure in both: a blockwise case's rate, as summary.md has it.
  fwd = next(
    r
    for r in result["records"]
    if r["impl"] == "blockwise" and r["mode"] == "fwd" and r["status"] == "ok"
  )
  assert f"| {fwd['tflops'] * 1e3:.3g} (" in md, md
  from pallas_fa3.tools.bench import plots  # pylint: disable=g-import-not-at-top

  for name, fig in plots.figures(result["records"], result["environment"]):
    assert name.startswith("gflops_"), name
    assert {ax.get_ylabel() for ax in fig.axes} == {"GFLOP/s"}, name
    assert "GFLOP/s of the median call" in " ".join(fig.get_suptitle().split())


def test_cpu_default_runs_what_it_says_and_says_it_once(tmp_path, capsys):
  # Without --impl a CPU run showed an interpret case in its progress bar
  # (skipped with a PJRT_NPROC paragraph on 2 cores) and the "No GPU"
  # banner before and after the sweep.
  argv = ["--head-dim", "32", "--seq", "64", "--tokens", "64", "--hidden"]
  argv += ["64", "--mode", "fwd", "--causal", "--runs", "1", "--warmup", "0"]
  argv += ["--input-sets", "1", "--no-plots", "--out", str(tmp_path)]
  assert cli.main(["bench"] + argv) == 0
  out = capsys.readouterr().out
  assert out.count(command.CPU_NOTE.split(":")[0]) == 1, out
  assert "interpret" not in out and "PJRT_NPROC" not in out, out
  rows = report.read_csv(os.path.join(tmp_path, report.CSV_FILE))
  assert {r["impl"] for r in rows} == {"blockwise", "reference", "xla"}
