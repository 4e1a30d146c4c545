"""The Flax adapter's masks: which dense masks `make_attention_fn` recognises
(none, Flax's top-left causal mask, padding and segment masks, traced ones
whose kind `make_attention_fn` declares; the others run as dense masks, a
traced one after a choice on the device), exact decompositions of masks into
segment ids, one-row key masks (decode steps: any mask is a key mask), the
on-device checks of declared masks, and the first feature a call asks for
that flash attention cannot compute: docs/flax.md#inside-flaxs-own-layers.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3.attention import flash_attention
from pallas_fa3.segments import (
  PAD_KV,
  PAD_Q,
  SegmentIds,
  ids_of_padding,
  padding_of_mask,
)
from pallas_fa3.spec import MAX_HEAD_DIM, SUPPORTED_DTYPES


def _rebuilt(q_ids, kv_ids, tril, xp):
  same = q_ids[..., :, None] == kv_ids[..., None, :]
  return xp.logical_and(same, tril) if tril is not None else same


def _tril(seq_q: int, seq_kv: int, causal: bool, xp=np):
  return xp.tril(xp.ones((seq_q, seq_kv), bool)) if causal else None


def padding_ids(
  visible: np.ndarray, causal: bool
) -> tuple[np.ndarray, np.ndarray] | None:
  """(q_ids, kv_ids) int32 `[b, seq]` of a concrete padding mask `[b, sq,
  skv]` (`q_valid & kv_valid`, `& tril` if causal), or None if it is not one.
  """
  tril = _tril(*visible.shape[-2:], causal)
  q_ids = np.where(visible.any(-1), 0, PAD_Q).astype(np.int32)
  kv_ids = np.where(visible.any(-2), 0, PAD_KV).astype(np.int32)
  if np.array_equal(_rebuilt(q_ids, kv_ids, tril, np), visible):
    return q_ids, kv_ids
  return None


def segment_ids_of(
  visible: np.ndarray, causal: bool
) -> tuple[np.ndarray, np.ndarray] | None:
  """(q_ids, kv_ids) int32 with `visible [b, sq, skv]` equal to their mask
  (`& tril` if causal), or None if there are none.

  Ids are the connected components of the bipartite graph of queries and
  keys joined where visible (every id class of a segment mask is a union
  of components, so the components rebuild it if anything does); queries
  and keys without an edge get `PAD_Q` / `PAD_KV`.
  """
  found = padding_ids(visible, causal)  # the common case, cheaply
  if found is not None:
    return found
  from scipy.sparse import coo_matrix  # pylint: disable=g-import-not-at-top
  from scipy.sparse.csgraph import connected_components  # pylint: disable=g-import-not-at-top

  b, sq, skv = visible.shape
  tril = _tril(sq, skv, causal)
  q_ids = np.empty((b, sq), np.int32)
  kv_ids = np.empty((b, skv), np.int32)
  for row in range(b):
    i, j = np.nonzero(visible[row])
    graph = coo_matrix(
      (np.ones(i.size, bool), (i, sq + j)), shape=(sq + skv,) * 2
    )
    _, labels = connected_components(graph, directed=False)
    labels = labels.astype(np.int32)
    q_ids[row] = np.where(visible[row].any(-1), labels[:sq], PAD_Q)
    kv_ids[row] = np.where(visible[row].any(-2), labels[sq:], PAD_KV)
  if np.array_equal(_rebuilt(q_ids, kv_ids, tril, np), visible):
    return q_ids, kv_ids
  return None


def concrete_mask_ids(
  visible: np.ndarray, causal: bool | None
) -> tuple[SegmentIds, bool] | None:
  """`(ids, causal)` that give exactly the mask `visible [b, heads, sq, skv]`
  (heads may be 1), or None.

  Args:
    visible: a concrete boolean mask, batch axes folded into b.
    causal: True: the call is causal, decompose `visible & tril`; None: try
      without the causal mask, then with it.
  """
  if not (visible == visible[:, :1]).all():
    return None  # ids are per batch entry, not per head
  visible = visible[:, 0]
  tries = (False, True) if causal is None else (True,)
  for c in tries:
    target = visible & _tril(*visible.shape[-2:], True) if c else visible
    found = segment_ids_of(target, c)
    # Without a causal call, a causal decomposition must be the whole mask.
    if found is not None and (
      causal is not None or np.array_equal(target, visible)
    ):
      return SegmentIds(*(jnp.asarray(x) for x in found)), c
  return None


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


def top_left_causal_mask(seq_q: int, seq_kv: int) -> np.ndarray:
  """Flax's causal mask (`is_causal`, `make_causal_mask`): key j <= query i."""
  return np.tril(np.ones((seq_q, seq_kv), dtype=bool))


def mask_kind(mask: Any, weights_shape: tuple[int, ...]) -> str:
  """'none', 'causal', 'other' for a concrete mask; 'traced' for a tracer.

  Raises:
    ValueError: the mask does not broadcast to the attention weights' shape.
  """
  if mask is None:
    return "none"
  try:
    broadcast_ok = (
      np.broadcast_shapes(tuple(mask.shape), weights_shape) == weights_shape
    )
  except ValueError:
    broadcast_ok = False
  if not broadcast_ok:
    raise ValueError(
      f"mask of shape {tuple(mask.shape)} does not broadcast to the attention"
      f" weights [batch..., heads, seq_q, seq_kv] = {weights_shape}"
    )
  if isinstance(mask, jax.core.Tracer):
    return "traced"
  visible = np.asarray(mask).astype(bool)
  # Causal first: with seq_kv = 1 the causal mask is all True as well.
  if np.all(visible == top_left_causal_mask(*weights_shape[-2:])):
    return "causal"
  return "none" if visible.all() else "other"


class MaskPlan(NamedTuple):
  """How a call's mask is computed.

  Attributes:
    causal: the flash call is causal (Flax's top-left mask).
    segment_ids: None, or int32 ids `[prod(batch...), seq]` giving the mask.
    ok: None, or a traced bool scalar: whether a traced mask keeps the
      promise it was declared with (the output is NaN where it does not).
    key_valid: None, or bool `[prod(batch...), 1 | heads, seq_kv]`: a call
      with one query row and a mask (`adapter_masks.flash_key_mask`), whose
      mask is exactly these keys.
    dense: None, or the mask as bool `[prod(batch...), 1 | heads, seq_q,
      seq_kv]`, run as a dense mask by the blockwise twin
      (`adapter.flash_dense`): a concrete mask no segment ids give, or with
      `on_device` a traced mask, which runs as padding ids where it is a
      padding mask (`segments.padding_or_dense`, decided on the device).
    on_device: see `dense`.
  """

  causal: bool = False
  segment_ids: SegmentIds | None = None
  ok: jax.Array | None = None
  key_valid: jax.Array | None = None
  dense: jax.Array | None = None
  on_device: bool = False

  @property
  def may_leave_rows_empty(self) -> bool:
    """Whether a query row may see no key (never with no mask or causal)."""
    return (
      self.segment_ids is not None
      or self.key_valid is not None
      or self.dense is not None
    )


def _by_heads(mask: Any, weights_shape: tuple[int, ...], xp) -> Any:
  """The mask as `[prod(batch...), heads or 1, seq_q, seq_kv]` (a head axis
  of the mask's own size: nothing is repeated over heads)."""
  heads = mask.shape[-3] if mask.ndim >= 3 else 1
  shape = weights_shape[:-3] + (heads,) + weights_shape[-2:]
  return xp.broadcast_to(mask, shape).reshape((-1,) + shape[-3:])


def plan_mask(
  mask: Any,
  weights_shape: tuple[int, ...],
  *,
  is_causal: bool,
  declared_causal: bool,
  padding_mask: bool,
) -> MaskPlan:
  """The `MaskPlan` of a call; `weights_shape` is `[batch..., heads, seq_q,
  seq_kv]`.

  A call with one query row and a mask (a decode step of Flax's layers:
  the mask is the cache's occupancy) is a key mask, taken exactly as it is
  (`adapter_masks.flash_key_mask`); `causal=True` and `padding_mask=True`
  declare the masks of whole sequences and do not apply to it (a top-left
  causal mask would keep key 0 only, as Flax's layers, which drop
  `is_causal` in decode, know). A concrete mask is decomposed into segment
  ids on the host where it can be, else run as a dense mask; a traced one
  is decided on the device (padding ids or the dense mask) unless it was
  declared (`padding_mask=True`, `causal=True`): then it is taken as
  declared and checked on the device.

  Raises:
    ValueError: the mask does not broadcast to `weights_shape`, or a
      concrete mask breaks `make_attention_fn(causal=True)` (entries above
      the diagonal) without `padding_mask=True`.
  """
  causal = declared_causal or is_causal
  kind = mask_kind(mask, weights_shape)
  if kind == "none" and mask is None:
    return MaskPlan(causal)
  if weights_shape[-2] == 1:
    valid = one_row_valid(mask, weights_shape, is_causal)
    return MaskPlan(key_valid=valid)
  if kind == "traced":
    by_heads = _by_heads(mask, weights_shape, jnp)
    if padding_mask:
      q_valid, kv_valid, ok = padding_of_mask(by_heads, causal)
      return MaskPlan(causal, ids_of_padding(q_valid, kv_valid), ok)
    if declared_causal:
      seq_q, seq_kv = weights_shape[-2:]
      return MaskPlan(True, ok=causal_ok(mask, seq_q, seq_kv))
    return MaskPlan(causal, dense=by_heads.astype(bool), on_device=True)
  visible = np.asarray(mask).astype(bool)
  tril = top_left_causal_mask(*weights_shape[-2:])
  if declared_causal and not padding_mask and (visible & ~tril).any():
    raise ValueError(
      "make_attention_fn(causal=True) declared every mask causal, but the"
      f" mask of shape {tuple(mask.shape)} has entries above the diagonal"
      " of the causal mask tril(ones(seq_q, seq_kv)) (declare"
      " padding_mask=True as well to intersect padding masks with it)"
    )
  if kind == "causal" or (causal and kind == "none"):
    return MaskPlan(True)
  if kind == "none":
    return MaskPlan(False)
  by_heads = _by_heads(visible, weights_shape, np)
  found = concrete_mask_ids(by_heads, True if causal else None)
  if found is None:
    return MaskPlan(causal, dense=jnp.asarray(by_heads))
  ids, ids_causal = found
  return MaskPlan(causal or ids_causal, ids)


def causal_ok(mask: jax.Array, seq_q: int, seq_kv: int) -> jax.Array:
  """Whether a traced mask is Flax's causal mask (a traced bool scalar)."""
  causal = jnp.asarray(top_left_causal_mask(seq_q, seq_kv))
  return jnp.all(mask.astype(bool) == causal)


def fill_empty_rows(
  out: jax.Array, lse: jax.Array, value: jax.Array
) -> jax.Array:
  """Rows that see no key (lse -inf) become what Flax's attention gives them.

  Flax masks scores with the dtype's lowest finite value, so a row whose
  every score is masked has uniform weights: the mean of V over all keys
  (of the query head's kv head). `flash_attention` gives such rows 0; the
  adapter keeps one convention on every route, Flax's.

  Args:
    out: `[batch, seq_q, heads_q, head_dim_v]`.
    lse: float32 `[batch, heads_q, seq_q]`.
    value: `[batch, seq_kv, heads_kv, head_dim_v]`.
  """
  empty = jnp.isneginf(lse).transpose(0, 2, 1)[..., None]
  mean = value.astype(jnp.float32).mean(axis=1)  # [b, hk, dv]
  mean = jnp.repeat(mean, out.shape[2] // value.shape[2], axis=1)
  return jnp.where(empty, mean[:, None].astype(out.dtype), out)


def poison(out: jax.Array, ok: jax.Array | None) -> jax.Array:
  """`out`, or NaN everywhere where a traced check failed."""
  if ok is None:
    return out
  return jnp.where(ok, out, jnp.asarray(jnp.nan, out.dtype))


def unsupported_feature(
  query,
  bias,
  dropout_rate,
  deterministic,
  module,
  custom_einsums,
) -> tuple[str, str] | None:
  """(feature key, description) of the first unsupported feature, else None."""
  if bias is not None:
    return "bias", "an attention bias (bias=...)"
  if dropout_rate > 0.0 and not deterministic:
    return "dropout", (
      f"attention dropout (dropout_rate={dropout_rate} with"
      " deterministic=False)"
    )
  if module is not None:
    return "sow", (
      "sowing the attention weights (sow_weights=True, i.e. a"
      " module passed as module=...)"
    )
  if custom_einsums:
    return "einsum", f"custom einsums ({', '.join(custom_einsums)})"
  if jnp.dtype(query.dtype) not in SUPPORTED_DTYPES:
    return "dtype", (
      f"dtype {jnp.dtype(query.dtype)} (flash attention takes"
      f" {', '.join(str(d) for d in SUPPORTED_DTYPES)})"
    )
  if query.shape[-1] > MAX_HEAD_DIM:
    return "head_dim", (
      f"head_dim {query.shape[-1]} (flash attention takes at"
      f" most {MAX_HEAD_DIM})"
    )
  return None
