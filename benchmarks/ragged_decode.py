"""A ragged kvcache batch (`flash_attention_with_kvcache(cu_seqlens_q=)`)
against one uniform call per sequence: wall time per step, same backend,
paged bf16 cache. docs/decoding.md#ragged-batches-continuous-batching

  JAX_PLATFORMS=cpu python benchmarks/ragged_decode.py --impl blockwise
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_fa3

# 2 prefill chunks, 12 single decode tokens, 2 speculative runs of 4.
LENGTHS = [128, 64] + [1] * 12 + [4, 4]
HEADS_Q, HEADS_KV, HEAD_DIM, PAGE_SIZE, PAGES_PER_SEQ = 8, 2, 64, 16, 64


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--impl", default="blockwise")
  parser.add_argument("--reps", type=int, default=5)
  args = parser.parse_args()
  call = pallas_fa3.flash_attention_with_kvcache
  rng = np.random.default_rng(0)
  n, lens = len(LENGTHS), np.asarray(LENGTHS, np.int32)
  pages = n * PAGES_PER_SEQ
  normal = lambda *s: jnp.asarray(rng.normal(size=s), jnp.bfloat16)
  kc = normal(pages, PAGE_SIZE, HEADS_KV, HEAD_DIM)
  vc = normal(pages, PAGE_SIZE, HEADS_KV, HEAD_DIM)
  pt = jnp.asarray(rng.permutation(pages).reshape(n, -1), jnp.int32)
  cs = jnp.asarray(rng.integers(0, 512, size=n), jnp.int32)
  total = int(lens.sum())
  cu_host = np.concatenate([[0], np.cumsum(lens)])
  cu = jnp.asarray(cu_host, jnp.int32)
  q = normal(total, HEADS_Q, HEAD_DIM)
  k = normal(total, HEADS_KV, HEAD_DIM)
  common = dict(causal=True, implementation=args.impl)
  ragged = jax.jit(
    lambda q, k, kc, vc: call(
      q, kc, vc, k, k, cache_seqlens=cs, page_table=pt, cu_seqlens_q=cu,
      max_seqlen_q=int(lens.max()), **common,
    )[0]
  )  # fmt: skip

  def alone(q, k, kc, vc):
    return [
      call(
        q[None, a:b], kc, vc, k[None, a:b], k[None, a:b],
        cache_seqlens=cs[i : i + 1], page_table=pt[i : i + 1], **common,
      )[0]
      for i, (a, b) in enumerate(zip(cu_host[:-1], cu_host[1:]))
    ]  # fmt: skip

  def ms(fn):
    jax.block_until_ready(fn(q, k, kc, vc))
    start = time.perf_counter()
    for _ in range(args.reps):
      jax.block_until_ready(fn(q, k, kc, vc))
    return (time.perf_counter() - start) / args.reps * 1e3

  print(
    f"{args.impl}: {n} sequences, total_q {total}, padded rows"
    f" {n * int(lens.max())}: ragged call {ms(ragged):.1f} ms,"
    f" {n} uniform calls {ms(alone):.1f} ms"
  )


if __name__ == "__main__":
  main()
