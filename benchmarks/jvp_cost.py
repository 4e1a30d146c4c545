"""What forward mode costs (issue 69): `jax.jvp` of `flash_attention` (the
primal forward plus the tangent pass: on `mosaic` the forward-tangent
kernel) against the forward alone and against the gradient (forward +
backward), and `jax.grad` of an sCM/MeanFlow-style loss holding a jvp, at
one shape per head dim, with TFLOP/s counted on the primal (the causal
forward's 2 GEMMs; the GPU target: jvp >= 0.45x the forward's).

  python benchmarks/jvp_cost.py [--seq 1024] [--head-dims 64 128]
      [--implementation blockwise|mosaic] [--dtype float32|bfloat16]
      [--json PATH]

Each function is jitted, compiled first (compile excluded), then timed as
`pallas-fa3 bench` times (warm-up calls, then --runs calls rotating two
random input sets; median). Causal, batch 1, 8 query heads over 2 kv
heads; float32 by default (XLA's CPU matmuls run float32 natively), the
kernels take bfloat16.
"""

from __future__ import annotations

import argparse
import json
import platform

import jax
import jax.numpy as jnp
import numpy as np

import pallas_fa3
from pallas_fa3.tools.bench import timing


def _functions(implementation: str) -> dict:
  attend = lambda q, k, v: pallas_fa3.flash_attention(
    q, k, v, causal=True, implementation=implementation
  )

  def jvp(q, k, v, dq, dk, dv):
    return jax.jvp(attend, (q, k, v), (dq, dk, dv))

  def grad(q, k, v, dq, dk, dv):
    del dk, dv
    return jax.grad(
      lambda q, k, v: jnp.vdot(attend(q, k, v).astype(jnp.float32), dq),
      (0, 1, 2),
    )(q, k, v)

  def scm_grad(q, k, v, dq, dk, dv):
    def loss(q, k, v):
      out, dout = jax.jvp(attend, (q, k, v), (dq, dk, dv))
      out, dout = out.astype(jnp.float32), dout.astype(jnp.float32)
      return jnp.sum((out - jax.lax.stop_gradient(out + 0.1 * dout)) ** 2)

    return jax.grad(loss, (0, 1, 2))(q, k, v)

  return {
    "forward": lambda q, k, v, *_: attend(q, k, v),
    "jvp": jvp,
    "grad": grad,
    "grad of a loss holding a jvp": scm_grad,
  }


def _inputs(seq: int, d: int, seed: int, dtype: str) -> tuple:
  rng = np.random.default_rng(seed)
  shapes = [(1, seq, 8, d), (1, seq, 2, d), (1, seq, 2, d)] * 2
  return tuple(jnp.asarray(rng.standard_normal(s), dtype) for s in shapes)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seq", type=int, default=1024)
  parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
  parser.add_argument("--runs", type=int, default=5)
  parser.add_argument("--implementation", default="blockwise")
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  rows = []
  for d in args.head_dims:
    sets = [_inputs(args.seq, d, s, args.dtype) for s in (0, 1)]
    # The causal forward's two GEMMs over the visible half, 8 heads.
    primal_flops = 4 * 8 * args.seq * args.seq * d / 2
    base = None
    for name, fn in _functions(args.implementation).items():
      t, _ = timing.measure(jax.jit(fn), sets, warmup=1, runs=args.runs)
      base = t.median_s if base is None else base
      tflops = primal_flops / t.median_s / 1e12
      rows.append(
        dict(
          head_dim=d, seq=args.seq, function=name, median_s=t.median_s,
          compile_s=t.compile_s, vs_forward=t.median_s / base,
          primal_tflops=tflops, implementation=args.implementation,
          dtype=args.dtype,
        )
      )  # fmt: skip
      print(
        f"d{d} seq {args.seq} {name:30s} {t.median_s * 1e3:9.2f} ms"
        f"  {t.median_s / base:5.2f}x forward  {tflops:7.2f} TFLOP/s on the"
        f" primal  (compile {t.compile_s:.1f} s)"
      )
  if args.json:
    meta = dict(jax=jax.__version__, machine=platform.machine())
    with open(args.json, "w") as f:
      json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
