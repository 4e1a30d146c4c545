"""Materialized attention over a KV cache (the decode oracle) and its
float64 golden.

`reference_decode` gathers every sequence's logical keys and values and
materializes `[b, hk, g, sq, capacity]` scores in float32; keys past a
sequence's length (garbage in the cache, possibly NaN) are masked in the
scores and zeroed in V, so none reaches the output. `golden_decode` runs
the float64 golden of `flash_attention` on each logical sequence. With
`spec.v_in_k` (v_cache None) V is the K cache's first `head_dim_v` columns.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3.kvcache_cache import cache_rows, gather
from pallas_fa3.kvcache_spec import DecodeSpec, visible_in_cache
from pallas_fa3.reference import golden_attention

_HIGHEST = jax.lax.Precision.HIGHEST


def reference_decode(
  spec: DecodeSpec,
  q: jax.Array,
  k_cache: jax.Array,
  v_cache: jax.Array,
  lengths: jax.Array,
  rows: Any,
  page_table: Any,
  sinks: jax.Array | None,
  descale: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array]:
  """(out `[b, sq, hq, dv]` in q's dtype, lse `[b, hq, sq]` float32) for
  sequences of `lengths[b]` keys (the appended tokens already written);
  an e4m3 cache is dequantized with `descale = (k_descale, v_descale)`;
  `v_cache` None with `spec.v_in_k`."""
  f32 = jnp.float32
  b, sq, hk, g = spec.batch, spec.seq_q, spec.heads_kv, spec.group_size
  k = gather(spec, k_cache, rows, page_table).astype(f32)
  if spec.v_in_k:
    v = k[..., : spec.head_dim_v]
  else:
    v = gather(spec, v_cache, rows, page_table).astype(f32)
  if descale is not None:
    k = k * descale[0][:, None, :, None]
    v = v * descale[1][:, None, :, None]
  pos = jnp.arange(spec.capacity)
  keep = (pos[None, :] < lengths[:, None])[:, :, None, None]
  v = jnp.where(keep, v, 0.0)  # 0 x NaN past the length would be NaN
  qg = q.astype(f32).reshape(b, sq, hk, g, spec.head_dim)
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, precision=_HIGHEST)
  s = s * f32(spec.softmax_scale)
  if spec.softcap is not None:
    s = f32(spec.softcap) * jnp.tanh(s / f32(spec.softcap))
  s = jax.lax.optimization_barrier(s)  # one rounding: see reference.py
  mask = visible_in_cache(
    spec,
    lengths[:, None, None],
    jnp.arange(sq)[None, :, None],
    pos[None, None, :],
  )[:, None, None]  # [b, 1, 1, sq, capacity]
  s = jnp.where(mask, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  if sinks is not None:
    sk = sinks.astype(f32).reshape(b, hk, g, 1, 1)
    m = jnp.maximum(m, sk)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  e = jnp.exp(s - m)
  l = e.sum(axis=-1, keepdims=True)
  if sinks is not None:
    l = l + jnp.exp(sk - m)
  empty = l == 0
  p = e / jnp.where(empty, 1.0, l)
  o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v, precision=_HIGHEST)
  lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))
  out = o.reshape(spec.out_shape).astype(spec.dtype)
  return out, lse[..., 0].reshape(spec.lse_shape)


def golden_decode(
  spec: DecodeSpec,
  q: Any,
  k_cache: Any,
  v_cache: Any,
  lengths: Any,
  rows: Any = None,
  page_table: Any = None,
  sinks: Any = None,
  descale: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
  """Float64 (out, lse) of every sequence: `flash_attention`'s golden on
  its logical keys `[0, lengths[b])` (bottom-right causal and windows, as
  in the decode semantics). A sequence of length 0 sees no key; `v_cache`
  None with `spec.v_in_k` (V: the K cache's columns). `rows`:
  `cache_batch_idx` (contiguous), `page_table` (paged); an e4m3 cache is
  dequantized with `descale = (k_descale, v_descale)` first."""
  rows = cache_rows(spec, rows)
  k = np.asarray(gather(spec, jnp.asarray(k_cache), rows, page_table))
  if spec.v_in_k:  # v_cache None: V is K's first head_dim_v columns
    v = k[..., : spec.head_dim_v]
  else:
    v = np.asarray(gather(spec, jnp.asarray(v_cache), rows, page_table))
  if descale is not None:  # float32 inputs (the golden computes in float64)
    k = (
      k.astype(np.float32)
      * np.asarray(descale[0], np.float32)[:, None, :, None]
    )
    v = (
      v.astype(np.float32)
      * np.asarray(descale[1], np.float32)[:, None, :, None]
    )
    q = np.asarray(q, np.float32)
  outs, lses = [], []
  for i in range(spec.batch):
    n = int(lengths[i])
    qi = np.asarray(q[i : i + 1])
    if n == 0:
      out = np.zeros(qi.shape[:3] + (spec.head_dim_v,))
      lse = np.full((1, spec.heads_q, spec.seq_q), -np.inf)
      if sinks is not None:
        lse = lse * 0 + np.asarray(sinks, np.float64)[None, :, None]
    else:
      out, lse = golden_attention(
        qi,
        k[i : i + 1, :n],
        v[i : i + 1, :n],
        causal=spec.causal,
        softmax_scale=spec.softmax_scale,
        window_size=spec.window_size,
        softcap=spec.softcap,
        sinks=sinks,
      )
    outs.append(out)
    lses.append(lse)
  return np.concatenate(outs), np.concatenate(lses)
