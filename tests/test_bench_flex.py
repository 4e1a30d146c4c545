"""`pallas-fa3 bench --mode flex` (`tools/bench/flex_case.py`): every case
and implementation runs and agrees with the float32 function; the table
and JSON are written; the mode stands alone."""

from __future__ import annotations

import json

import pytest

from pallas_fa3.tools import cli
from pallas_fa3.tools.bench import flex_case


def test_every_case_runs_and_agrees(tmp_path):
  records = flex_case.run_flex(
    "cpu",
    runs=1,
    warmup=0,
    out_dir=str(tmp_path),
    shape=dict(batch=1, seq=256, heads=2, head_dim=64),
    modes=("fwd",),
    printer=lambda _: None,
  )
  assert {r["case"] for r in records} == set(flex_case.CASES)
  assert all(r["status"] == "ok" for r in records), records
  for r in records:  # bf16 outputs against the float32 function
    assert r["max_err"] < 0.05, r
  impls = {r["impl"] for r in records if r["case"] == "document"}
  assert {"ours", "ours builtin (segment_ids)", "jax.nn xla"} <= impls
  saved = json.loads((tmp_path / "flex.json").read_text())
  assert len(saved["records"]) == len(records)
  assert "| alibi | ours | fwd |" in (tmp_path / "flex.md").read_text()


@pytest.mark.slow
def test_cli_runs_flex_alone(tmp_path, capsys):
  code = cli.main(
    ["bench", "--mode", "flex", "--seq", "128", "--runs", "1",
     "--warmup", "0", "--out", str(tmp_path)]
  )  # fmt: skip
  assert code == 0
  assert "| bias | ours | fwd+bwd |" in capsys.readouterr().out
  with pytest.raises(SystemExit):
    cli.main(["bench", "--mode", "flex", "fwd", "--out", str(tmp_path)])
