"""custom_vjp wiring shared by every backend.

Each backend supplies `forward(spec, config, q, k, v) -> (out, lse)` and
`backward(spec, config, q, k, v, out, lse, dout, dlse) -> (dq, dk, dv)`. The
residuals are always `(q, k, v, out, lse)`, so a backend's backward never
depends on private state of its forward, and the lse cotangent is passed
through (a caller may differentiate through the lse as well as the output).
With sinks (`spec.sinks`) both also take the `[b, heads_q]` float32 sinks
last; their gradient is computed here from the residuals
(`modifiers.sinks_gradient`), by no backend.
"""

from __future__ import annotations

import functools
from typing import Any, NoReturn

import jax
import numpy as np

from pallas_fa3 import modifiers
from pallas_fa3.backends.base import StaticCall
from pallas_fa3.parallel import partitioning, sharding_checks


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention_with_lse(
  call: StaticCall,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  sinks: jax.Array | None,
  segment_ids: Any,
) -> tuple[jax.Array, jax.Array]:
  """Returns (out, lse) of `call.backend`; differentiable through both (and
  in `sinks`, `[b, heads_q]` float32 or None). `segment_ids`: a
  `segments.SegmentIds` of int32 arrays, or None (no cotangent).

  Both passes go through `partitioning`, so that under SPMD sharding each
  device runs the backend on its own batch/head shard.
  """
  return partitioning.forward(call, q, k, v, sinks, segment_ids)


def _fwd(
  call: StaticCall,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  sinks: jax.Array | None,
  segment_ids: Any,
) -> tuple[tuple[jax.Array, jax.Array], tuple]:
  out, lse = attention_with_lse(call, q, k, v, sinks, segment_ids)
  return (out, lse), (q, k, v, out, lse, sinks, segment_ids)


def _bwd(call: StaticCall, residuals: tuple, cotangents: tuple) -> tuple:
  q, k, v, out, lse, sinks, segment_ids = residuals
  dout, dlse = cotangents
  dq, dk, dv = _backward_once(
    call, q, k, v, out, lse, dout, dlse, sinks, segment_ids
  )
  dsinks = None
  if sinks is not None:
    dsinks = modifiers.sinks_gradient(sinks, out, lse, dout, dlse)
    layout = sharding_checks.explicit_sharding(sinks)
    if layout is not None:  # `Explicit` axes: the type of the sinks' own
      dsinks = sharding_checks.fit_explicit(dsinks, layout)
  ids_cotangent = None if segment_ids is None else _zero_cotangents(segment_ids)
  return dq, dk, dv, dsinks, ids_cotangent


def _zero_cotangents(tree: Any) -> Any:
  """float0 zeros: the cotangent of integer inputs."""
  return jax.tree.map(
    lambda x: np.zeros(x.shape, dtype=jax.dtypes.float0), tree
  )


NO_HIGHER_ORDER = (
  "flash_attention has no higher-order derivatives: its backward pass is"
  " not differentiable (jax.grad of jax.grad, jax.hessian). Use"
  " pallas_fa3.reference_attention for higher-order derivatives"
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _backward_once(
  call: StaticCall, *residuals_and_cotangents: Any
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The backward pass, itself not differentiable (a clear error if asked).

  Takes `(q, k, v, out, lse, dout, dlse, sinks, segment_ids)`."""
  return partitioning.backward(call, *residuals_and_cotangents)


def _backward_once_fwd(
  call: StaticCall, *args: Any
) -> tuple[tuple[jax.Array, jax.Array, jax.Array], None]:
  return _backward_once(call, *args), None


def _backward_once_bwd(
  call: StaticCall, residuals: None, cotangents: tuple
) -> NoReturn:
  raise NotImplementedError(NO_HIGHER_ORDER)


_backward_once.defvjp(_backward_once_fwd, _backward_once_bwd)


attention_with_lse.defvjp(_fwd, _bwd)
