"""DeepSeek MLA decoding in FlashMLA's layout (issue 32, stretch): its error
against the float64 golden, what reading V in place saves, and why the
one-consumer decode kernel cannot serve the shape (the MLA kernel,
`kernels/sm90/decode_mla.py`, does: issue 45).

`flash_attention_with_kvcache(q, kv, None, k, head_dim_v=512)`: one cache
of head dim 576, one KV head, V its first 512 columns.

- errors: batch 2, capacity 1024, ragged lengths, one appended token,
  causal, bf16; out and lse against the float64 golden beside the naive
  bf16 error and FA3's bound (2 x naive + floor);
- time: one jitted blockwise step, `v_cache=None` against an explicit
  `v_cache=k_cache[..., :512]` (a copy of the cache every step), median of
  `--runs` after a warm-up;
- the one-consumer kernel's reason (`config_decode.mla_reason`) with its
  numbers;
- `--e4m3`: an e4m3 cache (`quantize_kv_cache(k_cache, None)`) through
  blockwise and the MLA kernel in interpret mode, descales per sequence
  and per 128-column group (`column_groups=True`), as relative RMSE against
  the float64 golden on the dequantized cache (what the decode adds) and
  on the bf16 cache (the e4m3 rounding included), at page 64 and
  contiguous, 16 and 128 query heads.

  JAX_PLATFORMS=cpu PJRT_NPROC=6 python benchmarks/mla_decode.py [--e4m3]
"""

from __future__ import annotations

import argparse
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_fa3
from pallas_fa3.kernels.sm90.config_decode import mla_reason
from pallas_fa3.kvcache import make_decode_spec
from pallas_fa3.reference import golden_decode
from pallas_fa3.testing import (
  decode_case,
  decode_golden_and_naive,
  max_abs_err,
  tolerance,
)

D, DV = 576, 512


def errors(rng: np.random.Generator) -> None:
  print("| heads_q | cache | seq_q | backend | out err | naive bf16 | bound"
        " | lse err |")  # fmt: skip
  print("|---|---|---|---|---|---|---|---|")
  for hq, page, sq in ((16, None, 1), (16, 64, 2), (128, 64, 1)):
    case = decode_case(
      rng, batch=2, seq_q=sq, heads_q=hq, heads_kv=1, head_dim=D,
      head_dim_v=DV, capacity=1024, lengths=[300, 1023], page_size=page,
      seq_new=1, v_in_k=True,
    )  # fmt: skip
    args, kwargs = case.call_args()
    spec = make_decode_spec(*args, **kwargs, causal=True)
    for impl, splits in (("blockwise", 1), ("blockwise", 4), ("reference", 1)):
      out, lse, kc = pallas_fa3.flash_attention_with_kvcache(
        *args, **kwargs, causal=True, return_lse=True, num_splits=splits,
        implementation=impl,
      )  # fmt: skip
      (g_out, g_lse), (n_out, _) = decode_golden_and_naive(spec, case, kc, None)
      name = impl if impl == "reference" else f"{impl}, {splits} split(s)"
      print(
        f"| {hq} | {'page ' + str(page) if page else 'contiguous'} | {sq} |"
        f" {name} | {max_abs_err(out, g_out):.3g} |"
        f" {max_abs_err(n_out, g_out):.3g} | {tolerance(n_out, g_out):.3g} |"
        f" {max_abs_err(lse, g_lse):.2g} |"
      )


def _relative_rmse(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))


def e4m3_errors(rng: np.random.Generator, impls=("blockwise", "interpret")):
  print("| heads_q | cache | descale per | backend | vs golden, dequantized"
        " cache | vs golden, bf16 cache | bf16 cache, same backend |")  # fmt: skip
  print("|---|---|---|---|---|---|---|")
  for hq, page in ((16, 64), (128, None)):
    case = decode_case(
      rng, batch=2, seq_q=1, heads_q=hq, heads_kv=1, head_dim=D,
      head_dim_v=DV, capacity=512, lengths=[300, 511], page_size=page,
      seq_new=1, v_in_k=True,
    )  # fmt: skip
    args, kwargs = case.call_args()
    spec = make_decode_spec(*args, **kwargs, causal=True)
    _, kc16 = pallas_fa3.flash_attention_with_kvcache(
      *args, **kwargs, causal=True, implementation="reference"
    )
    (g16, _), _ = decode_golden_and_naive(spec, case, kc16, None)
    lengths = np.asarray(case.cache_seqlens) + 1
    for groups, impl in itertools.product((False, True), impls):
      x = pallas_fa3.quantize_kv_cache(
        case.k_cache, None, page_table=case.page_table,
        cache_seqlens=case.cache_seqlens, column_groups=groups,
      )  # fmt: skip
      args8 = (args[0], x.k_cache) + args[2:]
      out, kc8 = pallas_fa3.flash_attention_with_kvcache(
        *args8, **kwargs, causal=True, k_descale=x.k_descale,
        implementation=impl,
      )  # fmt: skip
      g8, _ = golden_decode(
        spec, case.q, kc8, None, lengths, None, case.page_table,
        descale=(x.k_descale, x.k_descale),
      )  # fmt: skip
      out16 = pallas_fa3.flash_attention_with_kvcache(
        *args, **kwargs, causal=True, implementation=impl
      )[0]
      print(
        f"| {hq} | {'page ' + str(page) if page else 'contiguous'} |"
        f" {'128-column group' if groups else 'sequence'} |"
        f" {impl} | {_relative_rmse(out, g8):.2e} |"
        f" {_relative_rmse(out, g16):.2e} | {_relative_rmse(out16, g16):.2e} |"
      )


def timing(cache_len: int, runs: int) -> None:
  b, hq = 2, 16
  kc = jax.random.normal(jax.random.key(0), (b, cache_len, 1, D), jnp.bfloat16)
  q = jax.random.normal(jax.random.key(1), (b, 1, hq, D), jnp.bfloat16)
  n = jnp.array([cache_len, cache_len // 2], jnp.int32)
  for in_place in (True, False):
    extra = {"head_dim_v": DV} if in_place else {}
    step = jax.jit(
      lambda q, kc, n, in_place=in_place, extra=extra: (
        pallas_fa3.flash_attention_with_kvcache(
          q, kc, None if in_place else kc[..., :DV], cache_seqlens=n,
          causal=True, implementation="blockwise", **extra,
        )
      )
    )  # fmt: skip
    step(q, kc, n).block_until_ready()
    times = []
    for _ in range(runs):
      start = time.perf_counter()
      step(q, kc, n).block_until_ready()
      times.append(time.perf_counter() - start)
    name = "v_cache=None" if in_place else "v_cache=k_cache[..., :512]"
    print(f"{name}: median {np.median(times) * 1e3:.1f} ms of {runs}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cache-len", type=int, default=8192)
  parser.add_argument("--runs", type=int, default=5)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--e4m3", action="store_true")
  args = parser.parse_args()
  if args.e4m3:
    e4m3_errors(np.random.default_rng(args.seed))
    return
  errors(np.random.default_rng(args.seed))
  timing(args.cache_len, args.runs)
  q = jnp.zeros((1, 1, 16, D), jnp.bfloat16)
  kv = jnp.zeros((1, 64, 1, D), jnp.bfloat16)
  print(
    mla_reason(make_decode_spec(q, kv, None, cache_seqlens=1, head_dim_v=DV))
  )


if __name__ == "__main__":
  main()
