"""Timing and memory of one compiled case, its inputs, and the device's
peaks (the measured matmul rate, the HBM bandwidth by device kind):
compilation excluded (`jit(...).lower(...).compile()`), then warm-up calls,
then timed calls each ending in `block_until_ready` (more of them where
calls are cheap), cycling through several independent random input sets
(never zeros); median, min and max: docs/benchmarks.md#the-code.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3.kvcache import quantize_kv_cache
from pallas_fa3.tools.bench import specs

# The matmul used to measure the device's dense bf16 rate (FLOPs = 2 n^3).
MATMUL_N_GPU = 8192

# HBM bandwidth, bytes/s, from NVIDIA's datasheets, by a substring of
# `jax.Device.device_kind` (first match wins; H100 SXM reports "H100 80GB
# HBM3"). Decoding is memory-bound: its % of peak is against these. A kind
# not listed (a CPU, another GPU, GH200 whose HBM differs by model) has no
# peak: the column stays empty rather than holding a guess.
HBM_PEAK_BYTES_S: tuple[tuple[str, float], ...] = (
  ("H200", 4.8e12),
  ("H100 80GB HBM3", 3.35e12),
  ("H100 SXM", 3.35e12),
  ("H100 NVL", 3.9e12),
  ("H100 PCIe", 2.0e12),
)
NO_PEAK_CPU = "no HBM peak on a CPU: the % column is empty"
# More calls are cheap while a case's timed calls add up to less than this:
# `time_calls(..., cheap_s=CHEAP_S)` keeps calling, up to MORE_RUNS x its
# runs (bench does so where --runs is unset), so that a fast case's median
# rests on more than the CPU default's 3 calls.
CHEAP_S = 0.25
MORE_RUNS = 5


@dataclasses.dataclass(frozen=True)
class Timing:
  """Seconds per call (of `runs` timed calls) and the compiled function's
  memory."""

  median_s: float
  min_s: float
  max_s: float
  compile_s: float
  temp_bytes: int | None
  runs: int


def make_inputs(spec, dtype: str, num_sets: int, seed: int) -> list[tuple]:
  """`num_sets` independent input tuples of a case, standard-normal (never
  zeros) in `dtype`.

  The attention modes: `(q, k, v, dout)`; v and dout have
  `spec.head_dim_v` columns where the spec has one (not None). Decode:
  `(q, k_cache, v_cache, lengths, page_table)` (MLA: v_cache None), and
  for fp8 `k_descale,
  v_descale` after them: the whole cache random, also past a ragged length
  (fp8: quantized by `quantize_kv_cache`); lengths int32 `[batch]`;
  page_table int32 `[batch, pages_per_seq]`, a random permutation of the
  pages (the pages of a sequence are scattered, as a serving system
  recycles them), None for a contiguous cache.
  """
  q_shape = (spec.batch, spec.seq_q, spec.heads_q, spec.head_dim)
  decode = getattr(spec, "mode", None) == specs.DECODE
  if decode:
    pages = spec.batch * spec.pages_per_seq
    rows = (
      (pages, spec.page_size) if spec.paged else (spec.batch, spec.cache_len)
    )
    mla = getattr(spec, "mla", False)  # one cache: no v_cache
    shapes = (q_shape,) + ((*rows, spec.heads_kv, spec.head_dim),) * (
      1 if mla else 2
    )
    lengths = jnp.asarray(spec.lengths, jnp.int32)
  else:
    dv = getattr(spec, "head_dim_v", None) or spec.head_dim
    k_shape = (spec.batch, spec.seq_kv, spec.heads_kv, spec.head_dim)
    shapes = (q_shape, k_shape, k_shape[:3] + (dv,), q_shape[:3] + (dv,))
  sets = []
  for i in range(num_sets):
    key = jax.random.fold_in(jax.random.key(seed), i)
    keys = jax.random.split(key, len(shapes))
    arrays = tuple(
      jax.random.normal(k, shape, dtype) for k, shape in zip(keys, shapes)
    )
    if not decode:
      sets.append(arrays)
      continue
    q, k, v = arrays if len(arrays) == 3 else arrays + (None,)
    table = None
    if spec.paged:
      order = np.random.default_rng([seed, i]).permutation(pages)
      table = jnp.asarray(order.reshape(spec.batch, -1), jnp.int32)
    if spec.fp8_cache:
      x = quantize_kv_cache(k, v, page_table=table)
      sets.append((q, x.k_cache, x.v_cache, lengths, table) + x[2:])
    else:
      sets.append((q, k, v, lengths, table))
  return jax.block_until_ready(sets)


def measure_mode(
  fn: Callable,
  mode: str,
  inputs: tuple,
  warmup: int,
  runs: int,
  flops_fwd: float,
  want: Any,
) -> dict:
  """One case of a mode with its own table (`--mode flex`, `--mode
  varlen`): `fn(q, k, v)` timed in `mode` on `inputs = (q, k, v, dout)`;
  the record's fields: status "ok", ms, TFLOP/s (`flops_fwd`, x3.5 for
  fwd+bwd) and, in "fwd", the largest difference from `want`; or status
  "error" and the error."""
  try:
    jitted, args = mode_function(fn, mode, [inputs])
    t, compiled = measure(jitted, args, warmup, runs)
  except Exception as e:  # pylint: disable=broad-except
    return dict(status="error", error=f"{type(e).__name__}: {e}"[:300])
  flops = flops_fwd * (1 if mode == "fwd" else 3.5)
  rec = dict(status="ok", ms=1e3 * t.median_s, tflops=flops / t.median_s / 1e12)
  if mode == "fwd":
    got = np.asarray(compiled(*args[0]), np.float32)
    rec["max_err"] = float(np.abs(got - want).max())
  return rec


def mode_function(
  fn: Callable, mode: str, input_sets: Sequence[tuple]
) -> tuple[Callable, list[tuple]]:
  """The jitted function timed for `mode`, and its argument tuples.

  "fwd": `fn(q, k, v)`. "fwd+bwd": the forward and the pullback of a random
  cotangent, in one function. "bwd": the pullback alone; the forward's
  residuals are computed beforehand (`jax.vjp` returns them inside a pytree
  that is passed to the timed function as an argument). "decode": `fn` of
  the whole input tuple.
  """
  if mode == specs.DECODE:
    return jax.jit(fn), list(input_sets)
  if mode == "fwd":
    return jax.jit(fn), [s[:3] for s in input_sets]
  if mode == "fwd+bwd":

    def fwd_bwd(q, k, v, dout):
      _, pullback = jax.vjp(fn, q, k, v)
      return pullback(dout)

    return jax.jit(fwd_bwd), list(input_sets)
  if mode == "bwd":
    # Each jax.vjp call gives a pullback whose pytree metadata differs (it
    # holds a fresh closure), so pass only the residual leaves and rebuild
    # the pullback from the first call's structure.
    args, treedef = [], None
    forward = jax.jit(fn)
    for q, k, v, dout in input_sets:
      _, pullback = jax.vjp(forward, q, k, v)
      leaves, this_def = jax.tree.flatten(pullback)
      treedef = treedef or this_def
      args.append((leaves, dout))
    return jax.jit(
      lambda leaves, dout: jax.tree.unflatten(treedef, leaves)(dout)
    ), args
  raise ValueError(f"mode must be fwd, bwd, fwd+bwd or decode; got {mode!r}")


def compile_only(jitted: Callable, args: tuple) -> tuple[Any, float]:
  """`jitted` lowered and compiled for `args`, and the seconds it took."""
  start = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  return compiled, time.perf_counter() - start


def temp_bytes(compiled) -> int | None:
  """XLA's scratch bytes of a compiled function (None if not reported)."""
  try:
    stats = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    return None
  return None if stats is None else int(stats.temp_size_in_bytes)


def time_calls(
  compiled,
  arg_sets: Sequence[tuple],
  warmup: int,
  runs: int,
  cheap_s: float = 0.0,
) -> list[float]:
  """Seconds of `runs` calls after `warmup` ones, rotating the inputs; then
  more calls, up to `MORE_RUNS x runs` in all, while the timed calls add up
  to less than `cheap_s` seconds."""
  for i in range(warmup):
    jax.block_until_ready(compiled(*arg_sets[i % len(arg_sets)]))
  times = []
  while len(times) < runs or (
    sum(times) < cheap_s and len(times) < MORE_RUNS * runs
  ):
    args = arg_sets[len(times) % len(arg_sets)]
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  return times


def measure(
  jitted: Callable,
  arg_sets: Sequence[tuple],
  warmup: int,
  runs: int,
  cheap_s: float = 0.0,
) -> tuple[Timing, Any]:
  """Compiles, warms up and times one case (`time_calls`); returns (Timing,
  compiled)."""
  compiled, compile_s = compile_only(jitted, arg_sets[0])
  times = time_calls(compiled, arg_sets, warmup, runs, cheap_s)
  return Timing(
    median_s=statistics.median(times),
    min_s=min(times),
    max_s=max(times),
    compile_s=compile_s,
    temp_bytes=temp_bytes(compiled),
    runs=len(times),
  ), compiled


def hbm_peak_bytes_s(device_kind: str) -> float | None:
  """The HBM peak of a device kind (`HBM_PEAK_BYTES_S`), or None."""
  for name, peak in HBM_PEAK_BYTES_S:
    if name.lower() in device_kind.lower():
      return peak
  return None


def hbm_peak(platform: str) -> tuple[float | None, str]:
  """(bytes/s, what it is) of the default device's HBM peak."""
  if platform != "gpu":
    return None, NO_PEAK_CPU
  kind = jax.devices()[0].device_kind
  peak = hbm_peak_bytes_s(kind)
  if peak is None:
    return None, f"no HBM peak known for {kind!r}: the % column is empty"
  return peak, f"{peak / 1e12:.3g} TB/s ({kind}, datasheet)"


def peak_device_bytes() -> int | None:
  """The default device's peak bytes in use so far (GPU), else None."""
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # pylint: disable=broad-except
    return None
  return None if not stats else stats.get("peak_bytes_in_use")


def matmul_tflops(
  n: int,
  dtype: str = "bfloat16",
  warmup: int = 3,
  runs: int = 10,
  seed: int = 0,
) -> float:
  """Measured TFLOPs/s of an `n x n @ n x n` matmul (median time)."""
  keys = jax.random.split(jax.random.key(seed), 4)
  sets = [
    (
      jax.random.normal(keys[2 * i], (n, n), dtype),
      jax.random.normal(keys[2 * i + 1], (n, n), dtype),
    )
    for i in range(2)
  ]
  timing, _ = measure(jax.jit(jnp.dot), sets, warmup, runs)
  return 2 * n**3 / timing.median_s / 1e12
