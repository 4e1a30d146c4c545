"""Tests of `pallas-fa3 bench --window/--softcap/--sinks`: the flags, the
FLOPs of windows against a brute-force pair count, what each implementation
is given, and a tiny sweep whose rows, tables and skips name the options."""

import csv
import dataclasses
import json
import os

import numpy as np
import pytest

from pallas_fa3.tools import cli
from pallas_fa3.tools.bench import (
  command,
  flops,
  fp8_case,
  impls,
  options,
  runner,
  specs,
  terminal,
  timing,
)

WINDOWS = [None, (0, 0), (3, 2), (0, None), (None, 0), (None, 5), (17, 0)]


def _parse(argv):
  return cli.build_parser().parse_args(["bench"] + argv)


def _brute_force_pairs(sq, skv, causal, window):
  p = np.arange(sq)[:, None] + skv - sq  # bottom-right aligned
  j = np.arange(skv)[None, :]
  seen = np.ones((sq, skv), bool)
  if causal:
    seen &= j <= p
  left, right = window or (None, None)
  if left is not None:
    seen &= j >= p - left
  if right is not None:
    seen &= j <= p + right
  return int(seen.sum())


@pytest.mark.parametrize(
  "text,want",
  [
    ("256,0", (256, 0)),
    ("256,none", (256, None)),
    ("None,16", (None, 16)),
    (" 8 , 4 ", (8, 4)),
    ("0,0", (0, 0)),
  ],
)
def test_window_flag(text, want):
  args = _parse(["--window", text])
  assert args.window == want
  grid = specs.make_grid(command.grid_axes(args, "cpu"))
  assert grid and all(s.window == want for s in grid)
  assert all("window" in s.tags and s.modifiers == ("window",) for s in grid)
  assert len({s.name for s in grid}) == len(grid)


def test_softcap_and_sinks_flags():
  args = _parse(["--softcap", "30", "--sinks"])
  assert (args.window, args.softcap, args.sinks) == (None, 30.0, True)
  grid = specs.make_grid(command.grid_axes(args, "gpu"))
  assert all(s.softcap == 30.0 and s.sinks and s.window is None for s in grid)
  assert grid[0].name.endswith("-softcap30-sinks"), grid[0].name
  plain = specs.make_grid(command.grid_axes(_parse([]), "cpu"))
  assert all(not s.modifiers for s in plain)


@pytest.mark.parametrize(
  "argv",
  [
    ["--window", "256"],
    ["--window", "1,2,3"],
    ["--window", "-1,0"],
    ["--window", "a,0"],
    ["--window", "1.5,0"],
    ["--window", "none,none"],
    ["--softcap", "0"],
    ["--softcap", "-1"],
    ["--softcap", "nan"],
    ["--softcap", "inf"],
    ["--softcap", "big"],
  ],
  ids=" ".join,
)
def test_bad_option_flags_are_usage_errors(argv, capsys, tmp_path):
  with pytest.raises(SystemExit) as e:
    cli.main(
      ["bench", "--no-progress", "--no-plots", "--out", str(tmp_path), *argv]
    )
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "usage: pallas-fa3 bench" in err, err
  assert f"argument {argv[0]}: " in err, err


@pytest.mark.parametrize(
  "field,value",
  [("window", (1,)), ("window", (-1, 0)), ("window", [1, 0])]
  + [("softcap", v) for v in (0.0, -2.0, float("inf"), "30")]
  + [("sinks", 1)],
)
def test_bench_spec_checks_options(field, value):
  with pytest.raises(ValueError, match=f"{field} must be"):
    specs.BenchSpec(
      "t", 1, 8, 8, 1, 1, 8, True, "bf16", "fwd", **{field: value}
    )


@pytest.mark.parametrize(
  "sq,skv",
  [(1, 1), (7, 7), (5, 9), (9, 5), (1, 100), (100, 1), (113, 203), (300, 17)],
)
@pytest.mark.parametrize("causal", [False, True])
def test_visible_pairs_match_brute_force(sq, skv, causal):
  for window in WINDOWS + [(1000, None), (5, 1000), (None, None)]:
    got = flops.visible_pairs(sq, skv, causal, window)
    assert got == _brute_force_pairs(sq, skv, causal, window), window


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_flops_count_the_window(window, causal):
  b, hq, d, sq, skv = 2, 3, 16, 64, 80
  spec = specs.BenchSpec(
    "t", b, sq, skv, hq, hq, d, causal, "bf16", "fwd", window=window
  )
  pairs = _brute_force_pairs(sq, skv, causal, window)
  assert flops.attention_flops(spec) == 4 * b * pairs * hq * d
  bwd = specs.BenchSpec(
    "t", b, sq, skv, hq, hq, d, causal, "bf16", "fwd+bwd", window=window
  )
  assert 2 * flops.attention_flops(bwd) == 7 * 4 * b * pairs * hq * d


def test_window_flops_at_4096():
  # The window that benchmarks/window_skipping.py times: under an eighth of
  # the causal square's pairs.
  n, left = 4096, 256
  pairs = flops.visible_pairs(n, n, True, (left, 0))
  assert pairs == (left + 1) * n - left * (left + 1) // 2
  assert pairs < flops.causal_pairs(n, n) / 7


def test_interpret_case_keeps_the_options():
  args = _parse(["--seq", "128", "--window", "16,0", "--softcap", "5"])
  tiny = specs.tiny_spec_for(specs.make_grid(command.grid_axes(args, "cpu")))
  assert tiny.correctness_only
  assert (tiny.window, tiny.softcap, tiny.sinks) == ((16, 0), 5.0, False)


def test_every_implementation_gets_the_options():
  # float32, so that blockwise and XLA match the reference closely; the
  # options change the output, so they did reach each implementation.
  spec = specs.BenchSpec(
    "t", 1, 64, 64, 2, 2, 16, False, "fp32", "fwd", window=(5, 3)
  )
  capped = specs.BenchSpec(
    "t", 1, 64, 64, 2, 2, 16, True, "fp32", "fwd", softcap=2.0, sinks=True
  )
  q, k, v, _ = timing.make_inputs(spec, "float32", 1, 0)[0]
  out = lambda impl, s: np.asarray(impls.REGISTRY[impl].build(s)(q, k, v))
  for s, names in ((spec, ("blockwise", "xla")), (capped, ("blockwise",))):
    want = out("reference", s)
    plain = dataclasses.replace(s, window=None, softcap=None, sinks=False)
    assert np.max(np.abs(want - out("reference", plain))) > 0.1
    for name in names:
      np.testing.assert_allclose(out(name, s), want, atol=2e-5, err_msg=name)


def test_baselines_without_the_options_say_why():
  def spec(**kw):
    return specs.BenchSpec("t", 1, 64, 64, 2, 2, 16, True, "bf16", "fwd", **kw)

  xla = impls.REGISTRY["xla"].unsupported
  assert xla(spec(window=(8, 0)), "cpu") is None
  assert "softcap" in xla(spec(softcap=3.0), "cpu")
  assert "sinks" in xla(spec(sinks=True), "cpu")
  rect = specs.BenchSpec(
    "t", 1, 32, 64, 2, 2, 16, False, "bf16", "fwd", window=(8, 0)
  )
  assert "top-left" in xla(rect, "cpu")
  cudnn = impls.REGISTRY["cudnn"].unsupported
  assert "right" in cudnn(
    specs.BenchSpec(
      "t", 1, 64, 64, 2, 2, 16, False, "bf16", "fwd", window=(8, 4)
    ),
    "gpu",
  )
  assert options.join_names(("a", "b", "c")) == "a, b or c"


@pytest.mark.parametrize(
  "options",
  [dict(window=(8, 0)), dict(softcap=1.0), dict(sinks=True), dict(docs=3)],
  ids=["window", "softcap", "sinks", "docs"],
)
def test_fp8_cases_take_the_options(options):
  """FP8 cases run with a window, softcap, sinks or documents, and both FP8
  calls (quantized attention, total) compute the modified function."""
  spec = specs.BenchSpec(
    "t", 1, 64, 64, 2, 2, 64, True, "fp8", "fwd", **options
  )
  assert fp8_case.unsupported("blockwise", spec) is None
  plain = dataclasses.replace(spec, dtype="fp32")
  q, k, v, _ = timing.make_inputs(spec, "bfloat16", 1, 0)[0]
  quantize, attend, total = fp8_case.functions("blockwise", spec)
  got = np.asarray(attend(quantize(q, k, v)), np.float32)
  np.testing.assert_array_equal(got, np.asarray(total(q, k, v), np.float32))
  f32 = [np.asarray(a, np.float32) for a in (q, k, v)]
  want = np.asarray(impls.REGISTRY["reference"].build(plain)(*f32))
  unmodified = dataclasses.replace(
    plain, window=None, softcap=None, sinks=False, docs=None
  )
  other = np.asarray(impls.REGISTRY["reference"].build(unmodified)(*f32))
  err = np.sqrt(np.mean((got - want) ** 2))
  assert err < 0.25 * np.sqrt(np.mean((other - want) ** 2)), err


def _refuser() -> impls.Impl:
  """An implementation that refuses every option as a backend does: by
  raising NotImplementedError while the call is traced."""

  def build(spec):
    def fn(q, k, v):
      if spec.modifiers:
        raise NotImplementedError(
          f"refuser does not support {', '.join(spec.modifiers)}"
        )
      return q

    return fn

  return impls.Impl(
    "refuser", "ours", "refuses the options", lambda s, p: None, build
  )


@pytest.fixture(scope="module")
def option_sweep(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("bench"))
  argv = [
    "--impl",
    "blockwise",
    "reference",
    "xla",
    "refuser",
    "--dtype",
    "bf16",
    "fp8",
    "--head-dim",
    "32",
    "--seq",
    "64",
    "--mode",
    "fwd",
    "fwd+bwd",
    "--tokens",
    "64",
    "--hidden",
    "64",
    "--window",
    "8,0",
    "--softcap",
    "30",
    "--sinks",
    "--runs",
    "1",
    "--warmup",
    "0",
    "--input-sets",
    "1",
    "--out",
    out,
    "--no-progress",
  ]
  with pytest.MonkeyPatch.context() as mp:
    mp.setitem(impls.REGISTRY, "refuser", _refuser())
    mp.setattr(impls, "ALL", impls.ALL + ("refuser",))
    assert cli.main(["bench"] + argv) == 0
  return out


def _records(out):
  with open(os.path.join(out, "results.json")) as f:
    return json.load(f)["records"]


def test_rows_carry_the_options(option_sweep):
  with open(os.path.join(option_sweep, "results.csv"), newline="") as f:
    rows = list(csv.DictReader(f))
  assert rows and all(
    (r["window"], r["softcap"], r["sinks"]) == ("8,0", "30.0", "True")
    for r in rows
  )
  records = _records(option_sweep)
  assert all(
    (r["window"], r["softcap"], r["sinks"]) == ("8,0", 30.0, True)
    for r in records
  )
  ok = {(r["impl"], r["dtype"]) for r in records if r["status"] == "ok"}
  assert ok == {
    ("blockwise", "bf16"),
    ("reference", "bf16"),
    ("blockwise", "fp8"),
  }
  for r in records:
    pairs = _brute_force_pairs(64, 64, r["causal"], (8, 0))
    factor = 1 if r["mode"] == "fwd" else 3.5
    assert r["flops"] == factor * 4 * r["batch"] * pairs * r["heads_q"] * 32


def test_refusals_are_skips_with_reasons(option_sweep):
  records = _records(option_sweep)
  refused = [r for r in records if r["impl"] == "refuser"]
  assert refused and all(r["status"] == "skipped" for r in refused)
  assert all(
    r["reason"] == "NotImplementedError: refuser does not support window,"
    " softcap, sinks"
    for r in refused
    if r["dtype"] == "bf16"
  )
  xla = [r for r in records if r["impl"] == "xla" and r["dtype"] == "bf16"]
  assert xla and all(r["status"] == "skipped" for r in xla)
  assert all("no softcap or sinks" in r["reason"] for r in xla)
  fp8 = [r for r in records if r["dtype"] == "fp8"]
  ran = {(r["impl"], r["mode"]) for r in fp8 if r["status"] == "ok"}
  assert ran == {("blockwise", "fwd")}  # FP8 takes the options; forward only
  assert all(
    "forward only" in r["reason"] or "no FP8 path" in r["reason"]
    for r in fp8
    if r["status"] == "skipped"
  )
  assert not [r for r in records if r["status"] == "error"]


def test_summaries_name_the_options(option_sweep):
  with open(os.path.join(option_sweep, "results.json")) as f:
    result = json.load(f)
  text = terminal.text(result, "blockwise")
  assert all(len(line) <= terminal.WIDTH for line in text.splitlines())
  assert "fwd bf16, window 8,0, softcap 30, sinks: GFLOP/s" in text, text
  assert "refuser x" in text and "does not support window" in text
  with open(os.path.join(option_sweep, "summary.md")) as f:
    md = f.read()
  assert "| options |" in md and "| window 8,0, softcap 30, sinks |" in md
  plots = os.listdir(os.path.join(option_sweep, "plots"))
  assert "gflops_fwd_bf16_window_8_0_softcap_30_sinks.png" in plots, plots


def test_labels_and_record_fields():
  assert options.format_window((256, None)) == "256,none"
  assert options.modifier_label((4, 0), None, False) == "window 4,0"
  assert options.modifier_label(None, 2.5, True) == "softcap 2.5, sinks"
  assert options.modifier_label(None, None, False) == ""
  sinks = options.sinks_for(4)
  assert sinks.dtype == np.float32 and sinks.shape == (4,)
  np.testing.assert_array_equal(sinks, options.sinks_for(4))
  rec = runner.run_case(
    impls.REGISTRY["blockwise"],
    specs.tiny_spec(seq=32, head_dim=16, window=(4, None), sinks=True),
    timing.make_inputs(specs.tiny_spec(seq=32, head_dim=16), "bfloat16", 1, 0),
    dict(platform="cpu", runs=1, warmup=0),
    None,
  )
  assert rec["status"] == "ok" and rec["max_abs_err"] < 0.05
  assert (rec["window"], rec["softcap"], rec["sinks"]) == ("4,none", None, True)
