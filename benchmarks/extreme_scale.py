"""The extreme-scale table: attention at softmax scales 1e3 .. 1e38 on every
backend that runs here, finite or not, and its error against the float64
golden beside FA3's bound (2 x the naive low-precision error + floor).

    python benchmarks/extreme_scale.py [--scales 1e3 1e8 ...] [--impl ...]

Inputs: unit-normal bf16 q, k, v, dO `[1, 64, 2, 64]` (GQA 2/1), not causal;
the scaled scores reach |s * scale| ~ 30 * scale. docs/numerics.md#large-logits.
"""

from __future__ import annotations

import argparse
import sys

from pallas_fa3.backends import interpret_pool

interpret_pool.reserve()  # before JAX starts: the interpreter's threads

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_fa3  # noqa: E402
from pallas_fa3 import backends  # noqa: E402
from pallas_fa3.testing import (  # noqa: E402
  Shape,
  golden_and_naive,
  max_abs_err,
  random_inputs,
  tolerance,
)

NAMES = ("out", "lse", "dq", "dk", "dv")


def _run(impl: str, scale: float, q, k, v, dout) -> tuple:
  f = lambda q, k, v: pallas_fa3.flash_attention(
    q, k, v, softmax_scale=scale, return_lse=True, implementation=impl
  )
  (out, lse), pullback = jax.vjp(jax.jit(f), q, k, v)
  return (out, lse) + tuple(pullback((dout, jnp.zeros_like(lse))))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--scales",
    nargs="+",
    type=float,
    default=[1e3, 1e8, 1e20, 1e30, 1e37, 1e38],
  )
  parser.add_argument(
    "--impl",
    nargs="+",
    default=["reference", "blockwise", "interpret", "mosaic"],
  )
  args = parser.parse_args(argv)
  q, k, v, dout = random_inputs(
    jax.random.key(0), Shape(1, 64, 64, 2, 1, 64), jnp.bfloat16
  )
  print(
    "| scale | backend | finite out/lse/dq/dk/dv | out err / bound |"
    " lse err / bound | dv err / bound |"
  )
  print("|---|---|---|---|---|---|")
  for scale in args.scales:
    golden, naive = golden_and_naive(q, k, v, dout, softmax_scale=scale)
    for impl in args.impl:
      reason = backends.get(impl).device_reason()
      if reason:
        print(f"| {scale:g} | {impl} | skipped: {reason} | | | |")
        continue
      got = _run(impl, scale, q, k, v, dout)
      finite = "/".join(
        "yes" if np.all(np.isfinite(np.asarray(g, np.float32))) else "NO"
        for g in got
      )
      cells = [
        f"{max_abs_err(got[i], golden[i]):.3g} / {tolerance(naive[i], golden[i]):.3g}"
        for i in (0, 1, 4)
      ]
      print(f"| {scale:g} | {impl} | {finite} | " + " | ".join(cells) + " |")
      sys.stdout.flush()
  return 0


if __name__ == "__main__":
  sys.exit(main())
