"""e4m3 block quantization, and the FP8 softmax steps shared by the Hopper
FP8 kernel and its blockwise twin (same float32 operations, same order):
docs/fp8.md#the-kernels-and-the-twin.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_fa3.lse import natural_from_log2
from pallas_fa3.quant.hadamard import rotation_signs
from pallas_fa3.spec import LOG2E, cdiv

FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
E4M3_MAX = 448.0  # largest finite e4m3fn value
_TINY = float(np.finfo(np.float32).tiny)
_F32 = jnp.float32
# P is exponentiated against (row max - 8): P <= 2^8 = 256, inside e4m3's
# finite range (448), as FA3's reference CUDA code does for FP8.
P_LOG2_OFFSET = 8.0


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
    q_residual: None, or (`FP8Config(q_residual=True)`) Q's rounding
      residual in e4m3, in the same units: Q ~ (q + q_residual) * scale,
      about 2^-4 of q's error.
  """

  q: jax.Array
  k: jax.Array
  v_t: jax.Array
  q_scale: jax.Array
  k_scale: jax.Array
  v_scale: jax.Array
  q_residual: jax.Array | None = None


def scale_of(amax: jax.Array) -> jax.Array:
  """amax / 448, kept positive and finite (an all-zero tile gets scale 1)."""
  return jnp.where(amax > 0, jnp.maximum(amax / E4M3_MAX, _TINY), 1.0)


def pow2_scale_of(amax: jax.Array) -> jax.Array:
  """The smallest power of two `p >= 2^-126` with `448 p >= amax` (1 for an
  all-zero tile): a tile scale whose products and reciprocal are exact.

  Binary lifting over the exponent with exact products and compares only,
  so the quantization kernel and this twin agree to the bit (a division
  would not: XLA may compute it as a product with the reciprocal). The
  largest element lands in (224, 448]; e4m3's relative rounding error does
  not depend on where.
  """
  p = jnp.full_like(amax, 2.0**-126)
  for step in (64, 64, 64, 32, 16, 8, 4, 2, 1):
    up = p * jnp.float32(2.0**step)
    p = jnp.where(up * E4M3_MAX < amax, up, p)
  p = jnp.where(p * E4M3_MAX < amax, p * 2.0, p)
  return jnp.where(amax > 0, p, 1.0)


def split_residual(y: jax.Array) -> tuple[jax.Array, jax.Array]:
  """float32 values in e4m3's range -> (e4m3 y, e4m3 of what that rounding
  left out). The difference is exact in float32 and at most half an e4m3
  step of y (<= 16), so one scale serves both terms."""
  hi = y.astype(FP8_DTYPE)
  return hi, (y - hi.astype(_F32)).astype(FP8_DTYPE)


def quantize_tiles(
  x: jax.Array,
  rows: int,
  per_tensor: bool = False,
  residual: bool = False,
  pow2: bool = True,
) -> tuple[jax.Array, ...]:
  """Quantizes `[b, s, h, d]` to e4m3 with one scale per `rows x d` tile.

  Returns (x8 `[b, s, h, d]` e4m3, scale `[b, h, ceil(s / rows)]` float32) with
  `x ~ x8 * scale` tile by tile; `per_tensor` uses one scale (the amax of the
  whole tensor) for every tile instead. Values are rounded to nearest
  (even) after clipping to +-448. The scale is `pow2_scale_of(amax)` (the
  quantization kernel's), or with `pow2=False` `amax / 448`. `residual`
  adds a third result, the rounding's residual in e4m3 (`split_residual`).
  """
  b, s, h, d = x.shape
  n = cdiv(s, rows)
  xf = x.astype(jnp.float32)
  xt = jnp.pad(xf, [(0, 0), (0, n * rows - s), (0, 0), (0, 0)]).reshape(
    b, n, rows, h, d
  )
  amax = jnp.max(jnp.abs(xt), axis=(2, 4))  # [b, n, h]
  if per_tensor:
    amax = jnp.broadcast_to(jnp.max(amax), amax.shape)
  scale = pow2_scale_of(amax) if pow2 else scale_of(amax)
  inv = 1.0 / scale  # exact for a power of two
  y = jnp.clip(xt * inv[:, :, None, :, None], -E4M3_MAX, E4M3_MAX)
  scale = jnp.transpose(scale, (0, 2, 1))
  untile = lambda t: t.reshape(b, n * rows, h, d)[:, :s]
  if residual:
    hi, lo = split_residual(y)
    return untile(hi), scale, untile(lo)
  return untile(y.astype(FP8_DTYPE)), scale


def dequantize_tiles(x8: jax.Array, scale: jax.Array, rows: int) -> jax.Array:
  """float32 `[b, s, h, d]` from `quantize_tiles(x, rows)`'s output (tests, analysis)."""
  s = x8.shape[1]
  per_row = jnp.repeat(jnp.transpose(scale, (0, 2, 1)), rows, axis=1)[:, :s]
  return x8.astype(jnp.float32) * per_row[..., None]


def rotation_matrix(signs: jax.Array) -> jax.Array:
  """`D H` (float32 `[d, d]`, +-1 and 0 entries) with H Sylvester's
  Walsh-Hadamard matrix of size p = the largest power of two dividing d
  (block-diagonal when p < d, as `hadamard.hadamard_transform`): `x @ D H /
  sqrt(p)` is `hadamard.rotate(x, signs)` up to float32 summation order."""
  d = signs.shape[-1]
  p = d & -d
  # H_ij = (-1)^popcount(i & j) within a block, from iotas: no array
  # constant (custom_partitioning rejects closed-over constants).
  i = lax.broadcasted_iota(jnp.int32, (d, d), 0)
  j = lax.broadcasted_iota(jnp.int32, (d, d), 1)
  odd = lax.population_count((i % p) & (j % p)) % 2
  h = jnp.where(i // p == j // p, 1.0 - 2.0 * odd.astype(_F32), 0.0)
  return signs.astype(_F32)[:, None] * h


def identity(n: int, dtype: Any) -> jax.Array:
  """`I_n` in `dtype`, from iotas (no array constant)."""
  i = lax.broadcasted_iota(jnp.int32, (n, n), 0)
  return (i == lax.broadcasted_iota(jnp.int32, (n, n), 1)).astype(dtype)


def rotate_for_quantization(x: jax.Array, signs: jax.Array) -> jax.Array:
  """The pass's rotation: float32 `(x @ D H) * (1 / sqrt(d))`.

  A matmul with the +-1 matrix in x's dtype (exact products) and float32
  accumulation, as the quantization kernel does on the tensor cores; the
  1/sqrt(d) is applied after, in float32.
  """
  d = x.shape[-1]
  m = rotation_matrix(signs)
  # As 2-D operands, the kernel's form (XLA's summation order depends on it).
  x2 = x.reshape(-1, d)
  if x.dtype == _F32:
    y = jnp.dot(x2, m, precision=lax.Precision.HIGHEST)
  else:
    y = jnp.dot(x2, m.astype(x.dtype), preferred_element_type=_F32)
  y = y.reshape(x.shape)
  return y * jnp.float32(1.0 / np.sqrt(d & -d))


@functools.partial(
  jax.jit,
  static_argnames=(
    "block_q",
    "block_kv",
    "block_quantization",
    "rotation",
    "q_residual",
  ),
)
def quantize_inputs(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  key: jax.Array,
  *,
  block_q: int,
  block_kv: int,
  block_quantization: bool,
  rotation: bool,
  q_residual: bool = False,
) -> FP8Inputs:
  """Rotates (if `rotation`) and quantizes q, k, v to `FP8Inputs` in JAX.

  Q is quantized in `block_q`-row tiles, K and V in `block_kv`-row tiles
  (one scale per tensor instead when not `block_quantization`); V is
  transposed to `[b, hk, d, skv]`; `q_residual` adds Q's rounding residual
  (`FP8Inputs.q_residual`). The twin of the quantization kernel
  (`kernels/sm90/quantize.py`): the same float32 steps, the same bits. The
  validated entry point is `pallas_fa3.fp8.quantize`.
  """
  if rotation:
    signs = rotation_signs(key, q.shape[-1])
    q = rotate_for_quantization(q, signs)
    k = rotate_for_quantization(k, signs)
  per_tensor = not block_quantization
  q8, q_scale, *q_lo = quantize_tiles(q, block_q, per_tensor, q_residual)
  k8, k_scale = quantize_tiles(k, block_kv, per_tensor)
  v8, v_scale = quantize_tiles(v, block_kv, per_tensor)
  v8t = jnp.transpose(v8, (0, 2, 3, 1))
  return FP8Inputs(q8, k8, v8t, q_scale, k_scale, v_scale, *q_lo)


def online_softmax_fp8(
  s: jax.Array,
  m: jax.Array,
  l: jax.Array,
  *,
  scale_log2: jax.Array,
  mask: jax.Array | None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """One online-softmax step in base 2 with P offset by 2^8 (l in the same units).

  Returns (p, alpha, m_new, l_new); p is in [0, 2^8]. `scale_log2` is a
  scalar or broadcasts against the row statistics (`s.shape[:-1]`). Shared
  by the kernel and, through `pallas_fa3.backends.blockwise.fp8`, its twin.
  """
  # `s` holds raw scores, `m` the running max of scaled ones. The scores
  # are scaled once (a multiply behind an optimization barrier, not an FFMA
  # in the exponent), so the row max's exponent is exact at any finite
  # scale (kernels/sm90/scores.scaled_once).
  tile_scale = (
    scale_log2 if jnp.ndim(scale_log2) == 0 else scale_log2[..., None]
  )
  x = lax.optimization_barrier(s * tile_scale)
  if mask is not None:
    x = jnp.where(mask, x, -jnp.inf)
  m_new = jnp.maximum(m, x.max(axis=-1))
  # A row with no visible key yet has max -inf: exponentiate against 0.
  m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.exp2(m - m_ref)
  p = jnp.exp2(
    x
    - lax.broadcast_in_dim(
      m_ref - P_LOG2_OFFSET, s.shape, tuple(range(s.ndim - 1))
    )
  )
  return p, alpha, m_new, l * alpha + p.sum(axis=-1)


def finalize_fp8(
  o: jax.Array, m: jax.Array, l: jax.Array, sv: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """(normalized O, natural-log lse) from the running statistics.

  `o` is in units of the last V scale `sv` and of P's 2^8, as is `l`.
  """
  empty = l == 0.0
  inv_l = jnp.where(empty, 0.0, sv / jnp.where(empty, 1.0, l))
  o = o * lax.broadcast_in_dim(inv_l, o.shape, tuple(range(o.ndim - 1)))
  log2_l = jnp.log(jnp.where(empty, 1.0, l)) * jnp.float32(LOG2E)
  lse = jnp.where(
    empty, -jnp.inf, natural_from_log2(m + log2_l - P_LOG2_OFFSET)
  )
  return o, lse


def v_scale_ratios(v_scale: jax.Array) -> jax.Array:
  """`sv_{j-1} / sv_j` along the last (K/V tile) axis, 1 for the first tile.

  The factor that moves O from the units of one V tile's scale to the
  next's. Computed once outside the kernel (exact IEEE division, shared with
  the blockwise twin) rather than per step inside it.
  """
  v_scale = v_scale.astype(_F32)
  prev = jnp.concatenate([v_scale[..., :1], v_scale[..., :-1]], axis=-1)
  return prev / v_scale
