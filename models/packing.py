"""Packed batches: stdlib files side by side in a row, kept apart by segment
ids, with positions restarting per piece and a `loss_mask` of the targets
inside a segment (`PackedBatch`, `packed_train_batch`,
`packed_val_batches`).
More: docs/training.md#packed-batches

Example:
  >>> from models import data, packing
  >>> corpus = data.load_stdlib_corpus(max_bytes=1 << 18)
  >>> batch = packing.packed_train_batch(
  ...     corpus, step=0, data_seed=0, batch_size=4, seq_len=64)
  >>> batch.tokens.shape, batch.segment_ids.dtype, batch.positions.shape
  ((4, 65), dtype('int32'), (4, 65))
  >>> packing.loss_mask(batch.segment_ids).shape
  (4, 64)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from models.data import ByteCorpus, val_batches, val_window_starts


class PackedBatch(NamedTuple):
  """Rows of a packed batch (a pytree of three arrays of one shape).

  Attributes:
    tokens: int32 `[..., seq_len + 1]` bytes; inputs `[..., :-1]`, targets
      `[..., 1:]`.
    segment_ids: int32, same shape: the piece's index in its row (0, 1, ...);
      -1 would mark padding (none of the batches here has any).
    positions: int32, same shape: the byte's offset in its piece.
  """

  tokens: Any
  segment_ids: Any
  positions: Any


def loss_mask(segment_ids: Any) -> Any:
  """bool `[..., seq_len]`: whether the target of input byte i counts (the
  target `i + 1` is in the same segment as i, and not padding).

  Works on numpy and JAX arrays alike.
  """
  return (segment_ids[..., 1:] == segment_ids[..., :-1]) & (
    segment_ids[..., 1:] >= 0
  )


def document_pieces(
  bounds: np.ndarray, length: int
) -> tuple[np.ndarray, np.ndarray]:
  """(starts, ends) int64: each document `[bounds[i], bounds[i + 1])` cut
  into consecutive pieces of at most `length` bytes (empty documents give
  none)."""
  bounds = np.asarray(bounds, np.int64)
  sizes = np.diff(bounds)
  counts = -(-sizes // length)
  doc = np.repeat(np.arange(sizes.size), counts)
  first = np.repeat(np.cumsum(counts) - counts, counts)
  starts = bounds[doc] + (np.arange(doc.size) - first) * length
  return starts, np.minimum(starts + length, bounds[doc + 1])


def _check_args(batch_size: int, seq_len: int) -> None:
  for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be an int >= 1; got {value!r}")


def packed_train_batch(
  corpus: ByteCorpus,
  *,
  step: int,
  data_seed: int,
  batch_size: int,
  seq_len: int,
) -> PackedBatch:
  """The packed training batch of `step`: rows of `seq_len + 1` bytes.

  Depends only on the arguments (a generator seeded by `(data_seed, step)`).

  Raises:
    ValueError: a bad size, or a training split without a non-empty file.
  """
  _check_args(batch_size, seq_len)
  length = seq_len + 1
  starts, ends = document_pieces(corpus.train_bounds, length)
  if starts.size == 0:
    raise ValueError("the training split has no non-empty file to pack")
  rng = np.random.default_rng((data_seed, step))
  shape = (batch_size, length)
  tokens = np.empty(shape, np.int32)
  ids = np.empty(shape, np.int32)
  positions = np.empty(shape, np.int32)
  for row in range(batch_size):
    filled, segment = 0, 0
    while filled < length:
      piece = int(rng.integers(starts.size))
      n = min(int(ends[piece] - starts[piece]), length - filled)
      at = slice(filled, filled + n)
      tokens[row, at] = corpus.train[starts[piece] : starts[piece] + n]
      ids[row, at] = segment
      positions[row, at] = np.arange(n)
      filled += n
      segment += 1
  return PackedBatch(tokens, ids, positions)


def packed_val_batches(
  corpus: ByteCorpus, *, num_batches: int, batch_size: int, seq_len: int
) -> PackedBatch:
  """The validation windows of `data.val_batches` (same bytes), with segment
  ids at file boundaries and restarting positions: arrays `[num_batches,
  batch_size, seq_len + 1]`."""
  _check_args(batch_size, seq_len)
  tokens = val_batches(
    corpus, num_batches=num_batches, batch_size=batch_size, seq_len=seq_len
  )
  length = seq_len + 1
  starts = val_window_starts(corpus, num_batches * batch_size, seq_len)
  index = starts[:, None] + np.arange(length)[None, :]
  # The file of each byte; ids count the files from the window's first.
  doc = np.searchsorted(corpus.val_bounds, index, side="right") - 1
  ids = (doc - doc[:, :1]).astype(np.int32)
  file_start = corpus.val_bounds[doc]
  positions = (index - np.maximum(file_start, starts[:, None])).astype(np.int32)
  shape = tokens.shape
  return PackedBatch(tokens, ids.reshape(shape), positions.reshape(shape))


def packing_stats(batch: PackedBatch) -> dict[str, float]:
  """How full a packed batch is: mean segments per row and the share of
  next-byte targets the loss counts."""
  ids = np.asarray(batch.segment_ids)
  return {
    "segments_per_row": float(np.mean(ids.max(axis=-1) + 1)),
    "target_fraction": float(np.mean(loss_mask(ids))),
  }
