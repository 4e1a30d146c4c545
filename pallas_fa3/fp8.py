"""FP8 (e4m3) attention forward: the API behind `flash_attention(q, k, v,
fp8=True | FP8Config(...))`. `quantize(q, k, v, block_q=, block_kv=)` ->
`FP8Inputs` (FA3's block quantization and incoherent processing, optionally
Q's residual: the Pallas kernel `kernels/sm90/quantize.py` on Hopper, its
bit-identical pure-JAX twin `pallas_fa3.quant.e4m3.quantize_inputs`
elsewhere), `flash_attention_fp8(q8, k8, v8_t, q_scale, k_scale, v_scale,
...)` for callers that keep activations in FP8 (backends `mosaic`,
`interpret` and the `blockwise` twin, chosen like any call; forward only),
and `FP8Config`: docs/fp8.md#what-it-computes.

Example:
  >>> import jax, pallas_fa3
  >>> q = jax.random.normal(jax.random.key(0), (1, 256, 4, 128), "bfloat16")
  >>> kv = jax.random.normal(jax.random.key(1), (1, 256, 2, 128), "bfloat16")
  >>> out = pallas_fa3.flash_attention(q, kv, kv, causal=True, fp8=True,
  ...                                  implementation="blockwise")
  >>> out.shape, out.dtype
  ((1, 256, 4, 128), dtype(bfloat16))
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_fa3 import backends, modifiers, segments, vjp
from pallas_fa3.backends import Implementation
from pallas_fa3.backends.base import Quantized, StaticCall
from pallas_fa3.parallel import sharding_checks
from pallas_fa3.quant import e4m3, hadamard
from pallas_fa3.quant.config import (
  FP8Config as FP8Config,
  check_fp8 as check_fp8,
)
from pallas_fa3.quant.e4m3 import FP8_DTYPE, FP8Inputs, quantize_inputs
from pallas_fa3.spec import cdiv, check_bool, check_int, make_spec

# Re-exported: the config and the quantization helpers are this module's API.
E4M3_MAX = e4m3.E4M3_MAX
dequantize_tiles = e4m3.dequantize_tiles
quantize_tiles = e4m3.quantize_tiles
hadamard_transform = hadamard.hadamard_transform
rotate = hadamard.rotate
rotation_signs = hadamard.rotation_signs

_OUT_DTYPES = tuple(jnp.dtype(d) for d in ("bfloat16", "float16", "float32"))


def quantize(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  block_q: int,
  block_kv: int,
  config: FP8Config | None = None,
  key: jax.Array | None = None,
  implementation: Implementation | None = None,
) -> FP8Inputs:
  """The quantization pass: bf16/fp16/fp32 Q, K, V -> `FP8Inputs` (jitted).

  Args:
    q: `[batch, seq_q, heads_q, head_dim]`.
    k: `[batch, seq_kv, heads_kv, head_dim]`.
    v: `[batch, seq_kv, heads_kv, head_dim]`.
    block_q, block_kv: the quantization tiles; they must be the tiles of the
      attention that consumes the result (the kernel config's block_q and
      block_kv, or the blockwise config's).
    config: block quantization / rotation switches and the rotation's key
      (default `FP8Config()`: both on, seed 0).
    key: a PRNG key (may be traced) that overrides `config.key`.
    implementation: whose pass runs it: "mosaic" (the Hopper quantization
      kernel, `kernels/sm90/quantize.py`), "interpret" (that kernel in
      interpret mode, which needs the XLA CPU pool of
      `backends.interpret_pool`), "blockwise"/"reference" (its pure-JAX
      twin, `pallas_fa3.quant.e4m3.quantize_inputs`, the same bits), or
      None: the kernel where a Hopper GPU is present, else the twin. The
      kernel serves bf16/fp16 inputs with per-tile scales; other calls take
      the twin (the same function).

  Returns:
    `FP8Inputs(q, k, v_t, q_scale, k_scale, v_scale)`.

  Raises:
    TypeError / ValueError: bad operands or tiles; the message names the
      argument.
  """
  config = FP8Config() if config is None else config
  if not isinstance(config, FP8Config):
    raise TypeError(f"config must be a pallas_fa3.FP8Config; got {config!r}")
  make_spec(q, k, v)  # shapes and dtypes, errors naming q, k or v
  if q.shape[-1] != v.shape[-1]:
    raise ValueError(
      f"v must have q's head_dim for FP8; got q.shape="
      f"{tuple(q.shape)}, v.shape={tuple(v.shape)}"
    )
  key = config.prng_key() if key is None else key
  if backends.check_implementation(implementation) is None:
    mosaic = backends.get("mosaic")
    run = mosaic.fp8_quantize if mosaic.device_reason() is None else None
  else:
    run = backends.get(implementation).fp8_quantize
  return (run or quantize_inputs)(
    jnp.asarray(q),
    jnp.asarray(k),
    jnp.asarray(v),
    key,
    block_q=check_int("block_q", block_q, minimum=1),
    block_kv=check_int("block_kv", block_kv, minimum=1),
    block_quantization=config.block_quantization,
    rotation=config.rotation,
    q_residual=config.q_residual,
  )


def _from_quantized(
  call: StaticCall, x: FP8Inputs, sinks: Any, segment_ids: Any
) -> tuple[jax.Array, jax.Array]:
  operands = sharding_checks.vary_alike(Quantized(x, sinks, segment_ids))
  return vjp.call(call, operands)  # forward only: its gradient raises


_quantized_jit = jax.jit(_from_quantized, static_argnums=0)


def _check_fp8_operand(name: str, x: Any, rank: int, layout: str) -> tuple:
  if not (hasattr(x, "shape") and hasattr(x, "dtype")):
    raise TypeError(f"{name} must be an array {layout}; got {type(x).__name__}")
  if jnp.dtype(x.dtype) != FP8_DTYPE:
    raise TypeError(
      f"{name} must have dtype float8_e4m3fn (from"
      f" pallas_fa3.fp8.quantize); got {x.dtype}"
    )
  if len(x.shape) != rank:
    raise ValueError(
      f"{name} must have rank {rank} {layout}; got shape {tuple(x.shape)}"
    )
  return tuple(int(s) for s in x.shape)


def _check_scale(
  name: str, x: Any, want: tuple, block_name: str, block: int
) -> None:
  if not (hasattr(x, "shape") and hasattr(x, "dtype")):
    raise TypeError(
      f"{name} must be a float32 array of shape {want}; got {type(x).__name__}"
    )
  if jnp.dtype(x.dtype) != jnp.float32:
    raise TypeError(f"{name} must have dtype float32; got {x.dtype}")
  if tuple(x.shape) != want:
    raise ValueError(
      f"{name} must have shape {want} (one scale per {block_name}={block}"
      f" rows: the tiles of the config that runs the call); got"
      f" {tuple(x.shape)}"
    )


def flash_attention_fp8(
  q8: jax.Array,
  k8: jax.Array,
  v8_t: jax.Array,
  q_scale: jax.Array,
  k_scale: jax.Array,
  v_scale: jax.Array,
  q_residual: jax.Array | None = None,
  *,
  causal: bool = False,
  softmax_scale: float | None = None,
  return_lse: bool = False,
  implementation: Implementation | None = None,
  config: Any = None,
  out_dtype: Any = jnp.bfloat16,
  window_size: tuple[int | None, int | None] | None = None,
  softcap: float | None = None,
  sinks: jax.Array | None = None,
  segment_ids: Any = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """FP8 attention forward on pre-quantized operands (`quantize`'s layout).

  Computes `softmax(scale * (q8 * q_scale) (k8 * k_scale)^T) (v8 * v_scale)`
  tile by tile, with P rounded to e4m3 (offset by 2^8) for the P V product,
  as the Hopper kernel does. If Q and K were rotated, the same rotation must
  have been applied to both (the scores are invariant under it).

  Args:
    q8: `[batch, seq_q, heads_q, head_dim]` float8_e4m3fn.
    k8: `[batch, seq_kv, heads_kv, head_dim]` float8_e4m3fn.
    v8_t: `[batch, heads_kv, head_dim, seq_kv]` float8_e4m3fn (V transposed).
    q_scale: `[batch, heads_q, ceil(seq_q / block_q)]` float32.
    k_scale, v_scale: `[batch, heads_kv, ceil(seq_kv / block_kv)]` float32,
      positive and finite.
    q_residual: None, or Q's rounding residual (`quantize` with
      `FP8Config(q_residual=True)`), float8_e4m3fn shaped as q8: the
      scores use q8 + q_residual. `FP8Inputs` unpacks into these seven.
    causal, softmax_scale, return_lse: as `pallas_fa3.flash_attention`.
    implementation: None (mosaic on a Hopper GPU, else blockwise), "mosaic",
      "interpret" or "blockwise".
    config: `Sm90Config` / `Sm90ForwardConfig` (mosaic/interpret) or
      `BlockwiseConfig` (blockwise); its forward block_q / block_kv must be
      the quantization tiles.
      None: the FP8 kernel's default for the head dim.
    out_dtype: bfloat16 (default) or float16 (float32 too on blockwise).
    window_size, softcap, sinks, segment_ids: as
      `pallas_fa3.flash_attention` (the masks and the sink term act on the
      dequantized scores, exactly as in the bf16 forward).

  Returns:
    out `[batch, seq_q, heads_q, head_dim]` in `out_dtype`, and with
    `return_lse` the float32 natural-log lse `[batch, heads_q, seq_q]`.

  Raises:
    TypeError / ValueError: bad operands; the message names the argument.
    NotImplementedError: the backend cannot serve the call; also on any
      attempt to differentiate.
  """
  qs = _check_fp8_operand("q8", q8, 4, "[batch, seq_q, heads_q, head_dim]")
  ks = _check_fp8_operand("k8", k8, 4, "[batch, seq_kv, heads_kv, head_dim]")
  vs = _check_fp8_operand(
    "v8_t", v8_t, 4, "[batch, heads_kv, head_dim, seq_kv]"
  )
  if vs != (ks[0], ks[2], ks[3], ks[1]):
    raise ValueError(
      "v8_t must be V transposed to [batch, heads_kv, head_dim, seq_kv],"
      f" i.e. shape {(ks[0], ks[2], ks[3], ks[1])} for k8.shape={ks}; got"
      f" {vs}"
    )
  if q_residual is not None:
    rs = _check_fp8_operand("q_residual", q_residual, 4, "shaped as q8")
    if rs != qs:
      raise ValueError(f"q_residual must have q8's shape {qs}; got {rs}")
  out_dtype = jnp.dtype(out_dtype)
  if out_dtype not in _OUT_DTYPES:
    raise TypeError(
      f"out_dtype must be one of {[str(d) for d in _OUT_DTYPES]};"
      f" got {out_dtype}"
    )
  like = lambda shape: jax.ShapeDtypeStruct(shape, out_dtype)
  # The spec's fp8 marks the call as FP8 (the operands are already
  # quantized: the config's rotation and key play no part).
  spec = make_spec(
    like(qs),
    like(ks),
    like(ks),
    causal=causal,
    softmax_scale=softmax_scale,
    fp8=FP8Config(q_residual=q_residual is not None),
    window_size=window_size,
    softcap=softcap,
    sinks=sinks is not None,
    segmented=segment_ids is not None,
  )
  sinks = modifiers.check_sinks(sinks, spec.heads_q)
  segment_ids = segments.check_segment_ids(
    segment_ids, spec.batch, spec.seq_q, spec.seq_kv
  )
  return_lse = check_bool("return_lse", return_lse)
  backend, config = backends.resolve(spec, implementation, config)
  block_q, block_kv = backend.fp8_tiles(config)
  b, hq, hk = spec.batch, spec.heads_q, spec.heads_kv
  _check_scale(
    "q_scale", q_scale, (b, hq, cdiv(spec.seq_q, block_q)), "block_q", block_q
  )
  n_kv = cdiv(spec.seq_kv, block_kv)
  _check_scale("k_scale", k_scale, (b, hk, n_kv), "block_kv", block_kv)
  _check_scale("v_scale", v_scale, (b, hk, n_kv), "block_kv", block_kv)
  if not any(isinstance(a, jax.core.Tracer) for a in (q8, k8, v8_t)):
    backends.require_runnable_here(backend)
  x = FP8Inputs(
    *(jnp.asarray(a) for a in (q8, k8, v8_t, q_scale, k_scale, v_scale)),
    None if q_residual is None else jnp.asarray(q_residual),
  )
  call = StaticCall(spec, backend, config, op="fp8")
  out, lse = _quantized_jit(call, x, sinks, segment_ids)
  return (out, lse) if return_lse else out
