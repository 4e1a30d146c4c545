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
    del nzs_in
    result = self(operands)
    return result, (operands, result)

  def vjp_bwd_retval(self, residuals: tuple, cotangents: Any) -> tuple:
    return (_backward(self.static, residuals, _instantiate(cotangents)),)

  def jvp(self, primals: tuple, tangents: tuple) -> tuple[Any, Any]:
    (operands,), (dots,) = primals, tangents
    result = self(operands)
    dots = _instantiate(dots)
    if self.static.op == "backward":
      return result, tangent.backward_tangents(self.static, operands, dots)
    tangent.check(self.static)
    return result, Tangent(self.static, operands, result, dots)(
      operands, result, dots
    )

  lin, linearized = hijax.linearize_from_jvp

  def batch_dim_rule(self, axis_data: Any, dims: tuple) -> Any:
    return _out_dims(self.out_aval, dims)

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

  def __init__(self, static: StaticCall, operands: Any, result: Any, dots: Any):
    args = (operands, result, dots)
    self.in_avals = jax.tree.map(jax.typeof, args)
    self.out_aval = jax.tree.map(
      lambda x: jax.typeof(x).to_tangent_aval(), result
    )
    self.params = dict(static=static)
    super().__init__()

  def expand(self, operands: Any, result: Any, dots: Any) -> Any:
    del result
    return tangent.tangents(self.static, operands, dots)

  def transpose(self, cotangents: Any, operands: Any, result: Any, dots: Any):
    grads = _backward(self.static, (operands, result), _instantiate(cotangents))

    def accumulate(acc: Any, ct: Any) -> None:
      # Only the linear inputs accumulate (an instantiated zero tangent,
      # a known value, does not).
      if _is_accum(acc) and not isinstance(acc, hijax.NullAccum):
        acc.accum(ct)

    # The same tree as the operands (a mismatch raises, never misaligns).
    jax.tree.map(accumulate, dots, grads, is_leaf=_is_accum)

  def vjp_fwd(self, nzs_in: Any, *args: Any) -> tuple[Any, Any]:
    del nzs_in
    return jax.vjp(self.expand, *args)

  def vjp_bwd_retval(self, pullback: Any, cotangents: Any) -> tuple:
    return pullback(_instantiate(cotangents))

  def jvp(self, primals: tuple, tangents: tuple) -> tuple[Any, Any]:
    return jax.jvp(self.expand, primals, _instantiate(tangents))

  lin, linearized = hijax.linearize_from_jvp

  def batch_dim_rule(self, axis_data: Any, dims: tuple) -> Any:
    return _out_dims(self.out_aval, dims)


def _out_dims(out_aval: Any, in_dims: Any) -> Any:
  """vmap's output axes: none when no input is batched, else axis 0 for
  every result (each depends on every operand's batch)."""
  batched = any(d is not None for d in jax.tree.leaves(in_dims))
  return jax.tree.map(lambda _: 0 if batched else None, out_aval)


def _is_accum(x: Any) -> bool:
  return isinstance(x, hijax.GradAccum)


def _instantiate(tree: Any) -> Any:
  """Symbolic zeros (hijax.Zero) as arrays."""
  return jax.tree.map(
    hijax.instantiate_zeros, tree, is_leaf=lambda t: isinstance(t, hijax.Zero)
  )


def _backward(static: StaticCall, residuals: tuple, cotangents: Any) -> Any:
  """The cotangents of a forward call's operands: the backend's backward
  on the residuals (an op "backward" call), the sinks' gradient from out
  and lse, zeros for the segment ids."""
  reason = no_gradient(static)
  if reason:
    raise NotImplementedError(reason)
  operands, (out, lse) = residuals
  dout, dlse = cotangents
  backward = dataclasses.replace(static, op="backward")
  grads = call(backward, Backward(operands, out, lse, dout, dlse))
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
