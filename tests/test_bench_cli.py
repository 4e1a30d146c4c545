"""Tests of the `pallas-fa3 bench` flags: spec selection, usage errors,
head-dim checks and the interpret correctness case the filters pick."""

import itertools

import jax
import jax.numpy as jnp
import pytest

import pallas_fa3
from pallas_fa3.tools import cli
from pallas_fa3.tools.bench import (
  command,
  impls,
  runner,
  specs,
)


def _parse(argv):
  return cli.build_parser().parse_args(["bench"] + argv)


def _interpret_case(argv):
  grid = specs.make_grid(command.grid_axes(_parse(argv), "cpu"))
  cases = [
    s
    for i, s in runner.plan(grid, ["blockwise", "interpret"])
    if i.name == "interpret"
  ]
  assert len(cases) == 1
  return cases[0]


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
    "--window",
    "--softcap",
    "--sinks",
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
