"""Tests of `pallas-fa3 bench --head-dim-v` (issue 32): value head dims
unlike the query's, from the flag to the records, tables and plots."""

import os

import jax
import jax.numpy as jnp
import pytest

from pallas_fa3.tools import cli
from pallas_fa3.tools.bench import (
  command,
  flops,
  fp8_case,
  impls,
  plots,
  report,
  runner,
  specs,
  terminal,
  timing,
)

_MLA = ["--head-dim", "192", "--head-dim-v", "128", "--hidden", "384"]


def _parse(argv):
  return cli.build_parser().parse_args(["bench"] + argv)


def _grid(argv, platform="cpu"):
  return specs.make_grid(command.grid_axes(_parse(argv), platform))


def _spec(d=192, dv=128, mode="fwd", causal=False, dtype="bf16", seq=256, b=2):
  return specs.BenchSpec(
    "t", b, seq, seq, 2, 2, d, causal, dtype, mode, head_dim_v=dv
  )


def test_flag_pairs_every_head_dim_with_every_value_head_dim():
  grid = _grid(_MLA + ["--seq", "512", "--causal", "--mode", "fwd"])
  assert [(s.head_dim, s.head_dim_v, s.heads_q) for s in grid] == [
    (192, 128, 2)
  ]
  (s,) = grid
  assert s.name == "fwd-bf16-b4-s512-h2x2-d192-dv128-causal"
  assert {"d192", "dv128"} <= set(s.tags)
  assert specs.select(grid, ["dv128"]) == grid
  pairs = _grid(
    ["--head-dim", "64", "128", "--head-dim-v", "64", "128", "--seq", "128"]
  )
  assert {(s.head_dim, s.head_dim_v) for s in pairs} == {
    (64, 64),
    (64, 128),
    (128, 64),
    (128, 128),
  }
  assert len({s.name for s in pairs}) == len(pairs)


def test_unset_means_equal_and_names_unchanged():
  grid = _grid(["--head-dim", "64", "--seq", "128"])
  assert grid and all(s.head_dim_v == s.head_dim == 64 for s in grid)
  assert all("dv" not in s.name and "dv64" not in s.tags for s in grid)
  same = _grid(["--head-dim", "64", "--head-dim-v", "64", "--seq", "128"])
  assert same == grid  # dv == d: the very same specs and names
  default = specs.BenchSpec("t", 1, 8, 8, 1, 1, 64, True, "bf16", "fwd")
  assert default.head_dim_v == 64
  assert default == specs.BenchSpec(
    "t", 1, 8, 8, 1, 1, 64, True, "bf16", "fwd", head_dim_v=64
  )


def test_inputs_give_v_and_dout_the_value_head_dim():
  spec = _spec(d=64, dv=32, seq=16)
  q, k, v, dout = timing.make_inputs(spec, "float32", 1, 0)[0]
  assert q.shape == k.shape == (2, 16, 2, 64)
  assert v.shape == dout.shape == (2, 16, 2, 32)


def test_flops_count_both_head_dims():
  b, s, hq, d, dv = 2, 256, 2, 192, 128
  fwd = 2 * b * s * s * hq * (d + dv)  # QK^T: 2 d, PV: 2 dv per pair
  assert flops.attention_flops(_spec()) == fwd == 167_772_160
  assert flops.attention_flops(_spec(), dv) == fwd
  assert 2 * flops.attention_flops(_spec(mode="bwd")) == 5 * fwd
  assert 2 * flops.attention_flops(_spec(mode="fwd+bwd")) == 7 * fwd
  causal = flops.attention_flops(_spec(causal=True))
  assert causal == 2 * b * (s * (s + 1) // 2) * hq * (d + dv)
  rec = runner.run_case(
    impls.REGISTRY["xla"], _spec(), [], dict(platform="cpu"), None
  )
  assert rec["flops"] == fwd and rec["head_dim_v"] == dv


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_baselines_that_take_one_head_dim_skip_saying_why(platform):
  spec = _spec(d=128, dv=64)
  for name in ("xla", "cudnn", "mgpu"):
    if platform == "cpu" and name != "xla":
      continue  # their reason there: no GPU
    reason = impls.REGISTRY[name].unsupported(spec, platform)
    assert "head_dim_v == head_dim" in reason, (name, reason)
  assert impls.REGISTRY["blockwise"].unsupported(spec, "cpu") is None
  assert impls.REGISTRY["xla"].unsupported(_spec(128, 128), "cpu") is None


def test_dot_product_attention_still_refuses_another_value_head_dim():
  # The reason the xla and cudnn baselines skip: if a JAX upgrade accepts
  # it, this fails and the skip in impls.py should go.
  q = jax.ShapeDtypeStruct((1, 8, 2, 64), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, 8, 2, 32), jnp.bfloat16)
  with pytest.raises(ValueError, match="value shape"):
    jax.eval_shape(
      lambda q, v: jax.nn.dot_product_attention(q, q, v, implementation="xla"),
      q,
      v,
    )


def test_fp8_skips_another_value_head_dim():
  reason = fp8_case.unsupported("blockwise", _spec(dtype="fp8"))
  assert reason.startswith("FP8 needs head_dim_v == head_dim"), reason
  assert fp8_case.unsupported("blockwise", _spec(128, 128, dtype="fp8")) is None


def test_interpret_case_keeps_the_value_head_dim():
  tiny = specs.tiny_spec_for(_grid(_MLA + ["--seq", "128"]))
  assert (tiny.head_dim, tiny.head_dim_v) == (192, 128)
  assert "-d192-dv128-" in tiny.name and tiny.correctness_only


@pytest.mark.parametrize(
  "argv,want",
  [
    (
      ["--head-dim-v", "512"],
      "--head-dim-v 512 is over 256: head dims are at most 256",
    ),
    (["--head-dim-v", "0"], "argument --head-dim-v: must be >= 1; got 0"),
    (["--head-dim-v", "64", "-3"], "argument --head-dim-v: must be >= 1"),
    (
      ["--mode", "decode", "--head-dim-v", "64"],
      "--head-dim-v (decode cases keep head_dim_v == head_dim) does not"
      " apply to --mode decode",
    ),
  ],
  ids=lambda x: " ".join(x) if isinstance(x, list) else "",
)
def test_usage_errors_name_the_flag(argv, want, capsys, tmp_path):
  with pytest.raises(SystemExit) as e:
    cli.main(
      ["bench", "--no-progress", "--no-plots", "--out", str(tmp_path), *argv]
    )
  assert e.value.code == 2
  err = " ".join(capsys.readouterr().err.split())
  assert want in err, err
  assert not os.listdir(tmp_path)  # nothing ran


def test_help_lists_the_flag(capsys):
  with pytest.raises(SystemExit):
    cli.main(["bench", "--help"])
  assert "--head-dim-v" in capsys.readouterr().out


_TINY = [
  "--impl",
  "blockwise",
  "reference",
  "xla",
  "--head-dim",
  "64",
  "--head-dim-v",
  "32",
  "--seq",
  "64",
  "--tokens",
  "64",
  "--hidden",
  "128",
  "--runs",
  "1",
  "--warmup",
  "0",
  "--input-sets",
  "1",
  "--no-progress",
  "--no-plots",
]


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("head_dim_v"))
  argv = _TINY + ["--mode", "fwd", "fwd+bwd", "--out", out]
  assert cli.main(["bench"] + argv) == 0
  return out


def test_tiny_sweep_records_carry_the_value_head_dim(tiny_sweep):
  rows = report.read_csv(os.path.join(tiny_sweep, report.CSV_FILE))
  assert len(rows) == 3 * 2 * 2  # impls x modes x masks
  assert all(r["head_dim"] == "64" and r["head_dim_v"] == "32" for r in rows)
  for r in rows:
    if r["impl"] == "xla":
      assert r["status"] == "skipped", r
      assert "head_dim_v == head_dim" in r["reason"], r
    else:
      assert r["status"] == "ok", r
      causal = r["causal"] == "True"
      spec = _spec(64, 32, r["mode"], causal, seq=64, b=1)
      assert int(r["flops"]) == flops.attention_flops(spec)
  with open(os.path.join(tiny_sweep, report.MARKDOWN_FILE)) as f:
    md = f.read()
  assert "| d/dv |" in md and "| 64/32 |" in md, md


def test_tiny_sweep_terminal_and_plots_show_both_head_dims(tiny_sweep):
  import json  # pylint: disable=g-import-not-at-top

  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  with open(os.path.join(tiny_sweep, report.JSON_FILE)) as f:
    result = json.load(f)
  text = terminal.text(result, "blockwise")
  assert "d/dv" in text and "64/32" in text, text
  made = plots.figures(result["records"], result["environment"])
  try:
    titles = [ax.get_title() for _, fig in made for ax in fig.axes]
    assert titles and all(t.startswith("d=64, dv=32, ") for t in titles)
  finally:
    for _, fig in made:
      plt.close(fig)


def test_fp8_sweep_skips_with_the_reason(tmp_path):
  argv = _TINY + ["--dtype", "fp8", "--mode", "fwd", "--out", str(tmp_path)]
  assert cli.main(["bench"] + argv) == 0
  rows = report.read_csv(os.path.join(tmp_path, report.CSV_FILE))
  blockwise = [r for r in rows if r["impl"] == "blockwise"]
  assert blockwise and all(r["status"] == "skipped" for r in rows)
  assert all(
    "FP8 needs head_dim_v == head_dim" in r["reason"] for r in blockwise
  )
