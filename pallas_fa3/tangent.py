"""Forward-mode differentiation of a call (`pallas_fa3.vjp`'s jvp rule):
which pass computes the tangents of out and lse, and the words
`pallas_fa3.explain` prints for it. A backend with a tangent pass of its
own runs it (blockwise: one tiled forward-plus-tangent walk; reference:
`jax.jvp` of the materialized forward); the Hopper kernels have no fused
forward-plus-tangent kernel yet, so their calls run the blockwise twin's
pass (the same function) and the plan says so; FP8 refuses; decoding
differentiates the materialized decode: docs/api.md#forward-mode.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from pallas_fa3 import flex, reference as oracle
from pallas_fa3.backends import blockwise
from pallas_fa3.backends.base import Backend, StaticCall
from pallas_fa3.kvcache import DecodeSpec
from pallas_fa3.parallel import partitioning

NO_FP8_JVP = (
  "forward-mode differentiation (jax.jvp, jax.linearize, jax.jacfwd) of FP8"
  " attention is not implemented: differentiate the bf16/fp16 path"
  " (fp8=False), or wrap the FP8 call in jax.lax.stop_gradient"
)
NO_SECOND_ORDER_KERNEL = (
  "forward-over-reverse (jax.hessian, jax.jacfwd of jax.grad) runs the"
  " backward's own jvp, which only the pure-JAX backends have; use"
  " implementation='blockwise' or 'reference' (backend {name!r})"
)


def tangent_backend(
  spec: Any, backend: Backend, config: Any, *, differentiable: bool = False
) -> tuple:
  """(backend, config) whose tangent pass serves a call of `backend`:
  its own, or the blockwise twin's (default tiles): where it has none, or
  where the pass will be differentiated (`differentiable`) and its own is
  a kernel."""
  own = backend.describe_tangent(spec, config) is not None
  if own and (backend.tangent_differentiable or not differentiable):
    return backend, config
  twin = blockwise.BACKEND
  return twin, twin.make_config(spec, None)


def describe(spec: Any, backend: Backend, config: Any) -> str:
  """`pallas_fa3.explain`'s "jvp:" line: what computes the tangents."""
  if isinstance(spec, DecodeSpec):
    return (
      "jax.jvp of the materialized reference decode in float32 (the"
      " decode kernels have no tangent pass)"
    )
  if spec.fp8 is not None:
    return f"refused: {NO_FP8_JVP}"
  own = backend.describe_tangent(spec, config)
  twin, twin_config = tangent_backend(
    spec, backend, config, differentiable=True
  )
  if own is not None and twin is backend:
    return f"{own}; a gradient through the tangent differentiates it"
  twin_words = twin.describe_tangent(spec, twin_config)
  if own is not None:
    return (
      f"{own}; a gradient through the tangent differentiates {twin_words}"
      " instead (the same function); jax.hessian (the backward's jvp) is"
      " refused: blockwise or reference serve it"
    )
  return (
    f"{twin_words} (fallback: {backend.tangent_fallback(spec, config)};"
    " the primal runs its forward kernel); a gradient through the tangent"
    " differentiates that pass; jax.hessian (the backward's jvp) is"
    " refused: blockwise or reference serve it"
  )


def check(static: StaticCall) -> None:
  """Raises NotImplementedError (`NO_FP8_JVP`) for an FP8 call."""
  if static.op == "fp8" or getattr(static.spec, "fp8", None) is not None:
    raise NotImplementedError(NO_FP8_JVP)


def tangents(
  static: StaticCall,
  operands: Any,
  dots: Any,
  result: Any = None,
  *,
  differentiable: bool = False,
  needed: Any = None,
) -> tuple:
  """(out's tangent, lse's tangent) of a forward or decode call at
  `operands` along `dots` (the same tree, zeros instantiated); `result`
  the call's own (out, lse) where known (a kernel pass reads them rather
  than recomputing them). `differentiable`: JAX will differentiate the
  pass (a pure-JAX one serves). `needed` (`vjp.Needed`): whether the
  score_mod's arrays and the bias have tangents; where they have none the
  pass takes the function over frozen arrays and reads no bias tangent
  (`flex.as_differentiated`)."""
  spec = static.spec
  check(static)
  if static.op == "decode":
    _, (dout, dlse) = jax.jvp(
      lambda ops: oracle.reference_decode(spec, *ops), (operands,), (dots,)
    )
    return dout, dlse
  if needed is not None and spec.flex is not None and not differentiable:
    fs, ops = flex.as_differentiated(
      spec.flex, operands.flex, score_consts=needed.score_consts,
      bias=needed.bias,
    )  # fmt: skip
    spec = dataclasses.replace(spec, flex=fs)
    operands = operands._replace(flex=ops)
  backend, config = tangent_backend(
    spec, static.backend, static.config, differentiable=differentiable
  )
  if result is None:
    return backend.forward_tangent(spec, config, operands, dots)[2:]
  return backend.tangent_of_result(spec, config, operands, result, dots)


def backward_tangents(static: StaticCall, operands: Any, dots: Any) -> Any:
  """The tangent of a backward call (forward-over-reverse): `jax.jvp` of
  the backend's own backward where it is pure JAX.

  Raises:
    NotImplementedError: a kernel backend (`NO_SECOND_ORDER_KERNEL`).
  """
  if static.backend.describe_tangent(static.spec, static.config) is None:
    raise NotImplementedError(
      NO_SECOND_ORDER_KERNEL.format(name=static.backend.name)
    )
  _, dgrads = jax.jvp(
    lambda ops: partitioning.run(static, ops), (operands,), (dots,)
  )
  return dgrads
