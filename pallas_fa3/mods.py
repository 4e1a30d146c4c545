"""Ready-made `mask_mod` and `score_mod` functions for
`flash_attention(mask_mod=, score_mod=)` and `create_block_mask`: causal
(bottom-right and top-left), sliding windows, document masks from segment
ids, prefix-LM, chunked attention (Llama 4's, FA3's `attention_chunk`),
softcap, ALiBi (FA2's convention), relative-position bias tables (clipped,
and T5's log buckets), and
`and_masks` / `or_masks` to combine masks. Each is a plain JAX function of
scalars (the factories return one): docs/flex.md#ready-made-functions.

Example:
  >>> import jax, jax.numpy as jnp, pallas_fa3
  >>> from pallas_fa3 import mods
  >>> q = jax.random.normal(jax.random.key(0), (1, 256, 4, 64))
  >>> mask = mods.and_masks(mods.causal_top_left, mods.sliding_window(64))
  >>> bm = pallas_fa3.create_block_mask(mask, None, None, 256, 256)
  >>> out = pallas_fa3.flash_attention(
  ...     q, q, q, block_mask=bm, score_mod=mods.alibi(mods.alibi_slopes(4)))
  >>> out.shape
  (1, 256, 4, 64)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3.spec import check_int

MaskMod = Callable[[Any, Any, Any, Any], Any]
ScoreMod = Callable[[Any, Any, Any, Any, Any], Any]


def causal_top_left(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
  """Query i sees keys j <= i (jax.nn's and PyTorch's `is_causal`)."""
  del b, h
  return kv_idx <= q_idx


def causal_bottom_right(seq_q: int, seq_kv: int) -> MaskMod:
  """Query i sees keys j <= i + seq_kv - seq_q (FA2/FA3's and
  `flash_attention(causal=True)`'s alignment)."""
  offset = check_int("seq_kv", seq_kv, minimum=1) - check_int(
    "seq_q", seq_q, minimum=1
  )

  def causal(b, h, q_idx, kv_idx):
    del b, h
    return kv_idx <= q_idx + offset

  return causal


def sliding_window(left: int, right: int = 0, *, offset: int = 0) -> MaskMod:
  """Keys within `left` before and `right` after the query's diagonal
  position `q_idx + offset` (offset seq_kv - seq_q: bottom-right, as
  `flash_attention(window_size=)`; 0: top-left)."""
  left = check_int("left", left, minimum=0)
  right = check_int("right", right, minimum=0)
  offset = check_int("offset", offset)

  def window(b, h, q_idx, kv_idx):
    del b, h
    p = q_idx + offset
    return (kv_idx >= p - left) & (kv_idx <= p + right)

  return window


def document_mask(segment_ids: Any, kv_segment_ids: Any = None) -> MaskMod:
  """Query i sees key j only in the same document: int `[batch, seq_q]`
  ids (and `[batch, seq_kv]` for the keys; default the same)."""
  q_ids = jnp.asarray(segment_ids)
  kv_ids = q_ids if kv_segment_ids is None else jnp.asarray(kv_segment_ids)
  for name, ids in (("segment_ids", q_ids), ("kv_segment_ids", kv_ids)):
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
      raise TypeError(
        f"document_mask: {name} must be an int [batch, seq] array; got"
        f" shape {tuple(ids.shape)}, dtype {ids.dtype}"
      )

  def document(b, h, q_idx, kv_idx):
    del h
    return q_ids[b, q_idx] == kv_ids[b, kv_idx]

  return document


def prefix_lm(prefix_lengths: Any) -> MaskMod:
  """Prefix-LM: every query sees the first `prefix_lengths` keys (an int,
  or int `[batch]`) and, past them, keys j <= i (top-left causal)."""
  lengths = jnp.asarray(prefix_lengths, jnp.int32)
  if lengths.ndim > 1:
    raise TypeError(
      "prefix_lm: prefix_lengths must be an int or an int [batch] array;"
      f" got shape {tuple(lengths.shape)}"
    )

  def prefix(b, h, q_idx, kv_idx):
    del h
    n = lengths if lengths.ndim == 0 else lengths[b]
    return (kv_idx <= q_idx) | (kv_idx < n)

  return prefix


def chunked(
  chunk_size: int, *, causal: bool = True, offset: int = 0
) -> MaskMod:
  """Chunked attention (Llama 4; FA3's `attention_chunk`): query i sees
  keys of its own chunk of `chunk_size` positions (at position
  `i + offset`), and with `causal` only those not after it."""
  chunk = check_int("chunk_size", chunk_size, minimum=1)
  offset = check_int("offset", offset)

  def chunk_mask(b, h, q_idx, kv_idx):
    del b, h
    p = q_idx + offset
    start = (p // chunk) * chunk  # (as bounds: compares the kernels fold)
    inside = (kv_idx >= start) & (kv_idx < start + chunk)
    return inside & (kv_idx <= p) if causal else inside

  return chunk_mask


def and_masks(*mask_mods: MaskMod) -> MaskMod:
  """Pairs every mask lets through."""

  def both(b, h, q_idx, kv_idx):
    out = jnp.bool_(True)
    for m in mask_mods:
      out = out & m(b, h, q_idx, kv_idx)
    return out

  return both


def or_masks(*mask_mods: MaskMod) -> MaskMod:
  """Pairs any mask lets through."""

  def either(b, h, q_idx, kv_idx):
    out = jnp.bool_(False)
    for m in mask_mods:
      out = out | m(b, h, q_idx, kv_idx)
    return out

  return either


def softcap(cap: float) -> ScoreMod:
  """`cap * tanh(score / cap)` (Gemma 2's logit softcap) as a score_mod;
  `flash_attention(softcap=)` is the built-in form."""
  if not (isinstance(cap, (int, float)) and cap > 0):
    raise ValueError(f"softcap: cap must be a positive number; got {cap!r}")
  c = float(cap)

  def capped(score, b, h, q_idx, kv_idx):
    del b, h, q_idx, kv_idx
    return (c * jnp.tanh(score / c)).astype(score.dtype)

  return capped


def alibi_slopes(num_heads: int) -> jax.Array:
  """ALiBi's geometric slopes `2^(-8 i / n)` (Press et al.; the
  interleaving for head counts that are not a power of two)."""
  n = check_int("num_heads", num_heads, minimum=1)

  def powers(m):
    start = 2.0 ** (-8.0 / m)
    return [start ** (i + 1) for i in range(m)]

  p = 2 ** int(np.floor(np.log2(n)))
  slopes = powers(p)
  if p < n:
    slopes += powers(2 * p)[0::2][: n - p]
  return jnp.asarray(slopes, jnp.float32)


def alibi(slopes: Any, *, offset: int = 0) -> ScoreMod:
  """ALiBi as FA2 adds it: `score - slope[head] * |q_idx + offset - kv_idx|`
  with float32 slopes `[heads_q]` or `[batch, heads_q]` (offset seq_kv -
  seq_q: FA2's bottom-right alignment). Differentiable in the slopes."""
  slopes = jnp.asarray(slopes)
  if slopes.ndim not in (1, 2):
    raise TypeError(
      "alibi: slopes must be [heads_q] or [batch, heads_q]; got shape"
      f" {tuple(slopes.shape)}"
    )
  offset = check_int("offset", offset)

  def biased(score, b, h, q_idx, kv_idx):
    slope = slopes[h] if slopes.ndim == 1 else slopes[b, h]
    distance = jnp.abs(q_idx + offset - kv_idx).astype(score.dtype)
    return score - slope.astype(score.dtype) * distance

  return biased


def relative_position_bias(table: Any, max_distance: int) -> ScoreMod:
  """T5-style learned bias: `score + table[head, clip(kv_idx - q_idx,
  -max_distance, max_distance) + max_distance]`, table `[heads_q, 2 *
  max_distance + 1]` (differentiable)."""
  table = jnp.asarray(table)
  md = check_int("max_distance", max_distance, minimum=0)
  if table.ndim != 2 or table.shape[1] != 2 * md + 1:
    raise ValueError(
      "relative_position_bias: table must have shape [heads_q,"
      f" {2 * md + 1}] (2 * max_distance + 1); got {tuple(table.shape)}"
    )

  def relative(score, b, h, q_idx, kv_idx):
    del b
    d = jnp.clip(kv_idx - q_idx, -md, md) + md
    return score + table[h, d].astype(score.dtype)

  return relative


def t5_relative_position_bias(
  table: Any, *, bidirectional: bool = True, max_distance: int = 128
) -> ScoreMod:
  """T5's bucketed relative-position bias: `score + table[head,
  bucket(kv_idx - q_idx)]`, table `[heads_q, num_buckets]`
  (differentiable). Of the buckets (per direction when `bidirectional`,
  the later keys' half after the earlier's), the first half holds exact
  distances and the rest distances growing logarithmically up to
  `max_distance`, the last bucket everything past it (T5 /
  mesh-tensorflow's `relative_position_bucket`). Without `bidirectional`
  later keys share bucket 0 (a decoder's are masked anyway)."""
  table = jnp.asarray(table)
  if table.ndim != 2 or table.shape[1] < (4 if bidirectional else 2):
    raise ValueError(
      "t5_relative_position_bias: table must be [heads_q, num_buckets] with"
      f" num_buckets >= {4 if bidirectional else 2}; got shape"
      f" {tuple(table.shape)}"
    )
  buckets = table.shape[1] // 2 if bidirectional else table.shape[1]
  exact = buckets // 2
  md = check_int("max_distance", max_distance, minimum=exact + 1)
  ratio = float((buckets - exact) / np.log(md / exact))

  def t5(score, b, h, q_idx, kv_idx):
    del b
    rel = kv_idx - q_idx
    first = jnp.int32(0)
    if bidirectional:
      first = jnp.where(rel > 0, buckets, 0)
      distance = jnp.abs(rel)
    else:
      distance = jnp.maximum(-rel, 0)
    far = jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / exact)
    large = jnp.minimum(exact + (far * ratio).astype(jnp.int32), buckets - 1)
    bucket = first + jnp.where(distance < exact, distance, large)
    return score + table[h, bucket].astype(score.dtype)

  return t5
