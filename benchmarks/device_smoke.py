"""The first minute on a GPU: versions, one tiny call per kernel, the causal mask.

    python benchmarks/device_smoke.py versions --out DIR   # DIR/versions.json
    python benchmarks/device_smoke.py smoke --out DIR      # DIR/smoke.json
    python benchmarks/device_smoke.py causal --out DIR     # DIR/causal.json

`smoke`: the bf16 forward and backward kernels at d128 and d256 and the FP8
forward at d128, each one small call (`jax.jit`, causal, GQA, ragged)
against the float64 golden with the tolerance rule (FP8: against its
blockwise twin). `causal`: JAX's `attention_mgpu` refuses causal masks on
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
import numpy as np

import pallas_fa3
from pallas_fa3 import backends
from pallas_fa3.kernels.sm90 import config as sm90_config
from pallas_fa3.testing import (
  Shape,
  golden_and_naive,
  max_abs_err,
  random_inputs,
  tolerance,
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


def _check(name, got, naive, golden) -> dict:
  err, bound = max_abs_err(got, golden), tolerance(naive, golden)
  return {f"{name}_err": err, f"{name}_bound": bound}


def _kernel_item(
  head_dim: int,
  backward: bool,
  dtype=jnp.bfloat16,
  causal=True,
  shape=None,
  deterministic=False,
):
  shape = shape or Shape(1, 200, 330, 4, 2, head_dim)
  q, k, v, dout = random_inputs(jax.random.key(head_dim), shape, dtype)
  golden, naive = golden_and_naive(q, k, v, dout, causal=causal)
  f = lambda q, k, v: pallas_fa3.flash_attention(
    q,
    k,
    v,
    causal=causal,
    return_lse=True,
    implementation="mosaic",
    deterministic=deterministic,
  )
  out, lse = jax.jit(f)(q, k, v)
  result = {
    **_check("out", out, naive[0], golden[0]),
    **_check("lse", lse, naive[1], golden[1]),
  }
  if backward:
    loss = lambda q, k, v: (
      f(q, k, v)[0].astype(jnp.float32) * dout.astype(jnp.float32)
    ).sum()
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for name, g, n, gold in zip(
      ("dq", "dk", "dv"), grads, naive[2:], golden[2:]
    ):
      result.update(_check(name, g, n, gold))
  return result


def _fp8_item():
  q, k, v, _ = random_inputs(
    jax.random.key(8), Shape(1, 256, 512, 4, 2, 128), jnp.bfloat16
  )
  f = lambda impl: jax.jit(
    lambda q, k, v: pallas_fa3.flash_attention(
      q, k, v, causal=True, fp8=True, implementation=impl
    )
  )(q, k, v)
  got = np.asarray(f("mosaic"), np.float32)
  twin = np.asarray(f("blockwise"), np.float32)
  return {
    "out_vs_twin_err": float(np.max(np.abs(got - twin))),
    "out_vs_twin_bound": 0.05,
  }


def _smoke_items():
  yield "fwd bf16 d128", lambda: _kernel_item(128, False)
  yield "fwd+bwd bf16 d128 (fused)", lambda: _kernel_item(128, True)
  yield (
    "fwd+bwd bf16 d128 deterministic",
    lambda: _kernel_item(128, True, deterministic=True),
  )
  yield "fwd+bwd bf16 d192 (fused)", lambda: _kernel_item(192, True)
  yield "fwd+bwd bf16 d256", lambda: _kernel_item(256, True)
  yield "fwd fp8 d128", _fp8_item


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
  return _check("out", out, naive[0], golden[0])


def _causal_items():
  for d in sm90_config.KERNEL_HEAD_DIMS:
    for dtype in (jnp.bfloat16, jnp.float16):
      for sq, skv in ((512, 512), (384, 640), (640, 384)):
        yield (
          f"ours causal {jnp.dtype(dtype).name} d{d} q{sq} kv{skv}",
          lambda d=d, dtype=dtype, sq=sq, skv=skv: _kernel_item(
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
    if reason:
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


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("what", choices=("versions", "smoke", "causal"))
  parser.add_argument("--out", required=True, help="output folder")
  args = parser.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  if args.what == "versions":
    info = versions()
    (out / "versions.json").write_text(json.dumps(info, indent=1, default=str))
    print(json.dumps(info, indent=1, default=str))
    return 0
  items = _smoke_items() if args.what == "smoke" else _causal_items()
  return run_items(items, out / f"{args.what}.json")


if __name__ == "__main__":
  sys.exit(main())
