"""The decode kernel's e4m3-cache parts: a converter warpgroup in place of
the TMA producer, and the descales.

With an e4m3 cache the second warpgroup streams K and V tiles by TMA into
a `num_stages` ring of e4m3 tiles (half the bytes of bf16: the point of an
FP8 cache for a memory-bound decode), converts each tile to float16 (exact:
every e4m3 value is a float16; `cvt.f16x2.e4m3x2`, one instruction per two
values) into a ring of float16 tiles (`config_decode.converted_stages`), zeroing V's rows
past the sequence's length, and hands them to the consumer, which then
runs the 16-bit kernel's steps in float16 (Q is converted by XLA with a
power-of-two scale that keeps it in float16's range). `k_descale` times
Q's scale folds into the softmax scale (no extra multiply per score) and
`v_descale` multiplies O once at the end. FP8 wgmma would need V
transposed in shared memory and Q and P in e4m3 (FA3's FP8 path): the
conversion keeps the products 16-bit, so only the cache's own rounding
remains (docs/design_notes.md#decode-kernel).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa3.kernels.sm90 import compat, config_decode, hardware
from pallas_fa3.kernels.sm90.common import (
  LONE_CONSUMER_REGS,
  consumer_release,
  smem_transforms,
  softcapped,
)
from pallas_fa3.kernels.sm90.ops import KernelOps
from pallas_fa3.spec import LOG2E

FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
COMPUTE_DTYPE = jnp.dtype(jnp.float16)
# The converter holds a 64 x 128 chunk (64 values a thread) and addresses.
CONVERTER_REGS = 168
hardware.check_split(2, LONE_CONSUMER_REGS, CONVERTER_REGS)
# Q is scaled by a power of two into float16 when its amax exceeds this.
_Q_RANGE = 2.0**14
_CHUNK_ROWS = 64


def converted_q(q_rows: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(float16 Q `[b, hk, 64, d]`, its float32 scale `[b, hk]`): Q divided
  by the power of two that brings its amax under 2^14 (1 if already
  under), so that it converts to float16 without overflow."""
  amax = jnp.max(jnp.abs(q_rows.astype(jnp.float32)), axis=(2, 3))
  e = jnp.ceil(jnp.log2(jnp.maximum(amax, 1.0) / _Q_RANGE))
  scale = jnp.exp2(jnp.maximum(e, 0.0))
  q16 = q_rows.astype(jnp.float32) / scale[:, :, None, None]
  return q16.astype(COMPUTE_DTYPE), scale


def descaled(spec: Any, s: jax.Array, k_descale: Any) -> tuple[Any, Any]:
  """`softcapped` for scores of a descaled K: (scores, their base-2
  scale) with `k_descale` folded into the scale (or, with softcap, into
  the tanh's argument)."""
  if k_descale is None:
    return softcapped(spec, s)
  if spec.softcap is None:
    return s, jnp.float32(spec.softmax_scale * LOG2E) * k_descale
  factor = jnp.float32(spec.softmax_scale / spec.softcap) * k_descale
  return jnp.tanh(s * factor), jnp.float32(spec.softcap * LOG2E)


def convert_tile(ops: KernelOps, src: Any, dst: Any, valid: Any = None):
  """`dst[...] = src[...]` converted to float16 in 64-row chunks, the
  e4m3 tile's swizzle width at a time (128 columns, or 64 at d192 and 32
  at d96, whose rows are not whole 128-byte spans); rows `valid..` -> 0."""
  rows, cols = src.shape
  step = plgpu.find_swizzle(cols * 8 * src.dtype.itemsize) // src.dtype.itemsize
  for r in range(0, rows, _CHUNK_ROWS):
    keep = None
    if valid is not None:
      keep = ops.row_index(_CHUNK_ROWS) + r < valid
    for c in range(0, cols, step):
      box = (pl.ds(r, _CHUNK_ROWS), pl.ds(c, step))
      if ops.interpreted:
        x = src.at[box][...]
      else:
        x = compat.load_with_layout(src.at[box], plgpu.Layout.WGMMA)
      y = x.astype(dst.dtype)
      if keep is not None:
        y = jnp.where(lax.broadcast_in_dim(keep, y.shape, [0]), y, 0)
      dst.at[box][...] = y


def converter(refs: tuple, plan: Any, ops: KernelOps, scalars: tuple) -> None:
  """The second warpgroup with an e4m3 cache: TMA of the split's tiles into
  the e4m3 ring (`num_stages` ahead), conversion into the float16 ring.

  Every TMA it issues it also waits for, so none is in flight at exit; an
  e4m3 slot is refilled only after the whole warpgroup has read it (the
  warpgroup barrier of `commit_smem`); at the end it waits for the
  consumer's release of the last float16 tiles."""
  (k_ref, v_ref, pt_ref, raw_k, raw_v, raw_k_full, raw_v_full) = refs[:7]
  k16, v16, k_full, v_full, k_empty, v_empty = refs[7:]
  batch, head, row, first, count, length = scalars
  stages, bkv = plan.config.num_stages, plan.block_kv
  conv = config_decode.converted_stages(plan.spec)
  parts = plan.pages_per_tile
  rows = bkv // parts
  plgpu.set_max_registers(CONVERTER_REGS, action="decrease")

  def issue(j):
    slot = lax.rem(j, stages)
    for src_ref, dst, full in ((k_ref, raw_k, raw_k_full), (v_ref, raw_v, raw_v_full)):  # fmt: skip
      for part in range(parts):
        src = plan.tile_source(
          src_ref, row, pt_ref, batch, head, first + j, part
        )
        plgpu.copy_gmem_to_smem(
          src,
          dst.at[slot, pl.ds(part * rows, rows)] if parts > 1 else dst.at[slot],
          full.at[slot],
          oob_mode=compat.ZERO_FILL,
        )

  pl.loop(0, jnp.minimum(count, stages))(issue)

  @pl.loop(0, count)
  def _convert(j):
    raw, slot = lax.rem(j, stages), lax.rem(j, conv)
    valid = length - (first + j) * bkv  # V's rows past the length -> 0
    for src, raw_full, dst, full, empty in (
      (raw_k, raw_k_full, k16, k_full, k_empty),
      (raw_v, raw_v_full, v16, v_full, v_empty),
    ):
      plgpu.barrier_wait(raw_full.at[raw])

      @pl.when(j >= conv)
      def _():  # the consumer has read the slot's previous tile
        plgpu.barrier_wait(empty.at[slot])

      if dst is v16:
        pl.when(valid < bkv)(
          lambda: convert_tile(ops, raw_v.at[raw], v16.at[slot], valid)
        )
        pl.when(valid >= bkv)(
          lambda: convert_tile(ops, raw_v.at[raw], v16.at[slot])
        )
      else:
        convert_tile(ops, src.at[raw], dst.at[slot])
      plgpu.commit_smem()  # stores -> the wgmma's proxy; reads finished
      plgpu.barrier_arrive(full.at[slot])

    @pl.when(j + stages < count)
    def _():
      issue(j + stages)

  @pl.loop(jnp.maximum(count - conv, 0), count)
  def _drain(j):  # the consumer has read the last tiles (as the TMA
    slot = lax.rem(j, conv)  # producer's drain: every phase observed)
    plgpu.barrier_wait(k_empty.at[slot])
    plgpu.barrier_wait(v_empty.at[slot])


def scratch(plan: Any) -> tuple:
  """The e4m3 rings, the float16 rings and their barriers (in
  `converter`'s order after Q and before the output staging)."""
  spec, cfg = plan.spec, plan.config
  d, dv, bkv = spec.head_dim, spec.head_dim_v, cfg.block_kv
  conv = config_decode.converted_stages(spec)
  ring = lambda n, cols, dtype: plgpu.SMEM(
    (n, bkv, cols), dtype, transforms=smem_transforms(dtype, cols)
  )
  tma = lambda: plgpu.Barrier(
    num_arrivals=plan.pages_per_tile, num_barriers=cfg.num_stages
  )
  return (
    ring(cfg.num_stages, d, FP8_DTYPE),
    ring(cfg.num_stages, dv, FP8_DTYPE),
    tma(),
    tma(),
    ring(conv, d, COMPUTE_DTYPE),
    ring(conv, dv, COMPUTE_DTYPE),
    consumer_release(conv, consumers=1),
    consumer_release(conv, consumers=1),
    consumer_release(conv, consumers=1),
    consumer_release(conv, consumers=1),
  )
