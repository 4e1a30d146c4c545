"""FP8 (e4m3) attention forward: quantization pass, configuration and entry points.

FlashAttention-3's accuracy techniques for FP8 (paper section 3.3), which the
public CUDA kernel leaves out and ours carry:

- **Block quantization.** One float32 scale per `block_q x d` tile of Q and
  per `block_kv x d` tile of K and of V, `scale = amax(tile) / 448` (448 is
  e4m3's largest finite value), so a tile's outliers only coarsen that tile.
  The tiles are the kernel's tiles: the kernel folds the Q and K scales of a
  tile pair into its softmax scale and carries the V scale through O.
- **Incoherent processing.** Q and K are multiplied along head_dim by the
  orthogonal `M = D H / sqrt(d)` (D a random +-1 diagonal from a JAX PRNG
  key, H the Walsh-Hadamard matrix), which leaves `(QM)(KM)^T = QK^T` exact
  in real arithmetic and spreads outlier features across the row before
  quantization. Computed with a fast Walsh-Hadamard transform in
  O(d log d) per row, fused with the quantization. V is not rotated.
- **Layout.** FP8 wgmma wants both operands k-major; for O = P V the
  contraction runs over the sequence, so V is written transposed,
  `[batch, heads_kv, head_dim, seq_kv]` (sequence-contiguous).

The quantization pass is a jitted pure-JAX function (XLA fuses the rotation,
the tile amax and the cast into a few passes over Q, K and V); it runs on any
device. A Pallas kernel for it is not written yet.

Entry points:
  `pallas_fa3.flash_attention(q, k, v, fp8=True | FP8Config(...))`
      quantizes bf16/fp16/fp32 inputs and runs the FP8 forward.
  `quantize(q, k, v, block_q=..., block_kv=...)` -> `FP8Inputs`, and
  `flash_attention_fp8(q8, k8, v8_t, q_scale, k_scale, v_scale, ...)`
      for callers that keep activations in FP8.
Backends: `mosaic` (the Hopper kernel, `kernels/sm90_fwd_fp8.py`),
`interpret` (the same kernel in GPU interpret mode) and `blockwise` (its
pure-JAX twin with the identical quantization and P rounding,
`blockwise_fp8.py`). Gradients through FP8 raise `NotImplementedError`.

Example:
  >>> import jax, pallas_fa3
  >>> q = jax.random.normal(jax.random.key(0), (1, 256, 4, 128), "bfloat16")
  >>> kv = jax.random.normal(jax.random.key(1), (1, 256, 2, 128), "bfloat16")
  >>> out = pallas_fa3.flash_attention(q, kv, kv, causal=True, fp8=True,
  ...                                  implementation="blockwise")
  >>> out.shape, out.dtype
  ((1, 256, 4, 128), dtype(bfloat16))
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3 import backends
from pallas_fa3.kernels.sm90 import config as sm90_config
from pallas_fa3.backends.blockwise import BlockwiseConfig
from pallas_fa3.kernels.sm90.config import Sm90ForwardConfig
from pallas_fa3.spec import (AttentionSpec, check_bool, check_implementation,
                             make_spec)

FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
E4M3_MAX = 448.0  # largest finite e4m3fn value
_TINY = float(np.finfo(np.float32).tiny)
FP8_IMPLEMENTATIONS = ("mosaic", "interpret", "blockwise")
_OUT_DTYPES = tuple(jnp.dtype(d) for d in ("bfloat16", "float16", "float32"))
# Tiles of the blockwise twin when neither a config nor a kernel default
# applies (head dims the FP8 kernel does not serve).
_FALLBACK_TILES = (64, 128)


# -- configuration -------------------------------------------------------------

def _normalize_key(value: Any) -> tuple:
  """An int seed or a concrete JAX PRNG key -> hashable ("seed", n) / (impl, data)."""
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"FP8Config.key must be an int seed or a JAX PRNG key;"
                    f" got {value!r}")
  if isinstance(value, numbers.Integral):
    return ("seed", int(value))
  if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
    return value  # already normalized (dataclasses.replace)
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
        "FP8Config.key must be concrete (an int seed or a PRNG key created"
        " outside jit); for a traced key call pallas_fa3.fp8.quantize(...,"
        " key=key) and flash_attention_fp8")
  if isinstance(value, (jax.Array, np.ndarray)):
    if jnp.issubdtype(value.dtype, jax.dtypes.prng_key) and value.shape == ():
      impl = str(jax.random.key_impl(value))
      data = np.asarray(jax.random.key_data(value))
    elif value.dtype == np.uint32 and value.ndim == 1:  # legacy raw key
      impl, data = "raw", np.asarray(value)
    else:
      raise TypeError(
          "FP8Config.key must be an int seed or a single JAX PRNG key; got an"
          f" array of dtype {value.dtype} and shape {tuple(value.shape)}")
    return (impl, tuple(int(x) for x in data.ravel()))
  raise TypeError(f"FP8Config.key must be an int seed or a JAX PRNG key; got"
                  f" {value!r} of type {type(value).__name__}")


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
  """

  block_quantization: bool = True
  rotation: bool = True
  key: Any = 0

  def __post_init__(self):
    for name in ("block_quantization", "rotation"):
      value = getattr(self, name)
      if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"FP8Config.{name} must be a bool; got {value!r} of"
                        f" type {type(value).__name__}")
      object.__setattr__(self, name, bool(value))
    object.__setattr__(self, "key", _normalize_key(self.key))

  def prng_key(self) -> jax.Array:
    """The rotation's PRNG key."""
    kind, data = self.key
    if kind == "seed":
      return jax.random.key(data)
    if kind == "raw":
      return jax.random.wrap_key_data(jnp.asarray(data, jnp.uint32))
    return jax.random.wrap_key_data(jnp.asarray(data, jnp.uint32), impl=kind)


def check_fp8(fp8: Any) -> FP8Config | None:
  """`fp8=` of flash_attention: False/None (off), True (defaults) or an FP8Config."""
  if fp8 is None or fp8 is False or (isinstance(fp8, np.bool_) and not fp8):
    return None
  if fp8 is True or (isinstance(fp8, np.bool_) and fp8):
    return FP8Config()
  if isinstance(fp8, FP8Config):
    return fp8
  raise TypeError(f"fp8 must be a bool or a pallas_fa3.FP8Config; got"
                  f" {fp8!r} of type {type(fp8).__name__}")


# -- the randomized Hadamard transform -----------------------------------------

def _hadamard_block(n: int) -> int:
  """Size of the Walsh-Hadamard blocks used along an axis of length n.

  The largest power of two dividing n: H_n itself when n is a power of two
  (every head dim the FP8 kernel serves), else the block-diagonal
  I_(n/p) (x) H_p, still orthogonal (e.g. d = 96: three H_32 blocks).
  """
  return n & -n


@jax.jit
def hadamard_transform(x: jax.Array) -> jax.Array:
  """`x @ H / sqrt(p)` along the last axis by the fast Walsh-Hadamard transform.

  H is the Sylvester-ordered Hadamard matrix of size p = the largest power of
  two dividing `x.shape[-1]` (block-diagonal when that is not the whole
  axis); symmetric and, with the 1/sqrt(p), orthogonal. O(n log p) additions
  per row, computed in float32.
  """
  n = x.shape[-1]
  p = _hadamard_block(n)
  y = x.astype(jnp.float32).reshape(x.shape[:-1] + (n // p, p))
  h = 1
  while h < p:
    y = y.reshape(y.shape[:-1] + (p // (2 * h), 2, h))
    a, b = y[..., 0, :], y[..., 1, :]
    y = jnp.stack([a + b, a - b], axis=-2).reshape(y.shape[:-3] + (p,))
    h *= 2
  return (y * jnp.float32(1.0 / math.sqrt(p))).reshape(x.shape)


def rotation_signs(key: jax.Array, head_dim: int) -> jax.Array:
  """The random +-1 diagonal D (float32 `[head_dim]`) drawn from `key`."""
  return jax.random.rademacher(key, (head_dim,), dtype=jnp.float32)


@jax.jit
def rotate(x: jax.Array, signs: jax.Array) -> jax.Array:
  """`x @ M` along the last axis with `M = D H / sqrt(d)` (orthogonal), float32."""
  return hadamard_transform(x.astype(jnp.float32) * signs)


# -- quantization --------------------------------------------------------------

class FP8Inputs(NamedTuple):
  """Quantized attention operands (a pytree), as `quantize` writes them.

  Attributes:
    q: `[batch, seq_q, heads_q, head_dim]` e4m3 (rotated when rotation is on).
    k: `[batch, seq_kv, heads_kv, head_dim]` e4m3 (rotated likewise).
    v_t: `[batch, heads_kv, head_dim, seq_kv]` e4m3: V transposed
      (sequence-contiguous), never rotated.
    q_scale: `[batch, heads_q, ceil(seq_q / block_q)]` float32: Q ~ q * scale.
    k_scale: `[batch, heads_kv, ceil(seq_kv / block_kv)]` float32.
    v_scale: `[batch, heads_kv, ceil(seq_kv / block_kv)]` float32.
  """

  q: jax.Array
  k: jax.Array
  v_t: jax.Array
  q_scale: jax.Array
  k_scale: jax.Array
  v_scale: jax.Array


def _scale_of(amax: jax.Array) -> jax.Array:
  """amax / 448, kept positive and finite (an all-zero tile gets scale 1)."""
  return jnp.where(amax > 0, jnp.maximum(amax / E4M3_MAX, _TINY), 1.0)


def quantize_tiles(x: jax.Array, rows: int, per_tensor: bool = False
                   ) -> tuple[jax.Array, jax.Array]:
  """Quantizes `[b, s, h, d]` to e4m3 with one scale per `rows x d` tile.

  Returns (x8 `[b, s, h, d]` e4m3, scale `[b, h, ceil(s / rows)]` float32) with
  `x ~ x8 * scale` tile by tile; `per_tensor` uses one scale (the amax of the
  whole tensor) for every tile instead. Values are rounded to nearest
  (even) after clipping to +-448.
  """
  b, s, h, d = x.shape
  n = -(-s // rows)
  xf = x.astype(jnp.float32)
  xt = jnp.pad(xf, [(0, 0), (0, n * rows - s), (0, 0), (0, 0)]).reshape(
      b, n, rows, h, d)
  amax = jnp.max(jnp.abs(xt), axis=(2, 4))  # [b, n, h]
  if per_tensor:
    amax = jnp.broadcast_to(jnp.max(amax), amax.shape)
  scale = _scale_of(amax)
  x8 = jnp.clip(xt / scale[:, :, None, :, None], -E4M3_MAX, E4M3_MAX)
  x8 = x8.astype(FP8_DTYPE).reshape(b, n * rows, h, d)[:, :s]
  return x8, jnp.transpose(scale, (0, 2, 1))


def dequantize_tiles(x8: jax.Array, scale: jax.Array, rows: int) -> jax.Array:
  """float32 `[b, s, h, d]` from `quantize_tiles(x, rows)`'s output (tests, analysis)."""
  s = x8.shape[1]
  per_row = jnp.repeat(jnp.transpose(scale, (0, 2, 1)), rows, axis=1)[:, :s]
  return x8.astype(jnp.float32) * per_row[..., None]


@functools.partial(jax.jit, static_argnames=("block_q", "block_kv",
                                             "block_quantization", "rotation"))
def _quantize(q, k, v, key, *, block_q, block_kv, block_quantization, rotation):
  if rotation:
    signs = rotation_signs(key, q.shape[-1])
    q, k = rotate(q, signs), rotate(k, signs)
  per_tensor = not block_quantization
  q8, q_scale = quantize_tiles(q, block_q, per_tensor)
  k8, k_scale = quantize_tiles(k, block_kv, per_tensor)
  v8, v_scale = quantize_tiles(v, block_kv, per_tensor)
  return FP8Inputs(q8, k8, jnp.transpose(v8, (0, 2, 3, 1)), q_scale, k_scale,
                   v_scale)


def _check_block(name: str, value: Any) -> int:
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be an int; got {value!r} of type"
                    f" {type(value).__name__}")
  if value < 1:
    raise ValueError(f"{name} must be positive; got {value}")
  return int(value)


def quantize(q, k, v, *, block_q: int, block_kv: int,
             config: FP8Config | None = None, key: jax.Array | None = None
             ) -> FP8Inputs:
  """The quantization pass: bf16/fp16/fp32 Q, K, V -> `FP8Inputs` (jitted).

  Args:
    q: `[batch, seq_q, heads_q, head_dim]`.
    k: `[batch, seq_kv, heads_kv, head_dim]`.
    v: `[batch, seq_kv, heads_kv, head_dim]`.
    block_q, block_kv: the quantization tiles; they must be the tiles of the
      attention that consumes the result (the kernel config's block_q and
      block_kv, or the blockwise config's).
    config: block quantization / rotation switches and the rotation's key
      (default `FP8Config()`: both on, seed 0).
    key: a PRNG key (may be traced) that overrides `config.key`.

  Returns:
    `FP8Inputs(q, k, v_t, q_scale, k_scale, v_scale)`.
  """
  config = FP8Config() if config is None else config
  if not isinstance(config, FP8Config):
    raise TypeError(f"config must be a pallas_fa3.FP8Config; got {config!r}")
  make_spec(q, k, v)  # shapes and dtypes, errors naming q, k or v
  if q.shape[-1] != v.shape[-1]:
    raise ValueError(f"v must have q's head_dim for FP8; got q.shape="
                     f"{tuple(q.shape)}, v.shape={tuple(v.shape)}")
  key = config.prng_key() if key is None else key
  return _quantize(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), key,
                   block_q=_check_block("block_q", block_q),
                   block_kv=_check_block("block_kv", block_kv),
                   block_quantization=config.block_quantization,
                   rotation=config.rotation)


# -- backend choice ------------------------------------------------------------

def _default_tiles(spec: AttentionSpec) -> tuple[int, int]:
  """The FP8 kernel's default tiles for the head dim (so the blockwise twin
  quantizes and rounds as the kernel would), else `_FALLBACK_TILES`."""
  if spec.head_dim in sm90_config.FP8_HEAD_DIMS:
    c = sm90_config.default_fp8_forward_config(spec.head_dim)
    return c.block_q, c.block_kv
  return _FALLBACK_TILES


def _kernel_reason(spec: AttentionSpec, config) -> str | None:
  return sm90_config.fp8_forward_unsupported(spec, config)


def _config_mismatch(implementation: str, config) -> str | None:
  if config is None:
    return None
  want = BlockwiseConfig if implementation == "blockwise" else Sm90ForwardConfig
  if not isinstance(config, want):
    return f"implementation={implementation!r} with fp8 takes a {want.__name__}"
  return None


def resolve(spec: AttentionSpec, implementation: str | None, config
            ) -> tuple[str, Any]:
  """The FP8 backend and its (filled-in) config for a call; `spec.dtype` = out dtype.

  Raises:
    NotImplementedError: the requested backend cannot serve the call.
    TypeError: `config` does not belong to the backend.
  """
  if implementation is None:
    reasons = []
    for name in ("mosaic", "blockwise"):
      reason = (_config_mismatch(name, config)
                or backends.get(name).device_reason()
                or (_kernel_reason(spec, config) if name == "mosaic" else None))
      if reason is None:
        implementation = name
        break
      reasons.append(f"{name}: {reason}")
    else:
      raise TypeError(f"config={config!r} fits no automatically chosen FP8"
                      f" backend ({'; '.join(reasons)})")
  elif implementation not in FP8_IMPLEMENTATIONS:
    raise NotImplementedError(
        f"implementation={implementation!r} has no FP8 path; fp8 runs on"
        f" {FP8_IMPLEMENTATIONS} (the float64 golden is the oracle)")
  mismatch = _config_mismatch(implementation, config)
  if mismatch:
    raise TypeError(f"config={config!r} does not fit: {mismatch}")
  if implementation != "blockwise":
    reason = _kernel_reason(spec, config)
    if reason:
      raise NotImplementedError(
          f"implementation={implementation!r} cannot run this FP8 call: {reason}")
    if config is None:
      config = sm90_config.default_fp8_forward_config(spec.head_dim)
  elif config is None:
    config = BlockwiseConfig(*_default_tiles(spec))
  return implementation, config


# -- the forward, with a gradient that refuses ----------------------------------

@dataclasses.dataclass(frozen=True)
class _Fp8Call:
  """Static half of an FP8 call (hashable)."""

  spec: AttentionSpec  # dtype = output dtype
  implementation: str
  config: Any


def _forward_quantized(call: _Fp8Call, x: FP8Inputs):
  if call.implementation == "blockwise":
    from pallas_fa3.backends import blockwise_fp8
    return blockwise_fp8.blockwise_forward_fp8(
        call.spec, call.config.block_q, call.config.block_kv, *x)
  from pallas_fa3.kernels.sm90 import compat
  from pallas_fa3.kernels.sm90 import forward_fp8 as sm90_fwd_fp8
  interpret = None
  if call.implementation == "interpret":
    interpret = compat.interpret_params(
        detect_races=backends.INTERPRET_DETECT_RACES)
  return sm90_fwd_fp8.sm90_forward_fp8(call.spec, call.config, *x,
                                       interpret=interpret)


_NO_GRAD = ("gradients through FP8 attention are not implemented (the FP8"
            " backward is a later issue); differentiate the bf16/fp16 path"
            " (fp8=False) or wrap the FP8 call in jax.lax.stop_gradient")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_from_quantized(call: _Fp8Call, x: FP8Inputs):
  return _forward_quantized(call, x)


def _raise_fwd(call, x):
  return _fp8_from_quantized(call, x), None


def _raise_bwd(call, residuals, cotangents):
  raise NotImplementedError(_NO_GRAD)


_fp8_from_quantized.defvjp(_raise_fwd, _raise_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fp8_from_high_precision(call: _Fp8Call, fp8: FP8Config, q, k, v):
  x = _quantize(q, k, v, fp8.prng_key(), block_q=call.config.block_q,
                block_kv=call.config.block_kv,
                block_quantization=fp8.block_quantization,
                rotation=fp8.rotation)
  return _forward_quantized(call, x)


def _raise_fwd_hp(call, fp8, q, k, v):
  return _fp8_from_high_precision(call, fp8, q, k, v), None


def _raise_bwd_hp(call, fp8, residuals, cotangents):
  raise NotImplementedError(_NO_GRAD)


_fp8_from_high_precision.defvjp(_raise_fwd_hp, _raise_bwd_hp)

_high_precision_jit = jax.jit(_fp8_from_high_precision, static_argnums=(0, 1))
_quantized_jit = jax.jit(_fp8_from_quantized, static_argnums=0)


def _check_device(implementation: str, *arrays) -> None:
  if not any(isinstance(a, jax.core.Tracer) for a in arrays):
    backends.require_runnable_here(backends.get(implementation))


def attention_fp8(q, k, v, *, fp8: FP8Config, causal, softmax_scale,
                  return_lse, implementation, config):
  """`flash_attention(..., fp8=...)`: quantize, then the FP8 forward."""
  spec = make_spec(q, k, v, causal=causal, softmax_scale=softmax_scale)
  if spec.head_dim != spec.head_dim_v:
    raise ValueError(f"fp8 needs v's head_dim equal to q's; got q.shape="
                     f"{tuple(q.shape)}, v.shape={tuple(v.shape)}")
  implementation = check_implementation(implementation)
  return_lse = check_bool("return_lse", return_lse)
  implementation, config = resolve(spec, implementation, config)
  _check_device(implementation, q, k, v)
  out, lse = _high_precision_jit(_Fp8Call(spec, implementation, config), fp8,
                                 jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
  return (out, lse) if return_lse else out


def _check_fp8_operand(name: str, x: Any, rank: int, layout: str) -> tuple:
  if not (hasattr(x, "shape") and hasattr(x, "dtype")):
    raise TypeError(f"{name} must be an array {layout}; got {type(x).__name__}")
  if jnp.dtype(x.dtype) != FP8_DTYPE:
    raise TypeError(f"{name} must have dtype float8_e4m3fn (from"
                    f" pallas_fa3.fp8.quantize); got {x.dtype}")
  if len(x.shape) != rank:
    raise ValueError(f"{name} must have rank {rank} {layout}; got shape"
                     f" {tuple(x.shape)}")
  return tuple(int(s) for s in x.shape)


def _check_scale(name: str, x: Any, want: tuple, block_name: str,
                 block: int) -> None:
  if not (hasattr(x, "shape") and hasattr(x, "dtype")):
    raise TypeError(f"{name} must be a float32 array of shape {want}; got"
                    f" {type(x).__name__}")
  if jnp.dtype(x.dtype) != jnp.float32:
    raise TypeError(f"{name} must have dtype float32; got {x.dtype}")
  if tuple(x.shape) != want:
    raise ValueError(
        f"{name} must have shape {want} (one scale per {block_name}={block}"
        f" rows: the tiles of the config that runs the call); got"
        f" {tuple(x.shape)}")


def flash_attention_fp8(q8, k8, v8_t, q_scale, k_scale, v_scale, *,
                        causal=False, softmax_scale=None, return_lse=False,
                        implementation=None, config=None,
                        out_dtype=jnp.bfloat16):
  """FP8 attention forward on pre-quantized operands (`quantize`'s layout).

  Computes `softmax(scale * (q8 * q_scale) (k8 * k_scale)^T) (v8 * v_scale)`
  tile by tile, with P rounded to e4m3 (offset by 2^8) for the P V product,
  as the Hopper kernel does. If Q and K were rotated, the same rotation must
  have been applied to both (the scores are invariant under it).

  Args:
    q8: `[batch, seq_q, heads_q, head_dim]` float8_e4m3fn.
    k8: `[batch, seq_kv, heads_kv, head_dim]` float8_e4m3fn.
    v8_t: `[batch, heads_kv, head_dim, seq_kv]` float8_e4m3fn (V transposed).
    q_scale: `[batch, heads_q, ceil(seq_q / block_q)]` float32.
    k_scale, v_scale: `[batch, heads_kv, ceil(seq_kv / block_kv)]` float32,
      positive and finite.
    causal, softmax_scale, return_lse: as `pallas_fa3.flash_attention`.
    implementation: None (mosaic on a Hopper GPU, else blockwise), "mosaic",
      "interpret" or "blockwise".
    config: `Sm90ForwardConfig` (mosaic/interpret) or `BlockwiseConfig`
      (blockwise); its block_q / block_kv must be the quantization tiles.
      None: the FP8 kernel's default for the head dim.
    out_dtype: bfloat16 (default) or float16 (float32 too on blockwise).

  Returns:
    out `[batch, seq_q, heads_q, head_dim]` in `out_dtype`, and with
    `return_lse` the float32 natural-log lse `[batch, heads_q, seq_q]`.

  Raises:
    TypeError / ValueError: bad operands; the message names the argument.
    NotImplementedError: the backend cannot serve the call; also on any
      attempt to differentiate.
  """
  qs = _check_fp8_operand("q8", q8, 4, "[batch, seq_q, heads_q, head_dim]")
  ks = _check_fp8_operand("k8", k8, 4, "[batch, seq_kv, heads_kv, head_dim]")
  vs = _check_fp8_operand("v8_t", v8_t, 4,
                          "[batch, heads_kv, head_dim, seq_kv]")
  if vs != (ks[0], ks[2], ks[3], ks[1]):
    raise ValueError(
        "v8_t must be V transposed to [batch, heads_kv, head_dim, seq_kv],"
        f" i.e. shape {(ks[0], ks[2], ks[3], ks[1])} for k8.shape={ks}; got"
        f" {vs}")
  out_dtype = jnp.dtype(out_dtype)
  if out_dtype not in _OUT_DTYPES:
    raise TypeError(f"out_dtype must be one of {[str(d) for d in _OUT_DTYPES]};"
                    f" got {out_dtype}")
  like = lambda shape: jax.ShapeDtypeStruct(shape, out_dtype)
  spec = make_spec(like(qs), like(ks), like(ks), causal=causal,
                   softmax_scale=softmax_scale)
  implementation = check_implementation(implementation)
  return_lse = check_bool("return_lse", return_lse)
  implementation, config = resolve(spec, implementation, config)
  b, hq, hk = spec.batch, spec.heads_q, spec.heads_kv
  _check_scale("q_scale", q_scale, (b, hq, -(-spec.seq_q // config.block_q)),
               "block_q", config.block_q)
  n_kv = -(-spec.seq_kv // config.block_kv)
  _check_scale("k_scale", k_scale, (b, hk, n_kv), "block_kv", config.block_kv)
  _check_scale("v_scale", v_scale, (b, hk, n_kv), "block_kv", config.block_kv)
  _check_device(implementation, q8, k8, v8_t)
  x = FP8Inputs(*(jnp.asarray(a) for a in (q8, k8, v8_t, q_scale, k_scale,
                                           v_scale)))
  out, lse = _quantized_jit(_Fp8Call(spec, implementation, config), x)
  return (out, lse) if return_lse else out
