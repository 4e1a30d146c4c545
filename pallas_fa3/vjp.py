"""THE custom_vjp: every call of every entry point goes through `call`, whose
`StaticCall` names the op (flash_attention's forward, its backward, which
refuses a further derivative, the FP8 forward of pre-quantized operands
and decoding, which refuse gradients), with the residuals, the lse's
cotangent and the sinks' gradient handled here once, and every call run
through `parallel.partitioning`: docs/api.md#backends.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from pallas_fa3 import flex, modifiers
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def call(static: StaticCall, operands: Any) -> Any:
  """The result of `static` on `operands` (the tuple of `base` its op
  takes): `(out, lse)`, or for op "backward" `(dq, dk, dv)`. Inside a
  `jax.shard_map`, make the operands vary alike first
  (`sharding_checks.vary_alike`): each cotangent then has its primal's
  type."""
  return partitioning.run(static, operands)


def _fwd(static: StaticCall, operands: Any) -> tuple[Any, tuple]:
  result = call(static, operands)
  return result, (operands, result)


def _bwd(static: StaticCall, residuals: tuple, cotangents: Any) -> tuple:
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
  return (
    operands._replace(
      q=dq, k=dk, v=dv, sinks=dsinks, segment_ids=ids, flex=dflex
    ),
  )


def _zero_cotangents(tree: Any) -> Any:
  """float0 zeros: the cotangent of integer inputs."""
  return jax.tree.map(
    lambda x: np.zeros(x.shape, dtype=jax.dtypes.float0), tree
  )


call.defvjp(_fwd, _bwd)
