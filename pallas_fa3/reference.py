"""Materialized baseline attention (the oracle), prefill and decode, and
their float64 golden. `reference_attention` materializes S = scale * Q K^T,
P = softmax(S), O = P V with every intermediate in `intermediate_dtype`
(float32 by default, `Precision.HIGHEST`): the oracle of the other backends
and, with a low `intermediate_dtype`, the naive low-precision attention of
the tolerance rule. `reference_decode` gathers every sequence's logical K/V
from its cache and materializes the scores (keys past a length masked and
zeroed in V); `golden_decode` is its float64 golden. The lse of every
backend is the float32 natural log of the row's softmax denominator (-inf
for a row that sees no key; the sink with sinks). docs/api.md#conventions

Example:
  >>> import jax, jax.numpy as jnp
  >>> from pallas_fa3.reference import reference_attention, golden_attention
  >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 8, 2, 16))
  >>> out, lse = reference_attention(q, k, v, causal=True, return_lse=True)
  >>> gold_out, gold_lse = golden_attention(q, k, v, causal=True)
  >>> bool(abs(out - gold_out).max() < 1e-5)
  True
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3 import flex, masking, modifiers, segments
from pallas_fa3.kvcache import (
  DecodeSpec,
  cache_rows,
  dequantize,
  gather,
  visible_in_cache,
)
from pallas_fa3.prepare import prepare
from pallas_fa3.spec import HIGHEST, AttentionSpec, group_heads, make_spec


def reference_forward(
  spec: AttentionSpec,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  intermediate_dtype: Any = jnp.float32,
  sinks: jax.Array | None = None,
  segment_ids: segments.SegmentIds | None = None,
  flex_ops: flex.FlexOperands | None = None,
  flex_fns: tuple | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Materialized attention for a validated spec; returns (out, lse).

  Every intermediate (scores, softmax, P V accumulation) is kept in
  `intermediate_dtype`; out is cast to `spec.dtype`, lse is float32.
  `sinks`: `[batch, heads_q]` (`modifiers.batch_sinks`) when `spec.sinks`;
  `segment_ids` (int32 `SegmentIds`) when `spec.segmented`; `flex_ops`
  (`flex.FlexOperands`) with `spec.flex`. `flex_fns`: the user's own
  (score_mod, mask_mod) to call instead of the closure-converted ones (the
  oracle's path, any intermediate dtype).
  """
  dt = jnp.dtype(intermediate_dtype)
  qg = group_heads(q.astype(dt), spec.heads_kv)
  s = jnp.einsum(
    "bqhgd,bkhd->bhgqk",
    qg,
    k.astype(dt),
    preferred_element_type=dt,
    precision=HIGHEST,
  )
  s = s * jnp.asarray(spec.softmax_scale, dt)
  if spec.softcap is not None:
    cap = jnp.asarray(spec.softcap, dt)
    s = cap * jnp.tanh(s / cap)
  # One rounding of the scaled scores for both the max and exp(s - max):
  # XLA would otherwise contract the scaling into the subtraction (an FMA)
  # in one fusion only, and at large logits (|s| ~ 1e10) exp of the max's
  # own argument becomes exp(+-1000): lse inf or -inf, out NaN.
  mask = masking.visible(spec, jnp.arange(spec.seq_q), jnp.arange(spec.seq_kv))
  if spec.flex is not None:
    s, fmask = _flex_scores(spec, flex_ops, flex_fns, s)
    if fmask is not None:
      mask = mask & fmask
  s = jax.lax.optimization_barrier(s)
  if segment_ids is not None:  # [b, sq, skv] -> [b, 1, 1, sq, skv]
    mask = mask & segments.visible_ids(*segment_ids)[:, None, None]
  s = jnp.where(mask, s, -jnp.inf)
  # The row max only stabilizes exp; it carries no gradient. Rows with no
  # visible key use 0 so that exp(-inf - 0) = 0 instead of NaN.
  m = jnp.max(s, axis=-1, keepdims=True)
  if sinks is not None:  # [b, hq] -> [b, hk, g, 1, 1], like m
    sk = sinks.astype(dt).reshape(m.shape[:3] + (1, 1))
    m = jnp.maximum(m, sk)
  m = jax.lax.stop_gradient(m)
  m = jnp.where(jnp.isfinite(m), m, jnp.zeros_like(m))
  e = jnp.exp(s - m)
  l = jnp.sum(e, axis=-1, keepdims=True)
  if sinks is not None:
    l = l + jnp.exp(sk - m)
  empty = l == 0
  l_safe = jnp.where(empty, jnp.ones_like(l), l)
  p = e / l_safe
  o = jnp.einsum(
    "bhgqk,bkhd->bqhgd",
    p,
    v.astype(dt),
    preferred_element_type=dt,
    precision=HIGHEST,
  )
  out = o.reshape(spec.out_shape).astype(spec.dtype)
  lse = (m + jnp.log(l_safe)).astype(jnp.float32)
  lse = jnp.where(empty, -jnp.inf, lse)[..., 0]
  return out, lse.reshape(spec.lse_shape)


def _score_mod_dtype(intermediate_dtype: Any) -> Any:
  """score_mod sees float32 scores (float64 in the golden), whatever the
  oracle's intermediate dtype."""
  if jnp.dtype(intermediate_dtype) == jnp.float64:
    return jnp.float64
  return jnp.float32


def _flex_scores(
  spec: AttentionSpec, ops: Any, fns: tuple | None, s: jax.Array
) -> tuple[jax.Array, jax.Array | None]:
  """The scores `[b, hk, g, sq, skv]` through bias and score_mod, and the
  mask of mask_mod / the block mask (None: no mask)."""
  fs = spec.flex
  b = jnp.arange(spec.batch)[:, None, None, None, None]
  h = flex.head_index(spec.heads_kv, spec.group_size)[None, :, :, None, None]
  q = jnp.arange(spec.seq_q)[:, None]
  kv = jnp.arange(spec.seq_kv)[None, :]
  score_mod, mask_mod = fs.score_mod, fs.mask_mod
  score_consts, mask_consts = ops.score_consts, ops.mask_consts
  if fns is not None:  # the user's functions themselves, closures included
    if score_mod is not None:
      score_mod = lambda consts, *a, f=fns[0]: f(*a)
    if mask_mod is not None:
      mask_mod = lambda consts, *a, f=fns[1]: f(*a)
  bias = flex.grouped(ops.bias, spec.heads_kv, spec.group_size)
  if bias is not None:
    s = s + bias.astype(s.dtype)
  if score_mod is not None:  # called on float32 (float64 golden) scores
    fspec = flex.FlexSpec(score_mod=score_mod)
    sd = _score_mod_dtype(s.dtype)
    s = flex.modify_scores(
      fspec, score_consts, None, s.astype(sd), b, h, q, kv
    ).astype(s.dtype)
  vis = flex.visible(
    ops.block_mask, mask_mod, mask_consts, b, h, q, kv, s.shape
  )
  return s, vis


def reference_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  causal: bool = False,
  softmax_scale: float | None = None,
  return_lse: bool = False,
  intermediate_dtype: Any = jnp.float32,
  window_size: Any = None,
  softcap: float | None = None,
  sinks: jax.Array | None = None,
  segment_ids: Any = None,
  score_mod: Any = None,
  mask_mod: Any = None,
  block_mask: Any = None,
  bias: Any = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Materialized baseline attention, differentiable by plain JAX autodiff
  (in q, k, v, sinks, the bias and whatever score_mod closes over; with
  `jax.enable_x64` and `intermediate_dtype=jnp.float64`, the flex
  options' float64 golden).

  Args:
    q: `[batch, seq_q, heads_q, head_dim]`, any head_dim (`flash_attention`
      takes at most `spec.MAX_HEAD_DIM`; decoding more: DeepSeek MLA's 576).
    k: `[batch, seq_kv, heads_kv, head_dim]`, `heads_q % heads_kv == 0`.
    v: `[batch, seq_kv, heads_kv, head_dim_v]`.
    causal: bottom-right aligned causal mask (see `pallas_fa3.masking`).
    softmax_scale: defaults to `1/sqrt(head_dim)`.
    return_lse: also return the float32 natural-log LSE `[batch, heads_q, seq_q]`.
    intermediate_dtype: dtype of every intermediate (scores, softmax, P V).
      float32 (default) is the oracle; the input dtype gives the naive
      low-precision baseline of the tolerance rule and the numerics study.
    window_size, softcap, sinks, segment_ids, score_mod, mask_mod,
      block_mask, bias: as in `pallas_fa3.flash_attention` (the functions
      are called as given, on scores of `intermediate_dtype`).

  Returns:
    out `[batch, seq_q, heads_q, head_dim_v]` in the input dtype, and the lse
    if `return_lse`.
  """
  spec, sinks, segment_ids, flex_ops = prepare(
    q,
    k,
    v,
    causal=causal,
    softmax_scale=softmax_scale,
    window_size=window_size,
    softcap=softcap,
    sinks=sinks,
    segment_ids=segment_ids,
    score_mod=score_mod,
    mask_mod=mask_mod,
    block_mask=block_mask,
    bias=bias,
    max_head_dim=None,  # the oracle: decoding goes past MAX_HEAD_DIM (MLA)
    score_dtype=_score_mod_dtype(intermediate_dtype),
  )
  if sinks is not None:
    sinks = modifiers.batch_sinks(sinks, spec.batch)
  fns = None
  if spec.flex is not None:
    fns = tuple(
      None if f is None else f.original
      for f in (spec.flex.score_mod, spec.flex.mask_mod)
    )
  out, lse = reference_forward(
    spec, q, k, v, intermediate_dtype, sinks, segment_ids, flex_ops, fns
  )
  return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------
# Float64 golden (numpy, independent of JAX's x64 flag and of JAX autodiff).


def _golden_parts(
  q: Any,
  k: Any,
  v: Any,
  causal: bool,
  softmax_scale: float | None,
  window_size: Any = None,
  softcap: float | None = None,
  sinks: Any = None,
  segment_ids: Any = None,
) -> tuple:
  spec = make_spec(
    q,
    k,
    v,
    causal=causal,
    softmax_scale=softmax_scale,
    window_size=window_size,
    softcap=softcap,
    max_head_dim=None,
  )
  f64 = lambda x: np.asarray(x).astype(np.float64)
  q64, k64, v64 = f64(q), f64(k), f64(v)
  qg = q64.reshape(
    spec.batch, spec.seq_q, spec.heads_kv, spec.group_size, spec.head_dim
  )
  s = np.einsum("bqhgd,bkhd->bhgqk", qg, k64) * spec.softmax_scale
  t = None  # tanh of the capped scores (their derivative is 1 - t^2)
  if spec.softcap is not None:
    t = np.tanh(s / spec.softcap)
    s = spec.softcap * t
  mask = np.asarray(
    masking.visible(spec, np.arange(spec.seq_q), np.arange(spec.seq_kv))
  )
  if segment_ids is not None:  # [b, sq, skv] -> [b, 1, 1, sq, skv]
    q_ids, kv_ids = (np.asarray(x) for x in segment_ids)
    mask = mask & (q_ids[:, :, None] == kv_ids[:, None, :])[:, None, None]
  s = np.where(mask, s, -np.inf)
  m = s.max(axis=-1, keepdims=True)
  sk = None
  if sinks is not None:  # [hq] -> [1, hk, g, 1, 1]
    sk = f64(sinks).reshape(1, spec.heads_kv, spec.group_size, 1, 1)
    m = np.maximum(m, sk)
  m = np.where(np.isfinite(m), m, 0.0)
  e = np.exp(s - m)
  l = e.sum(axis=-1, keepdims=True)
  if sk is not None:
    l = l + np.exp(sk - m)
  empty = l == 0
  p = e / np.where(empty, 1.0, l)
  with np.errstate(divide="ignore"):
    lse = np.where(empty, -np.inf, m + np.log(np.where(empty, 1.0, l)))
  return spec, qg, k64, v64, p, lse[..., 0], t, sk


def golden_attention(
  q: Any,
  k: Any,
  v: Any,
  *,
  causal: bool = False,
  softmax_scale: float | None = None,
  window_size: Any = None,
  softcap: float | None = None,
  sinks: Any = None,
  segment_ids: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
  """Float64 attention in numpy; returns (out, lse) as float64 numpy arrays.

  Same conventions as `reference_attention` (layout, bottom-right causal
  and windows, natural-log lse, -inf for rows that see no key, sinks,
  segment ids as a `(q_ids, kv_ids)` pair).
  """
  spec, _, _, v64, p, lse, _, _ = _golden_parts(
    q, k, v, causal, softmax_scale, window_size, softcap, sinks, segment_ids
  )
  o = np.einsum("bhgqk,bkhd->bqhgd", p, v64)
  return o.reshape(spec.out_shape), lse.reshape(spec.lse_shape)


def golden_attention_vjp(
  q: Any,
  k: Any,
  v: Any,
  dout: Any,
  dlse: Any = None,
  *,
  causal: bool = False,
  softmax_scale: float | None = None,
  window_size: Any = None,
  softcap: float | None = None,
  sinks: Any = None,
  segment_ids: Any = None,
) -> tuple[np.ndarray, ...]:
  """Float64 gradients (dq, dk, dv) of attention for cotangents (dout, dlse),
  and d/dsinks `[heads_q]` as a fourth when `sinks` is given.

  Analytic backward in numpy: dV = P^T dO, dP = dO V^T,
  dS = P * (dP - delta + dlse) with delta = rowsum(dO * O) (times
  `1 - tanh^2` with softcap), dQ = scale dS K, dK = scale dS^T Q; GQA
  gradients are summed over each query-head group. A sink is a key with no
  value: d/dsink = sum over rows of `p_sink * (dlse - delta)`.
  """
  spec, qg, k64, v64, p, lse, t, sk = _golden_parts(
    q, k, v, causal, softmax_scale, window_size, softcap, sinks, segment_ids
  )
  g = spec.group_size
  do = (
    np.asarray(dout)
    .astype(np.float64)
    .reshape(spec.batch, spec.seq_q, spec.heads_kv, g, spec.head_dim_v)
  )
  o = np.einsum("bhgqk,bkhd->bqhgd", p, v64)
  delta = np.einsum("bqhgd,bqhgd->bhgq", do, o)
  if dlse is not None:
    dl = (
      np.asarray(dlse)
      .astype(np.float64)
      .reshape(spec.batch, spec.heads_kv, g, spec.seq_q)
    )
    delta = delta - dl
  dv = np.einsum("bhgqk,bqhgd->bkhd", p, do)
  dp = np.einsum("bqhgd,bkhd->bhgqk", do, v64)
  ds = p * (dp - delta[..., None])
  if t is not None:
    ds = ds * (1.0 - t * t)
  dq = np.einsum("bhgqk,bkhd->bqhgd", ds, k64) * spec.softmax_scale
  dk = np.einsum("bhgqk,bqhgd->bkhd", ds, qg) * spec.softmax_scale
  grads = (dq.reshape(np.shape(q)), dk, dv)
  if sk is None:
    return grads
  p_sink = np.exp(sk[..., 0] - lse)  # [b, hk, g, q]
  dsinks = -(p_sink * delta).sum(axis=(0, 3)).reshape(spec.heads_q)
  return grads + (dsinks,)


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
  flex_ops: Any = None,
  starts: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """(out `[b, sq, hq, dv]` in q's dtype, lse `[b, hq, sq]` float32) for
  sequences of keys `[starts[b], lengths[b])` (the appended tokens already
  written; `starts` None: 0);
  an e4m3 cache is dequantized with `descale = (k_descale, v_descale)`;
  `v_cache` None with `spec.v_in_k`; `flex_ops` those of `spec.flex`
  (score_mod / mask_mod at sequence positions)."""
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
  start = jnp.zeros_like(lengths) if starts is None else starts
  keep = (pos[None, :] < lengths[:, None]) & (pos[None, :] >= start[:, None])
  keep = keep[:, :, None, None]
  v = jnp.where(keep, v, 0.0)  # 0 x NaN past the length would be NaN
  qg = q.astype(f32).reshape(b, sq, hk, g, spec.head_dim)
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, precision=HIGHEST)
  s = s * f32(spec.softmax_scale)
  if spec.softcap is not None:
    s = f32(spec.softcap) * jnp.tanh(s / f32(spec.softcap))
  s = jax.lax.optimization_barrier(s)  # one rounding: see py
  mask = visible_in_cache(
    spec,
    lengths[:, None, None],
    jnp.arange(sq)[None, :, None],
    pos[None, None, :],
    start[:, None, None],
  )[:, None, None]  # [b, 1, 1, sq, capacity]
  if spec.flex is not None:
    s, fmask = flex.decode_scores(
      spec, flex_ops, s, jnp.arange(b), lengths, pos
    )
    if fmask is not None:
      mask = mask & fmask
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
  o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v, precision=HIGHEST)
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
  starts: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
  """Float64 (out, lse) of every sequence: `flash_attention`'s golden on
  its logical keys `[starts[b], lengths[b])` (`starts` None: 0;
  bottom-right causal and windows, as in the decode semantics). A sequence of length 0 sees no key; `v_cache`
  None with `spec.v_in_k` (V: the K cache's columns). `rows`:
  `cache_batch_idx` (contiguous), `page_table` (paged); an e4m3 cache is
  dequantized with `descale = (k_descale, v_descale)` first (each
  `[b, hk]` or grouped per 128 columns)."""
  rows = cache_rows(spec, rows)
  k = np.asarray(gather(spec, jnp.asarray(k_cache), rows, page_table))
  if spec.v_in_k:  # v_cache None: V is K's first head_dim_v columns
    v = k[..., : spec.head_dim_v]
  else:
    v = np.asarray(gather(spec, jnp.asarray(v_cache), rows, page_table))
  if descale is not None:  # float32 inputs (the golden computes in float64)
    k, v = (
      np.asarray(dequantize(jnp.asarray(x), jnp.asarray(d, jnp.float32)))
      for x, d in zip((k, v), descale)
    )
    q = np.asarray(q, np.float32)
  outs, lses = [], []
  for i in range(spec.batch):
    n = int(lengths[i])
    first = 0 if starts is None else int(starts[i])
    qi = np.asarray(q[i : i + 1])
    if n <= first:
      out = np.zeros(qi.shape[:3] + (spec.head_dim_v,))
      lse = np.full((1, spec.heads_q, spec.seq_q), -np.inf)
      if sinks is not None:
        lse = lse * 0 + np.asarray(sinks, np.float64)[None, :, None]
    else:
      out, lse = golden_attention(
        qi,
        k[i : i + 1, first:n],
        v[i : i + 1, first:n],
        causal=spec.causal,
        softmax_scale=spec.softmax_scale,
        window_size=spec.window_size,
        softcap=spec.softcap,
        sinks=sinks,
      )
    outs.append(out)
    lses.append(lse)
  return np.concatenate(outs), np.concatenate(lses)
