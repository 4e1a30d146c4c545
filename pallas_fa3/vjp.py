"""custom_vjp wiring shared by every backend.

Each backend supplies `forward(spec, config, q, k, v) -> (out, lse)` and
`backward(spec, config, q, k, v, out, lse, dout, dlse) -> (dq, dk, dv)`. The
residuals are always `(q, k, v, out, lse)`, so a backend's backward never
depends on private state of its forward, and the lse cotangent is passed
through (a caller may differentiate through the lse as well as the output).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from pallas_fa3.parallel import partitioning
from pallas_fa3.spec import AttentionSpec


@dataclasses.dataclass(frozen=True)
class StaticCall:
  """The static (hashable) half of a call: what to compute and with what."""

  spec: AttentionSpec
  backend: str
  config: Any = None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention_with_lse(call: StaticCall, q, k, v):
  """Returns (out, lse) of `call.backend`; differentiable through both.

  Both passes go through `partitioning`, so that under SPMD sharding each
  device runs the backend on its own batch/head shard.
  """
  return partitioning.forward(call, q, k, v)


def _fwd(call: StaticCall, q, k, v):
  out, lse = attention_with_lse(call, q, k, v)
  return (out, lse), (q, k, v, out, lse)


def _bwd(call: StaticCall, residuals, cotangents):
  q, k, v, out, lse = residuals
  dout, dlse = cotangents
  return partitioning.backward(call, q, k, v, out, lse, dout, dlse)


attention_with_lse.defvjp(_fwd, _bwd)
