"""The methods of the FA3 paper's FP8 error test (its Table 3), and its
tables: the outlier inputs, the metric (RMSE against float64 attention of
the same float16 inputs), the methods (baseline FP16, flash FP16, baseline
FP8 per-tensor, ours FP8 and its ablations, ours FP8 + Q residual) with the
paper's figures in `PAPER_RMSE`, and each FP8 error source alone:
docs/numerics.md#fp8.

Example:
  >>> import jax
  >>> from pallas_fa3.tools.numerics import fp8_methods
  >>> r = fp8_methods.error_table(jax.random.key(0), 1, 128, 1, 64,
  ...                             methods=("flash FP16", "ours FP8"))
  >>> sorted(r), r["flash FP16"] < r["ours FP8"] < 0.05
  (['flash FP16', 'ours FP8'], True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3 import fp8
from pallas_fa3.attention import flash_attention
from pallas_fa3.backends.blockwise import BlockwiseConfig
from pallas_fa3.kernels.sm90.config_fp8 import default_fp8_forward_config
from pallas_fa3.quant.e4m3 import scale_of
from pallas_fa3.reference import reference_attention
from pallas_fa3.tools.numerics import inputs, lowprec, metrics

# FA3 paper (arXiv 2407.08608) Table 3, RMSE against FP64.
PAPER_RMSE = {
  "baseline FP16": 3.2e-4,
  "flash FP16": 1.9e-4,
  "baseline FP8 per-tensor": 2.4e-2,
  "ours FP8": 9.1e-3,
  "ours FP8 w/o block quantization": 9.3e-3,
  "ours FP8 w/o rotation": 2.4e-2,
}
# Beyond the paper: Q carried as two e4m3 terms (`FP8Config(q_residual=True)`).
Q_RESIDUAL = "ours FP8 + Q residual"
METHODS: tuple[str, ...] = (*PAPER_RMSE, Q_RESIDUAL)
# Materialized (never tiled): one implementation each.
BASELINES = ("baseline FP16", "baseline FP8 per-tensor")
# The FP8Config switches (block_quantization, rotation, q_residual) of each
# FP8 row.
FP8_SWITCHES = {
  "ours FP8": (True, True, False),
  "ours FP8 w/o block quantization": (False, True, False),
  "ours FP8 w/o rotation": (True, False, False),
  Q_RESIDUAL: (True, True, True),
}
_F32 = jnp.float32


def outlier_inputs(
  key: jax.Array, batch: int, seq: int, heads: int, head_dim: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(q, k, v) float16 `[batch, seq, heads, head_dim]` from the paper's mix."""
  out = []
  for sub in jax.random.split(key, 3):
    kn, ko, kb = jax.random.split(sub, 3)
    shape = (batch, seq, heads, head_dim)
    x = jax.random.normal(kn, shape) + inputs.OUTLIER_STD * jax.random.normal(
      ko, shape
    ) * jax.random.bernoulli(kb, inputs.OUTLIER_PROB, shape)
    out.append(x.astype(jnp.float16))
  return tuple(out)


def default_tiles(head_dim: int) -> tuple[int, int]:
  """(block_q, block_kv): the FP8 kernel's default tiles (the twin's too)."""
  config = default_fp8_forward_config(head_dim)
  return config.block_q, config.block_kv


@jax.jit
def baseline_fp8_per_tensor(q, k, v) -> jax.Array:
  """Materialized FP8 attention with per-tensor scales (see the module doc)."""
  d = q.shape[-1]
  q8, qs = fp8.quantize_tiles(q, q.shape[1], per_tensor=True, pow2=False)
  k8, ks = fp8.quantize_tiles(k, k.shape[1], per_tensor=True, pow2=False)
  v8, vs = fp8.quantize_tiles(v, v.shape[1], per_tensor=True, pow2=False)
  f32 = lambda x: x.astype(_F32)
  s = jnp.einsum(
    "bqhd,bkhd->bhqk", f32(q8), f32(k8), precision=jax.lax.Precision.HIGHEST
  )
  s = s * (qs[:, :, :, None] * ks[:, :, :, None]) / np.float32(np.sqrt(d))
  p = jax.nn.softmax(f32(s.astype(jnp.float16)), axis=-1).astype(jnp.float16)
  # P per-tensor: one scale for the whole [b, h, q, k] tensor.
  p_scale = scale_of(jnp.max(f32(p)))
  p8 = jnp.clip(f32(p) / p_scale, -fp8.E4M3_MAX, fp8.E4M3_MAX).astype(
    fp8.FP8_DTYPE
  )
  o = jnp.einsum(
    "bhqk,bkhd->bqhd", f32(p8), f32(v8), precision=jax.lax.Precision.HIGHEST
  )
  return o * (p_scale * vs[:, :, 0][:, None, :, None])


def fp8_config(method: str, key: Any = 0) -> fp8.FP8Config | None:
  """The `FP8Config` of an FP8 row (None for the other methods)."""
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}; got {method!r}")
  if method not in FP8_SWITCHES:
    return None
  block_quantization, rotation, q_residual = FP8_SWITCHES[method]
  return fp8.FP8Config(
    block_quantization=block_quantization,
    rotation=rotation,
    key=key,
    q_residual=q_residual,
  )


def run_method(
  method: str,
  q,
  k,
  v,
  key: Any = 0,
  implementation: str = "blockwise",
  tiles: tuple[int, int] | None = None,
) -> jax.Array:
  """The attention output of one method (non-causal).

  Args:
    method: one of `METHODS`.
    q, k, v: `[batch, seq, heads, head_dim]` float16.
    key: the rotation's key of the FP8 rows (an int seed or a JAX key).
    implementation: backend of the flash rows (the baselines are
      materialized and ignore it).
    tiles: (block_q, block_kv) of the blockwise FP8 rows; None: the FP8
      kernel's default tiles for the head dim (as `flash_attention` picks).
  """
  config = fp8_config(method, key)
  if method == "baseline FP16":
    return reference_attention(q, k, v, intermediate_dtype=jnp.float16)
  if method == "baseline FP8 per-tensor":
    return baseline_fp8_per_tensor(q, k, v)
  if config is None:  # flash FP16
    return flash_attention(q, k, v, implementation=implementation)
  tiling = (
    BlockwiseConfig(*tiles)
    if tiles is not None and implementation == "blockwise"
    else None
  )
  return flash_attention(
    q, k, v, implementation=implementation, config=tiling, fp8=config
  )


def draw(
  key: jax.Array, batch: int, seq: int, heads: int, head_dim: int
) -> tuple[jax.Array, jax.Array, jax.Array, np.ndarray, jax.Array]:
  """(q, k, v, float64 golden, rotation key) of one input draw from `key`."""
  k_in, k_rot = jax.random.split(key)
  q, k, v = outlier_inputs(k_in, batch, seq, heads, head_dim)
  return q, k, v, lowprec.golden(q, k, v), k_rot


def error_table(
  key: jax.Array,
  batch: int,
  seq: int,
  heads: int,
  head_dim: int,
  methods: Sequence[str] = METHODS,
) -> dict[str, float]:
  """RMSE against float64 for each method (blockwise flash), one input draw."""
  q, k, v, golden, k_rot = draw(key, batch, seq, heads, head_dim)
  return {
    m: metrics.rmse(run_method(m, q, k, v, k_rot), golden) for m in methods
  }


def error_sources(
  key: jax.Array,
  batch: int,
  seq: int,
  heads: int,
  head_dim: int,
  tiles: tuple[int, int] | None = None,
) -> dict[str, float]:
  """`source_errors` of the input draw `error_table` makes from `key`."""
  return source_errors(*draw(key, batch, seq, heads, head_dim), tiles=tiles)


def source_errors(
  q, k, v, golden: np.ndarray, key: Any, tiles: tuple[int, int] | None = None
) -> dict[str, float]:
  """RMSE of "ours FP8" with one error source at a time (float64 otherwise).

  Materialized attention where only Q and K are rotated (signs from `key`)
  and block-quantized to e4m3 (with and without the rotation), only V is,
  or only P is rounded to e4m3 (2^8 offset, global row max): what limits
  the FP8 error. `tiles` as in `run_method`.
  """
  batch, _, heads, head_dim = q.shape
  block_q, block_kv = tiles or default_tiles(head_dim)
  f64 = lambda x: np.asarray(x, np.float64)
  through_e4m3 = lambda x, rows: f64(
    fp8.dequantize_tiles(*fp8.quantize_tiles(x, rows), rows)
  )
  signs = fp8.rotation_signs(fp8.FP8Config(key=key).prng_key(), head_dim)

  def qk(rotation: bool):
    qq, kk = (
      (fp8.rotate(q, signs), fp8.rotate(k, signs)) if rotation else (q, k)
    )
    return through_e4m3(qq, block_q), through_e4m3(kk, block_kv)

  v8 = through_e4m3(v, block_kv)
  out = {}
  for name, (qq, kk, vv, p_fp8) in {
    "Q, K quantized (rotated)": qk(True) + (f64(v), False),
    "Q, K quantized (not rotated)": qk(False) + (f64(v), False),
    "V quantized": (f64(q), f64(k), v8, False),
    "P in e4m3": (f64(q), f64(k), f64(v), True),
  }.items():
    o = np.empty_like(golden)
    for bi in range(batch):
      for hi in range(heads):
        s = (qq[bi, :, hi] @ kk[bi, :, hi].T) / np.sqrt(head_dim)
        p = np.exp2((s - s.max(axis=-1, keepdims=True)) / np.log(2) + 8.0)
        l = p.sum(axis=-1, keepdims=True)
        if p_fp8:
          p = f64(jnp.asarray(p, _F32).astype(fp8.FP8_DTYPE))
        o[bi, :, hi] = (p @ vv[bi, :, hi]) / l
    out[name] = metrics.rmse(o, golden)
  return out
