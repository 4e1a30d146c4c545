"""Rotary position embedding (RoPE) in the half-split layout of GPT-NeoX and
LLaMA, rotated in float32 and cast back to the input dtype: `apply_rope`
and the checks of its positions, base and head dim: docs/flax.md#rope.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from pallas_fa3.flax import apply_rope
  >>> x = jax.random.normal(jax.random.key(0), (2, 16, 32)).reshape(2, 16, 4, 8)
  >>> y = apply_rope(x, jnp.arange(16))  # x: [batch, seq, heads, head_dim]
  >>> y.shape, y.dtype
  ((2, 16, 4, 8), dtype('float32'))
  >>> bool(jnp.allclose(jnp.linalg.norm(x, axis=-1), jnp.linalg.norm(y, axis=-1), atol=1e-5))
  True
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# The base of the rotary frequencies in RoFormer, GPT-NeoX and LLaMA 1/2.
DEFAULT_ROPE_BASE = 10000.0


def check_rope_base(rope_base: Any) -> float:
  """Returns `rope_base` as a float; raises if it is not a finite number > 1."""
  if isinstance(rope_base, bool) or not isinstance(rope_base, numbers.Real):
    raise TypeError(f"rope_base must be a real number; got {rope_base!r}")
  value = float(rope_base)
  if not (np.isfinite(value) and value > 1.0):
    raise ValueError(f"rope_base must be finite and > 1; got {rope_base!r}")
  return value


def check_rope_head_dim(head_dim: int) -> None:
  """RoPE rotates pairs of features: the head dimension must be even."""
  if head_dim % 2:
    raise ValueError(
      f"rope=True needs an even head_dim (features are rotated in pairs);"
      f" got head_dim={head_dim}"
    )


def rope_positions(
  positions: jax.Array | None, seq_shape: tuple[int, ...]
) -> jax.Array:
  """Validates `positions` against `[batch..., seq]`; defaults to `arange(seq)`.

  Args:
    positions: None, or integers of shape `[seq]` or `[batch..., seq]`
      (anything that broadcasts to `seq_shape` and ends with `seq`).
    seq_shape: `[batch..., seq]`, the leading shape of the rotated tensor.

  Returns:
    An integer array broadcastable to `seq_shape`.

  Raises:
    TypeError: positions are not integers.
    ValueError: positions do not broadcast to `seq_shape`.
  """
  seq = seq_shape[-1]
  if positions is None:
    return jnp.arange(seq, dtype=jnp.int32)
  positions = jnp.asarray(positions)
  if not jnp.issubdtype(positions.dtype, jnp.integer):
    raise TypeError(f"positions must be integers; got dtype {positions.dtype}")
  shape = tuple(positions.shape)
  try:
    ok = (
      len(shape) >= 1
      and shape[-1] == seq
      and np.broadcast_shapes(shape, seq_shape) == tuple(seq_shape)
    )
  except ValueError:
    ok = False
  if not ok:
    raise ValueError(
      f"positions must have shape [seq] or [batch..., seq] = {tuple(seq_shape)};"
      f" got shape {shape}"
    )
  return positions


def apply_rope(
  x: jax.Array, positions: jax.Array | None, base: float = DEFAULT_ROPE_BASE
) -> jax.Array:
  """Rotates `x` by its positions (half-split RoPE, computed in float32).

  Args:
    x: `[batch..., seq, heads, head_dim]` with an even head_dim.
    positions: None (`arange(seq)`), or integers of shape `[seq]` or
      `[batch..., seq]`.
    base: the frequency base `theta_i = base ** (-2 i / head_dim)`.

  Returns:
    The rotated `x`, same shape and dtype.
  """
  head_dim = x.shape[-1]
  check_rope_head_dim(head_dim)
  base = check_rope_base(base)
  positions = rope_positions(positions, tuple(x.shape[:-2]))
  half = head_dim // 2
  inv_freq = 1.0 / (
    base ** (jnp.arange(half, dtype=jnp.float32) * 2 / head_dim)
  )
  # [batch..., seq] -> [batch..., seq, 1 (heads), half]
  angles = positions.astype(jnp.float32)[..., None, None] * inv_freq
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  x1 = x[..., :half].astype(jnp.float32)
  x2 = x[..., half:].astype(jnp.float32)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)
