"""The `reference` backend: materialized attention in float32, the oracle
(`pallas_fa3.reference`), prefill and decode; never chosen automatically.
Its backward differentiates the materialized forward (it ignores the lse):
docs/api.md#backends.
"""

from __future__ import annotations

from typing import Any

import jax

from pallas_fa3 import flex as flex_lib, reference as oracle
from pallas_fa3.backends.base import Backend
from pallas_fa3.kvcache import DecodeSpec
from pallas_fa3.spec import AttentionSpec


class ReferenceBackend(Backend):
  name = "reference"
  summary = (
    "materialized baseline attention in float32 (the oracle;"
    " memory quadratic in sequence length)"
  )
  backward_uses_lse = False

  def describe(self, spec, config) -> tuple[str, str]:
    what = "materialized attention in float32 (the oracle)"
    if isinstance(spec, DecodeSpec):
      return f"the reference's {what} over each sequence", "none (decoding)"
    return f"the reference's {what}", "JAX autodiff of the materialized forward"

  def unsupported(self, spec: AttentionSpec, config: Any) -> str | None:
    if spec.fp8 is not None:
      return (
        "the reference has no FP8 path (the float64 golden is the oracle"
        " of FP8 accuracy)"
      )
    if spec.stable_max is not None:
      return "stable_max is implemented by the blockwise backend only"
    return None

  def forward(
    self, spec, config, q, k, v, *, sinks=None, segment_ids=None, flex=None
  ):  # fmt: skip
    return oracle.reference_forward(
      spec, q, k, v, sinks=sinks, segment_ids=segment_ids, flex_ops=flex
    )

  def backward(
    self, spec, config, q, k, v, out, lse, dout, dlse, *, sinks=None,
    segment_ids=None, flex=None,
  ):  # fmt: skip
    del out, lse  # plain autodiff through the materialized forward
    if flex is None:
      _, pullback = jax.vjp(
        lambda *a: oracle.reference_forward(
          spec, *a, sinks=sinks, segment_ids=segment_ids
        ),
        q,
        k,
        v,
      )
      return pullback((dout, dlse))

    def forward(q, k, v, bias, floats):
      ops = flex_lib.with_float_consts(flex._replace(bias=bias), floats)
      return oracle.reference_forward(
        spec, q, k, v, sinks=sinks, segment_ids=segment_ids, flex_ops=ops
      )

    floats = flex_lib.float_consts(flex)
    _, pullback = jax.vjp(forward, q, k, v, flex.bias, floats)
    dq, dk, dv, dbias, dfloats = pullback((dout, dlse))
    return dq, dk, dv, (dbias, flex_lib.spread_float_grads(flex, dfloats))

  def describe_tangent(self, spec, config) -> str | None:
    return "jax.jvp of the materialized forward in float32"

  def forward_tangent(self, spec, config, primals, tangents):
    q, k, v, sinks, ids, ops = primals

    def forward(q, k, v, sinks, ops):
      return oracle.reference_forward(
        spec, q, k, v, sinks=sinks, segment_ids=ids, flex_ops=ops
      )

    dq, dk, dv, dsinks, _, dops = tangents
    (out, lse), (dout, dlse) = jax.jvp(
      forward, (q, k, v, sinks, ops), (dq, dk, dv, dsinks, dops)
    )
    return out, lse, dout, dlse

  def decode_splits(self, spec: DecodeSpec, config: Any) -> int:
    return 1  # one materialized pass

  def decode(self, spec, config, splits, operands):
    return oracle.reference_decode(spec, *operands)


REFERENCE = ReferenceBackend()
