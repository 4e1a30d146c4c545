"""Study-only attention with every intermediate in a chosen format, and the
golden: what the production code deliberately lacks, `baseline` (mode
"all": materialized, every intermediate in F; mode "kernel": float32 S and
softmax, P rounded to F), `flash_all` (FlashAttention-2 with the running
max, row sum and accumulator in F; optional `stable_max`) and `golden`
(float64 numpy attention); layout `[batch, seq, heads, head_dim]`, one kv
head per query head, non-causal:
docs/numerics.md#inputs-and-the-study-only-attention.

Example:
  >>> import jax.numpy as jnp, numpy as np
  >>> from pallas_fa3.tools.numerics import lowprec
  >>> q = k = v = jnp.asarray(np.random.default_rng(0).standard_normal(
  ...     (1, 96, 2, 16)), jnp.bfloat16)
  >>> out = lowprec.flash_all(q, k, v, block_q=32, block_kv=64)
  >>> gold = lowprec.golden(q, k, v)
  >>> out.dtype, bool(abs(np.asarray(out, np.float64) - gold).max() < 0.1)
  (dtype(bfloat16), True)
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3 import stable_max as stable_max_lib
from pallas_fa3.spec import HIGHEST

Mode = Literal["all", "kernel"]
MODES: tuple[str, ...] = ("all", "kernel")
ALGORITHMS: tuple[str, ...] = ("fa2", "fa1")
_F32 = jnp.float32


def _scale(head_dim: int, softmax_scale: float | None) -> float:
  return 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale


def _heads_first(x: jax.Array) -> jax.Array:
  return jnp.swapaxes(x, 1, 2)  # [b, s, h, d] <-> [b, h, s, d]


def _mm(eq: str, a, b) -> jax.Array:
  """A float32-accumulating matmul (result float32, not yet rounded)."""
  return jnp.einsum(eq, a, b, preferred_element_type=_F32, precision=HIGHEST)


@functools.partial(jax.jit, static_argnames=("mode", "softmax_scale"))
def baseline(q, k, v, *, mode: str = "all", softmax_scale=None) -> jax.Array:
  """Materialized baseline attention in the inputs' format; `[b, s, h, dv]`.

  Args:
    q, k, v: `[batch, seq, heads, head_dim]` in the format F under study.
    mode: "all" (every intermediate rounded to F) or "kernel" (float32
      scores and softmax, P rounded to F, float32 P V).
    softmax_scale: default `1/sqrt(head_dim)`.
  """
  dt = q.dtype
  r = (lambda x: x.astype(dt)) if mode == "all" else (lambda x: x)
  scale = _scale(q.shape[-1], softmax_scale)
  qh, kh, vh = (_heads_first(x) for x in (q, k, v))
  s = r(_mm("bhqd,bhkd->bhqk", qh, kh)) * jnp.asarray(
    scale, dt if mode == "all" else _F32
  )
  m = s.max(axis=-1, keepdims=True)
  e = r(jnp.exp(r(s - m)))
  l = r(e.astype(_F32).sum(axis=-1, keepdims=True))
  p = (e / l).astype(dt)  # P in F in both modes
  o = _mm("bhqk,bhkd->bhqd", p, vh).astype(dt)
  return _heads_first(o)


def _pad_seq(x: jax.Array, multiple: int) -> jax.Array:
  pad = -x.shape[2] % multiple
  return jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) if pad else x


@functools.partial(
  jax.jit,
  static_argnames=(
    "block_q",
    "block_kv",
    "softmax_scale",
    "stable_max",
    "algorithm",
  ),
)
def flash_all(
  q,
  k,
  v,
  *,
  block_q: int = 64,
  block_kv: int = 64,
  softmax_scale=None,
  stable_max: stable_max_lib.StableMax | None = None,
  algorithm: str = "fa2",
) -> jax.Array:
  """FlashAttention forward with every intermediate in the inputs' format F.

  FlashAttention-2 (`algorithm="fa2"`), per kv tile j (natural exp, as in
  the FlashAttention papers): `S = R(R(Q K_j^T) * scale)`,
  `m' = max(m, rowmax S)` (exact), `alpha = R(exp(R(m - m')))`,
  `P = R(exp(R(S - m')))`, `l = R(R(alpha l) + R(rowsum P))`,
  `acc = R(R(alpha acc) + R(P V_j))`; finally `out = R(acc / l)`, where R
  rounds to F. FlashAttention-1 (`"fa1"`, its Algorithm 1) exponentiates
  each tile against its own max m_t and keeps the output normalized after
  every tile: `P = R(exp(R(S - m_t)))`, `a = R(exp(R(m - m')))`,
  `b = R(exp(R(m_t - m')))`, `l' = R(R(a l) + R(b rowsum P))`,
  `O = R(R(R(R(a l) O) + R(b R(P V_j))) / l')`: more roundings per tile.
  Tiles larger than the sequence are clamped to it.

  Args:
    q, k, v: `[batch, seq, heads, head_dim]` in F.
    block_q: Br, query rows per tile.
    block_kv: Bc, key columns per tile.
    softmax_scale: default `1/sqrt(head_dim)`.
    stable_max: apply the repeated-max fix to each tile's max (fa2 only).
    algorithm: "fa2" (normalize at the end) or "fa1" (after every tile).

  Returns:
    out `[batch, seq_q, heads, head_dim_v]` in F.
  """
  if algorithm not in ALGORITHMS or (algorithm == "fa1" and stable_max):
    raise ValueError(
      f"algorithm must be one of {ALGORITHMS} (stable_max"
      f" with fa2 only); got {algorithm!r}"
    )
  dt = q.dtype
  r = lambda x: x.astype(dt)
  scale = jnp.asarray(_scale(q.shape[-1], softmax_scale), dt)
  b, sq, h, _ = q.shape
  skv, dv = k.shape[1], v.shape[-1]
  bq, bkv = min(block_q, sq), min(block_kv, skv)
  qh = _pad_seq(_heads_first(q), bq)
  kh, vh = _pad_seq(_heads_first(k), bkv), _pad_seq(_heads_first(v), bkv)
  nq, nkv = qh.shape[2] // bq, kh.shape[2] // bkv
  max_shift = stable_max_lib.max_shift_log2(dt) * math.log(2.0)

  def q_tile(iq):
    q_t = jax.lax.dynamic_slice_in_dim(qh, iq * bq, bq, axis=2)

    def kv_step(carry, j):
      if algorithm == "fa1":
        return fa1_step(carry, j)
      m, l, acc = carry
      k_t = jax.lax.dynamic_slice_in_dim(kh, j * bkv, bkv, axis=2)
      v_t = jax.lax.dynamic_slice_in_dim(vh, j * bkv, bkv, axis=2)
      s = r(r(_mm("bhqd,bhkd->bhqk", q_t, k_t)) * scale)
      s = jnp.where(j * bkv + jnp.arange(bkv) < skv, s, -jnp.inf)
      tile_m = (
        s.max(axis=-1)
        if stable_max is None
        else stable_max_lib.tile_max(
          s, stable_max, unit=1.0, max_shift=max_shift
        )
      )
      m_new = jnp.maximum(m, tile_m)
      m_ref = jnp.where(m_new == -jnp.inf, jnp.zeros_like(m_new), m_new)
      alpha = r(jnp.exp(r(m - m_ref)))
      p = r(jnp.exp(r(s - m_ref[..., None])))
      l = r(r(alpha * l) + r(p.astype(_F32).sum(axis=-1)))
      acc = r(r(alpha[..., None] * acc) + r(_mm("bhqk,bhkd->bhqd", p, v_t)))
      return (m_new, l, acc), None

    def fa1_step(carry, j):
      m, l, out = carry
      k_t = jax.lax.dynamic_slice_in_dim(kh, j * bkv, bkv, axis=2)
      v_t = jax.lax.dynamic_slice_in_dim(vh, j * bkv, bkv, axis=2)
      s = r(r(_mm("bhqd,bhkd->bhqk", q_t, k_t)) * scale)
      s = jnp.where(j * bkv + jnp.arange(bkv) < skv, s, -jnp.inf)
      m_t = s.max(axis=-1)
      p = r(jnp.exp(r(s - m_t[..., None])))
      l_t = r(p.astype(_F32).sum(axis=-1))
      m_new = jnp.maximum(m, m_t)
      a = r(jnp.exp(r(m - m_new)))
      b_ = r(jnp.exp(r(m_t - m_new)))
      l_new = r(r(a * l) + r(b_ * l_t))
      kept = r(r(a * l)[..., None] * out)
      fresh = r(b_[..., None] * r(_mm("bhqk,bhkd->bhqd", p, v_t)))
      out = r(r(kept + fresh) / l_new[..., None])
      return (m_new, l_new, out), None

    init = (
      jnp.full((b, h, bq), -jnp.inf, dt),
      jnp.zeros((b, h, bq), dt),
      jnp.zeros((b, h, bq, dv), dt),
    )
    (_, l, acc), _ = jax.lax.scan(kv_step, init, jnp.arange(nkv))
    if algorithm == "fa1":
      return acc  # already normalized
    return r(acc / jnp.where(l == 0, jnp.ones_like(l), l)[..., None])

  tiles = jax.lax.map(q_tile, jnp.arange(nq))  # [nq, b, h, bq, dv]
  out = jnp.moveaxis(tiles, 0, 2).reshape(b, h, nq * bq, dv)[:, :, :sq]
  return _heads_first(out)


# Query rows per float64 block of the golden: bounds its memory to
# _GOLDEN_ROWS x seq_kv x 8 bytes per head (128 MiB at seq_kv = 16k).
_GOLDEN_ROWS = 1024


def golden(q, k, v, *, softmax_scale=None) -> np.ndarray:
  """Float64 attention of the given values (numpy); `[b, s, h, dv]` float64.

  The same function as `pallas_fa3.reference.golden_attention` (non-causal,
  MHA), written with batched matmuls over blocks of query rows so that long
  sequences stay fast and within memory.
  """
  f64 = lambda x: np.swapaxes(np.asarray(x).astype(np.float64), 1, 2)
  qh, kh, vh = f64(q), f64(k), f64(v)
  scale = _scale(qh.shape[-1], softmax_scale)
  kt = np.swapaxes(kh, -1, -2)
  out = np.empty(qh.shape[:-1] + (vh.shape[-1],))
  for start in range(0, qh.shape[2], _GOLDEN_ROWS):
    rows = slice(start, start + _GOLDEN_ROWS)
    s = (qh[:, :, rows] @ kt) * scale
    s -= s.max(axis=-1, keepdims=True)
    e = np.exp(s, out=s)
    e /= e.sum(axis=-1, keepdims=True)
    out[:, :, rows] = e @ vh
  return np.swapaxes(out, 1, 2)
