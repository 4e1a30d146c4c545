"""The blockwise twin's backward: FlashAttention-2 recomputation from the
residuals out and lse. `delta = rowsum(dO * O)`, P recomputed from the
base-2 lse, `dS = P * (dP - delta)` (times `1 - tanh^2` with softcap); the
outer loop runs over kv tiles (as the kernels' grid does), the inner loop
over the query tiles that see them (masking only boundary tiles), and dQ is
added into a float32 accumulator in a fixed order (deterministic). GQA
reads each K/V tile once for its group; the sinks are in the lse.
docs/design_notes.md#backward-kernels
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_fa3 import flex as flex_lib, masking, segments
from pallas_fa3.backends.blockwise.tiles import (
  Tiling,
  clip_range,
  dot_f32,
  flex_tile,
  id_tiles,
  live_tiles,
  pad_bias,
  pad_seq,
  scores_log2,
  seq_tile,
  varying_like,
  walk_live,
  walk_tiles,
)
from pallas_fa3.lse import log2_of
from pallas_fa3.spec import AttentionSpec, cdiv, group_heads


def blockwise_backward(
  spec: AttentionSpec,
  config: object,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  out: jax.Array,
  lse: jax.Array,
  dout: jax.Array,
  dlse: jax.Array,
  segment_ids: Any = None,
  flex: Any = None,
) -> tuple[jax.Array, ...]:
  """FlashAttention-2 backward by recomputation; returns (dq, dk, dv).

  `config` is a `BlockwiseConfig` (its tiles). `out` and `lse` are the
  forward's residuals, `dout` and `dlse` their cotangents (`dlse` zeros when
  the caller only used the attention output); `dlse` enters as
  `delta - dlse` since d lse_i / d s_ij = P_ij. The gradients are shaped
  like q, k, v, in `spec.dtype`. With `flex` (`spec.flex`'s operands) a
  fourth result: `(dbias, d score_mod's arrays)` (`flex_lib.cotangents`'s
  arguments), each summed in float32 tile by tile.
  """
  t = Tiling.of(spec, config.block_q, config.block_kv)
  sq_pad, skv_pad = t.num_q * t.block_q, t.num_kv * t.block_kv
  hk, g = spec.heads_kv, spec.group_size
  stat = lambda x: x.reshape(spec.batch, hk, g, spec.seq_q)

  delta = dot_f32(
    "bqhd,bqhd->bhq", dout.astype(jnp.float32), out.astype(jnp.float32)
  )
  delta = stat(delta - dlse.astype(jnp.float32))
  # Kept out of the dP dot's fusion: XLA's CPU YNNPACK fusion of (a dot with
  # a constant operand - a reduction), which jax.grad's cotangent of `sum`
  # makes, computed garbage on jaxlib 0.11.2 (docs/design_notes.md, "A
  # miscompiled fusion").
  delta = jax.lax.optimization_barrier(delta)
  # P = exp2(S_log2 - lse_log2). Rows that saw no key (lse = -inf) and padded
  # rows get +inf so that their P is exactly 0 (finite gradients).
  lse2 = stat(jnp.where(lse == -jnp.inf, jnp.inf, log2_of(lse)))
  delta = pad_seq(jnp.moveaxis(delta, 3, 1), sq_pad)
  lse2 = pad_seq(jnp.moveaxis(lse2, 3, 1), sq_pad, value=jnp.inf)
  qp = group_heads(pad_seq(q, sq_pad), hk)
  dop = group_heads(pad_seq(dout, sq_pad), hk)
  kp, vp = pad_seq(k, skv_pad), pad_seq(v, skv_pad)
  masked = spec.masked or spec.seq_kv % t.block_kv != 0
  spans = ids = None
  if segment_ids is not None:
    spans = segments.q_tile_spans(segment_ids, t.block_kv, t.block_q)
    ids = id_tiles(segment_ids, t)
  bias = pad_bias(flex, t)
  live = live_tiles(spec, flex, t)
  floats = () if flex is None else flex_lib.float_consts(flex)
  dfloats0 = tuple(jnp.zeros(c.shape, jnp.float32) for c in floats)
  dbias_shape = None if bias is None else bias.shape[:3] + (t.block_kv,)

  def kv_tile_fn(carry, jk):
    dq_acc, dfloats = carry
    k_tile = seq_tile(kp, jk, t.block_kv)
    v_tile = seq_tile(vp, jk, t.block_kv)
    kv_pos = jk * t.block_kv + jnp.arange(t.block_kv)
    kv_ids = None if ids is None else seq_tile(ids[1], jk, t.block_kv)

    def q_step(i, carry, *, masked):
      dq_acc, dk, dv, dbias, dfloats = carry
      q_tile = seq_tile(qp, i, t.block_q)
      do_tile = seq_tile(dop, i, t.block_q)
      # [b, bq, hk, g] -> [b, hk, g, bq] to broadcast against the scores.
      lse2_t = jnp.moveaxis(seq_tile(lse2, i, t.block_q), 1, 3)
      delta_t = jnp.moveaxis(seq_tile(delta, i, t.block_q), 1, 3)
      q_pos = i * t.block_q + jnp.arange(t.block_q)
      tile_ids = None
      if ids is not None:
        tile_ids = (seq_tile(ids[0], i, t.block_q), kv_ids)
      tile = flex_tile(
        spec, flex, bias, q_pos, kv_pos, i * t.block_q, jk * t.block_kv,
        (t.block_q, t.block_kv),
      )  # fmt: skip
      s, tanh, pull = scores_log2(
        spec, q_tile, k_tile, q_pos, kv_pos, masked=masked, ids=tile_ids,
        flex_tile=tile, pullback=True,
      )  # fmt: skip
      # lse >= every score of its row: clamping at 0 changes nothing in
      # exact arithmetic and keeps P finite where lse's own rounding (at
      # |s| ~ 1e10 more than log(l)) would put the max's term above it.
      p = jnp.exp2(jnp.minimum(s - lse2_t[..., None], 0.0))
      dv = dv + dot_f32("bhgqk,bqhgd->bkhd", p.astype(spec.dtype), do_tile)
      dp = dot_f32("bqhgd,bkhd->bhgqk", do_tile, v_tile)
      ds = p * (dp - delta_t[..., None])
      if pull is not None:  # back through score_mod and the bias
        ds, dbias_t, dfloats_t = pull(ds)
        dfloats = tuple(a + b for a, b in zip(dfloats, dfloats_t))
        if dbias is not None:
          dbias_t = dbias_t.reshape(dbias.shape[:2] + dbias_t.shape[-2:])
          dbias = jax.lax.dynamic_update_slice_in_dim(
            dbias,
            jax.lax.dynamic_slice_in_dim(dbias, i * t.block_q, t.block_q, 2)
            + dbias_t,
            i * t.block_q,
            axis=2,
          )
      if tanh is not None:  # d(c tanh(x / c)) / dx
        ds = ds * (1.0 - tanh * tanh)
      ds = ds.astype(spec.dtype)
      dk = dk + dot_f32("bhgqk,bqhgd->bkhd", ds, q_tile)
      dq_tile = dot_f32("bhgqk,bkhd->bqhgd", ds, k_tile)
      dq_acc = jax.lax.dynamic_update_slice_in_dim(
        dq_acc,
        seq_tile(dq_acc, i, t.block_q) + dq_tile,
        i * t.block_q,
        axis=1,
      )
      return dq_acc, dk, dv, dbias, dfloats

    zeros = (
      jnp.zeros((spec.batch, t.block_kv, hk, spec.head_dim), jnp.float32),
      jnp.zeros((spec.batch, t.block_kv, hk, spec.head_dim_v), jnp.float32),
    )
    if dbias_shape is not None:
      zeros += (jnp.zeros(dbias_shape, jnp.float32),)
    zeros = varying_like(zeros, q, k, v, dout)
    dbias0 = zeros[2] if dbias_shape is not None else None
    init = (dq_acc,) + zeros[:2] + (dbias0, dfloats)
    cols = (jk * t.block_kv, (jk + 1) * t.block_kv)
    bounds = masking.q_block_range(spec, *cols, t.block_q, t.num_q)
    bounds = clip_range(bounds, spans, jk)
    if spans is None and not (spec.flex is not None and spec.flex.masks):
      bounds += _unmasked_q_blocks(spec, jk, t)
    else:  # every tile masked (the ids, mask_mod)
      bounds += (0, 0)
    if live is None:
      result = walk_tiles(bounds, q_step, init, masked=masked)
    else:  # the block mask's live tiles only
      result = walk_live(live[:, jk], *bounds[:2], q_step, init)
    dq_acc, dk, dv, dbias, dfloats = result
    return (dq_acc, dfloats), (dk, dv, dbias)

  dq0 = varying_like(
    jnp.zeros((spec.batch, sq_pad, hk, g, spec.head_dim), jnp.float32),
    q,
    k,
    v,
    dout,
  )
  (dq_acc, dfloats), (dks, dvs, dbiases) = jax.lax.scan(
    kv_tile_fn, (dq0, dfloats0), jnp.arange(t.num_kv)
  )
  scale = jnp.float32(spec.softmax_scale)
  dq = (dq_acc[:, : spec.seq_q] * scale).reshape(q.shape)
  # dks: [nkv, b, bkv, hk, d] -> [b, nkv * bkv, hk, d].
  untile = lambda x: jnp.moveaxis(x, 0, 1).reshape(
    (spec.batch, skv_pad) + x.shape[3:]
  )[:, : spec.seq_kv]
  dk, dv = untile(dks) * scale, untile(dvs)
  grads = dq.astype(spec.dtype), dk.astype(spec.dtype), dv.astype(spec.dtype)
  if flex is None:
    return grads
  dbias = None
  if dbiases is not None:  # [nkv, b|1, h|1, sq_pad, bkv] -> the bias's shape
    dbias = (
      jnp.moveaxis(dbiases, 0, 3)
      .reshape(dbiases.shape[1:4] + (skv_pad,))[
        :, :, : spec.seq_q, : spec.seq_kv
      ]
      .astype(flex.bias.dtype)
    )
  dfloats = tuple(d.astype(c.dtype) for d, c in zip(dfloats, floats))
  return grads + ((dbias, flex_lib.spread_float_grads(flex, dfloats)),)


def _unmasked_q_blocks(
  spec: AttentionSpec, jk: jax.Array, t: Tiling
) -> tuple[jax.Array, jax.Array]:
  """(lo, hi): the query tiles `lo <= i < hi` that see every key of kv tile
  `jk` (a tile with padded keys: none)."""
  lo, hi = jnp.int32(0), jnp.int32(t.num_q)
  kv0, kv_last = jk * t.block_kv, (jk + 1) * t.block_kv - 1
  off = spec.causal_offset
  if spec.window_right is not None:  # row i sees kv_last: i + off + r >= it
    lo = cdiv(jnp.maximum(kv_last - off - spec.window_right, 0), t.block_q)
  if spec.window_left is not None:  # the tile's last row sees kv0
    hi = (kv0 - off + spec.window_left + 1) // t.block_q
  full = kv_last < spec.seq_kv
  return lo, jnp.where(full, jnp.maximum(hi, 0), lo)
