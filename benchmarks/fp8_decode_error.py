"""Decoding from an e4m3 KV cache: its error, with and without the rotation
of K (issue 34).

One decode step (seq_q 1, causal, GQA 8/2, d128) over a cache quantized by
`pallas_fa3.quantize_kv_cache`. Two errors per implementation, as
relative RMSE (RMSE / RMS of the golden output):

- "computation": against the float64 golden on the dequantized cache
  (the issue's metric, target <= 3e-2): what the decode itself adds;
- "end to end": against the float64 golden on the 16-bit cache before
  quantization: the cache's e4m3 rounding included, with and without
  `rotation=` (K stored Hadamard-rotated, q rotated on the fly).

Inputs: `normal` (N(0,1) in bf16) and `table3` (FA3's Table-3 mix, N(0,1) +
N(0,100) * Bernoulli(0.001), in fp16); a few draws, the median printed.

  JAX_PLATFORMS=cpu PJRT_NPROC=6 python benchmarks/fp8_decode_error.py \\
      --impl reference blockwise interpret
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import pallas_fa3
from pallas_fa3.kvcache import make_decode_spec
from pallas_fa3.reference import golden_decode
from pallas_fa3.tools.numerics import fp8_methods


def inputs(kind: str, key, batch: int, cache_len: int):
  """(q `[b, 1, 8, 128]`, k_cache, v_cache `[b, L, 2, 128]`) of one draw."""
  kq, kk, kv = jax.random.split(key, 3)
  if kind == "table3":
    mix = lambda k, n, h: fp8_methods.outlier_inputs(k, batch, n, h, 128)[0]
    return mix(kq, 1, 8), mix(kk, cache_len, 2), mix(kv, cache_len, 2)
  normal = lambda k, n, h: jax.random.normal(k, (batch, n, h, 128), "bfloat16")
  return normal(kq, 1, 8), normal(kk, cache_len, 2), normal(kv, cache_len, 2)


def relative_rmse(got, want) -> float:
  got = np.asarray(got, np.float64)
  return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))


def one_draw(kind, key, impls, batch, cache_len) -> dict[str, float]:
  q, kc, vc = inputs(kind, key, batch, cache_len)
  lengths = jnp.asarray(
    [cache_len - 37 * b for b in range(batch)], jnp.int32
  )  # ragged
  spec = make_decode_spec(q, kc, vc, cache_seqlens=lengths, causal=True)
  exact, _ = golden_decode(spec, q, kc, vc, lengths)
  out = {}
  for rotation in (None, 0):
    x = pallas_fa3.quantize_kv_cache(
      kc, vc, cache_seqlens=lengths, rotation=rotation
    )
    spec8 = make_decode_spec(q, x.k_cache, x.v_cache, cache_seqlens=lengths)
    descale = (x.k_descale, x.v_descale)
    on_cache, _ = golden_decode(
      spec8, q, x.k_cache, x.v_cache, lengths, None, None, None, descale
    )
    for impl in impls:
      got = pallas_fa3.flash_attention_with_kvcache(
        q, x.k_cache, x.v_cache, cache_seqlens=lengths, causal=True,
        k_descale=x.k_descale, v_descale=x.v_descale,
        cache_rotation=rotation, implementation=impl,
      )  # fmt: skip
      tag = "rotated" if rotation is not None else "plain"
      if rotation is None:  # the rotation does not change the computation
        out[f"{impl} computation"] = relative_rmse(got, on_cache)
      out[f"{impl} end to end, {tag}"] = relative_rmse(got, exact)
  # The 16-bit decode on the 16-bit cache, for scale.
  got = pallas_fa3.flash_attention_with_kvcache(
    q, kc, vc, cache_seqlens=lengths, causal=True, implementation="blockwise"
  )
  out["blockwise 16-bit cache"] = relative_rmse(got, exact)
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--impl", nargs="+", default=["reference", "blockwise"])
  parser.add_argument("--inputs", nargs="+", default=["normal", "table3"])
  parser.add_argument("--draws", type=int, default=3)
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--cache-len", type=int, default=1024)
  args = parser.parse_args()
  print(
    f"decode step: batch {args.batch}, cache {args.cache_len} (ragged), GQA"
    f" 8/2, d128, causal; relative RMSE, median of {args.draws} draws"
  )
  for kind in args.inputs:
    rows: dict[str, list[float]] = {}
    for i in range(args.draws):
      key = jax.random.key(i)
      for name, err in one_draw(
        kind, key, args.impl, args.batch, args.cache_len
      ).items():
        rows.setdefault(name, []).append(err)
    print(f"\n| {kind} | relative RMSE |\n|---|---|")
    for name, errs in rows.items():
      print(f"| {name} | {np.median(errs):.3e} |", flush=True)


if __name__ == "__main__":
  main()
