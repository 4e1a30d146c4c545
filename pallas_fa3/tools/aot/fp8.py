"""Deviceless compiles of the FP8 path for an H200 (`pallas_fa3.tools.aot`):
the FP8 forward kernel, the quantization kernel, and the memory XLA assigns
to a whole `flash_attention(..., fp8=True)` call:
docs/kernels.md#verification-without-a-gpu.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pallas_fa3.spec import cdiv
from pallas_fa3.tools.aot import compiler as aot

if TYPE_CHECKING:  # jax is imported only when a compile runs
  from jax.sharding import Mesh

  from pallas_fa3.kernels.sm90 import config as sm90
  from pallas_fa3.spec import AttentionSpec


def compile_forward_fp8(
  spec: AttentionSpec, config: sm90.Sm90ForwardConfig, mesh: Mesh | None = None
) -> aot.CompileReport:
  """Compiles the FP8 forward kernel for sm_90a; ptxas's report.

  `spec.dtype` is the output dtype; the operands are e4m3 with float32
  scales, in the layouts `pallas_fa3.fp8.quantize` writes.
  """
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec

  from pallas_fa3.kernels.sm90 import forward_fp8 as sm90_fwd_fp8

  mesh = aot.h200_mesh() if mesh is None else mesh
  sharding = NamedSharding(mesh, PartitionSpec())
  f8, f32 = sm90_fwd_fp8.FP8_DTYPE, jnp.float32
  b, hq, hk, d = spec.batch, spec.heads_q, spec.heads_kv, spec.head_dim
  n_q = cdiv(spec.seq_q, config.block_q)
  n_kv = cdiv(spec.seq_kv, config.block_kv)
  shapes = [
    jax.ShapeDtypeStruct(s, t, sharding=sharding)
    for s, t in (
      ((b, spec.seq_q, hq, d), f8),
      ((b, spec.seq_kv, hk, d), f8),
      ((b, hk, d, spec.seq_kv), f8),
      ((b, hq, n_q), f32),
      ((b, hk, n_kv), f32),
      ((b, hk, n_kv), f32),
    )
  ]
  if spec.fp8 is not None and spec.fp8.q_residual:  # Q's rounding residual
    shapes.append(shapes[0])
  residual = " q-residual" if len(shapes) > 6 else ""
  sinks = ids = None  # constant stand-ins, as in aot.compile_forward
  if spec.sinks:
    sinks = jnp.zeros((b, hq), f32)
  if spec.segmented:
    ids = aot.packed_bounds(spec)[:2]
  return aot.compile_report(
    f"fwd-fp8{residual} d={d} out={spec.dtype} causal={spec.causal}"
    f"{aot.modifier_label(spec)} {config}",
    lambda *a: sm90_fwd_fp8.sm90_forward_fp8(
      spec, config, *a, sinks=sinks, segment_ids=ids
    ),
    shapes,
    aot.short_label(spec, config),
  )


def compile_quantize(
  spec: AttentionSpec, config: sm90.Sm90ForwardConfig, mesh: Mesh | None = None
) -> aot.CompileReport:
  """Compiles the FP8 quantization kernel for `spec`'s bf16 Q, K, V in
  `config`'s tiles (three kernels; Q's residual with `spec.fp8.q_residual`)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec

  from pallas_fa3.kernels.sm90 import quantize

  mesh = aot.h200_mesh() if mesh is None else mesh
  shapes = [
    jax.ShapeDtypeStruct(o.shape, jnp.bfloat16, sharding=o.sharding)
    for o in aot.bf16_operands(spec, mesh, backward=False)
  ]
  shapes.append(
    jax.ShapeDtypeStruct(
      (), jnp.uint32, sharding=NamedSharding(mesh, PartitionSpec())
    )
  )
  residual = spec.fp8 is not None and spec.fp8.q_residual
  return aot.compile_report(
    f"fp8-quantize d={spec.head_dim} q{config.block_q}/kv{config.block_kv}"
    f"{' q-residual' if residual else ''}",
    lambda q, k, v, seed: quantize.quantize_inputs_kernel(
      q, k, v, jax.random.key(seed), block_q=config.block_q,
      block_kv=config.block_kv, block_quantization=True, rotation=True,
      q_residual=residual,
    ),
    shapes,
    f"d{spec.head_dim} quantize {config.block_q}/{config.block_kv}",
  )  # fmt: skip


def fp8_call_memory(head_dim: int, tokens: int = 16384, hidden: int = 2048):
  """(argument bytes, temporary bytes) of `flash_attention(q, k, v, fp8=True,
  implementation="mosaic")` compiled for an H200, bf16 `[1, tokens,
  hidden // head_dim, head_dim]` operands (XLA's buffer assignment)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec

  import pallas_fa3

  sharding = NamedSharding(aot.h200_mesh(), PartitionSpec())
  x = jax.ShapeDtypeStruct(
    (1, tokens, hidden // head_dim, head_dim), jnp.bfloat16, sharding=sharding
  )
  call = jax.jit(
    lambda q, k, v: pallas_fa3.flash_attention(
      q, k, v, fp8=True, implementation="mosaic"
    )
  )
  stats = call.lower(x, x, x).compile().memory_analysis()
  return 3 * x.size * 2, int(stats.temp_size_in_bytes)
