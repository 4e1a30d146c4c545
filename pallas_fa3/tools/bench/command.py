"""`pallas-fa3 bench`, every mode's: the flags (one of the attention modes
with `--mode decode`, or a decode flag without it, is a usage error naming
it), the grid they select and the run (flags -> grid -> sweep -> files,
plots and tables): docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from pallas_fa3.backends import interpret_pool
from pallas_fa3.tools.bench import (
  flags,
  flex_case,
  impls,
  plots,
  report,
  runner,
  specs,
  terminal,
  timing,
  varlen_case,
)

# --out unset: this folder's "bench" (the attention modes) or "decode".
OUT_ROOT = "bench_out"
GRIDS = ("gpu", "cpu")  # --grid: whose default grid
# What a run without a GPU says first (format: the sweep, what needs a GPU).
CPU_NOTE = (
  "No GPU: this is the CPU {sweep} (blockwise vs reference vs XLA)."
  " GPU figures ({gpu}) need a Hopper GPU: run benchmarks/device_check.sh"
  " there."
)
_NEEDS_GPU = {
  False: "mosaic, cuDNN, attention_mgpu, % of matmul peak",
  True: "the Hopper decode kernel, cuDNN, JAX's Triton decode ops, % of the"
  " HBM peak",
}
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
  "mla": "--mla",
  "batch": "--batch",
  "cache_len": "--cache-len",
  "page_size": "--page-size",
  "num_splits": "--num-splits",
  "ragged": "--ragged",
  "q_len": "--q-len",
  "batch_invariant": "--batch-invariant",
  "decode_flex": "--decode-flex",
}
# What an unset flag holds (store_true flags: False; the others: None).
_UNSET = {
  "sinks": False,
  "ragged": False,
  "mla": False,
  "batch_invariant": False,
}


def out_dir(args: argparse.Namespace) -> str:
  """--out, or the mode's folder under OUT_ROOT."""
  return args.out or os.path.join(
    OUT_ROOT, specs.DECODE if is_decode(args) else "bench"
  )


def cpu_note(decode: bool) -> str:
  sweep = "decode sweep" if decode else "sweep"
  return CPU_NOTE.format(sweep=sweep, gpu=_NEEDS_GPU[decode])


def _decode_unset(field: str) -> str:
  """Help: a decode axis's values over the default grids' groups."""
  values = lambda grid: tuple(
    dict.fromkeys(v for axes in grid for v in getattr(axes, field))
  )
  gpu, cpu = values(specs.DECODE_GPU_GRID), values(specs.DECODE_CPU_GRID)
  return f"decode only; {flags.unset(gpu, cpu)}, as the default grid pairs them"


def add_parser(
  sub: Any, formatter_class: type[argparse.HelpFormatter], summary: str
) -> argparse.ArgumentParser:
  """Adds the `bench` subcommand and its flags to `sub` (argparse subparsers),
  with `summary` as its one-line help (the `pallas-fa3` listing's, which
  does not import this module).

  Flags left unset (None) take the platform's default (`grid_axes`,
  `settings_from`); their help says which.
  """
  gpu, cpu = specs.PAPER_AXES, specs.CPU_AXES
  positive = flags.int_at_least(1)
  p = sub.add_parser(
    "bench",
    help=summary,
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
    choices=impls.ALL,  # read now: tests may add one; each mode checks its own
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
    choices=impls.ALL,
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
    choices=specs.MODES + (specs.DECODE, flex_case.FLEX, varlen_case.VARLEN),
    metavar="MODE",
    help=f"passes to time, of {' '.join(specs.MODES)} ("
    + flags.unset(gpu.modes, cpu.modes)
    + "); or decode alone: one generation step over a KV cache; or flex"
    " alone: ALiBi, document masks and a dense bias through score_mod /"
    " mask_mod / block_mask / bias beside jax.nn and our built-in options;"
    " or varlen alone: 16 long-tailed sequences through"
    " flash_attention_varlen beside segment ids, the padded call and"
    " jax.nn's seq lengths (--seq: the packed tokens; --seq, --head-dim and"
    " --dtype take their first value)",
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
    + f", or up to {timing.MORE_RUNS}x that while a case's calls add up to"
    f" under {timing.CHEAP_S:g} s)",
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
    f" {OUT_ROOT}/bench; --mode decode: {OUT_ROOT}/{specs.DECODE})",
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
  p.add_argument(
    "--batch",
    nargs="+",
    type=positive,
    help="sequences per decode step (" + _decode_unset("batches") + ")",
  )
  p.add_argument(
    "--cache-len",
    nargs="+",
    type=positive,
    help="tokens in each sequence's KV cache ("
    + _decode_unset("cache_lens")
    + ")",
  )
  p.add_argument(
    "--page-size",
    nargs="+",
    type=flags.int_or_word(1, flags.NONE_WORD),
    metavar="N|none",
    help="tokens per page of a paged cache, 'none': contiguous ("
    + _decode_unset("page_sizes")
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
    "--q-len",
    nargs="+",
    type=positive,
    help="new query tokens per sequence, causal among themselves (2-16:"
    " speculative decoding; " + _decode_unset("q_lens") + ")",
  )
  p.add_argument(
    "--batch-invariant",
    action="store_true",
    help="decode only: flash_attention_with_kvcache(batch_invariant=True),"
    " split-KV ranges fixed in keys (ours only)",
  )
  p.add_argument(
    "--decode-flex",
    choices=specs.DECODE_FLEX,
    help="decode only: a flex decode case (alibi_doc: ALiBi as a score_mod"
    f" and {specs.DECODE_DOC_TOKENS}-token documents as a mask_mod; ours only)",
  )
  p.add_argument(
    "--mla",
    action="store_true",
    help="decode only: DeepSeek MLA's one latent cache (head_dim 576, V its"
    " first 512 columns, one KV head; --gqa: its query heads): the MLA"
    " kernel beside the blockwise twin and reference (XLA); unset grid:"
    " batch 64 x 8k, 128 heads, page 64 (+ batch 32 x 4k, 16 heads) on a"
    " GPU, batch 2 x 1k, 16 heads on a CPU",
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
  return p


def is_decode(args: argparse.Namespace) -> bool:
  return bool(args.mode) and specs.DECODE in args.mode


def _given(args: argparse.Namespace, dest: str) -> bool:
  return getattr(args, dest) != _UNSET.get(dest)


def check_flags(args: argparse.Namespace) -> None:
  """Usage errors (exit 2, naming the flag) for flags of the wrong mode."""
  error = args.parser.error
  decode = is_decode(args)
  if decode and len(args.mode) > 1:
    others = " ".join(m for m in args.mode if m != specs.DECODE)
    error(
      f"--mode decode cannot be combined with {others}: decode cases are"
      " a grid of their own (run them separately)"
    )
  for dest, flag in (_NOT_DECODE if decode else _DECODE_ONLY).items():
    if _given(args, dest):
      error(
        f"{flag} does not apply to --mode decode"
        if decode
        else f"{flag} applies only to --mode decode"
      )
  what = "--mode decode" if decode else f"--mode {'/'.join(specs.MODES)}"
  serving = impls.serving(specs.DECODE if decode else specs.MODES[0])
  for flag, names in (("--impl", args.impl or ()), ("--ours", [args.ours])):
    for name in names:
      if name is not None and name not in serving:
        modes = " ".join(impls.REGISTRY[name].modes)
        error(
          f"{flag} {name} has no {what} benchmark (it times --mode {modes});"
          f" {what} implementations: {' '.join(serving)}"
        )


def grid_axes(args, platform: str) -> tuple:
  """The groups of the default grid (--grid, unset: the platform's; the
  attention modes' is one group), each set flag replacing its axis in
  every group."""
  gpu = (args.grid or platform) == "gpu"
  given = dict(
    dtypes=args.dtype, head_dims=args.head_dim, gqa=args.gqa, hidden=args.hidden
  )
  if is_decode(args):
    groups = specs.DECODE_GPU_GRID if gpu else specs.DECODE_CPU_GRID
    if args.mla:
      groups = specs.MLA_GPU_GRID if gpu else specs.MLA_CPU_GRID
      for flag, value in (("--head-dim", args.head_dim), ("--hidden", args.hidden)):  # fmt: skip
        if value is not None:
          raise ValueError(
            f"{flag} does not apply to --mla (its head dims are 576 / 512;"
            " --gqa sets the query heads)"
          )
    given.update(
      batches=args.batch,
      cache_lens=args.cache_len,
      page_sizes=args.page_size,
      num_splits=args.num_splits,
      ragged=args.ragged or None,
      q_lens=args.q_len,
      batch_invariant=args.batch_invariant or None,
      flex=args.decode_flex,
    )
  else:
    groups = (specs.PAPER_AXES if gpu else specs.CPU_AXES,)
    given.update(
      head_dims_v=args.head_dim_v,
      seqs=args.seq,
      modes=args.mode,
      tokens=args.tokens,
      causals=None if args.causal is None else (args.causal,),
      window=args.window,
      softcap=args.softcap,
      sinks=args.sinks or None,
      docs=args.docs,
    )
  given = {
    k: tuple(dict.fromkeys(v)) if isinstance(v, list) else v
    for k, v in given.items()
    if v is not None
  }
  return tuple(dataclasses.replace(axes, **given) for axes in groups)


def grid(args, platform: str) -> list:
  """The cases of the run: `grid_axes` expanded, filtered by --tags.

  Raises:
    ValueError: naming the flag (see `specs.make_grid`), or --tags that
      select nothing.
  """
  groups = grid_axes(args, platform)
  made = specs.make_grid(groups, args.tags or ())
  if not made:
    tags = sorted({t for s in specs.make_grid(groups) for t in s.tags})
    raise ValueError(
      f"--tags {' '.join(args.tags)} selects no case; the grid's tags:"
      f" {' '.join(tags)}"
    )
  return made


def settings_from(args, platform: str) -> dict:
  settings = dict(
    platform=platform,
    runs=args.runs or runner.DEFAULT_RUNS[platform],
    # Unset --runs: more calls where a case's calls are cheap.
    cheap_s=0.0 if args.runs else timing.CHEAP_S,
    warmup=(
      args.warmup
      if args.warmup is not None
      else runner.DEFAULT_WARMUP[platform]
    ),
    input_sets=args.input_sets,
    seed=args.seed,
    time_budget_s=args.time_budget,
  )
  if is_decode(args):
    settings["hbm_peak_bytes_s"] = timing.hbm_peak(platform)[0]
  else:
    settings["matmul_n"] = timing.MATMUL_N_GPU if platform == "gpu" else None
  return settings


# The modes with their own cases and table: (shapes, run) of each.
_OWN_CASES = {
  flex_case.FLEX: (flex_case.shapes, flex_case.run_flex),
  varlen_case.VARLEN: (varlen_case.shapes, varlen_case.run_varlen),
}


def run_own_cases(args: argparse.Namespace, mode: str) -> int:
  """`--mode flex` (`flex_case`) or `--mode varlen` (`varlen_case`): its
  own cases, one table."""
  if len(args.mode) > 1:
    args.parser.error(f"--mode {mode} cannot be combined with other modes")
  shapes, run_cases = _OWN_CASES[mode]
  platform = runner.platform_name()
  shape = shapes(platform)
  if args.seq:
    shape["seq"] = args.seq[0]
  if args.head_dim:
    shape["head_dim"] = args.head_dim[0]
  dtype = specs.DTYPES[args.dtype[0]] if args.dtype else "bfloat16"
  settings = settings_from(args, platform)
  records = run_cases(
    platform,
    dtype=dtype,
    runs=settings["runs"],
    warmup=settings["warmup"],
    out_dir=args.out or os.path.join(OUT_ROOT, mode),
    shape=shape,
  )
  failed = any(r["status"] == "error" for r in records)
  return 1 if (args.strict and failed) else 0


def run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
  """Runs the benchmark described by the parsed `args`; returns an exit code."""
  for mode in _OWN_CASES:
    if args.mode and mode in args.mode:
      return run_own_cases(args, mode)
  if "interpret" in (args.impl or ()):  # before JAX starts: the interpreter
    interpret_pool.reserve()  # needs its threads (else interpret is skipped)
  check_flags(args)
  decode = is_decode(args)
  platform = runner.platform_name()
  try:
    cases = grid(args, platform)
  except ValueError as e:
    args.parser.error(str(e))
  impl_names = tuple(args.impl or runner.default_impls(platform, decode))
  ours = args.ours or impls.OURS_ON[platform]
  settings = settings_from(args, platform)
  console = report.make_console()
  if platform != "gpu":  # once, before the sweep: what this run can measure
    console.print(cpu_note(decode))
  result = runner.run_sweep(
    runner.plan(cases, impl_names), settings, progress=args.progress
  )
  result.update(environment=runner.environment(argv), settings=settings)
  if decode:
    result["hbm_peak"] = timing.hbm_peak(platform)[1]
  result["impls"] = {n: impls.REGISTRY[n].summary for n in impl_names}
  out = out_dir(args)
  paths = report.write_files(result, out, ours)
  if args.plots:
    try:
      paths["png"] = plots.plot(
        result["records"],
        os.path.join(out, "plots"),
        result["environment"],
        settings.get("hbm_peak_bytes_s"),
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
