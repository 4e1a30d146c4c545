"""The zig-zag layout of causal ring attention, and the ring's transfers:
`zigzag_order` (the layout's token order), `to_zigzag` / `from_zigzag`
(local shards permuted between it and the natural layout inside the
shard_map, two `ppermute`s of half a shard each) and `ppermute` (a pytree
sent around the ring, 16-bit floats as their raw bits):
docs/design_notes.md#ring-attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def zigzag_order(seq_len: int, ring_size: int) -> np.ndarray:
  """Token order of the zig-zag layout: `x[:, zigzag_order(s, n)]`.

  The sequence is cut into `2 * ring_size` equal chunks and device `i` holds
  chunks `i` and `2n-1-i`; sharding the permuted sequence contiguously over
  the ring axis gives every device its two chunks. `np.argsort` of the result
  is the inverse permutation.

  Raises:
    ValueError: `seq_len` is not a multiple of `2 * ring_size`.
  """
  n = int(ring_size)
  if n < 1 or seq_len % (2 * n):
    raise ValueError(
      f"seq_len={seq_len} must be a positive multiple of 2 * ring_size ="
      f" {2 * n} for the zig-zag layout"
    )
  c = seq_len // (2 * n)
  chunks = [chunk for i in range(n) for chunk in (i, 2 * n - 1 - i)]
  return np.concatenate([np.arange(ch * c, (ch + 1) * c) for ch in chunks])


# ---------------------------------------------------------------------------
# Transfers.

# Floating types sent as their raw bits (an unsigned int of the same width).
# XLA's CPU backend has no 16-bit-float collective-permute and would convert
# bf16/f16 payloads to float32 around it: twice the bytes on the wire and in
# memory. Bits are bits on every backend, and a bitcast costs nothing.
_WIRE_TYPES = {
  jnp.dtype(jnp.bfloat16): jnp.uint16,
  jnp.dtype(jnp.float16): jnp.uint16,
}


def ppermute(tree: Any, axis_name: str, perm: Sequence[tuple[int, int]]) -> Any:
  """`jax.lax.ppermute` of a pytree, 16-bit floats sent as their bits."""

  def send(x):
    wire = _WIRE_TYPES.get(jnp.dtype(x.dtype))
    if wire is None:
      return jax.lax.ppermute(x, axis_name, perm)
    bits = jax.lax.ppermute(
      jax.lax.bitcast_convert_type(x, wire), axis_name, perm
    )
    return jax.lax.bitcast_convert_type(bits, x.dtype)

  return jax.tree.map(send, tree)


# ---------------------------------------------------------------------------
# Zig-zag permutation of the local shards (natural layout, causal).


def _zigzag_perms(n: int) -> tuple[list, list]:
  """Where each natural half-shard goes: (first halves, second halves).

  Natural device `j` holds chunks `2j` and `2j+1`; chunk `ch` belongs to
  zig-zag device `ch` if `ch < n`, else `2n-1-ch`.
  """
  owner = lambda ch: ch if ch < n else 2 * n - 1 - ch
  return (
    [(j, owner(2 * j)) for j in range(n)],
    [(j, owner(2 * j + 1)) for j in range(n)],
  )


def to_zigzag(x: jax.Array, axis: int, axis_name: str, n: int) -> jax.Array:
  """Local natural shard -> local zig-zag shard (sequence along `axis`)."""
  perm0, perm1 = _zigzag_perms(n)
  h0, h1 = jnp.split(x, 2, axis=axis)
  r0 = ppermute(h0, axis_name, perm0)
  r1 = ppermute(h1, axis_name, perm1)
  # An even device receives its chunk i through perm0, an odd one its
  # chunk 2n-1-i; see _zigzag_perms.
  even = jax.lax.axis_index(axis_name) % 2 == 0
  return jnp.concatenate(
    [jnp.where(even, r0, r1), jnp.where(even, r1, r0)], axis=axis
  )


def from_zigzag(x: jax.Array, axis: int, axis_name: str, n: int) -> jax.Array:
  """Inverse of `to_zigzag`."""
  perm0, perm1 = _zigzag_perms(n)
  inverse = lambda perm: [(dst, src) for src, dst in perm]
  a, b = jnp.split(x, 2, axis=axis)
  even = jax.lax.axis_index(axis_name) % 2 == 0
  h0 = ppermute(jnp.where(even, a, b), axis_name, inverse(perm0))
  h1 = ppermute(jnp.where(even, b, a), axis_name, inverse(perm1))
  return jnp.concatenate([h0, h1], axis=axis)
