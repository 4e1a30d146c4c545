"""The blockwise forward: each query tile of `block_q` rows walks the
key/value tiles of `block_kv` columns in order (FlashAttention-2/3), with a
float32 running max and sum in base 2 as the Hopper kernels keep them, P
rounded to the input dtype before the P V product, and the full score
matrix never materialized. Causal and window tiles outside a query tile's
reach are skipped, only boundary tiles masked; softcap is fused into the
score and the sinks seed the running statistics: docs/api.md#backends.

Example:
  >>> import jax
  >>> import pallas_fa3
  >>> q = jax.random.normal(jax.random.key(0), (1, 300, 4, 64), "bfloat16")
  >>> kv = jax.random.normal(jax.random.key(1), (1, 300, 2, 64), "bfloat16")
  >>> cfg = pallas_fa3.BlockwiseConfig(block_q=64, block_kv=128)
  >>> out = pallas_fa3.flash_attention(q, kv, kv, causal=True,
  ...                                  implementation="blockwise", config=cfg)
  >>> out.shape
  (1, 300, 4, 64)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_fa3 import (
  masking,
  segments,
  stable_max as stable_max_lib,
)
from pallas_fa3.backends.blockwise.tiles import (
  BlockwiseConfig,
  Tiling,
  clip_range,
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
from pallas_fa3.lse import natural_from_log2
from pallas_fa3.spec import HIGHEST, LOG2E, AttentionSpec, group_heads


def blockwise_forward(
  spec: AttentionSpec,
  config: BlockwiseConfig,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  sinks: jax.Array | None = None,
  segment_ids: Any = None,
  flex: Any = None,
) -> tuple[jax.Array, jax.Array]:
  """Tiled online-softmax forward; returns (out `[b, sq, hq, dv]`, lse `[b, hq, sq]`).

  Each query tile walks only the kv tiles its rows see (a window's or the
  causal diagonal's others, and those whose segment ids cannot meet, are
  never computed), masking only the boundary ones (every one with segment
  ids). `sinks` (`[b, hq]` float32) seed the running max and sum.
  """
  t = Tiling.of(spec, config.block_q, config.block_kv)
  qp = group_heads(pad_seq(q, t.num_q * t.block_q), spec.heads_kv)
  kp = pad_seq(k, t.num_kv * t.block_kv)
  vp = pad_seq(v, t.num_kv * t.block_kv)
  stat_shape = (spec.batch, spec.heads_kv, spec.group_size, t.block_q)
  masked = spec.masked or spec.seq_kv % t.block_kv != 0
  if sinks is None:
    m0, l0 = jnp.full(stat_shape, -jnp.inf, jnp.float32), jnp.zeros(stat_shape)
  else:  # the sink is one more term of every row's sum, exp2(sink2 - m)
    sink2 = sinks.reshape(stat_shape[:3] + (1,)) * jnp.float32(LOG2E)
    m0, l0 = jnp.broadcast_to(sink2, stat_shape), jnp.ones(stat_shape)
  spans = ids = None
  if segment_ids is not None:
    spans = segments.kv_tile_spans(segment_ids, t.block_q, t.block_kv)
    ids = id_tiles(segment_ids, t)
  bias = pad_bias(flex, t)
  live = live_tiles(spec, flex, t)

  def q_tile_fn(iq):
    q_tile = seq_tile(qp, iq, t.block_q)
    q_pos = iq * t.block_q + jnp.arange(t.block_q)
    q_ids = None if ids is None else seq_tile(ids[0], iq, t.block_q)

    def kv_step(j, carry, *, masked):
      m, l, acc = carry
      kv_pos = j * t.block_kv + jnp.arange(t.block_kv)
      s, _, _ = scores_log2(
        spec,
        q_tile,
        seq_tile(kp, j, t.block_kv),
        q_pos,
        kv_pos,
        masked=masked,
        ids=None if ids is None else (q_ids, seq_tile(ids[1], j, t.block_kv)),
        flex_tile=flex_tile(
          spec, flex, bias, q_pos, kv_pos, iq * t.block_q, j * t.block_kv,
          (t.block_q, t.block_kv),
        ),
      )  # fmt: skip
      if spec.stable_max is None:
        m_new = jnp.maximum(m, s.max(axis=-1))
      else:  # scores are base 2 here: one natural-log unit is log2(e)
        m_new = jnp.maximum(
          m,
          stable_max_lib.tile_max(
            s,
            spec.stable_max,
            unit=LOG2E,
            max_shift=stable_max_lib.max_shift_log2(spec.dtype),
          ),
        )
      # Until a row has seen a visible key its max is -inf; exponentiate
      # against 0 instead so that exp2(-inf) = 0 rather than NaN.
      m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      alpha = jnp.exp2(m - m_ref)
      p = jnp.exp2(s - m_ref[..., None])
      l = alpha * l + p.sum(axis=-1)
      pv = jnp.einsum(
        "bhgqk,bkhd->bhgqd",
        p.astype(spec.dtype),
        seq_tile(vp, j, t.block_kv),
        preferred_element_type=jnp.float32,
        precision=HIGHEST,
      )
      return m_new, l, alpha[..., None] * acc + pv

    init = varying_like(
      (
        m0.astype(jnp.float32),
        l0.astype(jnp.float32),
        jnp.zeros(stat_shape + (spec.head_dim_v,), jnp.float32),
      ),
      q,
      k,
      v,
    )
    rows = (iq * t.block_q, (iq + 1) * t.block_q)
    bounds = masking.kv_block_range(spec, *rows, t.block_kv, t.num_kv)
    bounds = clip_range(bounds, spans, iq)
    if spans is None and not (spec.flex is not None and spec.flex.masks):
      bounds += masking.kv_blocks_unmasked(spec, *rows, t.block_kv)
    else:  # every tile masked (the ids, mask_mod)
      bounds += (0, 0)
    if live is None:
      m, l, acc = walk_tiles(bounds, kv_step, init, masked=masked)
    else:  # the block mask's live tiles only
      m, l, acc = walk_live(live[iq], *bounds[:2], kv_step, init)
    empty = l == 0.0
    inv_l = 1.0 / jnp.where(empty, 1.0, l)
    out = (acc * inv_l[..., None]).astype(spec.dtype)
    lse = jnp.where(
      empty, -jnp.inf, natural_from_log2(m + jnp.log2(jnp.where(empty, 1.0, l)))
    )
    return out, lse

  outs, lses = jax.lax.map(q_tile_fn, jnp.arange(t.num_q))
  # outs: [nq, b, hk, g, bq, dv] -> [b, nq * bq, hq, dv]; lses: [nq, b, hk, g, bq].
  out = jnp.moveaxis(outs, (0, 4), (1, 2)).reshape(
    spec.batch, t.num_q * t.block_q, spec.heads_q, spec.head_dim_v
  )
  lse = jnp.moveaxis(lses, 0, 3).reshape(
    spec.batch, spec.heads_q, t.num_q * t.block_q
  )
  return out[:, : spec.seq_q], lse[..., : spec.seq_q]
