"""Tilings of the sm90 kernels: validated configs, their shared-memory and
register estimates, the config spaces and the heuristic defaults.

The configs are frozen and hashable (static arguments of `jax.jit` and
`custom_vjp`) and validate themselves. Whether a config fits a call is
decided by one estimate against one limit (`forward_unsupported`,
`backward_config_unsupported`); the defaults and the config spaces are
checked against the same estimates, so they cannot disagree.

Tiles (FA3 terms): a forward CTA owns `2 * block_q` query rows, `block_q`
per consumer warpgroup (the M of its wgmma); the producer warpgroup streams
`block_kv`-row K and V tiles through a ring of `num_stages` slots.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pallas_fa3.spec import AttentionSpec, check_int_fields

# Hardware facts (sm90), each named once.
MAX_SMEM_BYTES = 227 * 1024  # usable dynamic shared memory per CTA on H100/H200
WGMMA_M = 64  # rows of one warpgroup MMA instruction
TMA_ROW_ALIGN = 64  # K/V tile rows: a multiple of the 128-byte swizzle span
NUM_CONSUMERS = 2  # consumer warpgroups per CTA (pingpong needs two)
BARRIER_BYTES = 8  # one mbarrier
# Mosaic's allocation alignment and its reserve for cross-warp reductions
# (`reduction_scratch_bytes`): docs/design_notes.md#shared-memory.
SMEM_ALIGN = 1024
RESERVED_SMEM = 128 * 4 * 4

KERNEL_HEAD_DIMS = (64, 96, 128, 192, 256)  # multiples of 32 the tiling serves
KERNEL_DTYPES = ("bfloat16", "float16")
BLOCK_Q_CHOICES = (64, 128)
# The P V wgmma takes block_kv as its K dimension, which must be a multiple
# of the 128-byte swizzle span (64 bf16/fp16 elements).
BLOCK_KV_CHOICES = (64, 128, 192, 256)
STAGE_CHOICES = (2, 3, 4)


def align_smem(nbytes: int) -> int:
  """One shared-memory allocation's size as Mosaic places it."""
  return -(-nbytes // SMEM_ALIGN) * SMEM_ALIGN


@dataclasses.dataclass(frozen=True)
class Sm90ForwardConfig:
  """Tiling of the sm90 forward kernel.

  Attributes:
    block_q: query rows per consumer warpgroup (the CTA holds 2 * block_q).
    block_kv: key/value rows per pipeline stage.
    num_stages: shared-memory slots in the K/V ring (2-4).
  """

  block_q: int = 64
  block_kv: int = 128
  num_stages: int = 2

  def __post_init__(self) -> None:
    check_int_fields(
      self,
      block_q=dict(choices=BLOCK_Q_CHOICES),
      block_kv=dict(choices=BLOCK_KV_CHOICES),
      num_stages=dict(choices=STAGE_CHOICES),
    )

  @property
  def rows_per_cta(self) -> int:
    """Query rows of one CTA (both consumers)."""
    return NUM_CONSUMERS * self.block_q


def forward_smem_bytes(
  config: Sm90ForwardConfig, head_dim: int, itemsize: int
) -> int:
  """Shared memory the forward kernel allocates for one CTA, in bytes.

  Q tiles (reused for O on the way out) for both consumers, the K and V
  rings, the lse staging rows and the barriers (K full/empty, V full/empty
  per stage, one Q barrier per consumer, one schedule barrier).
  """
  qo = align_smem(NUM_CONSUMERS * config.block_q * head_dim * itemsize)
  ring = align_smem(config.num_stages * config.block_kv * head_dim * itemsize)
  lse = align_smem(NUM_CONSUMERS * config.block_q * 4)
  barriers = (4 * config.num_stages + NUM_CONSUMERS + 1) * BARRIER_BYTES
  return qo + 2 * ring + lse + RESERVED_SMEM + barriers


def forward_config_unsupported(
  config: Sm90ForwardConfig, head_dim: int, itemsize: int
) -> str | None:
  """Why this config cannot run at this head_dim, or None."""
  need = forward_smem_bytes(config, head_dim, itemsize)
  if need > MAX_SMEM_BYTES:
    return (
      f"{config} needs {need} bytes of shared memory at head_dim"
      f" {head_dim}, over the sm90 limit of {MAX_SMEM_BYTES}"
    )
  # Register budget of a consumer (128 threads): the float32 O accumulator
  # (block_q x d), and the S tile (block_q x block_kv) counted twice: S and
  # its exponentials are live together during the softmax.
  regs = config.block_q * (head_dim + 2 * config.block_kv) // 128
  if regs > _CONSUMER_ACC_REGS:
    return (
      f"{config} keeps {regs} float32 accumulator registers per thread"
      f" at head_dim {head_dim}; a consumer warpgroup has room for"
      f" {_CONSUMER_ACC_REGS}"
    )
  return None


# Float32 tile registers a forward consumer may hold (of its 240; the rest
# hold P, the statistics and addresses). Calibrated with the sm_90a compile:
# docs/design_notes.md#tile-budgets.
_CONSUMER_ACC_REGS = 192


def forward_unsupported(
  spec: AttentionSpec, config: Sm90ForwardConfig | None = None
) -> str | None:
  """Why the sm90 forward kernel cannot compute `spec` (with `config`), or None."""
  if str(spec.dtype) not in KERNEL_DTYPES:
    return (
      f"dtype {spec.dtype} is not served by the kernel (it takes"
      f" {', '.join(KERNEL_DTYPES)}; FP8 is flash_attention(fp8=True))"
    )
  if spec.head_dim != spec.head_dim_v:
    return (
      f"head_dim {spec.head_dim} != value head_dim {spec.head_dim_v}:"
      " the kernel needs equal q/k and v head dims"
    )
  if spec.head_dim not in KERNEL_HEAD_DIMS:
    return (
      f"head_dim {spec.head_dim} is not one of the kernel's {KERNEL_HEAD_DIMS}"
    )
  config = default_forward_config(spec) if config is None else config
  return forward_config_unsupported(config, spec.head_dim, spec.dtype.itemsize)


# The heuristic default per head dim (bf16/fp16 alike): the largest K/V
# tile and deepest ring that fit. docs/design_notes.md#default-tilings
_DEFAULTS = {
  64: Sm90ForwardConfig(block_q=64, block_kv=128, num_stages=3),
  96: Sm90ForwardConfig(block_q=64, block_kv=128, num_stages=2),
  128: Sm90ForwardConfig(block_q=64, block_kv=128, num_stages=2),
  192: Sm90ForwardConfig(block_q=64, block_kv=64, num_stages=3),
  256: Sm90ForwardConfig(block_q=64, block_kv=64, num_stages=2),
}


def default_forward_config(spec: AttentionSpec) -> Sm90ForwardConfig:
  """The heuristic forward config for `spec` (checked against the estimate)."""
  config = _DEFAULTS.get(spec.head_dim, Sm90ForwardConfig())
  assert forward_config_unsupported(config, spec.head_dim, 2) is None, config
  return config


def forward_config_space(
  head_dim: int, itemsize: int = 2
) -> tuple[Sm90ForwardConfig, ...]:
  """Every config that fits at this head_dim (the autotuning space)."""
  return tuple(
    c
    for c in (
      Sm90ForwardConfig(bq, bkv, st)
      for bq in BLOCK_Q_CHOICES
      for bkv in BLOCK_KV_CHOICES
      for st in STAGE_CHOICES
    )
    if forward_config_unsupported(c, head_dim, itemsize) is None
  )


@dataclasses.dataclass(frozen=True)
class Sm90BackwardConfig:
  """Tiling of the sm90 backward kernels (dK/dV kernel and dQ kernel).

  Attributes:
    block_q: query rows per tile streamed through the dK/dV kernel's ring,
      and per consumer warpgroup in the dQ kernel.
    block_kv: key/value rows per consumer warpgroup in the dK/dV kernel,
      and per tile streamed through the dQ kernel's ring.
    num_stages: shared-memory slots of both kernels' rings (2-4).
    dkdv_consumers: consumer warpgroups of the dK/dV kernel (1 or 2). With
      one, the CTA has 256 threads and its consumer may hold 255 registers
      per thread (240 with two): the dK, dV accumulators of d > 64 need it.
    dkdv_head_splits: ways dK and dV's head dim is split (1 or 2). With two
      consumers they share one K/V tile, each accumulating half of the head
      dim and exchanging P and dS through shared memory (FA3's layout for
      d = 192, 256). With one, two CTAs share each K/V tile, each
      recomputing S^T and dP^T (two more GEMMs per tile).
    dq_consumers: consumer warpgroups of the dQ kernel (1 or 2). A lone
      consumer takes each K/V tile in halves of `block_kv / 2` keys.
    dq_head_splits: 2 makes the dQ kernel's two consumers share each query
      tile, each accumulating half of dQ's head dim and exchanging dS
      through shared memory. Needs `dq_consumers=2`.
  """

  block_q: int = 64
  block_kv: int = 64
  num_stages: int = 2
  dkdv_consumers: int = 2
  dkdv_head_splits: int = 1
  dq_consumers: int = NUM_CONSUMERS
  dq_head_splits: int = 1

  def __post_init__(self) -> None:
    one_or_two = dict(choices=(1, 2))
    check_int_fields(
      self,
      block_q=dict(choices=(64, 128)),
      block_kv=dict(choices=(64, 128)),
      num_stages=dict(choices=STAGE_CHOICES),
      dkdv_consumers=one_or_two,
      dkdv_head_splits=one_or_two,
      dq_consumers=one_or_two,
      dq_head_splits=one_or_two,
    )
    if self.dq_head_splits == 2 and self.dq_consumers != 2:
      raise ValueError(
        "Sm90BackwardConfig.dq_head_splits=2 needs dq_consumers=2"
        f" (the two consumers split the head dim); got"
        f" dq_consumers={self.dq_consumers}"
      )

  @property
  def dq_config(self) -> Sm90ForwardConfig:
    """The dQ kernel walks K/V like the forward kernel: the same tiling."""
    return Sm90ForwardConfig(self.block_q, self.block_kv, self.num_stages)


@dataclasses.dataclass(frozen=True)
class Sm90Config:
  """The sm90 kernels' tilings for one call (`mosaic` / `interpret`).

  Attributes:
    forward: the forward kernel's tiling (the FP8 kernel's with `fp8=`), or
      None for the heuristic default of the call.
    backward: the backward kernels' tiling, or None for the heuristic
      default. A tiling that does not fit the call is an error when the call
      is made.

  A bare `Sm90ForwardConfig` passed as `config=` means
  `Sm90Config(forward=that)`.
  """

  forward: Sm90ForwardConfig | None = None
  backward: Sm90BackwardConfig | None = None

  def __post_init__(self) -> None:
    for name, cls in (
      ("forward", Sm90ForwardConfig),
      ("backward", Sm90BackwardConfig),
    ):
      value = getattr(self, name)
      if value is not None and not isinstance(value, cls):
        raise TypeError(
          f"Sm90Config.{name} must be None or a"
          f" pallas_fa3.{cls.__name__}; got {value!r}"
        )

  @classmethod
  def of(cls, config: Any) -> Sm90Config:
    """`config=` of a kernel backend (None, Sm90Config or Sm90ForwardConfig)."""
    if config is None:
      return cls()
    if isinstance(config, Sm90ForwardConfig):
      return cls(forward=config)
    return config


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
