"""The one FLOPs model of the benchmarks.

Forward: two matmuls (S = Q K^T, O = P V), `2 * d` and `2 * dv` FLOPs per
(query, key) pair and query head. Causal counts exactly the unmasked pairs
under bottom-right alignment (query i sees keys j <= i + seq_kv - seq_q),
not half the square. Backward counts 2.5x the forward (five matmuls instead
of two: FA2/FA3 convention), forward+backward 3.5x.
"""

from __future__ import annotations

# Backward = 2.5x forward: five matmuls (recomputed S, dV, dP, dQ, dK) against
# the forward's two. Kept as exact fractions so that FLOPs stay integers.
BWD_FACTOR = (5, 2)
FWD_BWD_FACTOR = (7, 2)
_MODE_FACTOR = {"fwd": (1, 1), "bwd": BWD_FACTOR, "fwd+bwd": FWD_BWD_FACTOR}


def causal_pairs(seq_q: int, seq_kv: int) -> int:
  """Unmasked (query, key) pairs of a bottom-right aligned causal mask.

  Query i (0-based) sees keys 0..min(i + seq_kv - seq_q, seq_kv - 1), i.e.
  `clip(i + seq_kv - seq_q + 1, 0, seq_kv)` keys.
  """
  offset = seq_kv - seq_q
  # Rows with 0 < count < seq_kv form an arithmetic series; rows past the
  # diagonal see every key, rows before it none.
  first = max(0, -offset)  # first row that sees a key
  full_from = max(0, seq_kv - 1 - offset)  # first row that sees all keys
  full_from = min(full_from, seq_q)
  partial = 0
  if full_from > first:
    lo = first + offset + 1
    hi = full_from - 1 + offset + 1
    partial = (lo + hi) * (full_from - first) // 2
  return partial + (seq_q - full_from) * seq_kv


def attention_flops(spec, head_dim_v: int | None = None) -> int:
  """FLOPs of one benchmark case (`spec`: a `BenchSpec`-like object).

  Args:
    spec: has batch, seq_q, seq_kv, heads_q, head_dim, causal and mode.
    head_dim_v: value head dim when it differs from `head_dim`.

  Returns:
    `2 * b * pairs * hq * (d + dv)` for the forward (`4 * b * sq * skv * hq
    * d` when dv == d and not causal), times 2.5 for "bwd" and 3.5 for
    "fwd+bwd"; an int.
  """
  dv = spec.head_dim if head_dim_v is None else head_dim_v
  pairs = (
    causal_pairs(spec.seq_q, spec.seq_kv)
    if spec.causal
    else spec.seq_q * spec.seq_kv
  )
  fwd = 2 * spec.batch * pairs * spec.heads_q * (spec.head_dim + dv)
  num, den = _MODE_FACTOR[spec.mode]
  return fwd * num // den
