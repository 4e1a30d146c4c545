"""Checks of batch/head sharding: which layouts of q, k, v can run
shard-locally (`check_shardings`), and the mesh and PartitionSpec helpers
that `partitioning`, `context` and `ring` share:
docs/scale_out.md#batchhead-parallelism.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from pallas_fa3.spec import AttentionSpec

_BATCH, _SEQ, _HEADS, _HEAD_DIM = range(4)  # axes of q, k, v, out, dout
# The tensors whose layout the user chose; the others (out, lse, cotangents)
# are only resharded to match.
CHECKED = ("q", "k", "v")


def mesh_axes(entry: Any) -> tuple[str, ...]:
  """Mesh axes of one PartitionSpec entry (None, a name, or a tuple)."""
  if entry is None or entry is P.UNCONSTRAINED:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def axes_entry(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
  """The PartitionSpec entry for mesh axes `axes` (inverse of `mesh_axes`)."""
  return None if not axes else axes[0] if len(axes) == 1 else axes


def check_shardings(
  spec: AttentionSpec, axis_sizes: dict[str, int], shardings: dict[str, tuple]
) -> tuple[tuple, tuple]:
  """Checks the batch, head and head_dim splits of q, k, v shardings (a
  sequence split is `pallas_fa3.parallel.context`'s to check: the ring).

  Args:
    spec: the global call.
    axis_sizes: mesh axis name -> size.
    shardings: "q"/"k"/"v" -> PartitionSpec entries of that `[b, s, h, d]`
      operand (missing names are taken as replicated).

  Returns:
    (batch axes, head axes): the mesh axes of q's batch and head dimensions,
    the layout every operand and result gets.

  Raises:
    ValueError: a sharded head_dim axis, or a head sharding that would split
      a group of query heads sharing a kv head (MQA's one kv head is
      replicated instead: `kv_replicated_over_heads`); the message names
      the argument.
  """
  for name in CHECKED:
    split = mesh_axes(shardings.get(name, (None,) * 4)[_HEAD_DIM])
    if split:
      raise ValueError(
        f"{name} is sharded along its head_dim axis (axis {_HEAD_DIM}) over"
        f" mesh axes {split}; flash_attention can split batch (axis 0),"
        " sequence (axis 1, as a ring) and heads (axis 2). A head_dim split"
        " would need a reduction inside every score; shard batch or heads"
        " instead"
      )
  q = shardings.get("q", (None,) * 4)
  batch_axes, head_axes = mesh_axes(q[_BATCH]), mesh_axes(q[_HEADS])
  ways = math.prod(axis_sizes[a] for a in head_axes)
  if spec.heads_kv % ways and not kv_replicated_over_heads(spec, head_axes):
    raise ValueError(
      f"q is sharded over heads on mesh axes {head_axes} ({ways} ways), but"
      f" k and v have heads_kv={spec.heads_kv} heads, not a multiple of"
      f" {ways}: every device must hold whole groups (a kv head and its"
      f" {spec.group_size} query heads). Shard heads at most"
      f" {math.gcd(spec.heads_kv, ways)} ways, or shard batch instead"
    )
  return batch_axes, head_axes


def kv_replicated_over_heads(
  spec: AttentionSpec, head_axes: tuple[str, ...]
) -> bool:
  """MQA with q's heads split: every device holds the one K/V head (K/V
  replicated over the head axes; dK, dV summed over them)."""
  return bool(head_axes) and spec.heads_kv == 1


def known_sharding(x: Any) -> NamedSharding | None:
  """The `NamedSharding` of `x` if it is known at trace time, else None.

  Known means a concrete `jax.Array` with a `NamedSharding`, or a traced
  value whose type carries `Explicit` mesh axes (`jax.typeof(x).sharding`).
  Under `jax.jit` with automatic axes only the partitioner knows the layout.
  """
  sharding = (
    jax.typeof(x).sharding
    if isinstance(x, jax.core.Tracer)
    else getattr(x, "sharding", None)
  )
  return sharding if isinstance(sharding, NamedSharding) else None


def spec_entries(sharding: Any, ndim: int = 4) -> tuple:
  """The PartitionSpec of `sharding`, padded with None to `ndim` entries."""
  spec = tuple(getattr(sharding, "spec", ()))
  return spec + (None,) * (ndim - len(spec))


def mesh_ways(mesh: Any, axes: tuple[str, ...]) -> int:
  return math.prod(dict(mesh.shape)[a] for a in axes)


def explicit_sharding(x: Any) -> NamedSharding | None:
  """x's type sharding if x is traced on a mesh with `Explicit` axes."""
  if not isinstance(x, jax.core.Tracer):
    return None
  sharding = known_sharding(x)
  if sharding is None or AxisType.Explicit not in sharding.mesh.axis_types:
    return None
  return sharding


def fit_explicit(x: jax.Array, target: NamedSharding) -> jax.Array:
  """Reshards x to `target` when `target`'s mesh has `Explicit` axes.

  `jax.shard_map` on such a mesh insists that its operands' types already
  carry its `in_specs`; under automatic axes XLA reshards by itself, and x is
  returned as is.
  """
  if AxisType.Explicit not in target.mesh.axis_types:
    return x
  current = known_sharding(x) if isinstance(x, jax.core.Tracer) else None
  if current is not None and spec_entries(current, x.ndim) == spec_entries(
    target, x.ndim
  ):
    return x
  return jax.reshard(x, target)


def varying_axes(x: Any) -> frozenset[str]:
  """The manual mesh axes along which `x` varies inside a `jax.shard_map`
  (empty outside one, and for None)."""
  if x is None:
    return frozenset()
  aval = jax.typeof(x)
  vma = getattr(aval, "vma", None)  # (the newest JAX's name)
  if vma is None:
    vma = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
  return frozenset(vma)


def vary_alike(tree: Any) -> Any:
  """Every array of `tree` cast to vary along the union of their manual
  axes (`jax.lax.pcast(..., to="varying")`).

  Inside a `jax.shard_map`, a custom_vjp's backward returns cotangents
  that vary like the values they are computed from, so an input that does
  not vary (replicated sinks, K/V) while q does would get a cotangent of
  another type. Cast first, its cotangent varies like q's, and the cast's
  own transpose (a psum over those axes) gives the replicated input its
  summed gradient.
  """
  leaves = jax.tree.leaves(tree)
  union = frozenset().union(*map(varying_axes, leaves))
  if not union:
    return tree

  def cast(x):
    missing = tuple(sorted(union - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, tree)
