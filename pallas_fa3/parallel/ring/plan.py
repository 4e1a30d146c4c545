"""The static half of a ring call: `RingPlan`, and how it is chosen. Without
a window the classic ring (`pallas_fa3.parallel.ring.steps`) sends K/V all
the way round; with one the windowed ring (`pallas_fa3.parallel.ring.window`)
skips hidden blocks and stops K/V where the window ends. The order the ring
computes in (`RingPlan.order`) is zig-zag for causal calls (balanced) and,
where the chunks divide, for windows bounded on the right only; natural
for a left-bounded window (equal work, K/V only to the next devices); the
caller's without a mask. It may differ from the caller's order
(`RingPlan.layout`); the shards are then permuted in and out:
docs/scale_out.md#context-parallelism-ring_attention.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jax.sharding import PartitionSpec as P

from pallas_fa3.backends.base import StaticCall
from pallas_fa3.parallel import sharding_checks
from pallas_fa3.parallel.ring import blocks as ring_blocks
from pallas_fa3.parallel.ring.blocks import BlockPlan
from pallas_fa3.spec import AttentionSpec


@dataclasses.dataclass(frozen=True)
class RingPlan:
  """The static half of a ring call (hashable: a custom_vjp nondiff argument).

  Attributes:
    spec: the global call.
    mesh: the mesh.
    seq_axis: the mesh axis the sequence is sharded over (the ring).
    batch_axes: mesh axes sharding the batch (may be empty).
    head_axes: mesh axes sharding the heads (may be empty).
    layout: the caller's token order, "natural" or "zigzag".
    order: the order the ring computes in; the shards are permuted
      between the two when they differ.
    steps: the classic ring's backend calls. Causal: (own block [2c x 2c]
      causal, visiting block [c x c]); non-causal: (local queries x
      visiting block,). Empty for the windowed ring.
    blocks: the windowed ring's plan, or None for the classic ring.
  """

  spec: AttentionSpec
  mesh: Any  # a jax.sharding.Mesh or AbstractMesh
  seq_axis: str
  batch_axes: tuple[str, ...]
  head_axes: tuple[str, ...]
  layout: str
  order: str
  steps: tuple[StaticCall, ...]
  blocks: BlockPlan | None = None

  @property
  def ring_size(self) -> int:
    return int(dict(self.mesh.shape)[self.seq_axis])

  @property
  def call(self) -> StaticCall:
    """The call of the whole ring (`pallas_fa3.vjp.call`'s static half):
    the backend of its steps, the plan in `ring`."""
    first = self.steps[0] if self.steps else None
    if first is None:
      crop = self.blocks.full or self.blocks.partial[0][1]
      first = crop.call
    return StaticCall(self.spec, first.backend, first.config, ring=self)

  @property
  def reorder(self) -> bool:
    """The shards are permuted between the caller's order and the ring's."""
    return self.layout != self.order

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

  def ids_spec(self) -> P:
    """`[b, s]` segment ids: batch and sequence split."""
    return P(sharding_checks.axes_entry(self.batch_axes), self.seq_axis)

  def sinks_spec(self) -> P:
    """`[b, heads_q]` float32 sinks: batch and heads split."""
    return P(
      sharding_checks.axes_entry(self.batch_axes),
      sharding_checks.axes_entry(self.head_axes),
    )

  def describe(self) -> str:
    """One line: the scheme, its order and how far K/V travel."""
    n = self.ring_size
    where = f"ring over mesh axis {self.seq_axis!r} ({n} devices)"
    perm = (
      f", permuted {self.layout} -> {self.order} and back"
      if self.reorder
      else ""
    )
    if self.blocks is None:
      kind = "causal" if self.spec.causal else "full"
      return (
        f"{where}: {kind} attention in {self.order} order{perm}; K/V go"
        f" round the whole ring ({n - 1} steps)"
      )
    fwd, bwd = self.blocks.hops
    return (
      f"{where}: window {self.spec.window_size} in {self.order} order{perm};"
      f" K/V travel {fwd} step(s) forward and {bwd} backward of"
      f" {n - 1}, blocks the window hides are skipped"
    )


def positional(spec: AttentionSpec) -> bool:
  """Whether token positions matter (causal or a window): the order of the
  tokens then changes the result."""
  return spec.causal or spec.window_size is not None


def choose_order(spec: AttentionSpec, layout: str, n: int) -> str:
  """The order the ring computes in (see the module docstring)."""
  if not positional(spec):
    return layout  # no mask: the order changes nothing
  if spec.window_size is None:
    return "zigzag"  # causal: the balanced classic ring
  if spec.window_left is not None:
    return "natural"
  chunks = spec.seq_q == spec.seq_kv and spec.seq_q % (2 * n) == 0
  return "zigzag" if chunks else "natural"


def needs_chunks(spec: AttentionSpec, layout: str, n: int) -> bool:
  """Whether the sequence must split into 2n zig-zag chunks (the caller's
  or the ring's order is zig-zag, and positions matter)."""
  if not positional(spec):
    return False
  return layout == "zigzag" or choose_order(spec, layout, n) == "zigzag"


def _local_spec(
  spec: AttentionSpec,
  mesh: Any,
  batch_axes: tuple[str, ...],
  head_axes: tuple[str, ...],
) -> AttentionSpec:
  ways = lambda axes: math.prod(dict(mesh.shape)[a] for a in axes)
  nh = ways(head_axes)
  return dataclasses.replace(
    spec,
    batch=spec.batch // ways(batch_axes),
    heads_q=spec.heads_q // nh,
    heads_kv=spec.heads_kv // nh,
    sinks=False,  # merged once, after the ring
  )


def _step_call(
  spec: AttentionSpec,
  seq_q: int,
  seq_kv: int,
  causal: bool,
  implementation: str | None,
  config: Any,
) -> StaticCall:
  step = dataclasses.replace(spec, seq_q=seq_q, seq_kv=seq_kv, causal=causal)
  return ring_blocks.resolve_call(step, implementation, config)


def _classic_steps(
  local: AttentionSpec, n: int, implementation: str | None, config: Any
) -> tuple[StaticCall, ...]:
  """The per-device calls: causal (own block, c x c block), else (block,)."""
  if local.causal:
    c = local.seq_q // (2 * n)
    return (
      _step_call(local, 2 * c, 2 * c, True, implementation, config),
      _step_call(local, c, c, False, implementation, config),
    )
  return (
    _step_call(
      local, local.seq_q // n, local.seq_kv // n, False, implementation, config
    ),
  )


def make_plan(
  spec: AttentionSpec,
  mesh: Any,
  seq_axis: str,
  batch_axes: tuple[str, ...],
  head_axes: tuple[str, ...],
  layout: str,
  implementation: str | None,
  config: Any,
  order: str | None = None,
) -> RingPlan:
  """The plan of a checked call (`ring_checks` validated its arguments).

  `order`: None chooses (`choose_order`); "natural" / "zigzag" forces the
  windowed ring's order (for measurements; the classic ring ignores it).
  """
  n = int(dict(mesh.shape)[seq_axis])
  local = _local_spec(spec, mesh, batch_axes, head_axes)
  chosen = choose_order(spec, layout, n) if order is None else order
  if spec.window_size is None:
    chosen = choose_order(spec, layout, n)
    steps = _classic_steps(local, n, implementation, config)
    blocks = None
  else:
    steps = ()
    blocks = ring_blocks.block_plan(
      spec, local, chosen, n, implementation, config
    )
  return RingPlan(
    spec, mesh, seq_axis, batch_axes, head_axes, layout, chosen, steps, blocks
  )
