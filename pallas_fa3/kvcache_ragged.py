"""Ragged batches of `flash_attention_with_kvcache` (continuous batching,
FA3's `cu_seqlens_q` / `max_seqlen_q` / `cu_seqlens_k_new`): sequence i has
its own number of new queries and new keys, packed `[total, heads, dim]`.
The call runs as the uniform decode call: each sequence's queries are
scattered into a left-padded `[n, max_seqlen_q, heads_q, d]` array (real
tokens last, so the bottom-right rule puts them at their positions), the new
keys are written into the cache per sequence and counted in its length, and
the real output rows are gathered back; padded rows never reach an output.
docs/decoding.md#ragged-batches-continuous-batching
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3 import cu_seqlens, kvcache, rotary
from pallas_fa3.spec import check_bool


def _concrete(*xs: Any) -> bool:
  return not any(isinstance(x, jax.core.Tracer) for x in xs)


def _check_packed(name: str, x: Any, total: int | None) -> None:
  if not (hasattr(x, "shape") and hasattr(x, "dtype")):
    raise TypeError(f"{name} must be an array; got {type(x).__name__}")
  shape = tuple(x.shape)
  if len(shape) != 3 or (total is not None and shape[0] != total):
    want = "[total_q, heads_q, head_dim]" if name == "q" else (
      f"[total_k_new, heads_kv, head_dim(_v)] with total_k_new = {total}"
    )  # fmt: skip
    raise ValueError(
      f"{name} must be {want} with cu_seqlens_q; got shape {shape}"
    )


def _check_batch(n: int, **arrays: Any) -> None:
  """Per-sequence arrays must have n leading entries (n = the sequences
  of `cu_seqlens_q`)."""
  for name, x in arrays.items():
    shape = tuple(np.shape(x))
    if x is None or shape == ():
      continue
    if shape[0] != n:
      raise ValueError(
        f"{name} has {shape[0]} sequences (shape {shape}) but cu_seqlens_q"
        f" has {n} (shape ({n + 1},))"
      )


def attend(
  uniform: Callable[..., Any],
  q: Any,
  k_cache: Any,
  v_cache: Any,
  k: Any,
  v: Any,
  *,
  cu_seqlens_q: Any,
  max_seqlen_q: Any,
  cu_seqlens_k_new: Any,
  cache_seqlens: Any,
  page_table: Any,
  cache_batch_idx: Any,
  return_lse: bool,
  head_dim_v: Any,
  rotary_cos: Any,
  **options: Any,
) -> Any:
  """`flash_attention_with_kvcache` with `cu_seqlens_q`: the ragged call
  written as `uniform` (the uniform call) on left-padded queries; same
  arguments and results, packed (out `[total_q, heads_q, dv]`, lse
  `[heads_q, total_q]`)."""
  if cu_seqlens_q is None:
    raise ValueError(
      "max_seqlen_q and cu_seqlens_k_new need cu_seqlens_q (the packed"
      f" layout); got cu_seqlens_q=None, max_seqlen_q={max_seqlen_q!r},"
      f" cu_seqlens_k_new={'None' if cu_seqlens_k_new is None else 'given'}"
    )
  _check_packed("q", q, None)
  total_q = int(q.shape[0])
  cu_q = cu_seqlens.check_index_array("cu_seqlens_q", cu_seqlens_q, None)
  n = cu_q.shape[0] - 1
  if n < 1:
    raise ValueError(
      "cu_seqlens_q must have shape [n + 1] with n >= 1 sequences (0, then"
      f" the cumulative lengths); got shape {tuple(cu_q.shape)}"
    )
  max_q = cu_seqlens.check_max_seqlen("max_seqlen_q", max_seqlen_q)
  max_q = total_q if max_q is None else max_q
  if k is None and (v is not None or cu_seqlens_k_new is not None):
    raise ValueError(
      "v and cu_seqlens_k_new need k (the new keys, packed"
      " [total_k_new, heads_kv, head_dim])"
    )
  cu_k_raw = cu_seqlens_q if cu_seqlens_k_new is None else cu_seqlens_k_new
  total_k = 0
  if k is not None:
    _check_packed("k", k, None)
    total_k = int(k.shape[0])
    if v is not None:
      _check_packed("v", v, total_k)
    name = "cu_seqlens_q" if cu_seqlens_k_new is None else "cu_seqlens_k_new"
    cu_k = cu_seqlens.check_index_array(name, cu_k_raw, n + 1)
  if _concrete(cu_seqlens_q):
    cu_seqlens.check_concrete("q", cu_seqlens_q, None, total_q, max_q)
  if k is not None and _concrete(cu_k_raw):
    if cu_seqlens_k_new is None and int(np.asarray(cu_k_raw)[-1]) > total_k:
      raise ValueError(
        f"k has {total_k} tokens (shape {tuple(k.shape)}) but cu_seqlens_q,"
        " its packing when cu_seqlens_k_new is not given, ends at"
        f" {int(np.asarray(cu_k_raw)[-1])}: pass cu_seqlens_k_new"
      )
    side = "q" if cu_seqlens_k_new is None else "k_new"
    cu_seqlens.check_concrete(side, cu_k_raw, None, total_k, None)
  _check_batch(
    n,
    cache_seqlens=cache_seqlens,
    page_table=page_table,
    cache_batch_idx=cache_batch_idx,
  )
  width = max(max_q, 1)  # the padded seq_q (the uniform call needs >= 1)
  new = np.zeros(n, np.int32)
  if k is not None:
    new = (
      np.diff(np.asarray(cu_k_raw)).astype(np.int32)
      if _concrete(cu_k_raw)
      else cu_k[1:] - cu_k[:-1]
    )
  if _concrete(cache_seqlens) and isinstance(new, np.ndarray):
    lengths = np.broadcast_to(np.asarray(cache_seqlens, np.int32), (n,)) + new
  else:
    lengths = jnp.broadcast_to(jnp.asarray(cache_seqlens, jnp.int32), (n,))
    lengths = lengths + new
  # The uniform call's checks, eagerly on the lengths with the new keys
  # (concrete ones are checked against the cache).
  spec_options = {
    name: options[name]
    for name in ("causal", "softmax_scale", "window_size", "softcap",
                 "num_splits", "cache_leftpad", "batch_invariant")
  }  # fmt: skip
  spec = kvcache.make_decode_spec(
    jax.ShapeDtypeStruct((n, width) + tuple(q.shape[1:]), q.dtype),
    k_cache,
    v_cache,
    cache_seqlens=lengths,
    page_table=page_table,
    cache_batch_idx=cache_batch_idx,
    head_dim_v=head_dim_v,
    sinks=options["sinks"] is not None,
    **spec_options,
  )
  rotary_sin = options.pop("rotary_sin")
  interleaved = check_bool(
    "rotary_interleaved", options.pop("rotary_interleaved")
  )
  if rotary.check_rotary(
    rotary_cos, rotary_sin, head_dim=spec.head_dim, capacity=spec.capacity
  ):
    if k is None or spec.v_in_k:
      raise ValueError(
        "rotary_cos / rotary_sin rotate q and the appended k at their"
        " positions: new tokens k and v (a v_cache) must be given with them"
      )
    options["rotary_tables"] = (rotary_cos, rotary_sin)
  if k is not None:
    if spec.fp8_cache and spec.v_in_k:
      raise NotImplementedError(
        "appending k to an e4m3 cache with v_cache=None and cu_seqlens_q"
        " (a ragged batch) is not supported: quantize it into the cache"
        " first (quantize_kv_cache) and pass the longer cache_seqlens"
      )
    if spec.fp8_cache:  # FA3's: new tokens / descale, rounded to e4m3
      options["quantize"] = (
        kvcache.check_descale("k_descale", options["k_descale"], True, n, spec.heads_kv, spec.head_dim),
        kvcache.check_descale("v_descale", options["v_descale"], True, n, spec.heads_kv, spec.head_dim_v),
        kvcache.rotation_signs(options["cache_rotation"], spec.head_dim),
      )  # fmt: skip
    if spec.v_in_k and v is not None:
      raise ValueError("v must be None when v_cache is None (k holds V)")
    if not spec.v_in_k and v is None:
      raise ValueError("k and v must be given together")
  arrays = {
    n_: x
    for n_, x in options.items()
    if hasattr(x, "shape") or n_ in ("rotary_tables", "quantize")
  }
  static = tuple(
    sorted((n_, x) for n_, x in options.items() if n_ not in arrays)
  )
  static += (("head_dim_v", head_dim_v),)
  meta = (uniform, static, spec, n, width, max_q, return_lse, interleaved)
  operands = (
    q, k_cache, v_cache, k, v, cu_q, cu_q if k is None else cu_k,
    jnp.asarray(lengths), jnp.asarray(new), page_table, cache_batch_idx,
    arrays,
  )  # fmt: skip
  try:
    hash(meta)
  except TypeError:  # an unhashable option (a block mask): op by op
    return _device(meta, *operands)
  return _device_jit(meta, *operands)


def _device(
  meta: tuple, q, k_cache, v_cache, k, v, cu_q, cu_k, lengths, new,
  page_table, cache_batch_idx, arrays,
) -> Any:  # fmt: skip
  """The ragged call on the device (traceable): pad the queries, append
  the new keys, run the uniform call, gather the real rows."""
  uniform, static, spec, n, width, max_q, return_lse, interleaved = meta
  total_q = int(q.shape[0])
  p = cu_seqlens.packing(
    cu_q,
    cu_k,
    total_q,
    total_q if k is None else int(k.shape[0]),
    max_seqlen_q=max_q,
  )
  arrays = dict(arrays)
  tables = arrays.pop("rotary_tables", None)
  if tables is not None:  # FA3's positions: cache_seqlens[s] + i
    start = lengths - new
    per_token = spec.causal or spec.window_size is not None
    rope = lambda x, seq, pos: rotary.apply_rotary(
      x[None], *tables, jnp.clip(start[seq] + pos, 0)[None],
      interleaved=interleaved,
    )[0]  # fmt: skip
    q = rope(q, p.seq_q, p.pos_q if per_token else 0)
    k = rope(k, p.seq_k, p.pos_k)
  # Query t of sequence s sits at row width - 1 - (tokens after it): the
  # real queries last, where the bottom-right rule places them.
  row_q = width - 1 - p.after_q
  seq_q = jnp.where(p.valid_q, p.seq_q, n)  # n: dropped by the scatter
  q_pad = jnp.zeros((n, width) + tuple(q.shape[1:]), q.dtype)
  q_pad = q_pad.at[seq_q, row_q].set(jnp.asarray(q), mode="drop")
  quantize = arrays.pop("quantize", None)
  if k is not None:
    if quantize is not None:
      k_descale, v_descale, signs = quantize
      k = kvcache.rotate(k, signs)
      k = kvcache.quantize_tokens(k[:, None], k_descale[p.seq_k])[:, 0]
      v = kvcache.quantize_tokens(v[:, None], v_descale[p.seq_k])[:, 0]
    k_cache, v_cache = _append(
      spec, p, k_cache, v_cache, k, v, lengths, new, page_table,
      cache_batch_idx,
    )  # fmt: skip
  out, lse = uniform(
    q_pad,
    k_cache,
    v_cache,
    cache_seqlens=lengths,
    page_table=page_table,
    cache_batch_idx=cache_batch_idx,
    return_lse=True,
    **dict(static),
    **arrays,
  )
  # Real rows back in the packed order; unused tokens 0 (lse -inf), an
  # invalid traced packing NaN everywhere.
  seq, row = jnp.where(p.valid_q, p.seq_q, 0), jnp.where(p.valid_q, row_q, 0)
  poison = jnp.where(p.bad, jnp.nan, 1.0)
  out = jnp.where(p.valid_q[:, None, None], out[seq, row], 0)
  out = out * poison.astype(out.dtype)
  lse = jnp.where(p.valid_q[None], lse[seq, :, row].T, -jnp.inf) * poison
  result = (out, lse) if return_lse else (out,)
  if k is not None:
    result += (k_cache,) if spec.v_in_k else (k_cache, v_cache)
  return result[0] if len(result) == 1 else result


# Jitted per static options and shapes: an eager call compiles once.
_device_jit = jax.jit(_device, static_argnums=0)


def _append(
  spec: kvcache.DecodeSpec,
  p: cu_seqlens.Packing,
  k_cache: Any,
  v_cache: Any,
  k: Any,
  v: Any,
  lengths: Any,
  new: Any,
  page_table: Any,
  cache_batch_idx: Any,
) -> tuple[Any, Any]:
  """The caches with new token t (of sequence s, packed) written at
  `cache_seqlens[s] + its position`; a sequence whose tokens overflow the
  cache (or whose length is negative) writes none of them."""
  lengths = jnp.asarray(lengths)
  start = lengths - jnp.asarray(new)
  overflow = (start < 0) | (lengths > spec.capacity)
  keep = p.valid_k & ~overflow[p.seq_k] & ~p.bad
  positions = jnp.where(keep, start[p.seq_k] + p.pos_k, spec.capacity)
  rows = kvcache.cache_rows(spec, cache_batch_idx)
  where, slot = kvcache.token_slots(
    spec, positions, rows, page_table, seq=p.seq_k
  )
  k_cache = k_cache.at[where, slot].set(
    jnp.asarray(k).astype(k_cache.dtype), mode="drop"
  )
  if not spec.v_in_k:
    v_cache = v_cache.at[where, slot].set(
      jnp.asarray(v).astype(v_cache.dtype), mode="drop"
    )
  return k_cache, v_cache
