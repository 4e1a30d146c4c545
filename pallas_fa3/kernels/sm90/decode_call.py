"""The Hopper decode kernel's call: GQA rows packed for it, the kernel
(`decode.build_decode`), its split partials merged and the rows unpacked.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_fa3.decode_combine import combine_splits
from pallas_fa3.kernels.sm90 import decode_fp8
from pallas_fa3.kernels.sm90.common import pad_axis
from pallas_fa3.kernels.sm90.config_decode import DECODE_ROWS, Sm90DecodeConfig
from pallas_fa3.kernels.sm90.decode import DecodePlan, build_decode
from pallas_fa3.kernels.sm90.ops import COMPILED, INTERPRETED
from pallas_fa3.kvcache_spec import DecodeSpec


def pack_queries(spec: DecodeSpec, q: jax.Array) -> jax.Array:
  """`[b, sq, hq, d]` -> `[b, hk, 64, d]`: row `i * g + h` is query i of
  head `kv_head * g + h`; padded rows are zeros."""
  b, sq, hk, g = spec.batch, spec.seq_q, spec.heads_kv, spec.group_size
  rows = q.reshape(b, sq, hk, g, spec.head_dim).transpose(0, 2, 1, 3, 4)
  return pad_axis(rows.reshape(b, hk, sq * g, spec.head_dim), 2, DECODE_ROWS)


def unpack_rows(spec: DecodeSpec, x: jax.Array) -> jax.Array:
  """`[b, hk, 64, ...]` -> `[b, sq, hq, ...]` (the inverse of
  `pack_queries` on the first `sq * g` rows)."""
  b, sq, hk, g = spec.batch, spec.seq_q, spec.heads_kv, spec.group_size
  x = x[:, :, : sq * g].reshape((b, hk, sq, g) + x.shape[3:])
  return jnp.moveaxis(x, 2, 1).reshape((b, sq, spec.heads_q) + x.shape[4:])


def sm90_decode(
  spec: DecodeSpec,
  config: Sm90DecodeConfig,
  splits: int,
  q: jax.Array,
  k_cache: jax.Array,
  v_cache: jax.Array,
  lengths: jax.Array,
  rows: jax.Array,
  page_table: jax.Array | None,
  sinks: jax.Array | None,
  descale: tuple[jax.Array, jax.Array] | None = None,
  *,
  interpret: Any = None,
) -> tuple[jax.Array, jax.Array]:
  """Runs the decode kernel and merges its splits.

  Args: as `backends.decode.DecodeBackend.run` (lengths: each sequence's
    keys, appended tokens included; rows: the contiguous cache rows;
    sinks: float32 `[b, hq]` or None; descale: an e4m3 cache's
    `(k_descale, v_descale)`, float32 `[b, hk]`); `interpret`: None compiles for
    sm90, interpret-mode parameters run the same kernel on a CPU.

  Returns:
    (out `[b, sq, hq, dv]` in q's dtype, lse `[b, hq, sq]` float32).
  """
  plan = DecodePlan(spec, config, splits)
  ops = COMPILED if interpret is None else INTERPRETED
  pages = (
    jnp.zeros((spec.batch, 1), jnp.int32) if page_table is None else page_table
  )
  q_rows, extra = pack_queries(spec, q), ()
  if plan.fp8:  # Q in float16; its scale folds into k_descale
    q_rows, q_scale = decode_fp8.converted_q(q_rows)
    extra = (descale[0] * q_scale, descale[1])
  o_parts, lse_parts = build_decode(plan, ops, interpret)(
    q_rows,
    k_cache,
    v_cache,
    lengths.astype(jnp.int32),
    rows.astype(jnp.int32),
    pages.astype(jnp.int32),
    *extra,
  )
  sink = None
  if sinks is not None:  # per packed row: head kv_head * g + r % g
    g = spec.group_size
    per_head = sinks.reshape(spec.batch, spec.heads_kv, 1, g)
    sink = jnp.broadcast_to(
      per_head, (spec.batch, spec.heads_kv, spec.seq_q, g)
    ).reshape(spec.batch, spec.heads_kv, spec.seq_q * g)
    sink = pad_axis(sink, 2, DECODE_ROWS)
  out, lse = combine_splits(o_parts, lse_parts, sink)
  out = unpack_rows(spec, out).astype(spec.dtype)
  lse = jnp.moveaxis(unpack_rows(spec, lse[..., None])[..., 0], 1, 2)
  return out, lse
