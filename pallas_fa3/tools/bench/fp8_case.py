"""FP8 cases: the quantization and the FP8 attention, timed apart and together.

An "fp8" spec starts from bf16 Q, K, V, as a model holds them. The
quantization pass (`pallas_fa3.fp8.quantize` with the case's
implementation: the quantization kernel on mosaic, its pure-JAX twin
elsewhere; FA3's recipe: per-tile scales and the Hadamard rotation,
`FP8Config()`) writes e4m3 operands, and
`pallas_fa3.fp8.flash_attention_fp8` runs the attention on them, writing
bf16. Three timings per case: the quantization alone, the attention kernel
alone on pre-quantized inputs, and the total, both in one call of
`flash_attention(..., fp8=FP8Config(), config=<the same tiles>)`. The
FLOPs are the attention's; the quantization's O(n d) work is not counted.
FP8 is forward only and needs head_dim_v == head_dim: other cases are
skipped with the reason. A case's
window, softcap, sinks and packed documents go to both FP8 calls, as to the
bf16 ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import pallas_fa3
from pallas_fa3 import backends, fp8
from pallas_fa3.backends.base import Backend
from pallas_fa3.kernels.sm90 import config_fp8 as sm90_fp8_config
from pallas_fa3.tools.bench import options, specs, timing

# The backends with an FP8 path: those overriding the base class's
# `fp8_forward`, which raises NotImplementedError ("has no FP8 path").
FP8_IMPLS: tuple[str, ...] = tuple(
  b.name
  for b in backends.BACKENDS
  if type(b).fp8_forward is not Backend.fp8_forward
)
OUT_DTYPE = jnp.bfloat16


class Fp8Timing(NamedTuple):
  """The three timings of one FP8 case, and its output on the first inputs."""

  total: timing.Timing  # quantize + attention: flash_attention(fp8=...)
  quantize: timing.Timing  # the quantization pass alone
  attention: timing.Timing  # the FP8 attention alone, on quantized inputs
  out: jax.Array  # attention(quantize(first input set))


def unsupported(name: str, spec: specs.BenchSpec) -> str | None:
  """Why `name` cannot run the fp8 `spec`; None for non-fp8 specs."""
  if spec.dtype != "fp8":
    return None
  if name not in FP8_IMPLS:
    return (
      f"{name} has no FP8 path: fp8 cases run on"
      f" {', '.join(FP8_IMPLS)} (compare with the bf16 rows)"
    )
  if spec.head_dim_v != spec.head_dim:
    return (
      "FP8 needs head_dim_v == head_dim (the library raises ValueError);"
      f" got {spec.head_dim}/{spec.head_dim_v}"
    )
  if spec.mode != "fwd":
    return (
      "FP8 is forward only: gradients through FP8 attention are not"
      " implemented (time fp8 with --mode fwd)"
    )
  if name != "blockwise" and spec.head_dim not in sm90_fp8_config.FP8_HEAD_DIMS:
    return (
      f"the FP8 kernel serves head dims {sm90_fp8_config.FP8_HEAD_DIMS},"
      f" not {spec.head_dim}"
    )
  return None


def attention_config(name: str, head_dim: int) -> Any:
  """The tiles of the case (also the quantization's tiles).

  The FP8 kernel's default config for the head dim (mosaic, interpret); for
  blockwise a `BlockwiseConfig` with the same tiles, so that it quantizes
  and computes as the kernel would, or its default tiles at head dims the
  kernel does not serve.
  """
  if head_dim not in sm90_fp8_config.FP8_HEAD_DIMS:
    return pallas_fa3.BlockwiseConfig()
  config = sm90_fp8_config.default_fp8_forward_config(head_dim)
  if name == "blockwise":
    return pallas_fa3.BlockwiseConfig(config.block_q, config.block_kv)
  return config


def functions(
  name: str, spec: specs.BenchSpec
) -> tuple[Callable, Callable, Callable]:
  """(quantize(q, k, v) -> FP8Inputs, attend(FP8Inputs) -> out,
  total(q, k, v) -> out) for backend `name` and the fp8 `spec`."""
  config = attention_config(name, spec.head_dim)
  extras = dict(
    window_size=spec.window,
    softcap=spec.softcap,
    sinks=options.sinks_for(spec.heads_q) if spec.sinks else None,
    segment_ids=options.segment_ids_for(spec),
  )

  def quantize(q, k, v):
    return fp8.quantize(
      q,
      k,
      v,
      block_q=config.block_q,
      block_kv=config.block_kv,
      config=pallas_fa3.FP8Config(),
      implementation=name,
    )

  def attend(x):
    return fp8.flash_attention_fp8(
      *x,
      causal=spec.causal,
      implementation=name,
      config=config,
      out_dtype=OUT_DTYPE,
      **extras,
    )

  def total(q, k, v):  # the public entry point, quantizing inside
    return pallas_fa3.flash_attention(
      q,
      k,
      v,
      causal=spec.causal,
      implementation=name,
      config=config,
      fp8=pallas_fa3.FP8Config(),
      **extras,
    )

  return quantize, attend, total


def measure(
  name: str,
  spec: specs.BenchSpec,
  input_sets: Sequence[tuple],
  warmup: int,
  runs: int,
) -> Fp8Timing:
  """Compiles and times the quantization, the attention and the total.

  Args:
    name: "mosaic", "interpret" or "blockwise".
    spec: an fp8, forward `BenchSpec`.
    input_sets: `(q, k, v, ...)` tuples of bf16 arrays, rotated between calls.
    warmup, runs: untimed and timed calls of each of the three functions.
  """
  quantize, attend, total = functions(name, spec)
  qkv = [s[:3] for s in input_sets]
  quantize_t, quantize_c = timing.measure(jax.jit(quantize), qkv, warmup, runs)
  quantized = jax.block_until_ready([(quantize_c(*a),) for a in qkv])
  attend_t, attend_c = timing.measure(jax.jit(attend), quantized, warmup, runs)
  # One executable, as a model calls it (interpret mode too: its threads
  # need the reserved XLA pool, `backends.interpret_pool`).
  total_t, _ = timing.measure(jax.jit(total), qkv, warmup, runs)
  return Fp8Timing(total_t, quantize_t, attend_t, attend_c(*quantized[0]))
