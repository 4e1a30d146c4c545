"""The decode kernel's work per step, modelled from its plan (no GPU): the
split-KV count the kernel picks, its CTAs and waves over 132 SMs, the K/V
tiles the busiest SM streams, the K/V bytes and the float32 partial bytes
written and read back by the merge. Run it on two checkouts to compare
(issue 67: partials only for live rows, split counts that fill the last
wave); benchmarks/RESULTS.md records both.

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/decode_work.py
    ... decode_work.py --batch-invariant   # batch_invariant=True's cost
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from pallas_fa3.kernels.sm90 import config_decode as cd
from pallas_fa3.kvcache import make_decode_spec
from pallas_fa3.spec import cdiv

# (batch, cache tokens, query heads, KV heads, q_len): batch 1 x 8k,
# perfcmp's decode spec (batch 4 x 8k, 32/8 heads), the bench's headline
# points, q_len 4 and 16, GQA 8 and MQA.
SHAPES = (
  (1, 8192, 32, 8, 1),
  (4, 8192, 32, 8, 1),
  (64, 8192, 32, 8, 1),
  (1, 131072, 32, 8, 1),
  (8, 32768, 32, 8, 1),
  (8, 32768, 64, 8, 1),
  (1, 131072, 32, 8, 4),
  (64, 8192, 32, 8, 16),
  (2, 16384, 16, 1, 1),
)


def _partial_rows(spec) -> int:
  rows = getattr(cd, "partial_rows", None)  # (issue 67; before: 64-row tiles)
  if rows is not None:
    return rows(spec)
  return cd.query_tiles(spec) * cd.DECODE_ROWS


def work(b, n, hq, hk, sq, d=128, **options) -> dict:
  """One decode step's modelled work at (batch, cache tokens, heads, q_len);
  `options`: `flash_attention_with_kvcache`'s (batch_invariant)."""
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  spec = make_decode_spec(
    s(b, sq, hq, d), s(b, n, hk, d), s(b, n, hk, d), cache_seqlens=n - sq,
    causal=True, **options,
  )  # fmt: skip
  config = cd.default_decode_config(spec)
  splits = cd.default_splits(spec, config)
  qtiles = cd.query_tiles(spec)
  ctas = b * cd.grid_heads(spec) * qtiles * splits
  tiles = cdiv(n, config.block_kv)
  per = cdiv(tiles, splits)
  kv = qtiles * b * hk * n * 2 * d * 2  # each query tile reads K and V
  rows = _partial_rows(spec)
  partial = splits * b * cd.grid_heads(spec) * rows * (d + 1) * 4
  return dict(
    shape=f"b{b} L{n} {hq}/{hk} q{sq}",
    splits=splits,
    ctas=ctas,
    waves=ctas / cd.HOPPER_SMS,
    busiest_sm_tiles=cdiv(ctas, cd.HOPPER_SMS) * per,
    kv_bytes=kv,
    partial_bytes=partial,
    merge_read_bytes=partial,
    extra=2 * partial / kv,
  )


def main() -> None:
  options = {"batch_invariant": True} if "--batch-invariant" in sys.argv else {}
  print(
    "| shape | splits | CTAs | waves | tiles on the busiest SM | K/V MB |"
    " partials written MB | + merge read MB | partials / K/V |"
  )
  print("|---|---|---|---|---|---|---|---|---|")
  for shape in SHAPES:
    w = work(*shape, **options)
    print(
      f"| {w['shape']} | {w['splits']} | {w['ctas']} | {w['waves']:.2f} |"
      f" {w['busiest_sm_tiles']} | {w['kv_bytes'] / 1e6:.1f} |"
      f" {w['partial_bytes'] / 1e6:.2f} | {w['merge_read_bytes'] / 1e6:.2f} |"
      f" {100 * w['extra']:.1f}% |"
    )


if __name__ == "__main__":
  main()
