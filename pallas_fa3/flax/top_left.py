"""Flax's top-left alignment on flash_attention's bottom-right masks.

Flax's `is_causal` lets query i see keys j <= i whatever the lengths; the
core aligns its causal mask and windows bottom-right (query i sits at key
position `i + seq_kv - seq_q`). `flash_top_left` computes the top-left
function exactly with the core's masks and slicing, so that
`make_attention_fn` keeps Flax's semantics when seq_q != seq_kv. It returns
the lse with the output: a row that sees no key has lse -inf, which is how
the adapter finds the rows it gives Flax's value (`fill_empty_rows`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallas_fa3.attention import flash_attention
from pallas_fa3.flax.attend import Window
from pallas_fa3.segments import SegmentIds


def flash_top_left(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  causal: bool,
  window: Window | None,
  options: dict[str, Any],
  implementation: str | None,
  segment_ids: SegmentIds | None = None,
) -> tuple[jax.Array, jax.Array]:
  """flash_attention on rank-4 inputs with Flax's top-left alignment.

  The core aligns causal masks bottom-right. Top-left, query i sees keys
  j <= i: with seq_q < seq_kv the keys past seq_q are never seen (slice them
  off, then the mask is square); with seq_q > seq_kv the first seq_kv queries
  see a square causal mask and the others see every key. A window is
  translated too (`_window_top_left`).

  Args:
    q, k, v: `[batch, seq, heads, head_dim]`.
    causal: Flax's top-left causal mask.
    window: None or a checked `(left, right)`, top-left aligned.
    options: other keywords of `flash_attention` (softmax_scale, config,
      softcap).
    implementation: `flash_attention`'s.
    segment_ids: None or int32 ids `[batch, seq_q]` / `[batch, seq_kv]`,
      sliced along with the queries and keys.

  Returns:
    `(out [batch, seq_q, heads_q, head_dim_v], lse [batch, heads_q, seq_q])`
    (float32, natural log; -inf for a row that sees no key).
  """

  def call(q, k, v, causal, window=None, q_from=0):
    ids = None
    if segment_ids is not None:  # queries from q_from on, the leading keys
      ids = SegmentIds(
        segment_ids.q[:, q_from : q_from + q.shape[1]],
        segment_ids.kv[:, : k.shape[1]],
      )
    return flash_attention(
      q,
      k,
      v,
      causal=causal,
      window_size=window,
      implementation=implementation,
      segment_ids=ids,
      return_lse=True,
      **options,
    )

  seq_q, seq_kv = q.shape[1], k.shape[1]
  if window is not None:
    return _window_top_left(q, k, v, causal, window, call)
  if not causal or seq_q == seq_kv:
    return call(q, k, v, causal)
  if seq_q < seq_kv:
    return call(q, k[:, :seq_q], v[:, :seq_q], True)
  head = call(q[:, :seq_kv], k, v, True)
  tail = call(q[:, seq_kv:], k, v, False, q_from=seq_kv)
  return _concat_rows(head, tail)


def _concat_rows(
  first: tuple[jax.Array, jax.Array], second: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, jax.Array]:
  """Two (out, lse) pairs of consecutive query rows as one."""
  return (
    jnp.concatenate([first[0], second[0]], axis=1),
    jnp.concatenate([first[1], second[1]], axis=2),
  )


def _window_top_left(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  causal: bool,
  window: Window,
  call: Callable[..., tuple[jax.Array, jax.Array]],
) -> tuple[jax.Array, jax.Array]:
  """A top-left window (query i sees `i - left <= j <= i + right`) as one
  bottom-right windowed call.

  Causal makes right 0. Bottom-right, query i sits at `i + d` with
  `d = seq_kv - seq_q`, so the same keys are the window `(left + d,
  right - d)`; a side that would be negative is made valid by slicing off
  what no query sees: keys past `seq_q - 1 + right`, queries from
  `seq_kv + left` on (they see no key: output 0, lse -inf).
  """
  left, right = window
  if causal:
    right = 0
  seq_q, seq_kv = q.shape[1], k.shape[1]
  if right is not None and seq_kv > seq_q + right:
    seq_kv = seq_q + right
    k, v = k[:, :seq_kv], v[:, :seq_kv]
  rows = seq_q
  if left is not None and seq_q > seq_kv + left:
    rows = seq_kv + left
  d = seq_kv - rows
  left = None if left is None else left + d
  right = None if right is None else right - d
  if right == 0:  # the causal mask: let the core use its causal path
    out = call(q[:, :rows], k, v, True, (left, None))
  else:
    out = call(q[:, :rows], k, v, False, (left, right))
  if rows == seq_q:
    return out
  out, lse = out
  empty = jnp.zeros((q.shape[0], seq_q - rows) + out.shape[2:], out.dtype)
  no_key = jnp.full(lse.shape[:2] + (seq_q - rows,), -jnp.inf, lse.dtype)
  return _concat_rows((out, lse), (empty, no_key))
