"""The per-device half of ring attention: what runs inside the shard_map.

Algorithm. Each of the `n` devices of the ring keeps its query shard and
passes key/value shards around the ring with `jax.lax.ppermute`; at every
step it attends its queries to the visiting block with the backend
`flash_attention` would use (`pallas_fa3.partitioning.forward`, the same
`(out, lse)` residuals), and the partial results are merged exactly by
log-sum-exp. No device holds more than two K/V shards at a time.

Causal load balancing (zig-zag layout). With contiguous shards, device n-1
would attend to every block and device 0 to one. Instead the sequence is cut
into `2n` chunks of `c = seq / (2n)` tokens and device `i` holds chunks `i`
and `2n-1-i` (its shard is `[chunk i, chunk 2n-1-i]`). Then, at ring step
`s`, device `i` sees the block of device `j = i - s (mod n)`:

  * `s = 0` (`j = i`): causal attention of its own shard (3 of the 4 c x c
    sub-blocks visible, two of them half);
  * `j < i`: both query chunks see key chunk `j` in full, neither sees
    `2n-1-j`;
  * `j > i`: only query chunk `2n-1-i` sees anything, and it sees both key
    chunks in full.

So every step after the first is exactly two unmasked c x c blocks on every
device -- the fully masked ones are never computed -- and all devices do the
same work: `2 c^2` scores per step. (Non-causal attention needs no
balancing: every step is the full local block.)

Backward, FlashAttention-2 style: every step's backward gets the global
(merged) out and lse, so `P = exp(S - lse)` is the true softmax and
`delta = rowsum(dO * O) - dlse`. The ring runs in the reverse direction and
the float32 dK/dV accumulators travel with their K/V block; one more hop
brings them home. Nothing gathers the full sequence.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from pallas_fa3 import partitioning
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

  spec: Any
  mesh: Any
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
    return P(partitioning.axes_entry(self.batch_axes), self.seq_axis,
             partitioning.axes_entry(self.head_axes))

  def lse_spec(self) -> P:
    """`[b, h, s]` lse: batch, heads and sequence split."""
    return P(partitioning.axes_entry(self.batch_axes),
             partitioning.axes_entry(self.head_axes), self.seq_axis)


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
        f" {2 * n} for the zig-zag layout")
  c = seq_len // (2 * n)
  chunks = [chunk for i in range(n) for chunk in (i, 2 * n - 1 - i)]
  return np.concatenate([np.arange(ch * c, (ch + 1) * c) for ch in chunks])


# ---------------------------------------------------------------------------
# Zig-zag permutation of the local shards (natural layout, causal).


def _zigzag_perms(n: int) -> tuple[list, list]:
  """Where each natural half-shard goes: (first halves, second halves).

  Natural device `j` holds chunks `2j` and `2j+1`; chunk `ch` belongs to
  zig-zag device `ch` if `ch < n`, else `2n-1-ch`.
  """
  owner = lambda ch: ch if ch < n else 2 * n - 1 - ch
  return ([(j, owner(2 * j)) for j in range(n)],
          [(j, owner(2 * j + 1)) for j in range(n)])


def to_zigzag(x, axis: int, axis_name: str, n: int):
  """Local natural shard -> local zig-zag shard (sequence along `axis`)."""
  perm0, perm1 = _zigzag_perms(n)
  h0, h1 = jnp.split(x, 2, axis=axis)
  r0 = jax.lax.ppermute(h0, axis_name, perm0)
  r1 = jax.lax.ppermute(h1, axis_name, perm1)
  # An even device receives its chunk i through perm0, an odd one its
  # chunk 2n-1-i; see _zigzag_perms.
  even = jax.lax.axis_index(axis_name) % 2 == 0
  return jnp.concatenate([jnp.where(even, r0, r1), jnp.where(even, r1, r0)],
                         axis=axis)


def from_zigzag(x, axis: int, axis_name: str, n: int):
  """Inverse of `to_zigzag`."""
  perm0, perm1 = _zigzag_perms(n)
  inverse = lambda perm: [(dst, src) for src, dst in perm]
  a, b = jnp.split(x, 2, axis=axis)
  even = jax.lax.axis_index(axis_name) % 2 == 0
  h0 = jax.lax.ppermute(jnp.where(even, a, b), axis_name, inverse(perm0))
  h1 = jax.lax.ppermute(jnp.where(even, b, a), axis_name, inverse(perm1))
  return jnp.concatenate([h0, h1], axis=axis)


# ---------------------------------------------------------------------------
# Forward.


def _lse_to_rows(lse):
  """[b, h, s] -> [b, s, h, 1], to weight rows of out `[b, s, h, d]`."""
  return jnp.swapaxes(lse, 1, 2)[..., None]


def _merge(out_a, lse_a, out_b, lse_b):
  """Exact log-sum-exp merge of two partial results over disjoint keys.

  `out = w_a out_a + w_b out_b` with `w = exp(lse_part - lse)`; a part whose
  rows saw no key has lse = -inf and weight 0. Rows that no part has seen
  yet stay out = 0, lse = -inf (the reference is 0 there, not -inf, so no
  NaN appears).
  """
  lse = jnp.logaddexp(lse_a, lse_b)
  ref = jnp.where(jnp.isneginf(lse), 0.0, lse)
  w_a, w_b = jnp.exp(lse_a - ref), jnp.exp(lse_b - ref)
  out = (_lse_to_rows(w_a) * out_a.astype(jnp.float32)
         + _lse_to_rows(w_b) * out_b.astype(jnp.float32))
  return out, lse


def _merge_rows(acc, part, start):
  """Merges `part` (out, lse) into the rows `[start, start + rows)` of `acc`."""
  acc_out, acc_lse = acc
  out, lse = part
  rows = out.shape[1]
  cur_out = jax.lax.dynamic_slice_in_dim(acc_out, start, rows, axis=1)
  cur_lse = jax.lax.dynamic_slice_in_dim(acc_lse, start, rows, axis=2)
  new_out, new_lse = _merge(cur_out, cur_lse, out, lse)
  return (jax.lax.dynamic_update_slice_in_dim(acc_out, new_out, start, axis=1),
          jax.lax.dynamic_update_slice_in_dim(acc_lse, new_lse, start, axis=2))


def _rows(x, start, size):
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)


def _visiting_blocks(plan: RingPlan, owner, me):
  """The unmasked c x c blocks of a causal step: [(q start, kv start), ...].

  Query chunk `2n-1-i` (rows c..2c) always sees key chunk `j` (kv rows
  0..c); the second block is (chunk i, chunk j) when j < i, else
  (chunk 2n-1-i, chunk 2n-1-j). See the module docstring.
  """
  c = plan.spec.seq_q // (2 * plan.ring_size)
  second = jnp.where(owner < me, 0, c)
  return c, ((c, 0), (second, second))


def ring_forward(plan: RingPlan, q, k, v):
  """Local shards (zig-zag order if causal) -> (out float32, lse)."""
  n, axis = plan.ring_size, plan.seq_axis
  me = jax.lax.axis_index(axis)
  to_next = [(j, (j + 1) % n) for j in range(n)]
  acc = None
  kv = (k, v)
  for step in range(n):
    # Issue the transfer of the block for the next step before attending to
    # this one: they do not depend on each other, so XLA (which turns each
    # ppermute into an async collective-permute-start/-done pair on GPU)
    # schedules the copy to run under this step's attention. On CPU the
    # collective-permute is synchronous and nothing overlaps.
    next_kv = jax.lax.ppermute(kv, axis, to_next) if step + 1 < n else None
    k_blk, v_blk = kv
    if not plan.spec.causal:
      part = partitioning.forward(plan.steps[0], q, k_blk, v_blk)
      acc = part if acc is None else _merge(*acc, *part)
    elif step == 0:
      out, lse = partitioning.forward(plan.steps[0], q, k_blk, v_blk)
      acc = (out.astype(jnp.float32), lse)
    else:
      c, blocks = _visiting_blocks(plan, (me - step) % n, me)
      for q_start, kv_start in blocks:
        part = partitioning.forward(plan.steps[1], _rows(q, q_start, c),
                                    _rows(k_blk, kv_start, c),
                                    _rows(v_blk, kv_start, c))
        acc = _merge_rows(acc, part, q_start)
    kv = next_kv
  out, lse = acc
  return out, lse


# ---------------------------------------------------------------------------
# Backward.


def _add_rows(acc, part, start):
  rows = part.shape[1]
  cur = jax.lax.dynamic_slice_in_dim(acc, start, rows, axis=1)
  return jax.lax.dynamic_update_slice_in_dim(
      acc, cur + part.astype(jnp.float32), start, axis=1)


def ring_backward(plan: RingPlan, q, k, v, out, lse, dout, dlse):
  """Local shards (zig-zag order if causal) -> (dq, dk, dv) in float32."""
  n, axis = plan.ring_size, plan.seq_axis
  me = jax.lax.axis_index(axis)
  # The reverse ring: receive from i+1, send to i-1. At step s device i
  # holds the block of device i+s, with that block's dK/dV accumulators.
  to_prev = [(j, (j - 1) % n) for j in range(n)]
  f32 = lambda x: jnp.zeros(x.shape, jnp.float32)
  dq, dkv = f32(q), (f32(k), f32(v))
  kv = (k, v)
  for step in range(n):
    # As in the forward: the next block's transfer is issued first.
    next_kv = jax.lax.ppermute(kv, axis, to_prev) if step + 1 < n else None
    k_blk, v_blk = kv
    dk_acc, dv_acc = dkv
    if not plan.spec.causal or step == 0:
      dq_p, dk_p, dv_p = partitioning.backward(
          plan.steps[0], q, k_blk, v_blk, out, lse, dout, dlse)
      dq, dk_acc, dv_acc = dq + dq_p, dk_acc + dk_p, dv_acc + dv_p
    else:
      c, blocks = _visiting_blocks(plan, (me + step) % n, me)
      for q_start, kv_start in blocks:
        lse_rows = jax.lax.dynamic_slice_in_dim(lse, q_start, c, axis=2)
        dlse_rows = jax.lax.dynamic_slice_in_dim(dlse, q_start, c, axis=2)
        dq_p, dk_p, dv_p = partitioning.backward(
            plan.steps[1], _rows(q, q_start, c), _rows(k_blk, kv_start, c),
            _rows(v_blk, kv_start, c), _rows(out, q_start, c), lse_rows,
            _rows(dout, q_start, c), dlse_rows)
        dq = _add_rows(dq, dq_p, q_start)
        dk_acc = _add_rows(dk_acc, dk_p, kv_start)
        dv_acc = _add_rows(dv_acc, dv_p, kv_start)
    # The accumulators follow their block; after the last step this hop
    # delivers them to the block's owner. XLA can start it as soon as this
    # step's gradients are summed and finish it under the next step.
    dkv = jax.lax.ppermute((dk_acc, dv_acc), axis, to_prev)
    kv = next_kv
  return dq, dkv[0], dkv[1]
