"""Decoding in the native layers, once for both
`FlashMultiHeadAttention(decode=True)` (nnx) and
`FlashMultiHeadDotProductAttention(decode=True)` (linen), which hold the
state: the KV cache (`DecodeState`: K and V per kv head after RoPE, and each
sequence's length), the checks of a call, and what a prefill
(`flash_attention` from position 0) or a decode step (a chunk appended at
each sequence's length and attended by `flash_attention_with_kvcache`;
ragged with `chunk_lengths`, or packed `[total, features]` with
`cu_seqlens`: a continuous batch, through the ragged kvcache call) does
with it:
docs/flax.md#decoding-with-the-native-layers.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3 import cu_seqlens as packed_offsets
from pallas_fa3.attention import flash_attention, flash_attention_with_kvcache
from pallas_fa3.flax import attend, rope as rope_lib


class DecodeState(NamedTuple):
  """A layer's cache: `key`, `value` `[batch..., max_length, heads_kv,
  head_dim]` and `lengths` int32 `[batch...]` (tokens cached per sequence)."""

  key: jax.Array
  value: jax.Array
  lengths: jax.Array


def empty_state(
  input_shape: Any, heads_kv: int, head_dim: int, dtype: Any
) -> DecodeState:
  """An empty cache for inputs `[batch..., max_length, features]`.

  Raises:
    ValueError: `input_shape` has no length axis, or an empty one.
  """
  shape = tuple(int(s) for s in input_shape)
  if len(shape) < 2 or min(shape[:-1], default=0) < 1:
    raise ValueError(
      "init_cache takes input_shape [batch..., max_length, features] with"
      f" a positive max_length and batch; got {shape}"
    )
  kv_shape = shape[:-1] + (heads_kv, head_dim)
  return DecodeState(
    jnp.zeros(kv_shape, dtype),
    jnp.zeros(kv_shape, dtype),
    jnp.zeros(shape[:-2], jnp.int32),
  )


def check_call_options(
  decode: bool,
  *,
  inputs_k: Any,
  inputs_v: Any,
  positions: Any,
  segment_ids: Any,
  prefill: Any,
  chunk_lengths: Any,
  cu_seqlens: Any = None,
) -> bool:
  """Checks a layer call's options against its mode; returns `prefill`.

  Raises:
    TypeError: `prefill` is not a bool.
    ValueError: naming the option the mode does not take.
  """
  if not isinstance(prefill, bool):
    raise TypeError(f"prefill must be a bool; got {prefill!r}")
  if cu_seqlens is not None and (prefill or chunk_lengths is not None):
    raise ValueError(
      "cu_seqlens (packed chunks appended per sequence) takes no prefill or"
      " chunk_lengths: each sequence's chunk is its cu_seqlens range"
    )
  if not decode:
    for name, given in (
      ("prefill", prefill),
      ("chunk_lengths", chunk_lengths is not None),
      ("cu_seqlens", cu_seqlens is not None),
    ):
      if given:
        raise ValueError(
          f"{name} is a decode option; the call is not in decode mode"
          " (decode=True on the layer or the call)"
        )
    return prefill
  for name, given in (
    ("inputs_k", inputs_k),
    ("inputs_v", inputs_v),
    ("positions", positions),
    ("segment_ids", segment_ids),
  ):
    if given is not None:
      raise ValueError(
        f"decode mode takes no {name}: it is causal self-attention over"
        " the cache, with positions from each sequence's cached length"
      )
  return prefill


def _check_call(
  query: jax.Array,
  key: jax.Array,
  state: DecodeState,
  chunk_lengths: Any,
  causal: bool,
) -> jax.Array | None:
  """Checks a decode call against its cache; returns `chunk_lengths` as an
  int32 array (None: the whole chunk)."""
  batch, chunk = tuple(query.shape[:-3]), query.shape[-3]
  max_length = state.key.shape[-3]
  if tuple(state.key.shape[:-3]) != batch or (
    tuple(state.key.shape[-2:]) != tuple(key.shape[-2:])
  ):
    raise ValueError(
      f"decode: the cache holds {tuple(state.key.shape)} = [batch...,"
      " max_length, heads_kv, head_dim], which does not fit this call's"
      f" keys {tuple(key.shape)} = [batch..., chunk, heads_kv, head_dim];"
      " call init_cache with [batch..., max_length, features]"
    )
  if jnp.dtype(query.dtype) != jnp.dtype(state.key.dtype):
    raise TypeError(
      f"decode: the cache is {jnp.dtype(state.key.dtype)} but the layer"
      f" computes in {jnp.dtype(query.dtype)}; call init_cache(shape,"
      f" dtype={jnp.dtype(query.dtype).name})"
    )
  if chunk > max_length:
    raise ValueError(
      f"decode: a chunk of {chunk} tokens overflows the cache of"
      f" max_length {max_length} (init_cache)"
    )
  if chunk_lengths is None:
    return None
  if not causal:
    raise ValueError(
      "chunk_lengths (a ragged chunk, padded on the right) needs a causal"
      " layer: without the causal mask the chunk's queries see its padding"
    )
  if not jnp.issubdtype(jnp.asarray(chunk_lengths).dtype, jnp.integer):
    raise TypeError("chunk_lengths must be integers (int32 [batch...])")
  if tuple(jnp.shape(chunk_lengths)) != batch:
    raise ValueError(
      f"chunk_lengths must have shape [batch...] = {batch}; got"
      f" {tuple(jnp.shape(chunk_lengths))}"
    )
  if not isinstance(chunk_lengths, jax.core.Tracer):
    values = np.asarray(chunk_lengths)
    if values.size and (values.min() < 0 or values.max() > chunk):
      raise ValueError(
        f"chunk_lengths must be in [0, chunk = {chunk}]; got {values.tolist()}"
      )
  return jnp.asarray(chunk_lengths, jnp.int32)


def _check_room(lengths: jax.Array, chunk: int, max_length: int) -> None:
  """Raises when concrete lengths leave no room for the chunk."""
  if isinstance(lengths, jax.core.Tracer):
    return  # flash_attention_with_kvcache poisons the sequence instead
  longest = int(np.max(np.asarray(lengths), initial=0))
  if longest + chunk > max_length:
    raise ValueError(
      f"decode: a sequence holds {longest} tokens and a chunk of {chunk}"
      f" more overflows the cache of max_length {max_length} (init_cache"
      " with a longer input_shape)"
    )


def packed_positions(cu_seqlens: jax.Array, lengths: jax.Array,
                     total: int) -> jax.Array:  # fmt: skip
  """Each packed token's position in its sequence: sequence i's tokens
  (rows `cu_seqlens[i]:cu_seqlens[i+1]`) continue from its cached length
  `lengths[i]`; int32 `[total]` (rows past `cu_seqlens[-1]`: the last
  sequence's positions continued, never attended)."""
  cu = jnp.asarray(cu_seqlens, jnp.int32)
  p = packed_offsets.packing(cu, cu, total, total)
  return lengths[p.seq_q] + p.pos_q


def packed_attend(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  state: DecodeState,
  *,
  cu_seqlens: Any,
  max_seqlen_q: int | None,
  causal: bool,
  rope: bool,
  rope_base: float,
  implementation: str | None,
  decode_config: Any,
  window_size: Any,
  softcap: float | None,
  sinks: jax.Array | None,
) -> tuple[jax.Array, DecodeState]:
  """A continuous batch's decode call: `query [total, heads_q, head_dim]`
  (`key`/`value` `[total, heads_kv, head_dim]`), sequence i's new tokens
  the rows `cu_seqlens[i]:cu_seqlens[i+1]` (0 allowed), appended to cache
  row i at its length and attended causally by the ragged
  `flash_attention_with_kvcache(..., cu_seqlens_q=, cu_seqlens_k_new=)`:
  a prefill chunk and single decode tokens in one call. Returns `(output
  [total, heads_q, head_dim], the updated cache)`."""
  if state.lengths.ndim != 1:
    raise ValueError(
      "cu_seqlens needs a cache with one batch axis ([batch, max_length,"
      f" features] at init_cache); its lengths have shape"
      f" {tuple(state.lengths.shape)}"
    )
  if query.ndim != 3:
    raise ValueError(
      "with cu_seqlens the inputs are packed [total, features] (no batch"
      f" axis); the projected query has shape {tuple(query.shape)}"
    )
  if not causal:
    raise ValueError("cu_seqlens (appended chunks) needs a causal layer")
  # (cu_seqlens' own checks: the ragged call's, naming it.)
  cu = jnp.asarray(cu_seqlens, jnp.int32)
  if rope:
    positions = packed_positions(cu, state.lengths, query.shape[0])
    query = rope_lib.apply_rope(query, positions, rope_base)
    key = rope_lib.apply_rope(key, positions, rope_base)
  out, k_cache, v_cache = flash_attention_with_kvcache(
    query,
    state.key,
    state.value,
    key,
    value,
    cache_seqlens=state.lengths,
    cu_seqlens_q=cu,
    max_seqlen_q=max_seqlen_q,
    cu_seqlens_k_new=cu,
    causal=True,
    window_size=window_size,
    softcap=softcap,
    sinks=sinks,
    implementation=implementation,
    config=decode_config,
  )
  lengths = state.lengths + (cu[1:] - cu[:-1])
  return out, DecodeState(k_cache, v_cache, lengths)


def decode_attend(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  state: DecodeState,
  *,
  prefill: bool,
  chunk_lengths: Any,
  causal: bool,
  rope: bool,
  rope_base: float,
  implementation: str | None,
  config: Any,
  decode_config: Any,
  window_size: Any,
  softcap: float | None,
  sinks: jax.Array | None,
) -> tuple[jax.Array, DecodeState]:
  """One decode call: `(output [batch..., chunk, heads_q, head_dim], the
  updated cache)`.

  Args:
    query: `[batch..., chunk, heads_q, head_dim]` (projected).
    key, value: `[batch..., chunk, heads_kv, head_dim]`.
    state: the cache.
    prefill: start every sequence afresh (see the module docstring).
    chunk_lengths: None, or int32 `[batch...]`: the tokens of the chunk
      each sequence keeps (a ragged chunk; causal layers only).
    causal, rope, rope_base, window_size, softcap, sinks: the layer's.
    implementation: both entry points' backend.
    config: `flash_attention`'s tiling (prefill).
    decode_config: `flash_attention_with_kvcache`'s tiling (steps).
  """
  attend.check_qkv(query, key, value)
  chunk_lengths = _check_call(query, key, state, chunk_lengths, causal)
  batch, chunk = tuple(query.shape[:-3]), query.shape[-3]
  max_length = state.key.shape[-3]
  start = jnp.zeros(batch, jnp.int32) if prefill else state.lengths
  if rope:
    positions = start[..., None] + jnp.arange(chunk, dtype=jnp.int32)
    query = rope_lib.apply_rope(query, positions, rope_base)
    key = rope_lib.apply_rope(key, positions, rope_base)
  q, k, v = (attend.fold_batch(x) for x in (query, key, value))
  caches = [attend.fold_batch(x) for x in (state.key, state.value)]
  common = dict(
    causal=causal,
    window_size=window_size,
    softcap=softcap,
    sinks=sinks,
    implementation=implementation,
  )
  if prefill:
    out = flash_attention(q, k, v, config=config, **common)
    caches = [c.at[:, :chunk].set(x) for c, x in zip(caches, (k, v))]
  else:
    _check_room(state.lengths, chunk, max_length)
    out, *caches = flash_attention_with_kvcache(
      q,
      *caches,
      k,
      v,
      cache_seqlens=start.reshape(-1),
      config=decode_config,
      **common,
    )
  grown = chunk if chunk_lengths is None else chunk_lengths
  new_state = DecodeState(
    caches[0].reshape(state.key.shape),
    caches[1].reshape(state.value.shape),
    start + grown,
  )
  return attend.unfold_batch(out, query), new_state
