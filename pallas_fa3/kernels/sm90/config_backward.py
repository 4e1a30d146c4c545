"""Tilings of the sm90 backward kernels: shared-memory and register
estimates of `Sm90BackwardConfig`, its config space and heuristic default.
More: docs/kernels.md#the-backward-kernels.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pallas_fa3.kernels.sm90 import flex_tile
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
  config: Sm90BackwardConfig,
  head_dim: int,
  itemsize: int,
  head_dim_v: int | None = None,
) -> dict[str, int]:
  """Shared memory per CTA of each backward kernel ("dkdv", "dq", "fused"),
  in bytes; K, Q tiles have `head_dim` columns, V, dO tiles `head_dim_v`
  (default `head_dim`)."""
  st, bq, bkv, d = config.num_stages, config.block_q, config.block_kv, head_dim
  dv = head_dim if head_dim_v is None else head_dim_v
  c, qc = config.dkdv_consumers, config.dq_consumers
  shared = _dkdv_shared(config)
  tiles = 1 if shared else c
  # dK/dV: K and V tiles (one shared, or one per consumer); ring of Q, dO
  # tiles and lse, delta rows (head-dim chunks are slices of the same
  # buffers); shared: P and dS tiles by step parity and a rendezvous barrier.
  dkdv = (
    align_smem(tiles * bkv * d * itemsize)
    + align_smem(tiles * bkv * dv * itemsize)
    + align_smem(st * bq * d * itemsize)
    + align_smem(st * bq * dv * itemsize)
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
    align_smem(blocks * bq * d * itemsize)
    + align_smem(blocks * bq * dv * itemsize)
    + 2 * align_smem(blocks * bq * 4)
    + align_smem(st * bkv * d * itemsize)
    + align_smem(st * bkv * dv * itemsize)
    + (4 * st + 4 * blocks) * BARRIER_BYTES
  )
  if config.dq_head_splits == 2:
    dq += align_smem(2 * bq * bkv * itemsize) + BARRIER_BYTES
  # Fused: the dK/dV kernel plus float32 dQ staging per consumer and (own
  # tiles) dS^T tiles by step parity.
  fused = dkdv + align_smem(c * bq * fused_dq_cols(config, d, itemsize) * 4)
  if not shared:
    fused += align_smem(2 * c * bkv * bq * itemsize) + BARRIER_BYTES
  # No RESERVED_SMEM: no kernel has a cross-warp reduction.
  return {"dkdv": dkdv, "dq": dq, "fused": fused}


def fused_dq_cols(
  config: Sm90BackwardConfig, head_dim: int, itemsize: int
) -> int:
  """Head-dim columns of one consumer's dQ tile in the fused kernel: half
  when two consumers share a K/V tile, or own tiles whose halves are whole
  128-byte rows (d = 128: each adds its half over the CTA's keys, FA3's
  split); else all (each adds its own keys' dQ)."""
  half = head_dim // 2
  if config.dkdv_consumers == 2 and (
    _dkdv_shared(config) or half * itemsize % 128 == 0
  ):
    return half
  return head_dim


def _split_unsupported(
  config: Sm90BackwardConfig,
  field: str,
  head_dim: int,
  head_dim_v: int | None = None,
) -> str | None:
  """Why `config.<field>` (a head-dim split) cannot cut these head dims
  (the dK/dV split cuts V's too)."""
  splits = getattr(config, field)
  dims = [("head_dim", head_dim)]
  if field == "dkdv_head_splits" and head_dim_v not in (None, head_dim):
    dims.append(("head_dim_v", head_dim_v))
  for name, d in dims:
    cols = d // splits
    if splits > 1 and cols % 32:
      return (
        f"{config}: {field}={splits} leaves {cols}-column chunks of"
        f" {name} {d}; a split needs multiples of 32 (one 64-byte swizzle"
        " row)"
      )
  return None


def fused_unsupported(
  config: Sm90BackwardConfig,
  head_dim: int,
  itemsize: int,
  head_dim_v: int | None = None,
) -> str | None:
  """Why the fused backward (dQ by reduce-add) cannot run this config, or
  None (then `deterministic=False` runs it)."""
  if config.dkdv_consumers == 1 and config.dkdv_head_splits == 2:
    return f"{config}: the head dim split across CTAs would add dQ once per CTA"
  reason = _split_unsupported(config, "dkdv_head_splits", head_dim, head_dim_v)
  if reason:
    return reason
  need = backward_kernel_smem_bytes(config, head_dim, itemsize, head_dim_v)
  if need["fused"] > MAX_SMEM_BYTES:
    return (
      f"{config}: the fused backward needs {need['fused']} bytes of shared"
      f" memory at {_dims(head_dim, head_dim_v)}, over the sm90 limit of"
      f" {MAX_SMEM_BYTES}"
    )
  return None


# Float32 tile registers a fused consumer may hold, by layout, for a config
# to enter the space; calibrated with the sm_90a compile over `aot
# --backward-shapes` (benchmarks/RESULTS.md, "Fused backward" and issue
# 43). Two consumers: 208; own K/V tiles at 2 stages with dV at most 128
# columns: 224 (FA3's d128 64 x 64 layout, and 96/128), which compile
# without spills since the transposed tiles' mask compares against
# immediates (`masking.visible_tile_at`). Measured over it: 3 stages
# (d128: 4-8 B), 64/192 (dV's 96 registers: 4 B), the shared 64 x 128
# (4-32 B), all at causal or GQA shapes. Configs over it stay selectable
# (`fused_unsupported` does not check registers).
_FUSED_TILE_REGS = {"two": 208, "two, own tiles": 224, "one": 240}


def fused_fits_registers(
  config: Sm90BackwardConfig,
  head_dim: int,
  itemsize: int,
  head_dim_v: int | None = None,
) -> bool:
  """The fused register model within its room (the space's filter)."""
  regs = _fused_tile_regs(config, head_dim, itemsize, head_dim_v)
  if config.dkdv_consumers == 1:
    room = _FUSED_TILE_REGS["one"]
  elif _measured_own_tiles(config, head_dim, head_dim_v):
    room = _FUSED_TILE_REGS["two, own tiles"]
  else:
    room = _FUSED_TILE_REGS["two"]
  return regs <= room


def _fused_tile_regs(
  config: Sm90BackwardConfig,
  head_dim: int,
  itemsize: int,
  head_dim_v: int | None = None,
) -> int:
  """dK, dV accumulators, S^T and dP^T (shared: half of the keys each) and
  the dQ tile of one fused consumer."""
  bq, bkv = config.block_q, config.block_kv
  dv = head_dim if head_dim_v is None else head_dim_v
  sdp = 2 * bq * bkv // (2 if _dkdv_shared(config) else 1)
  dkdv = bkv * (head_dim + dv) // config.dkdv_head_splits
  dq = bq * fused_dq_cols(config, head_dim, itemsize)
  return (dkdv + sdp + dq) // 128


def fused_backward(spec: AttentionSpec, config: Sm90BackwardConfig) -> bool:
  """Whether `spec`'s gradients run the fused kernel: not deterministic,
  and `config` fits it (else the dK/dV and dQ kernels, the same function,
  run: CTA-split layouts, and d = 256, whose shared layout leaves no room
  for the dQ staging)."""
  if spec.deterministic:
    return False
  reason = fused_unsupported(
    config, spec.head_dim, spec.dtype.itemsize, spec.head_dim_v
  )
  return reason is None


# The own-tile fused consumer with flex options: up to d96. At d128 its
# 64 x 128 dK and dV beside the functions' reads and a score_mod's
# derivative spilled 48-336 B (ALiBi, softcap and document block-mask
# cases, 4 x 4096 x 16 heads, 2026-12-07); there the fused kernel runs its
# shared-tile layout (`fused_flex_config`'s second choice): 0 spills, model
# B 1.38-1.41x the plain fused backward, against the pair's 1.64-1.68x with
# a score_mod (its dK/dV kernel shared-tile too) and 1.28x with spills
# (8/16 B) with a document block mask (RESULTS.md, issue 66).
FUSED_FLEX_OWN_TILE_MAX_DIM = 96


def fused_flex_unsupported(
  spec: AttentionSpec, config: Sm90BackwardConfig
) -> str | None:
  """Why the fused kernel with `config` does not take `spec.flex` (it
  takes mask_mod, block masks and a score_mod, with its derivative), or
  None: a bias (dbias is dS, which the dQ kernel writes), a score_mod's
  floating arrays (their gradients are the deterministic kernels' row
  sums), or an own-tile layout past `FUSED_FLEX_OWN_TILE_MAX_DIM`."""
  fs = spec.flex
  if fs.bias is not None:
    return "a bias (dbias: the dQ kernel's dS)"
  if fs.score_mod is not None and flex_tile.float_positions(fs.score_mod):
    return "a score_mod's floating arrays (their gradients)"
  d = max(spec.head_dim, spec.head_dim_v)
  if not _dkdv_shared(config) and d > FUSED_FLEX_OWN_TILE_MAX_DIM:
    return (
      f"flex options in the own-tile layout at head dim {d} (registers:"
      f" up to {FUSED_FLEX_OWN_TILE_MAX_DIM})"
    )
  return None


def fused_flex_config(
  spec: AttentionSpec, tiling: Sm90BackwardConfig | None = None
) -> Sm90BackwardConfig | None:
  """The tiling the fused kernel runs `spec`'s flex options with (`tiling`,
  or the default, else the first of the fused space that takes them: the
  shared-tile layout at d128), or None where the dK/dV and dQ kernels take
  them:
  `deterministic`, a tiling that does not fuse, `fused_flex_unsupported`,
  or what `flex_tile.backward_unsupported` names."""
  if spec.deterministic:
    return None
  candidates = [tiling or default_backward_config(spec)]
  if tiling is None:  # then the shared-tile layout (`FUSED_FLEX_OWN_...`)
    d, dv, size = spec.head_dim, spec.head_dim_v, spec.dtype.itemsize
    small = dict(block_choices=(64,), stage_choices=(2,))
    candidates += _fused_space(d, size, dv, **small)
  for fused in dict.fromkeys(candidates):  # (the default is the space's first)
    if (
      fused_backward(spec, fused)
      and fused_flex_unsupported(spec, fused) is None
      and flex_tile.backward_unsupported(
        spec, fused.block_q, fused.block_kv, fused
      )
      is None
    ):
      return fused
  return None


def flex_backward(
  spec: AttentionSpec, tiling: Sm90BackwardConfig | None = None
) -> tuple[AttentionSpec, Sm90BackwardConfig | None, str | None]:
  """(spec, tiling, reason): the backward the kernels run `spec`'s flex
  options with: the fused kernel (`fused_flex_config`), else the dK/dV and
  dQ pair (the spec made `deterministic`, `tiling` or its default), or
  why neither takes them (`reason`: the blockwise backward runs)."""
  fused = fused_flex_config(spec, tiling)
  if fused is not None:
    return spec, fused, None
  det = dataclasses.replace(spec, deterministic=True)
  tiling = tiling or default_backward_config(det)
  reason = backward_unsupported(det, tiling)
  for cfg in (tiling, tiling.dq_config) if reason is None else ():
    reason = reason or flex_tile.backward_unsupported(
      det, cfg.block_q, cfg.block_kv, tiling
    )
  return det, tiling, reason


# How a call's gradients run in the sm90 backends (`BackwardPlan.form`):
# the fused kernel (dQ by reduce-add), the dK/dV and dQ pair (fixed-order
# dQ: deterministic, and the form that sums a bias's and a score_mod's
# arrays' gradients), or the blockwise twin's recomputation on the
# kernels' residuals (what the kernels cannot differentiate).
BackwardForm = Literal["fused", "pair", "blockwise"]


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
  """How an sm90 call's gradients run, decided once (`backward_plan`) and
  carried to the backward trace: its form, the spec and tiling the
  kernels run (the pair's spec is made `deterministic`), and why this form
  and not a faster one (empty when the fused kernel runs by default)."""

  form: BackwardForm
  spec: AttentionSpec
  tiling: Sm90BackwardConfig | None
  why: str = ""

  def describe(self) -> str:
    """One line for `pallas_fa3.explain`."""
    t = self.tiling
    tiles = ""
    if t is not None:
      tiles = (
        f", tiles {t.block_q}x{t.block_kv}, {t.num_stages} stages,"
        f" dK/dV consumers {t.dkdv_consumers} (head splits"
        f" {t.dkdv_head_splits}), dQ consumers {t.dq_consumers} (head"
        f" splits {t.dq_head_splits})"
      )
    name = {
      "fused": "the fused backward kernel (dQ by reduce-add)",
      "pair": "the dK/dV and dQ kernels (dQ summed in a fixed order)",
      "blockwise": "the blockwise twin's recomputation (pure JAX) on the"
      " kernels' residuals",
    }[self.form]
    why = f"; why: {self.why}" if self.why else ""
    return f"{name}{tiles}{why}"


# The fused kernel's own-tile consumers at d128 with segment ids or softcap
# (no GQA group: those take the shared tile, `_FUSED_GQA_MODIFIER_DEFAULTS`)
# spilled 252/228 B and 136/172 B (perfcmp, 4 x 4096, 16 heads; 124/160 B
# at the aot profile's 1 x 4096, 8 heads), and with a window open on both
# sides 96/72 B (aot --modifiers, (128, 128)). The shared-tile fused layout
# compiles segment ids and softcap without spills but models 1.34 and 1.41
# of the plain causal backward per block; the dK/dV and dQ pair 1.23 and
# 1.20, with 0 spills (softcap: 4/8 B at 8 heads; the window: 0). The
# default runs the pair (issue 66).
def fused_spills(spec: AttentionSpec, tiling: Sm90BackwardConfig) -> str | None:
  """Why the default fused tiling is not run for `spec` (its measured
  spills), or None."""
  if (
    spec.deterministic
    or max(spec.head_dim, spec.head_dim_v) != 128
    or tiling.dkdv_consumers != 2
    or _dkdv_shared(tiling)
  ):
    return None
  window = spec.window_size
  what = [
    name
    for name, on in (
      ("segment ids", spec.segmented),
      ("softcap", spec.softcap is not None),
      (
        "a window open on both sides",
        window is not None and None not in window and min(window) > 0,
      ),
    )
    if on
  ]
  if not what:
    return None
  return (
    f"the fused kernel's own-tile layout spills with {' and '.join(what)} at"
    " head dim 128 (72-252 B); the dK/dV and dQ kernels spill none or less"
  )


def backward_plan(
  spec: AttentionSpec, tiling: Sm90BackwardConfig | None = None
) -> BackwardPlan:
  """The one decision of how `spec`'s gradients run in the sm90 kernels
  (`tiling`: the user's, or None for the default): the fused kernel unless
  `deterministic`, a tiling or a flex option it does not take says the
  pair, or the kernels cannot differentiate the call (the blockwise twin,
  with the reason)."""
  if spec.flex is not None:
    run_spec, run_tiling, reason = flex_backward(spec, tiling)
    if reason is not None:
      return BackwardPlan("blockwise", spec, None, reason)
    if not run_spec.deterministic:
      return BackwardPlan("fused", run_spec, run_tiling)
    why = "deterministic=True"
    if not spec.deterministic:
      fused = tiling or default_backward_config(spec)
      why = (
        fused_flex_unsupported(spec, fused)
        or fused_unsupported(
          fused, spec.head_dim, spec.dtype.itemsize, spec.head_dim_v
        )
        or flex_tile.backward_unsupported(
          spec, fused.block_q, fused.block_kv, fused
        )
        or "the fused kernel does not take these flex options"
      )
    return BackwardPlan("pair", run_spec, run_tiling, why)
  if tiling is None:
    reason = backward_unsupported(spec)
    if reason:
      return BackwardPlan("blockwise", spec, None, reason)
    tiling = default_backward_config(spec)
    why = fused_spills(spec, tiling)
    if why is not None:
      det = dataclasses.replace(spec, deterministic=True)
      return BackwardPlan("pair", spec, default_backward_config(det), why)
  if fused_backward(spec, tiling):
    return BackwardPlan("fused", spec, tiling)
  why = (
    "deterministic=True"
    if spec.deterministic
    else (
      fused_unsupported(
        tiling, spec.head_dim, spec.dtype.itemsize, spec.head_dim_v
      )
      or "the tiling does not fuse"
    )
  )
  return BackwardPlan("pair", spec, tiling, why)


def backward_smem_bytes(
  config: Sm90BackwardConfig,
  head_dim: int,
  itemsize: int,
  head_dim_v: int | None = None,
) -> int:
  """Shared memory of the larger of the two deterministic backward kernels
  (dK/dV and dQ), per CTA."""
  sizes = backward_kernel_smem_bytes(config, head_dim, itemsize, head_dim_v)
  return max(sizes["dkdv"], sizes["dq"])


# Float32 tile registers a backward consumer may hold, by consumers per CTA
# (setmaxnreg 240 with two, 256 with one). Calibrated with the sm_90a
# compile: docs/design_notes.md#tile-budgets. Two dK/dV consumers owning
# 64 x 64 tiles at 2 stages with dV at most 128 columns: 192 (measured
# without spills up to d128 over `aot --backward-shapes`, issue 43; 64/192
# spills 4 B causal); other two-consumer forms keep the conservative 128.
_DKDV_TILE_REGS = {2: 128, 1: 192}
_DKDV_OWN_64_TILE_REGS = 192
_DQ_TILE_REGS = {2: 128, 1: 192}
_DKDV_SHARED_TILE_REGS = 160


def _measured_own_tiles(
  config: Sm90BackwardConfig, head_dim: int, head_dim_v: int | None
) -> bool:
  """Two dK/dV consumers owning 64 x 64 tiles at 2 stages with dV at most
  128 columns: the form whose larger rooms (fused and deterministic) were
  measured without spills (issue 43; 3 stages and 64/192 spill)."""
  dv = head_dim if head_dim_v is None else head_dim_v
  return (
    config.dkdv_consumers == 2
    and not _dkdv_shared(config)
    and (config.block_q, config.block_kv, config.num_stages) == (64, 64, 2)
    and dv <= 128
  )


def _dkdv_shared(config: Sm90BackwardConfig) -> bool:
  """Two dK/dV consumers sharing one K/V tile, splitting its head dim."""
  return config.dkdv_consumers == 2 and config.dkdv_head_splits == 2


def _dkdv_tile_regs(
  config: Sm90BackwardConfig, head_dim: int, head_dim_v: int | None = None
) -> int:
  """dK, dV accumulators (block_kv x d / splits and x dv / splits) plus S^T
  and dP^T tiles (shared: each consumer computes half of their key
  columns)."""
  dv = head_dim if head_dim_v is None else head_dim_v
  cols = (head_dim + dv) // config.dkdv_head_splits
  sdp = config.block_q * (1 if _dkdv_shared(config) else 2)
  return config.block_kv * (cols + sdp) // 128


def _dq_tile_regs(config: Sm90BackwardConfig, head_dim: int) -> int:
  """dQ accumulator (block_q x d / splits) plus S and dP tiles (shared rows:
  each consumer computes half of their key columns)."""
  splits = config.dq_head_splits
  return (
    config.block_q * (head_dim // splits + 2 * config.block_kv // splits) // 128
  )


def _dims(head_dim: int, head_dim_v: int | None) -> str:
  """ "head_dim 128" or "head_dims 192/128" for messages."""
  if head_dim_v in (None, head_dim):
    return f"head_dim {head_dim}"
  return f"head_dims {head_dim}/{head_dim_v}"


def backward_config_unsupported(
  config: Sm90BackwardConfig,
  head_dim: int,
  itemsize: int,
  deterministic: bool = True,
  head_dim_v: int | None = None,
) -> str | None:
  """Why this backward config cannot run at these head dims, or None. Not
  `deterministic`, a config the fused kernel runs is supported; any other
  runs the dK/dV and dQ kernels (`fused_backward`) and is checked for them."""
  dims = _dims(head_dim, head_dim_v)
  if (
    not deterministic
    and fused_unsupported(config, head_dim, itemsize, head_dim_v) is None
  ):
    return None
  for field in ("dkdv_head_splits", "dq_head_splits"):
    reason = _split_unsupported(config, field, head_dim, head_dim_v)
    if reason:
      return reason
  need = backward_smem_bytes(config, head_dim, itemsize, head_dim_v)
  if need > MAX_SMEM_BYTES:
    return (
      f"{config} needs {need} bytes of shared memory at {dims}, over the"
      f" sm90 limit of {MAX_SMEM_BYTES}"
    )
  dkdv = _dkdv_tile_regs(config, head_dim, head_dim_v)
  if _dkdv_shared(config):
    room = _DKDV_SHARED_TILE_REGS
  elif _measured_own_tiles(config, head_dim, head_dim_v):
    room = _DKDV_OWN_64_TILE_REGS
  else:
    room = _DKDV_TILE_REGS[config.dkdv_consumers]
  if dkdv > room:
    return (
      f"{config}: the dK/dV kernel keeps {dkdv} float32 tile registers"
      f" per thread at {dims}; room for {room}"
    )
  dq, room = _dq_tile_regs(config, head_dim), _DQ_TILE_REGS[config.dq_consumers]
  if dq > room:
    return (
      f"{config}: the dQ kernel keeps {dq} float32 tile registers per"
      f" thread at {dims}; room for {room}"
    )
  return None


def backward_unsupported(
  spec: AttentionSpec, config: Sm90BackwardConfig | None = None
) -> str | None:
  """Why the sm90 backward kernels cannot differentiate `spec`, or None."""
  reason = forward_unsupported(spec)
  if reason:
    return reason
  d, dv = spec.head_dim, spec.head_dim_v
  if config is None and not backward_config_space(
    d, spec.dtype.itemsize, spec.deterministic, dv
  ):
    return f"no backward tiling fits {_dims(d, dv)}"
  if config is not None:
    return backward_config_unsupported(
      config, d, spec.dtype.itemsize, spec.deterministic, dv
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
  head_dim_v: int | None = None,
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
    if (
      backward_config_unsupported(config, head_dim, itemsize, True, head_dim_v)
      is None
    ):
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
  head_dim_v: int | None = None,
) -> tuple[Sm90BackwardConfig, ...]:
  found = (
    _fit(bq, bkv, st, consumers, splits, head_dim, itemsize, head_dim_v)
    for consumers, splits in layouts
    for bq in block_choices
    for bkv in block_choices
    for st in stage_choices
  )
  return tuple(c for c in found if c is not None)


def backward_config_space(
  head_dim: int,
  itemsize: int = 2,
  deterministic: bool = True,
  head_dim_v: int | None = None,
) -> tuple[Sm90BackwardConfig, ...]:
  """Every backward tiling that fits at this head_dim, in order of
  preference. Deterministic (the dK/dV and dQ kernels): consumers owning
  whole K/V tiles, then two consumers sharing a tile's head dim; the head
  dim split across CTAs only where neither fits; one dQ consumer only
  where two do not fit. Not deterministic: the tilings the fused kernel
  runs (two consumers owning K/V tiles, two sharing one, one), or where it
  fits none (d = 256) the deterministic ones."""
  if not deterministic:
    fused = _fused_space(head_dim, itemsize, head_dim_v=head_dim_v)
    if fused:
      return fused
  return _space(head_dim, itemsize, head_dim_v=head_dim_v)


def _fused_space(
  head_dim: int,
  itemsize: int,
  head_dim_v: int | None = None,
  **choices: tuple[int, ...],
) -> tuple[Sm90BackwardConfig, ...]:
  blocks = choices.get("block_choices", (64, 128))
  stages = choices.get("stage_choices", STAGE_CHOICES)
  found = (
    Sm90BackwardConfig(bq, bkv, st, consumers, splits)
    for consumers, splits in _OWN_TILES[:1] + _SHARED_TILE + _OWN_TILES[1:]
    for bq in blocks
    for bkv in blocks
    for st in stages
  )
  return tuple(
    c
    for c in found
    if fused_unsupported(c, head_dim, itemsize, head_dim_v) is None
    and fused_fits_registers(c, head_dim, itemsize, head_dim_v)
  )


def _space(
  head_dim: int,
  itemsize: int,
  head_dim_v: int | None = None,
  **choices: tuple[int, ...],
) -> tuple[Sm90BackwardConfig, ...]:
  tilings = lambda layouts: _tilings(
    head_dim, itemsize, layouts, head_dim_v=head_dim_v, **choices
  )
  space = tilings(_OWN_TILES) + tilings(_SHARED_TILE)
  return space or tilings(_CTA_SPLIT)


# A score_mod traced into the deterministic kernels (`flex_tile`): its
# derivative tile sits beside P^T and dS^T, and the default d128 layout
# (two consumers owning 64 keys each) spills 4-8 B (`pallas-fa3 aot
# --flex`); the shared-tile layout (the consumers split the head dim) and a
# lone consumer compile with 0; the shared one keeps two consumers busy.
_FLEX_SCORE_DEFAULTS = {
  128: Sm90BackwardConfig(
    block_q=64, block_kv=64, num_stages=2, dkdv_consumers=2,
    dkdv_head_splits=2, dq_consumers=2, dq_head_splits=1,
  ),
}  # fmt: skip
# ... and with floating arrays read by key position, whose gradients only
# the own-tile dK/dV consumer sums (its rows are keys): a lone consumer,
# the head dim split across two CTAs (d128-d256, where the defaults share
# a tile). 0 spills for a per-key bias and for one beside a per-query
# scale, where two own-tile consumers spill 124 B with the pair at d128
# (benchmarks/RESULTS.md).
_FLEX_KEY_PARAM_DEFAULTS = {
  d: Sm90BackwardConfig(
    block_q=64, block_kv=64, num_stages=2, dkdv_consumers=1,
    dkdv_head_splits=2, dq_consumers=2, dq_head_splits=1 if d == 128 else 2,
  )
  for d in (128, 192, 256)
}  # fmt: skip


# The fused kernel at d128 with GQA and a window, softcap, sinks or segment
# ids: the own-tile consumers (FA3's layout) spilled 4-184 B (dV 128) and
# up to 76 B (dV 64) at (2048, 16/4) and (1000/1100, 32/8) bf16 (`aot`,
# benchmarks/RESULTS.md, issue 43), the deterministic pair 16-84 B; the
# shared-tile fused layout compiles all of them with 0. (128/96 has no
# 32-column halves of V: it keeps the own tiles, spilling in 5 of 22.)
# Without a group, softcap with segment ids takes it too: the pair
# `fused_spills` picks for either alone spilled 12-20 B inside its dK/dV
# loop with both (perfcmp 4 x 4096 x 16: model B 7750 against the shared
# tile's 8500, 1.41x the plain causal backward; issue 66).
_FUSED_GQA_MODIFIER_DEFAULTS = {
  (128, dv): Sm90BackwardConfig(
    block_q=64, block_kv=64, num_stages=2, dkdv_consumers=2,
    dkdv_head_splits=2, dq_consumers=2, dq_head_splits=1,
  )
  for dv in (128, 64)
}  # fmt: skip


def _modified(spec: AttentionSpec) -> bool:
  """A window, softcap, sinks or segment ids."""
  return (
    spec.window_size is not None
    or spec.softcap is not None
    or spec.sinks
    or spec.segmented
  )


def default_backward_config(spec: AttentionSpec) -> Sm90BackwardConfig:
  """The heuristic backward tiling for `spec`: 64 x 64 tiles, 2 stages, in
  the first form of `backward_config_space` (for `spec.deterministic`)
  that fits.

  Raises:
    ValueError: no form fits `spec.head_dim`.
  """
  small = dict(block_choices=(64,), stage_choices=(2,))
  d, dv, size = spec.head_dim, spec.head_dim_v, spec.dtype.itemsize
  flex = getattr(spec, "flex", None)
  # A score derivative beside P^T and dS^T: a score_mod's, or softcap's
  # with a GQA group (the own tiles spilled 16-48 B in 2 of 11 d128 calls
  # with softcap at (2048, 16/4); the shared tile 0 in all 4 softcap ones).
  derivative = (flex is not None and flex.score_mod is not None) or (
    spec.softcap is not None and spec.group_size > 1
  )
  if derivative and spec.deterministic:
    by_key = flex is not None and flex_tile.kernel_params(spec, "dkdv")
    table = _FLEX_KEY_PARAM_DEFAULTS if by_key else _FLEX_SCORE_DEFAULTS
    preset = table.get(max(d, dv))
    if (
      preset is not None
      and backward_config_unsupported(preset, d, size, True, dv) is None
    ):
      return preset
  if (
    not spec.deterministic
    and flex is None
    and (
      (spec.group_size > 1 and _modified(spec))
      or (spec.softcap is not None and spec.segmented)
    )
    and (d, dv) in _FUSED_GQA_MODIFIER_DEFAULTS
  ):
    return _FUSED_GQA_MODIFIER_DEFAULTS[d, dv]
  space = () if spec.deterministic else _fused_space(d, size, dv, **small)
  space = space or _space(d, size, dv, **small)
  if not space:
    raise ValueError(f"no backward config fits {_dims(d, dv)}")
  return space[0]
