"""The FP8 kernel's pure-JAX twin, `blockwise_forward_fp8`: the same
`block_q x block_kv` tiles as `kernels/sm90/forward_fp8.py`, the same
float32 steps in the same order (the kernel's own softmax step, epilogue
and V-scale ratios from `pallas_fa3.quant.e4m3`), on any device; it agrees
with the GPU to about the e4m3 resolution of single P entries, not bit for
bit: docs/fp8.md#the-kernels-and-the-twin.

Example:
  >>> import jax, pallas_fa3
  >>> from pallas_fa3 import fp8
  >>> q = jax.random.normal(jax.random.key(0), (1, 200, 2, 64), "bfloat16")
  >>> x = fp8.quantize(q, q, q, block_q=64, block_kv=128)
  >>> out = fp8.flash_attention_fp8(*x, implementation="blockwise",
  ...                               config=pallas_fa3.BlockwiseConfig(64, 128))
  >>> out.shape
  (1, 200, 2, 64)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_fa3 import masking
from pallas_fa3.quant.e4m3 import (
  FP8_DTYPE,
  P_LOG2_OFFSET,
  finalize_fp8,
  online_softmax_fp8,
  v_scale_ratios,
)
from pallas_fa3.spec import HIGHEST, LOG2E, AttentionSpec, cdiv, group_heads

_F32 = jnp.float32


def _pad(x: jax.Array, axis: int, length: int) -> jax.Array:
  pad = length - x.shape[axis]
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths)


def _pad_ids(ids: jax.Array, length: int, value: int) -> jax.Array:
  return jnp.pad(
    ids, ((0, 0), (0, length - ids.shape[1])), constant_values=value
  )


def blockwise_forward_fp8(
  spec: AttentionSpec,
  block_q: int,
  block_kv: int,
  q8: jax.Array,
  k8: jax.Array,
  v8_t: jax.Array,
  q_scale: jax.Array,
  k_scale: jax.Array,
  v_scale: jax.Array,
  q_residual: jax.Array | None = None,
  *,
  sinks: jax.Array | None = None,
  segment_ids: Any = None,
) -> tuple[jax.Array, jax.Array]:
  """Tiled FP8 forward; returns (out `[b, sq, hq, d]` in `spec.dtype`, lse `[b, hq, sq]`).

  Operands as `pallas_fa3.fp8.quantize` writes them (`FP8Inputs`), quantized
  with tiles `block_q` x `block_kv`. With `q_residual` the scores use
  Q + Q_res (exact in float32: the kernel's two chained products). As the
  kernel: a window's tiles outside every row's reach are skipped, softcap
  is fused into the scores (tanh of the descaled score), `sinks` (`[b, hq]`
  float32) seed the running max and sum, `segment_ids` mask by id.
  """
  b, hk, g = spec.batch, spec.heads_kv, spec.group_size
  nq, nkv = cdiv(spec.seq_q, block_q), cdiv(spec.seq_kv, block_kv)
  q = q8.astype(_F32)
  if q_residual is not None:
    q = q + q_residual.astype(_F32)
  qp = group_heads(_pad(q, 1, nq * block_q), hk)
  kp = _pad(k8, 1, nkv * block_kv).astype(_F32)
  vp = _pad(v8_t, 3, nkv * block_kv).astype(_F32)  # [b, hk, d, skv]
  qs = q_scale.astype(_F32).reshape(b, hk, g, nq)
  ks = k_scale.astype(_F32)
  vs = v_scale.astype(_F32)
  vr = v_scale_ratios(vs)
  stat_shape = (b, hk, g, block_q)
  ids = None
  if segment_ids is not None:  # padded tiles match no id
    ids = (
      _pad_ids(segment_ids[0], nq * block_q, -1),
      _pad_ids(segment_ids[1], nkv * block_kv, -2),
    )
  if sinks is None:
    m0 = jnp.full(stat_shape, -jnp.inf, _F32)
    l0 = jnp.zeros(stat_shape, _F32)
  else:  # the sink's term exp2(sink2 - (m - 8)) = 2^8 at m = sink2
    sink2 = sinks.astype(_F32).reshape(b, hk, g, 1) * jnp.float32(LOG2E)
    m0 = jnp.broadcast_to(sink2, stat_shape)
    l0 = jnp.full(stat_shape, 2.0**P_LOG2_OFFSET, _F32)

  def q_tile_fn(iq):
    q_tile = jax.lax.dynamic_slice_in_dim(qp, iq * block_q, block_q, axis=1)
    q_pos = iq * block_q + jnp.arange(block_q)
    # As the kernel: float32(scale * log2 e) * (sq * sk_j) per step.
    q_descale = qs[..., iq]

    def kv_step(j, carry):
      o, m, l = carry
      k_tile = jax.lax.dynamic_slice_in_dim(kp, j * block_kv, block_kv, axis=1)
      vt_tile = jax.lax.dynamic_slice_in_dim(vp, j * block_kv, block_kv, axis=3)
      s = jnp.einsum(
        "bqhgd,bkhd->bhgqk",
        q_tile,
        k_tile,
        preferred_element_type=_F32,
        precision=HIGHEST,
      )
      descale = (q_descale * ks[:, :, None, j])[..., None]  # [b, hk, g, 1]
      kv_pos = j * block_kv + jnp.arange(block_kv)
      mask = masking.visible(spec, q_pos, kv_pos)
      if ids is not None:  # [b, bq, bkv] -> [b, 1, 1, bq, bkv]
        q_ids = jax.lax.dynamic_slice_in_dim(ids[0], iq * block_q, block_q, 1)
        kv_ids = jax.lax.dynamic_slice_in_dim(ids[1], j * block_kv, block_kv, 1)
        mask = mask & (q_ids[:, :, None] == kv_ids[:, None, :])[:, None, None]
      if spec.softcap is None:
        step_scale = jnp.float32(spec.softmax_scale * LOG2E) * descale
      else:  # as the kernel: tanh of the descaled score
        factor = jnp.float32(spec.softmax_scale / spec.softcap) * descale
        s = jnp.tanh(s * factor[..., None])
        step_scale = jnp.float32(spec.softcap * LOG2E)
      p, alpha, m, l = online_softmax_fp8(
        s, m, l, scale_log2=step_scale, mask=mask
      )
      p8 = p.astype(FP8_DTYPE).astype(_F32)
      o = o * (alpha * vr[:, :, None, j, None])[..., None]
      o = o + jnp.einsum(
        "bhgqk,bhdk->bhgqd",
        p8,
        vt_tile,
        preferred_element_type=_F32,
        precision=HIGHEST,
      )
      return o, m, l

    init = (jnp.zeros(stat_shape + (spec.head_dim,), _F32), m0, l0)
    first, end = masking.kv_block_range(
      spec, iq * block_q, (iq + 1) * block_q, block_kv, nkv
    )
    end = jnp.maximum(end, first)
    o, m, l = jax.lax.fori_loop(first, end, kv_step, init)
    last = jnp.clip(end - 1, 0, nkv - 1)
    sv = jax.lax.dynamic_index_in_dim(vs, last, axis=2, keepdims=False)
    out, lse = finalize_fp8(o, m, l, sv[:, :, None, None])
    return out.astype(spec.dtype), lse

  outs, lses = jax.lax.map(q_tile_fn, jnp.arange(nq))
  # outs: [nq, b, hk, g, bq, d] -> [b, nq * bq, hq, d]; lses: [nq, b, hk, g, bq].
  out = jnp.moveaxis(outs, (0, 4), (1, 2)).reshape(
    b, nq * block_q, spec.heads_q, spec.head_dim
  )
  lse = jnp.moveaxis(lses, 0, 3).reshape(b, spec.heads_q, nq * block_q)
  return out[:, : spec.seq_q], lse[..., : spec.seq_q]
