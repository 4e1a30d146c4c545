"""Rotary position embedding from precomputed tables, FlashAttention's
`rotary_cos` / `rotary_sin` convention: tables `[seqlen_ro, rotary_dim / 2]`,
the first `rotary_dim` features of each head rotated (the rest pass through),
pairs `(2i, 2i + 1)` when interleaved (GPT-J) or `(i, i + rotary_dim / 2)`
when not (GPT-NeoX), computed in float32 and cast back to the input's dtype.
`flash_attention_with_kvcache` applies it to q and to the appended k at each
sequence's positions: docs/decoding.md#rotary-embeddings-and-left-padding.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def check_rotary(
  rotary_cos: Any, rotary_sin: Any, *, head_dim: int, capacity: int
) -> int:
  """Validates the tables; returns `rotary_dim` (0 without them).

  Raises:
    ValueError / TypeError naming the argument: one table without the
    other, shapes that differ or are not `[seqlen_ro, rotary_dim / 2]`,
    `rotary_dim` past `head_dim`, fewer rows than the cache's `capacity`
    positions (FA3's rule: every position a sequence can reach has a
    row), or a non-float dtype.
  """
  if rotary_cos is None and rotary_sin is None:
    return 0
  if rotary_cos is None or rotary_sin is None:
    raise ValueError(
      "rotary_cos and rotary_sin must be given together; got rotary_cos="
      f"{'None' if rotary_cos is None else 'an array'}, rotary_sin="
      f"{'None' if rotary_sin is None else 'an array'}"
    )
  shapes = {}
  for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
      raise TypeError(
        f"{name} must be an array [seqlen_ro, rotary_dim / 2]; got"
        f" {type(x).__name__}"
      )
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must be a float array; got {jnp.dtype(x.dtype)}")
    shapes[name] = tuple(int(s) for s in x.shape)
  cos_shape = shapes["rotary_cos"]
  if cos_shape != shapes["rotary_sin"]:
    raise ValueError(
      "rotary_cos and rotary_sin must have the same shape; got"
      f" {cos_shape} and {shapes['rotary_sin']}"
    )
  if len(cos_shape) != 2 or cos_shape[1] == 0:
    raise ValueError(
      f"rotary_cos must have shape [seqlen_ro, rotary_dim / 2]; got {cos_shape}"
    )
  rotary_dim = 2 * cos_shape[1]
  if rotary_dim > head_dim:
    raise ValueError(
      f"rotary_dim = 2 * rotary_cos.shape[1] = {rotary_dim} exceeds"
      f" head_dim {head_dim}; rotary_cos shape {cos_shape}"
    )
  if cos_shape[0] < capacity:
    raise ValueError(
      f"rotary_cos has {cos_shape[0]} rows (positions), fewer than the"
      f" cache's {capacity}: every position a sequence can reach needs a"
      f" row; rotary_cos shape {cos_shape}"
    )
  return rotary_dim


def apply_rotary(
  x: jax.Array,
  cos: jax.Array,
  sin: jax.Array,
  positions: jax.Array,
  *,
  interleaved: bool,
) -> jax.Array:
  """`x` `[batch, seq, heads, head_dim]` rotated at `positions` `[batch,
  seq]` (rows of the `[seqlen_ro, rotary_dim / 2]` tables), same shape
  and dtype."""
  half = cos.shape[1]
  rd = 2 * half
  f32 = jnp.float32
  c = jnp.take(cos.astype(f32), positions, axis=0)[:, :, None, :]
  s = jnp.take(sin.astype(f32), positions, axis=0)[:, :, None, :]
  r = x[..., :rd].astype(f32)
  if interleaved:
    x1, x2 = r[..., 0::2], r[..., 1::2]
    y = jnp.stack([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)
    y = y.reshape(r.shape)
  else:
    x1, x2 = r[..., :half], r[..., half:]
    y = jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)
  return jnp.concatenate([y.astype(x.dtype), x[..., rd:]], axis=-1)


def decode_positions(
  cache_seqlens: jax.Array, n: int, *, per_token: bool
) -> jax.Array:
  """int32 `[batch, n]`: the rotary positions of n tokens of each sequence
  that follow its `cache_seqlens[b]` cached slots: `cache_seqlens[b] + i`,
  or with `per_token=False` all at `cache_seqlens[b]` (FA3's queries
  without causal or a window)."""
  base = cache_seqlens.astype(jnp.int32)[:, None]
  if not per_token:
    return jnp.broadcast_to(base, (base.shape[0], n))
  return base + jnp.arange(n, dtype=jnp.int32)[None, :]
