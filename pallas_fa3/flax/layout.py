"""Flax's `[batch..., length, heads, head_dim]` layout <-> the core's rank-4 layout.

Flax's attention functions accept any number of leading batch axes (none
included); `pallas_fa3.flash_attention` takes exactly one. These helpers fold
the leading axes into one and unfold the output, so every caller in this
package handles extra batch axes the same way.
"""

from __future__ import annotations

import math

import jax

# Axes after the batch axes in Flax's layout: length, heads, head_dim.
_TRAILING_AXES = 3


def check_qkv(query: jax.Array, key: jax.Array, value: jax.Array) -> None:
  """Checks that q, k, v share their rank (>= 3) and their leading batch axes.

  Raises:
    ValueError: naming the operands and their shapes.
  """
  shapes = (
    f"query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)},"
    f" value.shape={tuple(value.shape)}"
  )
  if not query.ndim == key.ndim == value.ndim:
    raise ValueError(
      f"query, key and value must have the same rank; got {shapes}"
    )
  if query.ndim < _TRAILING_AXES:
    raise ValueError(
      "query, key and value must have layout [batch..., length, heads,"
      f" head_dim] (rank >= {_TRAILING_AXES}); got {shapes}"
    )
  batch = query.shape[:-_TRAILING_AXES]
  if not batch == key.shape[:-_TRAILING_AXES] == value.shape[:-_TRAILING_AXES]:
    raise ValueError(
      f"query, key and value must have the same batch dims (leading axes);"
      f" got {shapes}"
    )


def fold_batch(x: jax.Array) -> jax.Array:
  """`[batch..., length, heads, dim]` -> `[prod(batch...), length, heads, dim]`."""
  batch = x.shape[:-_TRAILING_AXES]
  return x.reshape((math.prod(batch),) + tuple(x.shape[-_TRAILING_AXES:]))


def unfold_batch(out: jax.Array, like: jax.Array) -> jax.Array:
  """Inverse of `fold_batch`: restores the batch axes of `like` on `out`."""
  return out.reshape(tuple(like.shape[:-_TRAILING_AXES]) + tuple(out.shape[1:]))
