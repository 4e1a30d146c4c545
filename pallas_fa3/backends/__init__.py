"""The backends, what each supports, and the automatic choice.

A backend that cannot serve a call says why (a string); an explicit request
for it raises `NotImplementedError` with that reason, and the automatic
choice moves on to the next candidate. The automatic order only contains
backends that compute the same function (the kernels and their blockwise
twin); the materialized `reference` is never chosen automatically.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import jax

from pallas_fa3.backends import blockwise
from pallas_fa3 import reference
from pallas_fa3.kernels.sm90 import config as sm90_config
from pallas_fa3.spec import AttentionSpec

# Fastest first. `reference` is deliberately absent: it is the oracle, with
# float32 P, not the kernels' function (P rounded to the input dtype).
AUTO_ORDER: tuple[str, ...] = ("mosaic", "blockwise")

@dataclasses.dataclass(frozen=True)
class Backend:
  """One way to compute attention.

  Attributes:
    name: the `implementation=` string.
    summary: one line for `pallas-fa3 info` and the README table.
    forward: `(spec, config, q, k, v) -> (out, lse)`.
    backward: `(spec, config, q, k, v, out, lse, dout, dlse) -> (dq, dk, dv)`.
    unsupported: `spec -> reason or None`.
    config_type: the config class it takes, or None if it takes none.
    default_config: `spec -> config` when `config=None`.
    device_reason: `() -> reason or None`: whether the devices present can
      run it. Only the automatic choice (and an eager call) consults it, so
      an explicit backend still traces and lowers for another platform
      (`jax.export(..., platforms=['cuda'])` on a machine without a GPU).
  """

  name: str
  summary: str
  forward: Callable[..., Any]
  backward: Callable[..., Any]
  unsupported: Callable[[AttentionSpec], str | None]
  config_type: type | None = None
  default_config: Callable[[AttentionSpec], Any] = lambda spec: None
  device_reason: Callable[[], str | None] = lambda: None


def _reference_forward(spec, config, q, k, v):
  del config
  return reference.reference_forward(spec, q, k, v)


def _reference_backward(spec, config, q, k, v, out, lse, dout, dlse):
  del config, out, lse  # plain autodiff through the materialized forward
  _, pullback = jax.vjp(lambda *a: reference.reference_forward(spec, *a), q, k, v)
  return pullback((dout, dlse))


def hopper_reason() -> str | None:
  """None when the default JAX backend is an sm90 (Hopper) GPU."""
  devices = jax.devices()
  kind = devices[0].platform
  if kind != "gpu":
    return f"no GPU: the default JAX backend is {kind!r}"
  cc = getattr(devices[0], "compute_capability", None)
  if cc is None or not str(cc).startswith("9."):
    return f"GPU {devices[0].device_kind!r} has compute capability {cc}, not sm90"
  return None


def _kernel_forward(interpret: bool):
  def forward(spec, config, q, k, v):
    from pallas_fa3.kernels.sm90 import compat
    from pallas_fa3.kernels.sm90 import forward as sm90_fwd
    params = compat.interpret_params(detect_races=INTERPRET_DETECT_RACES) if interpret else None
    return sm90_fwd.sm90_forward(spec, config, q, k, v, interpret=params)
  return forward


# Race detection in interpret mode costs little at the small shapes the
# interpreter is for, and a race is exactly what it exists to find.
INTERPRET_DETECT_RACES = True


def _kernel_backward(interpret: bool):
  def backward(spec, config, q, k, v, out, lse, dout, dlse):
    del config  # the forward tiling; the backward has its own heuristic
    reason = sm90_config.backward_unsupported(spec)
    if reason:
      # Same gradients from the same residuals, by the blockwise twin; said
      # once per trace, never silently.
      warnings.warn(
          f"the sm90 backward kernels cannot differentiate this call ({reason});"
          " its gradients use the blockwise recomputation (the same function)",
          stacklevel=2)
      return blockwise.blockwise_backward(
          spec, blockwise.BlockwiseConfig(), q, k, v, out, lse, dout, dlse)
    from pallas_fa3.kernels.sm90 import compat
    from pallas_fa3.kernels.sm90 import backward as sm90_bwd
    params = compat.interpret_params(detect_races=INTERPRET_DETECT_RACES) if interpret else None
    return sm90_bwd.sm90_backward(
        spec, sm90_config.default_backward_config(spec), q, k, v, out, lse,
        dout, dlse, interpret=params)
  return backward


def _kernel_unsupported(spec: AttentionSpec) -> str | None:
  return sm90_config.forward_unsupported(spec)


_BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("mosaic", "Pallas Mosaic GPU kernels on a Hopper (sm90) GPU",
                _kernel_forward(interpret=False), _kernel_backward(interpret=False),
                _kernel_unsupported, sm90_config.Sm90ForwardConfig,
                sm90_config.default_forward_config, device_reason=hopper_reason),
        Backend("interpret", "the same kernels in Pallas GPU interpret mode"
                " (CPU, small shapes, tests)",
                _kernel_forward(interpret=True), _kernel_backward(interpret=True),
                _kernel_unsupported, sm90_config.Sm90ForwardConfig,
                sm90_config.default_forward_config),
        Backend("blockwise", "pure-JAX FlashAttention (tiled online softmax),"
                " any device; the kernels' numerics twin",
                blockwise.blockwise_forward, blockwise.blockwise_backward,
                lambda spec: None, blockwise.BlockwiseConfig,
                lambda spec: blockwise.BlockwiseConfig()),
        Backend("reference", "materialized baseline attention in float32"
                " (the oracle; memory quadratic in sequence length)",
                _reference_forward, _reference_backward, lambda spec: None),
    )
}


def get(name: str) -> Backend:
  return _BACKENDS[name]


def all_backends() -> tuple[Backend, ...]:
  return tuple(_BACKENDS.values())


def _config_mismatch(backend: Backend, config: Any) -> str | None:
  if config is None:
    return None
  if backend.config_type is None:
    return f"implementation={backend.name!r} takes no config"
  if not isinstance(config, backend.config_type):
    return (f"implementation={backend.name!r} takes a"
            f" {backend.config_type.__name__}")
  return None


def explain_choice(spec: AttentionSpec, config: Any = None
                   ) -> list[tuple[str, str | None]]:
  """The automatic candidates in order, each with its reason to be skipped (or None)."""
  return [(name, _config_mismatch(_BACKENDS[name], config)
           or _BACKENDS[name].device_reason()
           or _BACKENDS[name].unsupported(spec)) for name in AUTO_ORDER]


def resolve(spec: AttentionSpec, implementation: str | None, config: Any
            ) -> tuple[Backend, Any]:
  """Chooses the backend for a call and fills in its default config.

  Raises:
    NotImplementedError: an explicitly requested backend cannot serve the call.
    TypeError: `config` does not belong to the backend.
  """
  if implementation is None:
    candidates = explain_choice(spec, config)
    chosen = next((name for name, reason in candidates if reason is None), None)
    if chosen is None:
      reasons = "; ".join(f"{n}: {r}" for n, r in candidates)
      raise TypeError(
          f"config={config!r} fits no automatically chosen backend ({reasons})")
    backend = _BACKENDS[chosen]
  else:
    backend = _BACKENDS[implementation]
    mismatch = _config_mismatch(backend, config)
    if mismatch:
      raise TypeError(f"config={config!r} does not fit: {mismatch}")
    reason = backend.unsupported(spec)
    if reason:
      raise NotImplementedError(
          f"implementation={implementation!r} cannot run this call: {reason}")
  return backend, backend.default_config(spec) if config is None else config


def require_runnable_here(backend: Backend) -> None:
  """Raises NotImplementedError, saying why, if the devices present cannot run it.

  For callers that are about to execute locally (an eager call, the training
  loop, the benchmark). Tracing and lowering for another platform
  (`jax.export(..., platforms=['cuda'])`) does not call this.
  """
  reason = backend.device_reason()
  if reason:
    raise NotImplementedError(
        f"implementation={backend.name!r} cannot run here: {reason}. It needs"
        " an sm90 (Hopper) GPU; jax.export(..., platforms=['cuda']) lowers it"
        " on any machine, and implementation='interpret' runs the same kernel"
        " on a CPU")

