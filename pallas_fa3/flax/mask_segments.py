"""Dense masks as segment ids: what `make_attention_fn` does with padding masks.

A mask `m[b, i, j]` is exactly a segment-id mask when there are ids with
`m[b, i, j] == (q_ids[b, i] == kv_ids[b, j])`, or that intersected with
Flax's top-left causal mask `tril` (`causal=True`). Padding masks are the
commonest case: `nnx.make_attention_mask(q_valid, kv_valid)` is
`q_valid[b, i] & kv_valid[b, j]`, i.e. ids 0 for valid tokens, -1 for
padded queries and -2 for padded keys (ids that match nothing). Flax's
packed-sequence masks, `make_attention_mask(seg, seg, jnp.equal)`, are the
general case.

Concrete masks (numpy) are decomposed here and the decomposition is
verified by rebuilding the mask, so a mask is either turned into ids that
give exactly it or not at all. Traced masks (under `jit`) are decomposed on
device as padding masks only, returning whether the rebuilt mask matches.

A query row the mask leaves empty outputs 0 from flash attention; the
adapter then gives it Flax's value, the mean of the values
(`adapter_masks.fill_empty_rows`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3.segments import SegmentIds

PAD_Q = -1  # id of a query that sees no key
PAD_KV = -2  # id of a key that no query sees


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


def traced_padding_ids(
  mask: jax.Array, causal: bool
) -> tuple[SegmentIds, jax.Array]:
  """Padding ids of a traced mask `[b, heads, sq, skv]` and a bool scalar:
  whether the mask (`& tril` if causal) is exactly theirs (the same for
  every head)."""
  visible = mask.astype(bool)
  tril = _tril(*visible.shape[-2:], causal, jnp)
  if tril is not None:
    visible = visible & tril
  q_valid, kv_valid = visible.any(-1), visible.any(-2)  # [b, heads, seq]
  q_ids = jnp.where(q_valid[:, 0], 0, PAD_Q).astype(jnp.int32)
  kv_ids = jnp.where(kv_valid[:, 0], 0, PAD_KV).astype(jnp.int32)
  rebuilt = _rebuilt(q_ids[:, None], kv_ids[:, None], tril, jnp)
  ok = jnp.all(visible == rebuilt)
  return SegmentIds(q_ids, kv_ids), ok
