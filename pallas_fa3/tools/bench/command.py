"""`pallas-fa3 bench`: parsed flags -> grid -> sweep -> files and table."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from pallas_fa3.backends import interpret_pool
from pallas_fa3.tools.bench import (
  decode_command,
  flags,
  impls,
  plots,
  report,
  runner,
  specs,
  terminal,
  timing,
)

OUT_DIR = "bench_out/bench"
GRIDS = ("gpu", "cpu")  # --grid: whose default grid
CPU_NOTE = (
  "No GPU: this is the CPU sweep (blockwise vs reference vs XLA)."
  " GPU figures (mosaic, cuDNN, attention_mgpu, % of matmul peak)"
  " need a Hopper GPU: run benchmarks/device_check.sh there."
)


def add_parser(
  sub: Any, formatter_class: type[argparse.HelpFormatter]
) -> argparse.ArgumentParser:
  """Adds the `bench` subcommand and its flags to `sub` (argparse subparsers).

  Flags left unset (None) take the platform's default (`grid_axes`,
  `settings_from`); their help says which.
  """
  gpu, cpu = specs.PAPER_AXES, specs.CPU_AXES
  positive = flags.int_at_least(1)
  # --impl and --ours: every mode's names (read now: tests may add one);
  # each mode checks its own.
  every_impl = impls.ALL
  p = sub.add_parser(
    "bench",
    help="performance harness: TFLOPs/s, memory, CSV/JSON/PNG",
    description=(
      "Time attention implementations over a grid of named shapes"
      " (compile excluded, warm-up, median/min/max of --runs calls,"
      " random inputs rotated). On a GPU the default grid is the FA3"
      " paper's (16k tokens, hidden 2048, d 64/128/256, seq 512..16k,"
      " causal and not, fwd/bwd/fwd+bwd) and the run also measures the"
      " bf16 matmul rate for % of peak. Without a GPU: a small CPU sweep"
      " of blockwise vs reference vs XLA (about a minute). Unset flags"
      " keep the platform default; every skipped case is reported with"
      " its reason. --window, --softcap, --sinks and --docs apply to every case"
      " and implementation; one that cannot serve them is skipped, saying"
      " why, and FLOPs count only the pairs a window and the documents"
      " leave visible. --mode decode times one generation step over a KV"
      " cache instead (--batch, --cache-len, --page-size, --num-splits,"
      " --ragged): GB/s of K/V read and % of the HBM peak, against XLA,"
      " cuDNN and JAX's Triton decode ops; see docs/benchmarks.md."
    ),
    formatter_class=formatter_class,
  )
  p.add_argument(
    "--impl",
    nargs="+",
    choices=every_impl,
    metavar="IMPL",
    help="implementations to time, of"
    f" {' '.join(impls.serving(specs.MODES[0]))} ("
    + flags.unset(runner.DEFAULT_IMPLS["gpu"], runner.DEFAULT_IMPLS["cpu"])
    + f"); --mode decode: of {' '.join(impls.serving(specs.DECODE))} ("
    + flags.unset(
      runner.DEFAULT_DECODE_IMPLS["gpu"], runner.DEFAULT_DECODE_IMPLS["cpu"]
    )
    + ")",
  )
  p.add_argument(
    "--ours",
    choices=every_impl,
    metavar="IMPL",
    help="the implementation compared with the others ("
    + flags.unset(impls.OURS_ON["gpu"], impls.OURS_ON["cpu"])
    + "; the same for --mode decode)",
  )
  p.add_argument(
    "--dtype",
    nargs="+",
    choices=tuple(specs.DTYPES),
    metavar="DTYPE",
    help=f"input dtypes, of {' '.join(specs.DTYPES)}; fp8: bf16"
    " inputs quantized to e4m3, forward only, the quantization"
    " and the attention also timed apart (unset: bf16)",
  )
  p.add_argument(
    "--head-dim",
    nargs="+",
    type=positive,
    help=f"head dims, at most {specs.MAX_HEAD_DIM}, each dividing"
    f" --hidden ({flags.unset(gpu.head_dims, cpu.head_dims)})",
  )
  p.add_argument(
    "--head-dim-v",
    nargs="+",
    type=positive,
    help=f"value head dims (v, dout and the output), at most"
    f" {specs.MAX_HEAD_DIM}, each paired with every --head-dim, e.g."
    " --head-dim 192 --head-dim-v 128 (DeepSeek MLA); FLOPs count both;"
    " not with --mode decode or fp8 (unset: equal to the head dim)",
  )
  p.add_argument(
    "--seq",
    nargs="+",
    type=positive,
    help=f"sequence lengths ({flags.unset(gpu.seqs, cpu.seqs)})",
  )
  causal = p.add_mutually_exclusive_group()
  causal.add_argument(
    "--causal",
    dest="causal",
    action="store_const",
    const=True,
    help="causal cases only (unset: causal and non-causal)",
  )
  causal.add_argument(
    "--no-causal",
    dest="causal",
    action="store_const",
    const=False,
    help="non-causal cases only",
  )
  p.add_argument(
    "--mode",
    nargs="+",
    choices=specs.MODES + (specs.DECODE,),
    metavar="MODE",
    help=f"passes to time, of {' '.join(specs.MODES)} ("
    + flags.unset(gpu.modes, cpu.modes)
    + "); or decode alone: one generation step over a KV cache",
  )
  p.add_argument(
    "--gqa",
    nargs="+",
    type=positive,
    help="query heads per key/value head, 1: MHA (unset: 1; --mode"
    " decode: 4, and 1 4 8 at batch 8 x 32k on a GPU)",
  )
  p.add_argument(
    "--window",
    type=flags.window,
    metavar="LEFT,RIGHT",
    help="sliding window of every case, bottom-right aligned like --causal:"
    " query i at p = i + seq_kv - seq_q sees keys p-LEFT..p+RIGHT; each"
    " side an int or 'none' (unbounded), e.g. 256,0 (unset: no window)",
  )
  p.add_argument(
    "--softcap",
    type=flags.positive_float,
    metavar="CAP",
    help="logit softcap of every case: scores become CAP * tanh(score"
    " / CAP) (unset: none)",
  )
  p.add_argument(
    "--sinks",
    action="store_true",
    help="per-head sinks in every case: random float32 logits, fixed seed",
  )
  p.add_argument(
    "--docs",
    type=positive,
    metavar="N",
    help="pack every sequence with N documents of equal length (the last"
    " takes the remainder), passed as segment_ids; N <= every --seq"
    " (unset: one document)",
  )
  p.add_argument(
    "--tokens",
    type=positive,
    help="batch x seq per case, batch = tokens // seq ("
    + flags.unset(gpu.tokens, cpu.tokens)
    + ")",
  )
  p.add_argument(
    "--hidden",
    type=positive,
    help="heads_q x head_dim per case ("
    + flags.unset(gpu.hidden, cpu.hidden)
    + ")",
  )
  p.add_argument(
    "--grid",
    choices=GRIDS,
    help="the default grid the flags change (unset: the platform's; e.g."
    " --grid gpu --time-budget 0 on a CPU lists the GPU grid's cases)",
  )
  p.add_argument(
    "--runs",
    type=positive,
    help="timed calls per case ("
    + flags.unset(runner.DEFAULT_RUNS["gpu"], runner.DEFAULT_RUNS["cpu"])
    + ")",
  )
  p.add_argument(
    "--warmup",
    type=flags.int_at_least(0),
    help="untimed calls before timing ("
    + flags.unset(runner.DEFAULT_WARMUP["gpu"], runner.DEFAULT_WARMUP["cpu"])
    + ")",
  )
  p.add_argument(
    "--input-sets",
    type=positive,
    default=3,
    help="random input sets rotated between calls",
  )
  p.add_argument("--seed", type=int, default=0, help="input seed")
  p.add_argument(
    "--time-budget",
    type=flags.non_negative_float,
    help="seconds; cases not started by then are reported as"
    " skipped, files are still written (unset: no limit)",
  )
  p.add_argument(
    "--out",
    help="output folder: results.csv/json, summary.md, plots/ (unset:"
    f" {OUT_DIR}; --mode decode: {decode_command.OUT_DIR})",
  )
  p.add_argument(
    "--plots",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="write PNG plots",
  )
  p.add_argument(
    "--progress",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="progress bar",
  )
  p.add_argument(
    "--strict",
    action="store_true",
    help="exit 1 if any case failed with an error",
  )
  decode_command.add_flags(p)
  return p


def grid_axes(args, platform: str) -> specs.GridAxes:
  """The grid's axes: the platform default, overridden by the flags."""
  axes = (
    specs.PAPER_AXES if (args.grid or platform) == "gpu" else specs.CPU_AXES
  )
  overrides = dict(
    dtypes=args.dtype,
    head_dims=args.head_dim,
    head_dims_v=args.head_dim_v,
    seqs=args.seq,
    modes=args.mode,
    gqa=args.gqa,
    tokens=args.tokens,
    hidden=args.hidden,
    causals=None if args.causal is None else (args.causal,),
    window=args.window,
    softcap=args.softcap,
    sinks=args.sinks or None,
    docs=args.docs,
  )
  return dataclasses.replace(
    axes,
    **{
      k: tuple(v) if isinstance(v, list) else v
      for k, v in overrides.items()
      if v is not None
    },
  )


def settings_from(args, platform: str) -> dict:
  return dict(
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
    matmul_n=timing.MATMUL_N_GPU if platform == "gpu" else None,
  )


def run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
  """Runs the benchmark described by the parsed `args`; returns an exit code."""
  if "interpret" in (args.impl or ()):  # before JAX starts: the interpreter
    interpret_pool.reserve()  # needs its threads (else interpret is skipped)
  if decode_command.is_decode(args):
    return decode_command.run(args, argv)
  decode_command.check_flags(args)
  platform = runner.platform_name()
  try:
    grid = specs.make_grid(grid_axes(args, platform))
  except ValueError as e:
    args.parser.error(str(e))
  if args.tags and not (grid := specs.select(grid, args.tags)):
    args.parser.error(f"--tags {' '.join(args.tags)} selects no case")
  impl_names = tuple(args.impl or runner.DEFAULT_IMPLS[platform])
  ours = args.ours or impls.OURS_ON[platform]
  settings = settings_from(args, platform)
  console = report.make_console()
  if platform != "gpu":  # once, before the sweep: what this run can measure
    console.print(CPU_NOTE)
  result = runner.run_sweep(
    runner.plan(grid, impl_names), settings, progress=args.progress
  )
  result.update(
    environment=runner.environment(argv),
    settings=settings,
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
      )
    except ImportError as e:  # a bare GPU image may lack matplotlib
      console.print(f"no plots: {e} (pip install matplotlib)")
  terminal.print_summary(result, ours, console)
  files = [
    p for v in paths.values() for p in (v if isinstance(v, list) else [v])
  ]
  console.print(f"wrote {', '.join(files)}", highlight=False)
  failed = any(r["status"] == "error" for r in result["records"])
  return 1 if (args.strict and failed) else 0
