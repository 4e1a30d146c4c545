"""Tests of the benchmark harness (pallas_fa3/bench) without a sweep: the
FLOPs model, grids, baselines' skip reasons, the runner's time budget and
correctness-only records, and the CPU default grid."""

import jax
import numpy as np
import pytest

from pallas_fa3.tools.bench import (
  flops,
  impls,
  report,
  runner,
  specs,
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


def test_baselines_skip_with_reasons():
  rect = _spec(64, 128)
  assert "top-left" in impls.REGISTRY["xla"].unsupported(rect, "cpu")
  assert impls.REGISTRY["xla"].unsupported(_spec(64, 64), "cpu") is None
  assert "GPU" in impls.REGISTRY["cudnn"].unsupported(_spec(64, 64), "cpu")
  assert "GPU" in impls.REGISTRY["mgpu"].unsupported(_spec(64, 64), "cpu")
  assert "correctness" in impls.REGISTRY["interpret"].unsupported(
    _spec(64, 64), "cpu"
  )


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


def test_cpu_default_is_small():
  # The CPU default was 24 shapes x 3 implementations (73 compiled cases,
  # 439 s for a new user on 2 cores); the README promises about a minute.
  grid = specs.make_grid(specs.CPU_AXES)
  cases = runner.plan(grid, runner.DEFAULT_IMPLS["cpu"])
  assert len(cases) <= 25
  assert sum(flops.attention_flops(s) for s in grid) <= 20e9
  # Still a comparison: blockwise, reference and XLA at two lengths, both
  # masks, forward and forward+backward. The interpret kernel check runs
  # when --impl names it (it needs 6 XLA CPU threads: on 2 cores the
  # default run showed it in the progress bar and skipped it with a
  # PJRT_NPROC paragraph the user had not asked for).
  assert {i.name for i, _ in cases} == {"blockwise", "reference", "xla"}
  assert (
    len({s.seq_q for s in grid}) >= 2
    and {s.causal for s in grid} == {False, True}
    and {s.mode for s in grid} == {"fwd", "fwd+bwd"}
  )
  tiny = [s for i, s in runner.plan(grid, ["interpret"])]
  assert len(tiny) == 1 and impls.REGISTRY["interpret"].unsupported(
    tiny[0], "cpu"
  ) in (None, "no GPU")
  assert runner.DEFAULT_RUNS["cpu"] <= 3


def test_mgpu_inputs_are_float16_with_their_cotangent():
  # attention_mgpu runs on float16 copies of bf16 inputs; the backward's
  # dout must follow, or the pullback rejects a bf16 cotangent.
  from pallas_fa3.tools.bench import timing

  spec = _spec(64, 64, mode="bwd", b=1, hq=2, d=16)
  (inputs,) = timing.make_inputs(spec, "bfloat16", 1, 0)
  prepared = impls.REGISTRY["mgpu"].prepare(spec, *inputs)
  assert [x.dtype for x in prepared] == ["float16"] * 4
  q, k, v, dout = prepared
  _, pullback = jax.vjp(lambda q, k, v: q @ k.mT @ v, q, k, v)
  assert pullback(dout)[0].dtype == "float16"
