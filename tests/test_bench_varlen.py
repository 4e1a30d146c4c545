"""`pallas-fa3 bench --mode varlen` (`tools/bench/varlen_case.py`): every
implementation runs and agrees with the float32 varlen call over the used
tokens; the layouts round-trip; the table and JSON are written; the mode
stands alone."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pallas_fa3.tools import cli
from pallas_fa3.tools.bench import varlen_case


def test_lengths_are_long_tailed_and_sum_to_the_tokens():
  lens = varlen_case.lengths(16, 65536)
  assert len(lens) == 16 and lens.min() >= 1
  assert abs(int(lens.sum()) - 65536) <= 16
  assert lens.max() > 4 * np.median(lens)  # a long tail


def test_every_implementation_runs_and_agrees(tmp_path):
  records = varlen_case.run_varlen(
    "cpu",
    runs=1,
    warmup=0,
    out_dir=str(tmp_path),
    shape=dict(sequences=6, seq=300, heads=2, head_dim=32),
    modes=("fwd",),
    printer=lambda _: None,
  )
  impls = {r["impl"] for r in records}
  assert {varlen_case.OURS, "ours segment ids", "ours padded"} <= impls
  assert "jax.nn xla (padded, seq lengths)" in impls
  assert all(r["status"] == "ok" for r in records), records
  for r in records:  # bf16 outputs against the float32 function
    assert r["max_err"] < 0.05, r
  saved = json.loads((tmp_path / "varlen.json").read_text())
  assert len(saved["records"]) == len(records) and len(saved["lengths"]) == 6
  assert "| ours padded | fwd |" in (tmp_path / "varlen.md").read_text()


@pytest.mark.slow
def test_cli_runs_varlen_alone(tmp_path, capsys):
  code = cli.main(
    ["bench", "--mode", "varlen", "--seq", "256", "--runs", "1",
     "--warmup", "0", "--out", str(tmp_path)]
  )  # fmt: skip
  assert code == 0
  assert "| ours varlen | fwd+bwd |" in capsys.readouterr().out
  with pytest.raises(SystemExit):
    cli.main(["bench", "--mode", "varlen", "fwd", "--out", str(tmp_path)])
