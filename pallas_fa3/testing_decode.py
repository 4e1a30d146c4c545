"""Test helpers for attention over a KV cache: caches with garbage past the
lengths, and the float64 golden and naive low-precision results of every
logical sequence (the tolerance rule of `pallas_fa3.testing`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from pallas_fa3.kvcache_cache import cache_rows, gather
from pallas_fa3.kvcache_spec import DecodeSpec
from pallas_fa3.reference import reference_attention
from pallas_fa3.reference_decode import golden_decode


@dataclasses.dataclass
class DecodeCase:
  """One decode problem: q, the caches (NaN and Inf past every sequence's
  tokens and in unused pages), the lengths already cached, optional new
  tokens, the page table or cache rows. `v_cache` None: DeepSeek MLA's
  layout, V the first `head_dim_v` columns of the K cache."""

  q: Any
  k_cache: Any
  v_cache: Any
  cache_seqlens: np.ndarray
  k: Any = None
  v: Any = None
  page_table: Any = None
  cache_batch_idx: Any = None
  head_dim_v: int | None = None  # with v_cache None

  def call_args(self) -> tuple[tuple, dict]:
    kwargs = dict(
      cache_seqlens=jnp.asarray(self.cache_seqlens, jnp.int32),
      page_table=self.page_table,
      cache_batch_idx=self.cache_batch_idx,
    )
    if self.v_cache is None:
      kwargs["head_dim_v"] = self.head_dim_v
    return (self.q, self.k_cache, self.v_cache, self.k, self.v), kwargs


def decode_case(
  rng: np.random.Generator,
  *,
  batch: int,
  seq_q: int,
  heads_q: int,
  heads_kv: int,
  head_dim: int,
  capacity: int,
  lengths: Any,
  head_dim_v: int | None = None,
  dtype: Any = jnp.bfloat16,
  page_size: int | None = None,
  seq_new: int = 0,
  batch_idx: bool = False,
  v_in_k: bool = False,
) -> DecodeCase:
  """A random case; `lengths` are the tokens cached before `seq_new` new
  ones. Paged: pages shuffled, one spare page; `batch_idx`: the cache has
  one spare row and the sequences use a permutation of the rows;
  `v_in_k`: no V cache and no new v (V: the K cache's first `head_dim_v`
  columns)."""
  dv = head_dim_v or head_dim
  normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
  lengths = np.asarray(lengths, np.int32)
  total = lengths + seq_new
  pt = rows = None
  if page_size:
    pps = capacity // page_size
    pages = batch * pps + 1
    kc, vc = (
      normal(pages, page_size, heads_kv, head_dim),
      normal(pages, page_size, heads_kv, dv),
    )
    pt = rng.permutation(pages)[: batch * pps].reshape(batch, pps)
    kc[...] = np.where(
      _unused_pages(pages, pt)[:, None, None, None], np.nan, kc
    )
    for b in range(batch):
      for t in range(total[b], capacity):
        kc[pt[b, t // page_size], t % page_size] = np.nan
        vc[pt[b, t // page_size], t % page_size] = np.inf
    pt = jnp.asarray(pt, jnp.int32)
  else:
    n = batch + (1 if batch_idx else 0)
    kc, vc = (
      normal(n, capacity, heads_kv, head_dim),
      normal(n, capacity, heads_kv, dv),
    )
    rows = rng.permutation(n)[:batch] if batch_idx else np.arange(batch)
    for b in range(batch):
      kc[rows[b], total[b] :] = np.nan
      vc[rows[b], total[b] :] = -np.inf
    rows = jnp.asarray(rows, jnp.int32) if batch_idx else None
  k = v = None
  if seq_new:
    k = jnp.asarray(normal(batch, seq_new, heads_kv, head_dim), dtype)
    v = jnp.asarray(normal(batch, seq_new, heads_kv, dv), dtype)
  return DecodeCase(
    jnp.asarray(normal(batch, seq_q, heads_q, head_dim), dtype),
    jnp.asarray(kc, dtype),
    None if v_in_k else jnp.asarray(vc, dtype),
    lengths,
    k,
    None if v_in_k else v,
    pt,
    rows,
    dv if v_in_k else None,
  )


def _unused_pages(pages: int, pt: np.ndarray) -> np.ndarray:
  used = np.zeros(pages, bool)
  used[np.asarray(pt).ravel()] = True
  return ~used


def decode_golden_and_naive(
  spec: DecodeSpec,
  case: DecodeCase,
  k_cache: Any,
  v_cache: Any,
  sinks: Any = None,
) -> tuple[tuple, tuple]:
  """((golden out, lse), (naive out, lse)) of every sequence of `case`
  against the (updated) caches: float64, and every intermediate in q's
  dtype. `v_cache` None with `spec.v_in_k`."""
  lengths = np.asarray(case.cache_seqlens) + spec.seq_new
  golden = golden_decode(
    spec,
    case.q,
    k_cache,
    v_cache,
    lengths,
    case.cache_batch_idx,
    case.page_table,
    sinks,
  )
  ids = cache_rows(spec, case.cache_batch_idx)
  k = gather(spec, jnp.asarray(k_cache), ids, case.page_table)
  if spec.v_in_k:
    v = k[..., : spec.head_dim_v]
  else:
    v = gather(spec, jnp.asarray(v_cache), ids, case.page_table)
  outs, lses = [], []
  for b in range(spec.batch):
    n = int(lengths[b])
    qb = case.q[b : b + 1]
    if n == 0:
      outs.append(np.zeros(qb.shape[:3] + (spec.head_dim_v,)))
      lse = np.full((1, spec.heads_q, spec.seq_q), -np.inf)
      if sinks is not None:
        lse = lse * 0 + np.asarray(sinks, np.float64)[None, :, None]
      lses.append(lse)
      continue
    out, lse = reference_attention(
      qb,
      k[b : b + 1, :n],
      v[b : b + 1, :n],
      causal=spec.causal,
      softmax_scale=spec.softmax_scale,
      window_size=spec.window_size,
      softcap=spec.softcap,
      sinks=sinks,
      return_lse=True,
      intermediate_dtype=spec.dtype,
    )
    outs.append(np.asarray(out, np.float64))
    lses.append(np.asarray(lse, np.float64))
  return golden, (np.concatenate(outs), np.concatenate(lses))
