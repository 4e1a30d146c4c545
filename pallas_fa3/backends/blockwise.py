"""Portable pure-JAX FlashAttention: the CPU default and the kernels' numerics twin.

Forward (FlashAttention-2/3 algorithm): each query tile of `block_q` rows
walks the key/value tiles of `block_kv` columns in order, keeping a running
max `m` and running sum `l` in float32. Scores are scaled by
`softmax_scale * log2(e)` so that the exponentials are `exp2`, as in the
Hopper kernels; P is rounded to the input dtype before the P V product (as a
tensor-core kernel must), accumulated in float32; the tile is normalized by
`1 / l` once at the end. Causal tiles past the diagonal are skipped, so the
work is about half; the full `[seq_q, seq_kv]` score matrix never exists
(memory is linear in sequence length).

Windows skip every tile outside a query tile's window and mask only the
boundary tiles; softcap is fused into the score (`c * tanh(s / c)`, with
`1 - tanh^2` in the backward); sinks seed the running max and sum.

Backward (`blockwise_backward.py`; FlashAttention-2 recomputation from the
residuals out and lse):
`delta = rowsum(dO * O)`, P recomputed as `exp2(S * scale * log2(e) - lse *
log2(e))`, `dS = P * (dP - delta)`. The outer loop runs over kv tiles (as the
kernel's grid does), the inner loop over the query tiles that see them,
accumulating dK and dV for the tile and adding each dQ contribution into a
float32 dQ accumulator in a fixed order (so gradients are deterministic).
Grouped-query attention reads each K/V tile once for all query heads of its
group and sums dK/dV over the group; K and V are never repeated.

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

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from pallas_fa3 import (
  masking,
  modifiers,
  segments,
  stable_max as stable_max_lib,
)
from pallas_fa3.backends import blockwise_fp8
from pallas_fa3.backends.base import Backend
from pallas_fa3.backends.blockwise_backward import (
  blockwise_backward as blockwise_backward,
)
from pallas_fa3.backends.blockwise_tiles import (
  HIGHEST,
  Tiling,
  clip_range,
  id_tiles,
  pad_seq,
  scores_log2,
  seq_tile,
  varying_like,
  walk_tiles,
)
from pallas_fa3.kernels.sm90 import config_fp8 as sm90_fp8_config
from pallas_fa3.lse import natural_from_log2
from pallas_fa3.spec import LOG2E, AttentionSpec, check_int_fields, group_heads

_MAX_BLOCK = 8192  # a tile this large is no longer "blockwise" on any machine


@dataclasses.dataclass(frozen=True)
class BlockwiseConfig:
  """Tile sizes of the blockwise backend (hashable: a static argument).

  Attributes:
    block_q: query rows per tile (the kernels' Br).
    block_kv: key/value columns per tile (the kernels' Bc).

  A tile larger than its sequence is clamped to the sequence length, which
  computes the same values as padding it.
  """

  block_q: int = 128
  block_kv: int = 128

  def __post_init__(self) -> None:
    block = dict(minimum=1, maximum=_MAX_BLOCK)
    check_int_fields(self, block_q=block, block_kv=block)


def blockwise_forward(
  spec: AttentionSpec,
  config: BlockwiseConfig,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  sinks: jax.Array | None = None,
  segment_ids: Any = None,
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

  def q_tile_fn(iq):
    q_tile = seq_tile(qp, iq, t.block_q)
    q_pos = iq * t.block_q + jnp.arange(t.block_q)
    q_ids = None if ids is None else seq_tile(ids[0], iq, t.block_q)

    def kv_step(j, carry, *, masked):
      m, l, acc = carry
      s, _ = scores_log2(
        spec,
        q_tile,
        seq_tile(kp, j, t.block_kv),
        q_pos,
        j * t.block_kv + jnp.arange(t.block_kv),
        masked=masked,
        ids=None if ids is None else (q_ids, seq_tile(ids[1], j, t.block_kv)),
      )
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
    if spans is None:
      bounds += masking.kv_blocks_unmasked(spec, *rows, t.block_kv)
    else:  # every tile masked (the ids)
      bounds += (0, 0)
    m, l, acc = walk_tiles(bounds, kv_step, init, masked=masked)
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


# Quantization tiles of FP8 calls without a config: the FP8 kernel's default
# for the head dim (so the twin quantizes and rounds P as the kernel would),
# else these.
_FP8_FALLBACK_TILES = (64, 128)


def _make_config(
  spec: AttentionSpec, config: BlockwiseConfig | None
) -> BlockwiseConfig:
  if config is not None:
    return config
  if spec.fp8 is None:
    return BlockwiseConfig()
  if spec.head_dim in sm90_fp8_config.FP8_HEAD_DIMS:
    kernel = sm90_fp8_config.default_fp8_forward_config(spec.head_dim)
    return BlockwiseConfig(kernel.block_q, kernel.block_kv)
  return BlockwiseConfig(*_FP8_FALLBACK_TILES)


def _unsupported(spec: AttentionSpec, config: BlockwiseConfig) -> str | None:
  del config
  if spec.fp8 is not None and spec.stable_max is not None:
    return "stable_max is not implemented for fp8 attention"
  if spec.stable_max is not None and modifiers.active(spec):
    names = ", ".join(modifiers.active(spec))
    return f"stable_max is not implemented together with {names}"
  return None


def _fp8_forward(
  spec: AttentionSpec, config: BlockwiseConfig, x: Any, **extras: Any
) -> tuple[jax.Array, jax.Array]:
  return blockwise_fp8.blockwise_forward_fp8(
    spec, config.block_q, config.block_kv, *x, **extras
  )


BACKEND = Backend(
  "blockwise",
  "pure-JAX FlashAttention (tiled online softmax), any device;"
  " the kernels' numerics twin",
  blockwise_forward,
  blockwise_backward,
  _unsupported,
  config_types=(BlockwiseConfig,),
  make_config=_make_config,
  fp8_forward=_fp8_forward,
  fp8_tiles=lambda config: (config.block_q, config.block_kv),
  automatic=True,
)
