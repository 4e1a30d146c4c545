"""The KV cache as data: where each sequence's tokens live, appending new
tokens in place, and gathering a sequence's logical K/V (the reference's
view; the blockwise twin and the kernel read tiles instead).

Contiguous: token t of sequence b is `cache[row_b, t]` with `row_b =
cache_batch_idx[b]` (or b). Paged: `cache[page_table[b, t // page_size],
t % page_size]`. Writes past a sequence's capacity are dropped (the call
then poisons that sequence's output: `kvcache.flash_attention_with_kvcache`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_fa3.kvcache_spec import DecodeSpec


def cache_rows(spec: DecodeSpec, cache_batch_idx: Any) -> jax.Array:
  """int32 `[b]`: the contiguous cache row of each sequence."""
  if cache_batch_idx is None:
    return jnp.arange(spec.batch, dtype=jnp.int32)
  return jnp.asarray(cache_batch_idx, jnp.int32)


def token_slots(
  spec: DecodeSpec, positions: jax.Array, rows: Any, page_table: Any
) -> tuple[jax.Array, jax.Array]:
  """(cache row or page, slot) of token `positions[b, ...]` of every
  sequence; positions past the capacity get row `cache_rows` (out of
  bounds: a scatter with mode="drop" skips them)."""
  past = positions >= spec.capacity
  if spec.paged:
    index = jnp.clip(positions // spec.page_size, 0, spec.pages_per_seq - 1)
    target = jnp.take_along_axis(
      page_table.astype(jnp.int32),
      index.reshape(spec.batch, -1),
      axis=1,
    ).reshape(positions.shape)
    slot = positions % spec.page_size
  else:
    target = jnp.broadcast_to(
      rows.reshape((spec.batch,) + (1,) * (positions.ndim - 1)),
      positions.shape,
    )
    slot = positions
  # A page or row that is not one of the cache's (a traced index) is out of
  # bounds too, negative ones included: never another sequence's slot.
  past |= (target < 0) | (target >= spec.cache_rows)
  return jnp.where(past, spec.cache_rows, target), slot


def invalid_sequences(
  spec: DecodeSpec, lengths: jax.Array, rows: Any, page_table: Any
) -> jax.Array:
  """bool `[b]`: sequence b reads a page (of its first `lengths[b]` tokens)
  or a row that is not one of the cache's (traced indices; concrete ones
  raise in `make_decode_spec`)."""
  if spec.paged:
    pages = page_table.astype(jnp.int32)
    used = jnp.arange(spec.pages_per_seq)[None, :] < (
      (lengths[:, None] + spec.page_size - 1) // spec.page_size
    )
    bad = (pages < 0) | (pages >= spec.cache_rows)
    return jnp.any(bad & used, axis=1)
  rows = jnp.asarray(rows, jnp.int32)
  return (rows < 0) | (rows >= spec.cache_rows)


def append(
  spec: DecodeSpec,
  cache: jax.Array,
  new: jax.Array,
  start: jax.Array,
  rows: Any,
  page_table: Any,
) -> jax.Array:
  """`cache` with `new[b, i]` written at token `start[b] + i` of sequence b
  (one scatter: in place when the cache is donated)."""
  positions = start[:, None] + jnp.arange(spec.seq_new, dtype=jnp.int32)
  where, slot = token_slots(spec, positions, rows, page_table)
  return cache.at[where, slot].set(new.astype(cache.dtype), mode="drop")


def gather(
  spec: DecodeSpec, cache: jax.Array, rows: Any, page_table: Any
) -> jax.Array:
  """Every sequence's `capacity` cache slots in order, `[b, capacity, hk, x]`
  (a copy: the reference's view)."""
  if spec.paged:
    pages = cache[page_table.astype(jnp.int32)]  # [b, pps, ps, hk, x]
    return pages.reshape((spec.batch, spec.capacity) + cache.shape[2:])
  return cache[rows]
