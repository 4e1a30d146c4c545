"""The randomized Hadamard transform of FA3's incoherent processing: Q and K
are multiplied along head_dim by the orthogonal `M = D H / sqrt(d)` (D a
random +-1 diagonal, H the Walsh-Hadamard matrix), which keeps
`(QM)(KM)^T = QK^T` in real arithmetic and spreads outlier features across
the row before quantization: docs/fp8.md#what-it-computes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def _hadamard_block(n: int) -> int:
  """Size of the Walsh-Hadamard blocks used along an axis of length n.

  The largest power of two dividing n: H_n itself when n is a power of two
  (every head dim the FP8 kernel serves), else the block-diagonal
  I_(n/p) (x) H_p, still orthogonal (e.g. d = 96: three H_32 blocks).
  """
  return n & -n


@jax.jit
def hadamard_transform(x: jax.Array) -> jax.Array:
  """`x @ H / sqrt(p)` along the last axis by the fast Walsh-Hadamard transform.

  H is the Sylvester-ordered Hadamard matrix of size p = the largest power of
  two dividing `x.shape[-1]` (block-diagonal when that is not the whole
  axis); symmetric and, with the 1/sqrt(p), orthogonal. O(n log p) additions
  per row, computed in float32.
  """
  n = x.shape[-1]
  p = _hadamard_block(n)
  y = x.astype(jnp.float32).reshape(x.shape[:-1] + (n // p, p))
  h = 1
  while h < p:
    y = y.reshape(y.shape[:-1] + (p // (2 * h), 2, h))
    a, b = y[..., 0, :], y[..., 1, :]
    y = jnp.stack([a + b, a - b], axis=-2).reshape(y.shape[:-3] + (p,))
    h *= 2
  return (y * jnp.float32(1.0 / math.sqrt(p))).reshape(x.shape)


def rotation_signs(key: jax.Array, head_dim: int) -> jax.Array:
  """The random +-1 diagonal D (float32 `[head_dim]`) drawn from `key`."""
  return jax.random.rademacher(key, (head_dim,), dtype=jnp.float32)


@jax.jit
def rotate(x: jax.Array, signs: jax.Array) -> jax.Array:
  """`x @ M` along the last axis with `M = D H / sqrt(d)` (orthogonal), float32."""
  return hadamard_transform(x.astype(jnp.float32) * signs)
