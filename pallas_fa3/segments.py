"""Packed sequences: `SegmentIds` (query i sees key j only if their ids match,
intersected with `causal` / `window_size`; traced int32 data, so a new
packing never recompiles), their checks, the helpers
`segment_ids_from_lengths` and `segment_positions`, and the per-tile id
ranges and tile spans by which the backends skip tiles whose ids cannot
meet: docs/api.md#packed-sequences-segment-ids.

Example:
  >>> import jax.numpy as jnp
  >>> from pallas_fa3 import segments
  >>> ids = segments.segment_ids_from_lengths(jnp.array([[3, 2]]), 6)
  >>> ids.tolist(), segments.segment_positions(ids).tolist()
  ([[0, 0, 0, 1, 1, -1]], [[0, 1, 2, 0, 1, 0]])
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3 import masking
from pallas_fa3.spec import cdiv


class SegmentIds(NamedTuple):
  """Segment ids of a packed call: int32 `q [batch, seq_q]` and
  `kv [batch, seq_kv]` (a pytree; a plain `(q, kv)` tuple is accepted
  too)."""

  q: Any
  kv: Any


def check_segment_ids(
  segment_ids: Any, batch: int, seq_q: int, seq_kv: int
) -> SegmentIds | None:
  """`segment_ids` as a `SegmentIds` of int32 arrays, or None.

  One int32 `[batch, seq]` array (MaxText's and splash attention's form)
  means `SegmentIds(ids, ids)`: self-attention only (`seq_q == seq_kv`).

  Raises:
    TypeError / ValueError naming `segment_ids` and the shapes/dtypes.
  """
  if segment_ids is None:
    return None
  if hasattr(segment_ids, "shape") and hasattr(segment_ids, "dtype"):
    if seq_q != seq_kv:
      raise ValueError(
        "segment_ids as one array needs self-attention (seq_q == seq_kv);"
        f" got seq_q={seq_q}, seq_kv={seq_kv}: pass"
        " pallas_fa3.SegmentIds(q_ids, kv_ids)"
      )
    segment_ids = (segment_ids, segment_ids)
  if not isinstance(segment_ids, tuple) or len(segment_ids) != 2:
    raise TypeError(
      "segment_ids must be None, a pallas_fa3.SegmentIds(q, kv), a"
      " (q_ids, kv_ids) tuple or (self-attention) one int32 [batch, seq]"
      f" array; got {type(segment_ids).__name__}"
    )
  out = []
  for name, ids, seq in (
    ("q", segment_ids[0], seq_q),
    ("kv", segment_ids[1], seq_kv),
  ):
    if not (hasattr(ids, "shape") and hasattr(ids, "dtype")):
      raise TypeError(
        f"segment_ids.{name} must be an int32 array [batch, seq]; got"
        f" {type(ids).__name__}"
      )
    shape = tuple(int(s) for s in ids.shape)
    if shape != (batch, seq):
      raise ValueError(
        f"segment_ids.{name} must have shape (batch, seq_{name}) ="
        f" {(batch, seq)}; got {shape}"
      )
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise TypeError(
        f"segment_ids.{name} must have an integer dtype (int32); got"
        f" {jnp.dtype(ids.dtype)}"
      )
    out.append(jnp.asarray(ids).astype(jnp.int32))
  return SegmentIds(*out)


def segment_ids_from_lengths(
  lengths: Any, seq_len: int, pad_id: int = -1
) -> jax.Array:
  """int32 `[batch, seq_len]` ids of documents packed in order: document d
  of row b (length `lengths[b, d]`, 0 for unused slots) gets id d; the
  positions past the last document get `pad_id`.

  Raises:
    ValueError naming `lengths` when a row's lengths exceed `seq_len`
    (concrete lengths only; traced ones are not checked).
  """
  lengths = jnp.asarray(lengths, jnp.int32)
  if lengths.ndim != 2:
    raise ValueError(
      f"lengths must be [batch, documents]; got shape {lengths.shape}"
    )
  ends = jnp.cumsum(lengths, axis=1)  # [b, n]
  if not isinstance(ends, jax.core.Tracer):
    total = np.asarray(ends[:, -1])
    if np.any(total > seq_len):
      raise ValueError(
        f"lengths sum to {total.max()} > seq_len {seq_len} in some row;"
        f" lengths={np.asarray(lengths).tolist()}"
      )
  pos = jnp.arange(seq_len, dtype=jnp.int32)
  doc = jnp.sum(pos[None, :, None] >= ends[:, None, :], axis=-1)
  inside = pos[None, :] < ends[:, -1:]
  return jnp.where(inside, doc, jnp.int32(pad_id)).astype(jnp.int32)


def segment_positions(ids: Any) -> jax.Array:
  """int32 positions restarting at 0 where the id changes (RoPE positions
  of packed documents), `[batch, seq]` like `ids`."""
  ids = jnp.asarray(ids)
  seq = ids.shape[-1]
  pos = jnp.arange(seq, dtype=jnp.int32)
  start = jnp.concatenate(
    [jnp.ones(ids.shape[:-1] + (1,), bool), ids[..., 1:] != ids[..., :-1]],
    axis=-1,
  )
  first = jax.lax.cummax(jnp.where(start, pos, 0), axis=ids.ndim - 1)
  return (pos - first).astype(jnp.int32)


def tile_id_ranges(ids: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
  """(min, max) id of each `block`-long tile of `ids [b, s]`: `[b, tiles]`
  each (the last tile's padding takes no part)."""
  b, s = ids.shape
  tiles = cdiv(s, block)
  pad = tiles * block - s
  big = jnp.iinfo(jnp.int32).max
  lo = jnp.pad(ids, ((0, 0), (0, pad)), constant_values=big)
  hi = jnp.pad(ids, ((0, 0), (0, pad)), constant_values=-big - 1)
  return (
    lo.reshape(b, tiles, block).min(-1),
    hi.reshape(b, tiles, block).max(-1),
  )


def kv_tile_spans(
  segment_ids: SegmentIds, block_q: int, block_kv: int
) -> tuple[jax.Array, jax.Array]:
  """(first, end) int32 `[b, q_tiles]`: the K/V tiles `first <= j < end`
  hold every K/V tile whose id range can meet query tile i's (a contiguous
  superset; exact when ids are sorted). `end <= first` when none can."""
  return _spans(segment_ids[0], segment_ids[1], block_q, block_kv)


def q_tile_spans(
  segment_ids: SegmentIds, block_kv: int, block_q: int
) -> tuple[jax.Array, jax.Array]:
  """(first, end) int32 `[b, kv_tiles]`: the query tiles that can meet
  each K/V tile (the backward's walk)."""
  return _spans(segment_ids[1], segment_ids[0], block_kv, block_q)


def _spans(
  rows: jax.Array, cols: jax.Array, block_rows: int, block_cols: int
) -> tuple[jax.Array, jax.Array]:
  r_lo, r_hi = tile_id_ranges(rows, block_rows)  # [b, nr]
  c_lo, c_hi = tile_id_ranges(cols, block_cols)  # [b, nc]
  meet = (c_lo[:, None, :] <= r_hi[:, :, None]) & (
    c_hi[:, None, :] >= r_lo[:, :, None]
  )  # [b, nr, nc]
  nc = c_lo.shape[1]
  j = jnp.arange(nc, dtype=jnp.int32)
  first = jnp.min(jnp.where(meet, j, nc), axis=-1)
  end = jnp.max(jnp.where(meet, j + 1, 0), axis=-1)
  return first.astype(jnp.int32), end.astype(jnp.int32)


PAD_Q = -1  # the id of a query that sees no key
PAD_KV = -2  # the id of a key that no query sees


def ids_of_padding(q_valid: Any, kv_valid: Any) -> SegmentIds:
  """Padding as segment ids: valid queries and keys (bool `[b, seq_q]`,
  `[b, seq_kv]`) in segment 0, the others `PAD_Q` / `PAD_KV`."""
  return SegmentIds(
    jnp.where(q_valid, 0, PAD_Q).astype(jnp.int32),
    jnp.where(kv_valid, 0, PAD_KV).astype(jnp.int32),
  )


def padding_of_mask(
  mask: jax.Array, causal: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(q_valid `[b, sq]`, kv_valid `[b, skv]`, exact): the queries and keys
  a boolean mask `[b, heads, sq, skv]` lets see anything, and a bool
  scalar: whether the mask is exactly `q_valid & kv_valid` for every head
  (`& tril`, top-left, where `causal`: the rest is masked anyway), a
  padding mask such as `nnx.make_attention_mask(q_valid, kv_valid)`.
  Traced: one pass over the mask, decided on the device."""
  visible = mask.astype(bool)
  tril = jnp.tril(jnp.ones(visible.shape[-2:], bool)) if causal else True
  visible = visible & tril
  q_valid, kv_valid = visible[:, 0].any(-1), visible[:, 0].any(-2)
  rebuilt = q_valid[:, None, :, None] & kv_valid[:, None, None, :] & tril
  return q_valid, kv_valid, jnp.all(visible == rebuilt)


@jax.custom_batching.custom_vmap
def for_every_example(flag: jax.Array) -> jax.Array:
  """`flag` (a bool scalar); under vmap one flag for the whole batch,
  whether it holds for every example, so that a `lax.cond` on it stays a
  cond (each branch vmapped) instead of vmap's both-then-select, which
  runs both sides and which interpret mode's effects cannot do at all."""
  return flag


@for_every_example.def_vmap
def _for_every_example_batched(axis_size, in_batched, flag):
  del axis_size
  return (jnp.all(flag) if in_batched[0] else flag), False


# The backends that take a dense mask (a `BlockMask.from_dense`); the
# kernels take a padding mask as segment ids only.
_DENSE_MASK_BACKENDS = (None, "blockwise", "reference")


def dense_mask_backend(implementation: str | None) -> str | None:
  """The backend that runs a dense mask for a call asking for
  `implementation`: that one where it takes dense masks, else the kernels'
  blockwise twin (the same function)."""
  if implementation in _DENSE_MASK_BACKENDS:
    return implementation
  return "blockwise"


def padding_or_dense(
  mask: jax.Array,
  operands: Any,
  *,
  causal: bool,
  implementation: str | None,
  padded: Callable[[Any, jax.Array, jax.Array], Any],
  dense: Callable[[Any, str | None], Any],
  call: str,
  vmap_hint: str,
) -> Any:
  """A call with a dense boolean mask `[b, heads|1, seq_q, seq_kv]`,
  decided on the device: `padded(operands, q_valid, kv_valid)` (padding as
  segment ids, which the kernels take, in `implementation`) where the mask
  is a padding mask for every example (`padding_of_mask`, `& tril` top-left
  where `causal`), else `dense(operands, backend)` with
  `dense_mask_backend(implementation)`. `dot_product_attention` and the
  Flax adapter share it.

  Args:
    call: the call as the messages name it (e.g. `"f(...) with a mask of
      shape (2, 1, 8, 8)"`): a warning when a kernel backend was asked for
      (other masks run in blockwise), and the error under vmap.
    vmap_hint: what serves the call under vmap in interpret mode besides
      another backend (the end of that error's sentence).

  Raises:
    NotImplementedError: interpret mode under jax.vmap (the interpreter's
      effects cannot be vmapped inside a cond), naming the call.
  """
  q_valid, kv_valid, exact = padding_of_mask(mask, causal)
  twin = dense_mask_backend(implementation)
  if twin != implementation:
    warnings.warn(
      f"{call}: the kernels run it where it is a padding mask (checked on"
      f" the device), any other mask in {twin!r} (the same function)",
      stacklevel=3,
    )
  try:
    return jax.lax.cond(
      for_every_example(exact),
      lambda args: padded(*args),
      lambda args: dense(args[0], twin),
      (operands, q_valid, kv_valid),
    )
  except NotImplementedError as e:
    if "vmap-of-cond" not in str(e):
      raise
    raise NotImplementedError(
      f"{call} cannot run under jax.vmap: the device-side choice between"
      " the kernels and blockwise is a cond, and the Pallas interpreter's"
      " effects cannot be vmapped inside one. Use implementation='mosaic'"
      f" (a GPU), 'blockwise' or None, or {vmap_hint}"
    ) from e


def visible_ids(q_ids: jax.Array, kv_ids: jax.Array) -> jax.Array:
  """`q_ids[..., :, None] == kv_ids[..., None, :]`: the id part of the
  mask, `[..., seq_q, seq_kv]`."""
  return q_ids[..., :, None] == kv_ids[..., None, :]


def key_bounds(
  segment_ids: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(lo, hi, contiguous): int32 `[b, seq_q]` bounds such that query i sees
  exactly the keys `lo <= j < hi` of its segment, and a bool scalar that
  says whether that is exact: the keys of every id a query holds are one
  contiguous run in every row (packed documents, padding included; the
  keys of an id no query holds, such as the pad id of left padding beside
  lengths, may lie in several). The kernels mask with the bounds (two
  compares per score, like a window) when it holds.
  """
  q_ids, kv_ids = segment_ids
  lo, hi, ok = jax.vmap(_row_bounds)(q_ids, kv_ids)
  return lo, hi, jnp.all(ok)


def query_bounds(
  segment_ids: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`key_bounds` mirrored: (lo, hi, contiguous) int32 `[b, seq_kv]` such
  that key j is seen by exactly the queries `lo <= i < hi` of its segment
  (positions aside), exact when every id's queries are one contiguous run
  (the backward's dK/dV kernels mask by them)."""
  q_ids, kv_ids = segment_ids
  return key_bounds((kv_ids, q_ids))


def kernel_bounds(spec: Any, segment_ids: Any) -> tuple[tuple, tuple]:
  """((lo, hi, q_lo, q_hi), (keys_exact, queries_exact)): the query rows'
  key bounds and the keys' query bounds, each narrowed by `spec`'s
  causal/window rule (`masking.fold_positions`: the kernels then mask by
  the bounds alone), and whether each pair is exact (every id's keys,
  resp. queries, contiguous)."""
  lo, hi, keys_ok = key_bounds(segment_ids)
  q_lo, q_hi, queries_ok = query_bounds(segment_ids)
  lo, hi = masking.fold_positions(spec, lo, hi, per_key=False)
  q_lo, q_hi = masking.fold_positions(spec, q_lo, q_hi, per_key=True)
  return (lo, hi, q_lo, q_hi), (keys_ok, queries_ok)


def _row_bounds(q: jax.Array, kv: jax.Array):
  n = kv.shape[0]
  pos = jnp.arange(n, dtype=jnp.int32)
  starts = jnp.concatenate([jnp.ones((1,), bool), kv[1:] != kv[:-1]])
  run = jnp.cumsum(starts.astype(jnp.int32)) - 1  # run of each key
  runs = run[-1] + 1
  run_start = jnp.full((n,), n, jnp.int32).at[run].min(pos)
  run_end = jnp.zeros((n,), jnp.int32).at[run].max(pos + 1)
  used = pos < runs
  big = jnp.iinfo(jnp.int32).max
  run_id = jnp.full((n,), big, jnp.int32).at[run].set(kv)
  order = jnp.argsort(jnp.where(used, run_id, big), stable=True)
  sorted_ids = run_id[order]
  sorted_used = used[order]
  # Exact: no query's id has two runs (an id no query holds, such as the
  # pad id of left padding beside lengths, may have several). `idx` is
  # the first of an id's runs in sorted order; `again` says another follows.
  again = jnp.append(
    (sorted_ids[1:] == sorted_ids[:-1]) & sorted_used[1:], False
  )
  idx = jnp.clip(jnp.searchsorted(sorted_ids, q), 0, n - 1)
  found = (sorted_ids[idx] == q) & sorted_used[idx]
  r = order[idx]
  lo = jnp.where(found, run_start[r], 0)
  hi = jnp.where(found, run_end[r], 0)
  exact = ~jnp.any(found & again[idx])
  return lo.astype(jnp.int32), hi.astype(jnp.int32), exact


def spans_from_bounds(
  lo: jax.Array, hi: jax.Array, block_q: int, block_kv: int, num_kv: int
) -> tuple[jax.Array, jax.Array]:
  """(first, end) K/V tiles of each `block_q` query tile from its rows'
  key bounds (rows that see nothing take no part), `[b, q_tiles]`."""
  b, s = lo.shape
  tiles = cdiv(s, block_q)
  pad = tiles * block_q - s
  empty = hi <= lo
  big = jnp.iinfo(jnp.int32).max
  lo_t = jnp.pad(
    jnp.where(empty, big, lo), ((0, 0), (0, pad)), constant_values=big
  )
  hi_t = jnp.pad(jnp.where(empty, 0, hi), ((0, 0), (0, pad)))
  first = lo_t.reshape(b, tiles, block_q).min(-1) // block_kv
  end = cdiv(hi_t.reshape(b, tiles, block_q).max(-1), block_kv)
  first = jnp.minimum(first, num_kv)
  return first.astype(jnp.int32), end.astype(jnp.int32)
