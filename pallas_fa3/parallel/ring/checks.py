"""Validation of `ring_attention`'s (and `ulysses_attention`'s) arguments,
every check raising naming the argument: the mesh and `seq_axis`, the
`batch_axes` / `head_axes`, sequence lengths that the ring (or the zig-zag
chunks) cannot divide, the layout, and a known batch/head split that the
plan would gather (a backend that cannot serve a ring step is refused when
`pallas_fa3.parallel.ring.plan` resolves its calls):
docs/scale_out.md#context-parallelism-ring_attention.
"""

from __future__ import annotations

import math
from typing import Any

from jax.sharding import AbstractMesh, Mesh

from pallas_fa3 import backends
from pallas_fa3.parallel import sharding_checks
from pallas_fa3.parallel.ring.plan import RingPlan
from pallas_fa3.prepare import prepare
from pallas_fa3.spec import AttentionSpec, check_bool

LAYOUTS: tuple[str, ...] = ("natural", "zigzag")


def check_call(
  q: Any,
  k: Any,
  v: Any,
  mesh: Any,
  seq_axis: Any,
  *,
  causal: bool,
  softmax_scale: float | None,
  window_size: Any,
  softcap: float | None,
  sinks: Any,
  segment_ids: Any,
  implementation: str | None,
  return_lse: bool,
) -> tuple[AttentionSpec, Any, Any, str | None, bool, int]:
  """The checks a sequence-parallel call shares: (spec, sinks, segment_ids,
  implementation, return_lse, the size of `seq_axis`), the arguments
  checked by `flash_attention`'s one check (`prepare.prepare`), then the
  mesh."""
  spec, sinks, segment_ids, _ = prepare(
    q,
    k,
    v,
    causal=causal,
    softmax_scale=softmax_scale,
    window_size=window_size,
    softcap=softcap,
    sinks=sinks,
    segment_ids=segment_ids,
  )
  implementation = backends.check_implementation(implementation)
  return_lse = check_bool("return_lse", return_lse)
  n = check_mesh(mesh, seq_axis)
  return spec, sinks, segment_ids, implementation, return_lse, n


def check_batch_head_axes(
  batch_axes: Any, head_axes: Any, mesh: Any, seq_axis: str, spec: AttentionSpec
) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(batch_axes, head_axes) as tuples of mesh axes other than `seq_axis`
  (and each other) that split the batch and whole GQA groups."""
  batch_axes = check_axes(
    "batch_axes", batch_axes, mesh, (seq_axis,), spec.batch, "the batch"
  )
  head_axes = check_axes(
    "head_axes",
    head_axes,
    mesh,
    (seq_axis,) + batch_axes,
    spec.heads_kv,
    "heads_kv (whole GQA groups per device)",
  )
  return batch_axes, head_axes


def check_mesh(mesh: Any, seq_axis: Any) -> int:
  """The ring size: the size of `seq_axis`, an axis of `mesh`."""
  if not isinstance(mesh, (Mesh, AbstractMesh)):
    raise TypeError(
      f"mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh((8,),"
      f" ('seq',))); got {type(mesh).__name__}"
    )
  if seq_axis not in mesh.axis_names:
    raise ValueError(
      f"seq_axis={seq_axis!r} is not an axis of the mesh; its axes are"
      f" {tuple(mesh.axis_names)}"
    )
  return int(dict(mesh.shape)[seq_axis])


def check_axes(
  name: str,
  axes: Any,
  mesh: Mesh | AbstractMesh,
  taken: tuple[str, ...],
  dim: int,
  what: str,
) -> tuple[str, ...]:
  """Validates `batch_axes`/`head_axes`: mesh axes, unused, dividing `dim`."""
  if axes is None:
    return ()
  axes = (axes,) if isinstance(axes, str) else axes
  if not (
    isinstance(axes, (tuple, list)) and all(isinstance(a, str) for a in axes)
  ):
    raise TypeError(
      f"{name} must be None, a mesh axis name or a tuple of them; got {axes!r}"
    )
  axes = tuple(axes)
  for axis in axes:
    if axis not in mesh.axis_names:
      raise ValueError(
        f"{name}={axes!r}: {axis!r} is not an axis of the mesh; its axes"
        f" are {tuple(mesh.axis_names)}"
      )
    if axis in taken or axes.count(axis) > 1:
      raise ValueError(
        f"{name}={axes!r}: mesh axis {axis!r} is used twice (seq_axis and"
        f" the batch/head axes must be distinct)"
      )
  ways = math.prod(dict(mesh.shape)[a] for a in axes)
  if dim % ways:
    raise ValueError(
      f"{name}={axes!r} splits {what} {ways} ways, but {what} is {dim}"
    )
  return axes


def check_known_layout(plan: RingPlan, **arrays: Any) -> None:
  """Refuses a batch/head split (known at trace time) that `plan` would gather."""
  declared = {
    0: ("batch_axes", plan.batch_axes),
    2: ("head_axes", plan.head_axes),
  }
  for name, x in arrays.items():
    sharding = sharding_checks.known_sharding(x)
    if sharding is None:
      continue
    entries = sharding_checks.spec_entries(sharding)
    for axis, (arg, axes) in declared.items():
      split = sharding_checks.mesh_axes(entries[axis])
      if split and split != axes:
        raise ValueError(
          f"{name} is sharded along {'batch' if axis == 0 else 'heads'}"
          f" over mesh axes {split}, but {arg}={axes or None}: pass"
          f" {arg}={split!r} (otherwise every device would gather it)"
        )
    if sharding_checks.mesh_axes(entries[3]):
      raise ValueError(
        f"{name} is sharded along head_dim (axis 3) over mesh axes"
        f" {sharding_checks.mesh_axes(entries[3])}; ring_attention splits"
        " batch, sequence and heads only"
      )


def check_lengths(
  spec: AttentionSpec, n: int, seq_axis: str, chunks: bool
) -> None:
  """Sequence lengths in whole shards (whole zig-zag chunks if `chunks`),
  and equal lengths if causal."""
  multiple, why = (
    (2 * n, "zig-zag chunks: 2 per device")
    if chunks
    else (n, "one shard per device")
  )
  for name, length in (("q", spec.seq_q), ("k", spec.seq_kv)):
    if length % multiple:
      raise ValueError(
        f"{name} has sequence length {length}, not a multiple of {multiple}"
        f" ({why} over mesh axis {seq_axis!r} of size {n})"
      )
  if spec.causal and spec.seq_q != spec.seq_kv:
    raise ValueError(
      f"causal ring attention needs q and k of the same sequence length;"
      f" got q: {spec.seq_q}, k: {spec.seq_kv}"
    )


def check_layout(layout: Any) -> str:
  """`layout`, one of `LAYOUTS`."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
  return layout
