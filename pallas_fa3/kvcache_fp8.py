"""An e4m3 KV cache: its descales, quantizing a cache and new tokens into
it, and the optional rotation of K (incoherent processing for the cache).

FlashAttention-3's convention: `k_cache` / `v_cache` of dtype
`float8_e4m3fn` hold `K / k_descale` and `V / v_descale`, with float32
descales `[batch, heads_kv]` (one per sequence and KV head; a scalar is
broadcast). The attention dequantizes, so it computes attention over
`k_cache * k_descale`, `v_cache * v_descale` (the "dequantized cache").
Appended bf16/fp16 tokens are divided by the descales, saturated at
e4m3's largest value 448 and rounded to nearest into the cache.

Beyond FA3 (opt-in): `rotation=` stores K times the orthogonal
`M = D H / sqrt(d)` of the FP8 forward (`pallas_fa3.fp8`, D from a PRNG
key); the call rotates q the same way (`cache_rotation=`), which leaves
every score `(q M)(K M)^T = q K^T` unchanged in exact arithmetic and
spreads K's outlier features before quantization.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3.fp8_config import FP8Config
from pallas_fa3.quant import hadamard
from pallas_fa3.quant.e4m3 import E4M3_MAX, FP8_DTYPE, scale_of


class FP8KVCache(NamedTuple):
  """`quantize_kv_cache`'s result: the e4m3 caches and their descales."""

  k_cache: jax.Array  # float8_e4m3fn, the input's layout (K rotated if asked)
  v_cache: jax.Array | None  # float8_e4m3fn (None: MLA's one cache)
  k_descale: jax.Array  # float32 [batch, heads_kv]
  v_descale: jax.Array | None  # float32 [batch, heads_kv]


def is_fp8(dtype: Any) -> bool:
  return jnp.dtype(dtype) == FP8_DTYPE


def rotation_signs(rotation: Any, head_dim: int) -> jax.Array | None:
  """The +-1 diagonal of the cache's rotation (float32 `[head_dim]`), or None.

  `rotation`: None/False (none), True (the FP8 forward's default key 0), an
  int seed or a concrete JAX PRNG key (as `FP8Config.key`).
  """
  if rotation is None or rotation is False:
    return None
  key = FP8Config(key=0 if rotation is True else rotation).prng_key()
  return hadamard.rotation_signs(key, head_dim)


def rotate(x: jax.Array, signs: jax.Array | None) -> jax.Array:
  """`x @ D H / sqrt(d)` along the last axis in float32 (x itself without
  signs)."""
  return x if signs is None else hadamard.rotate(x, signs)


def check_descale(
  name: str, x: Any, fp8: bool, batch: int, heads_kv: int
) -> jax.Array | None:
  """A descale as float32 `[batch, heads_kv]` (ones when an e4m3 cache has
  none; None for a 16-bit cache, which takes none).

  Raises:
    ValueError / TypeError naming the argument: a descale for a 16-bit
    cache, a shape other than a scalar or `[batch, heads_kv]`, a non-float
    dtype, or a concrete value that is not positive and finite.
  """
  if x is None:
    return jnp.ones((batch, heads_kv), jnp.float32) if fp8 else None
  if not fp8:
    raise ValueError(
      f"{name} applies to an e4m3 (float8_e4m3fn) cache only; this cache"
      " is 16-bit: pass None"
    )
  shape = tuple(getattr(x, "shape", ()))
  if shape not in ((), (batch, heads_kv)):
    raise ValueError(
      f"{name} must be a scalar or float32 [batch, heads_kv] ="
      f" ({batch}, {heads_kv}); got shape {shape}"
    )
  dtype = jnp.result_type(x)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{name} must be float32; got {dtype}")
  if not isinstance(x, jax.core.Tracer):  # (numpy: also inside a trace)
    value = np.asarray(x, np.float32)
    if not np.all(np.isfinite(value) & (value > 0)):
      raise ValueError(f"{name} must be positive and finite; got {value}")
  return jnp.broadcast_to(jnp.asarray(x, jnp.float32), (batch, heads_kv))


def quantize_tokens(x: jax.Array, descale: jax.Array) -> jax.Array:
  """`x / descale` in e4m3 (saturated at +-448, rounded to nearest):
  x `[batch, n, heads_kv, d]`, descale float32 `[batch, heads_kv]`."""
  y = x.astype(jnp.float32) / descale[:, None, :, None]
  return jnp.clip(y, -E4M3_MAX, E4M3_MAX).astype(FP8_DTYPE)


def dequantize(x8: jax.Array, descale: jax.Array) -> jax.Array:
  """float32 `x8 * descale` for per-sequence `[batch, n, heads_kv, d]`."""
  return x8.astype(jnp.float32) * descale[:, None, :, None]


def _amax(x: jax.Array, n: jax.Array | None) -> jax.Array:
  """`[rows, heads]` amax of `[rows, tokens, heads, d]` over tokens < n."""
  x = jnp.abs(x.astype(jnp.float32))
  if n is not None:
    live = jnp.arange(x.shape[1])[None, :] < n[:, None]
    x = jnp.where(live[:, :, None, None], x, 0.0)
  return jnp.max(x, axis=(1, 3))


def quantize_kv_cache(
  k_cache: jax.Array,
  v_cache: jax.Array | None,
  *,
  page_table: jax.Array | None = None,
  cache_seqlens: Any = None,
  rotation: Any = None,
) -> FP8KVCache:
  """A bf16/fp16/fp32 KV cache in e4m3 with FA3's per-(sequence, KV head)
  descales: `amax / 448` of the sequence's tokens, so nothing saturates.

  Args:
    k_cache, v_cache: contiguous `[batch, cache_len, heads_kv, d(_v)]` or,
      with `page_table`, paged `[num_pages, page_size, heads_kv, d(_v)]`.
      v_cache None: DeepSeek MLA's one cache (V its first columns, read
      with `k_descale`); v_cache and v_descale come back None.
    page_table: int32 `[batch, pages_per_seq]` for a paged cache. Pages
      may be shared between sequences, so a paged cache gets one descale
      per KV head (the amax over every sequence), repeated over the batch.
    cache_seqlens: None (every slot counts) or int32 `[batch]`: only each
      sequence's first `cache_seqlens[b]` tokens set its descale (the rest
      may be garbage, NaN included; it is quantized all the same).
    rotation: None, True, an int seed or a PRNG key: store K rotated (see
      the module docstring); pass the same value as `cache_rotation=` to
      `flash_attention_with_kvcache`.

  Returns:
    `FP8KVCache(k_cache, v_cache, k_descale, v_descale)` (v_cache and
    v_descale None without a v_cache). With a contiguous
    cache read through `cache_batch_idx`, the descales are per cache row:
    pass `k_descale[cache_batch_idx]`.
  """
  named = (("k_cache", k_cache),) + (
    () if v_cache is None else (("v_cache", v_cache),)
  )
  for name, x in named:
    if getattr(x, "ndim", None) != 4:
      raise ValueError(
        f"{name} must be a rank-4 cache array; got shape"
        f" {tuple(getattr(x, 'shape', ()))}"
      )
    if not jnp.issubdtype(x.dtype, jnp.floating) or is_fp8(x.dtype):
      raise TypeError(f"{name} must be float16/bfloat16/float32; got {x.dtype}")
  if v_cache is not None and k_cache.shape[:3] != v_cache.shape[:3]:
    raise ValueError(
      "k_cache and v_cache must agree on every axis but head_dim; got"
      f" {k_cache.shape} and {v_cache.shape}"
    )
  if v_cache is None and rotation is not None and rotation is not False:
    raise ValueError(
      "rotation cannot be combined with v_cache=None: V is the K cache's"
      " columns, and a rotated K cache holds rotated values"
    )
  signs = rotation_signs(rotation, k_cache.shape[3])
  caches = [rotate(k_cache, signs)] + ([] if v_cache is None else [v_cache])
  n = None if cache_seqlens is None else jnp.asarray(cache_seqlens, jnp.int32)
  batch = caches[0].shape[0]
  if page_table is None:
    if n is not None and n.shape != (batch,):
      raise ValueError(
        f"cache_seqlens must have shape [batch] = ({batch},); got {n.shape}"
      )
    descales = [scale_of(_amax(c, n)) for c in caches]
    rows = jnp.arange(batch)
  else:
    pt = jnp.asarray(page_table, jnp.int32)
    if pt.ndim != 2:
      raise ValueError(
        f"page_table must be [batch, pages_per_seq]; got shape {pt.shape}"
      )
    seq = lambda c: c[pt].reshape((pt.shape[0], -1) + c.shape[2:])
    per_head = lambda a: jnp.broadcast_to(a.max(0), a.shape)
    descales = [scale_of(per_head(_amax(seq(c), n))) for c in caches]
    rows = jnp.zeros((batch,), jnp.int32)  # every page: the head's
  for (name, _), d in zip(named, descales):
    if not isinstance(d, jax.core.Tracer) and not np.all(np.isfinite(d)):
      raise ValueError(
        f"{name} holds non-finite values among the tokens that set the"
        " descales; pass cache_seqlens to leave out the slots past each"
        " sequence's tokens"
      )
  out = [quantize_tokens(c, d[rows]) for c, d in zip(caches, descales)]
  if v_cache is None:
    return FP8KVCache(out[0], None, descales[0], None)
  return FP8KVCache(out[0], out[1], descales[0], descales[1])
