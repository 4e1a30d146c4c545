"""Flex options compiled into the Hopper decode kernel (issue 44): a
score_mod and a mask_mod traced into its tile loop (one query head per
CTA), interpret mode with race detection against the float64 golden of
each sequence (the user functions at sequence positions), contiguous and
paged caches, seq_q 1 to a prefill chunk past one tile, split-KV, a block
mask at seq_q 1; what it refuses names the reason and the automatic choice
runs blockwise; the CUDA lowering is the one kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import pallas_fa3
from pallas_fa3 import mods
from pallas_fa3.kernels.sm90 import compat
from pallas_fa3.testing import assert_within_tolerance, lowered_kernel_count

B, HQ, HK, D, CAP = 2, 8, 2, 64, 256
LENS = (90, 230)
_DOCS = jnp.asarray((np.arange(CAP) // 37)[None].repeat(B, 0), jnp.int32)
_SLOPES = jnp.asarray(mods.alibi_slopes(HQ), jnp.float32)


def _doc_mask(b, h, qi, ki):
  return _DOCS[b, qi] == _DOCS[b, ki]


def _alibi(s, b, h, qi, ki):
  return s - _SLOPES[h] * (qi - ki).astype(jnp.float32)


def _inputs(sq, paged, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (B, sq, HQ, D), jnp.bfloat16)
  kc = jax.random.normal(ks[1], (B, CAP, HK, D), jnp.bfloat16)
  vc = jax.random.normal(ks[2], (B, CAP, HK, D), jnp.bfloat16)
  kw = dict(cache_seqlens=jnp.asarray(LENS, jnp.int32))
  if paged:  # pages of 64 in a shuffled order
    order = np.random.default_rng(seed).permutation(B * CAP // 64)
    table = jnp.asarray(order.reshape(B, CAP // 64), jnp.int32)
    pages = lambda c: (
      jnp.zeros((B * CAP // 64, 64, HK, D), c.dtype)
      .at[table.reshape(-1)]
      .set(c.reshape(B * CAP // 64, 64, HK, D))
    )
    return q, (kc, vc), (pages(kc), pages(vc)), dict(kw, page_table=table)
  return q, (kc, vc), (kc, vc), kw


def _golden_and_naive(q, kc, vc, sq, options):
  """Per sequence: the float64 reference and the bf16-intermediate one
  over its own keys, the user functions at sequence positions."""

  def run(dtype):
    outs = []
    for b, n in enumerate(LENS):
      off = n - sq
      opts = dict(options)
      if "mask_mod" in opts:
        fn = opts["mask_mod"]
        opts["mask_mod"] = lambda bb, h, qi, ki, fn=fn, b=b, off=off: fn(
          bb + b, h, qi + off, ki
        )
      if "score_mod" in opts:
        fn = opts["score_mod"]
        opts["score_mod"] = lambda s, bb, h, qi, ki, fn=fn, b=b, off=off: fn(
          s, bb + b, h, qi + off, ki
        )
      x = (lambda a: jnp.asarray(a[b : b + 1], jnp.float32)) if dtype == jnp.float64 else (lambda a: a[b : b + 1])  # fmt: skip
      outs.append(
        np.asarray(
          pallas_fa3.reference_attention(
            x(q), x(kc)[:, :n], x(vc)[:, :n], causal=True,
            intermediate_dtype=dtype, **opts,
          ),
          np.float64,
        )
      )  # fmt: skip
    return np.concatenate(outs)

  with jax.enable_x64(True):
    golden = run(jnp.float64)
  return golden, run(jnp.bfloat16)


def _interpret(*args, **kw):
  try:
    with compat.capture_race_report() as report:
      out = pallas_fa3.flash_attention_with_kvcache(
        *args, **kw, implementation="interpret"
      )
      jax.block_until_ready(out)
  except Exception:
    compat.reset_interpret_state()
    raise
  assert not compat.races_found(), report.getvalue()[-3000:]
  return out


OPTIONS = {
  "alibi-and-documents": dict(score_mod=_alibi, mask_mod=_doc_mask),
  "documents": dict(mask_mod=_doc_mask),
  "softcap-mod": dict(score_mod=mods.softcap(20.0)),
}


_LAYOUTS = {
  "q1-contiguous": (1, False, 1),
  "q4-paged64-2-splits": (4, True, 2),
  "q70-two-query-tiles": (70, False, 1),
}
# The default run: each option set (both functions, each alone) in the
# paged split layout; the rest under -m slow. The block-mask tests below
# run the mask_mod at seq_q 1 and over two contiguous query tiles, and
# score_mod and mask_mod take the same query positions (the tile's `q0`
# in `decode._flex_scores`) in every layout.
_DECODE_QUICK_LAYOUT = "q4-paged64-2-splits"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
  "name,sq,paged,splits",
  [
    pytest.param(
      name,
      *layout,
      id=f"{name}-{lid}",
      marks=() if lid == _DECODE_QUICK_LAYOUT else pytest.mark.slow,
    )
    for name in OPTIONS
    for lid, layout in _LAYOUTS.items()
  ],
)
def test_interpret_flex_decode_against_float64_golden(name, sq, paged, splits):
  options = OPTIONS[name]
  q, (kc, vc), caches, kw = _inputs(sq, paged)
  got = _interpret(
    q, *caches, **kw, causal=True, num_splits=splits,
    config=pallas_fa3.Sm90DecodeConfig(block_kv=64, num_stages=2),
    **options,
  )  # fmt: skip
  golden, naive = _golden_and_naive(q, kc, vc, sq, options)
  assert_within_tolerance(name, got, naive, golden)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
  "sq,paged,splits",
  [(1, True, 1), (4, True, 2), (70, False, 1)],
  ids=["q1-paged64", "q4-paged64-2-splits", "q70-two-query-tiles"],
)
def test_interpret_flex_decode_with_a_block_mask(sq, paged, splits):
  """A block mask over sequence positions: the tiles' states in the
  kernel (a tile's queries, at any position, reading two block-mask rows
  where they cross one), mask_mod on the partial ones, the producer
  walking the span of the queries' rows."""
  q, (kc, vc), caches, kw = _inputs(sq, paged, seed=1)
  bm = pallas_fa3.create_block_mask(_doc_mask, B, None, CAP, CAP, block_q=64, block_kv=64)  # fmt: skip
  got = _interpret(
    q, *caches, **kw, causal=True, block_mask=bm, num_splits=splits,
    config=pallas_fa3.Sm90DecodeConfig(block_kv=64, num_stages=2),
  )  # fmt: skip
  golden, naive = _golden_and_naive(q, kc, vc, sq, dict(mask_mod=_doc_mask))
  assert_within_tolerance("block mask", got, naive, golden)


@pytest.mark.timeout(300)
def test_interpret_flex_decode_reads_both_block_mask_rows_of_a_tile():
  """A prefill chunk whose 64-row tiles cross a block-mask row: each row
  takes its own row's state. Hand-edited states (row 1's first key tile
  full, row 3's second empty) decide against the mask_mod, so a tile read
  with one row's states differs from blockwise (which honours them)."""
  from pallas_fa3 import flex

  q, _, caches, kw = _inputs(70, False, seed=2)
  bm = pallas_fa3.create_block_mask(_doc_mask, B, None, CAP, CAP, block_q=64, block_kv=64)  # fmt: skip
  state = bm.state.at[:, :, 1, 0].set(flex.FULL).at[:, :, 3, 2].set(flex.EMPTY)
  odd = flex.BlockMask(state, None, CAP, CAP, 64, 64, _doc_mask)
  call = lambda impl, bm: pallas_fa3.flash_attention_with_kvcache(
    q, *caches, **kw, causal=True, block_mask=bm, implementation=impl,
  )  # fmt: skip
  got = _interpret(q, *caches, **kw, causal=True, block_mask=odd)
  want = call("blockwise", odd)
  assert float(jnp.abs(want - call("blockwise", bm)).max()) > 0.1
  np.testing.assert_allclose(
    np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2
  )


def test_decode_producer_skips_a_block_masks_empty_tiles():
  """The decode kernel's K/V tile span per (sequence, head) is the span of
  the non-empty tiles in its query's block-mask row (brute force over the
  mask, its 64-key tiles in the kernel's 32), so its producer loads none
  outside it."""
  import types

  from pallas_fa3 import flex
  from pallas_fa3.kernels.sm90 import flex_tile

  bm = pallas_fa3.create_block_mask(_doc_mask, B, None, CAP, CAP, block_q=64, block_kv=64)  # fmt: skip
  fspec, ops = flex.prepare(
    score_mod=None, mask_mod=None, block_mask=bm, bias=None, batch=B,
    heads=HQ, seq_q=CAP, seq_kv=CAP,
  )  # fmt: skip
  view = types.SimpleNamespace(
    flex=fspec, seq_q=CAP, seq_kv=CAP, batch=B, heads_q=HQ
  )
  pos = jnp.asarray(LENS, jnp.int32) - 1
  spans = np.asarray(
    flex_tile.kernel_operands(
      view, ops, q_pad=CAP + 64, kv_pad=CAP, block_kv=32, positions=(pos, pos)
    )["bm_dspans"]
  )
  assert spans.shape == (2, B, HQ)
  docs = np.asarray(_DOCS)
  for b, p in enumerate(LENS):
    rows = slice((p - 1) // 64 * 64, (p - 1) // 64 * 64 + 64)
    seen = (docs[b, rows, None] == docs[b, None, :]).any(0)
    tiles = np.flatnonzero(seen.reshape(-1, 64).any(1))  # the mask's tiles
    np.testing.assert_array_equal(spans[0, b], 2 * tiles[0])  # in 32 keys
    np.testing.assert_array_equal(spans[1, b], 2 * tiles[-1] + 2)
  assert spans[0, 1, 0] > 0  # the longer sequence skips its first tiles


def test_what_the_kernel_refuses_names_the_reason_and_falls_back():
  q, _, caches, kw = _inputs(2, False)
  idx = jnp.asarray(np.arange(CAP)[::-1].copy(), jnp.int32)
  # an index computed from both positions (a function of one, or of
  # kv_idx - q_idx, compiles: `flex_tile.DerivedRead`)
  gather = lambda b, h, qi, ki: idx[(qi * ki) % CAP] >= 0
  with pytest.raises(NotImplementedError, match="mask_mod"):
    pallas_fa3.flash_attention_with_kvcache(
      q, *caches, **kw, mask_mod=gather, implementation="interpret"
    )
  bm = pallas_fa3.create_block_mask(
    _doc_mask, B, None, CAP, CAP, block_q=32, block_kv=64
  )
  with pytest.raises(NotImplementedError, match="32-query tiles with seq_q=2"):
    pallas_fa3.flash_attention_with_kvcache(
      q, *caches, **kw, block_mask=bm, mask_mod=_doc_mask,
      implementation="interpret",
    )  # fmt: skip
  got = pallas_fa3.flash_attention_with_kvcache(
    q, *caches, **kw, mask_mod=gather
  )
  want = pallas_fa3.flash_attention_with_kvcache(
    q, *caches, **kw, mask_mod=gather, implementation="blockwise"
  )
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.newest
def test_mosaic_lowers_flex_decode_to_one_kernel():
  S = jax.ShapeDtypeStruct
  q = S((4, 1, 16, 128), jnp.bfloat16)
  kc = S((4, 4096, 4, 128), jnp.bfloat16)

  def step(q, kc, vc, n):
    return pallas_fa3.flash_attention_with_kvcache(
      q, kc, vc, cache_seqlens=n, causal=True, score_mod=_alibi_16,
      implementation="mosaic",
    )  # fmt: skip

  text = export.export(jax.jit(step), platforms=["cuda"])(
    q, kc, kc, S((4,), jnp.int32)
  ).mlir_module()
  assert lowered_kernel_count(text) == 1


_SLOPES_16 = jnp.asarray(mods.alibi_slopes(16), jnp.float32)


def _alibi_16(s, b, h, qi, ki):
  return s - _SLOPES_16[h] * (qi - ki).astype(jnp.float32)
