"""Attention over a KV cache: `flash_attention_with_kvcache`, the decode entry
point (validate -> spec -> append -> backend -> split-KV merge).

Example:
  >>> import jax, jax.numpy as jnp, pallas_fa3
  >>> q = jax.random.normal(jax.random.key(0), (2, 1, 8, 64), "bfloat16")
  >>> k_cache = jnp.zeros((2, 256, 2, 64), "bfloat16")
  >>> v_cache = jnp.zeros((2, 256, 2, 64), "bfloat16")
  >>> k = jax.random.normal(jax.random.key(1), (2, 1, 2, 64), "bfloat16")
  >>> out, k_cache, v_cache = pallas_fa3.flash_attention_with_kvcache(
  ...     q, k_cache, v_cache, k, k, cache_seqlens=jnp.array([5, 9]),
  ...     causal=True)
  >>> out.shape, k_cache.shape
  ((2, 1, 8, 64), (2, 256, 2, 64))

DeepSeek MLA (FlashMLA's layout): one cache, V its first 512 columns.
  >>> q = jnp.zeros((2, 1, 16, 576), "bfloat16")
  >>> kv = jnp.zeros((2, 64, 1, 576), "bfloat16")
  >>> out, kv = pallas_fa3.flash_attention_with_kvcache(
  ...     q, kv, None, kv[:, :1], cache_seqlens=5, head_dim_v=512)
  >>> out.shape
  (2, 1, 16, 512)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NoReturn

import jax
import jax.numpy as jnp

from pallas_fa3 import kvcache_fp8, modifiers
from pallas_fa3.backends.decode import DecodeBackend, resolve_decode
from pallas_fa3.kvcache_cache import append, cache_rows, invalid_sequences
from pallas_fa3.kvcache_spec import DecodeSpec, make_decode_spec
from pallas_fa3.spec import check_bool

NO_DECODE_GRADIENT = (
  "flash_attention_with_kvcache is forward only (decoding): it has no"
  " gradient. Differentiate pallas_fa3.flash_attention instead, or wrap"
  " the call in jax.lax.stop_gradient"
)


@dataclasses.dataclass(frozen=True)
class _Call:
  spec: DecodeSpec
  backend: DecodeBackend
  config: Any
  splits: int


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(
  call: _Call, q, k_cache, v_cache, lengths, rows, pages, sinks, descale
):  # fmt: skip
  return call.backend.run(
    call.spec,
    call.config,
    call.splits,
    q,
    k_cache,
    v_cache,
    lengths,
    rows,
    pages,
    sinks,
    descale,
  )


def _attend_fwd(call: _Call, *args):
  return _attend(call, *args), None


def _attend_bwd(call: _Call, residuals: None, cotangents: Any) -> NoReturn:
  raise NotImplementedError(NO_DECODE_GRADIENT)


_attend.defvjp(_attend_fwd, _attend_bwd)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _decode(
  call: _Call, return_lse: bool, q, k_cache, v_cache, k, v, seqlens, pages,
  batch_idx, sinks, descale, signs,
):  # fmt: skip
  spec = call.spec
  rows = cache_rows(spec, batch_idx)
  if signs is not None:  # the cache holds K M: the scores need q M
    q = kvcache_fp8.rotate(q, signs).astype(q.dtype)
  if k is not None:  # one scatter each: in place when the caches are donated
    if spec.fp8_cache:
      k = kvcache_fp8.quantize_tokens(kvcache_fp8.rotate(k, signs), descale[0])
      if v is not None:
        v = kvcache_fp8.quantize_tokens(v, descale[1])
    k_cache = append(spec, k_cache, k, seqlens, rows, pages)
    if not spec.v_in_k:  # (else V is k_cache's columns: written with K)
      v_cache = append(spec, v_cache, v, seqlens, rows, pages)
  lengths = seqlens + spec.seq_new
  if sinks is not None:
    sinks = modifiers.batch_sinks(sinks, spec.batch)
  out, lse = _attend(
    call, q, k_cache, v_cache, lengths, rows, pages, sinks, descale
  )
  # A traced length past the cache (or negative), or a traced page or row
  # index that is not the cache's, cannot raise: its sequence's rows are
  # NaN, never a silently wrong result.
  bad = (seqlens < 0) | (lengths > spec.capacity)
  bad |= invalid_sequences(spec, lengths, rows, pages)
  out = jnp.where(bad[:, None, None, None], jnp.nan, out)
  lse = jnp.where(bad[:, None, None], jnp.nan, lse)
  result = (out, lse) if return_lse else (out,)
  if k is not None:
    result += (k_cache,) if spec.v_in_k else (k_cache, v_cache)
  return result[0] if len(result) == 1 else result


def _descales(spec: DecodeSpec, k_descale: Any, v_descale: Any) -> Any:
  """(k_descale, v_descale) as float32 `[b, hk]` for an e4m3 cache (with
  v_cache=None, k_descale twice), None for a 16-bit one."""
  if spec.v_in_k and v_descale is not None:
    raise ValueError(
      "v_descale must be None when v_cache is None: V is the K cache's"
      " first head_dim_v columns and is dequantized by k_descale"
    )
  names = ("k_descale", "v_descale")
  pair = (k_descale, k_descale if spec.v_in_k else v_descale)
  descale = tuple(
    kvcache_fp8.check_descale(
      name, x, spec.fp8_cache, spec.batch, spec.heads_kv
    )
    for name, x in zip(names, pair)
  )
  return descale if spec.fp8_cache else None


def flash_attention_with_kvcache(
  q: jax.Array,
  k_cache: jax.Array,
  v_cache: jax.Array | None,
  k: jax.Array | None = None,
  v: jax.Array | None = None,
  *,
  cache_seqlens: Any,
  page_table: jax.Array | None = None,
  cache_batch_idx: jax.Array | None = None,
  causal: bool = False,
  softmax_scale: float | None = None,
  window_size: tuple[int | None, int | None] | None = None,
  softcap: float | None = None,
  sinks: jax.Array | None = None,
  num_splits: int | None = None,
  return_lse: bool = False,
  implementation: str | None = None,
  config: Any = None,
  k_descale: Any = None,
  v_descale: Any = None,
  cache_rotation: Any = None,
  head_dim_v: int | None = None,
) -> Any:
  """Attention of new queries over each sequence's cached keys (decoding).

  Sequence b has `L_b = cache_seqlens[b] + seq_new` keys; its query i sits
  at position `L_b - seq_q + i` and sees the keys `causal`, `window_size`,
  `softcap` and `sinks` allow, exactly as `flash_attention` with
  `seq_kv = L_b` (bottom-right alignment). A row that sees no key gives 0
  and lse -inf (the sink with sinks). The cache past each sequence's length
  is garbage (any value, NaN included): none of it reaches the output.

  Args:
    q: `[batch, seq_q, heads_q, head_dim]` (seq_q 1 for plain decoding;
      more for speculative decoding or a prefill chunk).
    k_cache: contiguous `[batch_cache, cache_len, heads_kv, head_dim]`, or
      paged `[num_pages, page_size, heads_kv, head_dim]` with `page_table`.
    v_cache: the same with `head_dim_v`; or None (DeepSeek MLA's layout,
      FlashMLA's): V is the first `head_dim_v` columns of k_cache, read in
      place (no copy), and `head_dim_v` is required.
    k, v: optional new tokens `[batch, seq_new, heads_kv, head_dim(_v)]`,
      written at positions `cache_seqlens[b] ..` of each sequence and
      attended to; the updated caches are returned. With `v_cache=None`
      pass k only (v None): its first `head_dim_v` columns are the values.
    cache_seqlens: a Python int or int32 `[batch]`: tokens already cached
      (traced: one compilation serves every length).
    page_table: int32 `[batch, pages_per_seq]`: token t of sequence b is
      slot `t % page_size` of page `page_table[b, t // page_size]`.
    cache_batch_idx: int32 `[batch]` (contiguous only): each sequence's
      cache row (default: b).
    causal, softmax_scale, window_size, softcap, sinks: as in
      `pallas_fa3.flash_attention`.
    num_splits: split-KV ranges per sequence (flash-decoding; None: the
      backend chooses). Every value computes the same function.
    return_lse: also return the natural-log lse `[batch, heads_q, seq_q]`.
    implementation: None (automatic: `mosaic` on a Hopper GPU when it
      serves the call, else `blockwise`), "mosaic", "interpret",
      "blockwise" or "reference".
    config: `pallas_fa3.Sm90DecodeConfig` (mosaic, interpret) or
      `pallas_fa3.BlockwiseConfig` (blockwise: its `block_kv`).
    k_descale, v_descale: an e4m3 cache's (`float8_e4m3fn`) float32
      descales `[batch, heads_kv]` (or scalars; default 1): attention runs
      over `k_cache * k_descale`, `v_cache * v_descale`, and appended k/v
      are divided by them, saturated at 448 and rounded into the cache
      (FA3's convention; `pallas_fa3.quantize_kv_cache` makes them). With
      `v_cache=None`, V is dequantized by `k_descale` (v_descale None).
    cache_rotation: None, or the `rotation=` the cache was quantized with
      (`quantize_kv_cache`): q and appended k are rotated to match (not
      with `v_cache=None`: V would be rotated too).
    head_dim_v: with `v_cache=None`, V's columns (<= head_dim; 512 for
      DeepSeek MLA's 576); with a v_cache, None or its last dim.

  Returns:
    out `[batch, seq_q, heads_q, head_dim_v]` in q's dtype; `(out, lse)`
    with `return_lse`; with k/v, the updated caches after them: `(out,
    k_cache, v_cache)` or `(out, lse, k_cache, v_cache)`; with
    `v_cache=None` the one cache: `(out[, lse], k_cache)`. Under `jax.jit`
    with the caches donated, they are updated in place. A sequence whose
    traced length is negative or overflows the cache, or whose traced
    `page_table` entries (for its tokens) or `cache_batch_idx` entry name
    no page or row of the cache, gets NaN rows (and its new tokens are not
    written).

  Raises:
    TypeError / ValueError naming the argument (a concrete `page_table`
    or `cache_batch_idx` entry out of range: naming the entry and the
    bound); NotImplementedError for a
    valid call the requested backend does not serve, and for `jax.grad`
    (forward only).
  """
  spec = make_decode_spec(
    q,
    k_cache,
    v_cache,
    k,
    v,
    cache_seqlens=cache_seqlens,
    page_table=page_table,
    cache_batch_idx=cache_batch_idx,
    causal=causal,
    softmax_scale=softmax_scale,
    window_size=window_size,
    softcap=softcap,
    sinks=sinks is not None,
    num_splits=num_splits,
    head_dim_v=head_dim_v,
  )
  sinks = modifiers.check_sinks(sinks, spec.heads_q)
  descale = _descales(spec, k_descale, v_descale)
  if cache_rotation is not None and not spec.fp8_cache:
    raise ValueError(
      "cache_rotation applies to an e4m3 cache (quantize_kv_cache's"
      f" rotation=); this cache is {spec.cache_dtype}: pass None"
    )
  if cache_rotation is not None and spec.v_in_k:
    raise ValueError(
      "cache_rotation cannot be combined with v_cache=None: V is the K"
      " cache's columns, and a rotated K cache holds rotated values"
    )
  signs = kvcache_fp8.rotation_signs(cache_rotation, spec.head_dim)
  return_lse = check_bool("return_lse", return_lse)
  backend, config, splits = resolve_decode(spec, implementation, config)
  arrays = (q, k_cache, v_cache, k, v, cache_seqlens, page_table)
  if not any(isinstance(a, jax.core.Tracer) for a in arrays):
    reason = backend.device_reason()
    if reason:
      hint = f". {backend.device_hint}" if backend.device_hint else ""
      raise NotImplementedError(
        f"implementation={backend.name!r} cannot run here: {reason}{hint}"
      )
  seqlens = jnp.broadcast_to(
    jnp.asarray(cache_seqlens, jnp.int32), (spec.batch,)
  )
  return _decode(
    _Call(spec, backend, config, splits),
    return_lse,
    jnp.asarray(q),
    k_cache,
    v_cache,
    k,
    v,
    seqlens,
    page_table,
    cache_batch_idx,
    sinks,
    descale,
    signs,
  )
