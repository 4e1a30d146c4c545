"""Byte-level training data: the Python standard library's own `.py` sources
as a `ByteCorpus` (`load_stdlib_corpus`: bytes are the tokens, files split
into train and validation by path hash) and its deterministic batches,
`train_batch` (step n's windows depend only on `(data_seed, n)`) and
`val_batches` (fixed windows).
More: docs/training.md#the-data

Example:
  >>> from models import data
  >>> corpus = data.load_stdlib_corpus(max_bytes=1 << 20)
  >>> batch = data.train_batch(corpus, step=0, data_seed=0, batch_size=4, seq_len=64)
  >>> batch.shape, batch.dtype
  ((4, 65), dtype('int32'))
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import sysconfig
import zlib

import numpy as np

# Folders left out: installed third-party packages are not the standard
# library; the test suites are large, repetitive data files rather than
# representative code (docs/design_notes.md#training-data).
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_HASH_RANGE = 2**32  # zlib.crc32 values are in [0, 2**32)


@dataclasses.dataclass(frozen=True)
class ByteCorpus:
  """Train/validation bytes of the stdlib corpus.

  Attributes:
    train: uint8 `[n_train]`, the training files concatenated.
    val: uint8 `[n_val]`, the validation files concatenated.
    train_files: number of files in the training split.
    val_files: number of files in the validation split.
    root: the stdlib folder read.
    fingerprint: SHA-256 (hex, 16 chars) of both splits; identifies the data
      in checkpoints and summaries.
    train_bounds: int64 `[train_files + 1]`: file i of the training split is
      `train[train_bounds[i]:train_bounds[i + 1]]` (empty files included).
    val_bounds: the same for the validation split.
  """

  train: np.ndarray
  val: np.ndarray
  train_files: int
  val_files: int
  root: str
  fingerprint: str
  train_bounds: np.ndarray
  val_bounds: np.ndarray

  def describe(self) -> dict[str, object]:
    """Sizes and identity, JSON-ready."""
    return {
      "root": self.root,
      "train_bytes": int(self.train.size),
      "val_bytes": int(self.val.size),
      "train_files": self.train_files,
      "val_files": self.val_files,
      "fingerprint": self.fingerprint,
    }


def stdlib_root() -> pathlib.Path:
  """The folder of the running interpreter's standard library."""
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(
  root: pathlib.Path | None = None, *, include_tests: bool = False
) -> list[pathlib.Path]:
  """The stdlib's `*.py` files, sorted by path relative to `root`.

  Args:
    root: the folder to read; default `stdlib_root()`.
    include_tests: also take files under `test`/`tests`/`idle_test` folders.

  Returns:
    Paths relative to `root`, sorted.
  """
  root = stdlib_root() if root is None else pathlib.Path(root)
  excluded = _EXCLUDED_DIRS | (frozenset() if include_tests else _TEST_DIRS)
  files = []
  for folder, subfolders, names in os.walk(root):
    # Pruned in place, so os.walk never descends into site-packages.
    subfolders[:] = [d for d in subfolders if d not in excluded]
    rel = pathlib.Path(folder).relative_to(root)
    files.extend(rel / n for n in names if n.endswith(".py"))
  return sorted(files, key=lambda p: p.as_posix())


def is_validation_file(rel_path: pathlib.Path, val_fraction: float) -> bool:
  """Whether a file (path relative to the stdlib root) is in the validation split."""
  h = zlib.crc32(rel_path.as_posix().encode())
  return h < val_fraction * _HASH_RANGE


def load_stdlib_corpus(
  *,
  max_bytes: int | None = None,
  val_fraction: float = 0.05,
  include_tests: bool = False,
  root: pathlib.Path | None = None,
) -> ByteCorpus:
  """Reads the stdlib sources into a train/validation byte corpus.

  Args:
    max_bytes: cap on the bytes read (None: all). The training split gets
      `(1 - val_fraction) * max_bytes`, validation the rest; each split takes
      whole files in sorted order until its share is full (the last file is
      cut at the cap).
    val_fraction: share of files (by path hash) in the validation split, in
      (0, 1).
    include_tests: also read the test folders.
    root: the folder to read; default `stdlib_root()`.

  Returns:
    The corpus.

  Raises:
    ValueError: a bad argument, or a split too small to train on.
  """
  if not 0.0 < val_fraction < 1.0:
    raise ValueError(f"val_fraction must be in (0, 1); got {val_fraction}")
  if max_bytes is not None and max_bytes < 1:
    raise ValueError(f"max_bytes must be >= 1 or None; got {max_bytes}")
  root = stdlib_root() if root is None else pathlib.Path(root)
  caps = {False: None, True: None}
  if max_bytes is not None:
    caps[True] = max(1, int(max_bytes * val_fraction))
    caps[False] = max(1, max_bytes - caps[True])
  chunks: dict[bool, list[bytes]] = {False: [], True: []}
  sizes = {False: 0, True: 0}
  counts = {False: 0, True: 0}
  bounds: dict[bool, list[int]] = {False: [0], True: [0]}
  for rel in stdlib_files(root, include_tests=include_tests):
    split = is_validation_file(rel, val_fraction)
    cap = caps[split]
    if cap is not None and sizes[split] >= cap:
      continue
    text = (root / rel).read_bytes()
    if cap is not None:
      text = text[: cap - sizes[split]]
    chunks[split].append(text)
    sizes[split] += len(text)
    counts[split] += 1
    bounds[split].append(sizes[split])
  train = np.frombuffer(b"".join(chunks[False]), np.uint8)
  val = np.frombuffer(b"".join(chunks[True]), np.uint8)
  if train.size == 0 or val.size == 0:
    raise ValueError(
      f"no .py files found for a split under {root}"
      f" (train {train.size} bytes, val {val.size} bytes)"
    )
  digest = hashlib.sha256(train.tobytes())
  digest.update(val.tobytes())
  return ByteCorpus(
    train=train,
    val=val,
    train_files=counts[False],
    val_files=counts[True],
    root=str(root),
    fingerprint=digest.hexdigest()[:16],
    train_bounds=np.asarray(bounds[False], np.int64),
    val_bounds=np.asarray(bounds[True], np.int64),
  )


def _windows(data: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
  """Rows `data[s:s + length]` for each start, as int32 `[len(starts), length]`."""
  index = starts[:, None] + np.arange(length)[None, :]
  return data[index].astype(np.int32)


def _check_fits(data: np.ndarray, seq_len: int, split: str) -> None:
  if data.size < seq_len + 1:
    raise ValueError(
      f"the {split} split has {data.size} bytes, fewer than"
      f" seq_len + 1 = {seq_len + 1}"
    )


def train_batch(
  corpus: ByteCorpus,
  *,
  step: int,
  data_seed: int,
  batch_size: int,
  seq_len: int,
) -> np.ndarray:
  """The training batch of `step`: int32 `[batch_size, seq_len + 1]` bytes.

  Inputs are `batch[:, :-1]`, next-byte targets `batch[:, 1:]`. The result
  depends only on the arguments (a generator seeded by `(data_seed, step)`).
  """
  _check_fits(corpus.train, seq_len, "training")
  rng = np.random.default_rng((data_seed, step))
  starts = rng.integers(0, corpus.train.size - seq_len, size=batch_size)
  return _windows(corpus.train, starts, seq_len + 1)


def val_batches(
  corpus: ByteCorpus, *, num_batches: int, batch_size: int, seq_len: int
) -> np.ndarray:
  """Fixed validation windows: int32 `[num_batches, batch_size, seq_len + 1]`.

  The `num_batches * batch_size` windows start at evenly spaced offsets over
  the validation split (no randomness), so every evaluation sees the same
  bytes.
  """
  _check_fits(corpus.val, seq_len, "validation")
  starts = val_window_starts(corpus, num_batches * batch_size, seq_len)
  return _windows(corpus.val, starts, seq_len + 1).reshape(
    num_batches, batch_size, seq_len + 1
  )


def val_window_starts(
  corpus: ByteCorpus, count: int, seq_len: int
) -> np.ndarray:
  """int64 starts of the `count` validation windows of `seq_len + 1` bytes,
  evenly spaced from the first byte to the last window that fits."""
  return np.linspace(0, corpus.val.size - seq_len - 1, count).astype(np.int64)
