"""`pallas-fa3 bench --mode decode`: its flags, their checks, and the run
(parsed flags -> decode grid -> sweep -> files, plots and tables).

The flags of the other modes that mean nothing for a decode step (--seq,
--tokens, --causal, --window, --softcap, --sinks, --docs, --head-dim-v) are
usage errors with it, and the decode flags (--batch, --cache-len,
--page-size, --num-splits, --ragged) without it; either names the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from pallas_fa3.tools.bench import (
  flags,
  impls,
  plots,
  report,
  runner,
  specs,
  terminal,
  timing,
)

OUT_DIR = "bench_out/decode"
CPU_NOTE = (
  "No GPU: this is the CPU decode sweep (blockwise vs reference vs XLA),"
  " GB/s of K/V read with no % of an HBM peak. The Hopper kernel (mosaic),"
  " cuDNN and JAX's Triton decode ops need a GPU: run"
  " benchmarks/device_check.sh there."
)
# Flags of the attention modes a decode step has no use for, by dest.
_NOT_DECODE = {
  "seq": "--seq (decode cases: --cache-len)",
  "tokens": "--tokens (decode cases: --batch)",
  "causal": "--causal/--no-causal (one query at the end of its cache is"
  " causal by position)",
  "window": "--window",
  "softcap": "--softcap",
  "sinks": "--sinks",
  "docs": "--docs",
  "head_dim_v": "--head-dim-v (decode cases keep head_dim_v == head_dim)",
}
# Decode flags, by dest.
_DECODE_ONLY = {
  "batch": "--batch",
  "cache_len": "--cache-len",
  "page_size": "--page-size",
  "num_splits": "--num-splits",
  "ragged": "--ragged",
}


def _unset(gpu: Any, cpu: Any, field: str) -> str:
  """Help: the field's values over the default grids' groups."""
  values = lambda grid: tuple(
    dict.fromkeys(v for axes in grid for v in getattr(axes, field))
  )
  return (
    f"decode only; unset: {_show(values(gpu))} on a GPU, {_show(values(cpu))}"
    " on a CPU, as the default grid pairs them"
  )


def _show(values: tuple, none: str = flags.NONE_WORD) -> str:
  return " ".join(none if v is None else str(v) for v in values)


def add_flags(p: argparse.ArgumentParser) -> None:
  """Adds the decode flags to the `bench` parser."""
  gpu, cpu = specs.DECODE_GPU_GRID, specs.DECODE_CPU_GRID
  positive = flags.int_at_least(1)
  p.add_argument(
    "--batch",
    nargs="+",
    type=positive,
    help="sequences per decode step (" + _unset(gpu, cpu, "batches") + ")",
  )
  p.add_argument(
    "--cache-len",
    nargs="+",
    type=positive,
    help="tokens in each sequence's KV cache ("
    + _unset(gpu, cpu, "cache_lens")
    + ")",
  )
  p.add_argument(
    "--page-size",
    nargs="+",
    type=flags.int_or_word(1, flags.NONE_WORD),
    metavar="N|none",
    help="tokens per page of a paged cache, 'none': contiguous ("
    + _unset(gpu, cpu, "page_sizes")
    + ")",
  )
  p.add_argument(
    "--num-splits",
    nargs="+",
    type=flags.int_or_word(1, flags.AUTO_WORD),
    metavar="N|auto",
    help="split-KV ranges per sequence, 'auto': each implementation's own"
    " choice (decode only; unset: auto, and 1 8 32 128 at batch 1 x 128k"
    " on a GPU; auto and 4 at batch 1 on a CPU)",
  )
  p.add_argument(
    "--ragged",
    action="store_true",
    help="decode only: ragged cache lengths, from --cache-len down to about"
    " half of it across the batch (bytes and FLOPs count each length)",
  )
  p.add_argument(
    "--tags",
    nargs="+",
    metavar="TAG",
    help="only the cases carrying every TAG (e.g. headline: the decode"
    " points the targets of issue 29 name; d128, paged, causal, ...)",
  )


# What an unset flag holds (store_true flags: False; the others: None).
_UNSET = {"sinks": False, "ragged": False}


def _given(args: argparse.Namespace, dest: str) -> bool:
  return getattr(args, dest) != _UNSET.get(dest)


def is_decode(args: argparse.Namespace) -> bool:
  return bool(args.mode) and specs.DECODE in args.mode


def check_flags(args: argparse.Namespace) -> None:
  """Usage errors (exit 2, naming the flag) for flags of the wrong mode."""
  error = args.parser.error
  if is_decode(args):
    if len(args.mode) > 1:
      others = " ".join(m for m in args.mode if m != specs.DECODE)
      error(
        f"--mode decode cannot be combined with {others}: decode cases are"
        " a grid of their own (run them separately)"
      )
    for dest, flag in _NOT_DECODE.items():
      if _given(args, dest):
        error(f"{flag} does not apply to --mode decode")
    for flag, names in (("--impl", args.impl or ()), ("--ours", [args.ours])):
      for name in names:
        if name is not None and name not in impls.serving(specs.DECODE):
          error(
            f"{flag} {name} has no decode benchmark; --mode decode"
            f" implementations: {' '.join(impls.serving(specs.DECODE))}"
          )
    return
  for dest, flag in _DECODE_ONLY.items():
    if _given(args, dest):
      error(f"{flag} applies only to --mode decode")
  for flag, names in (("--impl", args.impl or ()), ("--ours", [args.ours])):
    for name in names:
      if name is not None and name not in impls.serving(specs.MODES[0]):
        error(f"{flag} {name} is a decode baseline: use it with --mode decode")


def grid(args, platform: str) -> list[specs.DecodeBenchSpec]:
  """The decode grid: the groups of --grid (unset: the platform's), each
  flag replacing its axis in every group, filtered by --tags.

  Raises:
    ValueError: naming the flag (see `specs.make_grid`), or --tags
      that select nothing.
  """
  gpu = (args.grid or platform) == "gpu"
  groups = specs.DECODE_GPU_GRID if gpu else specs.DECODE_CPU_GRID
  overrides = dict(
    batches=args.batch,
    cache_lens=args.cache_len,
    page_sizes=args.page_size,
    num_splits=args.num_splits,
    gqa=args.gqa,
    head_dims=args.head_dim,
    hidden=args.hidden,
    dtypes=args.dtype,
    ragged=args.ragged or None,
  )
  overrides = {
    k: tuple(dict.fromkeys(v)) if isinstance(v, list) else v
    for k, v in overrides.items()
    if v is not None
  }
  groups = [dataclasses.replace(axes, **overrides) for axes in groups]
  made = specs.make_grid(groups, args.tags or ())
  if not made:
    tags = " ".join(
      sorted({t for s in specs.make_grid(groups) for t in s.tags})
    )
    raise ValueError(
      f"--tags {' '.join(args.tags)} selects no decode case; the grid's"
      f" tags: {tags}"
    )
  return made


def run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
  """Runs the decode benchmark of the parsed `args`; returns an exit code."""
  check_flags(args)
  platform = runner.platform_name()
  try:
    cases = grid(args, platform)
  except ValueError as e:
    args.parser.error(str(e))
  impl_names = tuple(args.impl or runner.DEFAULT_DECODE_IMPLS[platform])
  ours = args.ours or impls.OURS_ON[platform]
  peak, peak_text = timing.hbm_peak(platform)
  settings = dict(
    platform=platform,
    runs=args.runs or runner.DEFAULT_RUNS[platform],
    warmup=(
      args.warmup
      if args.warmup is not None
      else runner.DEFAULT_WARMUP[platform]
    ),
    input_sets=args.input_sets,
    seed=args.seed,
    time_budget_s=args.time_budget,
    hbm_peak_bytes_s=peak,
  )
  console = report.make_console()
  if platform != "gpu":
    console.print(CPU_NOTE)
  result = runner.run_sweep(
    runner.plan(cases, impl_names), settings, progress=args.progress
  )
  result.update(
    environment=runner.environment(argv),
    settings=settings,
    hbm_peak=peak_text,
    impls={n: impls.REGISTRY[n].summary for n in impl_names},
  )
  out = args.out or OUT_DIR
  paths = report.write_files(result, out, ours)
  if args.plots:
    try:
      paths["png"] = plots.plot(
        result["records"],
        os.path.join(out, "plots"),
        result["environment"],
        peak,
      )
    except ImportError as e:  # a bare GPU image may lack matplotlib
      console.print(f"no plots: {e} (pip install matplotlib)")
  terminal.print_summary(result, ours, console)
  if platform != "gpu":
    console.print(CPU_NOTE)
  files = [
    p for v in paths.values() for p in (v if isinstance(v, list) else [v])
  ]
  console.print(f"wrote {', '.join(files)}", highlight=False)
  failed = any(r["status"] == "error" for r in result["records"])
  return 1 if (args.strict and failed) else 0
