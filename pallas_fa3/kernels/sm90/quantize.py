"""The FP8 quantization pass as one Pallas Mosaic GPU kernel (sm90): one CTA
per `rows x d` tile of one head reads it once by TMA, rotates Q and K on
the tensor cores (`(X @ (D H)) / sqrt(d)`, exact in 16 bits), writes e4m3
with the tile's power-of-two float32 scale (and Q's residual), and V
transposed for the FP8 wgmma; `pallas_fa3.quant.e4m3.quantize_inputs` is
its pure-JAX twin, bit for bit in interpret mode.
More: docs/design_notes.md#fp8-quantization-kernel.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa3.kernels.sm90 import compat
from pallas_fa3.kernels.sm90.common import (
  build_kernel,
  smem_transforms,
  tma_extent,
)
from pallas_fa3.kernels.sm90.ops import (
  COMPILED,
  INTERPRETED,
  KernelOps,
  async_proxy_read,
)
from pallas_fa3.quant.e4m3 import (
  E4M3_MAX,
  FP8_DTYPE,
  FP8Inputs,
  identity,
  pow2_scale_of,
  quantize_inputs,
  rotation_matrix,
  split_residual,
)
from pallas_fa3.quant.hadamard import rotation_signs
from pallas_fa3.spec import cdiv

_F32 = jnp.float32
_CHUNK = 64  # output rows per warpgroup (one wgmma M)
# Hardware barrier of the warpgroups' amax exchange (Mosaic uses 0-4).
_AMAX_BARRIER = 11
KERNEL_DTYPES = ("bfloat16", "float16")


def kernel_unsupported(x: jax.Array, rows: int) -> str | None:
  """Why the kernel cannot quantize `x` in `rows`-row tiles, or None."""
  if str(x.dtype) not in KERNEL_DTYPES:
    return f"the quantization kernel reads {KERNEL_DTYPES}; got {x.dtype}"
  d = x.shape[-1]
  if d % _CHUNK or d > 256:
    return f"head_dim {d} is not a multiple of {_CHUNK} up to 256"
  if rows % _CHUNK or rows > 256:
    return f"tile rows {rows} is not a multiple of {_CHUNK} up to 256"
  return None


def _warpgroups(out_rows: int) -> int:
  """One warpgroup per 64 output rows (they meet once, at a named barrier
  compiled and an mbarrier interpreted, for the tile's amax). (The
  interpreted meeting's old intermittent deadlock was XLA's CPU thread
  pool: docs/design_notes.md#the-interpreters-thread-pool.)"""
  return out_rows // _CHUNK


def _times(ops: KernelOps, a_smem: Any, b_smem: Any) -> jax.Array:
  """`A @ B` in float32 (both in shared memory, B not transposed): the
  twin's product, `jnp.dot` of the 2-D operands."""
  if ops.interpreted:
    return async_proxy_read(
      jnp.dot(a_smem[...], b_smem[...], preferred_element_type=_F32)
    )

  def scoped(acc):
    plgpu.wgmma(acc, a_smem, b_smem)
    return acc[...]  # waits for the wgmma

  return pl.run_scoped(
    scoped, plgpu.ACC((a_smem.shape[0], b_smem.shape[1]), _F32)
  )


def _tile_body(
  ops: KernelOps,
  transpose: bool,
  rotate: bool,
  terms: int,
  rows: int,
  d: int,
  refs: dict[str, Any],
) -> None:
  x_ref, m_ref, scale_ref = refs["x"], refs["m"], refs["scale"]
  out_refs = [refs[f"out{t}"] for t in range(terms)]
  x_smem, out_smem = refs["x_out_smem"]
  m_smem, amax_smem, scale_smem, loaded = (
    refs[n] for n in ("m_smem", "amax_smem", "scale_smem", "loaded")
  )
  meet = () if refs["meet"] is None else (refs["meet"],)
  wg = lax.axis_index("wg")
  batch, tile, head = (lax.axis_index(n) for n in ("batch", "tile", "head"))
  row0 = tile * rows
  out_rows = d if transpose else rows
  warpgroups = _warpgroups(out_rows)
  per_wg = out_rows // _CHUNK // warpgroups

  @pl.when(wg == 0)
  def _():
    plgpu.copy_gmem_to_smem(
      x_ref.at[batch, pl.ds(row0, rows), head],
      x_smem,
      loaded.at[0],
      oob_mode=compat.ZERO_FILL,  # past the sequence: zeros, amax unchanged
    )
    plgpu.copy_gmem_to_smem(m_ref, m_smem, loaded.at[1])

  plgpu.barrier_wait(loaded.at[0])
  plgpu.barrier_wait(loaded.at[1])
  chunks = [(wg * per_wg + i) * _CHUNK for i in range(per_wg)]
  ys = []
  for c0 in chunks:  # 64 output rows each
    mine = pl.ds(c0, _CHUNK)
    if transpose:  # V^T rows [c0, c0 + 64) = I_64 @ X[:, those cols]^T
      y = ops.scores(m_smem, x_smem.at[:, mine])
    else:  # y = X_c @ M
      y = _times(ops, x_smem.at[mine], m_smem)
      if rotate:
        y = y * jnp.float32(1.0 / math.sqrt(d))
    # The tile's amax: row maxima through shared memory, then every thread
    # reduces all of them (a column vector broadcast along the rows).
    amax_smem.at[mine][...] = jnp.max(jnp.abs(y), axis=1)
    ys.append(y)
  if meet:  # interpreted: an mbarrier stands in for the named barrier
    plgpu.barrier_arrive(meet[0])
    plgpu.barrier_wait(meet[0])
  else:
    compat.named_barrier(_AMAX_BARRIER, 128 * warpgroups, sync=True)
  cols = ops.load_cols(amax_smem)
  amax = jnp.max(lax.broadcast_in_dim(cols, (_CHUNK, out_rows), [1]), axis=1)
  scale = pow2_scale_of(amax)  # one value, repeated per row
  for c0, y in zip(chunks, ys):
    y8 = jnp.clip(
      y * lax.broadcast_in_dim(1.0 / scale, y.shape, [0]), -E4M3_MAX, E4M3_MAX
    )
    parts = split_residual(y8) if terms == 2 else (y8.astype(FP8_DTYPE),)
    for t, part in enumerate(parts):
      out_smem.at[t, pl.ds(c0, _CHUNK)][...] = part

  @pl.when(wg == 0)
  def _():
    scale_smem[...] = scale

  plgpu.commit_smem()
  for c0 in chunks:
    mine = pl.ds(c0, _CHUNK)
    for t, out_ref in enumerate(out_refs):
      if transpose:
        dst = out_ref.at[batch, head, mine, pl.ds(row0, rows)]
      else:
        dst = out_ref.at[batch, pl.ds(row0 + c0, _CHUNK), head]
      plgpu.copy_smem_to_gmem(out_smem.at[t, mine], dst)

  @pl.when(wg == 0)
  def _():
    plgpu.copy_smem_to_gmem(scale_smem, scale_ref.at[batch, head, tile])

  plgpu.wait_smem_to_gmem(0)


def _build(
  shape: tuple, dtype: Any, rows: int, transpose: bool, rotate: bool,
  terms: int, interpret: Any,
) -> Any:  # fmt: skip
  b, s, h, d = shape
  n = cdiv(s, rows)
  ops = COMPILED if interpret is None else INTERPRETED
  out_rows, out_cols = (d, rows) if transpose else (rows, d)
  warpgroups = _warpgroups(out_rows)
  m_shape = (_CHUNK, _CHUNK) if transpose else (d, d)
  # V^T's rows (the sequence) are whole tiles: its TMA box is a tile wide.
  out_shape = (b, h, d, n * rows) if transpose else (b, s, h, d)
  scratch = dict(
    # The e4m3 tile reuses the input's memory: it is written once every
    # warpgroup's wgmma has read the input (the amax exchange).
    x_out_smem=plgpu.RefUnion(
      plgpu.SMEM((rows, d), dtype, transforms=smem_transforms(dtype, d)),
      plgpu.SMEM(
        (terms, out_rows, out_cols),
        FP8_DTYPE,
        transforms=smem_transforms(FP8_DTYPE, out_cols),
      ),
    ),
    m_smem=plgpu.SMEM(
      m_shape, dtype, transforms=smem_transforms(dtype, m_shape[1])
    ),
    amax_smem=plgpu.SMEM((out_rows,), _F32),
    scale_smem=plgpu.SMEM((_CHUNK,), _F32),
    loaded=plgpu.Barrier(num_barriers=2),
    # The amax meeting in interpret mode (inline PTX does not run there).
    meet=plgpu.Barrier(num_arrivals=warpgroups) if ops.interpreted else None,
  )

  def fp8_quantize(refs):  # the kernel's name in profiles and dumps
    _tile_body(ops, transpose, rotate, terms, rows, d, refs)

  out_type = {
    f"out{t}": jax.ShapeDtypeStruct(out_shape, FP8_DTYPE) for t in range(terms)
  }
  out_type["scale"] = jax.ShapeDtypeStruct((b, h, n, _CHUNK), _F32)
  return build_kernel(
    fp8_quantize,
    inputs=("x", "m"),
    out_type=out_type,
    scratch=scratch,
    grid=(b, n, h),
    grid_names=("batch", "tile", "head"),
    warpgroups=warpgroups,
    interpret=interpret,
    cluster=False,
    # Exact division and no approximate math: the twin's bits.
    approx_math=False,
  )


def quantize_tensor(
  x: jax.Array,
  rows: int,
  *,
  signs: jax.Array | None = None,
  transpose: bool = False,
  residual: bool = False,
  interpret: Any = None,
) -> tuple[jax.Array, ...]:
  """One tensor through the kernel: (e4m3, scale `[b, h, ceil(s / rows)]`),
  with `residual` (e4m3, scale, e4m3 rounding residual).

  Args:
    x: `[b, s, h, d]` bfloat16 or float16.
    rows: the tile rows (the attention's block_q or block_kv).
    signs: the rotation's +-1 diagonal `[d]` (Q and K), or None.
    transpose: write `[b, h, d, s]` (V; not rotated).
    residual: also write the rounding's residual (`e4m3.split_residual`;
      not with `transpose`).
    interpret: None compiles for sm90; interpret-mode parameters run it on
      a CPU.

  Raises:
    ValueError: `kernel_unsupported(x, rows)`, or a rotated transpose.
  """
  reason = kernel_unsupported(x, rows)
  if reason:
    raise ValueError(reason)
  if transpose and (signs is not None or residual):
    raise ValueError("the transposed (V) pass has no rotation or residual")
  b, s, h, d = x.shape
  if transpose:
    m = identity(_CHUNK, x.dtype)
  elif signs is not None:
    m = rotation_matrix(signs).astype(x.dtype)  # +-1: exact
  else:
    m = identity(d, x.dtype)
  # TMA boxes: reads past the end are zeros, writes past it dropped.
  xp = tma_extent(x, 1, rows)
  terms = 2 if residual else 1
  call = _build(
    tuple(xp.shape), x.dtype, rows, transpose, signs is not None, terms,
    interpret,
  )  # fmt: skip
  *outs, scale = call(xp, m)
  outs = [o[..., :s] if transpose else o[:, :s] for o in outs]
  return (outs[0], scale[..., 0], *outs[1:])


def quantize_inputs_kernel(
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
  interpret: Any = None,
) -> FP8Inputs:
  """`e4m3.quantize_inputs` through the kernel (three launches, one per
  tensor), or through the pure-JAX twin where the kernel does not apply
  (float32 inputs, per-tensor scales, other tiles): the same function."""
  if not block_quantization or any(
    kernel_unsupported(x, rows)
    for x, rows in ((q, block_q), (k, block_kv), (v, block_kv))
  ):
    return quantize_inputs(
      q,
      k,
      v,
      key,
      block_q=block_q,
      block_kv=block_kv,
      block_quantization=block_quantization,
      rotation=rotation,
      q_residual=q_residual,
    )
  signs = rotation_signs(key, q.shape[-1]) if rotation else None
  q8, q_scale, *q_lo = quantize_tensor(
    q, block_q, signs=signs, residual=q_residual, interpret=interpret
  )
  k8, k_scale = quantize_tensor(k, block_kv, signs=signs, interpret=interpret)
  v8t, v_scale = quantize_tensor(
    v, block_kv, transpose=True, interpret=interpret
  )
  return FP8Inputs(q8, k8, v8t, q_scale, k_scale, v_scale, *q_lo)
