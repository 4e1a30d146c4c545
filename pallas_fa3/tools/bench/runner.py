"""The sweep, every mode's: `plan` orders the (implementation, case) pairs
(decode: ours first, so that a time budget cuts the baselines first),
`run_case` measures one into one record (compile excluded, warm-up,
median/min/max of calls on rotated inputs, the rates, memory and, where
recorded, the error against our reference) or says why not, `run_sweep`
runs them under the time budget behind a progress bar, and `environment`
is the run's header: docs/benchmarks.md#the-code.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence

import jax
import numpy as np

from pallas_fa3.tools.bench import fp8_case, impls, options, specs, timing

_MIB = 2**20
_REASON_CHARS = 400  # keep error messages readable in tables and CSV
# Runs per case on each platform (CPU timings are long and few suffice).
DEFAULT_RUNS = {"gpu": 20, "cpu": 3}
DEFAULT_WARMUP = {"gpu": 5, "cpu": 1}
# What runs without --impl. `interpret` (the kernels' correctness case)
# runs only when --impl names it: it needs an XLA CPU pool of 6 threads,
# which a small CPU lacks unless asked for before JAX starts and which
# slows the other implementations.
DEFAULT_IMPLS = {
  "gpu": ("mosaic", "blockwise", "reference", "cudnn", "xla", "mgpu"),
  "cpu": ("blockwise", "reference", "xla"),
}
# --mode decode: JAX's Triton decode ops instead of attention_mgpu.
DEFAULT_DECODE_IMPLS = {
  "gpu": ("mosaic", "blockwise", "reference", "xla", "cudnn")
  + ("triton-gqa", "triton-paged"),
  "cpu": ("blockwise", "reference", "xla"),
}
NO_SPLITS = "takes no split count: timed once per shape, at num_splits auto"


def platform_name() -> str:
  """ "gpu" when the default JAX backend is a GPU, else "cpu" (also TPU)."""
  return "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else "cpu"


def default_impls(platform: str, decode: bool) -> tuple[str, ...]:
  """What a run times without --impl."""
  return (DEFAULT_DECODE_IMPLS if decode else DEFAULT_IMPLS)[platform]


def environment(argv: Sequence[str] | None = None) -> dict:
  """Device, driver/platform, versions, date and command of this run."""
  import jaxlib  # pylint: disable=g-import-not-at-top

  device = jax.devices()[0]
  commit = None
  try:
    commit = subprocess.run(
      ["git", "rev-parse", "--short", "HEAD"],
      capture_output=True,
      text=True,
      check=True,
      timeout=10,
      cwd=os.path.dirname(os.path.abspath(__file__)),
    ).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    pass
  return dict(
    date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    command=shlex.join(
      ["pallas-fa3", "bench"] + list(sys.argv[2:] if argv is None else argv)
    ),
    device=f"{device.platform} {device.device_kind}",
    device_count=jax.device_count(),
    compute_capability=getattr(device, "compute_capability", None),
    platform_version=getattr(device.client, "platform_version", None),
    jax=jax.__version__,
    jaxlib=jaxlib.__version__,
    python=platform.python_version(),
    machine=platform.platform(),
    cpu_count=os.cpu_count(),
    git_commit=commit,
  )


def plan(grid: Sequence, impl_names: Sequence[str]) -> list[tuple]:
  """(impl, spec) pairs, each implementation named once.

  The attention modes: spec by spec, each spec's implementations in the
  order given, but `interpret` gets only a tiny correctness case within the
  grid's filters, last. Decode: ours (kind "ours") on every spec first, then
  the others on every spec, each spec's implementations in the order given
  (a spec's inputs are made once per block), so that a time budget cuts
  baselines first.
  """
  chosen = [impls.REGISTRY[n] for n in dict.fromkeys(impl_names)]
  if grid and grid[0].mode == specs.DECODE:
    ours = [i for i in chosen if i.kind == "ours"]
    blocks = (ours, [i for i in chosen if i.kind != "ours"])
    return [(i, s) for block in blocks for s in grid for i in block]
  cases = [(i, s) for s in grid for i in chosen if i.name != "interpret"]
  if "interpret" in impl_names and grid:
    cases.append((impls.REGISTRY["interpret"], specs.tiny_spec_for(grid)))
  return cases


def _base_record(impl, spec) -> dict:
  """The record of a case not (yet) measured; its columns are the mode's."""
  if spec.mode == specs.DECODE:
    shape = dict(
      cache_len=spec.cache_len,
      seq_q=spec.seq_q,
      heads_q=spec.heads_q,
      heads_kv=spec.heads_kv,
      head_dim=spec.head_dim,
      gqa=spec.gqa,
      page_size=spec.page_size,
      num_splits=spec.splits_label,
      splits=None,
      ragged=spec.ragged,
      batch_invariant=spec.batch_invariant,
      flex=spec.flex,
    )
    work = dict(kv_bytes=spec.kv_bytes)
    rates = dict(gbps=None, pct_hbm=None, tokens_per_s=None, tflops=None)
    fp8_parts = {}
  else:
    shape = dict(
      seq_q=spec.seq_q,
      seq_kv=spec.seq_kv,
      heads_q=spec.heads_q,
      heads_kv=spec.heads_kv,
      head_dim=spec.head_dim,
      head_dim_v=spec.head_dim_v,
      causal=spec.causal,
      window=options.format_window(spec.window),
      softcap=spec.softcap,
      sinks=spec.sinks,
      docs=spec.docs,
      gqa=spec.gqa,
    )
    work = {}
    rates = dict(tflops=None, pct_peak=None)
    fp8_parts = dict(quantize_ms=None, kernel_ms=None, kernel_tflops=None)
  return dict(
    spec=spec.name,
    impl=impl.name,
    kind=impl.kind,
    mode=spec.mode,
    dtype=spec.dtype,
    batch=spec.batch,
    **shape,
    tags=" ".join(spec.tags),
    **work,
    flops=spec.flops,
    status="skipped",
    reason="",
    time_median_ms=None,
    time_min_ms=None,
    time_max_ms=None,
    runs=None,
    compile_s=None,
    **rates,
    temp_mib=None,
    peak_mib=None,
    max_abs_err=None,
    **fp8_parts,
    note="correctness only, not a speed figure"
    if spec.correctness_only
    else "",
  )


def _unsupported(impl, spec, platform: str) -> str | None:
  """Why `impl` cannot run `spec` on `platform` (None: it can try)."""
  if spec.mode != specs.DECODE and fp8_case.unsupported(impl.name, spec):
    return fp8_case.unsupported(impl.name, spec)
  return impl.unsupported(spec, platform)


def _reference_output(spec, input_set: tuple) -> np.ndarray:
  """Our reference's output on one input set, float32."""
  fn = jax.jit(impls.REGISTRY["reference"].build(spec))
  args = input_set if spec.mode == specs.DECODE else input_set[:3]
  return np.asarray(fn(*args), np.float32)


def _max_err(got, want: np.ndarray) -> float:
  """max |got - want| in float32 (decode outputs `[b, 1, hq, d]` or `[b,
  hq, d]`)."""
  got = np.asarray(got, np.float32).reshape(want.shape)
  return float(np.max(np.abs(got - want)))


def run_case(
  impl: impls.Impl,
  spec,
  inputs: list[tuple],
  settings: dict,
  peak: float | None,
  reference=None,
) -> dict:
  """Measures one (impl, spec); the record says why if it could not.

  Args:
    impl, spec: the case.
    inputs: the spec's input sets (`timing.make_inputs`).
    settings: platform, runs, warmup, cheap_s (`run_sweep`'s).
    peak: what the % column is of: the bf16 matmul's TFLOP/s (the
      attention modes), the HBM bytes/s (decode); None: no % column.
    reference: `() -> our reference's output on inputs[0]` (float32 numpy)
      for the cases that record their error (decode's, the correctness
      case); None: computed here.
  """
  rec = _base_record(impl, spec)
  reason = _unsupported(impl, spec, settings["platform"])
  if reason:
    rec["reason"] = reason[:_REASON_CHARS]
    return rec
  decode = spec.mode == specs.DECODE
  # A correctness case is not a speed figure: one call is enough.
  warmup, runs, cheap_s = (
    (0, 1, 0.0)
    if spec.correctness_only
    else (settings["warmup"], settings["runs"], settings.get("cheap_s", 0.0))
  )
  parts = None
  try:
    if spec.dtype == "fp8" and not decode:
      parts = fp8_case.measure(impl.name, spec, inputs, warmup, runs)
      result = parts.total
      forward = lambda: parts.out
    else:
      arg_sets = [impl.prepare(spec, *s) for s in inputs]
      jitted, args = timing.mode_function(impl.build(spec), spec.mode, arg_sets)
      result, compiled = timing.measure(jitted, args, warmup, runs, cheap_s)
      # The output on the first inputs: the timed call's where it is the
      # forward, else the forward's.
      forward = lambda: (
        compiled(*args[0])
        if spec.mode in ("fwd", specs.DECODE)
        else jax.jit(impl.build(spec))(*arg_sets[0][:3])
      )
    if decode:
      rec["splits"] = impl.splits(spec)
    if decode or spec.correctness_only:
      want = reference() if reference else _reference_output(spec, inputs[0])
      rec["max_abs_err"] = _max_err(forward(), want)
  except NotImplementedError as e:
    rec["reason"] = f"NotImplementedError: {e}"[:_REASON_CHARS]
    return rec
  except Exception as e:  # pylint: disable=broad-except
    rec.update(
      status="error", reason=f"{type(e).__name__}: {e}"[:_REASON_CHARS]
    )
    return rec
  memory = timing.peak_device_bytes()
  tflops = rec["flops"] / result.median_s / 1e12
  rec.update(
    status="ok",
    time_median_ms=result.median_s * 1e3,
    time_min_ms=result.min_s * 1e3,
    time_max_ms=result.max_s * 1e3,
    runs=result.runs,
    compile_s=result.compile_s,
    tflops=tflops,
    temp_mib=None if result.temp_bytes is None else result.temp_bytes / _MIB,
    peak_mib=None if memory is None else memory / _MIB,
  )
  if decode:
    bytes_s = spec.kv_bytes / result.median_s
    rec.update(
      gbps=bytes_s / 1e9,
      pct_hbm=None if not peak else 100 * bytes_s / peak,
      # new tokens generated per second: the step's batch x seq_q
      tokens_per_s=spec.batch * spec.seq_q / result.median_s,
    )
  else:
    rec["pct_peak"] = None if not peak else 100 * tflops / peak
  if parts is not None:
    kernel_s = parts.attention.median_s
    rec.update(
      quantize_ms=parts.quantize.median_s * 1e3,
      kernel_ms=kernel_s * 1e3,
      kernel_tflops=rec["flops"] / kernel_s / 1e12,
      pct_peak=None,
    )  # the measured peak is bf16's, not FP8's
  return rec


def each_case(cases: Sequence[tuple], one, progress: bool = True) -> list:
  """`[one(impl, spec) for impl, spec in cases]`, under a rich progress bar
  (naming the case being run) when `progress` and rich is installed."""
  if progress:
    try:
      from rich.progress import Progress  # pylint: disable=g-import-not-at-top
    except ImportError:
      progress = False
  if not progress:
    return [one(impl, spec) for impl, spec in cases]
  records = []
  with Progress(transient=False) as bar:
    task = bar.add_task("bench", total=len(cases))
    for impl, spec in cases:
      bar.update(task, description=f"{impl.name:>9} {spec.name}")
      records.append(one(impl, spec))
      bar.advance(task)
  return records


def run_sweep(
  cases: Sequence[tuple], settings: dict, progress: bool = True
) -> dict:
  """Runs `cases` (from `plan`); returns {matmul_peak_tflops (where
  settings have matmul_n), records, sweep_wall_s}.

  Args:
    cases: `(Impl, spec)` pairs.
    settings: platform, runs, warmup, input_sets, seed, time_budget_s
      (None: no limit), cheap_s (`timing.time_calls`'s; absent: 0, no
      more calls than runs); the attention modes' matmul_n (None: do not measure
      the matmul peak), decode's hbm_peak_bytes_s (None: no % of peak).
    progress: show a rich progress bar.
  """
  start = time.perf_counter()
  peak = settings.get("hbm_peak_bytes_s")
  if settings.get("matmul_n"):
    peak = timing.matmul_tflops(settings["matmul_n"])
  budget = settings.get("time_budget_s")
  inputs_of, want_of = {}, {}
  auto = {
    s.shape_key
    for _, s in cases
    if s.mode == specs.DECODE and s.num_splits is None
  }

  def inputs(spec):
    if spec not in inputs_of:
      inputs_of.clear()  # one spec's inputs alive at a time
      inputs_of[spec] = timing.make_inputs(
        spec, spec.jax_dtype, settings["input_sets"], settings["seed"]
      )
    return inputs_of[spec]

  def reference(spec):
    if spec.name not in want_of:  # small: one output per spec
      want_of[spec.name] = _reference_output(spec, inputs(spec)[0])
    return want_of[spec.name]

  def one(impl, spec):
    # Why not, cheapest first: each case's own reason, also past the budget.
    reason = _unsupported(impl, spec, settings["platform"])
    if not reason and spec.mode == specs.DECODE and not impl.splits_kv:
      if spec.num_splits is not None and spec.shape_key in auto:
        reason = NO_SPLITS  # the same computation: time it once
    if not reason and budget is not None:
      if time.perf_counter() - start > budget:
        reason = f"time budget of {budget:.0f} s used up"
    if reason:
      return dict(_base_record(impl, spec), reason=reason[:_REASON_CHARS])
    return run_case(
      impl, spec, inputs(spec), settings, peak, lambda: reference(spec)
    )

  records = each_case(cases, one, progress)
  result = dict(records=records, sweep_wall_s=time.perf_counter() - start)
  if "matmul_n" in settings:
    result = dict(matmul_peak_tflops=peak, **result)
  return result
