"""The backends of `flash_attention_with_kvcache` and their automatic choice.

The same names as `flash_attention`'s (`IMPLEMENTATIONS`): `reference`
(gather and materialize: the oracle), `blockwise` (the kernel's twin in
pure JAX, any device), `mosaic` (the Hopper decode kernel) and `interpret`
(that kernel on a CPU). The automatic choice takes `mosaic` on an sm90 GPU
when it serves the call, else `blockwise`; an explicit request that a
backend cannot serve raises `NotImplementedError` with the reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pallas_fa3.backends import (
  IMPLEMENTATIONS,
  blockwise_decode,
  check_implementation,
  sm90,
)
from pallas_fa3.backends.blockwise import BlockwiseConfig
from pallas_fa3.kvcache_spec import DecodeSpec
from pallas_fa3.reference_decode import reference_decode


@dataclasses.dataclass(frozen=True, eq=False)
class DecodeBackend:
  """One way to attend over a KV cache (compared and hashed by identity).

  `run(spec, config, splits, q, k_cache, v_cache, lengths, rows,
  page_table, sinks, descale) -> (out, lse)`: `v_cache` is None with
  `spec.v_in_k` (V: k_cache's first head_dim_v columns, read in place; a
  backend that cannot says so in `unsupported`); lengths are each sequence's
  keys (the appended tokens already written), `rows` the contiguous cache
  rows, `splits` the split-KV ranges, `sinks` float32 `[b, hq]` or None,
  `descale` an e4m3 cache's float32 `(k_descale, v_descale)`, each
  `[b, hk]`, or None.
  """

  name: str
  run: Callable[..., Any]
  unsupported: Callable[[DecodeSpec, Any], str | None] = lambda s, c: None
  config_types: tuple[type, ...] = ()
  make_config: Callable[[DecodeSpec, Any], Any] = lambda spec, config: None
  splits: Callable[[DecodeSpec, Any], int] = lambda spec, config: 1
  device_reason: Callable[[], str | None] = lambda: None
  device_hint: str = ""
  automatic: bool = False


def _reference_run(spec, config, splits, *args):
  del config, splits  # one materialized pass
  return reference_decode(spec, *args)


def _blockwise_run(spec, config, splits, *args):
  return blockwise_decode.blockwise_decode(spec, config.block_kv, splits, *args)


def _blockwise_config(spec: DecodeSpec, config: Any) -> BlockwiseConfig:
  del spec
  return BlockwiseConfig() if config is None else config


REFERENCE = DecodeBackend("reference", _reference_run)
BLOCKWISE = DecodeBackend(
  "blockwise",
  _blockwise_run,
  config_types=(BlockwiseConfig,),
  make_config=_blockwise_config,
  splits=lambda spec, config: spec.num_splits or 1,
  automatic=True,
)


def _kernel(interpret: bool) -> DecodeBackend:
  def run(spec, config, splits, *args):
    from pallas_fa3.kernels.sm90 import decode as kernel  # pylint: disable=g-import-not-at-top

    params = sm90.interpret_params() if interpret else None
    return kernel.sm90_decode(spec, config, splits, *args, interpret=params)

  def unsupported(spec: DecodeSpec, config: Any) -> str | None:
    from pallas_fa3.kernels.sm90 import config_decode  # pylint: disable=g-import-not-at-top

    return config_decode.decode_unsupported(spec, config)

  def make_config(spec: DecodeSpec, config: Any) -> Any:
    from pallas_fa3.kernels.sm90 import config_decode  # pylint: disable=g-import-not-at-top

    return config or config_decode.default_decode_config(spec)

  def splits(spec: DecodeSpec, config: Any) -> int:
    from pallas_fa3.kernels.sm90 import config_decode  # pylint: disable=g-import-not-at-top

    return spec.num_splits or config_decode.default_splits(spec, config)

  from pallas_fa3.kernels.sm90.config_decode import Sm90DecodeConfig  # pylint: disable=g-import-not-at-top

  backend = sm90.INTERPRET if interpret else sm90.MOSAIC
  return DecodeBackend(
    backend.name,
    run,
    unsupported,
    config_types=(Sm90DecodeConfig,),
    make_config=make_config,
    splits=splits,
    device_reason=backend.device_reason,
    device_hint=backend.device_hint,
    automatic=not interpret,
  )


# Fastest first, as in the flash_attention registry.
DECODE_BACKENDS = (_kernel(False), _kernel(True), BLOCKWISE, REFERENCE)
_BY_NAME = {b.name: b for b in DECODE_BACKENDS}
assert set(_BY_NAME) == set(IMPLEMENTATIONS)


def _reason(backend: DecodeBackend, spec: DecodeSpec, config: Any, auto: bool):
  if config is not None and not isinstance(config, backend.config_types):
    if not backend.config_types:
      return f"implementation={backend.name!r} takes no config"
    names = " or ".join(c.__name__ for c in backend.config_types)
    return f"implementation={backend.name!r} takes a {names}"
  reason = backend.device_reason() if auto else None
  return reason or backend.unsupported(spec, backend.make_config(spec, config))


def explain_decode_choice(spec: DecodeSpec, config: Any = None) -> list:
  """The automatic candidates in order with their reasons to be skipped."""
  return [
    (b.name, _reason(b, spec, config, auto=True))
    for b in DECODE_BACKENDS
    if b.automatic
  ]


def resolve_decode(
  spec: DecodeSpec, implementation: str | None, config: Any
) -> tuple[DecodeBackend, Any, int]:
  """(backend, its config with defaults, split-KV ranges) for a call.

  Raises:
    NotImplementedError: the requested backend cannot serve the call.
    TypeError: `config` fits no (requested) backend.
  """
  implementation = check_implementation(implementation)
  if implementation is None:
    candidates = explain_decode_choice(spec, config)
    chosen = next((n for n, r in candidates if r is None), None)
    if chosen is None:
      reasons = "; ".join(f"{n}: {r}" for n, r in candidates)
      error = TypeError if config is not None else NotImplementedError
      raise error(f"no decode backend can run this call ({reasons})")
    backend = _BY_NAME[chosen]
  else:
    backend = _BY_NAME[implementation]
    reason = _reason(backend, spec, config, auto=False)
    if reason and config is not None and "takes" in reason:
      raise TypeError(f"config={config!r} does not fit: {reason}")
    if reason:
      raise NotImplementedError(
        f"implementation={implementation!r} cannot run this call: {reason}"
      )
  config = backend.make_config(spec, config)
  return backend, config, backend.splits(spec, config)
