"""The per-device half of ring attention: what runs inside the shard_map.

Each of the `n` devices keeps its query shard and passes K/V shards around
the ring with `ppermute`; every step attends the local queries to the
visiting block through `pallas_fa3.parallel.partitioning.forward` and merges
the partial `(out, lse)` exactly by log-sum-exp. Causal calls use the
zig-zag layout: the sequence is cut into `2n` chunks and device `i` holds
chunks `i` and `2n-1-i`, so every step after the first is two unmasked
`c x c` blocks on every device. The backward runs the ring in reverse with
the merged out and lse; the float32 dK/dV accumulators travel with their
K/V block and one more hop brings them home.
Step by step: docs/design_notes.md#ring-attention.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from pallas_fa3.parallel import partitioning, sharding_checks
from pallas_fa3.spec import AttentionSpec
from pallas_fa3.vjp import StaticCall


@dataclasses.dataclass(frozen=True)
class RingPlan:
  """The static half of a ring call (hashable: a custom_vjp nondiff argument).

  Attributes:
    spec: the global call.
    mesh: the mesh.
    seq_axis: the mesh axis the sequence is sharded over (the ring).
    batch_axes: mesh axes sharding the batch (may be empty).
    head_axes: mesh axes sharding the heads (may be empty).
    reorder: natural-layout causal inputs are permuted to zig-zag inside.
    steps: the per-device backend calls. Causal: (own block [2c x 2c]
      causal, visiting block [c x c]); non-causal: (local queries x
      visiting block,).
  """

  spec: AttentionSpec
  mesh: Any  # a jax.sharding.Mesh or AbstractMesh
  seq_axis: str
  batch_axes: tuple[str, ...]
  head_axes: tuple[str, ...]
  reorder: bool
  steps: tuple[StaticCall, ...]

  @property
  def ring_size(self) -> int:
    return int(dict(self.mesh.shape)[self.seq_axis])

  def seq_spec(self) -> P:
    """`[b, s, h, d]` operands: batch, sequence and heads split."""
    return P(
      sharding_checks.axes_entry(self.batch_axes),
      self.seq_axis,
      sharding_checks.axes_entry(self.head_axes),
    )

  def lse_spec(self) -> P:
    """`[b, h, s]` lse: batch, heads and sequence split."""
    return P(
      sharding_checks.axes_entry(self.batch_axes),
      sharding_checks.axes_entry(self.head_axes),
      self.seq_axis,
    )


def zigzag_order(seq_len: int, ring_size: int) -> np.ndarray:
  """Token order of the zig-zag layout: `x[:, zigzag_order(s, n)]`.

  The sequence is cut into `2 * ring_size` equal chunks and device `i` holds
  chunks `i` and `2n-1-i`; sharding the permuted sequence contiguously over
  the ring axis gives every device its two chunks. `np.argsort` of the result
  is the inverse permutation.

  Raises:
    ValueError: `seq_len` is not a multiple of `2 * ring_size`.
  """
  n = int(ring_size)
  if n < 1 or seq_len % (2 * n):
    raise ValueError(
      f"seq_len={seq_len} must be a positive multiple of 2 * ring_size ="
      f" {2 * n} for the zig-zag layout"
    )
  c = seq_len // (2 * n)
  chunks = [chunk for i in range(n) for chunk in (i, 2 * n - 1 - i)]
  return np.concatenate([np.arange(ch * c, (ch + 1) * c) for ch in chunks])


# ---------------------------------------------------------------------------
# Transfers.

# Floating types sent as their raw bits (an unsigned int of the same width).
# XLA's CPU backend has no 16-bit-float collective-permute and would convert
# bf16/f16 payloads to float32 around it: twice the bytes on the wire and in
# memory. Bits are bits on every backend, and a bitcast costs nothing.
_WIRE_TYPES = {
  jnp.dtype(jnp.bfloat16): jnp.uint16,
  jnp.dtype(jnp.float16): jnp.uint16,
}


def ppermute(tree: Any, axis_name: str, perm: Sequence[tuple[int, int]]) -> Any:
  """`jax.lax.ppermute` of a pytree, 16-bit floats sent as their bits."""

  def send(x):
    wire = _WIRE_TYPES.get(jnp.dtype(x.dtype))
    if wire is None:
      return jax.lax.ppermute(x, axis_name, perm)
    bits = jax.lax.ppermute(
      jax.lax.bitcast_convert_type(x, wire), axis_name, perm
    )
    return jax.lax.bitcast_convert_type(bits, x.dtype)

  return jax.tree.map(send, tree)


# ---------------------------------------------------------------------------
# Zig-zag permutation of the local shards (natural layout, causal).


def _zigzag_perms(n: int) -> tuple[list, list]:
  """Where each natural half-shard goes: (first halves, second halves).

  Natural device `j` holds chunks `2j` and `2j+1`; chunk `ch` belongs to
  zig-zag device `ch` if `ch < n`, else `2n-1-ch`.
  """
  owner = lambda ch: ch if ch < n else 2 * n - 1 - ch
  return (
    [(j, owner(2 * j)) for j in range(n)],
    [(j, owner(2 * j + 1)) for j in range(n)],
  )


def to_zigzag(x: jax.Array, axis: int, axis_name: str, n: int) -> jax.Array:
  """Local natural shard -> local zig-zag shard (sequence along `axis`)."""
  perm0, perm1 = _zigzag_perms(n)
  h0, h1 = jnp.split(x, 2, axis=axis)
  r0 = ppermute(h0, axis_name, perm0)
  r1 = ppermute(h1, axis_name, perm1)
  # An even device receives its chunk i through perm0, an odd one its
  # chunk 2n-1-i; see _zigzag_perms.
  even = jax.lax.axis_index(axis_name) % 2 == 0
  return jnp.concatenate(
    [jnp.where(even, r0, r1), jnp.where(even, r1, r0)], axis=axis
  )


def from_zigzag(x: jax.Array, axis: int, axis_name: str, n: int) -> jax.Array:
  """Inverse of `to_zigzag`."""
  perm0, perm1 = _zigzag_perms(n)
  inverse = lambda perm: [(dst, src) for src, dst in perm]
  a, b = jnp.split(x, 2, axis=axis)
  even = jax.lax.axis_index(axis_name) % 2 == 0
  h0 = ppermute(jnp.where(even, a, b), axis_name, inverse(perm0))
  h1 = ppermute(jnp.where(even, b, a), axis_name, inverse(perm1))
  return jnp.concatenate([h0, h1], axis=axis)


# ---------------------------------------------------------------------------
# Forward.


def _lse_to_rows(lse: jax.Array) -> jax.Array:
  """[b, h, s] -> [b, s, h, 1], to weight rows of out `[b, s, h, d]`."""
  return jnp.swapaxes(lse, 1, 2)[..., None]


def _merge(
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


def _merge_rows(
  acc: tuple[jax.Array, jax.Array],
  part: tuple[jax.Array, jax.Array],
  start: Any,
) -> tuple[jax.Array, jax.Array]:
  """Merges `part` (out, lse) into the rows `[start, start + rows)` of `acc`."""
  acc_out, acc_lse = acc
  out, lse = part
  rows = out.shape[1]
  cur_out = jax.lax.dynamic_slice_in_dim(acc_out, start, rows, axis=1)
  cur_lse = jax.lax.dynamic_slice_in_dim(acc_lse, start, rows, axis=2)
  new_out, new_lse = _merge(cur_out, cur_lse, out, lse)
  return (
    jax.lax.dynamic_update_slice_in_dim(acc_out, new_out, start, axis=1),
    jax.lax.dynamic_update_slice_in_dim(acc_lse, new_lse, start, axis=2),
  )


def _rows(x: jax.Array, start: Any, size: int) -> jax.Array:
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)


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
  plan: RingPlan, q: jax.Array, k: jax.Array, v: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Local shards (zig-zag order if causal) -> (out float32, lse)."""
  n, axis = plan.ring_size, plan.seq_axis
  me = jax.lax.axis_index(axis)
  # Step s: device i holds the K/V block of device i - s (from i - 1).
  send = lambda kv: ppermute(kv, axis, [(j, (j + 1) % n) for j in range(n)])

  def first(kv, acc):
    del acc  # step 0: the own block, causal on the diagonal if causal
    out, lse = partitioning.forward(plan.steps[0], q, *kv)
    return out.astype(jnp.float32), lse

  def visit(step, kv, acc):
    k_blk, v_blk = kv
    if not plan.spec.causal:
      return _merge(*acc, *partitioning.forward(plan.steps[0], q, k_blk, v_blk))
    c, blocks = _visiting_blocks(plan, (me - step) % n, me)
    for q_start, kv_start in blocks:
      part = partitioning.forward(
        plan.steps[1],
        _rows(q, q_start, c),
        _rows(k_blk, kv_start, c),
        _rows(v_blk, kv_start, c),
      )
      acc = _merge_rows(acc, part, q_start)
    return acc

  return _run_ring(n, first, visit, send, ((k, v), None))


# ---------------------------------------------------------------------------
# Backward.


def _add_rows(acc: jax.Array, part: jax.Array, start: Any) -> jax.Array:
  rows = part.shape[1]
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
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Local shards (zig-zag order if causal) -> (dq, dk, dv) in float32."""
  n, axis = plan.ring_size, plan.seq_axis
  me = jax.lax.axis_index(axis)
  # The reverse ring: step s, device i holds the block of device i + s (from
  # i + 1) together with that block's float32 dK/dV accumulators.
  to_prev = [(j, (j - 1) % n) for j in range(n)]
  send = lambda kv: ppermute(kv, axis, to_prev)

  def pass_on(dq, dk, dv):
    # The accumulators follow their block; after the last step this hop
    # delivers them to the block's owner. XLA can start it once this step's
    # gradients are summed and let it finish under the next step.
    return dq, send((dk, dv))

  def first(kv, grads):
    dq, (dk, dv) = grads
    dq_p, dk_p, dv_p = partitioning.backward(
      plan.steps[0], q, *kv, out, lse, dout, dlse
    )
    return pass_on(dq + dq_p, dk + dk_p, dv + dv_p)

  def visit(step, kv, grads):
    if not plan.spec.causal:
      return first(kv, grads)
    k_blk, v_blk = kv
    dq, (dk, dv) = grads
    c, blocks = _visiting_blocks(plan, (me + step) % n, me)
    for q_start, kv_start in blocks:
      rows = lambda x: _rows(x, q_start, c)
      lse_rows = lambda x: jax.lax.dynamic_slice_in_dim(x, q_start, c, axis=2)
      dq_p, dk_p, dv_p = partitioning.backward(
        plan.steps[1],
        rows(q),
        _rows(k_blk, kv_start, c),
        _rows(v_blk, kv_start, c),
        rows(out),
        lse_rows(lse),
        rows(dout),
        lse_rows(dlse),
      )
      dq = _add_rows(dq, dq_p, q_start)
      dk = _add_rows(dk, dk_p, kv_start)
      dv = _add_rows(dv, dv_p, kv_start)
    return pass_on(dq, dk, dv)

  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  grads = (zeros(q), (zeros(k), zeros(v)))
  dq, (dk, dv) = _run_ring(n, first, visit, send, ((k, v), grads))
  return dq, dk, dv
