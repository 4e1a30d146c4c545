"""Which (query, key) pairs are visible, and which tiles can be skipped.

One mask rule serves every backend: the reference applies it to the whole
score matrix, the blockwise twin and the kernels to one tile at a time
(`visible_tile_at`, `visible_keys_end` in the kernels). Block skipping is
derived from the same rule, per tile, so the two can never disagree.

Causal attention is **bottom-right aligned** (as in FlashAttention-2/3): with
`offset = seq_kv - seq_q`, query i sees key j iff `j <= i + offset`. When
`seq_q > seq_kv` the first `seq_q - seq_kv` queries see no key at all.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pallas_fa3.spec import AttentionSpec


def visible(
  spec: AttentionSpec, q_pos: jax.Array, kv_pos: jax.Array
) -> jax.Array:
  """Boolean mask of visible pairs, broadcasting `q_pos[:, None]` vs `kv_pos[None, :]`.

  Positions are absolute indices into the unpadded sequences; keys at or past
  `spec.seq_kv` (tile padding) are never visible.
  """
  return visible_tile(spec, q_pos[:, None], kv_pos[None, :])


def visible_tile(
  spec: AttentionSpec, q_pos: jax.Array, kv_pos: jax.Array
) -> jax.Array:
  """The same rule on positions that already broadcast against each other.

  `visible` is the 1-D convenience form; the kernels use `visible_tile_at`,
  the same rule from 1-D index vectors.
  """
  mask = kv_pos < spec.seq_kv
  if spec.causal:
    mask = mask & (kv_pos <= q_pos + spec.causal_offset)
  return mask


def visible_tile_at(
  spec: AttentionSpec,
  q0: Any,
  kv0: Any,
  q_idx: jax.Array,
  kv_idx: jax.Array,
  shape: tuple[int, int],
  q_dim: int,
  *,
  check_seq_kv: bool = True,
) -> jax.Array:
  """`visible_tile` of a `shape` tile whose query positions are
  `q0 + q_idx` along `q_dim` and key positions `kv0 + kv_idx` along the
  other dim (`q_idx`, `kv_idx`: 1-D index vectors; `q0`, `kv0` scalars).

  The same rule with only 1-D index arithmetic before the broadcast
  comparison, so a kernel keeps no index tile in registers: the causal test
  is `kv_idx <= q_idx + (q0 + offset - kv0)`. `check_seq_kv=False` skips
  the padded-key test where padded keys cannot matter (with bottom-right
  causal alignment no query sees a key at or past `seq_kv` anyway).
  """
  kv_dim = 1 - q_dim
  keys = lax.broadcast_in_dim(kv_idx, shape, [kv_dim])
  mask = None
  if spec.causal:
    last = q_idx + (q0 + spec.causal_offset - kv0)  # last visible key per row
    mask = keys <= lax.broadcast_in_dim(last, shape, [q_dim])
  if check_seq_kv:
    in_seq = keys < (spec.seq_kv - kv0)
    mask = in_seq if mask is None else mask & in_seq
  return jnp.ones(shape, bool) if mask is None else mask


def num_kv_blocks_visible(
  spec: AttentionSpec, q_block_end: Any, block_kv: int, num_kv_blocks: int
) -> int | jax.Array:
  """Number of leading kv blocks a query tile ending at `q_block_end` needs.

  `q_block_end` is one past the tile's last query row (may be traced). Blocks
  after this count are fully masked for every row of the tile and are skipped.
  """
  if not spec.causal:
    return num_kv_blocks
  last_row = jnp.minimum(q_block_end, spec.seq_q) - 1
  last_key = last_row + spec.causal_offset  # last visible key of the tile
  return jnp.clip(last_key // block_kv + 1, 0, num_kv_blocks)


def first_q_block_visible(
  spec: AttentionSpec, kv_block_start: Any, block_q: int, num_q_blocks: int
) -> int | jax.Array:
  """Index of the first query tile that sees any key of a kv tile.

  Query tiles before it are fully masked for the whole kv tile (causal) and
  are skipped by the backward pass.
  """
  if not spec.causal:
    return 0
  first_row = kv_block_start - spec.causal_offset  # first query seeing the tile
  return jnp.clip(first_row // block_q, 0, num_q_blocks)


def visible_keys_end(spec: AttentionSpec, q_pos: jax.Array) -> jax.Array:
  """One past the last key query `q_pos` sees: `visible(q, j)` iff `j < end`.

  The same rule as `visible_tile` as one bound per row, for kernels that
  compare a column index against it.
  """
  end = jnp.full_like(q_pos, spec.seq_kv)
  if spec.causal:
    end = jnp.minimum(end, jnp.maximum(q_pos + spec.causal_offset + 1, 0))
  return end
