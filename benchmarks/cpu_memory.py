#!/usr/bin/env python3
"""CPU time and peak memory of `blockwise` vs `reference` attention (issue 2).

What is measured
----------------
For every case -- implementation ("blockwise", "reference") x pass ("fwd":
the forward only; "fwdbwd": `jax.grad` of `sum(out * ct)` with respect to
q, k, v, where `ct` is a fixed random cotangent passed as an argument) x
sequence length -- the script reports:

* Compiled memory: `jax.jit(f).lower(*args).compile().memory_analysis()`,
  i.e. XLA's buffer assignment: `temp_size_in_bytes` (scratch that lives only
  during the call: the quantity that is quadratic for the materialized
  reference), plus argument and output bytes.

* Measured peak RSS of executing the compiled function, in a fresh Python
  subprocess per case (caches, allocator state and the high-water mark of
  one case never leak into another). That subprocess runs with
  `MALLOC_MMAP_THRESHOLD_=131072` (`--mmap-threshold`; glibc's initial value,
  but fixed: glibc otherwise raises it up to 32 MiB after the first large
  free, after which buffers come from heap pages that input creation and
  compilation freed but left resident, and RSS under-reads the execution).
  The inputs are materialized and the function compiled first. Then, right
  before the execution: `gc.collect()`, a short settle pause, glibc
  `malloc_trim(0)` (returns freed heap pages to the kernel), a reset of the
  kernel's peak-RSS watermark by writing "5" to `/proc/self/clear_refs`
  (resets VmHWM; checked at start-up to work on the running kernel), a read
  of VmRSS; then one execution (`block_until_ready`) and a read of VmHWM.
  The reported figure is `VmHWM(after) - VmRSS(before)`: the extra resident
  memory the execution needed (temporaries, outputs, runtime scratch), in
  MiB. The first execution after compilation is the primary figure; it
  includes ~0.5-1 MiB of one-time runtime start-up, so sub-MiB differences
  are not meaningful. `--mem-repeats` more executions are measured the same
  way and the maximum over all is also reported. A figure below 90% of
  XLA's compiled temp+output bytes is flagged (†) as an under-read. If
  resetting VmHWM does not work, the script falls back to `ru_maxrss` deltas
  (only meaningful when the execution exceeds every earlier peak of the
  process) and says so.

* Time, in a second fresh subprocess with the default allocator settings:
  compilation excluded, one warm-up execution, then `--runs` executions
  (default 5), each followed by `block_until_ready`, timed with
  `time.perf_counter`; median, min and max are reported. Inputs are fresh
  standard-normal random arrays (never zeros; numpy `default_rng`, cast to
  `--dtype`, copied to the device -- drawing them with `jax.random` would
  run XLA computations whose freed buffers perturb the RSS measurement),
  rotated among `--input-sets` independent sets (default 3).

Then a markdown summary is printed: per-case table, reference/blockwise
ratios (time, compiled temp bytes, measured peak), growth factor per doubling
of the sequence length (blockwise should be ~2x: linear memory; reference
~4x: the [seq, seq] score matrix), and a check that blockwise at the longest
sequence uses well under the reference's memory. Everything is also written
as JSON (`--out`) with an environment header (date, machine, CPU count, JAX
version, command line, git commit).

`--block-sweep` additionally times blockwise fwd and fwd+bwd at one sequence
length (default 4096) for several (block_q, block_kv) tile sizes, to see
which default tile is fastest on this CPU.

Timings are wall-clock on a shared machine: the 1-minute load average is
recorded for each case so that noisy numbers can be recognized (re-run them).

Files: this script (command line and the run; with `--worker`, it is also
the subprocess entry point), `cpu_memory_runner.py` (environment header,
each case in fresh subprocesses), `cpu_memory_worker.py` (one case in the
subprocess: inputs, compilation, measurement) and `cpu_memory_report.py`
(markdown tables, ratios, growth factors, checks).

Examples (from the repository root):
  python benchmarks/cpu_memory.py
  python benchmarks/cpu_memory.py --causal --dtype bfloat16 --seqs 1024 2048
  python benchmarks/cpu_memory.py --block-sweep --skip-main
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# benchmarks/ is not a package: import the sibling modules from this file's
# directory, wherever the script is run from.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
  sys.path.insert(0, _HERE)

from cpu_memory_report import (
  IMPLEMENTATIONS,  # noqa: E402
  PASSES,  # noqa: E402
  main_report,  # noqa: E402
  progress_note,  # noqa: E402
  sweep_report,  # noqa: E402
)
from cpu_memory_runner import (
  RESULT_TAG,  # noqa: E402
  environment,  # noqa: E402
  run_case,  # noqa: E402
)
from cpu_memory_worker import worker  # noqa: E402

DEFAULT_SEQS = (1024, 2048, 4096, 8192)
SWEEP_BLOCKS = (
  (64, 64),
  (128, 128),
  (256, 256),
  (512, 512),
  (128, 256),
  (256, 128),
)


def _parse_args(argv):
  p = argparse.ArgumentParser(
    prog="benchmarks/cpu_memory.py",
    description=(
      "Measure time and peak memory of pallas_fa3's 'blockwise' (tiled,"
      " linear memory) vs 'reference' (materialized [seq, seq] scores)"
      " attention on the CPU, forward and forward+backward, each case in"
      " a fresh subprocess. Prints markdown tables and writes JSON."
    ),
    epilog=(
      "Memory: XLA's compiled temp bytes, and the measured peak RSS of"
      " one execution (VmHWM after minus VmRSS before, with VmHWM reset"
      " via /proc/self/clear_refs), in one fresh subprocess per case; time"
      " in another: compile excluded, one warm-up, median/min/max of"
      " --runs. See the module docstring for details."
    ),
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  p.add_argument(
    "--seqs",
    type=int,
    nargs="+",
    default=list(DEFAULT_SEQS),
    metavar="N",
    help="sequence lengths (seq_q = seq_kv)",
  )
  p.add_argument(
    "--impls",
    nargs="+",
    default=list(IMPLEMENTATIONS),
    choices=IMPLEMENTATIONS,
    help="implementations to compare",
  )
  p.add_argument(
    "--passes",
    nargs="+",
    default=list(PASSES),
    choices=PASSES,
    help="fwd: forward only; fwdbwd: jax.grad of sum(out * ct) w.r.t. q, k, v",
  )
  p.add_argument(
    "--dtype",
    default="float32",
    choices=("float32", "bfloat16", "float16"),
    help="dtype of q, k, v",
  )
  p.add_argument("--causal", action="store_true", help="causal attention")
  p.add_argument("--batch", type=int, default=1, help="batch size")
  p.add_argument(
    "--heads", type=int, default=1, help="attention heads (q and k/v: MHA)"
  )
  p.add_argument("--head-dim", type=int, default=64, help="head dimension")
  p.add_argument(
    "--block",
    type=int,
    nargs=2,
    default=None,
    metavar=("BLOCK_Q", "BLOCK_KV"),
    help="blockwise tile size for the main comparison; None:"
    " the library default BlockwiseConfig()",
  )
  p.add_argument(
    "--runs",
    type=int,
    default=5,
    help="timed executions per case (after one warm-up)",
  )
  p.add_argument(
    "--input-sets",
    type=int,
    default=3,
    help="independent random input sets rotated between runs",
  )
  p.add_argument(
    "--seed",
    type=int,
    default=0,
    help="seed of the random inputs (numpy default_rng)",
  )
  p.add_argument(
    "--settle",
    type=float,
    default=0.2,
    metavar="SECONDS",
    help="pause (after gc) before each measured execution so that"
    " buffers freed by the previous one are returned",
  )
  p.add_argument(
    "--no-malloc-trim",
    dest="malloc_trim",
    action="store_false",
    help="do not call glibc malloc_trim(0) before each measured"
    " execution (without it, heap pages freed during input"
    " creation and compilation stay resident and are silently"
    " reused, hiding small peaks)",
  )
  p.add_argument(
    "--mmap-threshold",
    type=int,
    default=128 * 1024,
    metavar="BYTES",
    help="MALLOC_MMAP_THRESHOLD_ of the memory subprocess: a"
    " fixed glibc mmap threshold (this is glibc's initial"
    " value; setting it turns off the dynamic raise to 32 MiB)"
    " so that every buffer above it gets fresh pages and is"
    " unmapped on free; 0: leave the allocator alone",
  )
  p.add_argument(
    "--mem-repeats",
    type=int,
    default=2,
    help="extra measured executions after the first, in the"
    " memory subprocess (their max is reported too)",
  )
  p.add_argument(
    "--case-timeout",
    type=float,
    default=1800,
    metavar="SECONDS",
    help="kill a case's subprocess after this long",
  )
  p.add_argument(
    "--block-sweep",
    action="store_true",
    help="also time blockwise fwd and fwd+bwd at --sweep-seq for"
    f" (block_q, block_kv) in {list(SWEEP_BLOCKS)}",
  )
  p.add_argument(
    "--sweep-seq",
    type=int,
    default=4096,
    help="sequence length of the block-size sweep",
  )
  p.add_argument(
    "--skip-main",
    action="store_true",
    help="skip the blockwise-vs-reference comparison (use with --block-sweep)",
  )
  p.add_argument(
    "--strict",
    action="store_true",
    help="exit with status 1 if a check fails or a case errors",
  )
  p.add_argument(
    "--out",
    default="bench_out/cpu_memory.json",
    help="JSON output path (relative to the current directory)",
  )
  p.add_argument("--worker", help=argparse.SUPPRESS)
  return p.parse_args(argv)


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  args = _parse_args(argv)
  if args.worker:
    res = worker(json.loads(args.worker))
    print(RESULT_TAG + json.dumps(res), flush=True)
    return 0

  env = environment([os.path.relpath(__file__)] + argv)
  base = dict(
    dtype=args.dtype,
    causal=args.causal,
    batch=args.batch,
    heads=args.heads,
    head_dim=args.head_dim,
    runs=args.runs,
    input_sets=args.input_sets,
    seed=args.seed,
    settle_s=args.settle,
    block=args.block,
    malloc_trim=args.malloc_trim,
    mem_repeats=args.mem_repeats,
  )
  cases, sweep_cases = [], []
  if not args.skip_main:
    for pas in args.passes:
      for seq in sorted(args.seqs):
        for impl in args.impls:
          cases.append(dict(base, seq=seq, impl=impl, **{"pass": pas}))
  if args.block_sweep:
    for blk in SWEEP_BLOCKS:
      for pas in PASSES:
        sweep_cases.append(
          dict(
            base,
            seq=args.sweep_seq,
            impl="blockwise",
            block=list(blk),
            **{"pass": pas},
          )
        )

  def run_all(todo, label):
    results = []
    for i, case in enumerate(todo, 1):
      desc = f"{case['impl']} {case['pass']} seq={case['seq']}" + (
        f" block={tuple(case['block'])}" if case["block"] else ""
      )
      print(
        f"[{label} {i}/{len(todo)}] {desc} ...",
        file=sys.stderr,
        end="",
        flush=True,
      )
      res = run_case(case, args.case_timeout, args.mmap_threshold)
      print(" " + progress_note(res), file=sys.stderr, flush=True)
      results.append(res)
    return results

  results = run_all(cases, "main")
  sweep = run_all(sweep_cases, "sweep")

  all_res = results + sweep
  hwm_notes = sorted({r.get("hwm_note") for r in all_res if r.get("hwm_note")})
  hwm_ok = all(r.get("hwm_reset_ok") is not False for r in all_res)
  out = dict(
    environment=env,
    settings=dict(vars(args)),
    hwm_reset_ok=hwm_ok,
    hwm_notes=hwm_notes,
    results=results,
    sweep_results=sweep,
  )
  out["settings"].pop("worker", None)

  print("# CPU memory/time: blockwise vs reference\n")
  print(f"- date: {env['date']}")
  print(
    f"- machine: {env['platform']}; {env['cpu_model']};"
    f" {env['cpu_count']} CPUs; {env['mem_total_gib']} GiB"
  )
  print(f"- jax {env['jax']} / jaxlib {env['jaxlib']}; python {env['python']}")
  print(f"- command: `{env['command']}`")
  print(
    f"- shape: batch {args.batch}, heads {args.heads}, head_dim"
    f" {args.head_dim}, dtype {args.dtype}, causal {args.causal}"
  )
  if not hwm_ok:
    print(
      "- NOTE: resetting VmHWM via /proc/self/clear_refs did NOT work here;"
      " measured peaks are ru_maxrss deltas, which only show growth past"
      " the process's earlier maximum (compile, input creation) and"
      " understate small peaks."
    )
  for n in hwm_notes:
    print(
      f"- peak-RSS method: {n}; memory subprocess with"
      f" MALLOC_MMAP_THRESHOLD_={args.mmap_threshold or 'unset'},"
      f" malloc_trim(0) {'on' if args.malloc_trim else 'off'};"
      " timing in a separate subprocess"
    )
  print()
  failed = False
  if results:
    text, derived = main_report(results, sorted(args.seqs))
    out.update(derived)
    print(text)
    failed |= any(not c["ok"] for c in derived["checks"])
    failed |= any("error" in r for r in results)
  if sweep:
    text, best = sweep_report(sweep)
    out["sweep_fastest"] = best
    print(f"\n## Block-size sweep: blockwise, seq {args.sweep_seq}\n")
    print(text)
    for pas, blk in best.items():
      print(f"\nFastest {pas}: block_q={blk[0]}, block_kv={blk[1]}")
    failed |= any("error" in r for r in sweep)

  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(out, f, indent=2)
  print(f"\nJSON written to {args.out}")
  return 1 if (args.strict and failed) else 0


if __name__ == "__main__":
  sys.exit(main())
