"""FP8Config: how `flash_attention(..., fp8=...)` quantizes, `check_fp8`,
and the default quantization tiles per head dim (the FP8 kernel's tiles,
which its blockwise twin quantizes with too). Re-exported by
`pallas_fa3.fp8` (and `FP8Config` by `pallas_fa3`). docs/fp8.md
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _normalize_key(value: Any) -> tuple:
  """An int seed or a concrete JAX PRNG key -> hashable ("seed", n) / (impl, data)."""
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(
      f"FP8Config.key must be an int seed or a JAX PRNG key; got {value!r}"
    )
  if isinstance(value, numbers.Integral):
    return ("seed", int(value))
  if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
    return value  # already normalized (dataclasses.replace)
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
      "FP8Config.key must be concrete (an int seed or a PRNG key created"
      " outside jit); for a traced key call pallas_fa3.fp8.quantize(...,"
      " key=key) and flash_attention_fp8"
    )
  if isinstance(value, (jax.Array, np.ndarray)):
    if jnp.issubdtype(value.dtype, jax.dtypes.prng_key) and value.shape == ():
      impl = str(jax.random.key_impl(value))
      data = np.asarray(jax.random.key_data(value))
    elif value.dtype == np.uint32 and value.ndim == 1:  # legacy raw key
      impl, data = "raw", np.asarray(value)
    else:
      raise TypeError(
        "FP8Config.key must be an int seed or a single JAX PRNG key; got an"
        f" array of dtype {value.dtype} and shape {tuple(value.shape)}"
      )
    return (impl, tuple(int(x) for x in data.ravel()))
  raise TypeError(
    f"FP8Config.key must be an int seed or a JAX PRNG key; got"
    f" {value!r} of type {type(value).__name__}"
  )


@dataclasses.dataclass(frozen=True)
class FP8Config:
  """How `flash_attention(..., fp8=...)` quantizes (frozen, hashable, validated).

  Attributes:
    block_quantization: one scale per kernel tile of Q, K and V (True, FA3's
      method) or one scale per tensor (False, the ablation).
    rotation: incoherent processing, Q and K times a random orthogonal
      `D H / sqrt(d)` (True), or not (False, the ablation).
    key: the rotation's randomness, an int seed or a concrete JAX PRNG key
      (stored as its key data, so the config stays hashable).
    q_residual: carry Q as two e4m3 terms, its rounding residual quantized
      again in the same scale (`FP8Inputs.q_residual`): S = (Q + Q_res) K^T
      is two chained wgmma, which removes Q's share of the FP8 error (the
      largest single source, docs/design_notes.md#fp8-accuracy) at the
      price of a second QK^T product: 1.5x the tensor-core work. Off by
      default (FA3's recipe).
  """

  block_quantization: bool = True
  rotation: bool = True
  key: Any = 0
  q_residual: bool = False

  def __post_init__(self) -> None:
    for name in ("block_quantization", "rotation", "q_residual"):
      value = getattr(self, name)
      if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
          f"FP8Config.{name} must be a bool; got {value!r} of"
          f" type {type(value).__name__}"
        )
      object.__setattr__(self, name, bool(value))
    object.__setattr__(self, "key", _normalize_key(self.key))

  def prng_key(self) -> jax.Array:
    """The rotation's PRNG key."""
    kind, data = self.key
    if kind == "seed":
      return jax.random.key(data)
    # Word by word from scalars: under a trace an array built from the tuple
    # would be a closed-over constant, which custom_partitioning rejects.
    words = jnp.stack([jnp.uint32(w) for w in data])
    if kind == "raw":
      return jax.random.wrap_key_data(words)
    return jax.random.wrap_key_data(words, impl=kind)


def check_fp8(fp8: Any) -> FP8Config | None:
  """`fp8=` of flash_attention: False/None (off), True (defaults), an FP8Config.

  Raises:
    TypeError: anything else.
  """
  if fp8 is None or fp8 is False or (isinstance(fp8, np.bool_) and not fp8):
    return None
  if fp8 is True or (isinstance(fp8, np.bool_) and fp8):
    return FP8Config()
  if isinstance(fp8, FP8Config):
    return fp8
  raise TypeError(
    f"fp8 must be a bool or a pallas_fa3.FP8Config; got"
    f" {fp8!r} of type {type(fp8).__name__}"
  )


# (block_q, block_kv) quantization tiles by head dim: the FP8 kernel's
# default tiling (`kernels/sm90/config_fp8.py` builds its defaults from
# these), so a call without a config quantizes and rounds P as the kernel
# does whichever backend runs it; other head dims take `_FALLBACK_TILES`.
DEFAULT_TILES = {64: (64, 128), 128: (64, 128), 256: (64, 64)}
_FALLBACK_TILES = (64, 128)


def default_tiles(head_dim: int) -> tuple[int, int]:
  """The default (block_q, block_kv) quantization tiles at `head_dim`."""
  return DEFAULT_TILES.get(head_dim, _FALLBACK_TILES)
