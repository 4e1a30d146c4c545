"""Tests of the benchmark harness (pallas_fa3/bench): FLOPs model, grids,
flag selection, skip reasons, and one tiny end-to-end sweep writing files."""

import csv
import itertools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa3
from pallas_fa3 import cli
from pallas_fa3.bench import (
  command,
  flops,
  impls,
  report,
  runner,
  specs,
  terminal,
)


def _spec(sq, skv, causal=True, mode="fwd", b=2, hq=3, d=16):
  return specs.BenchSpec("t", b, sq, skv, hq, hq, d, causal, "bf16", mode)


def _brute_force_pairs(sq, skv):
  i = np.arange(sq)[:, None]
  j = np.arange(skv)[None, :]
  return int(np.sum(j <= i + skv - sq))  # bottom-right aligned


@pytest.mark.parametrize(
  "sq,skv",
  [
    (1, 1),
    (7, 7),
    (128, 128),
    (5, 9),
    (9, 5),
    (1, 100),
    (100, 1),
    (113, 203),
    (1023, 1024),
    (300, 17),
  ],
)
def test_causal_pairs_match_brute_force(sq, skv):
  assert flops.causal_pairs(sq, skv) == _brute_force_pairs(sq, skv)


@pytest.mark.parametrize("sq,skv", [(64, 64), (33, 80), (80, 33)])
def test_attention_flops(sq, skv):
  b, hq, d = 2, 3, 16
  full = flops.attention_flops(_spec(sq, skv, causal=False))
  assert full == 4 * b * sq * skv * hq * d
  causal = flops.attention_flops(_spec(sq, skv))
  assert causal == 4 * b * _brute_force_pairs(sq, skv) * hq * d
  assert flops.attention_flops(_spec(sq, skv, mode="bwd")) * 2 == 5 * causal
  assert flops.attention_flops(_spec(sq, skv, mode="fwd+bwd")) * 2 == 7 * causal
  # dv != d: 2 * b * pairs * hq * (d + dv)
  assert flops.attention_flops(_spec(sq, skv, False), head_dim_v=48) == (
    2 * b * sq * skv * hq * (16 + 48)
  )


def test_square_causal_is_about_half():
  n = 4096
  assert flops.causal_pairs(n, n) == n * (n + 1) // 2


def test_paper_grid_head_counts():
  grid = specs.make_grid(specs.PAPER_AXES)
  heads = {s.head_dim: s.heads_q for s in grid}
  assert heads == {64: 32, 128: 16, 256: 8}
  assert {s.seq_q for s in grid} == {512, 1024, 2048, 4096, 8192, 16384}
  assert all(s.batch * s.seq_q == 16 * 1024 for s in grid)
  assert {s.causal for s in grid} == {False, True}
  assert {s.mode for s in grid} == set(specs.MODES)
  assert len(grid) == len({s.name for s in grid}) == 3 * 6 * 2 * 3


def _parse(argv):
  return cli.build_parser().parse_args(["bench"] + argv)


def test_flags_select_specs():
  args = _parse(
    [
      "--head-dim",
      "128",
      "--seq",
      "1024",
      "4096",
      "--no-causal",
      "--mode",
      "bwd",
      "--gqa",
      "1",
      "4",
      "--dtype",
      "fp16",
    ]
  )
  grid = specs.make_grid(command.grid_axes(args, "gpu"))
  assert len(grid) == 2 * 2
  assert {(s.seq_q, s.gqa) for s in grid} == set(
    itertools.product((1024, 4096), (1, 4))
  )
  assert all(
    s.head_dim == 128
    and s.heads_q == 16
    and not s.causal
    and s.mode == "bwd"
    and s.dtype == "fp16"
    for s in grid
  )
  assert {s.heads_kv for s in grid} == {16, 4}
  causal = specs.make_grid(command.grid_axes(_parse(["--causal"]), "cpu"))
  assert causal and all(s.causal for s in causal)
  assert specs.select(causal, ["d64"]) == [
    s for s in causal if s.head_dim == 64
  ]


def test_bad_gqa_is_an_error():
  with pytest.raises(ValueError, match="gqa 3"):
    specs.make_grid(command.grid_axes(_parse(["--gqa", "3"]), "gpu"))


def test_baselines_skip_with_reasons():
  rect = _spec(64, 128)
  assert "top-left" in impls.REGISTRY["xla"].unsupported(rect, "cpu")
  assert impls.REGISTRY["xla"].unsupported(_spec(64, 64), "cpu") is None
  assert "GPU" in impls.REGISTRY["cudnn"].unsupported(_spec(64, 64), "cpu")
  assert "GPU" in impls.REGISTRY["mgpu"].unsupported(_spec(64, 64), "cpu")
  assert "correctness" in impls.REGISTRY["interpret"].unsupported(
    _spec(64, 64), "cpu"
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
    "tflops_fwd_bf16.png",
    "tflops_bwd_bf16.png",
    "tflops_fwd_bwd_bf16.png",
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


def test_time_budget_skips_remaining_cases():
  grid = [_spec(32, 32, causal=False, b=1, hq=1, d=16)]
  cases = runner.plan(grid, ["blockwise", "xla"])
  result = runner.run_sweep(
    cases,
    dict(
      platform="cpu", runs=1, warmup=0, input_sets=1, seed=0, time_budget_s=0.0
    ),
    progress=False,
  )
  assert all("time budget" in r["reason"] for r in result["records"])


def test_correctness_only_case_reports_error_not_speed():
  # The same record path as the interpret case, with blockwise on the tiny spec.
  spec = specs.tiny_spec()
  inputs = runner.timing.make_inputs(spec, spec.jax_dtype, 1, 0)
  rec = runner.run_case(
    impls.REGISTRY["blockwise"],
    spec,
    inputs,
    dict(platform="cpu", runs=1, warmup=0),
    None,
  )
  assert rec["status"] == "ok"
  assert rec["note"] == "correctness only, not a speed figure"
  assert 0 < rec["max_abs_err"] < 0.05
  assert report.ratios([rec], "blockwise") == []  # never a speed figure


def test_bench_help_lists_flags(capsys):
  with pytest.raises(SystemExit):
    cli.main(["bench", "--help"])
  text = capsys.readouterr().out
  for flag in (
    "--impl",
    "--dtype",
    "--head-dim",
    "--seq",
    "--no-causal",
    "--mode",
    "--gqa",
    "--runs",
    "--warmup",
    "--out",
  ):
    assert flag in text


@pytest.mark.parametrize(
  "argv",
  [
    ["--seq", "0"],
    ["--seq", "-5"],
    ["--seq", "128", "0"],
    ["--head-dim", "0"],
    ["--hidden", "0"],
    ["--hidden", "-128"],
    ["--tokens", "0"],
    ["--gqa", "0"],
    ["--runs", "0"],
    ["--runs", "-1"],
    ["--input-sets", "0"],
    ["--warmup", "-1"],
    ["--time-budget", "-1"],
  ],
  ids=" ".join,
)
def test_bad_int_flags_are_usage_errors(argv, capsys, tmp_path):
  # --seq 0 used to end in a ZeroDivisionError (batch = tokens // seq).
  with pytest.raises(SystemExit) as e:
    cli.main(
      ["bench", "--no-progress", "--no-plots", "--out", str(tmp_path), *argv]
    )
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "usage: pallas-fa3 bench" in err, err
  assert f"argument {argv[0]}: must be >= " in err, err


@pytest.mark.parametrize(
  "argv,want",
  [
    (
      ["--head-dim", "96"],
      (
        "--head-dim 96 does not divide --hidden 128:"
        " pick --hidden 192 (a multiple of 96)"
      ),
    ),
    (
      ["--head-dim", "64", "96"],
      (
        "--head-dim 96 does not divide --hidden"
        " 128: pick --hidden 192 (a multiple of 64"
        " and 96)"
      ),
    ),
    (["--head-dim", "96", "--hidden", "64"], "pick --hidden 96"),
    (
      ["--head-dim", "512"],
      ("--head-dim 512 is over 256: head dims are at most 256"),
    ),
    (["--head-dim", "512", "--hidden", "1024"], "at most 256"),
  ],
  ids=lambda x: " ".join(x) if isinstance(x, list) else "",
)
def test_bad_head_dim_names_the_flags(argv, want, capsys, tmp_path):
  with pytest.raises(SystemExit) as e:
    cli.main(
      ["bench", "--no-progress", "--no-plots", "--out", str(tmp_path), *argv]
    )
  assert e.value.code == 2
  err = " ".join(capsys.readouterr().err.split())
  assert want in err, err


def test_head_dim_96_with_a_fitting_hidden():
  grid = specs.make_grid(
    command.grid_axes(_parse(["--head-dim", "96", "--hidden", "192"]), "cpu")
  )
  assert grid and {(s.head_dim, s.heads_q) for s in grid} == {(96, 2)}


def test_max_head_dim_is_the_librarys():
  def shape(d):
    q = jax.ShapeDtypeStruct((1, 8, 1, d), jnp.bfloat16)
    return jax.eval_shape(
      lambda q: pallas_fa3.flash_attention(q, q, q, implementation="reference"),
      q,
    )

  assert shape(specs.MAX_HEAD_DIM).shape[-1] == specs.MAX_HEAD_DIM
  with pytest.raises(ValueError, match="head_dim"):
    shape(specs.MAX_HEAD_DIM + 1)


def _interpret_case(argv):
  grid = specs.make_grid(command.grid_axes(_parse(argv), "cpu"))
  cases = [
    s
    for i, s in runner.plan(grid, ["blockwise", "interpret"])
    if i.name == "interpret"
  ]
  assert len(cases) == 1
  return cases[0]


@pytest.mark.parametrize(
  "argv",
  [
    ["--no-causal"],
    ["--causal", "--seq", "256", "1024"],
    ["--dtype", "fp16", "--head-dim", "128", "--seq", "64"],
    ["--mode", "fwd+bwd", "--seq", "128"],
    ["--gqa", "2", "--head-dim", "64", "--seq", "128"],
  ],
  ids=" ".join,
)
def test_interpret_case_respects_the_filters(argv):
  # It used to be fwd bf16 d64 causal seq 128 whatever the flags said.
  grid = specs.make_grid(command.grid_axes(_parse(argv), "cpu"))
  tiny = _interpret_case(argv)
  assert tiny.correctness_only and tiny.batch == 1 and tiny.heads_kv <= 2
  assert any(
    (s.mode, s.dtype, s.causal, s.seq_q, s.head_dim, s.gqa)
    == (tiny.mode, tiny.dtype, tiny.causal, tiny.seq_q, tiny.head_dim, tiny.gqa)
    for s in grid
  ), tiny
  assert tiny.seq_q == min(s.seq_q for s in grid)
  assert impls.REGISTRY["interpret"].unsupported(tiny, "cpu") in (
    None,
    "no GPU",
  )  # runs where the interpreter runs


def test_interpret_case_too_long_for_the_filters_is_skipped():
  tiny = _interpret_case(["--seq", "2048"])
  assert tiny.seq_q == 2048
  reason = impls.REGISTRY["interpret"].unsupported(tiny, "cpu")
  assert "seq <= 512" in reason and "2048" in reason, reason


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

  from pallas_fa3.bench import plots

  with open(os.path.join(tiny_sweep, report.JSON_FILE)) as f:
    result = json.load(f)
  env = result["environment"]
  made = plots.figures(result["records"], env)
  assert {name for name, _ in made} >= {"tflops_fwd_bf16.png"}
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


def test_cpu_default_is_small():
  # The CPU default was 24 shapes x 3 implementations (73 compiled cases,
  # 439 s for a new user on 2 cores); the README promises about a minute.
  grid = specs.make_grid(specs.CPU_AXES)
  cases = runner.plan(grid, runner.DEFAULT_IMPLS["cpu"])
  assert len(cases) <= 25
  assert sum(flops.attention_flops(s) for s in grid) <= 20e9
  # Still a comparison: blockwise, reference and XLA at two lengths, both
  # masks, forward and forward+backward, plus the interpret kernel check.
  assert {"blockwise", "reference", "xla"} <= {i.name for i, _ in cases}
  assert (
    len({s.seq_q for s in grid}) >= 2
    and {s.causal for s in grid} == {False, True}
    and {s.mode for s in grid} == {"fwd", "fwd+bwd"}
  )
  tiny = [s for i, s in cases if i.name == "interpret"]
  assert len(tiny) == 1 and impls.REGISTRY["interpret"].unsupported(
    tiny[0], "cpu"
  ) in (None, "no GPU")
  assert runner.DEFAULT_RUNS["cpu"] <= 3
