"""The windowed ring, what each device runs inside the shard_map when a call
(`ring_attention` or sequence-sharded `flash_attention`) has a window: K/V
and the kv segment ids travel only as far as the window reaches
(`pallas_fa3.parallel.ring.blocks.block_plan`), every block picks its
static call by its distance (`lax.switch`), partial results merge by
log-sum-exp (`ring_steps.merge_rows`), and in the backward
(`ring_steps.backward_stream`) the dK/dV accumulators follow their blocks
and go home in one transfer: docs/design_notes.md#ring-attention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallas_fa3.parallel.ring import blocks as ring_blocks, skip as ring_skip
from pallas_fa3.parallel.ring.blocks import Crop
from pallas_fa3.parallel.ring.layout import ppermute
from pallas_fa3.parallel.ring.plan import RingPlan
from pallas_fa3.parallel.ring.steps import (
  add_rows,
  backward_stream,
  merge_rows,
  step_backward,
  step_forward,
)
from pallas_fa3.segments import SegmentIds

_rows = ring_skip.rows


def _blocks(
  plan: RingPlan, me: jax.Array, owner: jax.Array
) -> list[tuple[int, int, jax.Array]]:
  """(first local query row, first local key row, branch) of every block
  of this device's query chunks against the key chunks of `owner`."""
  bp, n = plan.blocks, plan.ring_size
  q_chunks = ring_blocks.chunk_ids(bp.order, n, me)
  kv_chunks = ring_blocks.chunk_ids(bp.order, n, owner)
  return [
    (
      a * bp.chunk_q,
      b * bp.chunk_kv,
      bp.branch(gq * bp.chunk_q - gk * bp.chunk_kv),
    )
    for a, gq in enumerate(q_chunks)
    for b, gk in enumerate(kv_chunks)
  ]


def _streams(plan: RingPlan) -> list[tuple[int, int]]:
  """(direction, steps) of each K/V stream that travels at all."""
  forward, backward = plan.blocks.hops
  return [(d, h) for d, h in ((1, forward), (-1, backward)) if h]


def _shift(plan: RingPlan, direction: int, distance: int) -> list:
  n = plan.ring_size
  return [(j, (j + direction * distance) % n) for j in range(n)]


def _switch(
  plan: RingPlan,
  me: jax.Array,
  owner: jax.Array,
  run: Callable[[Crop, int, int, Any], Any],
  state: Any,
) -> Any:
  """Applies every block's chosen call (`run(crop, q_base, kv_base, state)`)."""
  for q_base, kv_base, index in _blocks(plan, me, owner):
    branches = [
      (lambda s: s)
      if crop is None
      else (lambda s, c=crop: run(c, q_base, kv_base, s))
      for crop in plan.blocks.crops()
    ]
    state = jax.lax.switch(index, branches, state)
  return state


def window_forward(
  plan: RingPlan,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  ids: SegmentIds | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Local shards in `plan.order` -> (out float32, lse)."""
  axis = plan.seq_axis
  me = jax.lax.axis_index(axis)
  q_ids = None if ids is None else ids.q

  def attend(block, owner, acc):
    def run(crop, q_base, kv_base, acc):
      (r0, r1), (k0, k1) = crop.rows, crop.keys
      qs, ks, nq, nk = q_base + r0, kv_base + k0, r1 - r0, k1 - k0
      seg = ring_skip.block_ids(_rows(q_ids, qs, nq), _rows(block[2], ks, nk))

      def add(acc):
        part = step_forward(
          crop.call,
          _rows(q, qs, nq),
          _rows(block[0], ks, nk),
          _rows(block[1], ks, nk),
          segment_ids=seg,
        )
        return merge_rows(acc, part, qs)

      return ring_skip.unless_apart(seg, add, acc)

    return _switch(plan, me, owner, run, acc)

  acc = (
    jnp.zeros(q.shape[:3] + v.shape[3:], jnp.float32),
    jnp.full((q.shape[0], q.shape[2], q.shape[1]), -jnp.inf, jnp.float32),
  )
  own = (k, v, None if ids is None else ids.kv)
  streams = _streams(plan)
  # Both streams' first transfers go out before any attention.
  incoming = [ppermute(own, axis, _shift(plan, d, 1)) for d, _ in streams]
  acc = attend(own, me, acc)
  for (direction, steps), block in zip(streams, incoming):
    send = lambda x, d=direction: ppermute(x, axis, _shift(plan, d, 1))
    owner = lambda s, d=direction: (me - d * s) % plan.ring_size

    def body(s, carry, send=send, owner=owner):
      block, acc = carry
      return send(block), attend(block, owner(s), acc)

    block, acc = jax.lax.fori_loop(1, steps, body, (block, acc))
    acc = attend(block, owner(steps), acc)
  return acc


def window_backward(
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
  """Local shards in `plan.order` -> (dq, dk, dv) in float32."""
  axis = plan.seq_axis
  me = jax.lax.axis_index(axis)
  q_ids = None if ids is None else ids.q

  def attend(block, owner, grads):
    def run(crop, q_base, kv_base, grads):
      (r0, r1), (k0, k1) = crop.rows, crop.keys
      qs, ks, nq, nk = q_base + r0, kv_base + k0, r1 - r0, k1 - k0
      q_rows = lambda x: _rows(x, qs, nq)
      lse_rows = lambda x: _rows(x, qs, nq, axis=2)
      kv_rows = lambda x: _rows(x, ks, nk)
      seg = ring_skip.block_ids(q_rows(q_ids), kv_rows(block[2]))

      def add(grads):
        dq, dk, dv = grads
        dq_p, dk_p, dv_p = step_backward(
          crop.call,
          q_rows(q),
          kv_rows(block[0]),
          kv_rows(block[1]),
          q_rows(out),
          lse_rows(lse),
          q_rows(dout),
          lse_rows(dlse),
          segment_ids=seg,
        )
        return (
          add_rows(dq, dq_p, qs),
          add_rows(dk, dk_p, ks),
          add_rows(dv, dv_p, ks),
        )

      return ring_skip.unless_apart(seg, add, grads)

    return _switch(plan, me, owner, run, grads)

  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  zeros_kv = lambda: (zeros(k), zeros(v))
  own = (k, v, None if ids is None else ids.kv)
  streams = _streams(plan)
  incoming = [ppermute(own, axis, _shift(plan, d, 1)) for d, _ in streams]
  dq, dk, dv = attend(own, me, (zeros(q), *zeros_kv()))
  for (direction, steps), block in zip(streams, incoming):
    send = lambda x, d=direction: ppermute(x, axis, _shift(plan, d, 1))
    owner = lambda s, d=direction: (me - d * s) % plan.ring_size
    visit = lambda s, block, *grads, owner=owner: attend(block, owner(s), grads)
    dq, pending = backward_stream(
      visit, send, block, dq, None, (1, steps), zeros_kv
    )
    # Home: the block seen last belongs to the device `steps` hops back.
    back = ppermute(pending, axis, _shift(plan, -direction, steps))
    dk, dv = dk + back[0], dv + back[1]
  return dq, dk, dv
