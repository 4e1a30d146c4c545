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

Backward (FlashAttention-2 recomputation from the residuals out and lse):
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
import functools
import math
import operator
from typing import Any

import jax
import jax.numpy as jnp

from pallas_fa3 import masking, stable_max as stable_max_lib
from pallas_fa3.backends import blockwise_fp8
from pallas_fa3.backends.base import Backend
from pallas_fa3.kernels.sm90 import config_fp8 as sm90_fp8_config
from pallas_fa3.spec import LOG2E, AttentionSpec, check_int_fields, group_heads

_LN2 = math.log(2.0)  # converts the base-2 LSE back to natural log
_HIGHEST = jax.lax.Precision.HIGHEST
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


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


@dataclasses.dataclass(frozen=True)
class _Tiling:
  """Effective tile sizes and counts for one spec."""

  block_q: int
  block_kv: int
  num_q: int
  num_kv: int

  @classmethod
  def of(cls, spec: AttentionSpec, config: BlockwiseConfig) -> _Tiling:
    bq = min(config.block_q, spec.seq_q)
    bkv = min(config.block_kv, spec.seq_kv)
    return cls(bq, bkv, _cdiv(spec.seq_q, bq), _cdiv(spec.seq_kv, bkv))


def _pad_seq(x: jax.Array, length: int, value: float = 0) -> jax.Array:
  """Pads axis 1 (sequence) up to `length`; a no-op when already that long."""
  pad = length - x.shape[1]
  if pad == 0:
    return x
  widths = [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
  return jnp.pad(x, widths, constant_values=value)


def _varying_like(tree: Any, *operands: jax.Array) -> Any:
  """Gives fresh loop carries the manual-axis type of `operands` (shard_map).

  Inside `jax.shard_map` (`check_vma=True`) the operands vary over the
  manual axes while a fresh `jnp.zeros` does not, so a loop mixing the two
  would change its carry's type. Adding a zero that varies like every
  operand (from zero-size slices) fixes the type; values stay as they are.
  """
  empty = [x.reshape(-1)[:0].astype(jnp.float32) for x in operands]
  ref = functools.reduce(operator.add, empty)
  return jax.tree.map(
    lambda x: x + jnp.zeros_like(ref, shape=x.shape, dtype=x.dtype), tree
  )


def _seq_tile(x: jax.Array, index: Any, size: int) -> jax.Array:
  return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=1)


def _scores_log2(
  spec: AttentionSpec,
  q_tile: jax.Array,
  k_tile: jax.Array,
  q_pos: jax.Array,
  kv_pos: jax.Array,
) -> jax.Array:
  """Masked base-2 scores of one tile, float32 `[b, hk, g, block_q, block_kv]`."""
  s = jnp.einsum(
    "bqhgd,bkhd->bhgqk",
    q_tile,
    k_tile,
    preferred_element_type=jnp.float32,
    precision=_HIGHEST,
  )
  s = s * jnp.float32(spec.softmax_scale * LOG2E)
  return jnp.where(masking.visible(spec, q_pos, kv_pos), s, -jnp.inf)


def blockwise_forward(
  spec: AttentionSpec,
  config: BlockwiseConfig,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """Tiled online-softmax forward; returns (out `[b, sq, hq, dv]`, lse `[b, hq, sq]`)."""
  t = _Tiling.of(spec, config)
  qp = group_heads(_pad_seq(q, t.num_q * t.block_q), spec.heads_kv)
  kp = _pad_seq(k, t.num_kv * t.block_kv)
  vp = _pad_seq(v, t.num_kv * t.block_kv)
  stat_shape = (spec.batch, spec.heads_kv, spec.group_size, t.block_q)

  def q_tile_fn(iq):
    q_tile = _seq_tile(qp, iq, t.block_q)
    q_pos = iq * t.block_q + jnp.arange(t.block_q)

    def kv_step(j, carry):
      m, l, acc = carry
      s = _scores_log2(
        spec,
        q_tile,
        _seq_tile(kp, j, t.block_kv),
        q_pos,
        j * t.block_kv + jnp.arange(t.block_kv),
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
        _seq_tile(vp, j, t.block_kv),
        preferred_element_type=jnp.float32,
        precision=_HIGHEST,
      )
      return m_new, l, alpha[..., None] * acc + pv

    init = _varying_like(
      (
        jnp.full(stat_shape, -jnp.inf, jnp.float32),
        jnp.zeros(stat_shape, jnp.float32),
        jnp.zeros(stat_shape + (spec.head_dim_v,), jnp.float32),
      ),
      q,
      k,
      v,
    )
    n_kv = masking.num_kv_blocks_visible(
      spec, (iq + 1) * t.block_q, t.block_kv, t.num_kv
    )
    m, l, acc = jax.lax.fori_loop(0, n_kv, kv_step, init)
    empty = l == 0.0
    inv_l = 1.0 / jnp.where(empty, 1.0, l)
    out = (acc * inv_l[..., None]).astype(spec.dtype)
    lse = jnp.where(
      empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l))) * _LN2
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


def blockwise_backward(
  spec: AttentionSpec,
  config: BlockwiseConfig,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  out: jax.Array,
  lse: jax.Array,
  dout: jax.Array,
  dlse: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """FlashAttention-2 backward by recomputation; returns (dq, dk, dv).

  `out` and `lse` are the forward's residuals, `dout` and `dlse` their
  cotangents (`dlse` zeros when the caller only used the attention output);
  `dlse` enters as `delta - dlse` since d lse_i / d s_ij = P_ij. The
  gradients are shaped like q, k, v, in `spec.dtype`.
  """
  t = _Tiling.of(spec, config)
  sq_pad, skv_pad = t.num_q * t.block_q, t.num_kv * t.block_kv
  hk, g = spec.heads_kv, spec.group_size
  stat = lambda x: x.reshape(spec.batch, hk, g, spec.seq_q)

  delta = jnp.einsum(
    "bqhd,bqhd->bhq",
    dout.astype(jnp.float32),
    out.astype(jnp.float32),
    precision=_HIGHEST,
  )
  delta = stat(delta - dlse.astype(jnp.float32))
  # P = exp2(S_log2 - lse_log2). Rows that saw no key (lse = -inf) and padded
  # rows get +inf so that their P is exactly 0 (finite gradients).
  lse2 = stat(jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E))
  delta = _pad_seq(jnp.moveaxis(delta, 3, 1), sq_pad)
  lse2 = _pad_seq(jnp.moveaxis(lse2, 3, 1), sq_pad, value=jnp.inf)
  qp = group_heads(_pad_seq(q, sq_pad), hk)
  dop = group_heads(_pad_seq(dout, sq_pad), hk)
  kp, vp = _pad_seq(k, skv_pad), _pad_seq(v, skv_pad)

  def kv_tile_fn(dq_acc, jk):
    k_tile = _seq_tile(kp, jk, t.block_kv)
    v_tile = _seq_tile(vp, jk, t.block_kv)
    kv_pos = jk * t.block_kv + jnp.arange(t.block_kv)

    def q_step(i, carry):
      dq_acc, dk, dv = carry
      q_tile = _seq_tile(qp, i, t.block_q)
      do_tile = _seq_tile(dop, i, t.block_q)
      # [b, bq, hk, g] -> [b, hk, g, bq] to broadcast against the scores.
      lse2_t = jnp.moveaxis(_seq_tile(lse2, i, t.block_q), 1, 3)
      delta_t = jnp.moveaxis(_seq_tile(delta, i, t.block_q), 1, 3)
      s = _scores_log2(
        spec, q_tile, k_tile, i * t.block_q + jnp.arange(t.block_q), kv_pos
      )
      p = jnp.exp2(s - lse2_t[..., None])
      dv = dv + jnp.einsum(
        "bhgqk,bqhgd->bkhd",
        p.astype(spec.dtype),
        do_tile,
        preferred_element_type=jnp.float32,
        precision=_HIGHEST,
      )
      dp = jnp.einsum(
        "bqhgd,bkhd->bhgqk",
        do_tile,
        v_tile,
        preferred_element_type=jnp.float32,
        precision=_HIGHEST,
      )
      ds = (p * (dp - delta_t[..., None])).astype(spec.dtype)
      dk = dk + jnp.einsum(
        "bhgqk,bqhgd->bkhd",
        ds,
        q_tile,
        preferred_element_type=jnp.float32,
        precision=_HIGHEST,
      )
      dq_tile = jnp.einsum(
        "bhgqk,bkhd->bqhgd",
        ds,
        k_tile,
        preferred_element_type=jnp.float32,
        precision=_HIGHEST,
      )
      start = i * t.block_q
      dq_acc = jax.lax.dynamic_update_slice_in_dim(
        dq_acc, _seq_tile(dq_acc, i, t.block_q) + dq_tile, start, axis=1
      )
      return dq_acc, dk, dv

    init = (dq_acc,) + _varying_like(
      (
        jnp.zeros((spec.batch, t.block_kv, hk, spec.head_dim), jnp.float32),
        jnp.zeros((spec.batch, t.block_kv, hk, spec.head_dim_v), jnp.float32),
      ),
      q,
      k,
      v,
      dout,
    )
    first = masking.first_q_block_visible(
      spec, jk * t.block_kv, t.block_q, t.num_q
    )
    dq_acc, dk, dv = jax.lax.fori_loop(first, t.num_q, q_step, init)
    return dq_acc, (dk, dv)

  dq0 = _varying_like(
    jnp.zeros((spec.batch, sq_pad, hk, g, spec.head_dim), jnp.float32),
    q,
    k,
    v,
    dout,
  )
  dq_acc, (dks, dvs) = jax.lax.scan(kv_tile_fn, dq0, jnp.arange(t.num_kv))
  scale = jnp.float32(spec.softmax_scale)
  dq = (dq_acc[:, : spec.seq_q] * scale).reshape(q.shape)
  # dks: [nkv, b, bkv, hk, d] -> [b, nkv * bkv, hk, d].
  untile = lambda x: jnp.moveaxis(x, 0, 1).reshape(
    (spec.batch, skv_pad) + x.shape[3:]
  )[:, : spec.seq_kv]
  dk, dv = untile(dks) * scale, untile(dvs)
  return dq.astype(spec.dtype), dk.astype(spec.dtype), dv.astype(spec.dtype)


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
  return None


def _fp8_forward(
  spec: AttentionSpec, config: BlockwiseConfig, x: Any
) -> tuple[jax.Array, jax.Array]:
  return blockwise_fp8.blockwise_forward_fp8(
    spec, config.block_q, config.block_kv, *x
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
