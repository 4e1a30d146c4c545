"""What moves the FP8 error: one quantization change at a time (issue 18).

Materialized float64 attention on the FA3 Table 3 inputs
(`pallas_fa3.tools.numerics.fp8_methods.draw`), Q and K rotated and quantized in
the FP8 kernel's tiles (64 / 128 at d 128, power-of-two scales), V
quantized, P in e4m3 with the 2^8 offset; then each variant changes one
thing: one scale per Q row, per K and V row, V rotated too (and O rotated
back), or one operand left exact. Prints mean RMSE over the draws.

    PYTHONPATH=. python benchmarks/fp8_variants.py --seq 1024 --heads 16 --draws 5
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3 import fp8
from pallas_fa3.tools.numerics import fp8_methods


def _e4m3(x, rows: int) -> np.ndarray:
  return np.asarray(
    fp8.dequantize_tiles(*fp8.quantize_tiles(x, rows), rows), np.float64
  )


def _attend(q, k, v, golden_shape, p_e4m3=True, rotate_back=None):
  d = q.shape[-1]
  o = np.empty(golden_shape)
  for h in range(q.shape[2]):
    s = q[0, :, h] @ k[0, :, h].T / np.sqrt(d)
    p = np.exp2((s - s.max(-1, keepdims=True)) / np.log(2) + 8)
    l = p.sum(-1, keepdims=True)
    if p_e4m3:
      p = np.asarray(
        jnp.asarray(p, jnp.float32).astype(jnp.float8_e4m3fn), np.float64
      )
    out = p @ v[0, :, h] / l
    o[0, :, h] = out if rotate_back is None else out @ rotate_back.T
  return o


def variants(seq: int, heads: int, draws: int) -> dict[str, float]:
  d, bq, bkv = 128, 64, 128
  res: dict[str, list[float]] = {}
  for i in range(draws):
    q, k, v, golden, key = fp8_methods.draw(jax.random.key(i), 1, seq, heads, d)
    signs = fp8.rotation_signs(fp8.FP8Config(key=key).prng_key(), d)
    qr, kr, vr = (fp8.rotate(x, signs) for x in (q, k, v))
    m = np.asarray(fp8.rotate(jnp.eye(d, dtype=jnp.float32), signs), np.float64)
    f64 = lambda x: np.asarray(x, np.float64)
    g = golden.shape
    cases = {
      "FA3's recipe (Q, K rotated, tile scales, P in e4m3)": _attend(
        _e4m3(qr, bq), _e4m3(kr, bkv), _e4m3(v, bkv), g
      ),
      "one scale per Q row": _attend(
        _e4m3(qr, 1), _e4m3(kr, bkv), _e4m3(v, bkv), g
      ),
      "one scale per K row and per V row": _attend(
        _e4m3(qr, bq), _e4m3(kr, 1), _e4m3(v, 1), g
      ),
      "V rotated too (O rotated back)": _attend(
        _e4m3(qr, bq), _e4m3(kr, bkv), _e4m3(vr, bkv), g, rotate_back=m
      ),
      "P exact": _attend(
        _e4m3(qr, bq), _e4m3(kr, bkv), _e4m3(v, bkv), g, p_e4m3=False
      ),
      "Q exact": _attend(f64(qr), _e4m3(kr, bkv), _e4m3(v, bkv), g),
      "K exact": _attend(_e4m3(qr, bq), f64(kr), _e4m3(v, bkv), g),
      "V exact": _attend(_e4m3(qr, bq), _e4m3(kr, bkv), f64(v), g),
    }
    for name, o in cases.items():
      res.setdefault(name, []).append(
        float(np.sqrt(np.mean((o - golden) ** 2)))
      )
  return {name: float(np.mean(r)) for name, r in res.items()}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seq", type=int, default=1024)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--draws", type=int, default=5)
  args = parser.parse_args(argv)
  print("| variant | RMSE |\n|---|---:|")
  for name, rmse in variants(args.seq, args.heads, args.draws).items():
    print(f"| {name} | {rmse:.2e} |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
