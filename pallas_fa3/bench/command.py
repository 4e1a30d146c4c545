"""`pallas-fa3 bench`: parsed flags -> grid -> sweep -> files and table."""

from __future__ import annotations

import dataclasses
import os

from pallas_fa3.bench import impls, plots, report, runner, specs, timing

CPU_NOTE = ("No GPU: this is the CPU sweep (blockwise vs reference vs XLA)."
            " GPU figures (mosaic, cuDNN, attention_mgpu, % of matmul peak)"
            " need a Hopper GPU: run benchmarks/device_check.sh there.")


def grid_axes(args, platform: str) -> specs.GridAxes:
  """The grid's axes: the platform default, overridden by the flags."""
  axes = specs.PAPER_AXES if platform == "gpu" else specs.CPU_AXES
  overrides = dict(
      dtypes=args.dtype, head_dims=args.head_dim, seqs=args.seq,
      modes=args.mode, gqa=args.gqa, tokens=args.tokens, hidden=args.hidden,
      causals=None if args.causal is None else (args.causal,))
  return dataclasses.replace(axes, **{
      k: tuple(v) if isinstance(v, list) else v
      for k, v in overrides.items() if v is not None})


def settings_from(args, platform: str) -> dict:
  return dict(
      platform=platform,
      runs=args.runs or runner.DEFAULT_RUNS[platform],
      warmup=(args.warmup if args.warmup is not None
              else runner.DEFAULT_WARMUP[platform]),
      input_sets=args.input_sets, seed=args.seed,
      time_budget_s=args.time_budget,
      matmul_n=timing.MATMUL_N_GPU if platform == "gpu" else None)


def run(args, argv=None) -> int:
  """Runs the benchmark described by the parsed `args`; returns an exit code."""
  platform = runner.platform_name()
  try:
    grid = specs.make_grid(grid_axes(args, platform))
  except ValueError as e:
    args.parser.error(str(e))
  impl_names = tuple(args.impl or runner.DEFAULT_IMPLS[platform])
  ours = args.ours or impls.OURS_ON[platform]
  settings = settings_from(args, platform)
  console = report.make_console()
  if platform != "gpu":
    console.print(CPU_NOTE)
  result = runner.run_sweep(runner.plan(grid, impl_names), settings,
                            progress=args.progress)
  result.update(environment=runner.environment(argv), settings=settings,
                impls={n: impls.REGISTRY[n].summary for n in impl_names})
  paths = report.write_files(result, args.out, ours)
  if args.plots:
    try:
      paths["png"] = plots.plot(result["records"],
                                os.path.join(args.out, "plots"))
    except ImportError as e:  # a bare GPU image may lack matplotlib
      console.print(f"no plots: {e} (pip install matplotlib)")
  report.print_table(result, ours, console)
  if platform != "gpu":
    console.print(CPU_NOTE)
  files = [p for v in paths.values() for p in (v if isinstance(v, list)
                                               else [v])]
  console.print(f"wrote {', '.join(files)}", highlight=False)
  failed = any(r["status"] == "error" for r in result["records"])
  return 1 if (args.strict and failed) else 0
