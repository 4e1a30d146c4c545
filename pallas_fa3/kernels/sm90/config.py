"""Tilings of the sm90 kernels: the validated, frozen configs (static
arguments of `jax.jit` and `custom_vjp`) and the forward kernel's
shared-memory and register estimates, config space and heuristic defaults,
all judged by the same estimates (the backward's are in `config_backward`).
More: docs/kernels.md#configs-and-tilings.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pallas_fa3.kernels.sm90 import flex_tile
from pallas_fa3.spec import AttentionSpec, cdiv, check_bool, check_int_fields

# Hardware facts (sm90), each named once.
MAX_SMEM_BYTES = 227 * 1024  # usable dynamic shared memory per CTA on H100/H200
WGMMA_M = 64  # rows of one warpgroup MMA instruction
TMA_ROW_ALIGN = 64  # K/V tile rows: a multiple of the 128-byte swizzle span
NUM_CONSUMERS = 2  # consumer warpgroups per CTA (pingpong needs two)
BARRIER_BYTES = 8  # one mbarrier
# SMs of an H100 SXM / H200, for compiles with no GPU to ask (the deviceless
# compile); with a GPU its own count is used.
HOPPER_SMS = 132
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
  return cdiv(nbytes, SMEM_ALIGN) * SMEM_ALIGN


@dataclasses.dataclass(frozen=True)
class Sm90ForwardConfig:
  """Tiling of the sm90 forward kernel.

  Attributes:
    block_q: query rows per consumer warpgroup (the CTA holds 2 * block_q).
    block_kv: key/value rows per pipeline stage.
    num_stages: shared-memory slots in the K/V ring (2-4).
    persistent: one CTA per SM walking its query tiles (causal tiles
      longest first), or one CTA per query tile (the same order of CTAs):
      the walk keeps a few more registers live, which spills at d = 256.
    overlap: FA3's intra-warpgroup overlap (the softmax of S_{j+1} runs
      while P_j V_j is in flight, P_j held across it), or each step's S,
      softmax and P V in turn, which frees P's registers (d256 with flex;
      the bf16 kernel only).
  """

  block_q: int = 64
  block_kv: int = 128
  num_stages: int = 2
  persistent: bool = True
  overlap: bool = True

  def __post_init__(self) -> None:
    check_int_fields(
      self,
      block_q=dict(choices=BLOCK_Q_CHOICES),
      block_kv=dict(choices=BLOCK_KV_CHOICES),
      num_stages=dict(choices=STAGE_CHOICES),
    )
    check_bool("Sm90ForwardConfig.persistent", self.persistent)
    check_bool("Sm90ForwardConfig.overlap", self.overlap)

  @property
  def rows_per_cta(self) -> int:
    """Query rows of one CTA (both consumers)."""
    return NUM_CONSUMERS * self.block_q


def _dims(head_dim: int, head_dim_v: int | None) -> str:
  """ "head_dim 128" or "head_dims 192/128" for messages."""
  if head_dim_v is None or head_dim_v == head_dim:
    return f"head_dim {head_dim}"
  return f"head_dims {head_dim}/{head_dim_v}"


QOLayout = Literal["shared", "separate", "per_consumer"]


def forward_qo_layout(
  config: Sm90ForwardConfig,
  head_dim: int,
  itemsize: int,
  head_dim_v: int | None = None,
) -> QOLayout:
  """Where the forward kernel keeps its consumers' Q tiles and, on the way
  out, their O tiles (docs/hardware_hazards.md#forward-q-and-o-tiles).

  - "shared" (`head_dim_v == head_dim`): one `[consumers, block_q, d]`
    buffer; consumer w writes its O over its own Q, once its last wgmma
    has read it.
  - "separate" (`head_dim_v != head_dim`, where that fits): Q and O in
    buffers of their own; nothing aliases.
  - "per_consumer" (where it does not): one union of a Q and an O tile per
    consumer, so that each O aliases only its own consumer's Q (one union
    of both consumers' tiles would lay O_w over the other consumer's Q at
    different strides; the two consumers are not ordered there). The
    kernel then traces its consumer once per warpgroup with the union's
    refs as constants.
  """
  dv = head_dim if head_dim_v is None else head_dim_v
  if dv == head_dim:
    return "shared"
  separate = _qo_allocations("separate", config, head_dim, itemsize, dv)
  if _smem_total(config, head_dim, itemsize, dv, separate) <= MAX_SMEM_BYTES:
    return "separate"
  return "per_consumer"


def _qo_allocations(
  layout: QOLayout,
  config: Sm90ForwardConfig,
  head_dim: int,
  itemsize: int,
  head_dim_v: int,
) -> tuple[tuple[int, ...], ...]:
  """The Q/O allocations of `layout` in scratch order: per allocation, the
  byte sizes of its members (a union has several, all at its offset 0)."""
  tile = lambda w: config.block_q * w * itemsize
  if layout == "shared":
    return ((NUM_CONSUMERS * tile(head_dim),),)
  if layout == "separate":
    return (
      (NUM_CONSUMERS * tile(head_dim),),
      (NUM_CONSUMERS * tile(head_dim_v),),
    )
  return ((tile(head_dim), tile(head_dim_v)),) * NUM_CONSUMERS


def forward_qo_ranges(
  config: Sm90ForwardConfig,
  head_dim: int,
  itemsize: int,
  head_dim_v: int | None = None,
) -> tuple[tuple[range, range], ...]:
  """Per consumer, the byte ranges of its Q tile and its O tile in the
  kernel's shared memory, as Mosaic places `forward_qo_layout`'s
  allocations (in order, each aligned to `SMEM_ALIGN`)."""
  dv = head_dim if head_dim_v is None else head_dim_v
  layout = forward_qo_layout(config, head_dim, itemsize, dv)
  starts, offset = [], 0
  for members in _qo_allocations(layout, config, head_dim, itemsize, dv):
    starts.append(offset)
    offset += align_smem(max(members))
  tile = lambda w: config.block_q * w * itemsize
  ranges = []
  for w in range(NUM_CONSUMERS):
    if layout == "per_consumer":
      q0 = o0 = starts[w]
    else:  # [consumers, block_q, width] arrays: consumer w at row w
      q0, o0 = starts[0] + w * tile(head_dim), starts[-1] + w * tile(dv)
    ranges.append((range(q0, q0 + tile(head_dim)), range(o0, o0 + tile(dv))))
  return tuple(ranges)


def _smem_total(
  config: Sm90ForwardConfig,
  head_dim: int,
  itemsize: int,
  head_dim_v: int,
  qo_allocations: tuple[tuple[int, ...], ...],
) -> int:
  qo = sum(align_smem(max(members)) for members in qo_allocations)
  ring = lambda d: align_smem(
    config.num_stages * config.block_kv * d * itemsize
  )
  lse = align_smem(NUM_CONSUMERS * config.block_q * 4)
  barriers = (4 * config.num_stages + NUM_CONSUMERS) * BARRIER_BYTES
  return qo + ring(head_dim) + ring(head_dim_v) + lse + RESERVED_SMEM + barriers


def forward_smem_bytes(
  config: Sm90ForwardConfig,
  head_dim: int,
  itemsize: int,
  head_dim_v: int | None = None,
) -> int:
  """Shared memory the forward kernel allocates for one CTA, in bytes.

  Q and O tiles for both consumers (`forward_qo_layout`), the K ring
  (`head_dim`) and the V ring (`head_dim_v`, default `head_dim`), the lse
  staging rows and the barriers (K full/empty, V full/empty per stage, one
  Q barrier per consumer; the pingpong uses named barriers).
  """
  dv = head_dim if head_dim_v is None else head_dim_v
  layout = forward_qo_layout(config, head_dim, itemsize, dv)
  allocations = _qo_allocations(layout, config, head_dim, itemsize, dv)
  return _smem_total(config, head_dim, itemsize, dv, allocations)


def forward_config_unsupported(
  config: Sm90ForwardConfig,
  head_dim: int,
  itemsize: int,
  head_dim_v: int | None = None,
) -> str | None:
  """Why this config cannot run at these head dims, or None."""
  dv = head_dim if head_dim_v is None else head_dim_v
  need = forward_smem_bytes(config, head_dim, itemsize, dv)
  if need > MAX_SMEM_BYTES:
    return (
      f"{config} needs {need} bytes of shared memory at"
      f" {_dims(head_dim, dv)}, over the sm90 limit of {MAX_SMEM_BYTES}"
    )
  # Register budget of a consumer (128 threads) in FA3's order: the float32
  # O accumulator (block_q x dv) and S tile (block_q x block_kv), and the
  # previous tile's P in 16 bits, read by the P V wgmma still in flight
  # (with `overlap=False` P replaces S instead).
  s_and_p = 3 if config.overlap else 2
  regs = config.block_q * (2 * dv + s_and_p * config.block_kv) // 256
  if regs > _CONSUMER_ACC_REGS:
    return (
      f"{config} keeps {regs} tile registers per thread"
      f" at {_dims(head_dim, dv)}; a consumer warpgroup has room for"
      f" {_CONSUMER_ACC_REGS}"
    )
  if config.persistent and max(head_dim, dv) > _PERSISTENT_MAX_HEAD_DIM:
    return (
      f"{config}: the persistent tile walk spills registers at"
      f" {_dims(head_dim, dv)} (over {_PERSISTENT_MAX_HEAD_DIM}); use"
      " persistent=False"
    )
  return None


# Tile registers a forward consumer may hold (of its 240; the rest hold the
# statistics and addresses). Calibrated with the sm_90a compile (176 fits
# everywhere, 192 spills at d96 64x192): docs/design_notes.md#tile-budgets.
_CONSUMER_ACC_REGS = 184
# The persistent walk keeps the tile's coordinates and the walk's counters
# live beside the O accumulator: at d256 (64x64x2) it spilled 48-64 B, at
# d192 and below 0 (docs/design_notes.md#tile-budgets).
_PERSISTENT_MAX_HEAD_DIM = 192


def forward_unsupported(
  spec: AttentionSpec, config: Sm90ForwardConfig | None = None
) -> str | None:
  """Why the sm90 forward kernel cannot compute `spec` (with `config`), or None."""
  if str(spec.dtype) not in KERNEL_DTYPES:
    return (
      f"dtype {spec.dtype} is not served by the kernel (it takes"
      f" {', '.join(KERNEL_DTYPES)}; FP8 is flash_attention(fp8=True))"
    )
  for name, d in (("head_dim", spec.head_dim), ("head_dim_v", spec.head_dim_v)):
    if d not in KERNEL_HEAD_DIMS:
      return f"{name} {d} is not one of the kernel's {KERNEL_HEAD_DIMS}"
  if config is None:
    config = default_forward_config(spec)
    if config is None:
      return f"no forward tiling fits {_dims(spec.head_dim, spec.head_dim_v)}"
  return forward_config_unsupported(
    config, spec.head_dim, spec.dtype.itemsize, spec.head_dim_v
  )


# With score_mod / mask_mod / bias / a block mask (traced into the tile
# loop, `flex_tile`): the largest tiling with 0 spills for every case of
# `pallas-fa3 aot --flex` (the plain defaults spill 4-36 B at d64/96/128:
# the user function's vectors and the bias tile share the S tile's
# registers). d256 keeps its one tiling without the intra-warpgroup
# overlap: with it ALiBi and a block mask spill 8-16 B, without it no case
# does and the P tile's 16 registers are free for a user's function (the
# SASS kept 24-34 of 34 exp2 under the in-flight P V in the other cases,
# 0 in ALiBi's). benchmarks/RESULTS.md, issue 44.
_FLEX_DEFAULTS = {
  64: Sm90ForwardConfig(block_q=64, block_kv=128, num_stages=3),
  96: Sm90ForwardConfig(block_q=64, block_kv=64, num_stages=3),
  128: Sm90ForwardConfig(block_q=64, block_kv=64, num_stages=3),
  256: Sm90ForwardConfig(
    block_q=64, block_kv=64, num_stages=2, persistent=False, overlap=False
  ),
}

# A flex call whose functions add no tile or vector of registers
# (`flex_tile.register_light`: a softcap or ALiBi score_mod, a positional
# mask_mod) at d128 runs the plain 64 x 128 tiling: 0 spills, and the
# per-step overhead (barriers, row max/sum shuffles) paid per 128 keys, not
# 64: perfcmp model B, softcap score_mod 1.16 -> 1.02 of the plain causal
# forward, ALiBi 1.42 -> 1.20 (RESULTS, issue 66). A bias or a vector read
# (document ids) spills 16-28 B there and keeps 64 keys.
_FLEX_LIGHT_DEFAULTS = {
  128: Sm90ForwardConfig(block_q=64, block_kv=128, num_stages=2),
}

# The heuristic default per head dim (bf16/fp16 alike): the largest K/V
# tile and deepest ring that fit. docs/design_notes.md#default-tilings
_DEFAULTS = {
  64: Sm90ForwardConfig(block_q=64, block_kv=192, num_stages=3),
  96: Sm90ForwardConfig(block_q=64, block_kv=128, num_stages=2),
  128: Sm90ForwardConfig(block_q=64, block_kv=128, num_stages=2),
  192: Sm90ForwardConfig(block_q=64, block_kv=64, num_stages=3),
  256: Sm90ForwardConfig(
    block_q=64, block_kv=64, num_stages=2, persistent=False
  ),
}


# Causal d64: ptxas hoists the 192-key tile's P V wait above every exp2
# (SASS 0/196 under an in-flight wgmma); 128-key tiles keep all of them
# under it, and perfcmp's model B per score block drops 1372 -> 1243
# cycles (tokamax 1359). Non-causal keeps its overlap at 192 keys (1151).
_CAUSAL_DEFAULTS = {
  64: Sm90ForwardConfig(block_q=64, block_kv=128, num_stages=2),
}


# Segment ids mask every step with each row's key bounds: at d64 the
# 192-key tile then spills 4-8 B (the sm_90a compile); 128 keys do not.
_SEGMENTED_DEFAULTS = {
  64: Sm90ForwardConfig(block_q=64, block_kv=128, num_stages=2),
}


def default_forward_config(spec: AttentionSpec) -> Sm90ForwardConfig | None:
  """The heuristic forward config for `spec` (checked against the estimate):
  the tuned default of its head dim (causal d64 has its own); with
  `head_dim_v != head_dim` that of the wider one if it fits both, else the
  space's largest K/V tile and deepest ring at 64 query rows (None if
  nothing fits)."""
  d, dv = spec.head_dim, spec.head_dim_v
  config = _DEFAULTS.get(max(d, dv), Sm90ForwardConfig())
  if spec.causal:
    config = _CAUSAL_DEFAULTS.get(max(d, dv), config)
  if spec.segmented:
    config = _SEGMENTED_DEFAULTS.get(max(d, dv), config)
  if spec.flex is not None:
    config = _FLEX_DEFAULTS.get(max(d, dv), config)
    if max(d, dv) in _FLEX_LIGHT_DEFAULTS and flex_tile.register_light(spec):
      config = _FLEX_LIGHT_DEFAULTS[max(d, dv)]
  if spec.dtype.itemsize != 2:
    return config  # a dtype the kernel refuses: `forward_unsupported` says so
  block = None if spec.flex is None else spec.flex.block
  if block is not None and (
    block[2] % config.block_q or block[3] % config.block_kv
  ):
    # A block mask's tiles must each hold whole kernel tiles (one state per
    # kernel step): the largest such tiling.
    space = [
      c
      for c in forward_config_space(d, spec.dtype.itemsize, dv)
      if block[2] % c.block_q == 0 and block[3] % c.block_kv == 0
    ]
    best = max(
      space,
      key=lambda c: (c.block_q == 64, c.block_kv, c.num_stages),
      default=config,
    )
    return dataclasses.replace(best, overlap=config.overlap)
  if forward_config_unsupported(config, d, spec.dtype.itemsize, dv) is None:
    return config
  assert d != dv, config  # the tuned defaults fit their own head dim
  space = [
    c
    for c in forward_config_space(d, spec.dtype.itemsize, dv)
    if c.block_q == 64
  ]
  return max(space, key=lambda c: (c.block_kv, c.num_stages), default=None)


def forward_config_space(
  head_dim: int, itemsize: int = 2, head_dim_v: int | None = None
) -> tuple[Sm90ForwardConfig, ...]:
  """Every tiling that fits at these head dims (the autotuning space), each
  once: persistent where that fits."""
  space = []
  for bq in BLOCK_Q_CHOICES:
    for bkv in BLOCK_KV_CHOICES:
      for st in STAGE_CHOICES:
        # Each tiling once: persistent where that fits, else one CTA a tile.
        for persistent in (True, False):
          c = Sm90ForwardConfig(bq, bkv, st, persistent)
          if (
            forward_config_unsupported(c, head_dim, itemsize, head_dim_v)
            is None
          ):
            space.append(c)
            break
  return tuple(space)


@dataclasses.dataclass(frozen=True)
class Sm90BackwardConfig:
  """Tiling of the sm90 backward: the fused kernel (`deterministic=False`:
  `block_q`, `block_kv`, `num_stages`, `dkdv_consumers`, `dkdv_head_splits`
  apply), or the dK/dV and dQ kernels (`deterministic=True`, and configs
  the fused kernel cannot run: `config_backward.fused_backward`).

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
