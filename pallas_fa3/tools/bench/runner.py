"""The sweep: plan (impl, spec) cases, measure each, collect records.

Every planned case yields one record (a flat dict, one CSV row): status
"ok" with times, TFLOPs/s and memory (fp8: also the quantization and the
attention timed apart); "skipped" with the reason (unsupported shape or
option, backend not implemented, no GPU, FP8 backward, time budget); or
"error" with the exception. Nothing is dropped silently. A record's
`window` is "LEFT,RIGHT" text as on the command line (None: no window),
`softcap` a float or None, `sinks` a bool, `docs` an int or None (one
document) and `head_dim_v` an int (equal to `head_dim` unless set).
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

from pallas_fa3.tools.bench import (
  flops,
  fp8_case,
  impls,
  options,
  specs,
  timing,
)

_MIB = 2**20
_REASON_CHARS = 400  # keep error messages readable in tables and CSV
# Runs per case on each platform (CPU timings are long and few suffice).
DEFAULT_RUNS = {"gpu": 20, "cpu": 3}
DEFAULT_WARMUP = {"gpu": 5, "cpu": 1}
# `interpret` (the kernels' correctness case) runs only when --impl names
# it: it needs an XLA CPU pool of 6 threads, which a small CPU lacks unless
# asked for before JAX starts and which slows the other implementations.
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


def platform_name() -> str:
  """ "gpu" when the default JAX backend is a GPU, else "cpu" (also TPU)."""
  return "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else "cpu"


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


def plan(
  grid: Sequence[specs.BenchSpec], impl_names: Sequence[str]
) -> list[tuple[impls.Impl, specs.BenchSpec]]:
  """(impl, spec) pairs: every grid spec for every impl but `interpret`,
  which gets only a tiny correctness case within the grid's filters."""
  cases = []
  for spec in grid:
    cases += [(impls.REGISTRY[n], spec) for n in impl_names if n != "interpret"]
  if "interpret" in impl_names and grid:
    cases.append((impls.REGISTRY["interpret"], specs.tiny_spec_for(grid)))
  return cases


def _base_record(impl, spec) -> dict:
  return dict(
    spec=spec.name,
    impl=impl.name,
    kind=impl.kind,
    mode=spec.mode,
    dtype=spec.dtype,
    batch=spec.batch,
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
    tags=" ".join(spec.tags),
    flops=flops.attention_flops(spec, spec.head_dim_v),
    status="skipped",
    reason="",
    time_median_ms=None,
    time_min_ms=None,
    time_max_ms=None,
    compile_s=None,
    tflops=None,
    pct_peak=None,
    temp_mib=None,
    peak_mib=None,
    max_abs_err=None,
    quantize_ms=None,
    kernel_ms=None,
    kernel_tflops=None,
    note="correctness only, not a speed figure"
    if spec.correctness_only
    else "",
  )


def _max_err(impl, spec, inputs, got=None) -> float:
  """max |impl - reference| on the first input set (float32).

  `got`: the implementation's output there, when the caller has it.
  """
  if got is None:
    q, k, v = impl.prepare(spec, *inputs[0][:3])
    got = jax.jit(impl.build(spec))(q, k, v)
  want = jax.jit(impls.REGISTRY["reference"].build(spec))(*inputs[0][:3])
  return float(
    np.max(np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)))
  )


def run_case(
  impl: impls.Impl,
  spec: specs.BenchSpec,
  inputs: list[tuple],
  settings: dict,
  peak_tflops: float | None,
) -> dict:
  """Measures one (impl, spec); the record says why if it could not."""
  rec = _base_record(impl, spec)
  reason = fp8_case.unsupported(impl.name, spec) or impl.unsupported(
    spec, settings["platform"]
  )
  if reason:
    rec["reason"] = reason
    return rec
  # A correctness case is not a speed figure: one call is enough.
  warmup, runs = (
    (0, 1) if spec.correctness_only else (settings["warmup"], settings["runs"])
  )
  parts = None
  try:
    if spec.dtype == "fp8":
      parts = fp8_case.measure(impl.name, spec, inputs, warmup, runs)
      result = parts.total
    else:
      arg_sets = [impl.prepare(spec, *s[:3]) + s[3:] for s in inputs]
      jitted, args = timing.mode_function(impl.build(spec), spec.mode, arg_sets)
      result, _ = timing.measure(jitted, args, warmup, runs)
    if spec.correctness_only:
      rec["max_abs_err"] = _max_err(
        impl, spec, inputs, None if parts is None else parts.out
      )
  except NotImplementedError as e:
    rec["reason"] = f"NotImplementedError: {e}"[:_REASON_CHARS]
    return rec
  except Exception as e:  # pylint: disable=broad-except
    rec.update(
      status="error", reason=f"{type(e).__name__}: {e}"[:_REASON_CHARS]
    )
    return rec
  tflops = rec["flops"] / result.median_s / 1e12
  peak = timing.peak_device_bytes()
  rec.update(
    status="ok",
    time_median_ms=result.median_s * 1e3,
    time_min_ms=result.min_s * 1e3,
    time_max_ms=result.max_s * 1e3,
    compile_s=result.compile_s,
    tflops=tflops,
    pct_peak=None if not peak_tflops else 100 * tflops / peak_tflops,
    temp_mib=None if result.temp_bytes is None else result.temp_bytes / _MIB,
    peak_mib=None if peak is None else peak / _MIB,
  )
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
  cases: Sequence[tuple[impls.Impl, specs.BenchSpec]],
  settings: dict,
  progress: bool = True,
) -> dict:
  """Runs `cases` (from `plan`); returns {matmul_peak_tflops, records}.

  Args:
    cases: `(Impl, BenchSpec)` pairs.
    settings: platform, runs, warmup, input_sets, seed, time_budget_s
      (None: no limit), matmul_n (None: do not measure the matmul peak).
    progress: show a rich progress bar.
  """
  start = time.perf_counter()
  peak = None
  if settings.get("matmul_n"):
    peak = timing.matmul_tflops(settings["matmul_n"])
  inputs_of = {}
  budget = settings.get("time_budget_s")

  def one(impl, spec):
    if budget is not None and time.perf_counter() - start > budget:
      return dict(
        _base_record(impl, spec),
        reason=f"time budget of {budget:.0f} s used up",
      )
    if spec not in inputs_of:
      inputs_of.clear()  # one spec's inputs alive at a time
      inputs_of[spec] = timing.make_inputs(
        spec, spec.jax_dtype, settings["input_sets"], settings["seed"]
      )
    return run_case(impl, spec, inputs_of[spec], settings, peak)

  records = each_case(cases, one, progress)
  return dict(
    matmul_peak_tflops=peak,
    records=records,
    sweep_wall_s=time.perf_counter() - start,
  )
