"""FP8 forward error with windows, softcap, sinks and segment ids (issue 34).

For each option (and all of them together): the RMSE of `flash_attention(..., fp8=True)` against the float64 golden with
the same option, absolute and relative to the golden output's RMS, beside
the bf16 forward's, per implementation; with two implementations, their
largest difference. A window or documents leave each row fewer keys, so
outputs (and every implementation's absolute error) grow: the relative
column is the one to compare with plain FP8's.

Inputs: `--inputs table3` (default) FA3's Table-3 error setup (float16,
N(0,1) + N(0,100) * Bernoulli(0.001), `pallas_fa3.tools.numerics.fp8_methods`),
4 heads, not causal unless `--causal`; `--inputs normal` bf16 N(0,1) with
GQA 4/2 and seq_q != seq_kv, causal.

  JAX_PLATFORMS=cpu PJRT_NPROC=6 python benchmarks/fp8_modifiers.py \
      --impl blockwise interpret --inputs normal --seq 256 384
  JAX_PLATFORMS=cpu python benchmarks/fp8_modifiers.py --seq 2048 2048
  python benchmarks/fp8_modifiers.py --impl mosaic blockwise   # on a GPU
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import pallas_fa3
from pallas_fa3.reference import golden_attention
from pallas_fa3.testing import Shape, random_inputs
from pallas_fa3.tools.numerics import fp8_methods

SINKS = np.asarray([0.3, -0.2, 1.0, 0.0], np.float32)


def cases(seq_q: int, seq_kv: int) -> dict[str, dict]:
  """Options at (seq_q, seq_kv): three documents, a 100-key left window."""
  ids = lambda n: np.repeat(
    np.arange(3), [n * 2 // 5] * 2 + [n - 2 * (n * 2 // 5)]
  )
  ids_q = jnp.asarray(ids(seq_q)[None].astype(np.int32))
  ids_kv = jnp.asarray(ids(seq_kv)[None].astype(np.int32))
  window, cap, sinks = (100, None), 5.0, jnp.asarray(SINKS)
  return {
    "plain": {},
    "window": dict(window_size=window),
    "softcap": dict(softcap=cap),
    "sinks": dict(sinks=sinks),
    "segment_ids": dict(segment_ids=(ids_q, ids_kv)),
    "all": dict(
      window_size=window,
      softcap=cap,
      sinks=sinks,
      segment_ids=(ids_q, ids_kv),
    ),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--impl", nargs="+", default=["blockwise"])
  parser.add_argument("--seq", type=int, nargs=2, default=(256, 384))
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--inputs", choices=["table3", "normal"], default="table3"
  )
  parser.add_argument("--causal", action="store_true")
  args = parser.parse_args()
  sq, skv = args.seq
  key = jax.random.key(args.seed)
  if args.inputs == "table3":
    if sq != skv:
      parser.error(f"--inputs table3 is self-attention: --seq {sq} {skv}")
    q, k, v = fp8_methods.outlier_inputs(key, 1, sq, 4, 128)
    shape, causal = f"table3 [1, {sq}, 4, 128] float16", args.causal
  else:
    shape = Shape(1, sq, skv, 4, 2, 128)
    q, k, v, _ = random_inputs(key, shape, jnp.bfloat16)
    causal = True
  rmse = lambda a, b: float(
    np.sqrt(np.mean((np.asarray(a, np.float64) - b) ** 2))
  )
  head = ["option", "out RMS", "16-bit RMSE"]
  head += [f"{i} RMSE (rel.)" for i in args.impl]
  if len(args.impl) > 1:
    head.append(f"max |{args.impl[0]} - {args.impl[1]}|")
  print(f"{shape}, causal={causal}, seed {args.seed}")
  print("| " + " | ".join(head) + " |")
  print("|" + "---|" * len(head))
  for name, opts in cases(sq, skv).items():
    golden, _ = golden_attention(q, k, v, causal=causal, **opts)
    size = float(np.sqrt(np.mean(golden**2)))

    def run(impl, fp8, opts=opts):
      f = lambda q, k, v: pallas_fa3.flash_attention(
        q, k, v, causal=causal, fp8=fp8, implementation=impl, **opts
      )
      return np.asarray(jax.jit(f)(q, k, v), np.float64)

    row = [name, f"{size:.4f}", f"{rmse(run('blockwise', False), golden):.5f}"]
    outs = [run(impl, True) for impl in args.impl]
    for out in outs:
      err = rmse(out, golden)
      row.append(f"{err:.5f} ({err / size:.4f})")
    if len(outs) > 1:
      row.append(f"{np.max(np.abs(outs[0] - outs[1])):.3g}")
    print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
  main()
