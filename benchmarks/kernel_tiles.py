"""Tile pairs the sm90 kernels walk with segment ids against without (issue
20), counted on any machine from the same span and range functions the
kernels run: a packed call of --docs documents of equal length (16 x 512 =
8192 tokens by default), bf16, default configs, causal and not.

  JAX_PLATFORMS=cpu python benchmarks/kernel_tiles.py [--json PATH]

Per kernel: the forward and dQ kernels' K/V steps summed over their query
tiles (`common.cta_kv_range`), the dK/dV (and fused) kernel's query steps
summed over its K/V CTAs (`backward_dkdv.q_tile_range`'s ranges). One
step is one (query tile, K/V tile) GEMM pair, so the ratio is the work a
GPU run should save (every segmented step is masked, a little dearer).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp

from pallas_fa3 import masking, segments
from pallas_fa3.kernels.sm90 import config, config_backward
from pallas_fa3.kernels.sm90.backward_dkdv import DkdvPlan
from pallas_fa3.kernels.sm90.common import (
  QueryPlan,
  cta_kv_range,
  id_operands,
  query_tile_spans,
  round_up,
)
from pallas_fa3.spec import make_spec


def _kv_steps(plan: QueryPlan, bounds) -> int:
  """K/V steps over every query tile of one (batch row, head)."""
  spans = None if bounds is None else id_operands(plan, *bounds[:2])[2]
  total = 0
  for t in range(plan.num_q_tiles):
    span = None if spans is None else (spans[0, 0, t], spans[1, 0, t])
    total += int(cta_kv_range(plan, t * plan.rows_per_cta, span)[1])
  return total


def _q_steps(plan: DkdvPlan, bounds) -> int:
  """Query steps over every K/V CTA of one (batch row, kv head) and query
  head of its group."""
  if bounds is not None:
    first, end = query_tile_spans(plan, *bounds[2:])
    return int(jnp.maximum(end - first, 0).sum())
  total = 0
  for c in range(plan.kv_ctas):
    kv0 = c * plan.kv_rows_per_cta
    first, end = masking.q_block_range(
      plan.spec,
      kv0,
      kv0 + plan.kv_rows_per_cta,
      plan.config.block_q,
      plan.num_q_blocks,
    )
    total += max(int(end) - int(first), 0)
  return total


def steps(spec, bounds) -> dict:
  """Steps per kernel of one head of `spec` (batch 1), with the segment
  ids' `bounds` (`segments.kernel_bounds(...)[0]`) or None."""
  seq_q, seq_kv = spec.seq_q, spec.seq_kv
  fwd = config.default_forward_config(spec)
  plan = QueryPlan(
    spec, fwd, round_up(seq_q, fwd.rows_per_cta), round_up(seq_kv, fwd.block_kv)
  )
  bwd = config_backward.default_backward_config(spec)
  sq_pad = round_up(seq_q, 2 * bwd.block_q)
  skv_pad = round_up(seq_kv, DkdvPlan(spec, bwd, 0, 0).kv_rows_per_cta)
  dq_plan = QueryPlan(
    spec,
    bwd.dq_config,
    sq_pad,
    skv_pad,
    row_blocks=1 if bwd.dq_head_splits == 2 else bwd.dq_consumers,
  )
  return {
    "forward": _kv_steps(plan, bounds),
    "dq": _kv_steps(dq_plan, bounds),
    "dkdv": _q_steps(DkdvPlan(spec, bwd, sq_pad, skv_pad), bounds),
  }


def count(seq: int, docs: int, head_dim: int, causal: bool) -> dict:
  """Steps per kernel, unsegmented and segmented, for one head."""
  q = jax.ShapeDtypeStruct((1, seq, 1, head_dim), jnp.bfloat16)
  ids = segments.segment_ids_from_lengths(
    jnp.full((1, docs), seq // docs, jnp.int32), seq
  )
  row = {}
  for seg in (False, True):
    spec = make_spec(q, q, q, causal=causal, segmented=seg)
    bounds = segments.kernel_bounds(spec, (ids, ids))[0] if seg else None
    row["segmented" if seg else "unsegmented"] = steps(spec, bounds)
  return row


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seq", type=int, default=8192)
  parser.add_argument("--docs", type=int, default=16)
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  results = []
  print("| d | mask | kernel | unsegmented | segmented | ratio |")
  print("|---|---|---|---|---|---|")
  for d in config.KERNEL_HEAD_DIMS:
    for causal in (False, True):
      row = count(args.seq, args.docs, d, causal)
      for kernel in ("forward", "dq", "dkdv"):
        a, b = row["unsegmented"][kernel], row["segmented"][kernel]
        mask = "causal" if causal else "full"
        print(f"| {d} | {mask} | {kernel} | {a} | {b} | {b / a:.3f} |")
        results.append(
          dict(head_dim=d, causal=causal, kernel=kernel, steps=a, segmented=b)
        )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(seq=args.seq, docs=args.docs, rows=results), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
