"""Batch/head parallelism: the attention forward and backward under SPMD sharding.

`flash_attention` under `jax.jit` with q, k, v sharded (`NamedSharding` on a
`Mesh`) over batch and/or heads runs every device's shard locally: each
backend call (forward `(q, k, v) -> (out, lse)` and backward
`(q, k, v, out, lse, dout, dlse) -> (dq, dk, dv)`) is a
`jax.experimental.custom_partitioning` op. XLA's partitioner hands it the
operand shardings; `_Op.plan` keeps q's batch and head sharding, checks
(`sharding_checks`) that it can be honoured, and the op runs the backend on
the local shard. So no collective is emitted for q, k, v or the output,
whatever the backend (the kernels are custom calls that XLA could not split
by itself). The Shardy rules (`_FWD_RULE`) tell propagation which
dimensions correspond: batch, and query heads = kv heads times the group,
so that a kv head and its query heads move together.

What can be honoured:
  * batch sharded over any mesh axes;
  * heads sharded over mesh axes of total size n when `heads_kv % n == 0`
    (GQA groups stay whole: kv head j and query heads `j*g .. j*g+g-1` on
    one device), or with MQA's one kv head, which every device then holds
    (dK, dV summed over the head axes);
  * the sequence sharded over one mesh axis: each device then runs its half
    of ring attention instead of the plain backend call (context
    parallelism, `pallas_fa3.parallel.context`), with batch/head splits as
    above on the other axes;
  * k, v (and the backward's cotangents) sharded differently from q are
    resharded to q's layout (a local slice when they are replicated).
What is refused, with a `ValueError` (or `NotImplementedError` for an
option) naming the argument: a sharded head_dim, a head sharding that would
split a GQA group, and a sequence split the ring cannot serve (see
`context`). The check runs at trace time when the sharding is known then
(concrete arrays, or `Explicit` mesh axes); otherwise the partitioner runs
it at compile time and XLA reports it as a `jax.errors.JaxRuntimeError`
carrying the same message.

`Explicit` mesh axes (the default of `jax.make_mesh` since JAX 0.7) put the
layout in the traced types, so there the same plan runs through a
`jax.shard_map` instead, decided at trace time. On one device the backend
is called directly (no custom_partitioning or custom_vmap wrapper); inside a
fully manual `shard_map` of the caller's the custom_partitioning op lowers
to the plain backend call. `custom_partitioning` has no batching rule, so
each op is wrapped in `jax.custom_batching.custom_vmap`: a vmapped axis is
folded into the batch axis. A backend call with side effects (the Pallas
interpreter's callbacks) cannot be a custom_partitioning op and runs
unpartitioned.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, get_args

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_fa3 import segments
from pallas_fa3.backends.base import Op, StaticCall
from pallas_fa3.parallel import context
from pallas_fa3.parallel.ring import local as ring_local
from pallas_fa3.parallel.sharding_checks import (
  CHECKED,
  axes_entry,
  explicit_sharding,
  fit_explicit,
  kv_replicated_over_heads,
  mesh_axes,
  mesh_ways,
  spec_entries,
)
from pallas_fa3.spec import AttentionSpec

# Shardy rules, by operand: b batch, s/t query/key positions, k kv heads,
# d/e head dims of q/k and v, and {h} the query heads (see `_heads_factor`).
_Q, _KV, _V, _O, _L, _S = (
  "b s {h} d",
  "b t k d",
  "b t k e",
  "b s {h} e",
  "b {h} s",
  "b {h}",  # sinks, batched (`modifiers.batch_sinks`)
)
_FWD_RULE = f"{_Q}, {_KV}, {_V} -> {_O}, {_L}"
_BWD_RULE = f"{_Q}, {_KV}, {_V}, {_O}, {_L}, {_O}, {_L} -> {_Q}, {_KV}, {_V}"
_FWD_NAMES = ("q", "k", "v")
_BWD_NAMES = ("q", "k", "v", "out", "lse", "dout", "dlse")


def _with_extras(rule: str, sinks: bool, ids: bool) -> str:
  """The rule with trailing sinks and segment-ids operands."""
  args, results = rule.split(" -> ")
  extra = ([_S] if sinks else []) + (["b s", "b t"] if ids else [])
  return ", ".join([args, *extra]) + " -> " + results


def _heads_factor(spec: AttentionSpec) -> tuple[str, dict[str, int]]:
  """The query-head factor of the rules, and the factor sizes it needs.

  Query heads are kv heads times the group: the compound factor `(k g)`
  makes a kv head and its query heads move together. Shardy refuses a
  compound with a size-1 part, so MHA (g = 1) uses `k` itself and MQA
  (heads_kv = 1: nothing to keep together) a factor `g` of its own.
  """
  if spec.group_size == 1:
    return "k", {}
  if spec.heads_kv == 1:
    return "g", {}
  return "(k g)", {"g": spec.group_size}


def _local_call(
  call: StaticCall, batchmesh_ways: int, headmesh_ways: int
) -> StaticCall:
  """`call` for one device's shard: batch and heads divided (MQA's one kv
  head is every device's)."""
  spec = call.spec
  local = dataclasses.replace(
    spec,
    batch=spec.batch // batchmesh_ways,
    heads_q=spec.heads_q // headmesh_ways,
    heads_kv=max(spec.heads_kv // headmesh_ways, 1),
  )
  return dataclasses.replace(call, spec=local)


def _layout_specs(
  names: Sequence[str],
  axes: tuple[tuple[str, ...], ...],
  kv_replicated: bool = False,
) -> tuple[P, ...]:
  """PartitionSpecs with batch, heads and sequence split as `axes` (batch,
  heads, sequence) say, for operands named `names`; `kv_replicated`: K/V
  (and dK/dV) whole over the head axes (`kv_replicated_over_heads`)."""
  b, h, s = (axes_entry(a) for a in axes)
  by_name = {
    "lse": P(b, h, s),
    "dlse": P(b, h, s),
    "sinks": P(b, h),
    "q_ids": P(b, s),
    "kv_ids": P(b, s),
  }
  if kv_replicated:
    by_name.update(k=P(b, s, None, None), v=P(b, s, None, None))
  return tuple(by_name.get(n, P(b, s, h, None)) for n in names)


@dataclasses.dataclass(frozen=True)
class _Op:
  """One backend entry point (forward or backward), run shard-locally."""

  arg_names: tuple[str, ...]
  result_names: tuple[str, ...]
  run: Callable[..., Any]  # (call, *arrays) -> tuple of arrays
  rule: str
  backward: bool

  def sharding_rule(
    self, call: StaticCall, mesh: Any, operand_types: Any, result_types: Any
  ) -> tuple[str, dict[str, int]]:
    """The Shardy rule of this call (its query-head factor), with sizes."""
    del mesh, operand_types, result_types
    heads, sizes = _heads_factor(call.spec)
    return self.rule.format(h=heads), sizes

  def plan(
    self, call: StaticCall, mesh: Any, arg_specs: Sequence[tuple]
  ) -> tuple[tuple[tuple[str, ...], ...], tuple[P, ...], tuple[P, ...]]:
    """((batch, head, sequence axes), arg specs, result specs) for these
    operands."""
    shardings = {
      n: spec for n, spec in zip(self.arg_names, arg_specs) if n in CHECKED
    }
    axes = context.check(call, dict(mesh.shape), shardings)
    kv_whole = kv_replicated_over_heads(call.spec, axes[1])
    return (
      axes,
      _layout_specs(self.arg_names, axes, kv_whole),
      _layout_specs(self.result_names, axes, kv_whole),
    )

  def local(
    self, call: StaticCall, mesh: Any, axes: tuple[tuple[str, ...], ...]
  ) -> Callable[..., Any]:
    """The per-device function: the backend on the batch/head shard, or
    with a sequence split the ring (`pallas_fa3.parallel.context`)."""
    batch_axes, head_axes, seq_axes = axes
    if seq_axes:
      return context.runner(call, mesh, axes, self.backward)
    local = _local_call(
      call, mesh_ways(mesh, batch_axes), mesh_ways(mesh, head_axes)
    )
    if self.backward and kv_replicated_over_heads(call.spec, head_axes):

      def run_mqa(*a):  # each device's dK, dV: its query heads' share
        dq, dk, dv = self.run(local, *a)
        return dq, *jax.lax.psum((dk, dv), head_axes)

      return run_mqa
    return lambda *a: self.run(local, *a)

  def partition(
    self, call: StaticCall, mesh: Any, arg_shapes: Any, result_shape: Any
  ) -> tuple:
    """custom_partitioning: the local computation and the layouts it needs."""
    del result_shape
    axes, args, results = self.plan(
      call, mesh, [spec_entries(a.sharding, len(a.shape)) for a in arg_shapes]
    )
    named = lambda specs: tuple(NamedSharding(mesh, s) for s in specs)
    return (mesh, self.local(call, mesh, axes), named(results), named(args))

  def infer(
    self, call: StaticCall, mesh: Any, arg_shapes: Any, result_shape: Any
  ) -> tuple[NamedSharding, ...]:
    """Result shardings for the GSPMD partitioner (Shardy uses `rule`)."""
    del result_shape
    results = self.plan(
      call, mesh, [spec_entries(a.sharding, len(a.shape)) for a in arg_shapes]
    )[2]
    return tuple(NamedSharding(mesh, s) for s in results)

  def shard_map(
    self, call: StaticCall, sharding: NamedSharding, *args: jax.Array
  ) -> tuple[jax.Array, ...]:
    """`Explicit` mesh axes: the layout is in the types, so a shard_map runs
    the local computation (operands whose layout differs are resharded)."""
    mesh = sharding.mesh
    specs = [spec_entries(jax.typeof(x).sharding, x.ndim) for x in args]
    axes, arg_specs, result_specs = self.plan(call, mesh, specs)
    args = [
      fit_explicit(x, NamedSharding(mesh, want))
      for x, want in zip(args, arg_specs)
    ]
    return tuple(
      jax.shard_map(
        self.local(call, mesh, axes),
        mesh=mesh,
        in_specs=tuple(arg_specs),
        out_specs=tuple(result_specs),
        check_vma=False,
      )(*args)
    )


def _partitioned(op: _Op) -> Any:
  fn = custom_partitioning(op.run, static_argnums=(0,))
  fn.def_partition(
    partition=op.partition,
    infer_sharding_from_operands=op.infer,
    sharding_rule=op.sharding_rule,
  )
  return fn


def _fold_batch(x: jax.Array, axis_size: int, batched: bool) -> jax.Array:
  """[n, b, ...] (or unbatched [b, ...], broadcast) -> [n * b, ...]."""
  if not batched:
    x = jax.numpy.broadcast_to(x, (axis_size,) + x.shape)
  return x.reshape((axis_size * x.shape[1],) + x.shape[2:])


def _with_vmap(
  partitioned: Any, call: StaticCall, *args: jax.Array
) -> tuple[jax.Array, ...]:
  """Calls `partitioned(call, *args)`; a vmapped axis is folded into batch."""

  @jax.custom_batching.custom_vmap
  def apply(*args):
    return tuple(partitioned(call, *args))

  @apply.def_vmap
  def rule(axis_size, in_batched, *args):
    folded = [_fold_batch(x, axis_size, b) for x, b in zip(args, in_batched)]
    spec = dataclasses.replace(call.spec, batch=axis_size * call.spec.batch)
    outs = _with_vmap(
      partitioned, dataclasses.replace(call, spec=spec), *folded
    )
    unfold = lambda y: y.reshape(
      (axis_size, y.shape[0] // axis_size) + y.shape[1:]
    )
    return tuple(unfold(y) for y in outs), (True,) * len(outs)

  return apply(*args)


def _extras(call: StaticCall, rest: tuple) -> dict[str, Any]:
  """The trailing operands of an op as the backend's keywords."""
  extras, rest = {}, list(rest)
  if call.spec.sinks:
    extras["sinks"] = rest.pop(0)
  if call.spec.segmented:
    extras["segment_ids"] = segments.SegmentIds(rest.pop(0), rest.pop(0))
  return extras


def _run_forward(
  call: StaticCall, q: jax.Array, k: jax.Array, v: jax.Array, *rest: jax.Array
) -> tuple[jax.Array, jax.Array]:
  return tuple(
    call.backend.run_forward(
      call.spec, call.config, q, k, v, **_extras(call, rest)
    )
  )


def _run_backward(
  call: StaticCall, *args: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  return tuple(
    call.backend.run_backward(
      call.spec, call.config, *args[:7], **_extras(call, args[7:])
    )
  )


@functools.cache
def _ops(backward: bool, sinks: bool, ids: bool) -> tuple[_Op, Any]:
  """(op, its custom_partitioning function) for these trailing operands."""
  names = _BWD_NAMES if backward else _FWD_NAMES
  names += ("sinks",) * sinks + ("q_ids", "kv_ids") * ids
  op = _Op(
    names,
    ("q", "k", "v") if backward else ("out", "lse"),
    _run_backward if backward else _run_forward,
    _with_extras(_BWD_RULE if backward else _FWD_RULE, sinks, ids),
    backward,
  )
  return op, _partitioned(op)


def _dispatch(
  op: _Op, partitioned: Any, call: StaticCall, *args: jax.Array
) -> tuple[jax.Array, ...]:
  sharding = explicit_sharding(args[0])
  entries = spec_entries(sharding, 4) if sharding is not None else (None,) * 4
  if mesh_axes(entries[1]):  # sequence split over Explicit axes: the ring
    return op.shard_map(call, sharding, *args)
  if not call.backend.partitionable or _global_scales(call.spec):
    return op.run(call, *args)
  if any(mesh_axes(e) for e in entries):
    return op.shard_map(call, sharding, *args)
  if jax.device_count() == 1:  # nothing to partition: the call itself
    return op.run(call, *args)
  return _with_vmap(partitioned, call, *args)


def run(call: StaticCall, operands: Any) -> Any:
  """`call` (`pallas_fa3.vjp.call`'s) on its operands: a forward or
  backward shard-locally under SPMD sharding (or the ring of a
  `ring_attention` call), an FP8 or decode call by the backend.
  Returns (out, lse), or (dq, dk, dv) for op "backward"."""
  if call.op == "forward":
    q, k, v, sinks, ids = operands
    if call.ring is not None:
      return ring_local.ring_forward_global(
        call.ring, q, k, v, sinks, () if ids is None else tuple(ids)
      )
    return forward(call, q, k, v, sinks, ids)
  if call.op == "backward":
    (q, k, v, sinks, ids), out, lse, dout, dlse = operands
    if call.ring is not None:
      return ring_local.ring_backward_global(
        call.ring, q, k, v, out, lse, dout, dlse,
        () if ids is None else tuple(ids),
      )  # fmt: skip
    return backward(call, q, k, v, out, lse, dout, dlse, sinks, ids)
  if call.op == "fp8":
    x, sinks, ids = operands
    return call.backend.fp8_forward(
      call.spec, call.config, x, sinks=sinks, segment_ids=ids
    )
  if call.op == "decode":
    return call.backend.decode(call.spec, call.config, call.splits, *operands)
  raise ValueError(
    f"StaticCall.op must be one of {get_args(Op)}; got {call.op!r}"
  )


def _global_scales(spec: AttentionSpec) -> bool:
  """FP8 with one scale per tensor: its amax spans every shard, so the call
  runs whole (XLA gathers) rather than per shard with per-shard scales."""
  return spec.fp8 is not None and not spec.fp8.block_quantization


def forward(
  call: StaticCall,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  sinks: jax.Array | None = None,
  segment_ids: Any = None,
) -> tuple[jax.Array, jax.Array]:
  """The backend's `(out, lse)`, computed shard-locally under SPMD sharding
  (`sinks`: `[b, heads_q]` float32, `segment_ids`: a `SegmentIds`, when the
  call has them)."""
  extra = _operands(sinks, segment_ids)
  op, fn = _ops(False, sinks is not None, segment_ids is not None)
  return _dispatch(op, fn, call, q, k, v, *extra)


def backward(
  call: StaticCall,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  out: jax.Array,
  lse: jax.Array,
  dout: jax.Array,
  dlse: jax.Array,
  sinks: jax.Array | None = None,
  segment_ids: Any = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The backend's `(dq, dk, dv)`, computed shard-locally under SPMD sharding."""
  extra = _operands(sinks, segment_ids)
  op, fn = _ops(True, sinks is not None, segment_ids is not None)
  return _dispatch(op, fn, call, q, k, v, out, lse, dout, dlse, *extra)


def _operands(sinks: Any, segment_ids: Any) -> tuple:
  return (() if sinks is None else (sinks,)) + (
    () if segment_ids is None else tuple(segment_ids)
  )
