"""The attention step shared by the nnx and linen modules (RoPE, then
flash_attention), the checks of the options they and `make_attention_fn`
take, and Flax's `[batch..., length, heads, head_dim]` layout folded onto
the core's rank-4 one (any number of leading batch axes). docs/flax.md
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3 import modifiers
from pallas_fa3.attention import flash_attention
from pallas_fa3.flax import rope as rope_lib
from pallas_fa3.segments import SegmentIds
from pallas_fa3.spec import check_int

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


Window = tuple[int | None, int | None]


def check_window(window_size: Any) -> Window | None:
  """`window_size` as None or a `(left, right)` tuple of ints >= 0 or None
  (-1, FA3's unbounded side, becomes None).

  The rules are `flash_attention`'s (`pallas_fa3.modifiers`); checked here
  so a layer refuses a bad window when it is built, not at its first call.

  Raises:
    TypeError / ValueError naming `window_size`.
  """
  if window_size is None:
    return None
  # Only the checks matter here; the lengths given do not change them.
  modifiers.check_window_size(window_size, seq_q=1, seq_kv=1, causal=False)
  return tuple(
    modifiers.window_bound(name, side)
    for name, side in zip(("left", "right"), window_size)
  )


def head_layout(
  num_heads: int, num_kv_heads: int | None, qkv_features: int
) -> tuple[int, int, int]:
  """Validates the head configuration; returns (num_heads, num_kv_heads, head_dim).

  Args:
    num_heads: query heads.
    num_kv_heads: key/value heads (None: `num_heads`, i.e. MHA); fewer heads
      give grouped-query attention and must divide `num_heads`.
    qkv_features: total query features, split evenly over `num_heads`.

  Raises:
    ValueError: naming the argument and its value.
  """
  num_heads = check_int("num_heads", num_heads, minimum=1)
  num_kv_heads = (
    num_heads
    if num_kv_heads is None
    else check_int("num_kv_heads", num_kv_heads, minimum=1)
  )
  qkv_features = check_int("qkv_features", qkv_features, minimum=1)
  if num_heads % num_kv_heads:
    raise ValueError(
      f"num_heads ({num_heads}) must be divisible by num_kv_heads"
      f" ({num_kv_heads})"
    )
  if qkv_features % num_heads:
    raise ValueError(
      f"qkv_features ({qkv_features}) must be divisible by num_heads"
      f" ({num_heads})"
    )
  return num_heads, num_kv_heads, qkv_features // num_heads


def self_attention_inputs(
  inputs_q: jax.Array, inputs_k: jax.Array | None, inputs_v: jax.Array | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Flax's defaulting: k defaults to q, v defaults to k.

  Raises:
    ValueError: `inputs_v` given without `inputs_k`.
  """
  if inputs_k is None:
    if inputs_v is not None:
      raise ValueError(
        "inputs_k cannot be None when inputs_v is given; pass the same array"
        " as inputs_k and leave inputs_v as None"
      )
    inputs_k = inputs_q
  if inputs_v is None:
    inputs_v = inputs_k
  return inputs_q, inputs_k, inputs_v


def layer_segment_ids(
  segment_ids: Any, query: jax.Array, key: jax.Array
) -> SegmentIds | None:
  """A layer's `segment_ids` as int32 `SegmentIds` over the folded batch.

  Args:
    segment_ids: None; a `pallas_fa3.SegmentIds(q, kv)` or `(q_ids, kv_ids)`
      tuple of integer arrays `[batch..., seq_q]` / `[batch..., seq_kv]`;
      or, when `seq_q == seq_kv`, one integer array `[batch..., seq]` for
      both. Each may also be `[seq]` (or anything that broadcasts to the
      batch axes and ends with seq): the same ids for every batch entry.
    query: `[batch..., seq_q, heads, head_dim]`.
    key: `[batch..., seq_kv, heads_kv, head_dim]`.

  Raises:
    TypeError / ValueError naming `segment_ids` and the shapes.
  """
  if segment_ids is None:
    return None
  if not isinstance(segment_ids, tuple):
    if query.shape[-3] != key.shape[-3]:
      raise ValueError(
        "a single segment_ids array means the same ids for queries and keys"
        " and needs seq_q == seq_kv; got query.shape="
        f"{tuple(query.shape)}, key.shape={tuple(key.shape)}; pass"
        " pallas_fa3.SegmentIds(q_ids, kv_ids)"
      )
    segment_ids = (segment_ids, segment_ids)
  if len(segment_ids) != 2:
    raise TypeError(
      "segment_ids must be None, one array, a pallas_fa3.SegmentIds(q, kv)"
      f" or a (q_ids, kv_ids) tuple; got a tuple of {len(segment_ids)}"
    )
  out = []
  for name, ids, x in (
    ("q", segment_ids[0], query),
    ("kv", segment_ids[1], key),
  ):
    if not (hasattr(ids, "shape") and hasattr(ids, "dtype")):
      ids = np.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise TypeError(
        f"segment_ids.{name} must be integers; got dtype {ids.dtype}"
      )
    want = tuple(x.shape[:-2])  # [batch..., seq]
    shape = tuple(ids.shape)
    try:
      ok = len(shape) >= 1 and shape[-1] == want[-1]
      ok = ok and np.broadcast_shapes(shape, want) == want
    except ValueError:
      ok = False
    if not ok:
      raise ValueError(
        f"segment_ids.{name} must have shape [seq] or [batch..., seq] ="
        f" {want}; got shape {shape}"
      )
    ids = jnp.broadcast_to(jnp.asarray(ids, jnp.int32), want)
    out.append(ids.reshape(-1, want[-1]))
  return SegmentIds(*out)


def attend(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  *,
  causal: bool,
  rope: bool,
  rope_base: float,
  positions: jax.Array | None,
  implementation: str | None,
  config: Any,
  window_size: Window | None = None,
  softcap: float | None = None,
  sinks: jax.Array | None = None,
  segment_ids: Any = None,
) -> jax.Array:
  """RoPE (optional) on q and k, then `flash_attention` over the folded batch.

  Args:
    query: `[batch..., seq_q, heads_q, head_dim]`.
    key: `[batch..., seq_kv, heads_kv, head_dim]`.
    value: `[batch..., seq_kv, heads_kv, head_dim]`.
    causal: bottom-right aligned causal mask (the core's convention; for
      self-attention, seq_q == seq_kv, this is the usual lower triangle).
    rope: rotate q and k by `positions` first.
    rope_base: RoPE frequency base.
    positions: None or integers `[seq]` / `[batch..., seq]`; only with rope.
    implementation: forwarded to `flash_attention`.
    config: forwarded to `flash_attention`.
    window_size: forwarded to `flash_attention` (bottom-right aligned, like
      `causal`; intersects with it).
    softcap: forwarded to `flash_attention`.
    sinks: None or the `[heads_q]` sink logits, forwarded.
    segment_ids: None or packed-sequence ids (`layer_segment_ids`): query i
      sees key j only if their ids are equal (and the mask allows it).

  Returns:
    `[batch..., seq_q, heads_q, head_dim]` in the dtype of the inputs.
  """
  check_qkv(query, key, value)
  segment_ids = layer_segment_ids(segment_ids, query, key)
  if rope:
    if query.shape[-3] != key.shape[-3]:
      raise ValueError(
        "rope=True shares positions between queries and keys and needs"
        f" seq_q == seq_kv; got query.shape={tuple(query.shape)},"
        f" key.shape={tuple(key.shape)}"
      )
    positions = rope_lib.rope_positions(positions, tuple(query.shape[:-2]))
    query = rope_lib.apply_rope(query, positions, rope_base)
    key = rope_lib.apply_rope(key, positions, rope_base)
  elif positions is not None:
    raise ValueError("positions is only used with rope=True; got rope=False")
  out = flash_attention(
    fold_batch(query),
    fold_batch(key),
    fold_batch(value),
    causal=causal,
    implementation=implementation,
    config=config,
    window_size=window_size,
    softcap=softcap,
    sinks=sinks,
    segment_ids=segment_ids,
  )
  return unfold_batch(out, query)
