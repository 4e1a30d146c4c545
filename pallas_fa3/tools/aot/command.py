"""Deviceless ahead-of-time compile of the sm90 kernels for an H200 (sm_90a),
Mosaic + ptxas on a CPU: every supported kernel config is compiled and
ptxas's report read, so register spills are caught without a GPU (needs
the package's `aot` extra). The command fails on any spill and on any
setmaxnreg split the CTA's register pool cannot satisfy; `--profile` adds
each kernel's static PTX profile. Also `JAX_PLATFORMS=cpu python -m
pallas_fa3.tools.aot`; what is compiled: `pallas_fa3.tools.aot.sweeps`;
more: docs/kernels.md#verification-without-a-gpu.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
from collections.abc import Iterator

from pallas_fa3.tools.aot import ptx_profile
from pallas_fa3.tools.aot.compiler import (  # re-exported: the tier's API
  CompileReport as CompileReport,
  SweepItem,
  budget_problems as budget_problems,
  compile_backward as compile_backward,
  compile_forward as compile_forward,
  h200_mesh as h200_mesh,
  missing_packages as missing_packages,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The flags of `pallas-fa3 aot` / `python -m pallas_fa3.tools.aot`."""
  from pallas_fa3.tools.aot.sweeps import PROFILE_SHAPE

  parser.add_argument(
    "--max-configs", type=int, default=None, help="stop after this many configs"
  )
  parser.add_argument(
    "--json",
    default=None,
    metavar="PATH",
    help="also write every report (and profile) to PATH",
  )
  parser.add_argument(
    "--profile",
    action="store_true",
    help="print each kernel's static profile (a Markdown"
    " table: threads, registers, spills, shared memory,"
    " wgmma shapes, wait_group depths, barriers, TMA, the"
    " steady-state loop's instruction mix)",
  )
  parser.add_argument(
    "--causal-only",
    action="store_true",
    help="with --defaults: the causal calls only (their kernels hold the"
    " unmasked steps too; the default test tier's quick check)",
  )
  parser.add_argument(
    "--head-dims",
    type=int,
    nargs="+",
    default=None,
    metavar="D",
    help="with --defaults: only these query head dims (and the head-dim"
    " pairs and decode defaults whose query head dim is one of them)",
  )
  sweeps = parser.add_mutually_exclusive_group()
  sweeps.add_argument(
    "--defaults",
    action="store_true",
    help="only the default config of each kernel at every"
    f" head dim, bf16 at {PROFILE_SHAPE} (b, s, hq, hk),"
    " causal and not",
  )
  sweeps.add_argument(
    "--fp8",
    action="store_true",
    help="sweep the FP8 forward kernel (with and without Q's residual) and"
    " the quantization kernel instead",
  )
  sweeps.add_argument(
    "--modifiers",
    action="store_true",
    help="the default forward and backward kernels of every head dim with"
    " windows, softcap and sinks (MODIFIER_CASES) instead",
  )
  sweeps.add_argument(
    "--flex",
    action="store_true",
    help="the default forward kernel of every head dim with each ready-made"
    " score_mod / mask_mod, a dense bias and a block mask (FLEX_CASES)"
    " instead",
  )
  sweeps.add_argument(
    "--decode",
    action="store_true",
    help="sweep the decode kernel (flash_attention_with_kvcache): head dims"
    " 64/128/256, contiguous and paged caches, GQA groups 1-16, seq_q 1-16,"
    " every block/stage config at d128, window and softcap",
  )
  sweeps.add_argument(
    "--backward-shapes",
    action="store_true",
    help="sweep every backward config over more shapes"
    " (BACKWARD_SHAPES, causal and not, bf16) instead",
  )


def _items(args: argparse.Namespace) -> Iterator[SweepItem]:
  from pallas_fa3.tools.aot import sweeps

  if args.fp8:
    return sweeps.fp8_forward_sweep()
  if args.decode:
    from pallas_fa3.tools.aot import decode as aot_decode  # pylint: disable=g-import-not-at-top

    return aot_decode.decode_sweep()
  if args.defaults:
    return sweeps.defaults_sweep(
      causal_only=args.causal_only, head_dims=args.head_dims
    )
  if args.backward_shapes:
    return sweeps.backward_shapes_sweep()
  if args.modifiers:
    return sweeps.modifiers_sweep()
  if args.flex:
    return sweeps.flex_sweep()
  return sweeps.sweep()


def run(args: argparse.Namespace) -> int:
  """Compiles the selected sweep; 0 without spills, 1 with, 2 if the CUDA
  packages are missing."""
  if getattr(args, "causal_only", False) and not args.defaults:
    raise SystemExit("aot: --causal-only selects within --defaults only")
  head_dims = getattr(args, "head_dims", None)
  if head_dims is not None:
    from pallas_fa3.kernels.sm90.config import KERNEL_HEAD_DIMS

    if not args.defaults:
      raise SystemExit("aot: --head-dims selects within --defaults only")
    unknown = sorted(set(head_dims) - set(KERNEL_HEAD_DIMS))
    if unknown:
      raise SystemExit(
        f"aot: --head-dims {unknown} not among the kernels' head dims"
        f" {KERNEL_HEAD_DIMS}"
      )
  reason = missing_packages()
  if reason:
    print(f"skipped: {reason}")
    return 2
  mesh, reports = h200_mesh(), []
  for i, (compile_fn, spec, config) in enumerate(_items(args)):
    if args.max_configs is not None and i >= args.max_configs:
      break
    report = compile_fn(spec, config, mesh)
    reports.append(report)
    bad = report.spill_store_bytes or report.spill_load_bytes
    over = budget_problems(report)
    status = "SPILL" if bad else "REGS" if over else "ok"
    print(
      f"{status:5} regs={report.registers:3d}"
      f" spill_st={report.spill_store_bytes} spill_ld="
      f"{report.spill_load_bytes}  {report.name}",
      flush=True,
    )
    for problem in over:
      print(f"      {problem}", flush=True)
  failures = sum(
    bool(r.spill_store_bytes or r.spill_load_bytes or budget_problems(r))
    for r in reports
  )
  if args.profile:
    print(ptx_profile.table([k for r in reports for k in r.kernels]))
  if args.json:
    import json

    pathlib.Path(args.json).write_text(
      json.dumps([dataclasses.asdict(r) for r in reports], indent=1)
    )
  print(f"{failures} config(s) spill or oversubscribe the register pool")
  return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  add_arguments(parser)
  return run(parser.parse_args(argv))


if __name__ == "__main__":
  sys.exit(main())
