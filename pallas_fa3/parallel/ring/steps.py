"""The per-device half of the classic ring, what runs inside the shard_map:
K/V shards passed around with `ppermute`, every step's backend call on the
visiting block (`step_forward`) merged exactly by log-sum-exp, causal calls
in the zig-zag layout (two unmasked blocks per device per step after the
first), steps whose segment ids cannot meet skipped
(`pallas_fa3.parallel.ring.skip`), and the backward in reverse with the
float32 dK/dV accumulators travelling with their K/V block:
docs/design_notes.md#ring-attention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallas_fa3.backends.base import StaticCall
from pallas_fa3.parallel.ring import skip as ring_skip
from pallas_fa3.parallel.ring.layout import (
  ppermute,
  zigzag_order as zigzag_order,
)
from pallas_fa3.parallel.ring.plan import RingPlan
from pallas_fa3.segments import SegmentIds


def step_forward(
  call: StaticCall,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  segment_ids: SegmentIds | None = None,
) -> tuple[jax.Array, jax.Array]:
  """One block's `(out, lse)` from its backend (on this device's shards)."""
  extras = {} if segment_ids is None else {"segment_ids": segment_ids}
  return tuple(
    call.backend.run_forward(call.spec, call.config, q, k, v, **extras)
  )


def step_backward(
  call: StaticCall,
  *residuals_and_cts: jax.Array,
  segment_ids: SegmentIds | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One block's `(dq, dk, dv)` from `(q, k, v, out, lse, dout, dlse)`."""
  grads = call.backend.run_backward(
    call.spec, call.config, *residuals_and_cts, segment_ids=segment_ids
  )
  return grads.dq, grads.dk, grads.dv


# ---------------------------------------------------------------------------
# Forward.


def _lse_to_rows(lse: jax.Array) -> jax.Array:
  """[b, h, s] -> [b, s, h, 1], to weight rows of out `[b, s, h, d]`."""
  return jnp.swapaxes(lse, 1, 2)[..., None]


def merge(
  out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Exact log-sum-exp merge of two partial results over disjoint keys.

  `out = w_a out_a + w_b out_b` with `w = exp(lse_part - lse)`; a part whose
  rows saw no key has lse = -inf and weight 0. Rows that no part has seen
  yet stay out = 0, lse = -inf (the reference is 0 there, not -inf, so no
  NaN appears).
  """
  lse = jnp.logaddexp(lse_a, lse_b)
  ref = jnp.where(jnp.isneginf(lse), 0.0, lse)
  w_a, w_b = jnp.exp(lse_a - ref), jnp.exp(lse_b - ref)
  out = _lse_to_rows(w_a) * out_a.astype(jnp.float32) + _lse_to_rows(
    w_b
  ) * out_b.astype(jnp.float32)
  return out, lse


def merge_rows(
  acc: tuple[jax.Array, jax.Array],
  part: tuple[jax.Array, jax.Array],
  start: Any,
) -> tuple[jax.Array, jax.Array]:
  """Merges `part` (out, lse) into the rows `[start, start + rows)` of `acc`."""
  acc_out, acc_lse = acc
  out, lse = part
  rows = out.shape[1]
  if rows == acc_out.shape[1]:  # every row (start 0)
    return merge(acc_out, acc_lse, out, lse)
  cur_out = jax.lax.dynamic_slice_in_dim(acc_out, start, rows, axis=1)
  cur_lse = jax.lax.dynamic_slice_in_dim(acc_lse, start, rows, axis=2)
  new_out, new_lse = merge(cur_out, cur_lse, out, lse)
  return (
    jax.lax.dynamic_update_slice_in_dim(acc_out, new_out, start, axis=1),
    jax.lax.dynamic_update_slice_in_dim(acc_lse, new_lse, start, axis=2),
  )


def _visiting_blocks(
  plan: RingPlan, owner: jax.Array, me: jax.Array
) -> tuple[int, tuple[tuple[Any, Any], ...]]:
  """The unmasked c x c blocks of a causal step: (c, ((q0, kv0), ...)).

  Query chunk `2n-1-i` (rows c..2c) always sees key chunk `j` (kv rows
  0..c); the second block is (chunk i, chunk j) when j < i, else
  (chunk 2n-1-i, chunk 2n-1-j) (docs/design_notes.md#ring-attention).
  """
  c = plan.spec.seq_q // (2 * plan.ring_size)
  second = jnp.where(owner < me, 0, c)
  return c, ((c, 0), (second, second))


def _run_ring(
  n: int,
  first: Callable[..., Any],
  visit: Callable[..., Any],
  send: Callable[[Any], Any],
  carry: tuple,
) -> Any:
  """Drives one pass around the ring: `first`, then `visit` steps 1..n-1.

  `carry` is `(block, state)`. Every step first issues `send(block)` -- the
  transfer of the block the next step needs -- and only then computes on the
  current block: they do not depend on each other, so XLA, which turns each
  `ppermute` into an async collective-permute-start/-done pair on GPU,
  schedules the copy under the step's attention (the latency-hiding
  scheduler; on CPU the collective-permute is synchronous and nothing
  overlaps). Steps 1..n-2 are one `fori_loop` body, so the compiled program
  does not grow with the ring; the last step is peeled off because it has
  nothing left to send.
  """
  block, state = carry
  if n == 1:
    return first(block, state)
  incoming = send(block)
  state = first(block, state)

  def body(step, carry):
    block, state = carry
    incoming = send(block)
    return incoming, visit(step, block, state)

  block, state = jax.lax.fori_loop(1, n - 1, body, (incoming, state))
  return visit(n - 1, block, state)


def ring_forward(
  plan: RingPlan,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  ids: SegmentIds | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Local shards (zig-zag order if causal) -> (out float32, lse).

  `ids`: the local segment ids, or None; the kv ids travel with K/V.
  """
  n, axis = plan.ring_size, plan.seq_axis
  me = jax.lax.axis_index(axis)
  q_ids = None if ids is None else ids.q
  # Step s: device i holds the K/V block of device i - s (from i - 1).
  send = lambda kv: ppermute(kv, axis, [(j, (j + 1) % n) for j in range(n)])

  def attend(call, kv, acc, q_start, kv_start, size_q, size_kv):
    # Merges q rows [q_start, +size_q) x kv rows [kv_start, +size_kv) into
    # acc, unless their ids cannot meet.
    seg = ring_skip.block_ids(
      ring_skip.rows(q_ids, q_start, size_q),
      ring_skip.rows(kv[2], kv_start, size_kv),
    )

    def add_block(acc):
      part = step_forward(
        call,
        ring_skip.rows(q, q_start, size_q),
        ring_skip.rows(kv[0], kv_start, size_kv),
        ring_skip.rows(kv[1], kv_start, size_kv),
        segment_ids=seg,
      )
      return merge_rows(acc, part, q_start)

    return ring_skip.unless_apart(seg, add_block, acc)

  def first(kv, acc):
    if ids is None:  # step 0: the own block, causal on the diagonal if causal
      out, lse = step_forward(plan.steps[0], q, kv[0], kv[1])
      return out.astype(jnp.float32), lse
    return attend(plan.steps[0], kv, acc, 0, 0, q.shape[1], kv[0].shape[1])

  def visit(step, kv, acc):
    if not plan.spec.causal:
      return attend(plan.steps[0], kv, acc, 0, 0, q.shape[1], kv[0].shape[1])
    c, blocks = _visiting_blocks(plan, (me - step) % n, me)
    for q_start, kv_start in blocks:
      acc = attend(plan.steps[1], kv, acc, q_start, kv_start, c, c)
    return acc

  empty = (
    jnp.zeros(q.shape[:3] + v.shape[3:], jnp.float32),
    jnp.full((q.shape[0], q.shape[2], q.shape[1]), -jnp.inf, jnp.float32),
  )
  kv_ids = None if ids is None else ids.kv
  return _run_ring(n, first, visit, send, ((k, v, kv_ids), empty))


# ---------------------------------------------------------------------------
# Backward.


def add_rows(acc: jax.Array, part: jax.Array, start: Any) -> jax.Array:
  rows = part.shape[1]
  if rows == acc.shape[1]:  # every row (start 0)
    return acc + part.astype(jnp.float32)
  cur = jax.lax.dynamic_slice_in_dim(acc, start, rows, axis=1)
  return jax.lax.dynamic_update_slice_in_dim(
    acc, cur + part.astype(jnp.float32), start, axis=1
  )


def ring_backward(
  plan: RingPlan,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  out: jax.Array,
  lse: jax.Array,
  dout: jax.Array,
  dlse: jax.Array,
  ids: SegmentIds | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Local shards (zig-zag order if causal) -> (dq, dk, dv) in float32."""
  n, axis = plan.ring_size, plan.seq_axis
  me = jax.lax.axis_index(axis)
  q_ids = None if ids is None else ids.q
  # The reverse ring: step s, device i holds the block of device i + s (from
  # i + 1); the block's float32 dK/dV accumulators follow one step behind.
  to_prev = [(j, (j - 1) % n) for j in range(n)]
  send = lambda kv: ppermute(kv, axis, to_prev)

  def attend(call, kv, grads, q_start, kv_start, size_q, size_kv):
    # Adds the gradients of q rows [q_start, +size_q) x kv rows
    # [kv_start, +size_kv), unless their ids cannot meet.
    q_rows = lambda x: ring_skip.rows(x, q_start, size_q)
    kv_rows = lambda x: ring_skip.rows(x, kv_start, size_kv)
    lse_rows = lambda x: ring_skip.rows(x, q_start, size_q, axis=2)
    seg = ring_skip.block_ids(q_rows(q_ids), kv_rows(kv[2]))

    def add(grads):
      dq, dk, dv = grads
      dq_p, dk_p, dv_p = step_backward(
        call,
        q_rows(q),
        kv_rows(kv[0]),
        kv_rows(kv[1]),
        q_rows(out),
        lse_rows(lse),
        q_rows(dout),
        lse_rows(dlse),
        segment_ids=seg,
      )
      return (
        add_rows(dq, dq_p, q_start),
        add_rows(dk, dk_p, kv_start),
        add_rows(dv, dv_p, kv_start),
      )

    return ring_skip.unless_apart(seg, add, grads)

  def visit(step, kv, dq, dk, dv):
    if step is None or not plan.spec.causal:  # step 0, or every step
      whole = (0, 0, q.shape[1], kv[0].shape[1])
      return attend(plan.steps[0], kv, (dq, dk, dv), *whole)
    grads = (dq, dk, dv)
    c, blocks = _visiting_blocks(plan, (me + step) % n, me)
    for q_start, kv_start in blocks:
      grads = attend(plan.steps[1], kv, grads, q_start, kv_start, c, c)
    return grads

  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  zeros_kv = lambda: (zeros(k), zeros(v))
  block = (k, v, None if ids is None else ids.kv)
  if n == 1:
    return visit(None, block, zeros(q), *zeros_kv())
  incoming = send(block)
  dq, dk, dv = visit(None, block, zeros(q), *zeros_kv())
  # The own block's part travels the whole ring too: n hops bring it home.
  dq, pending = backward_stream(
    visit, send, incoming, dq, (dk, dv), (1, n - 1), zeros_kv
  )
  dk, dv = send(pending)
  return dq, dk, dv


def backward_stream(
  visit: Callable[..., Any],
  send: Callable[[Any], Any],
  block: tuple,
  dq: jax.Array,
  pending: tuple | None,
  steps: tuple[int, int],
  zeros_kv: Callable[[], tuple],
) -> tuple[jax.Array, tuple]:
  """Steps `first..last` of a backward pass along one direction.

  `visit(step, block, dq, dk, dv)` adds a step's gradients into dq and into
  zeroed dk, dv; `block` is step `first`'s block (arrived); `pending`: the
  dK/dV accumulators of that block (None: no device saw it before).
  Returns (dq, the accumulators of the block of step `last`).

  Every step issues the next block's transfer and the accumulators of the
  block it sees (from the device that saw it last step) before its
  attention, and adds the arriving accumulators to its own part after it.
  Neither transfer depends on the step's attention, so XLA overlaps both
  with it. (Sent after the attention, the accumulators' transfer would be
  merged with the next block's by XLA's collective combiner, and make that
  one wait for the attention too.)
  """
  first, last = steps

  def step(s, block, dq, pending, send_block):
    incoming = send(block) if send_block else None
    arriving = None if pending is None else send(pending)
    dq, dk, dv = visit(s, block, dq, *zeros_kv())
    if arriving is not None:
      dk, dv = dk + arriving[0], dv + arriving[1]
    return incoming, dq, (dk, dv)

  if pending is None:  # the first step receives no accumulators
    incoming, dq, pending = step(first, block, dq, None, first < last)
    if first == last:
      return dq, pending
    block, first = incoming, first + 1
  if first < last:
    body = lambda s, carry: step(s, *carry, True)
    block, dq, pending = jax.lax.fori_loop(
      first, last, body, (block, dq, pending)
    )
  _, dq, pending = step(last, block, dq, pending, False)
  return dq, pending
