"""Random mixes of `flash_attention`'s options and their operands (the
property suite: test_property_golden.py; the check of one case:
property_check.py).

A mix is split where compilation splits it:

* `Mix`, the static part (shape, dtype, every option that is a static
  argument of the call, the tiling): one compile per mix and backend, about
  a second or two on a CPU. Mixes come from a seeded generator
  (`make_mix(index)`), so a profile runs a fixed pool of mixes, whose size
  bounds the compile time.
* `Operands`, the traced part (inputs, sink values, segment ids, the lse
  cotangent): drawn by hypothesis for every case, free of compiles.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np

import pallas_fa3
from pallas_fa3.kernels.sm90.config import KERNEL_DTYPES, KERNEL_HEAD_DIMS
from pallas_fa3.testing import Shape

DTYPES = ("float32", "bfloat16", "float16")
# How segment ids are given: None (no ids), contiguous packed documents,
# arbitrary ids (any order, repeats), or one array (self-attention only).
SEGMENT_KINDS = (None, "packed", "ids", "array")
# Lengths where tile and padding bugs live (tile multiples and their
# neighbours), drawn more often than the rest.
_EDGE_SEQS = (1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 192)
_EDGE_SEQS += (193, 255, 256)
_HEAD_DIMS = (8, 16, 24, 32, 64, 80, 96, 128, 256)
# Head-dim pairs whose forward the kernels serve but no backward tiling
# fits (the gradients then take the blockwise recomputation, with a warning).
_NO_KERNEL_BACKWARD = ({96, 192}, {96, 256})
_BLOCKS = (None, (8, 8), (16, 16), (16, 64), (64, 16), (32, 48), (128, 32))
# The float64 golden's einsums are numpy loops: at most this many
# multiply-adds per case keeps a case well under a second.
_MAX_WORK = 2e7


@dataclasses.dataclass(frozen=True)
class Mix:
  """The static part of one call: everything whose change recompiles."""

  shape: Shape
  dtype: str
  causal: bool = False
  window_size: tuple[int | None, int | None] | None = None
  softcap: float | None = None
  softmax_scale: float | None = None
  sinks_dtype: str | None = None  # None: no sinks
  segments: str | None = None  # one of SEGMENT_KINDS
  return_lse: bool = False
  deterministic: bool = False
  block: tuple[int, int] | None = None  # BlockwiseConfig; None: default

  def options(self) -> dict[str, Any]:
    """The golden's keyword arguments (those it shares with the call)."""
    return dict(
      causal=self.causal,
      softmax_scale=self.softmax_scale,
      window_size=self.window_size,
      softcap=self.softcap,
    )

  def config(self, implementation: str) -> Any:
    if implementation != "blockwise" or self.block is None:
      return None
    return pallas_fa3.BlockwiseConfig(*self.block)


def _seq(rng: random.Random, limit: int) -> int:
  edges = [n for n in _EDGE_SEQS if n <= limit]
  return rng.choice(edges) if rng.random() < 0.4 else rng.randint(1, limit)


def _window(rng: random.Random, seq_kv: int) -> tuple | None:
  if rng.random() < 0.5:
    return None
  sides = (None, 0, 1, 2, 7, rng.randint(0, seq_kv + 3))
  return (rng.choice(sides), rng.choice(sides))


def _shape(rng: random.Random, kernel: bool, segments: str | None) -> Shape:
  """A shape; `kernel`: one the Hopper kernels serve, tiny (interpret mode
  takes seconds per CTA)."""
  while True:
    if kernel:
      batch, heads_kv, group = 1, rng.choice((1, 2)), rng.choice((1, 2))
      head_dim = head_dim_v = rng.choice(KERNEL_HEAD_DIMS)
      if rng.random() < 0.3:
        head_dim_v = rng.choice(KERNEL_HEAD_DIMS)
      seq_q, seq_kv = _seq(rng, 256), _seq(rng, 256)
      if {head_dim, head_dim_v} in _NO_KERNEL_BACKWARD:
        continue
    else:
      batch, heads_kv, group = (rng.randint(1, 3) for _ in range(3))
      head_dim = rng.choice(_HEAD_DIMS)
      head_dim_v = head_dim
      if rng.random() < 0.4:
        head_dim_v = rng.choice(_HEAD_DIMS)
      seq_q, seq_kv = _seq(rng, 160), _seq(rng, 160)
    if segments == "array" or rng.random() < 0.25:
      seq_kv = seq_q  # self-attention (one array of ids needs it)
    shape = Shape(
      batch, seq_q, seq_kv, heads_kv * group, heads_kv, head_dim, head_dim_v
    )
    work = batch * shape.heads_q * seq_q * seq_kv * (head_dim + head_dim_v)
    if work <= _MAX_WORK:
      return shape


def make_mix(index: int, *, kernel: bool) -> Mix:
  """Mix number `index`: every choice drawn from a generator seeded by the
  index, each option on about half the time (segment ids: each form a
  quarter); `kernel`: only what the Hopper kernels serve."""
  rng = random.Random(index)
  segments = rng.choice(SEGMENT_KINDS)
  shape = _shape(rng, kernel, segments)
  return Mix(
    shape=shape,
    dtype=rng.choice(KERNEL_DTYPES if kernel else DTYPES),
    causal=rng.random() < 0.5,
    window_size=_window(rng, shape.seq_kv),
    softcap=rng.choice((None, None, None, 0.0, 0.5, 3.0, 30.0)),
    softmax_scale=rng.choice((None, None, None, 0.02, 0.3, 1.0, 3.0)),
    sinks_dtype=rng.choice((None, None, None) + DTYPES),
    segments=segments,
    return_lse=rng.random() < 0.5,
    deterministic=rng.random() < 0.3,
    block=None if kernel else rng.choice(_BLOCKS),
  )


# ---------------------------------------------------------------------------
# The traced part of a case.


@dataclasses.dataclass(frozen=True)
class Operands:
  """What hypothesis draws per case: a seed for q, k, v, dout (and dlse
  when `with_dlse`), the sink logits and the segment ids (numpy)."""

  seed: int
  sinks: np.ndarray | None = None
  with_dlse: bool = False
  ids: tuple[np.ndarray, np.ndarray] | None = None

  def arrays(self, mix: Mix) -> dict[str, Any]:
    """q, k, v, dout (never zeros), dlse, sinks, segment_ids as the call
    takes them."""
    s, dtype = mix.shape, jnp.dtype(mix.dtype)
    rng = np.random.default_rng(self.seed)
    normal = lambda *shape: rng.standard_normal(shape, np.float32)
    b, sq, skv, hq, hk = s.batch, s.seq_q, s.seq_kv, s.heads_q, s.heads_kv
    out = {
      "q": normal(b, sq, hq, s.head_dim),
      "k": normal(b, skv, hk, s.head_dim),
      "v": normal(b, skv, hk, s.dv),
      "dout": normal(b, sq, hq, s.dv),
    }
    out = {name: jnp.asarray(x, dtype) for name, x in out.items()}
    dlse = normal(b, hq, sq) if self.with_dlse else np.zeros((b, hq, sq))
    out["dlse"] = jnp.asarray(dlse, jnp.float32)
    out["sinks"] = None
    if self.sinks is not None:
      out["sinks"] = jnp.asarray(self.sinks, mix.sinks_dtype)
    out["segment_ids"] = None
    if self.ids is not None:
      q_ids, kv_ids = (jnp.asarray(x, jnp.int32) for x in self.ids)
      out["segment_ids"] = (
        q_ids
        if mix.segments == "array"
        else pallas_fa3.SegmentIds(q_ids, kv_ids)
      )
    return out


def _packed_row(draw: Any, seq: int, pad: int) -> list[int]:
  """One row of packed documents 0, 1, ... then `pad` up to `seq`."""
  lengths = draw(st.lists(st.integers(0, seq), min_size=1, max_size=4))
  row = []
  for doc, n in enumerate(lengths):
    row += [doc] * min(n, seq - len(row))
  return row + [pad] * (seq - len(row))


def _arbitrary_ids(seed: int, batch: int, seq: int, ids: int) -> np.ndarray:
  """Ids in -2 .. ids - 1 in runs of random length (from every position its
  own id to long runs): any order, repeats, ids the other side lacks."""
  rng = np.random.default_rng(seed)
  stay = rng.choice((0.0, 0.7, 0.95))  # chance a position continues a run
  values = rng.integers(-2, ids, (batch, seq))
  new_run = rng.random((batch, seq)) >= stay
  new_run[:, 0] = True
  run = np.cumsum(new_run, axis=1) - 1
  return np.take_along_axis(values, run, axis=1).astype(np.int32)


@st.composite
def _segment_ids(draw: Any, mix: Mix) -> tuple[np.ndarray, np.ndarray]:
  s = mix.shape
  # Self-attention ids (the keys' are the queries'): always for one array.
  same = mix.segments == "array"
  same = same or (s.seq_q == s.seq_kv and draw(st.booleans()))
  arbitrary = mix.segments == "ids"
  arbitrary = arbitrary or (mix.segments == "array" and draw(st.booleans()))
  if arbitrary:
    n, seed = draw(st.integers(1, 4)), draw(st.integers(0, 2**32 - 1))
    q_ids = _arbitrary_ids(seed, s.batch, s.seq_q, n)
    if same:
      return q_ids, q_ids
    return q_ids, _arbitrary_ids(seed + 1, s.batch, s.seq_kv, n)
  # Packed documents, then padding ids: -1 for the queries; for the keys
  # -1 too (padding sees padding) or -2 (padding that matches nothing).
  kv_pad = -1 if mix.segments == "array" else draw(st.sampled_from((-1, -2)))
  q_rows, kv_rows = [], []
  for _ in range(s.batch):
    q_rows.append(_packed_row(draw, s.seq_q, -1))
    if same:
      kv_rows.append([kv_pad if i == -1 else i for i in q_rows[-1]])
    else:
      kv_rows.append(_packed_row(draw, s.seq_kv, kv_pad))
  return np.array(q_rows, np.int32), np.array(kv_rows, np.int32)


@st.composite
def operands(draw: Any, mix: Mix) -> Operands:
  """A hypothesis strategy of `Operands` for `mix`."""
  sinks = None
  if mix.sinks_dtype is not None:
    # From negligible to dominating every row (exp(20) >> seq_kv).
    logits = st.floats(-20, 20, width=32)
    sinks = draw(hnp.arrays(np.float32, (mix.shape.heads_q,), elements=logits))
  return Operands(
    seed=draw(st.integers(0, 2**32 - 1)),
    sinks=sinks,
    with_dlse=mix.return_lse and draw(st.booleans()),
    ids=None if mix.segments is None else draw(_segment_ids(mix)),
  )
