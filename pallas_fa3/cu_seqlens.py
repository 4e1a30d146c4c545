"""Packed sequences' offsets, `cu_seqlens` (FA3's: 0, then cumulative
lengths): their checks (`check_index_array`, `check_max_seqlen`,
`check_concrete`) and the per-token arrays derived from them on the device
(`packing`), shared by `flash_attention_varlen` and the ragged KV-cache
call: docs/varlen.md.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3 import segments


class Packing(NamedTuple):
  """Per-token int32 arrays of a packed call (`[total_q]` / `[total_k]`),
  derived on the device from `cu_seqlens` (and `seqused`): each token's
  sequence index (`seq_*`), position inside it (`pos_*`), count of its
  sequence's used tokens after it (`after_*`), whether it is used
  (`valid_*`: inside `cu_seqlens[-1]` and its sequence's used prefix),
  and a bool scalar `bad`: the traced `cu_seqlens` / `seqused` are not a
  valid packing (the output is then NaN)."""

  seq_q: jax.Array
  seq_k: jax.Array
  pos_q: jax.Array
  pos_k: jax.Array
  after_q: jax.Array
  after_k: jax.Array
  valid_q: jax.Array
  valid_k: jax.Array
  bad: jax.Array

  def segment_ids(self) -> segments.SegmentIds:
    """The sequence index as segment ids `[1, total]`; unused queries
    `PAD_Q`, unused keys `PAD_KV` (they meet nothing)."""
    return segments.SegmentIds(
      jnp.where(self.valid_q, self.seq_q, segments.PAD_Q)[None],
      jnp.where(self.valid_k, self.seq_k, segments.PAD_KV)[None],
    )


def is_traced(x: Any) -> bool:
  return isinstance(x, jax.core.Tracer)


def check_index_array(name: str, x: Any, size: int | None) -> jax.Array:
  """`x` (an array, or a list or tuple of ints) as an int32 1-D array (of
  `size` entries when given)."""
  if isinstance(x, (list, tuple)):
    x = np.asarray(x)
  if not (hasattr(x, "shape") and hasattr(x, "dtype")):
    raise TypeError(
      f"{name} must be an int32 array; got {type(x).__name__}: {x!r}"
    )
  dtype = jnp.dtype(x.dtype)
  if dtype == jnp.bool_ or not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype (int32); got {dtype}")
  shape = tuple(int(s) for s in x.shape)
  if len(shape) != 1 or (size is not None and shape[0] != size):
    want = "[n + 1]" if size is None else f"({size},)"
    raise ValueError(f"{name} must have shape {want}; got {shape}")
  return jnp.asarray(x).astype(jnp.int32)


def check_max_seqlen(name: str, value: Any) -> int | None:
  if value is None:
    return None
  if isinstance(value, (jax.Array, bool, np.bool_)):
    raise TypeError(
      f"{name} must be a static Python int (an upper bound on the"
      f" sequences' lengths) or None; got {value!r}"
    )
  try:
    bound = int(value)
  except TypeError as e:
    raise TypeError(f"{name} must be an int or None; got {value!r}") from e
  if bound != value or bound < 0:
    raise ValueError(f"{name} must be an int >= 0 or None; got {value!r}")
  return bound


def check_concrete(
  side: str, cu: Any, used: Any, total: int, max_seqlen: int | None
) -> None:
  """The checks a concrete `cu_seqlens_{side}` (and `seqused_{side}`)
  allow, each naming the argument and its values."""
  name = f"cu_seqlens_{side}"
  cu = np.asarray(cu)
  lengths = np.diff(cu)
  if cu[0] != 0:
    raise ValueError(f"{name} must start at 0; got {cu.tolist()}")
  if np.any(lengths < 0):
    raise ValueError(
      f"{name} must be non-decreasing (lengths >= 0); got {cu.tolist()}"
    )
  if cu[-1] > total:
    buffer = "q" if side == "q" else "k and v"
    raise ValueError(
      f"{name}[-1] = {int(cu[-1])} exceeds the {total} tokens of {buffer};"
      f" {name}={cu.tolist()}"
    )
  if used is not None:
    used = np.asarray(used)
    if np.any(used < 0) or np.any(used > lengths):
      raise ValueError(
        f"seqused_{side} must lie in [0, length] of each sequence; got"
        f" seqused_{side}={used.tolist()} for lengths {lengths.tolist()}"
      )
    lengths = used
  if max_seqlen is not None and lengths.size and lengths.max() > max_seqlen:
    raise ValueError(
      f"max_seqlen_{side}={max_seqlen} is smaller than the longest"
      f" sequence ({int(lengths.max())}) of {name}={cu.tolist()}"
    )


def _side(
  cu: jax.Array, used: jax.Array | None, total: int, max_seqlen: int | None
) -> tuple[jax.Array, ...]:
  """(seq, pos, after, valid, bad) of one side's `total` tokens."""
  n = cu.shape[0] - 1
  t = jnp.arange(total, dtype=jnp.int32)
  # The last sequence starting at or before t (empty ones are skipped).
  seq = jnp.clip(jnp.searchsorted(cu, t, side="right") - 1, 0, n - 1)
  lengths = cu[1:] - cu[:-1]
  used_len = lengths if used is None else used
  pos = t - cu[seq]
  length = used_len[seq]
  valid = (t < cu[n]) & (pos < length)
  after = jnp.where(valid, length - 1 - pos, 0)
  bad = (cu[0] != 0) | jnp.any(lengths < 0) | (cu[n] > total)
  if used is not None:
    bad |= jnp.any((used < 0) | (used > lengths))
  if max_seqlen is not None:
    bad |= jnp.any(used_len > max_seqlen)
  return seq.astype(jnp.int32), pos, after, valid, bad


def packing(
  cu_seqlens_q: jax.Array,
  cu_seqlens_k: jax.Array,
  total_q: int,
  total_k: int,
  *,
  seqused_q: jax.Array | None = None,
  seqused_k: jax.Array | None = None,
  max_seqlen_q: int | None = None,
  max_seqlen_k: int | None = None,
) -> Packing:
  """The `Packing` of checked int32 arrays (traced ones too)."""
  sq = _side(cu_seqlens_q, seqused_q, total_q, max_seqlen_q)
  sk = _side(cu_seqlens_k, seqused_k, total_k, max_seqlen_k)
  return Packing(
    sq[0], sk[0], sq[1], sk[1], sq[2], sk[2], sq[3], sk[3], sq[4] | sk[4]
  )
