"""Tiles a block mask visits against today's skipping (issue 44): 16 packed
documents (causal within each), prefix-LM, chunked attention and a causal
sliding window, at 4096 tokens.

  python benchmarks/flex_tiles.py [--seq 4096] [--time-seq 2048] [--json PATH]

For each: the 128 x 128 tiles the block mask keeps (`tiles_visited`)
against the tiles the built-in option computing the same function walks
(segment ids' spans intersected with the causal range, `window_size`'s
range; prefix-LM has no built-in: plain causal beside it), and the K/V
tiles the Hopper forward kernel's producer loads (per 128-row CTA tile,
128-key tiles: `flex_tile.kernel_operands`' spans against the segment-id
kernel's `id_operands` spans and the window kernel's range), and the
64-row query tiles the dK/dV kernel's producer loads per 128-key CTA
(`bm_qspans` against `dkdv_operands`' spans and the causal/window range). Then the
blockwise forward on this CPU at `--time-seq` tokens (d64, 4 heads,
float32): the block mask, the mask_mod alone (every tile visited) and the
built-in option.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_fa3
from pallas_fa3 import flex, masking, mods, segments
from pallas_fa3.kernels.sm90 import common, flex_tile
from pallas_fa3.kernels.sm90.backward_dkdv import DkdvPlan
from pallas_fa3.kernels.sm90.config import Sm90BackwardConfig, Sm90ForwardConfig
from pallas_fa3.spec import make_spec

T = 128  # tiles (blockwise and block mask), CTA rows and kernel K/V tiles


def cases(s: int) -> dict:
  """name -> (mask_mod, built-in flash_attention keywords or None)."""
  docs = jnp.asarray(np.arange(s)[None] // (s // 16), jnp.int32)
  chunks = jnp.asarray(np.arange(s)[None] // 1024, jnp.int32)
  causal = mods.causal_top_left
  return {
    "16 documents": (
      mods.and_masks(causal, mods.document_mask(docs)),
      dict(causal=True, segment_ids=docs),
    ),
    "prefix-LM (512)": (mods.prefix_lm(512), dict(causal=True)),
    "chunked (1024)": (
      mods.chunked(1024),
      dict(causal=True, segment_ids=chunks),
    ),
    "window (256, 0)": (
      mods.sliding_window(256),
      dict(causal=True, window_size=(256, 0)),
    ),
  }


def builtin_tiles(s: int, kw: dict) -> int:
  """Tiles the built-in option walks (positional range, segment spans)."""
  q = jax.ShapeDtypeStruct((1, s, 1, 64), jnp.bfloat16)
  spec = make_spec(q, q, q, causal=kw.get("causal", False),
                   window_size=kw.get("window_size"))  # fmt: skip
  n = s // T
  span = None
  if "segment_ids" in kw:
    ids = kw["segment_ids"]
    span = segments.kv_tile_spans(segments.SegmentIds(ids, ids), T, T)
  total = 0
  for i in range(n):
    first, end = masking.kv_block_range(spec, i * T, (i + 1) * T, T, n)[:2]
    if span is not None:
      first = max(int(first), int(span[0][0, i]))
      end = min(int(end), int(span[1][0, i]))
    total += max(int(end) - int(first), 0)
  return total


def block_mask_spec(s: int, mask_mod) -> tuple:
  """(the spec of a call with `mask_mod`'s block mask, its operands)."""
  q = jax.ShapeDtypeStruct((1, s, 1, 64), jnp.bfloat16)
  bm = pallas_fa3.create_block_mask(mask_mod, 1, None, s, s)
  fspec, ops = flex.prepare(
    score_mod=None, mask_mod=None, block_mask=bm, bias=None, batch=1,
    heads=1, seq_q=s, seq_kv=s,
  )  # fmt: skip
  return dataclasses.replace(make_spec(q, q, q), flex=fspec), ops


def builtin_spec(s: int, kw: dict) -> tuple:
  """(the built-in option's spec, its segment ids' kernel bounds or None)."""
  q = jax.ShapeDtypeStruct((1, s, 1, 64), jnp.bfloat16)
  bspec = make_spec(q, q, q, causal=True, window_size=kw.get("window_size"))
  if "segment_ids" not in kw:
    return bspec, None
  ids = kw["segment_ids"]
  bspec = dataclasses.replace(bspec, segmented=True)
  return bspec, segments.kernel_bounds(bspec, (ids, ids))[0]


def kernel_loads(s: int, mask_mod, kw: dict | None) -> tuple[int, int]:
  """K/V tiles the forward kernel's producer loads: (with the block mask,
  with the built-in option)."""
  cfg = Sm90ForwardConfig(64, T, 2)
  spec, ops = block_mask_spec(s, mask_mod)
  plan = common.QueryPlan(spec, cfg, seq_q_pad=s, seq_kv_pad=s)
  spans = flex_tile.kernel_operands(
    spec, ops, q_pad=s, kv_pad=s, rows_per_cta=T, block_kv=T
  )["bm_spans"][:, 0, 0]
  ours = sum(
    int(common.cta_kv_range(plan, t * T, (spans[0, t], spans[1, t]))[1])
    for t in range(s // T)
  )
  if kw is None:
    return ours, None
  bspec, bounds = builtin_spec(s, kw)
  span = None
  if bounds is not None:
    lo, hi, _, _ = bounds
    bplan = common.QueryPlan(bspec, cfg, seq_q_pad=s, seq_kv_pad=s)
    span = common.id_operands(bplan, lo, hi)[2][:, 0]
  bplan = common.QueryPlan(bspec, cfg, seq_q_pad=s, seq_kv_pad=s)
  theirs = sum(
    int(
      common.cta_kv_range(
        bplan, t * T, None if span is None else (span[0, t], span[1, t])
      )[1]
    )
    for t in range(s // T)
  )
  return ours, theirs


def dkdv_loads(s: int, mask_mod, kw: dict | None) -> tuple[int, int]:
  """Query tiles (Q, dO, lse, delta; 64 rows) the dK/dV kernel's producer
  loads per 128-key CTA (two consumers of 64 keys): (with the block mask,
  with the built-in option), as `backward_dkdv.q_tile_range` walks them."""
  cfg = Sm90BackwardConfig(64, 64, 2, 2, 1)
  spec, ops = block_mask_spec(s, mask_mod)
  plan = DkdvPlan(spec, cfg, s, s)
  rows, nq = plan.kv_rows_per_cta, plan.num_q_blocks
  spans = flex_tile.kernel_operands(
    spec, ops, q_pad=s, kv_pad=s, kv_rows_per_cta=rows, block_q=cfg.block_q
  )["bm_qspans"][:, 0, 0]

  def walked(spec, span):
    total = 0
    for c in range(s // rows):
      first, end = masking.q_block_range(
        spec, c * rows, (c + 1) * rows, cfg.block_q, nq
      )
      if span is not None:
        first, end = (
          max(int(first), int(span[0, c])),
          min(int(end), int(span[1, c])),
        )
      total += max(int(end) - int(first), 0)
    return total

  ours = walked(spec, spans)
  if kw is None:
    return ours, None
  bspec, bounds = builtin_spec(s, kw)
  span = None
  if bounds is not None:
    span = common.dkdv_operands(DkdvPlan(bspec, cfg, s, s), bounds)[2][:, 0]
  return ours, walked(bspec, span)


def timed(fn, *args, runs: int = 5) -> float:
  jitted = jax.jit(fn)
  jax.block_until_ready(jitted(*args))
  times = []
  for _ in range(runs):
    t0 = time.perf_counter()
    jax.block_until_ready(jitted(*args))
    times.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(times)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--seq", type=int, default=4096)
  p.add_argument("--time-seq", type=int, default=2048)
  p.add_argument("--json")
  args = p.parse_args()
  rows = []
  s = args.seq
  print(
    "| case | tiles of 128x128 | block mask visits | built-in walks |"
    " kernel loads, block mask | kernel loads, built-in |"
    " dK/dV loads, block mask | dK/dV loads, built-in |"
  )
  print("| --- | --- | --- | --- | --- | --- | --- | --- |")
  for name, (mask, kw) in cases(s).items():
    bm = pallas_fa3.create_block_mask(mask, 1, None, s, s)
    ours_k, theirs_k = kernel_loads(s, mask, kw)
    ours_b, theirs_b = dkdv_loads(s, mask, kw)
    row = dict(
      case=name,
      tiles=(s // T) ** 2,
      block_mask=int(bm.tiles_visited()),
      builtin=builtin_tiles(s, kw),
      kernel_block_mask=ours_k,
      kernel_builtin=theirs_k,
      dkdv_block_mask=ours_b,
      dkdv_builtin=theirs_b,
    )
    rows.append(row)
    print(
      f"| {name} | {row['tiles']} | {row['block_mask']} | {row['builtin']} |"
      f" {ours_k} | {theirs_k} | {ours_b} | {theirs_b} |"
    )
  # CPU time of the blockwise forward.
  s = args.time_seq
  ks = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(x, (1, s, 4, 64)) for x in ks)
  print(f"\nblockwise forward, {s} tokens, d64, 4 heads, float32 (ms):\n")
  print("| case | block mask | mask_mod alone | built-in |")
  print("| --- | --- | --- | --- |")
  for name, (mask, kw) in cases(s).items():
    bm = pallas_fa3.create_block_mask(mask, 1, None, s, s)
    fa = pallas_fa3.flash_attention
    cfg = pallas_fa3.BlockwiseConfig(T, T)
    t_bm = timed(lambda q, k, v: fa(q, k, v, block_mask=bm), q, k, v)
    t_mm = timed(
      lambda q, k, v: fa(q, k, v, mask_mod=mask, config=cfg), q, k, v
    )
    t_bi = timed(lambda q, k, v: fa(q, k, v, config=cfg, **kw), q, k, v)
    rows.append(dict(case=name, seq=s, ms_block_mask=t_bm,
                     ms_mask_mod=t_mm, ms_builtin=t_bi))  # fmt: skip
    print(f"| {name} | {t_bm:.1f} | {t_mm:.1f} | {t_bi:.1f} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
