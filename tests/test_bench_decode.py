"""Tests of `pallas-fa3 bench --mode decode`: a tiny CPU sweep end to end,
the bytes and FLOPs model, the default grids, skip reasons, the Triton
baselines' wrappers (interpret mode) and the flags' usage errors."""

import dataclasses
import importlib.util
import json
import os
import pathlib

import jax
import numpy as np
import pytest

from pallas_fa3.tools import cli
from pallas_fa3.tools.bench import (
  command,
  flops,
  impls,
  report,
  runner,
  specs,
  terminal,
  timing,
)

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_TINY = [
  "--mode",
  "decode",
  "--batch",
  "2",
  "--cache-len",
  "128",
  "--page-size",
  "none",
  "64",
  "--num-splits",
  "auto",
  "2",
  "--hidden",
  "128",
  "--head-dim",
  "64",
  "--gqa",
  "2",
  "--runs",
  "1",
  "--warmup",
  "0",
  "--input-sets",
  "1",
  "--no-progress",
]


def _parse(argv):
  return cli.build_parser().parse_args(["bench"] + argv)


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("decode"))
  impls = ["--impl", "blockwise", "reference", "xla", "mosaic", "cudnn"]
  impls += ["triton-gqa", "triton-paged"]
  assert cli.main(["bench"] + _TINY + impls + ["--out", out]) == 0
  return out


def test_cli_writes_every_file(tiny_sweep):
  rows = report.read_csv(os.path.join(tiny_sweep, report.CSV_FILE))
  ok = [r for r in rows if r["status"] == "ok"]
  # 2 layouts x 2 split counts for blockwise; reference and xla take no
  # split count: timed at auto only.
  assert sorted((r["impl"], r["num_splits"]) for r in ok) == sorted(
    [("blockwise", s) for s in ("auto", "2") for _ in range(2)]
    + [(i, "auto") for i in ("reference", "xla") for _ in range(2)]
  )
  for r in ok:
    median = float(r["time_median_ms"]) * 1e-3
    assert float(r["time_min_ms"]) <= float(r["time_median_ms"])
    assert float(r["time_median_ms"]) <= float(r["time_max_ms"])
    assert float(r["gbps"]) == pytest.approx(int(r["kv_bytes"]) / median / 1e9)
    assert float(r["tflops"]) == pytest.approx(int(r["flops"]) / median / 1e12)
    assert r["pct_hbm"] == ""  # a CPU has no HBM peak
    assert float(r["max_abs_err"]) < 0.05  # bf16 against the reference
  blockwise = {
    r["num_splits"]: r["splits"] for r in ok if r["impl"] == "blockwise"
  }
  assert blockwise == {"auto": "1", "2": "2"}
  data = json.loads(open(os.path.join(tiny_sweep, report.JSON_FILE)).read())
  assert data["environment"]["command"].startswith("pallas-fa3 bench")
  assert data["ours"] == "blockwise" and "CPU" in data["hbm_peak"]
  assert {r["baseline"] for r in data["ratios"]} == {"reference", "xla"}
  md = open(os.path.join(tiny_sweep, report.MARKDOWN_FILE)).read()
  assert "| b x L | hq/hk d | cache | splits |" in md and "no HBM peak" in md
  png = os.path.join(tiny_sweep, "plots", "decode_gbps_bf16.png")
  with open(png, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_skipped_implementations_say_why(tiny_sweep):
  rows = report.read_csv(os.path.join(tiny_sweep, report.CSV_FILE))
  skipped = [r for r in rows if r["status"] != "ok"]
  assert skipped and all(
    r["status"] == "skipped" and r["reason"] for r in skipped
  )
  why = {r["impl"]: r["reason"] for r in skipped}
  assert "GPU" in why["mosaic"] and "GPU" in why["cudnn"]
  assert "Triton" in why["triton-gqa"] and "Triton" in why["triton-paged"]
  assert why["xla"] == runner.NO_SPLITS
  md = open(os.path.join(tiny_sweep, report.MARKDOWN_FILE)).read()
  for impl in ("mosaic", "cudnn", "triton-gqa", "triton-paged"):
    assert f"- {impl}: [skipped]" in md


def test_terminal_tables_fit_80_columns(tiny_sweep):
  result = json.loads(open(os.path.join(tiny_sweep, report.JSON_FILE)).read())
  text = terminal.text(result, "blockwise")
  assert "contiguous cache" in text and "paged cache" in text
  assert max(map(len, text.splitlines())) <= terminal.WIDTH


def test_bytes_and_flops_by_hand():
  s = specs.DecodeBenchSpec("x", 3, 100, 8, 2, 64, "bf16")
  # K and V: 3 x 100 tokens x 2 heads x (64 + 64) x 2 bytes.
  assert s.kv_bytes == 3 * 100 * 2 * 128 * 2 == 153600
  assert s.flops == 4 * 3 * 8 * 1 * 100 * 64 == 614400  # 4 b hq sq L d
  # Ragged: 100, 100 - 50 // 3 = 84, 100 - 100 // 3 = 67 tokens; the
  # layout does not change the bytes, the dtype does.
  r = specs.DecodeBenchSpec(
    "y", 3, 100, 8, 2, 64, "fp32", page_size=16, ragged=True
  )
  assert r.lengths == (100, 84, 67) and r.pages_per_seq == 7
  assert r.kv_bytes == 251 * 2 * 128 * 4
  assert r.flops == 2 * 251 * 8 * 128 == flops.decode_flops(r)


def test_hbm_peak_by_device_kind():
  assert timing.hbm_peak_bytes_s("NVIDIA H200") == 4.8e12
  assert timing.hbm_peak_bytes_s("NVIDIA H100 80GB HBM3") == 3.35e12
  assert timing.hbm_peak_bytes_s("cpu") is None
  assert timing.hbm_peak("cpu") == (None, timing.NO_PEAK_CPU)


def test_default_grids():
  gpu = command.grid(_parse(["--mode", "decode"]), "gpu")
  names = [s.name for s in gpu]
  assert len(names) == len(set(names))
  head = command.grid(_parse(["--mode", "decode", "--tags", "headline"]), "gpu")
  assert [(s.batch, s.cache_len, s.page_size, s.num_splits) for s in head] == [
    (64, 8192, None, None),
    (64, 8192, 64, None),
    (1, 131072, None, None),
  ]
  assert all((s.heads_q, s.heads_kv, s.head_dim) == (32, 8, 128) for s in head)
  assert {s.gqa for s in gpu} == {1, 4, 8}
  assert {s.num_splits for s in gpu if s.batch == 1} == {None, 1, 8, 32, 128}
  # A flag replaces its axis in every group; duplicates are dropped.
  flat = command.grid(
    _parse(["--mode", "decode", "--page-size", "none", "--num-splits", "auto"]),
    "gpu",
  )
  assert {s.page_size for s in flat} == {None}
  assert len(flat) == len({s.shape_key for s in flat})
  # --grid gpu picks the GPU grid on any platform.
  assert (
    command.grid(_parse(["--mode", "decode", "--grid", "gpu"]), "cpu") == gpu
  )
  cpu = command.grid(_parse(["--mode", "decode"]), "cpu")
  assert len(cpu) == 8 and max(s.kv_bytes for s in cpu) <= 2**25  # 32 MiB


def test_our_backends_check_every_gpu_case():
  # Shapes only (no arrays): the library validates every default GPU case,
  # and split counts come from the backends.
  for spec in command.grid(_parse(["--mode", "decode"]), "gpu"):
    assert "GPU" in impls.REGISTRY["mosaic"].unsupported(spec, "cpu")
    for name in ("mosaic", "blockwise"):
      splits = impls.REGISTRY[name].splits(spec)
      assert splits >= 1 and spec.num_splits in (None, splits)


def test_baselines_say_why_on_a_gpu():
  reg = impls.REGISTRY
  spec = specs.DecodeBenchSpec
  contiguous = spec("c", 1, 8192, 32, 8, 128, "bf16")
  paged = spec("p", 1, 8192, 32, 8, 128, "bf16", page_size=64)
  assert "paged" in reg["triton-gqa"].unsupported(paged, "gpu")
  assert "contiguous" in reg["triton-paged"].unsupported(contiguous, "gpu")
  assert reg["triton-gqa"].unsupported(contiguous, "gpu") is None
  assert reg["triton-paged"].unsupported(paged, "gpu") is None
  assert reg["triton-gqa"].splits(contiguous) == impls.TRITON_SPLITS
  odd = spec("o", 1, 8192, 32, 8, 128, "bf16", num_splits=3)
  assert "num_splits=3" in reg["triton-gqa"].unsupported(odd, "gpu")
  fp32 = spec("f", 1, 8192, 32, 8, 128, "fp32")
  assert "bf16/fp16" in reg["cudnn"].unsupported(fp32, "gpu")


@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged"])
def test_fp8_cases_read_an_e4m3_cache(page_size):
  """--dtype fp8: bf16 queries over an e4m3 cache with its descales, half
  the K/V bytes of bf16; ours compute it, the baselines say why not."""
  s = specs.DecodeBenchSpec(
    "f", 2, 64, 4, 2, 64, "fp8", page_size=page_size, ragged=True
  )
  bf16 = specs.DecodeBenchSpec(
    "b", 2, 64, 4, 2, 64, "bf16", page_size=page_size, ragged=True
  )
  assert 2 * s.kv_bytes == bf16.kv_bytes
  inputs = timing.make_inputs(s, s.jax_dtype, 1, 0)
  q, kc, vc, lengths, table, kd, vd = inputs[0]
  assert kc.dtype == vc.dtype == jax.numpy.float8_e4m3fn
  assert q.dtype == jax.numpy.bfloat16 and kd.shape == vd.shape == (2, 2)
  args = (q, kc, vc, lengths, table, kd, vd)
  reg = impls.REGISTRY
  want = np.asarray(jax.jit(reg["reference"].build(s))(*args), np.float32)
  got = np.asarray(jax.jit(reg["blockwise"].build(s))(*args), np.float32)
  np.testing.assert_allclose(got, want, atol=2e-2)
  assert reg["blockwise"].unsupported(s, "cpu") is None
  for name in ("xla", "cudnn", "triton-gqa", "triton-paged"):
    assert "e4m3" in reg[name].unsupported(s, "gpu")


@pytest.mark.parametrize("page_size", [None, 16], ids=["gqa", "paged"])
def test_triton_wrappers_match_the_reference(page_size):
  # The Triton ops in Pallas interpret mode, on this CPU: our layouts,
  # scale and split counts around them give the reference's output.
  s = specs.DecodeBenchSpec(
    "t", 2, 64, 4, 2, 64, "fp32", page_size=page_size, ragged=True
  )
  impl = impls.REGISTRY["triton-paged" if page_size else "triton-gqa"]
  inputs = timing.make_inputs(s, s.jax_dtype, 1, 0)[0]
  want = jax.jit(impls.REGISTRY["reference"].build(s))(*inputs)
  got = jax.jit(impl.build(s, interpret=True))(*impl.prepare(s, *inputs))
  assert impl.splits(s) == 4
  np.testing.assert_allclose(
    np.asarray(got).reshape(want.shape), want, atol=1e-5
  )


def test_headline_has_a_decode_table(tmp_path):
  rec = dict(batch=64, cache_len=8192, heads_q=32, heads_kv=8, head_dim=128)
  rec.update(dtype="bf16", page_size=None, num_splits="auto", spec="s")
  records = [
    dict(rec, impl="mosaic", status="ok", gbps=4200.0, pct_hbm=87.5),
    dict(rec, impl="triton-gqa", status="ok", gbps=2100.0, pct_hbm=43.75),
    dict(rec, impl="triton-paged", status="skipped", gbps=None),
  ]
  (tmp_path / "decode").mkdir()
  (tmp_path / "decode" / "results.json").write_text(
    json.dumps(dict(records=records, hbm_peak="4.8 TB/s"))
  )
  path = _ROOT / "benchmarks" / "headline.py"
  loader = importlib.util.spec_from_file_location("headline", path)
  headline = importlib.util.module_from_spec(loader)
  loader.loader.exec_module(headline)
  assert headline.main([str(tmp_path)]) == 0
  text = (tmp_path / "headline.md").read_text()
  assert "4.8 TB/s" in text
  assert (
    "| b64 L8192 32/8 d128 bf16 contiguous splits auto | 4200 (88%) |"
    " 2100 (44%) | skipped | - | - | 2.00 |"
  ) in text


@pytest.mark.parametrize(
  "argv, flag",
  [
    (["--mode", "decode", "fwd"], "--mode decode"),
    (["--mode", "decode", "--seq", "128"], "--seq"),
    (["--mode", "decode", "--window", "8,0"], "--window"),
    (["--mode", "decode", "--no-causal"], "--causal"),
    (["--mode", "decode", "--impl", "mgpu"], "--impl mgpu"),
    (["--mode", "decode", "--gqa", "3"], "--gqa 3"),
    (["--mode", "decode", "--head-dim", "512"], "--head-dim"),
    (["--mode", "decode", "--tags", "nope"], "--tags"),
    (["--mode", "decode", "--batch", "0"], "--batch"),
    (["--mode", "decode", "--cache-len", "-1"], "--cache-len"),
    (["--mode", "decode", "--page-size", "big"], "--page-size"),
    (["--mode", "decode", "--page-size", "0"], "--page-size"),
    (["--mode", "decode", "--num-splits", "0"], "--num-splits"),
    (["--mode", "fwd", "--cache-len", "128"], "--cache-len"),
    (["--ragged"], "--ragged"),
    (["--q-len", "4"], "--q-len"),
    (["--batch-invariant"], "--batch-invariant"),
    (["--mode", "decode", "--decode-flex", "nope"], "--decode-flex"),
    (["--mode", "decode", "--q-len", "0"], "--q-len"),
    (["--mla"], "--mla"),
    (["--mode", "decode", "--mla", "--head-dim", "128"], "--head-dim"),
    (["--impl", "triton-gqa"], "--impl triton-gqa"),
  ],
  ids=lambda x: x if isinstance(x, str) else " ".join(x),
)
def test_bad_flags_are_usage_errors(argv, flag, capsys, tmp_path):
  with pytest.raises(SystemExit) as e:
    cli.main(["bench"] + argv + ["--out", str(tmp_path), "--no-progress"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert flag in err, err
  assert not os.listdir(tmp_path)  # nothing ran


def _records_by_impl(flags, impls, tmp_path):
  """`pallas-fa3 bench --mode decode <flags>` of `impls`, one quick run
  each, to exit 0; its records by implementation."""
  quick = ["--runs", "1", "--warmup", "0", "--input-sets", "1"]
  argv = ["bench", "--mode", "decode", *flags, *quick, "--no-progress"]
  argv += ["--no-plots", "--impl", *impls, "--out", str(tmp_path)]
  assert cli.main(argv) == 0
  rows = json.loads((tmp_path / "results.json").read_text())["records"]
  return {r["impl"]: r for r in rows}


def test_mla_sweep_reads_one_cache_and_names_the_baselines_it_skips(tmp_path):
  """`--mode decode --mla`: DeepSeek's 576 / 512 latent cache, one KV head;
  bytes count the one cache (V is its first 512 columns, read in place),
  tokens/s per step; the baselines that take two caches say why not."""
  flags = "--mla --batch 2 --cache-len 128 --page-size 64 --gqa 16".split()
  impls_ = ["blockwise", "reference", "xla", "triton-paged"]
  by_impl = _records_by_impl(flags, impls_, tmp_path)
  ours = by_impl["blockwise"]
  assert ours["status"] == "ok" and ours["head_dim"] == 576
  assert ours["kv_bytes"] == 2 * 128 * 576 * 2  # batch x L x d x bf16
  assert ours["tokens_per_s"] == pytest.approx(
    2 / (ours["time_median_ms"] / 1e3)
  )
  assert ours["max_abs_err"] < 0.02
  for name in ("xla", "triton-paged"):
    assert by_impl[name]["status"] == "skipped"
    assert "MLA's one 576-column cache" in by_impl[name]["reason"]
  assert "decode-mla-" in ours["spec"]


def test_speculative_rows_q_len_1_4_8_16_at_the_targets_points():
  """`--tags speculative`: q_len 1, 4, 8, 16 at batch 64 x 8k and 1 x 128k
  (issue 67), the same K/V bytes at every q_len, FLOPs by the causal pairs
  of the new tokens; the q_len 1 rows are the headline ones."""
  argv = ["--mode", "decode", "--tags", "speculative"]
  rows = command.grid(_parse(argv), "gpu")
  assert sorted((s.batch, s.cache_len, s.seq_q) for s in rows) == sorted(
    (b, n, q) for b, n in ((64, 8192), (1, 131072)) for q in (1, 4, 8, 16)
  )
  for s in rows:
    one = dataclasses.replace(s, seq_q=1)
    assert s.kv_bytes == one.kv_bytes
    # query i of q sees L - q + 1 + i keys: q L - q (q - 1) / 2 pairs
    pairs = s.seq_q * s.cache_len - s.seq_q * (s.seq_q - 1) // 2
    assert s.flops == s.batch * 2 * pairs * s.heads_q * 2 * s.head_dim
    assert (f"-q{s.seq_q}-" in s.name) == (s.seq_q > 1)
    assert ("headline" in s.tags) == (s.seq_q == 1)
  assert impls.REGISTRY["mosaic"].splits(rows[-1]) >= 1


def test_speculative_sweep_on_a_cpu(tmp_path):
  """`--q-len 4`: four causal new tokens per sequence through blockwise
  against the reference; the one-query baselines say why they skip."""
  flags = "--q-len 4 --batch 2 --cache-len 128 --page-size none --hidden 128"
  flags += " --head-dim 64 --gqa 2 --num-splits auto"
  by_impl = _records_by_impl(
    flags.split(), ["blockwise", "reference", "xla"], tmp_path
  )
  ours = by_impl["blockwise"]
  assert ours["status"] == "ok" and ours["seq_q"] == 4
  assert ours["max_abs_err"] < 0.05
  assert ours["tokens_per_s"] == pytest.approx(
    2 * 4 / (ours["time_median_ms"] / 1e3)
  )
  assert by_impl["xla"]["status"] == "skipped"
  assert "one query per sequence" in by_impl["xla"]["reason"]
  md = (tmp_path / report.MARKDOWN_FILE).read_text()
  assert "| 2x128 q4 |" in md


def test_batch_invariant_and_flex_rows(tmp_path):
  """`--batch-invariant --decode-flex alibi_doc`: ours with the options
  (blockwise against the reference with the same functions), the
  baselines say why they skip; the GPU grid tags issue 67's rows."""
  flags = "--batch-invariant --decode-flex alibi_doc --batch 2 --cache-len"
  flags += " 1024 --page-size 64 --hidden 128 --head-dim 64 --gqa 2"
  flags += " --num-splits auto"
  by_impl = _records_by_impl(
    flags.split(), ["blockwise", "reference", "xla"], tmp_path
  )
  ours = by_impl["blockwise"]
  assert ours["status"] == "ok" and ours["max_abs_err"] < 0.05
  assert ours["batch_invariant"] and ours["flex"] == "alibi_doc"
  assert ours["splits"] == 1  # 1024 keys: one fixed 2048-key run
  assert "batch_invariant" in by_impl["xla"]["reason"]
  grid = command.grid(
    _parse(["--mode", "decode", "--tags", "decode-modes"]), "gpu"
  )
  assert {(s.seq_q, s.batch_invariant, s.flex) for s in grid} >= {
    (4, False, None), (8, False, None), (16, False, None), (1, True, None),
    (1, False, "alibi_doc"),
  }  # fmt: skip
  for s in grid:  # the library checks each (shapes only)
    assert impls.REGISTRY["mosaic"].splits(s) >= 1
