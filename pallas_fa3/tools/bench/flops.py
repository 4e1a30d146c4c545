"""The one FLOPs model of the benchmarks.

Forward: two matmuls (S = Q K^T, O = P V), `2 * d` and `2 * dv` FLOPs per
visible (query, key) pair and query head. Causal masks and sliding windows
count exactly the visible pairs under bottom-right alignment (query i sits
at key position p = i + seq_kv - seq_q; causal: keys j <= p; window (left,
right): p - left <= j <= p + right), not half the square. Packed documents
(`--docs`) keep only the pairs of a query and a key of the same document,
intersected with that mask. A softcap's tanh
and the sinks are not matmul work and are not counted. Backward counts 2.5x
the forward (five matmuls instead of two: FA2/FA3 convention),
forward+backward 3.5x.

Decoding (`--mode decode`) counts the same pairs per sequence, each on its
own cache length, and also the K/V bytes a step must read
(`decode_kv_bytes`), its figure of merit.
"""

from __future__ import annotations

# Backward = 2.5x forward: five matmuls (recomputed S, dV, dP, dQ, dK) against
# the forward's two. Kept as exact fractions so that FLOPs stay integers.
BWD_FACTOR = (5, 2)
FWD_BWD_FACTOR = (7, 2)
_MODE_FACTOR = {"fwd": (1, 1), "bwd": BWD_FACTOR, "fwd+bwd": FWD_BWD_FACTOR}


def pairs_up_to(seq_q: int, seq_kv: int, diagonal: int) -> int:
  """Pairs (i, j) of `[0, seq_q) x [0, seq_kv)` with `j <= i + diagonal`.

  Row i holds `clip(i + diagonal + 1, 0, seq_kv)` of them: rows before
  `first` none, rows from `full_from` on all `seq_kv`, the rows between an
  arithmetic series.
  """
  first = min(seq_q, max(0, -diagonal))
  full_from = min(seq_q, max(first, seq_kv - 1 - diagonal))
  partial = 0
  if full_from > first:
    lo = first + diagonal + 1
    hi = full_from - 1 + diagonal + 1
    partial = (lo + hi) * (full_from - first) // 2
  return partial + (seq_q - full_from) * seq_kv


def causal_pairs(seq_q: int, seq_kv: int) -> int:
  """Unmasked (query, key) pairs of a bottom-right aligned causal mask.

  Query i (0-based) sees keys 0..min(i + seq_kv - seq_q, seq_kv - 1), i.e.
  `clip(i + seq_kv - seq_q + 1, 0, seq_kv)` keys.
  """
  return pairs_up_to(seq_q, seq_kv, seq_kv - seq_q)


def visible_pairs(
  seq_q: int,
  seq_kv: int,
  causal: bool = False,
  window: tuple[int | None, int | None] | None = None,
  offset: int | None = None,
) -> int:
  """Visible (query, key) pairs of a causal mask and/or a sliding window.

  The band `p - left <= j <= p + right` (p = i + offset, by default
  `seq_kv - seq_q`: bottom-right aligned; a None side unbounded, causal
  caps right at 0) clipped to the score matrix: the pairs up to its upper
  diagonal minus those below its lower one. Exact.
  """
  if offset is None:
    offset = seq_kv - seq_q
  left, right = (None, None) if window is None else window
  if causal:
    right = 0 if right is None else min(right, 0)
  upper = (
    seq_q * seq_kv
    if right is None
    else pairs_up_to(seq_q, seq_kv, offset + right)
  )
  below = 0 if left is None else pairs_up_to(seq_q, seq_kv, offset - left - 1)
  return upper - below


def doc_lengths(docs: int, seq: int) -> list[int]:
  """`docs` documents packed in `seq` positions: equal lengths `seq //
  docs`, the last one taking the remainder (`--docs`)."""
  size = seq // docs
  return [size] * (docs - 1) + [seq - size * (docs - 1)]


def document_pairs(
  seq_q: int,
  seq_kv: int,
  docs: int,
  causal: bool = False,
  window: tuple[int | None, int | None] | None = None,
) -> int:
  """Visible pairs of `docs` packed documents (`doc_lengths` of seq_q and
  of seq_kv): per document, the pairs its block of the score matrix keeps
  of the whole matrix's causal mask and window (bottom-right aligned per
  document when seq_q == seq_kv). Exact."""
  total, q0, k0 = 0, 0, 0
  for nq, nk in zip(doc_lengths(docs, seq_q), doc_lengths(docs, seq_kv)):
    offset = seq_kv - seq_q + q0 - k0
    total += visible_pairs(nq, nk, causal, window, offset)
    q0, k0 = q0 + nq, k0 + nk
  return total


def attention_flops(spec, head_dim_v: int | None = None) -> int:
  """FLOPs of one benchmark case (`spec`: a `BenchSpec`-like object).

  Args:
    spec: has batch, seq_q, seq_kv, heads_q, head_dim, causal and mode; a
      `window` (a `BenchSpec`'s) or `window_size` (an `AttentionSpec`'s)
      attribute, when present, is counted too, and so is a `docs` one.
    head_dim_v: value head dim; None: the spec's `head_dim_v` where it has
      one (not None), else `head_dim`.

  Returns:
    `2 * b * pairs * hq * (d + dv)` for the forward (`4 * b * sq * skv * hq
    * d` when dv == d and nothing is masked), times 2.5 for "bwd" and 3.5
    for "fwd+bwd"; an int.
  """
  dv = head_dim_v or getattr(spec, "head_dim_v", None) or spec.head_dim
  window = getattr(spec, "window", None) or getattr(spec, "window_size", None)
  docs = getattr(spec, "docs", None)
  if docs:
    pairs = document_pairs(spec.seq_q, spec.seq_kv, docs, spec.causal, window)
  else:
    pairs = visible_pairs(spec.seq_q, spec.seq_kv, spec.causal, window)
  fwd = 2 * spec.batch * pairs * spec.heads_q * (spec.head_dim + dv)
  num, den = _MODE_FACTOR[spec.mode]
  return fwd * num // den


def decode_kv_bytes(spec) -> int:
  """K/V bytes one decode step must read (`spec`: a `DecodeBenchSpec`).

  Every sequence's keys and values once: `sum_b L_b * heads_kv * (d + dv)
  * itemsize` (MLA's one cache: `d` columns, V among them). The figure of merit of a memory-bound decoder is these
  bytes per second against the HBM peak; what an implementation reads
  beyond them (a gathered copy of a paged cache, materialized scores,
  partials of a split) is its overhead, not counted.
  """
  per_token = spec.heads_kv * (spec.head_dim + spec.head_dim_v)
  if getattr(spec, "mla", False):  # one cache: V is K's columns, read once
    per_token = spec.heads_kv * spec.head_dim
  return sum(spec.lengths) * per_token * spec.cache_itemsize


def decode_flops(spec) -> int:
  """FLOPs of one decode step (`spec`: a `DecodeBenchSpec`): `2 * (d + dv)`
  per visible (query, key) pair and query head, each sequence's `seq_q`
  queries bottom-right aligned on its own length (`visible_pairs`); at seq_q
  1 and dv == d, `4 * b * hq * L * d` with every cache full."""
  pairs = sum(visible_pairs(spec.seq_q, n, spec.causal) for n in spec.lengths)
  return 2 * pairs * spec.heads_q * (spec.head_dim + spec.head_dim_v)
