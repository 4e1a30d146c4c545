"""Tile steps the sm90 kernels walk for a `flash_attention_varlen` batch of
--seqs sequences (issue 68) against the sum of the steps each sequence
walks alone, counted on any machine from the span and range functions the
kernels run (`kernel_tiles.steps`), bf16, default configs, one head.

  JAX_PLATFORMS=cpu python benchmarks/varlen_tiles.py [--json PATH]

Lengths come from `pallas-fa3 bench --mode varlen`'s long-tailed
(log-normal) distribution, scaled to --tokens in all. Two packings:
self-attention (`cu_seqlens_q` is `cu_seqlens_k`: the built-in diagonal,
causal tiles skipped per sequence) and chunked prefill (each sequence's queries the last quarter of its
keys: the per-token mask_mod rule, whose kernels skip by sequence but walk
a sequence's key tiles past a query tile's diagonal). Each against the
same sequences alone (causal bottom-right) and against one padded
`[seqs, max_len]` batch; chunked prefill causal also as it would walk
with each sequence's diagonal folded into the segment bounds. Then, with
--time-tokens > 0, the blockwise backend on this CPU (float32, 4 heads
of d64, jit, compile excluded, median of --runs): the self-attention
packing causal, forward and forward+backward, through the built-in
diagonal (the same cu_seqlens array twice), the per-token mask_mod (an
equal copy, so the rule cannot know), `flash_attention(segment_ids=)` on
the same layout, and the padded batch.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from kernel_tiles import steps

import pallas_fa3
from pallas_fa3 import segments, varlen
from pallas_fa3.spec import make_spec
from pallas_fa3.tools.bench import timing
from pallas_fa3.tools.bench.varlen_case import lengths

KERNELS = ("forward", "dq", "dkdv")


def _spec(sq: int, skv: int, d: int, **options):
  q = jax.ShapeDtypeStruct((1, sq, 1, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, skv, 1, d), jnp.bfloat16)
  return make_spec(q, k, k, **options)


def packed_steps(lq, lk, d: int, causal: bool) -> dict:
  """Steps of the varlen call as it runs (`varlen.packing`'s ids; the
  built-in diagonal when the packings are equal, else ids alone)."""
  cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
  cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
  aligned = np.array_equal(cu_q, cu_k)
  p = varlen.packing(
    jnp.asarray(cu_q), jnp.asarray(cu_k), int(cu_q[-1]), int(cu_k[-1])
  )
  spec = _spec(
    int(cu_q[-1]), int(cu_k[-1]), d, causal=causal and aligned, segmented=True
  )
  return steps(spec, segments.kernel_bounds(spec, p.segment_ids())[0])


def folded_steps(lq, lk, d: int) -> dict:
  """Steps of the causal call if each sequence's bottom-right diagonal
  were folded into the segment bounds (per query row its last key, per
  key its first query) instead of the per-token mask_mod: what the kernels
  would walk with that rule (not yet built; issue 68)."""
  cq = np.concatenate([[0], np.cumsum(lq)])
  ck = np.concatenate([[0], np.cumsum(lk)])
  lo, hi = np.zeros(cq[-1], np.int32), np.zeros(cq[-1], np.int32)
  q_lo, q_hi = np.zeros(ck[-1], np.int32), np.zeros(ck[-1], np.int32)
  for b in range(len(lq)):
    qs, qe, ks, ke = cq[b], cq[b + 1], ck[b], ck[b + 1]
    after = qe - 1 - np.arange(qs, qe)  # the sequence's queries after i
    lo[qs:qe], hi[qs:qe] = ks, ke - after
    q_lo[ks:ke] = np.maximum(qs, qe - ke + np.arange(ks, ke))
    q_hi[ks:ke] = qe
  spec = _spec(int(cq[-1]), int(ck[-1]), d, segmented=True)
  return steps(spec, tuple(jnp.asarray(x)[None] for x in (lo, hi, q_lo, q_hi)))


def alone_steps(lq, lk, d: int, causal: bool) -> dict:
  total = dict.fromkeys(KERNELS, 0)
  for a, b in zip(lq, lk):
    one = steps(_spec(int(a), int(b), d, causal=causal), None)
    for name in KERNELS:
      total[name] += one[name]
  return total


def padded_steps(lq, lk, d: int, causal: bool) -> dict:
  one = steps(_spec(int(max(lq)), int(max(lk)), d, causal=causal), None)
  return {name: len(lq) * n for name, n in one.items()}


def time_rules(lens: np.ndarray, runs: int) -> list[dict]:
  """Median ms of the self-attention packing, causal, per rule and mode."""
  rng = np.random.default_rng(0)
  total, heads, d = int(lens.sum()), 4, 64
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  x = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  q, k, v, dout = (x(total, heads, d) for _ in range(4))
  ids = pallas_fa3.segment_ids_from_lengths(jnp.asarray(lens)[None], total)
  n, width = len(lens), int(lens.max())
  pad = lambda t: jnp.zeros((n, width, heads, d)).at[:, :1].set(t[:1])
  calls = {
    "varlen, built-in diagonal": (
      lambda q, k, v, cu: pallas_fa3.flash_attention_varlen(
        q, k, v, cu, cu, causal=True, implementation="blockwise"
      ),
      (q, k, v, cu),
    ),
    "varlen, per-token mask_mod": (
      lambda q, k, v, cu: pallas_fa3.flash_attention_varlen(
        q, k, v, cu, cu + 0, causal=True, implementation="blockwise"
      ),
      (q, k, v, cu),
    ),
    "segment ids": (
      lambda q, k, v, ids: pallas_fa3.flash_attention(
        q[None],
        k[None],
        v[None],
        causal=True,
        segment_ids=(ids, ids),
        implementation="blockwise",
      )[0],
      (q, k, v, ids),
    ),  # fmt: skip
    f"padded [{n}, {width}]": (
      lambda q, k, v, _: pallas_fa3.flash_attention(
        q, k, v, causal=True, implementation="blockwise"
      ),
      (pad(q), pad(k), pad(v), cu),
    ),
  }
  rows = []
  for name, (fn, args) in calls.items():
    for mode in ("fwd", "fwd+bwd"):
      if mode == "fwd":
        jitted = jax.jit(fn)
      else:

        def jitted(q, k, v, extra, fn=fn):
          out, pull = jax.vjp(lambda *a: fn(*a, extra), q, k, v)
          return pull(jnp.ones_like(out))

        jitted = jax.jit(jitted)
      t, _ = timing.measure(jitted, [args], 1, runs)
      rows.append(dict(rule=name, mode=mode, median_ms=t.median_s * 1e3))
      print(f"| {name} | {mode} | {t.median_s * 1e3:.0f} |", flush=True)
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seqs", type=int, default=16)
  parser.add_argument("--tokens", type=int, default=16384)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--time-tokens", type=int, default=4096)
  parser.add_argument("--runs", type=int, default=3)
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  lk = lengths(args.seqs, args.tokens, args.seed)
  packings = {"self-attention": (lk, lk), "chunked prefill": (-(-lk // 4), lk)}
  print(f"lengths (keys): {lk.tolist()}")
  print("| packing | mask | kernel | alone (sum) | varlen | ratio | padded |")
  print("|---|---|---|---|---|---|---|")
  rows, alone = [], {}
  for name, (lq, lk_) in packings.items():
    for causal in (False, True):
      got = packed_steps(lq, lk_, args.head_dim, causal)
      own = alone[name, causal] = alone_steps(lq, lk_, args.head_dim, causal)
      pad = padded_steps(lq, lk_, args.head_dim, causal)
      for kernel in KERNELS:
        mask = "causal" if causal else "full"
        ratio = got[kernel] / own[kernel]
        print(
          f"| {name} | {mask} | {kernel} | {own[kernel]} | {got[kernel]} |"
          f" {ratio:.3f} | {pad[kernel]} |"
        )
        rows.append(
          dict(
            packing=name,
            causal=causal,
            kernel=kernel,
            alone=own[kernel],
            varlen=got[kernel],
            padded=pad[kernel],
          )
        )
  lq = packings["chunked prefill"][0]
  fold = folded_steps(lq, lk, args.head_dim)
  own = alone["chunked prefill", True]
  print("\nchunked prefill, causal, the diagonal folded into the bounds:")
  print("| kernel | alone (sum) | folded | ratio |\n|---|---|---|---|")
  for kernel in KERNELS:
    ratio = fold[kernel] / own[kernel]
    print(f"| {kernel} | {own[kernel]} | {fold[kernel]} | {ratio:.3f} |")
    rows.append(
      dict(packing="chunked prefill, folded", causal=True, kernel=kernel,
           alone=own[kernel], varlen=fold[kernel], padded=None)
    )  # fmt: skip
  timed = []
  if args.time_tokens:
    short = lengths(args.seqs, args.time_tokens, args.seed)
    print(f"\nblockwise on this CPU, {short.sum()} tokens: {short.tolist()}")
    print("| rule | mode | median ms |\n|---|---|---|")
    timed = time_rules(short, args.runs)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(
        dict(vars(args), lengths=lk.tolist(), rows=rows, timed=timed),
        f,
        indent=1,
      )
  return 0


if __name__ == "__main__":
  sys.exit(main())
