"""FP8 forward on a Hopper GPU: RMSE against the CPU twin, then speed.

1. The FA3 Table 3 error ("ours FP8" and "ours FP8 + Q residual", seq 4096,
   2 heads, d 128) computed by the kernels (`mosaic`: the quantization
   kernel and the attention kernel) and by their twins (`blockwise`, on
   this machine's CPU): they should agree within rounding.
2. Speed at the paper's grid point of 16k tokens (batch 1, seq 16384,
   hidden 2048: 16 heads at d 128, 8 at d 256), non-causal and causal: the
   quantization pass alone, the FP8 kernel alone (pre-quantized inputs), the
   total (`flash_attention(..., fp8=True)`; at d 128 also with
   `FP8Config(q_residual=True)`), and the bf16 kernel for
   comparison. TFLOPs/s count the attention FLOPs only (4 b s^2 h d, halved
   for causal), also for the total. Targets (issue 8, H200): FP8 forward
   16k non-causal d256 >= 1100 TFLOPs/s, d128 >= 900.

Writes `$OUT/fp8.json` and prints a table. Stops timing when --time-budget
seconds have passed (the remaining rows are listed as skipped).

    python benchmarks/fp8_device_check.py --out device_out/fp8
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
import types

import jax
import jax.numpy as jnp

import pallas_fa3
from pallas_fa3 import fp8
from pallas_fa3.kernels.sm90 import config_fp8 as sm90_fp8_config
from pallas_fa3.tools.bench import flops, timing
from pallas_fa3.tools.numerics import fp8_methods, metrics


def _rmse_check() -> dict:
  """FA3's recipe and Q's residual (issue 18), the kernels (quantization
  and attention) against the twins on this machine's CPU."""
  q, k, v, golden, key = fp8_methods.draw(jax.random.key(0), 1, 4096, 2, 128)
  out = {}
  for method, tag in (("ours FP8", ""), (fp8_methods.Q_RESIDUAL, "_q_res")):
    gpu = fp8_methods.run_method(method, q, k, v, key, implementation="mosaic")
    cpu_dev = jax.devices("cpu")[0]
    with jax.default_device(cpu_dev):
      qc, kc, vc = (jax.device_put(x, cpu_dev) for x in (q, k, v))
      twin = fp8_methods.run_method(
        method, qc, kc, vc, key, implementation="blockwise"
      )
    out.update({
      f"rmse_gpu{tag}": metrics.rmse(gpu, golden),
      f"rmse_twin{tag}": metrics.rmse(twin, golden),
      f"rmse_gpu_vs_twin{tag}": metrics.rmse(gpu, twin),
    })  # fmt: skip
  return out


def _timings(args, on_row) -> list[dict]:
  rows, start = [], time.time()
  for d, causal in ((256, False), (128, False), (256, True), (128, True)):
    if d not in args.head_dim:
      continue
    heads = 2048 // d
    shape = (1, 16384, heads, d)
    if time.time() - start > args.time_budget:
      rows.append(dict(head_dim=d, causal=causal, skipped="time budget"))
      on_row(rows)
      continue
    sets = []
    for i in range(2):
      keys = jax.random.split(jax.random.key(i), 3)
      sets.append(
        tuple(jax.random.normal(kk, shape, jnp.bfloat16) for kk in keys)
      )
    cfg = sm90_fp8_config.default_fp8_forward_config(d)
    quant = jax.jit(
      lambda q, k, v: fp8.quantize(
        q, k, v, block_q=cfg.block_q, block_kv=cfg.block_kv
      )
    )
    qsets = [jax.block_until_ready(quant(*s)) for s in sets]
    fns = {
      "quantize": (quant, sets),
      "fp8 kernel": (
        jax.jit(
          lambda *x: fp8.flash_attention_fp8(
            *x, causal=causal, implementation="mosaic", config=cfg
          )
        ),
        qsets,
      ),
      "fp8 total": (
        jax.jit(
          lambda q, k, v: pallas_fa3.flash_attention(
            q, k, v, causal=causal, fp8=True, implementation="mosaic"
          )
        ),
        sets,
      ),
      "fp8 total q-residual": (
        jax.jit(
          lambda q, k, v: pallas_fa3.flash_attention(
            q,
            k,
            v,
            causal=causal,
            fp8=fp8.FP8Config(q_residual=True),
            implementation="mosaic",
          )
        ),
        sets if d <= 128 else [],
      ),
      "bf16 kernel": (
        jax.jit(
          lambda q, k, v: pallas_fa3.flash_attention(
            q, k, v, causal=causal, implementation="mosaic"
          )
        ),
        sets,
      ),
    }
    bench_spec = types.SimpleNamespace(
      batch=1,
      seq_q=16384,
      seq_kv=16384,
      heads_q=heads,
      head_dim=d,
      causal=causal,
      mode="fwd",
    )
    work = flops.attention_flops(bench_spec)
    row = dict(head_dim=d, causal=causal, heads=heads, config=str(cfg))
    for name, (fn, arg_sets) in fns.items():
      if not arg_sets:  # q-residual: served up to d 128
        continue
      try:
        t, _ = timing.measure(fn, arg_sets, warmup=2, runs=args.runs)
        row[name + " ms"] = t.median_s * 1e3
        if name != "quantize":
          row[name + " TFLOPs/s"] = work / t.median_s / 1e12
      except Exception as e:  # pylint: disable=broad-except
        row[name] = f"failed: {type(e).__name__}: {str(e)[:200]}"
    rows.append(row)
    on_row(rows)
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--out", type=pathlib.Path, default=pathlib.Path("device_out/fp8")
  )
  parser.add_argument("--runs", type=int, default=10)
  parser.add_argument("--time-budget", type=float, default=60.0)
  parser.add_argument(
    "--head-dim",
    type=int,
    nargs="+",
    default=[128, 256],
    choices=[128, 256],
    help="head dims to time",
  )
  args = parser.parse_args(argv)
  args.out.mkdir(parents=True, exist_ok=True)
  result = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__)
  try:
    result["rmse"] = _rmse_check()
  except Exception as e:  # pylint: disable=broad-except
    result["rmse"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
  print("RMSE (Table 3, ours FP8, 1x4096x2x128):", result["rmse"], flush=True)
  write = lambda: (args.out / "fp8.json").write_text(
    json.dumps(result, indent=1)
  )
  write()  # each finished row is on disk before the next starts

  def on_row(rows):
    result["timings"] = rows
    write()

  result["timings"] = _timings(args, on_row)
  write()
  cols = (
    "quantize ms",
    "fp8 kernel TFLOPs/s",
    "fp8 total TFLOPs/s",
    "fp8 total q-residual TFLOPs/s",
    "bf16 kernel TFLOPs/s",
  )
  print("| d | causal | " + " | ".join(cols) + " |")
  print("|---|---|" + "---:|" * len(cols))
  for r in result["timings"]:
    cells = [
      r.get(c, r.get(c.rsplit(" ", 1)[0], r.get("skipped", "-"))) for c in cols
    ]
    cells = [f"{c:.1f}" if isinstance(c, float) else str(c)[:60] for c in cells]
    print(f"| {r['head_dim']} | {r['causal']} | " + " | ".join(cells) + " |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
