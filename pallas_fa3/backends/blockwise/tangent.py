"""The blockwise forward-plus-tangent pass (forward-mode differentiation):
each query tile walks its key/value tiles once, carrying the online
softmax's running max and sum and three accumulators, `P V`, the tangent
accumulator `P V' + (P o S') V` and the row sum `rowsum(P o S')`, all
rescaled by the same `exp2(m_old - m_new)` whenever the max moves. At the
end `O = acc / l`, `lse' = rowsum(P o S') / l` and
`O' = acc' / l - lse' O`. `S'` is the tile's score tangent, taken with
`jax.jvp` of the tile's own scores (scale, softcap, bias, score_mod,
masks: a hidden entry's tangent is 0); a sink is one more term of the sum
with tangent `sink'`. Loops are `lax.scan`s with a `lax.cond` skipping the
tiles a query tile cannot see, so the pass is itself differentiable in
reverse mode (`jax.grad` through a tangent): docs/api.md#forward-mode.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from pallas_fa3 import flex as flex_lib, masking, segments
from pallas_fa3.backends.blockwise.tiles import (
  BlockwiseConfig,
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
)
from pallas_fa3.lse import natural_from_log2
from pallas_fa3.spec import LOG2E, AttentionSpec, group_heads


def blockwise_forward_tangent(
  spec: AttentionSpec,
  config: BlockwiseConfig,
  primals: Any,
  tangents: Any,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """(out, lse, out's tangent, lse's tangent) in one tiled pass.

  Args:
    spec: the call.
    config: the tiles.
    primals: a `base.Prefill` (q, k, v, `[b, hq]` float32 sinks, segment
      ids, `flex.FlexOperands`).
    tangents: its tangents, the same tree with every leaf an array (zeros
      where the caller has none; float0 for integer leaves).

  Returns:
    out `[b, sq, hq, dv]` and its tangent in `spec.dtype`, lse
    `[b, hq, sq]` and its tangent in float32. A row that sees no key has
    out 0, lse -inf and both tangents 0.
  """
  q, k, v, sinks, segment_ids, ops = primals
  dq, dk, dv = tangents[:3]
  t = Tiling.of(spec, config.block_q, config.block_kv)
  hk, g = spec.heads_kv, spec.group_size
  qp = group_heads(pad_seq(q, t.num_q * t.block_q), hk)
  dqp = group_heads(pad_seq(dq, t.num_q * t.block_q), hk)
  kp, dkp = (pad_seq(x, t.num_kv * t.block_kv) for x in (k, dk))
  vp, dvp = (pad_seq(x, t.num_kv * t.block_kv) for x in (v, dv))
  stat_shape = (spec.batch, hk, g, t.block_q)
  ln2 = jnp.float32(math.log(2.0))
  if sinks is None:
    m0 = jnp.full(stat_shape, -jnp.inf, jnp.float32)
    l0 = ldot0 = jnp.zeros(stat_shape, jnp.float32)
  else:  # the sink: one more term exp(sink) of every row's sum
    m0 = jnp.broadcast_to(
      sinks.reshape(stat_shape[:3] + (1,)) * jnp.float32(LOG2E), stat_shape
    )
    l0 = jnp.ones(stat_shape, jnp.float32)
    ldot0 = jnp.broadcast_to(
      tangents[3].astype(jnp.float32).reshape(stat_shape[:3] + (1,)),
      stat_shape,
    )
  spans = ids = None
  if segment_ids is not None:
    spans = segments.kv_tile_spans(segment_ids, t.block_q, t.block_kv)
    ids = id_tiles(segment_ids, t)
  bias = dbias = None
  floats = dfloats = ()
  if ops is not None:
    bias = pad_bias(ops, t)
    if bias is not None:
      dbias = pad_bias(tangents[5], t)
    mask = flex_lib.differentiable(ops.score_consts)
    floats = flex_lib.float_consts(ops)
    dfloats = tuple(
      x for x, d in zip(tangents[5].score_consts, mask) if d
    )  # fmt: skip
  live = live_tiles(spec, ops, t)

  def q_tile_fn(iq):
    q_tile = seq_tile(qp, iq, t.block_q)
    dq_tile = seq_tile(dqp, iq, t.block_q)
    q_pos = iq * t.block_q + jnp.arange(t.block_q)
    q_ids = None if ids is None else seq_tile(ids[0], iq, t.block_q)
    rows = (iq * t.block_q, (iq + 1) * t.block_q)
    first, end = masking.kv_block_range(spec, *rows, t.block_kv, t.num_kv)
    first, end = clip_range((first, end), spans, iq)

    def scores(j, q_t, k_t, bias_t, floats_t):
      """The tile's base-2 scores (hidden entries -inf)."""
      kv_pos = j * t.block_kv + jnp.arange(t.block_kv)
      tile = flex_tile(
        spec, ops, bias, q_pos, kv_pos, iq * t.block_q, j * t.block_kv,
        (t.block_q, t.block_kv),
      )  # fmt: skip
      if tile is not None:
        tile = dataclasses.replace(tile, bias=bias_t, floats=floats_t)
      s, _, _ = scores_log2(
        spec, q_t, k_t, q_pos, kv_pos, masked=True,
        ids=None if ids is None else (q_ids, seq_tile(ids[1], j, t.block_kv)),
        flex_tile=tile,
      )  # fmt: skip
      return s

    def bias_tile(x, j):
      if x is None:
        return None
      size = x.shape[:2] + (t.block_q, t.block_kv)
      x = jax.lax.dynamic_slice(x, (0, 0, iq * t.block_q, j * t.block_kv), size)
      return flex_lib.grouped(x, hk, g)

    def step(carry, j):
      m, l, acc, ldot, accdot = carry
      k_t, dk_t = seq_tile(kp, j, t.block_kv), seq_tile(dkp, j, t.block_kv)
      v_t, dv_t = seq_tile(vp, j, t.block_kv), seq_tile(dvp, j, t.block_kv)
      s, sdot = jax.jvp(
        lambda a, b, c, d: scores(j, a, b, c, d),
        (q_tile, k_t, bias_tile(bias, j), floats),
        (dq_tile, dk_t, bias_tile(dbias, j), dfloats),
      )
      sdot = sdot * ln2  # base 2 -> natural units
      m_new = jnp.maximum(m, s.max(axis=-1))
      # A row that has seen no visible key yet keeps max -inf: exponentiate
      # against 0 so that exp2(-inf) = 0 rather than NaN.
      m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      alpha = jnp.exp2(m - m_ref)
      p = jnp.exp2(s - m_ref[..., None])
      ps = p * sdot  # P o S', 0 where hidden
      l = alpha * l + p.sum(axis=-1)
      ldot = alpha * ldot + ps.sum(axis=-1)
      p_lo = p.astype(spec.dtype)
      acc = alpha[..., None] * acc + dot_f32("bhgqk,bkhd->bhgqd", p_lo, v_t)
      accdot = (
        alpha[..., None] * accdot
        + dot_f32("bhgqk,bkhd->bhgqd", p_lo, dv_t)
        + dot_f32("bhgqk,bkhd->bhgqd", ps, v_t.astype(jnp.float32))
      )
      return m_new, l, acc, ldot, accdot

    def maybe_step(carry, j):
      seen = (j >= first) & (j < end)
      if live is not None:
        seen = seen & live[iq, j]
      return jax.lax.cond(seen, step, lambda c, _: c, carry, j), None

    acc0 = jnp.zeros(stat_shape + (spec.head_dim_v,), jnp.float32)
    init = varying_like((m0, l0, acc0, ldot0, acc0), q, k, v)
    (m, l, acc, ldot, accdot), _ = jax.lax.scan(
      maybe_step, init, jnp.arange(t.num_kv)
    )
    empty = l == 0.0
    inv_l = 1.0 / jnp.where(empty, 1.0, l)
    out = acc * inv_l[..., None]
    lse_dot = jnp.where(empty, 0.0, ldot * inv_l)
    out_dot = accdot * inv_l[..., None] - lse_dot[..., None] * out
    lse = jnp.where(
      empty, -jnp.inf, natural_from_log2(m + jnp.log2(jnp.where(empty, 1.0, l)))
    )
    return out, lse, out_dot, lse_dot

  outs, lses, out_dots, lse_dots = jax.lax.map(q_tile_fn, jnp.arange(t.num_q))
  size = spec.batch, t.num_q * t.block_q, spec.heads_q, spec.head_dim_v

  def untile_out(x):  # [nq, b, hk, g, bq, dv] -> [b, sq, hq, dv]
    x = jnp.moveaxis(x, (0, 4), (1, 2)).reshape(size)
    return x[:, : spec.seq_q].astype(spec.dtype)

  def untile_lse(x):  # [nq, b, hk, g, bq] -> [b, hq, sq]
    x = jnp.moveaxis(x, 0, 3).reshape(size[0], size[2], size[1])
    return x[..., : spec.seq_q]

  return (
    untile_out(outs),
    untile_lse(lses),
    untile_out(out_dots),
    untile_lse(lse_dots),
  )
