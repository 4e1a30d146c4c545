"""The first minute on a GPU: versions, one tiny call per kernel, the causal mask.

    python benchmarks/device_smoke.py versions --out DIR   # DIR/versions.json
    python benchmarks/device_smoke.py smoke --out DIR      # DIR/smoke.json
    python benchmarks/device_smoke.py causal --out DIR     # DIR/causal.json

`smoke`: one small call (`jax.jit`, causal, GQA, ragged) of every path that
had only been compiled before its first GPU run (`SMOKE_ITEMS`: the
pingpong turns, the fused backward's TMA reduce-add into the in-place
accumulator, the dS exchange barrier, the deterministic kernels, the
shared-tile layout, d256, the multi-warpgroup quantization kernel, the FP8
forward plain and with every option, the decode kernel with bf16 and e4m3
caches; `smoke_items.py`), against the float64 golden with the tolerance rule (FP8: its
blockwise twin; quantization: its twin's bits). Each item runs in a
process of its own under its own timeout, all at once, so a hang is
recorded as "hang" and costs only its own item. `causal`: JAX's `attention_mgpu` refuses causal masks on
CUDA 12.8-12.9.1 for a ptxas miscompilation; this checks our causal forward
(every default config, aligned and offset diagonals, bf16 and fp16) and
`attention_mgpu`'s causal forward (fp16) on this machine's exact toolchain.
Each item's result is written as soon as it is known, so a hang loses only
the item it hangs in. Without a GPU every item is recorded as skipped (the
CPU rehearsal of `device_check.sh`).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
from smoke_items import SMOKE_ITEMS, check, kernel_item

from pallas_fa3 import backends
from pallas_fa3.kernels.sm90 import config as sm90_config
from pallas_fa3.testing import (
  Shape,
  golden_and_naive,
  random_inputs,
)


def _run(cmd: list[str]) -> str:
  try:
    return subprocess.run(
      cmd, capture_output=True, text=True, timeout=20, check=False
    ).stdout.strip()
  except (OSError, subprocess.SubprocessError) as e:
    return f"unavailable: {e}"


def _ptxas_versions() -> dict:
  """Every ptxas this process could use: the CUDA pip packages' and PATH's."""
  found = {}
  import nvidia  # pylint: disable=g-import-not-at-top

  candidates = [
    p
    for root in getattr(nvidia, "__path__", [])
    for p in glob.glob(os.path.join(root, "*", "bin", "ptxas"))
  ]
  candidates += [shutil.which("ptxas") or ""] + glob.glob(
    "/usr/local/cuda*/bin/ptxas"
  )
  for path in filter(None, candidates):
    found[path] = _run([path, "--version"]).splitlines()[-1:]
  return found


def versions() -> dict:
  import jaxlib  # pylint: disable=g-import-not-at-top

  info = dict(
    jax=jax.__version__,
    jaxlib=jaxlib.__version__,
    python=platform.python_version(),
    backend=jax.default_backend(),
    devices=[d.device_kind for d in jax.devices()],
    hopper=backends.hopper_reason() or "yes",
  )
  try:
    from jax._src.lib import cuda_versions  # pylint: disable=g-import-not-at-top

    info.update(
      cuda_runtime=cuda_versions.cuda_runtime_get_version(),
      cuda_driver=cuda_versions.cuda_driver_get_version(),
      cudnn=cuda_versions.cudnn_get_version(),
    )
  except Exception as e:  # pylint: disable=broad-except
    info["cuda_versions"] = f"unavailable: {type(e).__name__}: {e}"
  try:
    info["ptxas"] = _ptxas_versions()
  except ImportError as e:
    info["ptxas"] = f"no nvidia packages: {e}"
  info["nvidia_smi"] = _run(
    [
      "nvidia-smi",
      "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
      "--format=csv",
    ]
  )
  return info


# DEVICE_CHECK_SELFTEST=1: an item that hangs (also without a GPU), to show
# that the per-item timeout fires and the other items still report.
_SELFTEST = "selftest hang"
if os.environ.get("DEVICE_CHECK_SELFTEST") == "1":
  SMOKE_ITEMS[_SELFTEST] = ("the per-item timeout", lambda: time.sleep(1e6))


def _mgpu_causal_item(head_dim: int):
  from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu  # pylint: disable=g-import-not-at-top

  shape = Shape(1, 1024, 1024, 2, 2, head_dim)
  q, k, v, dout = random_inputs(jax.random.key(3), shape, jnp.float16)
  cfg = mgpu.TuningConfig(
    block_q=64,
    block_kv=64 if head_dim == 256 else 128,
    max_concurrent_steps=2,
    causal=True,
  )
  scale = head_dim**-0.5
  out = jax.jit(
    lambda q, k, v: mgpu.attention(q * jnp.float16(scale), k, v, cfg)
  )(q, k, v)
  golden, naive = golden_and_naive(q, k, v, dout, causal=True)
  return check("out", out, naive[0], golden[0])


def _causal_items():
  for d in sm90_config.KERNEL_HEAD_DIMS:
    for dtype in (jnp.bfloat16, jnp.float16):
      for sq, skv in ((512, 512), (384, 640), (640, 384)):
        yield (
          f"ours causal {jnp.dtype(dtype).name} d{d} q{sq} kv{skv}",
          lambda d=d, dtype=dtype, sq=sq, skv=skv: kernel_item(
            d, False, dtype, True, Shape(1, sq, skv, 2, 1, d)
          ),
        )
  for d in (64, 128, 256):
    yield (
      f"attention_mgpu causal float16 d{d}",
      lambda d=d: _mgpu_causal_item(d),
    )


def _passed(result: dict) -> bool:
  return all(
    result[k] <= result[k[:-4] + "_bound"] for k in result if k.endswith("_err")
  )


def run_items(items, out: pathlib.Path) -> int:
  reason = backends.hopper_reason()
  records, failures = [], 0
  for name, fn in items:
    start = time.time()
    if reason and name != _SELFTEST:
      record = dict(item=name, status="skipped", reason=reason)
    else:
      try:
        result = fn()
        record = dict(
          item=name, status="ok" if _passed(result) else "FAIL", **result
        )
      except Exception as e:  # pylint: disable=broad-except
        record = dict(
          item=name,
          status="error",
          error=f"{type(e).__name__}: {e}"[:600],
          traceback=traceback.format_exc()[-2000:],
        )
    record["seconds"] = round(time.time() - start, 2)
    failures += record["status"] in ("FAIL", "error")
    records.append(record)
    out.write_text(json.dumps(records, indent=1, default=str))
    print(
      f"{record['status']:7} {record['seconds']:6.1f}s  {name}  "
      + " ".join(
        f"{k}={v:.3g}" for k, v in record.items() if k.endswith("_err")
      ),
      flush=True,
    )
  return 1 if failures else 0


def run_isolated(out: pathlib.Path, timeout: float, parallel: int) -> int:
  """Every smoke item in a process of its own (`parallel` at a time), each
  killed at `timeout` seconds and recorded as "hang" (a hang inside a
  kernel cannot be interrupted from its own process)."""
  reason = backends.hopper_reason()
  records, failures = {}, 0
  names = list(SMOKE_ITEMS)
  if reason:  # the CPU rehearsal: every GPU item listed, none run
    records.update(
      (n, dict(item=n, status="skipped", reason=reason))
      for n in names
      if n != _SELFTEST
    )
    names = [n for n in names if n == _SELFTEST]
  running: dict[str, tuple[subprocess.Popen, float, pathlib.Path]] = {}
  while names or running:
    while names and len(running) < parallel:
      name = names.pop(0)
      path = out / f"smoke_item_{len(records) + len(running)}.json"
      cmd = [sys.executable, __file__, "item", name, "--out", str(path)]
      proc = subprocess.Popen(cmd, start_new_session=True)
      running[name] = (proc, time.time(), path)
    for name, (proc, start, path) in list(running.items()):
      elapsed = time.time() - start
      if proc.poll() is None and elapsed < timeout:
        continue
      if proc.poll() is None:  # the whole group: compile workers too
        os.killpg(proc.pid, 9)
        proc.wait()
        record = dict(item=name, status="hang", reason=f"killed at {timeout} s")
      elif path.exists():
        record = json.loads(path.read_text())[0]
      else:
        record = dict(
          item=name, status="error", error=f"exit {proc.returncode}"
        )
      record.update(
        first_run_of=SMOKE_ITEMS[name][0], seconds=round(elapsed, 1)
      )
      records[name] = record
      failures += record["status"] in ("FAIL", "error", "hang")
      del running[name]
      print(
        f"{record['status']:7} {record['seconds']:6.1f}s  {name}", flush=True
      )
    (out / "smoke.json").write_text(
      json.dumps(list(records.values()), indent=1, default=str)
    )
    time.sleep(0.2)
  (out / "smoke.json").write_text(  # (also when nothing ran: a CPU)
    json.dumps(list(records.values()), indent=1, default=str)
  )
  return 1 if failures else 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("what", choices=("versions", "smoke", "causal", "item"))
  parser.add_argument("name", nargs="?", help="item: the smoke item to run")
  parser.add_argument("--out", required=True, help="output folder (item: file)")
  parser.add_argument(
    "--item-timeout", type=float, default=40.0, help="smoke: seconds per item"
  )
  parser.add_argument(
    "--parallel", type=int, default=8, help="smoke: items run at once"
  )
  args = parser.parse_args(argv)
  out = pathlib.Path(args.out)
  if args.what == "item":
    item = [(args.name, SMOKE_ITEMS[args.name][1])]
    return run_items(item, out)
  out.mkdir(parents=True, exist_ok=True)
  if args.what == "versions":
    info = versions()
    (out / "versions.json").write_text(json.dumps(info, indent=1, default=str))
    print(json.dumps(info, indent=1, default=str))
    return 0
  if args.what == "smoke":
    return run_isolated(out, args.item_timeout, args.parallel)
  return run_items(_causal_items(), out / f"{args.what}.json")


if __name__ == "__main__":
  sys.exit(main())
