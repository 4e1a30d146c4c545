"""One device's whole ring call, the caller's shards in and its shards out,
shared by `ring_attention` (its shard_map bodies) and sequence-sharded
`flash_attention` (the partitioner's per-device function): it permutes the
shards between the caller's order and the ring's (`RingPlan.reorder`),
runs the classic ring (`ring_steps`) or the windowed one (`ring_window`),
and adds the sinks once, after the ring has merged every block:
docs/design_notes.md#ring-attention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from pallas_fa3.parallel import sharding_checks
from pallas_fa3.parallel.ring import (
  layout as ring_layout,
  steps as ring_steps,
  window as ring_window,
)
from pallas_fa3.parallel.ring.plan import RingPlan
from pallas_fa3.segments import SegmentIds


def permute(plan: RingPlan, inward: bool, *xs: jax.Array) -> tuple:
  """Caller's order <-> the ring's for local shards (sequence on axis 1, or
  on axis 2 for a 3-D lse)."""
  if not plan.reorder:
    return xs
  to_zigzag = (plan.order == "zigzag") == inward
  fn = ring_layout.to_zigzag if to_zigzag else ring_layout.from_zigzag
  return tuple(
    fn(x, 2 if x.ndim == 3 else 1, plan.seq_axis, plan.ring_size) for x in xs
  )


def with_sinks(
  out: jax.Array, lse: jax.Array, sinks: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Adds one sink logit per (batch, head) row to merged results.

  `out` float32 `[b, s, h, d]`, `lse` `[b, h, s]`, `sinks` `[b, h]`.
  """
  total = jnp.logaddexp(lse, sinks.astype(jnp.float32)[..., None])
  weight = jnp.exp(lse - total)  # 0 where no key was seen (lse = -inf)
  return out * jnp.swapaxes(weight, 1, 2)[..., None], total


def _ids(ids: tuple) -> SegmentIds | None:
  return SegmentIds(*ids) if ids else None


def local_forward(
  plan: RingPlan,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  sinks: jax.Array | None = None,
  ids: tuple = (),
) -> tuple[jax.Array, jax.Array]:
  """(out in q's dtype, lse float32) of this device's shards.

  `sinks`: float32 `[b, heads_q]` (local) or None; `ids`: () or the local
  `(q_ids, kv_ids)`, in the caller's order like q, k, v.
  """
  q, k, v, *ids = permute(plan, True, q, k, v, *ids)
  engine = (
    ring_steps.ring_forward
    if plan.blocks is None
    else (ring_window.window_forward)
  )
  out, lse = engine(plan, q, k, v, _ids(ids))
  if sinks is not None:
    out, lse = with_sinks(out, lse, sinks)
  return permute(plan, False, out.astype(plan.spec.dtype), lse)


def local_backward(
  plan: RingPlan,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  out: jax.Array,
  lse: jax.Array,
  dout: jax.Array,
  dlse: jax.Array,
  ids: tuple = (),
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(dq, dk, dv) in q's dtype of this device's shards (sinks are in lse)."""
  args = permute(plan, True, q, k, v, out, lse, dout, dlse, *ids)
  engine = (
    ring_steps.ring_backward
    if plan.blocks is None
    else (ring_window.window_backward)
  )
  grads = engine(plan, *args[:7], _ids(args[7:]))
  return permute(plan, False, *(g.astype(plan.spec.dtype) for g in grads))


# ---------------------------------------------------------------------------
# The whole ring over its mesh: one shard_map per pass. Every mesh axis is
# manual: the body sees one device's batch/head/sequence shard, and each
# step's backend call runs on it as is.


def _shard_map(
  plan: RingPlan, body: Callable[..., Any], in_specs: tuple, out_specs: Any
) -> Callable[..., Any]:
  return jax.shard_map(
    body,
    mesh=plan.mesh,
    in_specs=in_specs,
    out_specs=out_specs,
    check_vma=False,
  )


def _fit(plan: RingPlan, xs: tuple, specs: tuple) -> list[jax.Array]:
  return [
    sharding_checks.fit_explicit(x, NamedSharding(plan.mesh, spec))
    for x, spec in zip(xs, specs)
  ]


def ring_forward_global(
  plan: RingPlan,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  sinks: jax.Array | None,
  ids: tuple,
) -> tuple[jax.Array, jax.Array]:
  """(out, lse) of the ring on global arrays laid out as `plan` says
  (`sinks`: None or float32 `[b, heads_q]`; `ids`: () or (q_ids, kv_ids))."""
  has_sinks = sinks is not None

  def body(q, k, v, *rest):
    sinks = rest[0] if has_sinks else None
    return local_forward(plan, q, k, v, sinks, rest[has_sinks:])

  seq, lse = plan.seq_spec(), plan.lse_spec()
  sinks_args = (sinks,) if has_sinks else ()
  specs = (seq,) * 3 + (plan.sinks_spec(),) * has_sinks
  specs += (plan.ids_spec(),) * len(ids)
  args = _fit(plan, (q, k, v, *sinks_args, *ids), specs)
  return _shard_map(plan, body, specs, (seq, lse))(*args)


def ring_backward_global(
  plan: RingPlan,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  out: jax.Array,
  lse: jax.Array,
  dout: jax.Array,
  dlse: jax.Array,
  ids: tuple,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(dq, dk, dv) of the ring from the residuals (the caller's layout);
  the sinks are in the lse, their gradient `pallas_fa3.vjp`'s."""

  def body(q, k, v, out, lse, dout, dlse, *ids):
    return local_backward(plan, q, k, v, out, lse, dout, dlse, ids)

  seq, lse_spec = plan.seq_spec(), plan.lse_spec()
  specs = (seq,) * 3 + (seq, lse_spec, seq, lse_spec)
  specs += (plan.ids_spec(),) * len(ids)
  args = _fit(plan, (q, k, v, out, lse, dout, dlse, *ids), specs)
  return tuple(_shard_map(plan, body, specs, (seq,) * 3)(*args))
