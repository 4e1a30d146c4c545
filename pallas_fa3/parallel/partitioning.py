"""Sharding attached to the backend call: every call `pallas_fa3.vjp` makes
(flash_attention's forward and backward, the FP8 forward, decoding) is a
`custom_partitioning` op (a `jax.shard_map` on `Explicit` mesh axes) that
runs the backend on the local shard of a batch and head split, with no
collective (GQA groups kept whole), hands a sequence split to the ring
(`pallas_fa3.parallel.context`), and refuses what it cannot honour, naming
the argument: docs/scale_out.md#batchhead-parallelism.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, get_args

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_fa3 import flex, segments
from pallas_fa3.backends.base import (
  Decode,
  FlexGrads,
  Grads,
  Op,
  StaticCall,
)
from pallas_fa3.kvcache import DecodeSpec
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
from pallas_fa3.quant.e4m3 import FP8Inputs
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
  # Folds a vmapped axis into batch (`_with_vmap`): every operand has the
  # batch first (a paged cache does not).
  foldable: bool = True

  def sharding_rule(
    self, call: StaticCall, mesh: Any, operand_types: Any, result_types: Any
  ) -> tuple[str, dict[str, int]]:
    """The Shardy rule of this call (its query-head factor), with sizes."""
    del mesh, operand_types, result_types
    heads, sizes = _heads_factor(call.spec)
    rule = self.rule
    if call.spec.flex is not None and not rule:  # (`_FlexOp`: per call)
      rule = _flex_rule(self.arg_names, self.result_names, call.spec)
    return rule.format(h=heads), sizes

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


def _cache_follows_batch(spec: Any) -> bool:
  """A decode call whose cache rows are its sequences (contiguous, no
  cache_batch_idx): the cache shards with the batch; otherwise (pages, or
  rows picked by cache_batch_idx) every device holds the whole cache."""
  return not (spec.paged or spec.batch_idx)


@dataclasses.dataclass(frozen=True)
class _DecodeOp(_Op):
  """A decode call, shard-local over batch and heads: q, the cache's kv
  heads and the per-sequence operands split like q; the sequence is whole
  (decoding's few queries: a split is gathered)."""

  def plan(self, call, mesh, arg_specs):
    spec, sizes = call.spec, dict(mesh.shape)
    q = dict(zip(self.arg_names, arg_specs))["q"]
    batch_axes, head_axes = mesh_axes(q[0]), mesh_axes(q[2])
    ways = mesh_ways(mesh, head_axes)
    if spec.heads_kv % ways and not kv_replicated_over_heads(spec, head_axes):
      raise ValueError(
        f"q is sharded over heads on mesh axes {head_axes} ({ways} ways),"
        f" but the cache has heads_kv={spec.heads_kv} heads, not a multiple"
        f" of {ways}: every device must hold whole groups. Shard heads at"
        f" most {math.gcd(spec.heads_kv, ways)} ways, or shard batch instead"
      )
    del sizes
    b, h = axes_entry(batch_axes), axes_entry(head_axes)
    hk = None if kv_replicated_over_heads(spec, head_axes) else h
    rows = b if _cache_follows_batch(spec) else None
    by_name = dict(
      q=P(b, None, h, None), out=P(b, None, h, None), lse=P(b, h, None),
      k_cache=P(rows, None, hk, None), v_cache=P(rows, None, hk, None),
      lengths=P(b), rows=P(b), pages=P(b, None), sinks=P(b, h),
      k_descale=P(b, hk), v_descale=P(b, hk), starts=P(b),
      batch_index=P(b), head_index=P(h),
    )  # fmt: skip
    if spec.flex is not None and spec.flex.block is not None:
      nb, nh = spec.flex.block[:2]
      state = P(b if nb > 1 else None, h if nh > 1 else None, None, None)
      by_name.update(bm_state=state, bm_dense=state)
    get = lambda n: by_name.get(n, P())  # (the functions' arrays: whole)
    return (
      (batch_axes, head_axes, ()),
      tuple(get(n) for n in self.arg_names),
      tuple(get(n) for n in self.result_names),
    )

  def local(self, call, mesh, axes):
    batch_axes, head_axes, _ = axes
    spec = call.spec
    bw = mesh_ways(mesh, batch_axes)
    local = _local_call(call, bw, mesh_ways(mesh, head_axes))
    follows = _cache_follows_batch(spec)
    if follows:
      local_spec = dataclasses.replace(
        local.spec, cache_rows=spec.cache_rows // bw
      )
      local = dataclasses.replace(local, spec=local_spec)
    rows_at = self.arg_names.index("rows")
    split = (bool(batch_axes), bool(head_axes))

    def run(*a):
      if follows:  # a batch shard's cache rows are its own sequences
        a = list(a)
        a[rows_at] = jax.numpy.arange(local.spec.batch, dtype=jax.numpy.int32)
      return _run_decode_shard(local, split, *a)

    return run


@dataclasses.dataclass(frozen=True)
class _Fp8Op(_Op):
  """An FP8 call on pre-quantized operands, shard-local over batch and
  heads (a sequence split is refused: the FP8 forward has no ring)."""

  def plan(self, call, mesh, arg_specs):
    named = dict(zip(self.arg_names, arg_specs))
    shardings = {"q": named["q8"], "k": named["k8"]}
    axes = context.check(call, dict(mesh.shape), shardings)
    b, h, _ = (axes_entry(a) for a in axes)
    hk = None if kv_replicated_over_heads(call.spec, axes[1]) else h
    by_name = dict(
      q8=P(b, None, h, None), q_residual=P(b, None, h, None),
      k8=P(b, None, hk, None), v8_t=P(b, hk, None, None),
      q_scale=P(b, h, None), k_scale=P(b, hk, None), v_scale=P(b, hk, None),
      sinks=P(b, h), q_ids=P(b, None), kv_ids=P(b, None),
      out=P(b, None, h, None), lse=P(b, h, None),
    )  # fmt: skip
    return (
      axes,
      tuple(by_name[n] for n in self.arg_names),
      tuple(by_name[n] for n in self.result_names),
    )

  def local(self, call, mesh, axes):
    batch_axes, head_axes, _ = axes
    local = _local_call(
      call, mesh_ways(mesh, batch_axes), mesh_ways(mesh, head_axes)
    )
    return lambda *a: self.run(local, *a)


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
  grads = call.backend.run_backward(
    call.spec,
    call.config,
    *args[:7],
    plan=call.backward_plan,
    **_extras(call, args[7:]),
  )
  return grads.dq, grads.dk, grads.dv


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


def _decode_names(spec: Any) -> tuple[str, ...]:
  names = ("q", "k_cache") + ("v_cache",) * (not spec.v_in_k)
  names += ("lengths", "rows") + ("pages",) * spec.paged
  names += ("sinks",) * spec.sinks + ("k_descale", "v_descale") * spec.fp8_cache
  names += ("starts",) * spec.leftpad
  return names + (() if spec.flex is None else _flex_operand_names(spec.flex))


def _run_decode(call: StaticCall, *arrays: jax.Array) -> tuple:
  """The backend's decode on `_decode_names`' operands."""
  return _run_decode_shard(call, (False, False), *arrays)


def _run_decode_shard(
  call: StaticCall, split: tuple[bool, bool], *arrays: jax.Array
) -> tuple:
  """`_run_decode` of a shard (`split`: whether batch / heads are split;
  its flex functions see global batch and head indices)."""
  named = dict(zip(_decode_names(call.spec), arrays))
  descale = None
  if "k_descale" in named:
    descale = (named["k_descale"], named["v_descale"])
  spec, ops = call.spec, None
  if spec.flex is not None:
    spec, ops = _local_flex(spec, named, split)
  operands = Decode(
    named["q"], named["k_cache"], named.get("v_cache"), named["lengths"],
    named["rows"], named.get("pages"), named.get("sinks"), descale, ops,
    named.get("starts"),
  )  # fmt: skip
  return tuple(call.backend.decode(spec, call.config, call.splits, operands))


@functools.cache
def _decode_ops(
  names: tuple[str, ...], follows: bool, spec: Any
) -> tuple[_Op, Any]:
  """(op, its custom_partitioning function) of a decode call with these
  operands; `follows`: its cache shards with the batch; `spec`: the
  call's (its flex options' rule)."""
  r = "b" if follows else "c"  # the cache's rows: the sequences, or its own
  factors = dict(
    q=_Q, k_cache=f"{r} t k d", v_cache=f"{r} t k e", lengths="b", rows="b",
    pages="b p", sinks=_S, k_descale="b k", v_descale="b k", starts="b",
  )  # fmt: skip
  if spec.flex is None:
    rule = ", ".join(factors[n] for n in names) + f" -> {_O}, {_L}"
  else:
    rule = _flex_rule(names, ("out", "lse"), spec, factors)
  op = _DecodeOp(names, ("out", "lse"), _run_decode, rule, False, False)
  return op, _partitioned(op)


_FP8_FACTORS = dict(
  q8=_Q.replace("e", "d"), k8=_KV, v8_t="b k d t", q_scale="b {h} n",
  k_scale="b k m", v_scale="b k m", q_residual=_Q.replace("e", "d"),
  sinks=_S, q_ids="b s", kv_ids="b t",
)  # fmt: skip


def _run_fp8(call: StaticCall, *arrays: jax.Array) -> tuple:
  """The backend's FP8 forward on `FP8Inputs` (+ sinks, ids) flattened."""
  q8, k8, v8_t, qs, ks, vs, *rest = arrays
  residual = rest.pop(0) if call.spec.fp8.q_residual else None
  x = FP8Inputs(q8, k8, v8_t, qs, ks, vs, residual)
  return tuple(
    call.backend.fp8_forward(call.spec, call.config, x, **_extras(call, rest))
  )


@functools.cache
def _fp8_ops(names: tuple[str, ...]) -> tuple[_Op, Any]:
  rule = ", ".join(_FP8_FACTORS[n] for n in names)
  rule += " -> b s {h} d, " + _L
  op = _Fp8Op(names, ("out", "lse"), _run_fp8, rule, False)
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
  if call.spec.flex is not None:
    return _whole_under_vmap(op, partitioned, call, *args)
  if not op.foldable:
    return tuple(partitioned(call, *args))
  return _with_vmap(partitioned, call, *args)


def describe(
  call: StaticCall, axis_sizes: dict[str, int], shardings: dict[str, tuple]
) -> list[str]:
  """How a call with these q/k/v shardings (PartitionSpec entries by name)
  runs over the devices, in lines (`pallas_fa3.explain`); a layout it
  refuses gives the reason."""
  try:
    batch, heads, seq = context.check(call, axis_sizes, shardings)
  except (ValueError, NotImplementedError) as e:
    return [f"sharding: refused: {e}"]
  ways = lambda axes: math.prod(axis_sizes[a] for a in axes)
  spec = call.spec
  if not (batch or heads or seq):
    return ["sharding: none (q, k, v whole on every device)"]
  parts = []
  if batch:
    parts.append(f"batch {ways(batch)} ways over {batch}")
  if heads:
    parts.append(f"heads {ways(heads)} ways over {heads}")
  if seq:
    parts.append(f"sequence {ways(seq)} ways over {seq}")
  lines = [f"sharding: {', '.join(parts)}"]
  if seq:
    lines.append(
      f"  the ring (context parallelism): K/V blocks passed around"
      f" {ways(seq)} devices, each block by {call.backend.name}"
    )
    return lines
  local = _local_call(call, ways(batch), ways(heads)).spec
  lines.append(
    f"  shard-local, no collective for q, k, v: each device runs batch"
    f" {local.batch}, heads {local.heads_q}/{local.heads_kv} (q/kv)"
  )
  if kv_replicated_over_heads(spec, heads):
    lines.append("  MQA: the one kv head on every device, dK/dV summed")
  fs = spec.flex
  if fs is not None:
    whole = []
    for name, dims in (("bias", fs.bias), ("block_mask", fs.block)):
      if dims is not None:
        split = [
          n
          for n, d, axes in (
            ("batch", dims[0], batch),
            ("heads", dims[1], heads),
          )
          if d > 1 and axes
        ]
        where = f"split along its {' and '.join(split)}" if split else "whole"
        lines.append(f"  {name}: {where} on each device")
        if dims[0] == 1 and batch or dims[1] == 1 and heads:
          whole.append(name)
    if fs.score_mod is not None or fs.mask_mod is not None:
      lines.append(
        "  the functions' arrays whole on every device; they see global"
        " batch and head indices"
      )
    if whole or (fs.score_mod is not None and call.op != "decode"):
      lines.append(
        "  gradients of what is whole (a broadcast bias dim, learnable"
        " arrays) summed over the devices"
      )
  return lines


def run(call: StaticCall, operands: Any) -> Any:
  """`call` (`pallas_fa3.vjp.call`'s) on its operands: a forward or
  backward shard-locally under SPMD sharding (or the ring of a
  `ring_attention` call), an FP8 or decode call by the backend.
  Returns (out, lse), or (dq, dk, dv) for op "backward"."""
  if call.op in ("forward", "backward") and call.spec.flex is not None:
    return _run_flex(call, operands)
  if call.op == "forward":
    q, k, v, sinks, ids, _ = operands
    if call.ring is not None:
      return ring_local.ring_forward_global(
        call.ring, q, k, v, sinks, () if ids is None else tuple(ids)
      )
    return forward(call, q, k, v, sinks, ids)
  if call.op == "backward":
    (q, k, v, sinks, ids, _), out, lse, dout, dlse = operands
    if call.ring is not None:
      return Grads(
        *ring_local.ring_backward_global(
          call.ring,
          q,
          k,
          v,
          out,
          lse,
          dout,
          dlse,
          () if ids is None else tuple(ids),
        )  # fmt: skip
      )
    return Grads(*backward(call, q, k, v, out, lse, dout, dlse, sinks, ids))
  if call.op == "fp8":
    x, sinks, ids = operands
    arrays = tuple(x[:6]) + (
      (x.q_residual,) if call.spec.fp8.q_residual else ()
    )
    names = ("q8", "k8", "v8_t", "q_scale", "k_scale", "v_scale")
    names += ("q_residual",) * call.spec.fp8.q_residual
    names += ("sinks",) * (sinks is not None)
    names += ("q_ids", "kv_ids") * (ids is not None)
    op, fn = _fp8_ops(names)
    return _dispatch(op, fn, call, *arrays, *_operands(sinks, ids))
  if call.op == "decode":
    names = _decode_names(call.spec)
    present = dict(zip(Decode._fields, operands))
    arrays = [present.get(n) for n in ("q", "k_cache", "v_cache")]
    arrays += [present["lengths"], present["rows"], present["page_table"]]
    arrays += [present["sinks"]]
    arrays += list(present["descale"] or ())
    arrays += [present["starts"]]
    arrays = [a for a in arrays if a is not None]
    if call.spec.flex is not None:
      arrays += _flex_arrays(call.spec, present["flex"])
    op, fn = _decode_ops(names, _cache_follows_batch(call.spec), call.spec)
    return _dispatch(op, fn, call, *arrays)
  raise ValueError(
    f"StaticCall.op must be one of {get_args(Op)}; got {call.op!r}"
  )


def _run_flex(call: StaticCall, operands: Any) -> Any:
  """A forward or backward with score_mod / mask_mod / bias / block_mask,
  shard-local over batch and heads like every other call (`_FlexOp`): the
  bias and the block mask split where they are not broadcast, the
  functions' arrays whole, their batch and head indices global. A
  sequence split is refused (`context.check_ring`)."""
  if call.ring is not None:
    raise NotImplementedError(
      f"ring_attention does not implement {', '.join(call.spec.flex.names())}"
      " (its blocks would need each function's positions shifted per"
      " step); flash_attention runs them shard-locally over batch and"
      " heads"
    )
  backward = call.op == "backward"
  forward_ops = operands.forward if backward else operands
  arrays = list(forward_ops[:3])
  if backward:
    arrays += [operands.out, operands.lse, operands.dout, operands.dlse]
  arrays += _operands(forward_ops.sinks, forward_ops.segment_ids)
  ops = forward_ops.flex
  spec = call.spec
  arrays += _flex_arrays(spec, ops)
  op, fn = _flex_ops(*_flex_names(spec, backward), backward)
  outs = _dispatch(op, fn, call, *arrays)
  if not backward:
    return outs
  dq, dk, dv, *rest = outs
  dbias = rest.pop(0) if _dbias(spec.flex) else None
  dscore = flex.spread_float_grads(ops, tuple(rest))
  return Grads(dq, dk, dv, FlexGrads(dbias, dscore))


def _dbias(fs: flex.FlexSpec) -> bool:
  """Whether a flex call's backward returns dbias (a differentiated bias)."""
  return fs.bias is not None and fs.bias_grad


def _flex_operand_names(fs: flex.FlexSpec) -> tuple[str, ...]:
  """The names of a call's flex arrays (`_flex_arrays`' order): the bias,
  the block mask's states and dense mask, each function's arrays and the
  constants it holds, and the batch and head iotas."""
  names = ("bias",) * (fs.bias is not None)
  names += ("bm_state",) * (fs.block is not None) + ("bm_dense",) * fs.dense
  score = () if fs.score_mod is None else fs.score_mod.consts
  mask = () if fs.mask_mod is None else fs.mask_mod.consts
  names += tuple(f"score{i}" for i in range(len(score)))
  names += tuple(f"mask{i}" for i in range(len(mask)))
  for prefix, fn in (("scorek", fs.score_mod), ("maskk", fs.mask_mod)):
    n = 0 if fn is None else len(fn.constants())
    names += tuple(f"{prefix}{i}" for i in range(n))
  return names + ("batch_index", "head_index")


def _flex_arrays(spec: Any, ops: flex.FlexOperands) -> list[jax.Array]:
  """The arrays `_flex_operand_names` names."""
  bm = ops.block_mask
  arrays = [] if ops.bias is None else [ops.bias]
  arrays += [] if bm is None else [bm.state]
  arrays += [] if bm is None or bm.dense is None else [bm.dense]
  arrays += [jax.numpy.asarray(c) for c in ops.score_consts + ops.mask_consts]
  for fn in (spec.flex.score_mod, spec.flex.mask_mod):  # and what the
    arrays += [] if fn is None else list(fn.constants())  # functions hold
  return arrays + [
    jax.numpy.arange(spec.batch, dtype=jax.numpy.int32),
    jax.numpy.arange(spec.heads_q, dtype=jax.numpy.int32),
  ]


def _local_flex(
  spec: Any, named: dict[str, jax.Array], split: tuple[bool, bool]
) -> tuple[Any, flex.FlexOperands]:
  """(spec, flex operands) of one shard (`spec` the shard's) from its
  named arrays: the functions rebound to this trace's constants and
  shifted to global indices where `split` (`flex.shard_local`)."""
  fs = spec.flex
  bm = None
  if fs.block is not None:
    if isinstance(spec, DecodeSpec):  # built over the cache's positions
      seqs = (spec.capacity, spec.capacity)
    else:
      seqs = (spec.seq_q, spec.seq_kv)
    bm = flex.BlockMask(
      named["bm_state"], named.get("bm_dense"), *seqs, *fs.block[2:]
    )
  pick = lambda prefix: tuple(
    named[n]
    for n in named
    if n.startswith(prefix) and n[len(prefix) :].isdigit()
  )

  def rebound(fn, given):  # the functions' constants: this trace's values
    if fn is None or all(a is b for a, b in zip(given, fn.constants())):
      return fn  # (called directly: the function's own)
    return fn.rebound(given)

  fs = dataclasses.replace(
    fs,
    score_mod=rebound(fs.score_mod, pick("scorek")),
    mask_mod=rebound(fs.mask_mod, pick("maskk")),
  )
  local_fs, ops = flex.shard_local(
    fs,
    flex.FlexOperands(named.get("bias"), pick("score"), pick("mask"), bm),
    batch=spec.batch,
    heads=spec.heads_q,
    first=(named["batch_index"][0], named["head_index"][0]),
    split=split,
  )
  return dataclasses.replace(spec, flex=local_fs), ops


def _flex_names(
  spec: AttentionSpec, backward: bool
) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(operand names, result names) of a flex call (`_run_flex`'s order)."""
  fs = spec.flex
  names = _BWD_NAMES if backward else _FWD_NAMES
  names += ("sinks",) * spec.sinks + ("q_ids", "kv_ids") * spec.segmented
  names += _flex_operand_names(fs)
  score = () if fs.score_mod is None else fs.score_mod.consts
  if not backward:
    return names, ("out", "lse")
  results = ("q", "k", "v") + ("dbias",) * _dbias(fs)
  floats = flex.differentiable(score)
  results += tuple(f"dscore{i}" for i, d in enumerate(floats) if d)
  return names, results


def _flex_compute(
  call: StaticCall,
  names: tuple[str, ...],
  split: tuple[bool, bool],
  *arrays: jax.Array,
) -> tuple[jax.Array, ...]:
  """The backend on one shard's (or the whole call's) named arrays:
  `call.spec` the shard's, `split` whether batch / heads are split."""
  named = dict(zip(names, arrays))
  spec, ops = _local_flex(call.spec, named, split)
  extras = dict(flex=ops, sinks=named.get("sinks"))
  if "q_ids" in named:
    extras["segment_ids"] = segments.SegmentIds(named["q_ids"], named["kv_ids"])
  backend, config = call.backend, call.config
  if "dout" not in named:
    return tuple(
      backend.run_forward(
        spec, config, named["q"], named["k"], named["v"], **extras
      )
    )
  residuals = [named[n] for n in _BWD_NAMES]
  grads = backend.run_backward(
    spec, config, *residuals, plan=call.backward_plan, **extras
  )
  dq, dk, dv = grads[:3]
  dbias, dscore = grads.dflex
  n = len(call.spec.flex.score_mod.consts) if call.spec.flex.score_mod else 0
  floats = [d for d in dscore[:n] if d is not None]  # (offsets after)
  dbias = (dbias,) if _dbias(call.spec.flex) else ()
  return (dq, dk, dv) + dbias + tuple(floats)


@dataclasses.dataclass(frozen=True)
class _FlexOp(_Op):
  """A forward or backward with flex operands, shard-local over batch and
  heads: the bias, the block mask's states and dense mask split along
  their batch / head dims where those are not 1, the functions' arrays
  whole (replicated), and per shard its first global batch and head index
  (`batch_index`, `head_index`: iotas split like q) so that the functions
  see global indices. Partial gradients of what is whole (a broadcast
  bias's dims, the score_mod's arrays) are summed over the shards."""

  def plan(self, call, mesh, arg_specs):
    axes, _, _ = _Op.plan(self, call, mesh, arg_specs)
    kv_whole = kv_replicated_over_heads(call.spec, axes[1])
    b, h, s = (axes_entry(a) for a in axes)
    fs = call.spec.flex
    dims = lambda d: (b if d[0] > 1 else None, h if d[1] > 1 else None)
    by_name = dict(batch_index=P(b), head_index=P(h))
    if fs.bias is not None:
      by_name["bias"] = by_name["dbias"] = P(*dims(fs.bias), None, None)
    if fs.block is not None:
      by_name["bm_state"] = by_name["bm_dense"] = P(*dims(fs.block), None, None)

    def layout(names):
      base = _layout_specs(names, axes, kv_whole)
      return tuple(
        by_name.get(
          n, P() if n.startswith(("score", "mask", "dscore")) else spec
        )
        for n, spec in zip(names, base)
      )

    return axes, layout(self.arg_names), layout(self.result_names)

  def local(self, call, mesh, axes):
    batch_axes, head_axes, seq_axes = axes
    if seq_axes:  # (refused earlier by context.check_ring)
      raise NotImplementedError(
        f"{', '.join(call.spec.flex.names())} with a sequence split"
      )
    local = _local_call(
      call, mesh_ways(mesh, batch_axes), mesh_ways(mesh, head_axes)
    )
    split = (bool(batch_axes), bool(head_axes))
    fs = call.spec.flex
    mqa = self.backward and kv_replicated_over_heads(call.spec, head_axes)

    def run(*a):
      outs = list(_flex_compute(local, self.arg_names, split, *a))
      if not self.backward:
        return tuple(outs)
      if mqa:  # each device's dK, dV: its query heads' share
        outs[1:3] = jax.lax.psum(tuple(outs[1:3]), head_axes)
      for i, name in enumerate(self.result_names):
        whole = ()  # mesh axes over which this result is a partial sum
        if name == "dbias":
          whole = (batch_axes if fs.bias[0] == 1 else ()) + (
            head_axes if fs.bias[1] == 1 else ()
          )
        elif name.startswith("dscore"):
          whole = batch_axes + head_axes
        if whole:
          outs[i] = jax.lax.psum(outs[i], whole)
      return tuple(outs)

    return run


def _flex_rule(
  names: tuple[str, ...],
  results: tuple[str, ...],
  spec: Any,
  base: dict[str, str] | None = None,
) -> str:
  """The Shardy rule of a flex call: q, k, v's factors (`base`: a decode
  call's); the bias and block mask's batch / head dims on `b` / the head
  factor where they are not 1; every other dim a factor of its own."""
  fs = spec.flex
  fresh = (f"zz{i}" for i in range(1000))
  base = dict(
    base
    or dict(
      q=_Q,
      k=_KV,
      v=_V,
      out=_O,
      lse=_L,
      dout=_O,
      dlse=_L,
      sinks=_S,
      q_ids="b s",
      kv_ids="b t",
    ),  # fmt: skip
    batch_index="b",
    head_index="{h}",
  )
  consts = {}
  for prefix, fn in (("score", fs.score_mod), ("mask", fs.mask_mod)):
    for i, c in enumerate(() if fn is None else fn.consts):
      consts[f"{prefix}{i}"] = jax.numpy.ndim(c)
      if prefix == "score":
        consts[f"dscore{i}"] = jax.numpy.ndim(c)
    for i, c in enumerate(() if fn is None else fn.constants()):
      consts[f"{prefix}k{i}"] = jax.numpy.ndim(c)

  def lead(d):
    return (
      ("b" if d[0] > 1 else next(fresh))
      + " "
      + ("{h}" if d[1] > 1 else next(fresh))
    )

  def factors(name):
    if name in base:
      return base[name]
    if name in ("bias", "dbias"):
      return f"{lead(fs.bias)} s t"
    if name in ("bm_state", "bm_dense"):
      return f"{lead(fs.block)} {next(fresh)} {next(fresh)}"
    rank = consts[name]
    return " ".join(next(fresh) for _ in range(rank)) if rank else ""

  res = {"q": _Q, "k": _KV, "v": _V, "out": _O, "lse": _L}
  args = ", ".join(factors(n) for n in names)
  outs = ", ".join(res[n] if n in res else factors(n) for n in results)
  return f"{args} -> {outs}"


@functools.cache
def _flex_ops(
  names: tuple[str, ...], results: tuple[str, ...], backward: bool
) -> tuple[_FlexOp, Any]:
  """(op, its custom_partitioning function) of a flex call with these
  operands and results; its rule comes from the call (`_flex_rule`)."""

  def run(call, *arrays):  # the whole call (one device, or unpartitioned)
    return _flex_compute(call, names, (False, False), *arrays)

  op = _FlexOp(names, results, run, "", backward, foldable=False)
  return op, _partitioned(op)


def _whole_under_vmap(
  op: _Op, partitioned: Any, call: StaticCall, *args: jax.Array
) -> tuple[jax.Array, ...]:
  """`partitioned(call, *args)`; under `jax.vmap` the call runs whole,
  vmapped (a flex call: a vmapped axis is not folded into the batch, whose
  index its functions see)."""

  @jax.custom_batching.custom_vmap
  def apply(*args):
    return tuple(partitioned(call, *args))

  @apply.def_vmap
  def rule(axis_size, in_batched, *args):
    axes = [0 if b else None for b in in_batched]
    outs = jax.vmap(lambda *a: tuple(op.run(call, *a)), in_axes=axes)(*args)
    return outs, (True,) * len(outs)

  return apply(*args)


def _global_scales(spec: AttentionSpec) -> bool:
  """FP8 with one scale per tensor: its amax spans every shard, so the call
  runs whole (XLA gathers) rather than per shard with per-shard scales."""
  fp8 = getattr(spec, "fp8", None)  # (a decode spec has none)
  return fp8 is not None and not fp8.block_quantization


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
