"""Which (query, key) pairs are visible, and which tiles can be skipped: the
one mask rule every backend applies (the reference to the whole score
matrix, the blockwise twin and the kernels one tile at a time:
`visible_tile_at`, `visible_keys_end`), and the tile ranges derived from it
per tile, so skipping and masking can never disagree. Causal and windows
are bottom-right aligned: docs/api.md#conventions.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pallas_fa3.spec import AttentionSpec, cdiv


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
  p = q_pos + spec.causal_offset
  if spec.window_right is not None:
    mask = mask & (kv_pos <= p + spec.window_right)
  if spec.window_left is not None:
    mask = mask & (kv_pos >= p - spec.window_left)
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
  shift = q0 + spec.causal_offset - kv0  # query q_idx's own key: q_idx + shift
  if q_dim == 1:
    # Keys along the rows (a transposed tile, the dK/dV consumers): a
    # column index of a wgmma accumulator is `8j + e` with j fixed per
    # register and e < 8 lane-dependent, so `q & ~7` folds to a constant per
    # register and `q & 7` takes two values per thread. Moving every scalar
    # and `q & 7` to the key side leaves compares against immediates (FA3's
    # trick) instead of 16 query indices held across the loop, which spilled
    # the fused d128 consumer: `k <= q + s` is `k - s - (q & 7) <= q & ~7`.
    low = q_idx & 7
    high = q_idx - low

    def bound(side: int) -> tuple[jax.Array, jax.Array]:
      keys_rel = lax.broadcast_in_dim(kv_idx - (shift + side), shape, [kv_dim])
      return (
        keys_rel - lax.broadcast_in_dim(low, shape, [q_dim]),
        lax.broadcast_in_dim(high, shape, [q_dim]),
      )
  else:

    def bound(side: int) -> tuple[jax.Array, jax.Array]:
      pos = q_idx + shift + side  # each row's bound on the key position
      return keys, lax.broadcast_in_dim(pos, shape, [q_dim])

  if spec.window_right is not None:
    k, q = bound(spec.window_right)  # last visible key per query
    mask = k <= q
  if spec.window_left is not None:
    k, q = bound(-spec.window_left)
    mask = k >= q if mask is None else mask & (k >= q)
  if check_seq_kv:
    in_seq = keys < (spec.seq_kv - kv0)
    mask = in_seq if mask is None else mask & in_seq
  return jnp.ones(shape, bool) if mask is None else mask


def within_bounds(
  index: jax.Array,
  lo: jax.Array,
  hi: jax.Array,
  base: Any,
  shape: tuple[int, int],
  bounds_dim: int = 0,
) -> jax.Array:
  """`lo[r] <= base + index[c] < hi[r]` over a `shape` tile, r along
  `bounds_dim` and c along the other dim (segment ids' per-row bounds; 1-D
  vectors only before the broadcast compare, no index tile in registers)."""
  other = 1 - bounds_dim
  idx = lax.broadcast_in_dim(index, shape, [other])
  first = lax.broadcast_in_dim(lo - base, shape, [bounds_dim])
  end = lax.broadcast_in_dim(hi - base, shape, [bounds_dim])
  return (idx >= first) & (idx < end)


def fold_positions(
  spec: AttentionSpec, lo: jax.Array, hi: jax.Array, *, per_key: bool
) -> tuple[jax.Array, jax.Array]:
  """Segment bounds narrowed by the positional rule (causal, window), so
  that a kernel masks by the bounds alone (two compares per score).

  `per_key=False`: `[b, seq_q]` key bounds of each query row i, whose own
  key position is p = i + offset: keys in `[max(lo, p - left),
  min(hi, p + right + 1))`. `per_key=True`: `[b, seq_kv]` query bounds of
  each key j: queries in `[max(lo, j - offset - right),
  min(hi, j - offset + left + 1))`. An empty range has `hi <= lo`.
  """
  n = lo.shape[-1]
  pos = jnp.arange(n, dtype=jnp.int32)
  left, right = spec.window_left, spec.window_right
  if per_key:
    pos = pos - spec.causal_offset
    left, right = right, left  # the query range mirrors the key range
  else:
    pos = pos + spec.causal_offset
  if left is not None:
    lo = jnp.maximum(lo, pos - left)
  if right is not None:
    hi = jnp.minimum(hi, pos + right + 1)
  return lo.astype(jnp.int32), hi.astype(jnp.int32)


def kv_block_range(
  spec: AttentionSpec,
  q_start: Any,
  q_end: Any,
  block_kv: int,
  num_kv_blocks: int,
) -> tuple[Any, Any]:
  """(first, end) kv blocks that the query rows `[q_start, q_end)` need.

  Blocks outside are fully masked for every row of the tile and are
  skipped (never loaded). `end <= first` when no row sees any key. Either
  bound may be traced.
  """
  first, end = 0, num_kv_blocks
  off = spec.causal_offset
  if spec.window_left is not None:
    lo = q_start + off - spec.window_left  # first key of the tile's first row
    first = jnp.clip(lo // block_kv, 0, num_kv_blocks)
  if spec.window_right is not None:
    last_row = jnp.minimum(q_end, spec.seq_q) - 1
    hi = last_row + off + spec.window_right  # last key of the last row
    end = jnp.clip(hi // block_kv + 1, 0, num_kv_blocks)
  return first, end


def kv_blocks_unmasked(
  spec: AttentionSpec, q_start: Any, q_end: Any, block_kv: int
) -> tuple[Any, Any]:
  """(lo, hi): kv blocks `lo <= j < hi` are visible to every row of
  `[q_start, q_end)` (no padded key either), so they skip the mask; empty
  when `hi <= lo`."""
  lo, hi = 0, spec.seq_kv // block_kv
  off = spec.causal_offset
  if spec.window_left is not None:
    first_key = q_end - 1 + off - spec.window_left  # of the last row
    lo = cdiv(jnp.maximum(first_key, 0), block_kv)
  if spec.window_right is not None:
    seen = q_start + off + spec.window_right + 1  # keys of the first row
    hi = jnp.minimum(jnp.maximum(seen, 0) // block_kv, hi)
  return lo, hi


def num_kv_blocks_visible(
  spec: AttentionSpec, q_block_end: Any, block_kv: int, num_kv_blocks: int
) -> int | jax.Array:
  """Number of leading kv blocks a query tile ending at `q_block_end` needs
  (the end of `kv_block_range`; for calls without a left window bound,
  whose tiles all start at block 0)."""
  return kv_block_range(spec, 0, q_block_end, block_kv, num_kv_blocks)[1]


def q_block_range(
  spec: AttentionSpec,
  kv_start: Any,
  kv_end: Any,
  block_q: int,
  num_q_blocks: int,
) -> tuple[Any, Any]:
  """(first, end) query blocks that see any key of `[kv_start, kv_end)`;
  the others are fully masked for the whole kv tile and are skipped by
  the backward pass."""
  first, end = 0, num_q_blocks
  off = spec.causal_offset
  if spec.window_right is not None:
    row = kv_start - off - spec.window_right  # first query seeing kv_start
    first = jnp.clip(row // block_q, 0, num_q_blocks)
  if spec.window_left is not None:
    last_key = jnp.minimum(kv_end, spec.seq_kv) - 1
    row = last_key - off + spec.window_left  # last query seeing it
    end = jnp.clip(row // block_q + 1, 0, num_q_blocks)
  return first, end


def q_blocks_unmasked(
  spec: AttentionSpec,
  kv_start: Any,
  kv_end: Any,
  block_q: int,
  num_q_blocks: int,
) -> tuple[Any, Any]:
  """(lo, hi): query blocks `lo <= i < hi` (of `num_q_blocks`, padding
  included) see every key of `[kv_start, kv_end)` (the transpose of
  `kv_blocks_unmasked`), so a backward step over them skips the
  causal/window mask; empty when `hi <= lo`. Padded keys and query rows
  need no mask in the backward (their rows of dK, dV are sliced off;
  padded rows carry zero dO and delta), so they do not bound the range:
  without a left window `hi` is `num_q_blocks`."""
  lo, hi = 0, num_q_blocks
  off = spec.causal_offset
  if spec.window_right is not None:
    row = kv_end - 1 - off - spec.window_right  # first row seeing the last key
    lo = cdiv(jnp.maximum(row, 0), block_q)
  if spec.window_left is not None:
    row = kv_start - off + spec.window_left  # last row seeing the first key
    hi = jnp.clip((row + 1) // block_q, 0, hi)
  return lo, hi


def visible_keys_end(spec: AttentionSpec, q_pos: jax.Array) -> jax.Array:
  """One past the last key query `q_pos` sees: `visible(q, j)` iff `j < end`.

  The same rule as `visible_tile` as one bound per row, for kernels that
  compare a column index against it.
  """
  end = jnp.full_like(q_pos, spec.seq_kv)
  if spec.window_right is not None:
    seen = q_pos + spec.causal_offset + spec.window_right + 1
    end = jnp.minimum(end, jnp.maximum(seen, 0))
  return end
