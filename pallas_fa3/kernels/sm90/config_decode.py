"""The Hopper decode kernel's tiling (one CTA per sequence, KV head, query
tile and split; the GQA group's query rows packed into 64-row wgmma
tiles), its
shared-memory and register estimates, what it serves (`decode_unsupported`,
`mla_reason`) and the split-KV choice.
More: docs/design_notes.md#decode-kernel.
"""

from __future__ import annotations

import dataclasses

from pallas_fa3.kernels.sm90 import hardware
from pallas_fa3.kernels.sm90.config import (
  BARRIER_BYTES,
  HOPPER_SMS,
  KERNEL_HEAD_DIMS,
  MAX_SMEM_BYTES,
  RESERVED_SMEM,
  align_smem,
)
from pallas_fa3.kvcache import DecodeSpec, invariant_splits
from pallas_fa3.spec import cdiv, check_int_fields

# Query rows of one CTA: one wgmma M (the rows of a GQA group times seq_q,
# padded).
DECODE_ROWS = 64
BLOCK_KV_CHOICES = (64, 128, 256)
STAGE_CHOICES = (2, 3, 4, 6, 8)
# Float32 registers per thread for S and O of the consumer warpgroup (one
# consumer: 256 registers; the rest holds addresses, the softmax, masks).
_ACC_REGS = 192
# Splits at most (the partials are [splits, b, hk, rows, dv] float32).
MAX_SPLITS = 128
# A contiguous cache's length: a multiple of the TMA box's 8-row tiling. A
# page: whole 64-row groups of the swizzled tile (one TMA destination each).
_TMA_ROWS = 8
_PAGE_ROWS = 64
# The shortest contiguous cache the kernels read (one 64-key tile).
MIN_CAPACITY = 64


@dataclasses.dataclass(frozen=True)
class Sm90DecodeConfig:
  """Tiling of the Hopper decode kernel (hashable: a static argument).

  Attributes:
    block_kv: keys per K/V tile (a multiple of a paged cache's page size,
      or of the page size's divisor).
    num_stages: K/V tiles in flight (the ring's depth: HBM latency).
  """

  block_kv: int = 128
  num_stages: int = 4

  def __post_init__(self) -> None:
    check_int_fields(
      self,
      block_kv=dict(choices=BLOCK_KV_CHOICES),
      num_stages=dict(choices=STAGE_CHOICES),
    )


def converted_stages(spec: DecodeSpec) -> int:
  """An e4m3 cache's float16 tiles between the converter warpgroup and the
  consumer: two (the converter fills one while the consumer reads the
  other), one at d + dv > 256 (shared memory)."""
  return 2 if spec.head_dim + spec.head_dim_v <= 256 else 1


def out_cols(head_dim_v: int) -> int:
  """Columns of the float32 output staging tile: O leaves in chunks."""
  return 64 if head_dim_v % 64 == 0 else 32


def decode_smem_bytes(spec: DecodeSpec, config: Sm90DecodeConfig) -> int:
  """Shared memory per CTA as Mosaic allocates it: Q, the K and V rings
  (an e4m3 cache: the e4m3 rings and the float16 ones), the float32
  output and lse staging, Mosaic's reserve, the barriers."""
  item = 2 if spec.fp8_cache else spec.dtype.itemsize  # (float16 products)
  ring = lambda n, d, size: align_smem(n * config.block_kv * d * size)
  rings = ring(config.num_stages, spec.head_dim, item) + ring(
    config.num_stages, spec.head_dim_v, item
  )
  barriers = 1 + 4 * config.num_stages
  if spec.fp8_cache:
    conv = converted_stages(spec)
    rings = sum(
      ring(config.num_stages, d, 1) + ring(conv, d, 2)
      for d in (spec.head_dim, spec.head_dim_v)
    )
    barriers = 1 + 2 * config.num_stages + 4 * conv
  return (
    align_smem(DECODE_ROWS * spec.head_dim * item)
    + rings
    + align_smem(DECODE_ROWS * out_cols(spec.head_dim_v) * 4)
    + align_smem(DECODE_ROWS * 4)
    + RESERVED_SMEM
    + barriers * BARRIER_BYTES
  )


def _acc_regs(block_kv: int, head_dim_v: int) -> int:
  """Float32 registers per consumer thread for S `[64, block_kv]` and O
  `[64, head_dim_v]`."""
  return DECODE_ROWS * (block_kv + head_dim_v) // hardware.WARPGROUP_THREADS


def flex_reason(spec: DecodeSpec, config: Sm90DecodeConfig) -> str | None:
  """Why the decode kernel cannot compile `spec.flex` (a score_mod and
  mask_mod traced into its tile loop, on packed rows or one query head
  per CTA: `flex_packs`), or None."""
  from pallas_fa3.kernels.sm90 import flex_tile  # pylint: disable=g-import-not-at-top

  fs, names = spec.flex, ", ".join(spec.flex.names())
  if spec.v_in_k:
    return f"{names} in the MLA decode kernel (blockwise serves them)"
  if spec.fp8_cache:
    return f"{names} with an e4m3 cache in the decode kernel"
  if fs.block is not None:
    if fs.dense or fs.mask_mod is None:
      return (
        "block_mask from a dense mask: the decode kernel masks partial"
        " tiles with a mask_mod"
      )
    if spec.seq_q > 1 and fs.block[2] < DECODE_ROWS:
      return (
        f"block_mask's {fs.block[2]}-query tiles with seq_q={spec.seq_q}:"
        f" a {DECODE_ROWS}-row tile's queries, at traced positions, may"
        " reach into more than two block-mask rows (the decode kernel"
        f" reads two; create_block_mask(block_q=>={DECODE_ROWS}))"
      )
    if fs.block[3] % config.block_kv:
      return (
        f"block_mask's {fs.block[3]}-key tiles are not multiples of the"
        f" decode kernel's block_kv {config.block_kv}"
      )
  for fn, score in ((fs.score_mod, True), (fs.mask_mod, False)):
    if fn is not None:
      try:
        flex_tile.plan(fn, score, spec.capacity, spec.capacity)
      except flex_tile.Refused as e:
        return str(e)
  return None


def mla_reason(spec: DecodeSpec) -> str | None:
  """Why head dims past the one-consumer kernel's largest cannot be served
  with a V cache of their own, in numbers (the MLA kernel serves them with
  `v_cache=None`); None for smaller head dims."""
  largest = max(KERNEL_HEAD_DIMS)
  d, dv = spec.head_dim, spec.head_dim_v
  if max(d, dv) <= largest:
    return None
  small = Sm90DecodeConfig(min(BLOCK_KV_CHOICES), min(STAGE_CHOICES))
  o_regs = _acc_regs(0, dv)
  return (
    f"head_dim {d} / head_dim_v {dv} are past the kernel's largest"
    f" ({largest}): with its one consumer warpgroup, the {DECODE_ROWS} x"
    f" {dv} float32 O accumulator alone takes {o_regs} registers per thread"
    f" (a thread has at most {hardware.MAX_THREAD_REGISTERS}; S and O:"
    f" {_acc_regs(small.block_kv, dv)}, budget {_ACC_REGS}), and"
    f" the smallest config {small} needs {decode_smem_bytes(spec, small)}"
    f" bytes of shared memory (limit {MAX_SMEM_BYTES}). The MLA kernel"
    " (two consumers, V read from the K tile) serves v_cache=None with"
    " head_dim_v; a separate v_cache at these dims goes to blockwise"
  )


# The MLA kernel (`decode_mla.py`): two consumers, each owning half of
# O's columns; 64-key tiles (P's tile, V zeroed in 64-row chunks).
MLA_CONSUMERS = 2
MLA_BLOCK_KV = 64
# The TMA box's largest extent (elements): a K chunk's columns.
_TMA_BOX = 256


def mla_chunks(spec: DecodeSpec) -> tuple[tuple[int, int], ...]:
  """(first column, columns) of the K tile's shared-memory chunks: V's two
  halves (one per consumer), then the RoPE columns past head_dim_v."""
  half = spec.head_dim_v // MLA_CONSUMERS
  rope = spec.head_dim - spec.head_dim_v
  return ((0, half), (half, half)) + (
    ((spec.head_dim_v, rope),) if rope else ()
  )


def mla_smem_bytes(spec: DecodeSpec, config: Sm90DecodeConfig) -> int:
  """Shared memory of the MLA kernel as Mosaic places it: Q's chunks in
  one region with the output staging (a union), the K ring's chunks, P,
  the row rescale, the barriers (no cross-warp reduction reserve). An
  e4m3 cache: `num_stages` e4m3 tiles and one float16 tile (the products
  are 16-bit either way)."""
  item = 2  # Q, P and the tiles the wgmma reads: bf16/fp16 (float16: e4m3)
  widths = [w for _, w in mla_chunks(spec)]
  q = sum(align_smem(DECODE_ROWS * w * item) for w in widths)
  out = MLA_CONSUMERS * align_smem(DECODE_ROWS * 64 * 4) + 2 * align_smem(
    DECODE_ROWS * 4
  )
  tile = lambda stages, size: sum(
    align_smem(stages * config.block_kv * w * size) for w in widths
  )
  if spec.fp8_cache:  # the e4m3 ring, its TMA barriers, the float16 slot
    ring = tile(config.num_stages, 1) + tile(converted_stages(spec), item)
    barriers = 1 + config.num_stages + 2 * converted_stages(spec) + 3
  else:
    ring = tile(config.num_stages, item)
    barriers = 1 + 2 * config.num_stages + 3
  p = align_smem(DECODE_ROWS * config.block_kv * item)
  return (
    max(q, out)
    + ring
    + p
    + align_smem(DECODE_ROWS * 4)
    + barriers * BARRIER_BYTES
  )


def is_mla(spec: DecodeSpec) -> bool:
  """A call for the MLA kernel: `v_cache=None` (V in the K cache)."""
  return spec.v_in_k


def mla_unsupported(
  spec: DecodeSpec, config: Sm90DecodeConfig | None = None
) -> str | None:
  """Why the MLA kernel cannot serve `spec` (v_cache=None) with `config`,
  or None."""
  d, dv = spec.head_dim, spec.head_dim_v
  if dv % (64 * MLA_CONSUMERS) or dv // MLA_CONSUMERS > _TMA_BOX:
    return (
      f"head_dim_v {dv}: the MLA kernel splits V's columns over"
      f" {MLA_CONSUMERS} consumers in whole 64-column tiles of at most"
      f" {_TMA_BOX}: head_dim_v must be a multiple of 128 up to 512"
    )
  rope = d - dv
  if rope % 64 or rope > _TMA_BOX:
    return (
      f"head_dim {d} - head_dim_v {dv} = {rope} RoPE columns: the MLA"
      f" kernel takes them as one chunk of whole 64-column tiles, at most"
      f" {_TMA_BOX}"
    )
  config = config or default_decode_config(spec)
  if config.block_kv != MLA_BLOCK_KV:
    return (
      f"{config}: the MLA kernel takes block_kv={MLA_BLOCK_KV} (P's tile"
      " and V's zeroing are one 64-row wgmma tile)"
    )
  layout = _layout_problem(spec, config)
  if layout:
    return layout
  need = mla_smem_bytes(spec, config)
  if need > MAX_SMEM_BYTES:
    return (
      f"{config} needs {need} bytes of shared memory in the MLA kernel,"
      f" over {MAX_SMEM_BYTES}"
    )
  return None


def _layout_problem(spec: DecodeSpec, config: Sm90DecodeConfig) -> str | None:
  """A page size or cache length the kernels' TMA boxes cannot tile."""
  if spec.paged:
    ps = spec.page_size
    if ps % _PAGE_ROWS:
      return (
        f"page_size {ps} is not a multiple of {_PAGE_ROWS} (a page is one"
        " TMA box of whole swizzled 64-row groups)"
      )
    if config.block_kv % ps and ps % config.block_kv:
      return (
        f"block_kv {config.block_kv} and page_size {ps}: one must divide"
        " the other"
      )
  elif spec.capacity % _TMA_ROWS or spec.capacity < config.block_kv:
    return (
      f"cache_len {spec.capacity} must be a multiple of {_TMA_ROWS} and at"
      f" least block_kv {config.block_kv} (TMA boxes of the cache)"
    )
  return None


def kernel_spec(spec: DecodeSpec) -> DecodeSpec:
  """The call the kernels run for `spec`: itself, or, for a cache whose
  layout the TMA boxes cannot tile (pages not a multiple of 64 rows, FA3's
  1 and 4; a contiguous length not a multiple of 8 or under 64), a
  contiguous one of each sequence's slots, padded to a multiple of 8 rows
  and at least 64 (`decode.repacked` gathers it, one XLA copy of
  the cache per call). With flex options the capacity (their positions'
  range) must stay; a call that would change it keeps its layout."""
  cap = spec.capacity
  if spec.paged:
    if spec.page_size % _PAGE_ROWS == 0:
      return spec
  elif cap % _TMA_ROWS == 0 and cap >= MIN_CAPACITY:
    return spec
  padded = max(cdiv(cap, _TMA_ROWS) * _TMA_ROWS, MIN_CAPACITY)
  if spec.flex is not None and padded != cap:
    return spec
  return dataclasses.replace(
    spec,
    paged=False,
    capacity=padded,
    page_size=0,
    pages_per_seq=0,
    cache_rows=spec.batch,
    batch_idx=False,
  )


def decode_unsupported(
  spec: DecodeSpec, config: Sm90DecodeConfig | None = None
) -> str | None:
  """Why the decode kernel cannot serve `spec` (`kernel_spec(spec)`, the
  call it runs) with `config`, or None."""
  spec = kernel_spec(spec)
  if spec.flex is not None:
    reason = flex_reason(spec, config or default_decode_config(spec))
    if reason:
      return reason
  if str(spec.dtype) not in ("bfloat16", "float16"):
    return f"the decode kernel takes bfloat16 or float16; got {spec.dtype}"
  if is_mla(spec):
    return mla_unsupported(spec, config)
  reason = mla_reason(spec)
  if reason:
    return reason
  for name, d in (("head_dim", spec.head_dim), ("head_dim_v", spec.head_dim_v)):
    if d not in KERNEL_HEAD_DIMS:
      return f"{name} {d} is not one of the kernel's {KERNEL_HEAD_DIMS}"
  config = config or default_decode_config(spec)
  layout = _layout_problem(spec, config)
  if layout:
    return layout
  regs = _acc_regs(config.block_kv, spec.head_dim_v)
  if regs > _ACC_REGS:
    return (
      f"{config}: S and O take {regs} float32 registers per thread at"
      f" head_dim_v {spec.head_dim_v}, over the budget {_ACC_REGS}"
    )
  need = decode_smem_bytes(spec, config)
  if need > MAX_SMEM_BYTES:
    return (
      f"{config} needs {need} bytes of shared memory, over {MAX_SMEM_BYTES}"
    )
  return None


def default_decode_config(spec: DecodeSpec) -> Sm90DecodeConfig:
  """128-key tiles (64 where S and O need the registers or a contiguous
  cache is shorter), as many stages as the shared memory holds, up to 8
  (decoding is bound by HBM latency). An e4m3 cache takes 64-key tiles
  where 128-key ones would leave fewer than 4 stages (its float16 tiles
  take shared memory too)."""
  smem = mla_smem_bytes if is_mla(spec) else decode_smem_bytes

  def deepest(block: int) -> Sm90DecodeConfig:
    best = Sm90DecodeConfig(block, 2)
    for stages in STAGE_CHOICES:
      config = Sm90DecodeConfig(block, stages)
      if smem(spec, config) <= MAX_SMEM_BYTES:
        best = config
    return best

  if is_mla(spec):  # the deepest ring of 64-key tiles that fits
    return deepest(MLA_BLOCK_KV)
  block = 128  # a larger page holds several tiles; a 64-key page: two
  if spec.head_dim_v > 128:
    block = 64  # S and O registers
  if not spec.paged and spec.capacity < block:
    block = 64
  fs = spec.flex
  if fs is not None and fs.block is not None and fs.block[3] % block:
    block = 64  # whole tiles of the block mask's (64: its smallest)

  best = deepest(block)
  if spec.fp8_cache and block == 128 and best.num_stages < 4:
    best = deepest(64)
  return best


def flex_packs(spec: DecodeSpec) -> bool:
  """Whether a flex call's functions run on the GQA-packed rows (each K/V
  tile read once for the group): no block mask, and each function's
  `UserFunction.packed` form is one the kernels compile (it reads no
  captured array at a head or query index: a softcap score_mod, causal or
  window mask_mods, kv-indexed arrays). Otherwise one query head per CTA:
  ALiBi's slopes[head] or a document mask's ids[q_idx] at a packed row
  would be a gather `flex_tile` does not load."""
  from pallas_fa3.kernels.sm90 import flex_tile  # pylint: disable=g-import-not-at-top

  fs, g = spec.flex, spec.group_size
  if fs is None:
    return True
  if fs.block is not None or g == 1:
    return False
  for fn, score in ((fs.score_mod, True), (fs.mask_mod, False)):
    if fn is not None:
      try:
        flex_tile.plan(fn.packed(g), score, spec.capacity * g, spec.capacity)
      except flex_tile.Refused:
        return False
  return True


def packed_heads(spec: DecodeSpec) -> int:
  """Query heads packed into one CTA's rows: the KV head's group (flex
  options too where `flex_packs`), else one (a score_mod / mask_mod then
  sees one head per tile)."""
  return spec.group_size if flex_packs(spec) else 1


def grid_heads(spec: DecodeSpec) -> int:
  """The grid's head axis: KV heads, or query heads with flex options that
  do not pack."""
  return spec.heads_kv if flex_packs(spec) else spec.heads_q


def query_tiles(spec: DecodeSpec) -> int:
  """64-row query tiles per (sequence, grid head): its packed heads times
  seq_q rows (a prefill chunk takes several; a CTA each)."""
  return cdiv(packed_heads(spec) * spec.seq_q, DECODE_ROWS)


# The shortest split-KV range the automatic count makes, in tiles: shorter
# ones leave the K/V ring's stages idle and add a partial per few tiles.
MIN_SPLIT_TILES = 4
# Model time within this fraction of the best counts as a tie: the fewest
# splits then wins (fewer partials written and merged).
_SPLIT_TIE = 0.02


def partial_rows(spec: DecodeSpec) -> int:
  """Rows of each split's float32 partial (output and lse) per (sequence,
  grid head): only the live packed rows (the group times seq_q, whole
  8-row groups of the staging tile's swizzle) with one query tile; whole
  64-row tiles with several."""
  tiles = query_tiles(spec)
  if tiles > 1:
    return tiles * DECODE_ROWS
  return cdiv(packed_heads(spec) * spec.seq_q, _TMA_ROWS) * _TMA_ROWS


@dataclasses.dataclass(frozen=True)
class SplitChoice:
  """One candidate split-KV count of a call and what it costs in the
  model: `ctas` (batch x grid heads x query tiles x splits), the `waves`
  they take over the SMs (CTAs / SMs, fractional), `tiles` per range,
  `steps` (the K/V tiles the busiest SM streams: HBM-bound, each SM at its
  share of the bandwidth) and the float32 partial bytes written (read
  again by the merge)."""

  splits: int
  ctas: int
  waves: float
  tiles: int
  steps: int
  partial_bytes: int


def split_choices(
  spec: DecodeSpec, config: Sm90DecodeConfig
) -> list[SplitChoice]:
  """Every split count the automatic choice weighs: 1 up to the capacity's
  tiles over `MIN_SPLIT_TILES` (at most `MAX_SPLITS`)."""
  base = spec.batch * grid_heads(spec) * query_tiles(spec)
  tiles = cdiv(spec.capacity, config.block_kv)
  rows = partial_rows(spec)
  out = []
  for s in range(1, max(1, min(tiles // MIN_SPLIT_TILES, MAX_SPLITS)) + 1):
    per = cdiv(tiles, s)
    ctas = base * s
    # out and lse in float32 (one split too: the merge rounds them)
    written = ctas // query_tiles(spec) * rows * (spec.head_dim_v + 1) * 4
    out.append(
      SplitChoice(
        s, ctas, ctas / HOPPER_SMS, per, cdiv(ctas, HOPPER_SMS) * per, written
      )
    )
  return out


def default_splits(spec: DecodeSpec, config: Sm90DecodeConfig) -> int:
  """Split-KV ranges per sequence: the count whose CTAs fill their last
  wave best, i.e. the fewest K/V tiles streamed by the busiest SM
  (`split_choices`; within 2% of the best, the fewest splits); with
  `batch_invariant`, fixed runs of keys whatever the batch
  (`kvcache.invariant_splits`). `split_table` says why."""
  if spec.batch_invariant:
    return invariant_splits(spec, config.block_kv, MAX_SPLITS)
  return _best(split_choices(spec, config)).splits


def _best(choices: list[SplitChoice]) -> SplitChoice:
  least = min(c.steps for c in choices)
  return next(c for c in choices if c.steps <= least * (1 + _SPLIT_TIE))


def split_table(spec: DecodeSpec, config: Sm90DecodeConfig) -> str:
  """The automatic split count's reasons, as a Markdown table: each
  candidate's CTAs, waves, tiles per range, tiles on the busiest SM and
  partial bytes, the chosen one marked."""
  choices = split_choices(spec, config)
  best = _best(choices)
  lines = [
    "| splits | CTAs | waves | tiles per range | tiles on the busiest SM"
    " | partial bytes |",
    "|---|---|---|---|---|---|",
  ]
  for c in choices:
    mark = " (chosen)" if c is best else ""
    lines.append(
      f"| {c.splits}{mark} | {c.ctas} | {c.waves:.2f} | {c.tiles} |"
      f" {c.steps} | {c.partial_bytes} |"
    )
  return "\n".join(lines)
