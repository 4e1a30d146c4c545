"""Tests of `pallas-fa3 bench --docs N`: the flag, the FLOPs of packed
documents against a brute-force pair count, the segment ids given to our
implementations, and a tiny sweep whose rows name the docs and whose
baselines are skipped with a reason."""

import csv
import json
import os

import numpy as np
import pytest

from pallas_fa3.tools import cli
from pallas_fa3.tools.bench import (
  command,
  flops,
  impls,
  options,
  specs,
  terminal,
  timing,
)


def _parse(argv):
  return cli.build_parser().parse_args(["bench"] + argv)


def _brute_force_pairs(sq, skv, causal, window, docs):
  """The library's mask: bottom-right causal/window on positions, and
  equal document ids (from `segment_ids_for`)."""
  spec = specs.BenchSpec(
    "t", 1, sq, skv, 1, 1, 8, causal, "bf16", "fwd", docs=docs
  )
  q_ids, kv_ids = (np.asarray(x)[0] for x in options.segment_ids_for(spec))
  p = np.arange(sq)[:, None] + skv - sq
  j = np.arange(skv)[None, :]
  seen = q_ids[:, None] == kv_ids[None, :]
  if causal:
    seen &= j <= p
  left, right = window or (None, None)
  if left is not None:
    seen &= j >= p - left
  if right is not None:
    seen &= j <= p + right
  return int(seen.sum())


def test_docs_flag():
  args = _parse(["--docs", "4", "--seq", "64", "128"])
  assert args.docs == 4
  grid = specs.make_grid(command.grid_axes(args, "cpu"))
  assert grid and all(s.docs == 4 and s.modifiers == ("docs",) for s in grid)
  assert all(s.name.endswith("-docs4") and "docs" in s.tags for s in grid)
  tiny = specs.tiny_spec_for(grid)
  assert tiny.docs == 4 and tiny.correctness_only
  plain = specs.make_grid(command.grid_axes(_parse([]), "cpu"))
  assert all(s.docs is None for s in plain)


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "four", "65"])
def test_bad_docs_are_usage_errors(value, capsys, tmp_path):
  with pytest.raises(SystemExit) as e:
    cli.main(
      [
        "bench",
        "--no-progress",
        "--no-plots",
        "--out",
        str(tmp_path),
        "--seq",
        "64",
        "--docs",
        value,
      ]
    )
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "usage: pallas-fa3 bench" in err and "--docs" in err, err


def test_doc_lengths_and_ids():
  assert flops.doc_lengths(4, 10) == [2, 2, 2, 4]
  assert flops.doc_lengths(1, 7) == [7]
  assert flops.doc_lengths(3, 3) == [1, 1, 1]
  spec = specs.BenchSpec("t", 2, 6, 12, 1, 1, 8, True, "bf16", "fwd", docs=3)
  q_ids, kv_ids = options.segment_ids_for(spec)
  assert q_ids.tolist() == [[0, 0, 1, 1, 2, 2]] * 2
  assert kv_ids.tolist() == [[0] * 4 + [1] * 4 + [2] * 4] * 2
  with pytest.raises(ValueError, match="docs must be"):
    specs.BenchSpec("t", 1, 4, 4, 1, 1, 8, True, "bf16", "fwd", docs=5)
  with pytest.raises(ValueError, match="docs must be"):
    specs.BenchSpec("t", 1, 4, 4, 1, 1, 8, True, "bf16", "fwd", docs=0)


@pytest.mark.parametrize(
  "sq,skv", [(1, 1), (7, 7), (64, 64), (37, 37), (20, 50), (50, 20)]
)
@pytest.mark.parametrize("causal", [False, True])
def test_document_pairs_match_brute_force(sq, skv, causal):
  for docs in (d for d in (1, 2, 3, 5) if d <= min(sq, skv)):
    for window in (None, (0, 0), (3, 2), (4, 0), (None, 1), (2, None)):
      got = flops.document_pairs(sq, skv, docs, causal, window)
      want = _brute_force_pairs(sq, skv, causal, window, docs)
      assert got == want, (docs, window)


def test_self_attention_pairs_are_per_document_causal():
  # 4 documents of 16 in 64: 4 causal triangles of 16.
  assert flops.document_pairs(64, 64, 4, True) == 4 * 16 * 17 // 2
  spec = specs.BenchSpec(
    "t", 2, 64, 64, 3, 3, 16, True, "bf16", "fwd+bwd", docs=4
  )
  assert 2 * flops.attention_flops(spec) == 7 * 4 * 2 * 4 * 136 * 3 * 16


def test_ours_get_the_segment_ids():
  spec = specs.BenchSpec("t", 1, 64, 64, 2, 2, 16, True, "fp32", "fwd", docs=4)
  q, k, v, _ = timing.make_inputs(spec, "float32", 1, 0)[0]
  out = lambda impl, s: np.asarray(impls.REGISTRY[impl].build(s)(q, k, v))
  want = out("reference", spec)
  whole = specs.BenchSpec("t", 1, 64, 64, 2, 2, 16, True, "fp32", "fwd")
  assert np.max(np.abs(want - out("reference", whole))) > 0.1
  np.testing.assert_allclose(out("blockwise", spec), want, atol=2e-5)


def test_baselines_without_segment_ids_say_why():
  spec = specs.BenchSpec("t", 1, 64, 64, 2, 2, 64, True, "bf16", "fwd", docs=4)
  assert "no docs" in impls.REGISTRY["xla"].unsupported(spec, "cpu")
  assert "no docs" in impls.REGISTRY["cudnn"].unsupported(spec, "gpu")
  assert options.modifier_label((4, 0), None, False, 3) == "window 4,0, docs 3"


@pytest.fixture(scope="module")
def docs_sweep(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("bench"))
  argv = (
    "--impl blockwise reference xla --dtype bf16 --head-dim 32 --seq 64"
    " --mode fwd --tokens 64 --hidden 64 --docs 4 --runs 1 --warmup 0"
    " --input-sets 1 --no-progress --no-plots --out"
  ).split() + [out]
  assert cli.main(["bench"] + argv) == 0
  return out


def test_docs_sweep_rows_and_skips(docs_sweep):
  with open(os.path.join(docs_sweep, "results.csv"), newline="") as f:
    rows = list(csv.DictReader(f))
  assert rows and all(r["docs"] == "4" for r in rows)
  with open(os.path.join(docs_sweep, "results.json")) as f:
    result = json.load(f)
  records = result["records"]
  assert all(r["docs"] == 4 and r["spec"].endswith("-docs4") for r in records)
  ok = {r["impl"] for r in records if r["status"] == "ok"}
  assert ok == {"blockwise", "reference"}
  xla = [r for r in records if r["impl"] == "xla"]
  assert xla and all(r["status"] == "skipped" for r in xla)
  assert all("no docs option" in r["reason"] for r in xla)
  for r in records:
    pairs = _brute_force_pairs(64, 64, r["causal"], None, 4)
    assert r["flops"] == 4 * r["batch"] * pairs * r["heads_q"] * 32
  blockwise = [r for r in records if r["impl"] == "blockwise"]
  assert all(
    r["max_abs_err"] is None or r["max_abs_err"] < 0.05 for r in blockwise
  )
  text = terminal.text(result, "blockwise")
  assert "fwd bf16, docs 4:" in text, text
