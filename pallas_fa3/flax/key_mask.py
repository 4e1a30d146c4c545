"""One query row: any mask is a key mask (Flax's decode steps).

In a decode step of Flax's attention layers the query has length 1 and the
mask is `[batch..., 1 | heads, 1, cache_len]`: the cache's occupancy, and
the caller's mask if any. With one query row, whatever the mask holds says
only which keys that row sees, so it maps exactly onto segment ids (the
query 0, a visible key 0, a hidden key `PAD_KV`), concrete or traced alike:
nothing needs to be declared or checked. A mask whose heads differ gives
every query head its own sequence (K/V are then repeated per query head,
which a mask of one head never costs).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3.attention import flash_attention
from pallas_fa3.flax.mask_segments import PAD_KV
from pallas_fa3.segments import SegmentIds


def one_row_valid(
  mask: Any, weights_shape: tuple[int, ...], is_causal: bool
) -> jax.Array:
  """The keys the single query row sees: bool `[prod(batch...), heads_m, seq_kv]`.

  Args:
    mask: broadcastable to `weights_shape` (checked by the caller).
    weights_shape: `[batch..., heads, 1, seq_kv]`.
    is_causal: Flax's top-left causal mask of the call: the row sees key 0
      at most.

  Returns:
    heads_m is 1 when the mask has no head axis, or when it is concrete and
    the same for every head; else the number of heads.
  """
  seq_kv = weights_shape[-1]
  heads = mask.shape[-3] if mask.ndim >= 3 else 1
  shape = weights_shape[:-3] + (heads, 1, seq_kv)
  concrete = not isinstance(mask, jax.core.Tracer)
  xp = np if concrete else jnp
  valid = xp.broadcast_to(xp.asarray(mask).astype(bool), shape)
  valid = valid.reshape((-1, heads, seq_kv))
  if is_causal:
    valid = valid & (xp.arange(seq_kv) == 0)
  if concrete and heads > 1 and (valid == valid[:, :1]).all():
    valid = valid[:, :1]
  return jnp.asarray(valid)


def flash_key_mask(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  valid: jax.Array,
  *,
  options: dict[str, Any],
  implementation: str | None,
) -> tuple[jax.Array, jax.Array]:
  """flash_attention of one query row over the keys `valid` allows.

  Args:
    q: `[batch, 1, heads_q, head_dim]`.
    k, v: `[batch, seq_kv, heads_kv, head_dim(_v)]`.
    valid: bool `[batch, 1 | heads_q, seq_kv]` (`one_row_valid`).
    options: other keywords of `flash_attention` (softmax_scale, config,
      softcap).
    implementation: `flash_attention`'s.

  Returns:
    `(out [batch, 1, heads_q, head_dim_v], lse [batch, heads_q, 1])`; a
    query that sees no key has lse -inf.
  """
  batch, _, heads_q, head_dim = q.shape
  seq_kv, heads_kv = k.shape[1], k.shape[2]

  def call(q, k, v, valid):
    ids = SegmentIds(
      jnp.zeros((valid.shape[0], 1), jnp.int32),
      jnp.where(valid, 0, PAD_KV).astype(jnp.int32),
    )
    return flash_attention(
      q,
      k,
      v,
      segment_ids=ids,
      return_lse=True,
      implementation=implementation,
      **options,
    )

  if valid.shape[1] == 1:
    return call(q, k, v, valid[:, 0])
  # Per-head masks: every query head becomes a sequence of one head, with
  # its kv head (GQA: query head h reads kv head h // group).
  group = heads_q // heads_kv

  def per_head(x):  # [b, s, hk, d] -> [b * hq, s, 1, d]
    x = jnp.repeat(x, group, axis=2).transpose(0, 2, 1, 3)
    return x.reshape((batch * heads_q, x.shape[2], 1, x.shape[3]))

  out, lse = call(
    q.reshape(batch * heads_q, 1, 1, head_dim),
    per_head(k),
    per_head(v),
    valid.reshape(batch * heads_q, seq_kv),
  )
  out = out.reshape(batch, heads_q, 1, out.shape[-1]).transpose(0, 2, 1, 3)
  return out, lse.reshape(batch, heads_q, 1)
