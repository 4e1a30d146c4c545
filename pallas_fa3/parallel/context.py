"""Sequence-sharded `flash_attention`: context parallelism from the layout.
Under `jax.jit` with q (and k, v) sharded along the sequence over one mesh
axis, the partitioner (`pallas_fa3.parallel.partitioning`) runs each
device's half of ring attention (`pallas_fa3.parallel.ring.local`) instead
of refusing the layout; here are the checks of which layouts and options
it serves (the rest refused, naming them), its ring plan, and `explain`,
which says which scheme a call with given shardings runs:
docs/scale_out.md#sequence-sharded-flash_attention.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax

from pallas_fa3 import backends
from pallas_fa3.backends import Implementation
from pallas_fa3.backends.base import StaticCall
from pallas_fa3.parallel.ring import (
  checks as ring_checks,
  local as ring_local,
  plan as ring_plan,
)
from pallas_fa3.parallel.ring.plan import RingPlan
from pallas_fa3.parallel.sharding_checks import (
  CHECKED,
  check_shardings,
  known_sharding,
  kv_replicated_over_heads,
  mesh_axes,
  spec_entries,
)
from pallas_fa3.spec import AttentionSpec, make_spec

_SEQ = 1  # the sequence axis of q, k, v


def _seq_axes(shardings: dict[str, tuple]) -> tuple[str, ...]:
  """The mesh axes of q's sequence split, checked against k's and v's."""
  q_axes = mesh_axes(shardings.get("q", (None,) * 4)[_SEQ])
  for name in CHECKED[1:]:
    axes = mesh_axes(shardings.get(name, (None,) * 4)[_SEQ])
    if axes and axes != q_axes:
      where = f"over mesh axes {q_axes}" if q_axes else "not at all"
      raise ValueError(
        f"{name} is sharded along its sequence axis (axis 1) over mesh axes"
        f" {axes}, but q {where}: context parallelism needs q split along"
        f" the sequence and {name} split the same way (or replicated)"
      )
  return q_axes


def check_ring(
  spec: AttentionSpec, backend: Any, axis_sizes: dict[str, int], axes: tuple
) -> None:
  """Refuses a sequence-sharded call the ring cannot serve, naming why."""
  if len(axes) != 1:
    raise ValueError(
      f"q is sharded along its sequence axis (axis 1) over mesh axes {axes};"
      " context parallelism runs a ring over one mesh axis: shard the"
      " sequence over one axis (and batch or heads over the others)"
    )
  for option, on in (
    ("fp8", spec.fp8 is not None),
    ("stable_max", spec.stable_max is not None),
  ):
    if on:
      raise NotImplementedError(
        f"{option} with q sharded along its sequence axis: the ring merges"
        f" blocks by their lse, which {option} does not compute the same"
        " way; replicate the sequence or call without it"
      )
  if spec.flex is not None:
    names = ", ".join(spec.flex.names())
    raise NotImplementedError(
      f"{names} with q sharded along its sequence axis: the ring's blocks"
      " would need each function's positions shifted per step (and a bias"
      " or block mask cut per block), which is not implemented; shard the"
      " batch or the heads (both run these shard-locally), or replicate"
      " the sequence"
    )
  if not backend.backward_uses_lse:
    raise NotImplementedError(
      f"implementation={backend.name!r} cannot run with q sharded along its"
      " sequence axis: the ring hands every block's backward the merged"
      " lse, which this backend ignores; use 'blockwise' (or None)"
    )
  n = axis_sizes[axes[0]]
  chunks = ring_plan.needs_chunks(spec, "natural", n)
  ring_checks.check_lengths(spec, n, axes[0], chunks)


def check(
  call: StaticCall, axis_sizes: dict[str, int], shardings: dict[str, tuple]
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
  """(batch axes, head axes, sequence axes) of a call with these operand
  shardings, checked (`sharding_checks.check_shardings` for batch and
  heads, `check_ring` for a sequence split).

  Raises:
    ValueError / NotImplementedError naming the argument or option.
  """
  seq = _seq_axes(shardings)
  batch, heads = check_shardings(call.spec, axis_sizes, shardings)
  if seq and kv_replicated_over_heads(call.spec, heads):
    raise NotImplementedError(
      f"q is sharded along its sequence axis and over heads on mesh axes"
      f" {heads}, with heads_kv=1 (MQA): the ring passes K/V shards of"
      " whole kv heads around, and one kv head cannot be split; shard"
      " the heads or the sequence, not both"
    )
  if seq:
    check_ring(call.spec, call.backend, axis_sizes, seq)
  return batch, heads, seq


def check_array_shardings(call: StaticCall, **arrays: Any) -> None:
  """Runs `check` at trace time on the layouts known then (concrete arrays,
  `Explicit` axes); the partitioner runs it at compile time otherwise."""
  sizes: dict[str, int] = {}
  shardings: dict[str, tuple] = {}
  for name, x in arrays.items():
    sharding = known_sharding(x)
    if sharding is not None:
      sizes.update(dict(sharding.mesh.shape))
      shardings[name] = spec_entries(sharding)
  if shardings:
    check(call, sizes, shardings)


def plan(
  call: StaticCall,
  mesh: Any,
  batch_axes: tuple[str, ...],
  head_axes: tuple[str, ...],
  seq_axes: tuple[str, ...],
) -> RingPlan:
  """The ring of a checked sequence-sharded call (natural token order)."""
  return ring_plan.make_plan(
    call.spec,
    mesh,
    seq_axes[0],
    batch_axes,
    head_axes,
    "natural",
    call.backend.name,
    call.config,
  )


def runner(
  call: StaticCall,
  mesh: Any,
  axes: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]],
  backward: bool,
) -> Callable[..., tuple]:
  """The per-device function of the forward op `(q, k, v, [sinks], [q_ids,
  kv_ids]) -> (out, lse)` or the backward op `(q, k, v, out, lse, dout,
  dlse, [sinks], [ids]) -> (dq, dk, dv)` on local shards: the ring."""
  ring = plan(call, mesh, *axes)
  sinks = int(call.spec.sinks)

  if backward:

    def run_backward(*args: jax.Array) -> tuple:
      # The sinks are in the lse; their gradient is vjp.py's.
      ids = tuple(args[7 + sinks :])
      return ring_local.local_backward(ring, *args[:7], ids)

    return run_backward

  def run_forward(q, k, v, *rest):
    s = rest[0] if sinks else None
    return ring_local.local_forward(ring, q, k, v, s, tuple(rest[sinks:]))

  return run_forward


def explain(
  q: Any,
  k: Any,
  v: Any,
  *,
  implementation: Implementation | None = None,
  config: Any = None,
  **options: Any,
) -> str:
  """Which scheme `flash_attention(q, k, v, **options)` runs with the
  shardings q, k, v carry (arrays or `jax.ShapeDtypeStruct`s with a
  `NamedSharding`): one line, or the reason it is refused.

  Example (8 devices):
    >>> seq = NamedSharding(mesh, P(None, "seq"))       # doctest: +SKIP
    >>> x = jax.ShapeDtypeStruct((1, 8192, 8, 64), "bfloat16",
    ...                          sharding=seq)           # doctest: +SKIP
    >>> explain(x, x, x, causal=True, window_size=(1024, 0))  # doctest: +SKIP
    "ring over mesh axis 'seq' (8 devices): window (1024, None) in natural
    order; K/V travel 1 step(s) forward and 0 backward of 7, ..."
  """
  spec = make_spec(
    q,
    k,
    v,
    causal=options.get("causal", False),
    softmax_scale=options.get("softmax_scale"),
    window_size=options.get("window_size"),
    softcap=options.get("softcap"),
    sinks=options.get("sinks") is not None,
    segmented=options.get("segment_ids") is not None,
  )
  try:
    backend, config = backends.resolve(spec, implementation, config)
  except (NotImplementedError, TypeError) as e:
    return f"refused: {e}"
  call = StaticCall(spec, backend, config)
  arrays = dict(q=q, k=k, v=v)
  mesh, shardings = None, {}
  for name, x in arrays.items():
    sharding = known_sharding(x) or getattr(x, "sharding", None)
    if getattr(sharding, "mesh", None) is not None:
      mesh = sharding.mesh
      shardings[name] = spec_entries(sharding)
  if mesh is None:
    return f"one device (or replicated): {backend.name} on the whole call"
  try:
    batch, heads, seq = check(call, dict(mesh.shape), shardings)
    shard = "".join(
      f", {what} split {math.prod(dict(mesh.shape)[a] for a in axes)} ways"
      for what, axes in (("batch", batch), ("heads", heads))
      if axes
    )
    if not seq:
      return f"shard-local {backend.name} on every device{shard}; no collective"
    return f"{plan(call, mesh, batch, heads, seq).describe()}{shard}"
  except (ValueError, NotImplementedError) as e:
    return f"refused: {e}"
