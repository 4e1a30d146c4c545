"""Worker side of `cpu_memory.py`: one role of one case in a fresh process.

`worker(case)` builds the inputs, compiles the attention function, reads
XLA's compiled memory analysis and then either times the execution (role
"time") or measures the peak RSS of executing it (role "memory"), with the
/proc, VmHWM-reset and malloc_trim helpers below. See the docstring of
`cpu_memory.py` for the method.
"""

from __future__ import annotations

import gc
import os
import resource
import statistics
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MIB = 1024.0 * 1024.0

_COMPILED_FIELDS = (
  "temp_size_in_bytes",
  "argument_size_in_bytes",
  "output_size_in_bytes",
  "alias_size_in_bytes",
  "generated_code_size_in_bytes",
)


# ---------------------------------------------------------------------------
# /proc helpers.


def _proc_status_kib() -> dict[str, int]:
  """VmRSS / VmHWM of this process in KiB."""
  out = {}
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(("VmRSS:", "VmHWM:")):
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0])
  return out


def _reset_hwm() -> None:
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")


def _hwm_reset_works() -> tuple[bool, str]:
  """Allocates and frees 64 MiB, resets VmHWM, and checks that it dropped."""
  try:
    import numpy as np

    buf = np.ones(64 * 1024 * 1024 // 8)  # touched: resident
    high = _proc_status_kib()["VmHWM"]
    del buf
    gc.collect()
    _reset_hwm()
    after = _proc_status_kib()
  except OSError as e:
    return False, f"writing /proc/self/clear_refs failed: {e}"
  except KeyError:
    return False, "/proc/self/status has no VmHWM"
  dropped = high - after["VmHWM"]
  if dropped > 32 * 1024:
    return True, (
      f"VmHWM reset verified: it dropped by {dropped / 1024:.0f}"
      " MiB after freeing a 64 MiB buffer"
    )
  return False, (
    f"VmHWM did not drop after reset (high {high} KiB, now"
    f" {after['VmHWM']} KiB)"
  )


def _malloc_trim():
  """glibc's `malloc_trim`, or None where it is unavailable."""
  try:
    import ctypes

    fn = ctypes.CDLL("libc.so.6").malloc_trim
  except (OSError, AttributeError):
    return None
  fn.argtypes = [ctypes.c_size_t]
  fn.restype = ctypes.c_int
  return fn


def _ru_maxrss_kib() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def _mem_available_bytes() -> int | None:
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


# ---------------------------------------------------------------------------
# The function under test.


def _function(case: dict):
  """(function to compile, number of its arguments) for the case."""
  import jax
  import jax.numpy as jnp

  import pallas_fa3

  impl = case["impl"]
  config = None
  if impl == "blockwise" and case.get("block") is not None:
    config = pallas_fa3.BlockwiseConfig(*case["block"])

  def forward(q, k, v):
    return pallas_fa3.flash_attention(
      q, k, v, causal=case["causal"], implementation=impl, config=config
    )

  def loss(q, k, v, ct):
    return jnp.sum(forward(q, k, v).astype(jnp.float32) * ct)

  if case["pass"] == "fwd":
    return forward, 3
  return jax.grad(loss, argnums=(0, 1, 2)), 4


# ---------------------------------------------------------------------------
# Measurement.


def _measure_time(case: dict, compiled, input_sets: list[tuple]) -> dict:
  """Timing: the default allocator, no RSS bookkeeping between runs."""
  import jax

  jax.block_until_ready(compiled(*input_sets[0]))  # warm-up
  times = []
  for i in range(case["runs"]):
    args = input_sets[(i + 1) % len(input_sets)]
    t = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t)
  return dict(
    times_s=times,
    time_median_s=statistics.median(times),
    time_min_s=min(times),
    time_max_s=max(times),
    loadavg_after=os.getloadavg()[0],
  )


def _measure_memory(
  case: dict, compiled, input_sets: list[tuple], hwm_ok: bool
) -> dict:
  """Peak RSS delta of the first execution and of `mem_repeats` more."""
  import jax

  trim = _malloc_trim() if case["malloc_trim"] else None
  result = dict(
    malloc_trim=trim is not None,
    malloc_mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_"),
  )

  def measured_call(args):
    """One execution: (peak delta KiB, rss before KiB, hwm after KiB, s)."""
    gc.collect()
    time.sleep(case["settle_s"])  # let asynchronously freed buffers go
    if trim is not None:
      trim(0)  # hand freed-but-resident heap pages back to the kernel
    if hwm_ok:
      _reset_hwm()
    before = _proc_status_kib()
    maxrss_before = _ru_maxrss_kib()
    t = time.perf_counter()
    out = compiled(*args)
    jax.block_until_ready(out)
    dt = time.perf_counter() - t
    after = _proc_status_kib()
    del out
    if hwm_ok:
      peak = after["VmHWM"] - before["VmRSS"]
    else:  # ru_maxrss cannot be reset: only growth past the old max shows
      peak = max(_ru_maxrss_kib(), maxrss_before) - before["VmRSS"]
    return peak, before["VmRSS"], after["VmHWM"], dt

  # The first execution after compile is the primary figure.
  first_peak, first_rss, first_hwm, first_s = measured_call(input_sets[0])
  peaks = [
    measured_call(input_sets[(i + 1) % len(input_sets)])[0]
    for i in range(case["mem_repeats"])
  ]
  result.update(
    peak_delta_first_kib=first_peak,
    rss_before_first_kib=first_rss,
    hwm_first_kib=first_hwm,
    first_run_s=first_s,
    peak_delta_repeats_kib=peaks,
    peak_delta_max_kib=max(peaks + [first_peak]),
    loadavg_after=os.getloadavg()[0],
  )
  return result


def worker(case: dict) -> dict:
  """One role of one case: "memory" (compiled + measured RSS) or "time"."""
  # Checked before JAX is imported, on a small, quiet process.
  if case["role"] == "memory":
    hwm_ok, hwm_note = _hwm_reset_works()
  else:
    hwm_ok, hwm_note = None, None

  if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)
  import jax
  import jax.numpy as jnp
  import numpy as np

  fn, n_args = _function(case)
  dtype = jnp.dtype(case["dtype"])
  shape = (case["batch"], case["seq"], case["heads"], case["head_dim"])

  # Inputs are drawn on the host (numpy) and copied in: generating them with
  # jax.random would run XLA computations whose freed buffers stay resident
  # and can hide part of the next execution's peak.
  rng = np.random.default_rng(case["seed"])
  input_sets = []
  for _ in range(case["input_sets"]):
    qkv = [
      rng.standard_normal(shape, dtype=np.float32).astype(dtype)
      for _ in range(3)
    ]
    ct = rng.standard_normal(shape, dtype=np.float32)  # cotangent of out
    input_sets.append(tuple(jnp.asarray(x) for x in qkv + [ct])[:n_args])
  jax.block_until_ready(input_sets)

  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*input_sets[0]).compile()
  compile_s = time.perf_counter() - t0
  ma = compiled.memory_analysis()
  mem = {
    name: int(getattr(ma, name))
    for name in _COMPILED_FIELDS
    if ma is not None and hasattr(ma, name)
  }

  result = dict(
    case=case,
    compile_s=compile_s,
    compiled=mem,
    hwm_reset_ok=hwm_ok,
    hwm_note=hwm_note,
    loadavg_before=os.getloadavg()[0],
  )

  # Refuse cases that cannot fit (the reference at very long sequences).
  avail = _mem_available_bytes()
  need = mem.get("temp_size_in_bytes", 0) + mem.get("output_size_in_bytes", 0)
  if avail is not None and need > 0.8 * avail:
    result["skipped"] = (
      f"compiled temp+output {need / _MIB:.0f} MiB exceeds"
      f" 80% of MemAvailable {avail / _MIB:.0f} MiB"
    )
    return result

  if case["role"] == "time":
    result.update(_measure_time(case, compiled, input_sets))
  else:
    result.update(_measure_memory(case, compiled, input_sets, hwm_ok))
  return result
