"""Every implementation of attention, in one registry, and the automatic
choice, for every mode of a call: an `AttentionSpec` (flash_attention, FP8
included) or a `DecodeSpec` (flash_attention_with_kvcache). `BACKENDS` is
the only place implementation names are spelled. A backend that cannot
serve a call says why: an explicit request raises `NotImplementedError`
with that reason, the automatic choice moves on to the next candidate. The
materialized `reference` is the oracle, never chosen automatically.
docs/api.md#backends
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, get_args

from pallas_fa3.backends import blockwise, sm90
from pallas_fa3.backends.base import Backend, Spec
from pallas_fa3.backends.reference import REFERENCE
from pallas_fa3.kvcache import DecodeSpec

hopper_reason = sm90.hopper_reason  # re-exported: None on an sm90 GPU

# Fastest first: the automatic choice takes the first automatic backend that
# can serve the call.
BACKENDS: tuple[Backend, ...] = (
  sm90.MOSAIC,
  sm90.INTERPRET,
  blockwise.BACKEND,
  REFERENCE,
)
_BY_NAME = {b.name: b for b in BACKENDS}
# The names of `implementation=` (spelled out for type checkers; the
# registry is the authority, checked below).
Implementation = Literal["mosaic", "interpret", "blockwise", "reference"]
IMPLEMENTATIONS: tuple[str, ...] = tuple(_BY_NAME)
assert get_args(Implementation) == IMPLEMENTATIONS, IMPLEMENTATIONS
AUTO_ORDER: tuple[str, ...] = tuple(b.name for b in BACKENDS if b.automatic)


def get(name: str) -> Backend:
  """The backend called `name` (one of `IMPLEMENTATIONS`)."""
  return _BY_NAME[check_implementation(name)]


def check_implementation(implementation: Any) -> str | None:
  """Validates `implementation=` (None means automatic); returns it.

  Raises:
    TypeError: not None or a string.
    ValueError: not one of `IMPLEMENTATIONS`.
  """
  if implementation is None:
    return None
  if not isinstance(implementation, str):
    raise TypeError(
      f"implementation must be None or a string, one of {IMPLEMENTATIONS};"
      f" got {implementation!r} of type {type(implementation).__name__}"
    )
  if implementation not in _BY_NAME:
    raise ValueError(
      f"implementation must be None or one of"
      f" {IMPLEMENTATIONS}; got {implementation!r}"
    )
  return implementation


def _reason(
  backend: Backend, spec: Spec, config: Any, automatic: bool
) -> str | None:
  """Why `backend` cannot serve the call (with the device when automatic)."""
  reason = backend.config_mismatch(config, spec)
  if reason is None and automatic:
    reason = backend.device_reason()
  if reason is None:
    reason = backend.reason(spec, backend.config_for(spec, config))
  return reason


def unsupported_reason(
  implementation: str, spec: Spec, config: Any = None
) -> str | None:
  """Why `implementation` cannot serve the call (devices aside), or None."""
  return _reason(get(implementation), spec, config, automatic=False)


def explain_choice(
  spec: Spec, config: Any = None
) -> list[tuple[str, str | None]]:
  """The automatic candidates in order, each with its reason to be skipped
  (None for those that can serve the call)."""
  return [
    (name, _reason(_BY_NAME[name], spec, config, automatic=True))
    for name in AUTO_ORDER
  ]


def resolve(
  spec: Spec, implementation: Implementation | None, config: Any
) -> tuple[Backend, Any]:
  """The backend for a call (either mode) and its config with defaults
  filled in.

  Raises:
    NotImplementedError: an explicitly requested backend cannot serve the
      call, or no automatic candidate can.
    TypeError: `config` belongs to no (requested) backend.
  """
  implementation = check_implementation(implementation)
  if implementation is None:
    candidates = explain_choice(spec, config)
    chosen = next((name for name, reason in candidates if reason is None), None)
    if chosen is None:
      reasons = "; ".join(f"{n}: {r}" for n, r in candidates)
      if config is not None:
        raise TypeError(
          f"config={config!r} fits no automatically chosen backend ({reasons})"
        )
      raise NotImplementedError(f"no backend can run this call ({reasons})")
    backend = _BY_NAME[chosen]
  else:
    backend = _BY_NAME[implementation]
    mismatch = backend.config_mismatch(config, spec)
    if mismatch:
      raise TypeError(f"config={config!r} does not fit: {mismatch}")
    reason = _reason(backend, spec, config, automatic=False)
    if reason:
      raise NotImplementedError(
        f"implementation={implementation!r} cannot run this call: {reason}"
      )
  return backend, backend.config_for(spec, config)


@dataclasses.dataclass(frozen=True)
class Plan:
  """What a call runs, decided once (`plan`): its backend and config
  (defaults filled in), how its gradients run (`Backend.plan_backward`,
  carried to the backward as `StaticCall.backward_plan`), and for the
  automatic choice the candidates skipped and why. `explain()` says it
  in words (`pallas_fa3.explain`)."""

  spec: Spec
  backend: Backend
  config: Any
  backward: Any = None
  requested: str | None = None
  skipped: tuple[tuple[str, str], ...] = ()

  def explain(self) -> str:
    """The plan as lines of text: the call, the backend and why, what runs
    forward and backward, how each flex function compiles."""
    spec, backend = self.spec, self.backend
    why = (
      f"requested: implementation={self.requested!r}"
      if self.requested
      else "the automatic choice"
    )
    lines = [f"call: {spec.describe()}", f"backend: {backend.name} ({why})"]
    lines += [f"  skipped {n}: {r}" for n, r in self.skipped]
    forward, backward = backend.describe(spec, self.config)
    mode = "decode" if isinstance(spec, DecodeSpec) else "forward"
    lines.append(f"{mode}: {forward}")
    lines.append(f"backward: {backward}")
    from pallas_fa3 import tangent  # (it imports the backends)

    lines.append(f"jvp: {tangent.describe(spec, backend, self.config)}")
    lines += backend.describe_flex(spec, self.config)
    if (
      getattr(spec, "segmented", False)
      and (spec.causal or spec.window_size is not None)
      and spec.seq_q != spec.seq_kv
    ):
      lines.append(
        "note: causal / window_size beside segment_ids align over the whole"
        f" row (key j <= query i + {spec.seq_kv - spec.seq_q}), not per"
        " document: where a document's queries and keys sit at different"
        " places (FA3 varlen's cu_seqlens_q != cu_seqlens_k as ids) that is"
        " not per-sequence causal (docs/api.md#causal-across-packed-documents)"
      )
    return "\n".join(lines)


def plan(
  spec: Spec, implementation: Implementation | None, config: Any
) -> Plan:
  """`resolve`, and the rest of what the call runs decided with it (its
  backward's form, for the Hopper kernels): the one place a call's
  kernels are chosen. Raises as `resolve` does."""
  backend, filled = resolve(spec, implementation, config)
  skipped = ()
  if implementation is None:
    first = AUTO_ORDER.index(backend.name)
    skipped = tuple(explain_choice(spec, config)[:first])
  config = filled
  backward = None
  if not isinstance(spec, DecodeSpec):
    backward = backend.plan_backward(spec, config)
  return Plan(spec, backend, config, backward, implementation, skipped)


def require_runnable_here(backend: Backend) -> None:
  """Raises NotImplementedError, saying why, if the devices present cannot
  run `backend` (for callers about to execute locally: an eager call, the
  training loop, the benchmark)."""
  reason = backend.device_reason()
  if reason:
    hint = f". {backend.device_hint}" if backend.device_hint else ""
    raise NotImplementedError(
      f"implementation={backend.name!r} cannot run here: {reason}{hint}"
    )
