"""Tilings of the sm90 backward kernels: shared-memory and register
estimates of `Sm90BackwardConfig`, its config space and heuristic default.
"""

from __future__ import annotations

from pallas_fa3.kernels.sm90.config import (
  BARRIER_BYTES,
  MAX_SMEM_BYTES,
  NUM_CONSUMERS,
  STAGE_CHOICES,
  Sm90BackwardConfig,
  align_smem,
  forward_unsupported,
)
from pallas_fa3.spec import AttentionSpec


def backward_kernel_smem_bytes(
  config: Sm90BackwardConfig, head_dim: int, itemsize: int
) -> dict[str, int]:
  """Shared memory per CTA of each backward kernel ("dkdv", "dq"), in bytes."""
  st, bq, bkv, d = config.num_stages, config.block_q, config.block_kv, head_dim
  c, qc = config.dkdv_consumers, config.dq_consumers
  shared = _dkdv_shared(config)
  tiles = 1 if shared else c
  # dK/dV: K and V tiles (one shared, or one per consumer); ring of Q, dO
  # tiles and lse, delta rows (head-dim chunks are slices of the same
  # buffers); shared: P and dS tiles by step parity and a rendezvous barrier.
  dkdv = (
    2 * align_smem(tiles * bkv * d * itemsize)
    + 2 * align_smem(st * bq * d * itemsize)
    + 2 * align_smem(st * bq * 4)
    + (5 * st + 2 * tiles) * BARRIER_BYTES
  )
  if shared:
    dkdv += 2 * align_smem(2 * bq * bkv * itemsize) + BARRIER_BYTES
  # dQ: Q, dO tiles and lse, delta rows per row block (one block when the
  # consumers share the rows); ring of K and V tiles; shared: dS tiles by
  # step parity and a rendezvous barrier.
  blocks = 1 if config.dq_head_splits == 2 else qc
  dq = (
    2 * align_smem(blocks * bq * d * itemsize)
    + 2 * align_smem(blocks * bq * 4)
    + 2 * align_smem(st * bkv * d * itemsize)
    + (4 * st + 4 * blocks) * BARRIER_BYTES
  )
  if config.dq_head_splits == 2:
    dq += align_smem(2 * bq * bkv * itemsize) + BARRIER_BYTES
  # No RESERVED_SMEM: neither kernel has a cross-warp reduction.
  return {"dkdv": dkdv, "dq": dq}


def backward_smem_bytes(
  config: Sm90BackwardConfig, head_dim: int, itemsize: int
) -> int:
  """Shared memory of the larger of the two backward kernels, per CTA."""
  return max(backward_kernel_smem_bytes(config, head_dim, itemsize).values())


# Float32 tile registers a backward consumer may hold, by consumers per CTA
# (setmaxnreg 240 with two, 256 with one). Calibrated with the sm_90a
# compile: docs/design_notes.md#tile-budgets.
_DKDV_TILE_REGS = {2: 128, 1: 192}
_DQ_TILE_REGS = {2: 128, 1: 192}
_DKDV_SHARED_TILE_REGS = 160


def _dkdv_shared(config: Sm90BackwardConfig) -> bool:
  """Two dK/dV consumers sharing one K/V tile, splitting its head dim."""
  return config.dkdv_consumers == 2 and config.dkdv_head_splits == 2


def _dkdv_tile_regs(config: Sm90BackwardConfig, head_dim: int) -> int:
  """dK, dV accumulators (block_kv x d / splits) plus S^T and dP^T tiles
  (shared: each consumer computes half of their key columns)."""
  cols = head_dim // config.dkdv_head_splits
  sdp = config.block_q * (1 if _dkdv_shared(config) else 2)
  return config.block_kv * (2 * cols + sdp) // 128


def _dq_tile_regs(config: Sm90BackwardConfig, head_dim: int) -> int:
  """dQ accumulator (block_q x d / splits) plus S and dP tiles (shared rows:
  each consumer computes half of their key columns)."""
  splits = config.dq_head_splits
  return (
    config.block_q * (head_dim // splits + 2 * config.block_kv // splits) // 128
  )


def backward_config_unsupported(
  config: Sm90BackwardConfig, head_dim: int, itemsize: int
) -> str | None:
  """Why this backward config cannot run at this head_dim, or None."""
  for field in ("dkdv_head_splits", "dq_head_splits"):
    splits = getattr(config, field)
    cols = head_dim // splits
    if splits > 1 and cols % 32:
      return (
        f"{config}: {field}={splits} leaves {cols}-column chunks of"
        f" head_dim {head_dim}; a split needs multiples of 32 (one"
        " 64-byte swizzle row)"
      )
  need = backward_smem_bytes(config, head_dim, itemsize)
  if need > MAX_SMEM_BYTES:
    return (
      f"{config} needs {need} bytes of shared memory at head_dim"
      f" {head_dim}, over the sm90 limit of {MAX_SMEM_BYTES}"
    )
  dkdv = _dkdv_tile_regs(config, head_dim)
  room = (
    _DKDV_SHARED_TILE_REGS
    if _dkdv_shared(config)
    else _DKDV_TILE_REGS[config.dkdv_consumers]
  )
  if dkdv > room:
    return (
      f"{config}: the dK/dV kernel keeps {dkdv} float32 tile registers"
      f" per thread at head_dim {head_dim}; room for {room}"
    )
  dq, room = _dq_tile_regs(config, head_dim), _DQ_TILE_REGS[config.dq_consumers]
  if dq > room:
    return (
      f"{config}: the dQ kernel keeps {dq} float32 tile registers per"
      f" thread at head_dim {head_dim}; room for {room}"
    )
  return None


def backward_unsupported(
  spec: AttentionSpec, config: Sm90BackwardConfig | None = None
) -> str | None:
  """Why the sm90 backward kernels cannot differentiate `spec`, or None."""
  reason = forward_unsupported(spec)
  if reason:
    return reason
  if config is None and not backward_config_space(
    spec.head_dim, spec.dtype.itemsize
  ):
    return f"no backward tiling fits head_dim {spec.head_dim}"
  if config is not None:
    return backward_config_unsupported(
      config, spec.head_dim, spec.dtype.itemsize
    )
  return None


def _fit(
  block_q: int,
  block_kv: int,
  num_stages: int,
  dkdv_consumers: int,
  head_splits: int,
  head_dim: int,
  itemsize: int,
) -> Sm90BackwardConfig | None:
  """The first dQ layout that fits (two consumers with their own rows, two
  sharing the rows' head dim, one); None if none does."""
  for dq_consumers, dq_splits in (
    (NUM_CONSUMERS, 1),
    (NUM_CONSUMERS, 2),
    (1, 1),
  ):
    config = Sm90BackwardConfig(
      block_q,
      block_kv,
      num_stages,
      dkdv_consumers,
      head_splits,
      dq_consumers,
      dq_splits,
    )
    if backward_config_unsupported(config, head_dim, itemsize) is None:
      return config
  return None


# dK/dV layouts as (consumers, head splits): own K/V tiles; two consumers
# sharing a tile's head dim; one consumer per CTA with the head dim split
# across CTAs (S^T and dP^T recomputed: only where nothing else fits).
_OWN_TILES, _SHARED_TILE, _CTA_SPLIT = ((2, 1), (1, 1)), ((2, 2),), ((1, 2),)


def _tilings(
  head_dim: int,
  itemsize: int,
  layouts: tuple,
  block_choices: tuple[int, ...] = (64, 128),
  stage_choices: tuple[int, ...] = STAGE_CHOICES,
) -> tuple[Sm90BackwardConfig, ...]:
  found = (
    _fit(bq, bkv, st, consumers, splits, head_dim, itemsize)
    for consumers, splits in layouts
    for bq in block_choices
    for bkv in block_choices
    for st in stage_choices
  )
  return tuple(c for c in found if c is not None)


def backward_config_space(
  head_dim: int, itemsize: int = 2
) -> tuple[Sm90BackwardConfig, ...]:
  """Every backward tiling that fits at this head_dim, in order of
  preference: consumers owning whole K/V tiles, then two consumers sharing
  a tile's head dim; the head dim split across CTAs only where neither
  fits; one dQ consumer only where two do not fit."""
  return _space(head_dim, itemsize)


def _space(
  head_dim: int, itemsize: int, **choices: tuple[int, ...]
) -> tuple[Sm90BackwardConfig, ...]:
  space = _tilings(head_dim, itemsize, _OWN_TILES, **choices) + _tilings(
    head_dim, itemsize, _SHARED_TILE, **choices
  )
  return space or _tilings(head_dim, itemsize, _CTA_SPLIT, **choices)


def default_backward_config(spec: AttentionSpec) -> Sm90BackwardConfig:
  """The heuristic backward tiling for `spec`: 64 x 64 tiles, 2 stages, in
  the first form of `backward_config_space` that fits.

  Raises:
    ValueError: no form fits `spec.head_dim`.
  """
  space = _space(
    spec.head_dim, spec.dtype.itemsize, block_choices=(64,), stage_choices=(2,)
  )
  if not space:
    raise ValueError(f"no backward config fits head_dim {spec.head_dim}")
  return space[0]
