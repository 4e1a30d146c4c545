"""THE differentiation rules: every call of every entry point goes through
`call`, one `jax.experimental.hijax.HiPrim` (`Attention`) whose
`StaticCall` names the op (flash_attention's forward, its backward, the
FP8 forward of pre-quantized operands and decoding). Reverse mode is the
hand-written backward (the residuals, the lse's cotangent and the sinks'
gradient handled here once; the backward refuses a further reverse
derivative, FP8 and decoding refuse gradients); forward mode (`jax.jvp`,
`jax.linearize`, `jax.jacfwd`) runs the primal call and the tangent pass
of `pallas_fa3.tangent`. Every call runs through `parallel.partitioning`:
docs/api.md#backends, docs/design_notes.md#forward-mode-one-primitive-two-rules.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from jax.experimental import hijax

from pallas_fa3 import flex, modifiers, tangent
from pallas_fa3.backends.base import (
  NO_DECODE_GRADIENT,
  NO_FP8_GRADIENT,
  Backward,
  StaticCall,
)
from pallas_fa3.parallel import partitioning, sharding_checks

NO_HIGHER_ORDER = (
  "flash_attention has no higher-order derivatives: its backward pass is"
  " not differentiable (jax.grad of jax.grad, jax.hessian). Use"
  " pallas_fa3.reference_attention for higher-order derivatives"
)


def no_gradient(call: StaticCall) -> str | None:
  """Why `call` has no gradient, or None (a forward that is not FP8)."""
  if call.op == "backward":
    return NO_HIGHER_ORDER
  if call.op == "decode":
    return NO_DECODE_GRADIENT
  if call.op == "fp8" or getattr(call.spec, "fp8", None) is not None:
    return NO_FP8_GRADIENT
  return None


def call(static: StaticCall, operands: Any) -> Any:
  """The result of `static` on `operands` (the tuple of `base` its op
  takes): `(out, lse)`, or for op "backward" a `base.Grads`. Inside a
  `jax.shard_map`, make the operands vary alike first
  (`sharding_checks.vary_alike`): each cotangent then has its primal's
  type."""
  if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(operands)):
    return partitioning.run(static, operands)  # nothing to differentiate
  return Attention(static, operands)(operands)


class Attention(hijax.HiPrim):
  """One attention call as a primitive: `expand` runs it
  (`partitioning.run`), `vjp_fwd`/`vjp_bwd_retval` are the hand-written
  backward, `jvp` the primal plus `tangent.tangents`, and `linearize`
  comes from the jvp rule. Its output types are those of the call traced
  once here (that trace is what `expand` inlines)."""

  def __init__(self, static: StaticCall, operands: Any):
    traced = jax.jit(functools.partial(partitioning.run, static)).trace(
      operands
    )
    self.in_avals = (jax.tree.map(jax.typeof, operands),)
    self.out_aval = traced.out_avals
    # The call's own effects (the Pallas interpreter's callbacks), seen by
    # JAX as before (a cond under vmap refuses them, nothing drops them).
    self.effects = traced.effects
    self.params = dict(static=static, traced=traced)
    super().__init__()

  def expand(self, operands: Any) -> Any:
    return self.traced(operands)

  def vjp_fwd(self, nzs_in: Any, operands: Any) -> tuple[Any, tuple]:
    result = self(operands)
    return result, (operands, result, Needed.of(nzs_in[0]))

  def vjp_bwd_retval(self, residuals: tuple, cotangents: Any) -> tuple:
    *residuals, needed = residuals
    grads = _backward(
      self.static, tuple(residuals), _instantiate(cotangents), needed
    )
    return (grads,)

  def jvp(self, primals: tuple, tangents: tuple) -> tuple[Any, Any]:
    (operands,), (dots,) = primals, tangents
    result = self(operands)
    if self.static.op == "backward":
      return result, tangent.backward_tangents(
        self.static, operands, _instantiate(dots)
      )
    tangent.check(self.static)
    # Which flex arrays have tangents (symbolic zeros: none), before the
    # zeros become arrays: the tangent pass then runs the score_mod over
    # frozen arrays and reads no bias tangent.
    nonzero = jax.tree.map(
      lambda t: not isinstance(t, hijax.Zero),
      tangents[0],
      is_leaf=lambda t: isinstance(t, hijax.Zero),
    )
    needed = Needed.of(nonzero)
    dots = _instantiate(dots)
    return result, Tangent(self.static, operands, result, dots, needed)(
      operands, result, dots
    )

  lin, linearized = hijax.linearize_from_jvp

  def batch(self, axis_data: Any, args: tuple, dims: Any) -> tuple:
    return _batch(self, axis_data, args, dims)

  def __hash__(self) -> int:
    return hash((type(self), self.static, id(self.traced)))

  def __eq__(self, other: Any) -> bool:
    return (
      type(self) is type(other)
      and self.static == other.static
      and self.traced is other.traced
    )


class Tangent(hijax.HiPrim):
  """The tangents of a forward or decode call's (out, lse) at `operands`
  along `dots`: linear in `dots`, computed by `tangent.tangents`, and
  transposed by the hand-written backward (so `jax.linearize` +
  `jax.linear_transpose` and `jax.checkpoint`'s linearization run the
  backward kernels, as `jax.grad` does). Its own derivatives (the tangent
  differentiated again: `jax.grad` through a jvp, `jax.jacfwd` twice) are
  JAX autodiff of the tangent pass (pure JAX). `result`, the call's
  (out, lse), is read by the transpose only."""

  def __init__(
    self,
    static: StaticCall,
    operands: Any,
    result: Any,
    dots: Any,
    needed: Needed | None = None,
  ):
    args = (operands, result, dots)
    self.in_avals = jax.tree.map(jax.typeof, args)
    self.out_aval = jax.tree.map(
      lambda x: jax.typeof(x).to_tangent_aval(), result
    )
    # `needed`: which flex arrays have nonzero tangents (`Needed`).
    self.params = dict(static=static, needed=needed or Needed())
    super().__init__()

  def expand(self, operands: Any, result: Any, dots: Any) -> Any:
    return tangent.tangents(
      self.static, operands, dots, result, needed=self.needed
    )

  def differentiable(self, operands: Any, result: Any, dots: Any) -> Any:
    """The tangents by a pass JAX can differentiate (pure JAX)."""
    del result
    return tangent.tangents(self.static, operands, dots, differentiable=True)

  def transpose_values(self, cotangents: Any, operands: Any, result: Any):
    """The transpose's value: the tangents' cotangents (a `Prefill`)."""
    return _backward(self.static, (operands, result), _instantiate(cotangents))

  def transpose(self, cotangents: Any, operands: Any, result: Any, dots: Any):
    _accumulate(dots, self.transpose_values(cotangents, operands, result))

  def vjp_fwd(self, nzs_in: Any, *args: Any) -> tuple[Any, Any]:
    # The value by `expand` (the kernel where one serves); the pullback
    # differentiates the pure-JAX pass, traced only if a cotangent comes
    # (none where the tangent is used under stop_gradient).
    del nzs_in
    return self(*args), args

  def vjp_bwd_retval(self, args: Any, cotangents: Any) -> tuple:
    _, pullback = jax.vjp(self.differentiable, *args)
    return pullback(_instantiate(cotangents))

  def jvp(self, primals: tuple, tangents: tuple) -> tuple[Any, Any]:
    return jax.jvp(self.differentiable, primals, _instantiate(tangents))

  lin, linearized = hijax.linearize_from_jvp

  def batch(self, axis_data: Any, args: tuple, dims: Any) -> tuple:
    return _batch(self, axis_data, args, dims)


class Batched(hijax.HiPrim):
  """`inner` (an `Attention` or `Tangent`) under `jax.vmap`: its arguments
  batched on axis 0 where `in_dims` says 0 (None: not batched), every
  result on axis 0. Each rule is `inner`'s, vmapped (the residuals and
  cotangents of unbatched arguments summed over the batch)."""

  def __init__(self, inner: Any, axis: tuple, in_dims: tuple, args: tuple):
    self.in_avals = jax.tree.map(jax.typeof, args)
    self.params = dict(inner=inner, axis=axis, in_dims=in_dims)
    traced = jax.jit(self._vmap(inner.expand, in_dims)).trace(*args)
    self.out_aval = traced.out_avals
    self.effects = traced.effects
    self.params["traced"] = traced
    super().__init__()

  def _vmap(self, fn: Any, in_axes: Any) -> Any:
    """`fn` vmapped over this batch axis, every result on axis 0."""
    size, name, spmd = self.params["axis"]
    return jax.vmap(
      fn,
      in_axes=in_axes,
      out_axes=0,
      axis_size=size,
      axis_name=name,
      spmd_axis_name=spmd,
    )

  def expand(self, *args: Any) -> Any:
    return self.params["traced"](*args)

  def jvp(self, primals: tuple, tangents: tuple) -> tuple[Any, Any]:
    dims = self.params["in_dims"]
    return self._vmap(self.params["inner"].jvp, (dims, dims))(
      primals, _instantiate(tangents)
    )

  lin, linearized = hijax.linearize_from_jvp

  def vjp_fwd(self, nzs_in: Any, *args: Any) -> tuple[Any, Any]:
    inner = self.params["inner"]
    return self._vmap(
      lambda *a: inner.vjp_fwd(nzs_in, *a), self.params["in_dims"]
    )(*args)

  def vjp_bwd_retval(self, residuals: Any, cotangents: Any) -> Any:
    inner = self.params["inner"]
    cts = self._vmap(inner.vjp_bwd_retval, 0)(
      residuals, _instantiate(cotangents)
    )
    return _unbatched(cts, self.params["in_dims"])

  def transpose(self, cotangents: Any, operands: Any, result: Any, dots: Any):
    ops_dims, result_dims, dots_dims = self.params["in_dims"]
    grads = self._vmap(
      self.params["inner"].transpose_values, (0, ops_dims, result_dims)
    )(_instantiate(cotangents), operands, result)
    _accumulate(dots, _unbatched(grads, dots_dims))

  def batch(self, axis_data: Any, args: tuple, dims: Any) -> tuple:
    return _batch(self, axis_data, args, dims)

  def __hash__(self) -> int:
    return hash((type(self), id(self.params["traced"])))

  def __eq__(self, other: Any) -> bool:
    return type(self) is type(other) and (
      self.params["traced"] is other.params["traced"]
    )


def _batch(prim: Any, axis_data: Any, args: tuple, dims: Any) -> tuple:
  """`prim` applied to `args` batched along `dims` (the hijax `batch`
  rule): a `Batched` of it, every result on axis 0; `prim` itself where
  nothing is batched."""
  flat, tree = jax.tree.flatten(args)
  flat_dims = _flat_dims(tree, dims)
  if all(d is None for d in flat_dims):
    out = prim(*args)
    return out, jax.tree.map(lambda _: None, out)
  front = [x if d is None else jax.numpy.moveaxis(x, d, 0)
           for x, d in zip(flat, flat_dims)]  # fmt: skip
  in_dims = tree.unflatten([None if d is None else 0 for d in flat_dims])
  args = tree.unflatten(front)
  spmd = axis_data.spmd_name or axis_data.explicit_mesh_axis
  axis = (axis_data.size, axis_data.name, spmd)
  out = Batched(prim, axis, in_dims, args)(*args)
  return out, jax.tree.map(lambda _: 0, out)


def _flat_dims(tree: Any, dims: Any) -> list:
  """One axis (or None) per leaf of `tree` from `dims`, the arguments'
  tree of axes or a prefix of it, whatever sequence type its nodes are
  (JAX 0.11 passes the arguments' own NamedTuples, 0.12 plain tuples)."""
  if dims is None or isinstance(dims, int):
    return [dims] * tree.num_leaves
  if tree.num_leaves == 1 and not tree.children():
    return [dims]
  if not isinstance(dims, (tuple, list)):  # a custom node (a BlockMask)
    return tree.flatten_up_to(dims)
  children = tree.children()
  dims = tuple(dims)
  if len(dims) != len(children):
    raise ValueError(f"batch axes {dims!r} do not match the arguments {tree}")
  return [d for c, x in zip(children, dims) for d in _flat_dims(c, x)]


def _unbatched(cts: Any, dims: Any) -> Any:
  """Cotangents computed per example (axis 0) for arguments batched along
  `dims` (0 or None, a prefix of `cts`): those of unbatched ones summed."""

  def one(d: Any, ct: Any) -> Any:
    if d is not None or ct is None:
      return ct
    if ct.dtype == jax.dtypes.float0:
      return np.zeros(ct.shape[1:], jax.dtypes.float0)
    return ct.sum(axis=0)

  return jax.tree.map(one, dims, cts, is_leaf=lambda d: d is None)


def _accumulate(dots: Any, cts: Any) -> None:
  """Adds `cts` into the linear inputs among `dots` (the same tree: a
  mismatch raises, never misaligns); a known value (an instantiated zero
  tangent) or a `NullAccum` takes nothing."""

  def one(acc: Any, ct: Any) -> None:
    if _is_accum(acc) and not isinstance(acc, hijax.NullAccum):
      acc.accum(ct)

  jax.tree.map(one, dots, cts, is_leaf=_is_accum)


def _is_accum(x: Any) -> bool:
  return isinstance(x, hijax.GradAccum)


def _instantiate(tree: Any) -> Any:
  """Symbolic zeros (hijax.Zero) as arrays."""
  return jax.tree.map(
    hijax.instantiate_zeros, tree, is_leaf=lambda t: isinstance(t, hijax.Zero)
  )


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Needed:
  """Which gradients a reverse-mode call needs beyond q, k, v (a static
  residual): `score_consts`, whether any of the score_mod's arrays was
  differentiated (else the backward runs the function `flex.frozen`: no
  per-array sums, and the fused kernel where it takes the options);
  `bias`, whether the bias was (else no dbias: the kernels write no dS)."""

  score_consts: bool = True
  bias: bool = True

  @classmethod
  def of(cls, nonzero: Any) -> Needed:
    """From the call's operands' tree of nonzero-tangent flags."""
    flex_nz = getattr(nonzero, "flex", None)
    if flex_nz is None:
      return cls()
    return cls(
      score_consts=any(jax.tree.leaves(flex_nz.score_consts)),
      bias=bool(flex_nz.bias),
    )


def _backward(
  static: StaticCall,
  residuals: tuple,
  cotangents: Any,
  needed: Needed = Needed(),
) -> Any:
  """The cotangents of a forward call's operands: the backend's backward
  on the residuals (an op "backward" call), the sinks' gradient from out
  and lse, zeros for the segment ids and for what `needed` says is not
  needed."""
  reason = no_gradient(static)
  if reason:
    raise NotImplementedError(reason)
  operands, (out, lse) = residuals
  dout, dlse = cotangents
  backward = dataclasses.replace(static, op="backward")
  run = operands
  fs = static.spec.flex
  if fs is not None:
    fs, ops = flex.as_differentiated(
      fs, operands.flex, score_consts=needed.score_consts, bias=needed.bias
    )
    if fs is not static.spec.flex:  # (the kernels' plan: for these options)
      spec = dataclasses.replace(static.spec, flex=fs)
      plan = static.backward_plan
      if plan is not None:
        plan = static.backend.plan_backward(spec, static.config)
      backward = dataclasses.replace(backward, spec=spec, backward_plan=plan)
      run = operands._replace(flex=ops)
  grads = call(backward, Backward(run, out, lse, dout, dlse))
  dq, dk, dv = grads.dq, grads.dk, grads.dv
  dflex = None
  if operands.flex is not None:  # (dbias, d score_mod's arrays)
    dflex = flex.cotangents(operands.flex, *grads.dflex)
  dsinks = None
  if operands.sinks is not None:
    dsinks = modifiers.sinks_gradient(operands.sinks, out, lse, dout, dlse)
    layout = sharding_checks.explicit_sharding(operands.sinks)
    if layout is not None:  # `Explicit` axes: the type of the sinks' own
      dsinks = sharding_checks.fit_explicit(dsinks, layout)
  ids = operands.segment_ids
  ids = None if ids is None else _zero_cotangents(ids)
  return operands._replace(
    q=dq, k=dk, v=dv, sinks=dsinks, segment_ids=ids, flex=dflex
  )


def _zero_cotangents(tree: Any) -> Any:
  """float0 zeros: the cotangent of integer inputs."""
  return jax.tree.map(
    lambda x: np.zeros(x.shape, dtype=jax.dtypes.float0), tree
  )
