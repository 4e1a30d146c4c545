"""The blockwise twin of the Hopper decode kernel: attention over a KV cache
in pure JAX, tile by tile over each sequence's own visible keys, split into
`num_splits` ranges merged by log-sum-exp, the query rows of one KV head
together; keys past a sequence's length are masked in the scores and
zeroed in V (garbage, NaN included, never reaches the output), and with
`spec.v_in_k` (MLA) each V tile is the first `head_dim_v` columns of the K
tile just read: docs/decoding.md#backends.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pallas_fa3 import flex
from pallas_fa3.backends.blockwise.tiles import scaled_scores
from pallas_fa3.kvcache import (
  DecodeSpec,
  key_range,
  split_span,
  visible_in_cache,
)
from pallas_fa3.lse import combine_splits, natural_from_log2
from pallas_fa3.spec import HIGHEST, LOG2E, cdiv


def decode_compute_dtype(spec: DecodeSpec) -> jnp.dtype:
  """The dtype of the K, V and P operands of the products: q's, or for an
  e4m3 cache float16 (e4m3 converts to it exactly; float32 queries keep
  float32)."""
  if spec.fp8_cache and jnp.dtype(spec.dtype).itemsize == 2:
    return jnp.dtype(jnp.float16)
  return jnp.dtype(spec.dtype)


def decode_tile(spec: DecodeSpec, block_kv: int) -> int:
  """Keys per tile: `block_kv` (whole pages for a paged cache), at most the
  capacity."""
  if spec.paged:
    pages = max(1, block_kv // spec.page_size)
    return min(pages, spec.pages_per_seq) * spec.page_size
  return min(block_kv, spec.capacity)


def split_ranges(
  spec: DecodeSpec, lengths: jax.Array, tile: int, starts=0
) -> tuple[jax.Array, jax.Array]:
  """(first tile `[b]`, end tile `[b]`) of every sequence's visible keys
  (from `starts`, its cache_leftpad); `kvcache.split_span` cuts them into
  the split-KV ranges."""
  first, end = key_range(spec, lengths, starts)
  t0 = jnp.broadcast_to(jnp.asarray(first, jnp.int32), lengths.shape) // tile
  t1 = jnp.maximum(cdiv(jnp.asarray(end, jnp.int32), tile), t0)
  return t0, t1


def _tile_kv(
  spec: DecodeSpec,
  k_cache: jax.Array,
  v_cache: jax.Array,
  row: Any,
  pages: Any,
  tile_index: jax.Array,
  tile: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(K `[tile, hk, d]`, V `[tile, hk, dv]`, key positions `[tile]`) of
  one sequence's tile (its start clamped into the capacity like
  `dynamic_slice`: positions say which keys they really are). With
  `spec.v_in_k`, V is the K tile's first `head_dim_v` columns."""

  def read(cache):
    if spec.paged:
      return cache[ids].reshape((tile,) + cache.shape[2:])
    box = (1, tile) + cache.shape[2:]
    return lax.dynamic_slice(cache, (row, start, 0, 0), box)[0]

  if spec.paged:
    per_tile = tile // spec.page_size
    first = jnp.minimum(tile_index * per_tile, spec.pages_per_seq - per_tile)
    ids = lax.dynamic_slice_in_dim(pages, first, per_tile)
    start = first * spec.page_size
  else:
    start = jnp.minimum(tile_index * tile, spec.capacity - tile)
  k = read(k_cache)
  v = k[..., : spec.head_dim_v] if spec.v_in_k else read(v_cache)
  return k, v, start + jnp.arange(tile, dtype=jnp.int32)


def blockwise_decode(
  spec: DecodeSpec,
  block_kv: int,
  splits: int,
  q: jax.Array,
  k_cache: jax.Array,
  v_cache: jax.Array,
  lengths: jax.Array,
  rows: Any,
  page_table: Any,
  sinks: jax.Array | None,
  descale: tuple[jax.Array, jax.Array] | None = None,
  flex_ops: Any = None,
  starts: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """(out `[b, sq, hq, dv]` in q's dtype, lse `[b, hq, sq]` float32) over
  keys `[starts[b], lengths[b])` (`starts` None: 0).

  `v_cache` is None with `spec.v_in_k`. An e4m3 cache (`descale =
  (k_descale, v_descale)`, float32 `[b, hk]`)
  computes as the kernel does: K and V tiles converted exactly to float16
  (float32 for float32 queries), k_descale folded into the scores' scale,
  P rounded to float16, O times v_descale. `flex_ops`: those of
  `spec.flex` (score_mod in natural units on each tile, then log2).
  """
  f32 = jnp.float32
  b, sq, hk, g = spec.batch, spec.seq_q, spec.heads_kv, spec.group_size
  tile = decode_tile(spec, block_kv)
  if starts is None:
    starts = jnp.zeros_like(lengths)
  t0, t1 = split_ranges(spec, lengths, tile, starts)
  stat = (hk, g, sq)
  compute = decode_compute_dtype(spec)
  if descale is None:
    descale = (jnp.ones((b, hk), f32),) * 2

  def one_split(bi, qb, length, start, row, pages, kd, t0, t1, s):
    lo, count = split_span(spec, t0, t1, s, splits, tile)
    hi = lo + count
    kd = kd[:, None, None, None]  # [hk, 1, 1, 1]

    def step(j, carry):
      m, l, acc = carry
      k, v, pos = _tile_kv(spec, k_cache, v_cache, row, pages, j, tile)
      live = (pos < length) & (pos >= start)
      v = jnp.where(live[:, None, None], v, 0).astype(compute)
      s_ = jnp.einsum(
        "qhgd,khd->hgqk",
        qb,
        k.astype(compute),
        preferred_element_type=f32,
        precision=HIGHEST,
      )
      fmask = None
      # natural units through the user functions, then base 2
      x, _ = scaled_scores(spec, s_, base2=spec.flex is None, descale=kd)
      if spec.flex is not None:
        x, fmask = flex.decode_scores(
          spec, flex_ops, x[None], bi[None], length[None], pos
        )
        x = x[0] * f32(LOG2E)
        fmask = None if fmask is None else fmask[0]
      x = lax.optimization_barrier(x)  # one rounding: see blockwise_tiles
      seen = pos >= j * tile  # a clamped tile's start repeats keys
      mask = visible_in_cache(spec, length, jnp.arange(sq)[:, None], pos, start)
      if fmask is not None:
        mask = mask & fmask
      x = jnp.where(mask & seen, x, -jnp.inf)
      m_new = jnp.maximum(m, x.max(axis=-1))
      m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      alpha = jnp.exp2(m - m_ref)
      p = jnp.exp2(x - m_ref[..., None])
      pv = jnp.einsum(
        "hgqk,khd->hgqd",
        p.astype(compute),
        v,
        preferred_element_type=f32,
        precision=HIGHEST,
      )
      return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

    init = (
      jnp.full(stat, -jnp.inf, f32),
      jnp.zeros(stat, f32),
      jnp.zeros(stat + (spec.head_dim_v,), f32),
    )
    m, l, acc = lax.fori_loop(lo, jnp.maximum(hi, lo), step, init)
    empty = l == 0.0
    out = acc / jnp.where(empty, 1.0, l)[..., None]
    log2_l = jnp.log2(jnp.where(empty, 1.0, l))
    return out, jnp.where(empty, -jnp.inf, natural_from_log2(m + log2_l))

  qg = q.reshape(b, sq, hk, g, spec.head_dim)
  if spec.fp8_cache:
    qg = qg.astype(f32)  # (16-bit queries are exact in the kernel's float16)
  pages = (
    jnp.zeros((b, 1), jnp.int32) if page_table is None else page_table
  ).astype(jnp.int32)
  sink = None
  if sinks is not None:
    sink = sinks.astype(f32).reshape(b, hk, g, 1)

  def one_sequence(args):
    *seq_args, vd, sk = args
    outs, lses = jax.vmap(one_split, in_axes=(None,) * 9 + (0,))(
      *seq_args, jnp.arange(splits)
    )  # [S, hk, g, sq, dv], [S, hk, g, sq]
    outs = outs * vd[None, :, None, None, None]
    return combine_splits(outs, lses, sk)

  per_sequence = (
    jnp.arange(b, dtype=jnp.int32),
    qg,
    lengths,
    starts.astype(jnp.int32),
    rows,
    pages,
    descale[0],
    t0,
    t1,
    descale[1],
    sink,
  )
  if spec.batch_invariant:  # one sequence's program, whatever the batch
    out, lse = lax.map(one_sequence, per_sequence)
  else:
    out, lse = jax.vmap(one_sequence)(per_sequence)
  out = jnp.moveaxis(out, 3, 1).reshape(spec.out_shape)  # [b, sq, hk, g, dv]
  return out.astype(spec.dtype), lse.reshape(spec.lse_shape)
