"""What a backend is: one way to compute attention, and what it supports."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from pallas_fa3.quant import e4m3
from pallas_fa3.spec import AttentionSpec

NO_FP8_GRADIENT = (
  "gradients through FP8 attention are not implemented; differentiate the"
  " bf16/fp16 path (fp8=False) or wrap the FP8 call in"
  " jax.lax.stop_gradient"
)


def _no_reason(spec: AttentionSpec, config: Any) -> str | None:
  del spec, config
  return None


@dataclasses.dataclass(frozen=True, eq=False)
class Backend:
  """One way to compute attention (compared and hashed by identity).

  Attributes:
    name: the `implementation=` string.
    summary: one line for `pallas-fa3 info` and the README table.
    forward: `(spec, config, q, k, v) -> (out, lse)`; with `spec.sinks`
      also `sinks=` (`[b, heads_q]` float32), with `spec.segmented` also
      `segment_ids=` (a `segments.SegmentIds`).
    backward: `(spec, config, q, k, v, out, lse, dout, dlse) -> (dq, dk, dv)`,
      with `segment_ids=` when segmented (sinks are in the lse; `sinks=`
      reaches only a backend with `backward_uses_lse=False`).
    unsupported: `(spec, config) -> reason or None`, config as `make_config`
      returns it; covers `spec.fp8`, `spec.stable_max` and the modifiers
      (`spec.window_size`, `spec.softcap`, `spec.sinks`).
    config_types: the `config=` classes it takes (empty: none).
    make_config: `(spec, config) -> config` with defaults filled in.
    device_reason: `() -> reason or None`: whether the devices present can
      run it. Only the automatic choice and eager calls consult it, so an
      explicit backend still lowers for another platform.
    device_hint: what to do instead when `device_reason` refuses (said
      after the reason).
    fp8_forward: `(spec, config, FP8Inputs) -> (out, lse)`, with `sinks=`
      and `segment_ids=` as `forward` takes them; or None.
    fp8_tiles: `config -> (block_q, block_kv)`, the quantization tiles.
    fp8_quantize: the quantization pass, with `e4m3.quantize_inputs`'s
      signature and bits (default: that pure-JAX pass).
    automatic: a candidate of the automatic choice (computes the kernels'
      function, with P rounded to the input dtype).
    partitionable: may run as a `custom_partitioning` op (a backend whose
      calls have side effects, like the Pallas interpreter's, may not).
    backward_uses_lse: the backward reads the residual lse rather than
      recomputing its own softmax (ring attention needs it).
  """

  name: str
  summary: str
  forward: Callable[..., Any]
  backward: Callable[..., Any]
  unsupported: Callable[[AttentionSpec, Any], str | None] = _no_reason
  config_types: tuple[type, ...] = ()
  make_config: Callable[[AttentionSpec, Any], Any] = lambda spec, config: None
  device_reason: Callable[[], str | None] = lambda: None
  device_hint: str = ""
  fp8_forward: Callable[..., Any] | None = None
  fp8_tiles: Callable[[Any], tuple[int, int]] | None = None
  fp8_quantize: Callable[..., Any] = e4m3.quantize_inputs
  automatic: bool = False
  partitionable: bool = True
  backward_uses_lse: bool = True

  def config_mismatch(self, config: Any) -> str | None:
    """Why `config` does not belong to this backend, or None."""
    if config is None or isinstance(config, self.config_types):
      return None
    if not self.config_types:
      return f"implementation={self.name!r} takes no config"
    names = " or ".join(c.__name__ for c in self.config_types)
    return f"implementation={self.name!r} takes a {names}"

  def run_forward(
    self,
    spec: AttentionSpec,
    config: Any,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    **extras: Any,
  ) -> tuple[jax.Array, jax.Array]:
    """`forward`, or with `spec.fp8` the quantization pass and `fp8_forward`.

    `extras`: `sinks=` and `segment_ids=` when the call has them.
    """
    if spec.fp8 is None:
      return self.forward(spec, config, q, k, v, **extras)
    block_q, block_kv = self.fp8_tiles(config)
    x = self.fp8_quantize(
      q,
      k,
      v,
      spec.fp8.prng_key(),
      block_q=block_q,
      block_kv=block_kv,
      block_quantization=spec.fp8.block_quantization,
      rotation=spec.fp8.rotation,
      q_residual=spec.fp8.q_residual,
    )
    return self.fp8_forward(spec, config, x, **extras)

  def run_backward(
    self,
    spec: AttentionSpec,
    config: Any,
    *residuals_and_cts: jax.Array,
    sinks: jax.Array | None = None,
    segment_ids: Any = None,
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`backward` on `(q, k, v, out, lse, dout, dlse)`; returns (dq, dk, dv).
    `segment_ids` reach every backward (the mask); `sinks` only one with
    `backward_uses_lse=False` (elsewhere they are in the lse).

    Raises:
      NotImplementedError: an FP8 call (FP8 has no backward).
    """
    if spec.fp8 is not None:
      raise NotImplementedError(NO_FP8_GRADIENT)
    extras = {} if segment_ids is None else {"segment_ids": segment_ids}
    if sinks is not None and not self.backward_uses_lse:
      extras["sinks"] = sinks
    return self.backward(spec, config, *residuals_and_cts, **extras)


@dataclasses.dataclass(frozen=True)
class StaticCall:
  """The static (hashable) half of a call: what to compute and with what
  (the custom_vjp's and the partitioner's non-differentiable argument)."""

  spec: AttentionSpec
  backend: Backend
  config: Any = None
