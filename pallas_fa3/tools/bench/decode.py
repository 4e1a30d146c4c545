"""The decode sweep (`pallas-fa3 bench --mode decode`): cases, timing,
records.

Every planned case yields one record (one CSV row): status "ok" with the
times (compile excluded, warm-up, median/min/max of `runs` calls rotating
`input_sets` inputs: `timing.measure`), the K/V bytes read per second and
their share of the device's HBM peak (`timing.hbm_peak_bytes_s`; none on a
CPU or an unlisted GPU: the column stays empty), TFLOP/s, and the largest
difference from our reference on the first inputs; "skipped" with the
reason (an implementation that takes no split count is timed once per
shape, at "auto", when the grid has it); or "error" with the exception.
Ours run first on every case, then the baselines (`--impl` order within a
case), so a time budget cuts baselines first.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import numpy as np

from pallas_fa3.tools.bench import impls, runner, specs, timing

_MIB = 2**20
_REASON_CHARS = 400  # as runner.py: readable in tables and CSV
NO_PEAK_CPU = "no HBM peak on a CPU: the % column is empty"
NO_SPLITS = "takes no split count: timed once per shape, at num_splits auto"


def hbm_peak(platform: str) -> tuple[float | None, str]:
  """(bytes/s, what it is) of the default device's HBM peak."""
  if platform != "gpu":
    return None, NO_PEAK_CPU
  kind = jax.devices()[0].device_kind
  peak = timing.hbm_peak_bytes_s(kind)
  if peak is None:
    return None, f"no HBM peak known for {kind!r}: the % column is empty"
  return peak, f"{peak / 1e12:.3g} TB/s ({kind}, datasheet)"


def plan(
  grid: Sequence[specs.DecodeBenchSpec], impl_names: Sequence[str]
) -> list[tuple[impls.Impl, specs.DecodeBenchSpec]]:
  """(impl, spec) pairs: ours (kind "ours") on every spec first, then the
  others on every spec, each spec's implementations in the order given
  (a spec's inputs are made once per block)."""
  chosen = [impls.REGISTRY[n] for n in dict.fromkeys(impl_names)]
  ours = [i for i in chosen if i.kind == "ours"]
  others = [i for i in chosen if i.kind != "ours"]
  return [(i, s) for block in (ours, others) for s in grid for i in block]


def base_record(impl, spec) -> dict:
  return dict(
    spec=spec.name,
    impl=impl.name,
    kind=impl.kind,
    mode=spec.mode,
    dtype=spec.dtype,
    batch=spec.batch,
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
    tags=" ".join(spec.tags),
    kv_bytes=spec.kv_bytes,
    flops=spec.flops,
    status="skipped",
    reason="",
    time_median_ms=None,
    time_min_ms=None,
    time_max_ms=None,
    compile_s=None,
    gbps=None,
    pct_hbm=None,
    tflops=None,
    temp_mib=None,
    peak_mib=None,
    max_abs_err=None,
    note="",
  )


def _max_err(got, want) -> float:
  """max |got - want| in float32 (outputs `[b, 1, hq, d]` or `[b, hq, d]`)."""
  got = np.asarray(got, np.float32).reshape(want.shape)
  return float(np.max(np.abs(got - want)))


def run_case(
  impl: impls.Impl,
  spec: specs.DecodeBenchSpec,
  inputs: list[tuple],
  settings: dict,
  reference,
) -> dict:
  """Measures one (impl, spec) that `impl.unsupported` accepts; the record
  says why if it could not.

  `reference()`: our reference's output on `inputs[0]`, float32 numpy.
  """
  rec = base_record(impl, spec)
  try:
    arg_sets = [impl.prepare(spec, *s) for s in inputs]
    result, compiled = timing.measure(
      jax.jit(impl.build(spec)), arg_sets, settings["warmup"], settings["runs"]
    )
    rec["splits"] = impl.splits(spec)
    err = _max_err(compiled(*arg_sets[0]), reference())
  except NotImplementedError as e:
    rec["reason"] = f"NotImplementedError: {e}"[:_REASON_CHARS]
    return rec
  except Exception as e:  # pylint: disable=broad-except
    rec.update(
      status="error", reason=f"{type(e).__name__}: {e}"[:_REASON_CHARS]
    )
    return rec
  peak_bytes_s = settings.get("hbm_peak_bytes_s")
  bytes_s = spec.kv_bytes / result.median_s
  memory = timing.peak_device_bytes()
  rec.update(
    status="ok",
    time_median_ms=result.median_s * 1e3,
    time_min_ms=result.min_s * 1e3,
    time_max_ms=result.max_s * 1e3,
    compile_s=result.compile_s,
    gbps=bytes_s / 1e9,
    pct_hbm=None if not peak_bytes_s else 100 * bytes_s / peak_bytes_s,
    tflops=spec.flops / result.median_s / 1e12,
    temp_mib=None if result.temp_bytes is None else result.temp_bytes / _MIB,
    peak_mib=None if memory is None else memory / _MIB,
    max_abs_err=err,
  )
  return rec


def run_sweep(cases: Sequence[tuple], settings: dict, progress=True) -> dict:
  """Runs `cases` (from `plan`); returns {records, sweep_wall_s}.

  Args:
    cases: `(DecodeImpl, DecodeBenchSpec)` pairs.
    settings: platform, runs, warmup, input_sets, seed, time_budget_s
      (None: no limit), hbm_peak_bytes_s (None: no % of peak).
    progress: show a rich progress bar.
  """
  start = time.perf_counter()
  budget = settings.get("time_budget_s")
  inputs_of, want_of = {}, {}
  auto = {s.shape_key for _, s in cases if s.num_splits is None}

  def inputs(spec):
    if spec not in inputs_of:
      inputs_of.clear()  # one spec's inputs alive at a time
      inputs_of[spec] = timing.make_inputs(
        spec, spec.jax_dtype, settings["input_sets"], settings["seed"]
      )
    return inputs_of[spec]

  def reference(spec):
    if spec.name not in want_of:  # small: [b, 1, hq, d] per spec
      fn = jax.jit(impls.REGISTRY["reference"].build(spec))
      want_of[spec.name] = np.asarray(fn(*inputs(spec)[0]), np.float32)
    return want_of[spec.name]

  def one(impl, spec):
    # Why not, cheapest first: each case's own reason, also past the budget.
    reason = impl.unsupported(spec, settings["platform"])
    if not reason and not impl.splits_kv and spec.num_splits is not None:
      if spec.shape_key in auto:  # the same computation: time it once
        reason = NO_SPLITS
    if not reason and budget is not None:
      if time.perf_counter() - start > budget:
        reason = f"time budget of {budget:.0f} s used up"
    if reason:
      return dict(base_record(impl, spec), reason=reason[:_REASON_CHARS])
    return run_case(impl, spec, inputs(spec), settings, lambda: reference(spec))

  records = runner.each_case(cases, one, progress)
  return dict(records=records, sweep_wall_s=time.perf_counter() - start)
