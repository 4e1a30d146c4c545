"""The FP8 (e4m3) forward kernel's tilings: `Sm90ForwardConfig` judged by
the FP8 kernel's own shared-memory and register footprint; its block_q and
block_kv are also the quantization tiles (`pallas_fa3.fp8`).
More: docs/fp8.md#the-kernels-and-the-twin.
"""

from __future__ import annotations

from pallas_fa3.kernels.sm90.config import (
  BARRIER_BYTES,
  BLOCK_KV_CHOICES,
  BLOCK_Q_CHOICES,
  MAX_SMEM_BYTES,
  NUM_CONSUMERS,
  RESERVED_SMEM,
  STAGE_CHOICES,
  Sm90ForwardConfig,
  align_smem,
)
from pallas_fa3.quant.config import DEFAULT_TILES
from pallas_fa3.spec import AttentionSpec

FP8_HEAD_DIMS = (64, 128, 256)  # the randomized Hadamard needs a power of two
FP8_OUT_DTYPES = ("bfloat16", "float16")
_FP8_ITEMSIZE = 1


def out_cols(head_dim: int) -> int:
  """Columns of the FP8 kernel's output staging tile: O leaves in chunks of
  at most 128 columns (at d = 256 the whole tile would not fit beside a
  128-key ring)."""
  return min(head_dim, 128)


def fp8_forward_smem_bytes(
  config: Sm90ForwardConfig,
  head_dim: int,
  out_itemsize: int = 2,
  q_terms: int = 1,
) -> int:
  """Shared memory the FP8 forward kernel allocates for one CTA, in bytes.

  As `forward_smem_bytes`, with e4m3 Q/K/V tiles, plus an output staging
  tile per consumer (`out_cols` columns in the output dtype) and one e4m3 P
  tile per consumer (P is staged through shared memory for the P V wgmma).
  `q_terms=2`: Q and its rounding residual (`FP8Config(q_residual=True)`).
  """
  rows = NUM_CONSUMERS * config.block_q
  q = align_smem(q_terms * rows * head_dim * _FP8_ITEMSIZE)
  out = align_smem(rows * out_cols(head_dim) * out_itemsize)
  p = align_smem(rows * config.block_kv * _FP8_ITEMSIZE)
  ring = align_smem(
    config.num_stages * config.block_kv * head_dim * _FP8_ITEMSIZE
  )
  lse = align_smem(rows * 4)
  barriers = (4 * config.num_stages + NUM_CONSUMERS) * BARRIER_BYTES
  return q + out + p + 2 * ring + lse + RESERVED_SMEM + barriers


# Register model of the FP8 consumer: the O tile and the S tile counted
# twice, plus one register per 8 columns of P (its store addresses stay
# live). It predates FA3's order (one S tile live) and is kept as a
# conservative bound: every config within it compiles with 0 spills.
# Calibrated with the sm_90a compile: docs/design_notes.md#tile-budgets.
_FP8_CONSUMER_ACC_REGS = 208


def fp8_forward_config_unsupported(
  config: Sm90ForwardConfig,
  head_dim: int,
  out_itemsize: int = 2,
  q_terms: int = 1,
) -> str | None:
  """Why this config cannot run the FP8 kernel at this head_dim, or None."""
  if head_dim not in FP8_HEAD_DIMS:
    return f"head_dim {head_dim} is not one of the FP8 kernel's {FP8_HEAD_DIMS}"
  if not config.overlap:
    return (
      f"{config}: overlap=False is the bf16/fp16 kernel's; the FP8 kernel"
      " runs FA3's overlapped order only"
    )
  if q_terms == 2 and head_dim > 128:
    return (
      f"q_residual is served up to head_dim 128 (the second QK^T product"
      f" spills registers at {head_dim}); got head_dim {head_dim}"
    )
  need = fp8_forward_smem_bytes(config, head_dim, out_itemsize, q_terms)
  if need > MAX_SMEM_BYTES:
    return (
      f"{config} needs {need} bytes of shared memory for FP8 at"
      f" head_dim {head_dim}, over the sm90 limit of {MAX_SMEM_BYTES}"
    )
  regs = (
    config.block_q * (head_dim + 2 * config.block_kv) // 128
    + config.block_kv // 8
  )
  if regs > _FP8_CONSUMER_ACC_REGS:
    return (
      f"{config} keeps about {regs} registers of tiles per thread in"
      f" the FP8 consumer at head_dim {head_dim}; the budget is"
      f" {_FP8_CONSUMER_ACC_REGS}"
    )
  return None


def fp8_forward_config_space(
  head_dim: int, out_itemsize: int = 2, q_terms: int = 1
) -> tuple[Sm90ForwardConfig, ...]:
  """Every FP8 config that fits at this head_dim (the autotuning space);
  `q_terms=2`: with Q's rounding residual (`FP8Config(q_residual=True)`)."""
  return tuple(
    c
    for c in (
      Sm90ForwardConfig(bq, bkv, st)
      for bq in BLOCK_Q_CHOICES
      for bkv in BLOCK_KV_CHOICES
      for st in STAGE_CHOICES
    )
    if fp8_forward_config_unsupported(c, head_dim, out_itemsize, q_terms)
    is None
  )


_FP8_DEFAULTS = {
  d: Sm90ForwardConfig(block_q=bq, block_kv=bkv, num_stages=2)
  for d, (bq, bkv) in DEFAULT_TILES.items()
}


def default_fp8_forward_config(head_dim: int) -> Sm90ForwardConfig:
  """The heuristic FP8 forward config (also the default quantization tiles)."""
  config = _FP8_DEFAULTS.get(head_dim, Sm90ForwardConfig())
  assert fp8_forward_config_unsupported(config, head_dim) is None, config
  return config


def fp8_forward_unsupported(
  spec: AttentionSpec, config: Sm90ForwardConfig | None = None
) -> str | None:
  """Why the FP8 kernel cannot compute `spec` (output dtype `spec.dtype`), or None."""
  if str(spec.dtype) not in FP8_OUT_DTYPES:
    return (
      f"the FP8 kernel writes {', '.join(FP8_OUT_DTYPES)}; got output"
      f" dtype {spec.dtype}"
    )
  if spec.head_dim != spec.head_dim_v:
    return (
      f"head_dim {spec.head_dim} != value head_dim {spec.head_dim_v}:"
      " the FP8 kernel needs equal q/k and v head dims"
    )
  if spec.head_dim not in FP8_HEAD_DIMS:
    return (
      f"head_dim {spec.head_dim} is not one of the FP8 kernel's {FP8_HEAD_DIMS}"
    )
  config = (
    default_fp8_forward_config(spec.head_dim) if config is None else config
  )
  q_terms = 2 if spec.fp8 is not None and spec.fp8.q_residual else 1
  return fp8_forward_config_unsupported(
    config, spec.head_dim, spec.dtype.itemsize, q_terms
  )
