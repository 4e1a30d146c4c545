"""Tier 3: the deviceless sm_90a compile (Mosaic + ptxas on a CPU, no driver).

Needs the CUDA plugin, PJRT and ptxas at the installed jax version (the
`aot` extra: `jax[cuda13-local]` and the H200's ptxas, CUDA 13.0); skipped,
saying why, where they are absent. The default run compiles the default
config of every kernel at head dims 128 and 256 and their head-dim pairs,
causal (`pallas-fa3 aot --defaults --causal-only --head-dims 128 256`), and
checks its spills and static profile;
every default, causal and not, and every config of every kernel space are
the `slow` sweeps (`pallas-fa3 aot`, `--defaults`, `--fp8`, `--modifiers`,
`--backward-shapes`). The PTX profile parser itself is tested on small
hand-written PTX in tests/test_ptx_profile.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from pallas_fa3.tools.aot import command as aot, ptx_profile

_needs_packages = pytest.mark.skipif(
  aot.missing_packages() is not None, reason=str(aot.missing_packages())
)


@_needs_packages
def test_aot_flags_a_compiled_oversubscribed_split():
  """The FP8 kernel's old split (240/32 in a 384-thread CTA), built into
  the bf16 forward and compiled for sm_90a: ptxas compiles it without a
  word and the pool check refuses it; the kernel as built passes."""
  code = """
import jax.numpy as jnp
from pallas_fa3.tools.aot import command as aot
from pallas_fa3.kernels.sm90 import config, forward
from pallas_fa3.spec import make_spec
import jax
q = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16)
spec = make_spec(q, q, q, causal=True)
cfg = config.default_forward_config(spec)
print("as built:", aot.budget_problems(aot.compile_forward(spec, cfg)))
forward.PRODUCER_REGS = 32
print("240/32:", aot.budget_problems(aot.compile_forward(spec, cfg)))
"""
  run = _run_python(code)
  built, bad = run.stdout.strip().splitlines()[-2:]
  assert built == "as built: []", run.stdout
  assert "512 registers" in bad and "owns 504" in bad, run.stdout


def _run_python(code: str) -> subprocess.CompletedProcess:
  """`python -c code` in a fresh process (as `_run_aot`), asserted to exit 0."""
  run = subprocess.run(
    [sys.executable, "-c", code],
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert run.returncode == 0, run.stderr[-4000:]
  return run


def _run_aot(
  *flags: str, timeout: int
) -> tuple[subprocess.CompletedProcess, list]:
  # A fresh process: the CUDA plugin must not claim a GPU for a deviceless run.
  out = f"/tmp/pallas_fa3_aot_{os.getpid()}_{'_'.join(flags) or 'all'}.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  run = subprocess.run(
    [
      sys.executable,
      "-m",
      "pallas_fa3.tools.cli",
      "aot",
      "--json",
      out,
      *flags,
    ],
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  reports = json.loads(open(out).read()) if os.path.exists(out) else []
  return run, reports


DEFAULT_TIER_HEAD_DIMS = (128, 256)


@pytest.fixture(scope="module")
def default_reports():
  # Causal only (their kernels hold the unmasked steps' code too), at head
  # dims 128 and 256 (the register and shared-memory extreme) with their
  # head-dim pairs; every default, causal and not, every head dim, under
  # -m slow.
  run, reports = _run_aot(
    "--defaults",
    "--causal-only",
    "--head-dims",
    *map(str, DEFAULT_TIER_HEAD_DIMS),
    "--profile",
    timeout=1700,
  )
  assert reports, run.stdout[-4000:] + run.stderr[-4000:]
  return run, reports


def _spills(reports):
  return {
    r["name"]: (r["spill_store_bytes"], r["spill_load_bytes"])
    for r in reports
    if r["spill_store_bytes"] or r["spill_load_bytes"]
  }


def _over_budget(reports):
  """Kernels whose setmaxnreg split their CTA's register pool cannot
  satisfy, or whose named barriers cannot work as written (JSON profiles
  back into `KernelProfile`s)."""
  out = {}
  for r in reports:
    for k in r["kernels"]:
      profile = ptx_profile.KernelProfile(**k)
      problems = ptx_profile.register_problems(profile)
      problems += ptx_profile.named_barrier_problems(profile)
      if problems:
        out[k["name"]] = problems
  return out


@_needs_packages
@pytest.mark.timeout(1800)
def test_default_configs_compile_without_spills(default_reports):
  run, reports = default_reports
  assert _spills(reports) == {}
  assert _over_budget(reports) == {}
  assert run.returncode == 0 and "0 config(s) spill" in run.stdout
  kinds = {k["name"].split()[0] for r in reports for k in r["kernels"]}
  assert kinds == {
    "fa3_fwd",
    "fa3_fwd_fp8",
    "fa3_fwd_tangent",
    "fa3_bwd_dkdv",
    "fa3_bwd_dq",
    "fp8_quantize",
    "fa3_decode",
  }


@_needs_packages
@pytest.mark.timeout(1800)
def test_default_profiles_describe_warp_specialized_wgmma_kernels(
  default_reports,
):
  run, reports = default_reports
  assert "| kernel | threads |" in run.stdout  # the --profile table
  for r in reports:
    for k in r["kernels"]:
      if k["name"].startswith("fp8_quantize"):
        # One tile per CTA, a warpgroup per 64 output rows: TMA in, the
        # rotation (or V's transpose) on the tensor cores, TMA out.
        assert k["threads"] in (128, 256, 512), k["name"]
        assert k["wgmma"] and k["tma"]["load"] == 2, k["name"]
        assert k["tma"]["store"] >= 2, k["name"]
        continue
      assert k["threads"] in (256, 384), k["name"]
      assert k["smem_bytes"] and k["smem_bytes"] <= 227 * 1024, k["name"]
      assert k["wgmma"] and k["tma"]["load"] > 0, k["name"]
      assert any(s.startswith("dec") for s in k["setmaxnreg"]), k["name"]
      # The steady-state loop issues wgmma and synchronizes by mbarrier.
      assert k["loop"]["wgmma"] > 0 and k["loop"]["mbarrier"] > 0, k["name"]
      if k["name"].startswith("fa3_fwd_tangent"):
        # S waited alone with S' in flight (its two chunks: wait_group 2),
        # S' with P V' in flight (1); P = exp2 of the scores less the lse;
        # K with K' and V with V' on one barrier each (2 copies of a
        # warpgroup's 128 arrivals, as are the two consumers' releases).
        assert k["wait_group"].get("2", 0) > 0, k["name"]
        assert k["wait_group"].get("1", 0) > 0, k["name"]
        assert k["loop"]["ex2"] > 0 and not k["wgmma_serialized"], k["name"]
        assert 256 in k["mbarrier_arrival_counts"], k["name"]
        continue
      if k["name"].startswith("fa3_fwd"):
        # Online softmax: one exp2 per score, its argument scaled by a
        # multiply (FMUL then FADD since large logits stay finite, issue 31).
        loop = k["loop"]
        assert loop["ex2"] > 0, k["name"]
        assert loop["fmul"] + loop["ffma"] >= loop["ex2"], k["name"]
        # FA3's order: P V stays in flight past the wait for the next S
        # (wait_group 1), ptxas keeps the wgmma asynchronous, and the
        # pingpong hand-off is by named barrier.
        assert k["wait_group"].get("1", 0) > 0, k["name"]
        assert not k["wgmma_serialized"], k["name"]
        assert k["loop"]["bar"] >= 2, k["name"]
        # Slot releases count warpgroups (one elected arrival each); only
        # Pallas's TMA barriers count 128 threads.
        assert 2 in k["mbarrier_arrival_counts"], k["name"]
        assert k["max_mbarrier_arrivals"] <= 128, k["name"]
        # The producer's step loads one K and one V tile (a loop unrolled
        # over the ring shows its stages' steps).
        tiles = re.match(
          r"fa3_fwd d(\d+)(?:/(\d+))? .*?\d+x(\d+)x(\d+)", k["name"]
        )
        if tiles:
          d, bkv, stages = int(tiles[1]), int(tiles[3]), int(tiles[4])
          step = bkv * (d + int(tiles[2] or d)) * 2
          total = k["tma_loop_bytes"][0]
          assert total % step == 0 and total <= stages * step, k["name"]
      splits = re.search(r" kv\d/(\d)", k["name"])
      if splits and k["name"].startswith("fa3_bwd_dkdv"):
        # S^T (or S) waited alone while dP^T computes: the wait leaves
        # dP^T's wgmma groups in flight, one per head-dim chunk
        # (`ops.score_pair`); never wait_group 1 after a two-chunk dP^T.
        splits = int(splits.group(1))
        if splits == 2:
          assert "1" not in k["wait_group"], k["name"]
          assert k["wait_group"].get("2", 0) > 0, k["name"]
      if k["name"].endswith("fused"):
        # One backward kernel: dQ by TMA reduce-add; S^T waited alone
        # while dP^T computes; asynchronous wgmma; slot releases by
        # warpgroup.
        assert k["tma"]["reduce"] > 0, k["name"]
        assert k["wait_group"].get(str(splits), 0) > 0, k["name"]
        assert not k["wgmma_serialized"], k["name"]
        assert 2 in k["mbarrier_arrival_counts"], k["name"]
  # The default backward is fused at every head dim (and head-dim pair)
  # but those with a 256-wide query side.
  assert _fused(reports) == {"d128", "d128/64"}


def _fused(reports):
  """The head dims (d or d/dv) whose backward compiled as one kernel."""
  return {
    k["name"].split()[1]
    for r in reports
    for k in r["kernels"]
    if k["name"].endswith("fused")
  }


@_needs_packages
@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize(
  "flags",
  [(), ("--fp8",), ("--modifiers",), ("--backward-shapes",), ("--defaults",)],
  ids=["bf16", "fp8", "modifiers", "backward-shapes", "defaults"],
)
def test_every_config_of_the_spaces_compiles_without_spills(flags):
  run, reports = _run_aot(*flags, timeout=3500)
  assert reports, run.stdout[-4000:] + run.stderr[-4000:]
  spills = _spills(reports)
  if flags == ("--modifiers",):
    # Known and left (benchmarks/RESULTS.md, issues 19, 20 and 35): the d256
    # dK/dV kernel with a two-sided window (8 B), segment ids (8 B), or
    # segment ids and softcap (60 B); nothing else may spill.
    spills = {
      name: b
      for name, b in spills.items()
      if not (name.split()[1] == "d=256" and max(b) <= 60)
      or not name.startswith(("bwd ", "bwd-det "))
    }
  assert spills == {}
  assert _over_budget(reports) == {}
  if flags == ("--defaults",):
    # Fused at every head dim and pair but those 256 wide on the query side.
    assert _fused(reports) == {
      "d64",
      "d96",
      "d128",
      "d192",
      "d192/128",
      "d128/64",
      "d64/128",
    }


@_needs_packages
def test_flex_items_compile_without_spills():
  """ALiBi and a block mask, which spilled 8-16 B at d256 in FA3's order,
  compile with 0 spills in the default's (`overlap=False`); a learnable
  per-key bias, its gradient summed by the dK/dV kernel (at d128 a lone
  consumer, the head dim split across CTAs), with 0; the fused backward
  with a block mask at d64, with 0; the d128 dK/dV and dQ pair with a bias
  beside segment ids, with 0. One process."""
  code = """
from pallas_fa3.tools.aot import sweeps
for fn, spec, cfg in sweeps.flex_sweep():
  label, d = fn.keywords["label"].strip(), spec.head_dim
  if d == 256 and label in ("flex=alibi", "flex=block_mask"):
    if fn.func.__name__ == "compile_forward":
      r = fn(spec, cfg)
      print(label, cfg.overlap, r.spill_store_bytes, r.spill_load_bytes)
  if "per-key" in label and d in (64, 128):
    r = fn(spec, cfg)
    print(d, cfg.dkdv_consumers, r.spill_store_bytes, r.spill_load_bytes)
  if d == 128 and label == "flex=bias segment_ids" and spec.deterministic:
    r = fn(spec, cfg)
    print("segmented", d, r.spill_store_bytes, r.spill_load_bytes)
  fused = fn.func.__name__ == "compile_backward" and not spec.deterministic
  if fused and d == 64 and label == "flex=block_mask":
    r = fn(spec, cfg)
    print("fused", d, r.spill_store_bytes, r.spill_load_bytes)
"""
  run = _run_python(code)
  rows = [line.split() for line in run.stdout.strip().splitlines()[-6:]]
  assert sorted(rows) == sorted(
    [
      ["flex=alibi", "False", "0", "0"],
      ["flex=block_mask", "False", "0", "0"],
      ["64", "2", "0", "0"],
      ["128", "1", "0", "0"],
      ["fused", "64", "0", "0"],
      ["segmented", "128", "0", "0"],
    ]
  ), run.stdout


@_needs_packages
@pytest.mark.parametrize("head_dim", [128, 256])
def test_fp8_call_temporaries_stay_below_its_arguments(head_dim):
  """The quantization kernel writes e4m3 and scales only: the fp8=True call
  at 16k tokens, hidden 2048 needs at most 0.6x its bf16 arguments (the
  e4m3 Q, K, V^T are 0.5x); the pure-JAX pass needed 2.0x."""
  code = (
    "from pallas_fa3.tools.aot import fp8 as aot_fp8;"
    f" print(*aot_fp8.fp8_call_memory({head_dim}))"
  )
  run = _run_python(code)
  args, temp = map(int, run.stdout.split()[-2:])
  assert temp <= 0.6 * args, (temp, args)


def test_causal_only_needs_defaults():
  from pallas_fa3.tools import cli

  with pytest.raises(
    SystemExit, match="--causal-only selects within --defaults"
  ):
    cli.main(["aot", "--causal-only"])


@pytest.mark.parametrize(
  "argv,message",
  [
    (["--head-dims", "128"], "--head-dims selects within --defaults"),
    (["--defaults", "--head-dims", "80"], r"--head-dims \[80\] not among"),
  ],
)
def test_head_dims_are_checked(argv, message):
  from pallas_fa3.tools import cli

  with pytest.raises(SystemExit, match=message):
    cli.main(["aot", *argv])


def test_head_dims_select_the_defaults():
  from pallas_fa3.tools.aot import sweeps as aot_sweeps

  every = list(aot_sweeps.defaults_sweep(causal_only=True))
  some = list(aot_sweeps.defaults_sweep(causal_only=True, head_dims=(128,)))
  assert {spec.head_dim for _, spec, _ in some} == {128}
  assert len(some) == sum(spec.head_dim == 128 for _, spec, _ in every) > 0
  # Pairs keep their value head dim; the e4m3 decode cache is d128's.
  assert {(s.head_dim, s.head_dim_v) for _, s, _ in some} >= {(128, 64)}


_PIPELINED_DKDV = """
import dataclasses, json, sys
import jax
from pallas_fa3.kernels.sm90 import config_backward
from pallas_fa3.spec import make_spec
from pallas_fa3.tools.aot import compiler
q = jax.ShapeDtypeStruct((1, 4096, 8, 128), "bfloat16")
spec = make_spec(q, q, q, causal=False, deterministic=True)
rep = compiler.compile_backward(spec, config_backward.default_backward_config(spec))
print(json.dumps([dataclasses.asdict(k) for k in rep.kernels]))
"""


@_needs_packages
@pytest.mark.timeout(900)
def test_pipelined_deterministic_dkdv_kernel_compiles_asynchronous():
  # The deterministic d128 dK/dV kernel without a mask keeps dK's wgmma in
  # flight into the next step (`dkdv_consumer`'s `pipelined`), a form the
  # causal default tier does not compile: 0 spills, ptxas keeps the wgmma
  # asynchronous, and a step waits at depth 1 (dP^T under P^T dO).
  run = _run_python(_PIPELINED_DKDV)
  kernels = json.loads(run.stdout.strip().splitlines()[-1])
  dkdv = [k for k in kernels if k["name"].startswith("fa3_bwd_dkdv")]
  assert len(dkdv) == 1, [k["name"] for k in kernels]
  for k in kernels:
    assert (k["spill_store_bytes"], k["spill_load_bytes"]) == (0, 0), k["name"]
    assert not k["wgmma_serialized"], k["name"]
  assert dkdv[0]["wait_group"].get("1", 0) > 0
