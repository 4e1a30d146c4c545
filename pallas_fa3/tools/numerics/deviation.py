"""`pallas-fa3 numerics deviation`: forward deviation against a float64
golden, after "Is Flash Attention Stable?" (Golden et al. 2024, arXiv
2405.02803): materialized and flash attention with every intermediate in
the format under study, kernel-like baseline, the blockwise backend and the
Hopper kernels where they run, over a sequence-length sweep and a tile
sweep; the checks against the paper are in `deviation_checks`, the
markdown and plots in `deviation_report`: docs/numerics.md#deviation.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3 import backends
from pallas_fa3.attention import flash_attention
from pallas_fa3.backends.blockwise import BlockwiseConfig
from pallas_fa3.spec import SUPPORTED_DTYPES, check_int, make_spec
from pallas_fa3.tools.numerics import inputs, lowprec, metrics

DTYPES = tuple(str(d) for d in SUPPORTED_DTYPES)  # float16, bfloat16, float32
KERNELS = ("interpret", "mosaic")
_SQUARES = ((16, 16), (32, 32), (64, 64), (128, 128), (256, 256))
# Swapped pairs (Br < Bc, then Br > Bc), each sharing its Bc with a square.
_SWAPPED = ((32, 128), (128, 32), (64, 256), (256, 64))
_MAX_TILE = 8192


def _check_ints(name: str, values, low: int = 1, high: int | None = None):
  if not values:
    raise ValueError(f"DeviationConfig.{name} must not be empty")
  for x in values:
    check_int(f"DeviationConfig.{name} entries", x, minimum=low, maximum=high)


def _check_choices(name: str, values, choices) -> None:
  if not values:
    raise ValueError(f"DeviationConfig.{name} must not be empty")
  for x in values:
    if x not in choices:
      raise ValueError(
        f"DeviationConfig.{name} entries must be in {choices}; got {x!r}"
      )


@dataclasses.dataclass(frozen=True)
class DeviationConfig:
  """What the deviation study measures (the CPU default; see GPU_DEFAULT).

  Attributes:
    seqs: sequence lengths of the sequence sweep (seq_q = seq_kv).
    head_dims: head dims of the sequence sweep.
    distributions: input distributions ("normal", "outliers").
    dtypes: formats F.
    modes: "all" (every intermediate in F) and/or "kernel" (kernel-like).
    tile: (Br, Bc) of the sequence sweep.
    tiles: (Br, Bc) pairs of the tile sweep.
    tile_seq: sequence length of the tile sweep.
    tile_head_dim: head dim of the tile sweep.
    tile_dtypes: formats of the tile sweep.
    batch: batch size of every case.
    heads: heads of every case.
    seed: input seed (each case draws from its own derived generator).
    kernels: kernel backends tried in the sequence sweep (kernel-like mode).
    interpret_max_seq: longest sequence run through `interpret` (slow).
    flash_algorithm: the all-in-F flash: "fa2" (normalize once at the end,
      as our kernels) or "fa1" (FlashAttention-1: normalize after every
      tile, each tile against its own max).
  """

  seqs: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096)
  head_dims: tuple[int, ...] = (64, 128)
  distributions: tuple[str, ...] = inputs.DISTRIBUTIONS
  dtypes: tuple[str, ...] = ("bfloat16", "float16", "float32")
  modes: tuple[str, ...] = lowprec.MODES
  tile: tuple[int, int] = (64, 64)
  tiles: tuple[tuple[int, int], ...] = _SQUARES + _SWAPPED
  tile_seq: int = 2048
  tile_head_dim: int = 64
  tile_dtypes: tuple[str, ...] = ("bfloat16",)
  batch: int = 1
  heads: int = 4
  seed: int = 0
  kernels: tuple[str, ...] = KERNELS
  # The interpreter takes ~20 s per call at seq 128 x 4 heads on 2 cores.
  interpret_max_seq: int = 128
  flash_algorithm: str = "fa2"

  def __post_init__(self):
    for name in (
      "seqs",
      "head_dims",
      "distributions",
      "dtypes",
      "modes",
      "tiles",
      "tile_dtypes",
      "kernels",
    ):
      object.__setattr__(
        self,
        name,
        tuple(
          tuple(x) if isinstance(x, list) else x for x in getattr(self, name)
        ),
      )
    object.__setattr__(self, "tile", tuple(self.tile))
    _check_ints("seqs", self.seqs)
    _check_ints("head_dims", self.head_dims, high=256)
    _check_choices("distributions", self.distributions, inputs.DISTRIBUTIONS)
    _check_choices("dtypes", self.dtypes, DTYPES)
    _check_choices("tile_dtypes", self.tile_dtypes, DTYPES)
    _check_choices("modes", self.modes, lowprec.MODES)
    if self.kernels:
      _check_choices("kernels", self.kernels, KERNELS)
    if len(self.tile) != 2:
      raise ValueError(
        f"DeviationConfig.tile must be (Br, Bc); got {self.tile!r}"
      )
    _check_ints("tile", self.tile, high=_MAX_TILE)
    for pair in self.tiles:
      if len(pair) != 2:
        raise ValueError(
          f"DeviationConfig.tiles entries must be (Br, Bc); got {pair!r}"
        )
      _check_ints("tiles", pair, high=_MAX_TILE)
    _check_ints("tile_seq", (self.tile_seq,))
    _check_ints("tile_head_dim", (self.tile_head_dim,), high=256)
    _check_ints("batch", (self.batch,))
    _check_ints("heads", (self.heads,))
    _check_ints("seed", (self.seed,), low=0)
    _check_ints("interpret_max_seq", (self.interpret_max_seq,), low=0)
    _check_choices(
      "flash_algorithm", (self.flash_algorithm,), lowprec.ALGORITHMS
    )

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


# On a GPU: longer sequences (the paper's 16k) and more heads.
GPU_DEFAULT = DeviationConfig(
  seqs=(128, 256, 512, 1024, 2048, 4096, 8192, 16384),
  tile_seq=8192,
  heads=8,
  interpret_max_seq=0,
)


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One computation compared with the golden."""

  algorithm: str  # "baseline" or "flash"
  mode: str  # "all" or "kernel"
  impl: str  # "study", "blockwise", "interpret", "mosaic"
  tile: tuple[int, int] | None  # (Br, Bc); None: tile-free or the kernel's

  @property
  def name(self) -> str:
    tile = f" {self.tile[0]}x{self.tile[1]}" if self.tile else ""
    who = self.algorithm if self.impl == "study" else self.impl
    return f"{who}/{self.mode}{tile}"


def _seq_candidates(cfg: DeviationConfig) -> list[Candidate]:
  cands = []
  if "all" in cfg.modes:
    cands += [
      Candidate("baseline", "all", "study", None),
      Candidate("flash", "all", "study", cfg.tile),
    ]
  if "kernel" in cfg.modes:
    cands += [
      Candidate("baseline", "kernel", "study", None),
      Candidate("flash", "kernel", "blockwise", cfg.tile),
    ]
    cands += [Candidate("flash", "kernel", k, None) for k in cfg.kernels]
  return cands


def _tile_candidates(cfg: DeviationConfig) -> list[Candidate]:
  cands = [Candidate("baseline", m, "study", None) for m in cfg.modes]
  for tile in cfg.tiles:
    if "all" in cfg.modes:
      cands.append(Candidate("flash", "all", "study", tile))
    if "kernel" in cfg.modes:
      cands.append(Candidate("flash", "kernel", "blockwise", tile))
  return cands


@dataclasses.dataclass(frozen=True)
class Problem:
  """One set of inputs: a sweep point."""

  sweep: str  # "seq" or "tile"
  seq: int
  head_dim: int
  distribution: str
  dtype: str


def plan(cfg: DeviationConfig) -> list[tuple[Problem, list[Candidate]]]:
  """Every (problem, candidates) pair of both sweeps."""
  cases = []
  for dtype in cfg.dtypes:
    for d in cfg.head_dims:
      for dist in cfg.distributions:
        for seq in cfg.seqs:
          cases.append(
            (Problem("seq", seq, d, dist, dtype), _seq_candidates(cfg))
          )
  for dtype in cfg.tile_dtypes:
    for dist in cfg.distributions:
      cases.append(
        (
          Problem("tile", cfg.tile_seq, cfg.tile_head_dim, dist, dtype),
          _tile_candidates(cfg),
        )
      )
  return cases


def _skip_reason(cand: Candidate, q, cfg: DeviationConfig) -> str | None:
  if cand.impl in KERNELS:
    reason = backends.get(cand.impl).device_reason() or (
      backends.unsupported_reason(cand.impl, make_spec(q, q, q))
    )
    if reason:
      return reason
    if cand.impl == "interpret" and q.shape[1] > cfg.interpret_max_seq:
      return (
        f"interpret runs only up to seq {cfg.interpret_max_seq}"
        " (--interpret-max-seq): the interpreter is slow"
      )
  return None


def _compute(cand: Candidate, q, k, v, cfg: DeviationConfig) -> jax.Array:
  if cand.algorithm == "baseline":
    return lowprec.baseline(q, k, v, mode=cand.mode)
  if cand.impl == "study":
    return lowprec.flash_all(
      q,
      k,
      v,
      block_q=cand.tile[0],
      block_kv=cand.tile[1],
      algorithm=cfg.flash_algorithm,
    )
  config = BlockwiseConfig(*cand.tile) if cand.impl == "blockwise" else None
  return flash_attention(q, k, v, implementation=cand.impl, config=config)


def _problem_inputs(problem: Problem, cfg: DeviationConfig):
  """(q, k, v) in F as jax arrays, and the float64 golden of those values."""
  # One generator per (seed, sweep point), so a case's inputs do not depend
  # on which other cases run; the formats share the float64 draw.
  key = (
    cfg.seed,
    problem.seq,
    problem.head_dim,
    inputs.DISTRIBUTIONS.index(problem.distribution),
    0 if problem.sweep == "seq" else 1,
  )
  rng = np.random.default_rng(key)
  shape = (cfg.batch, problem.seq, cfg.heads, problem.head_dim)
  raw = inputs.draw(rng, problem.distribution, shape)
  rounded = [inputs.round_to(x, problem.dtype) for x in raw]
  golden = lowprec.golden(*rounded)
  arrays = [jnp.asarray(x, jnp.float32).astype(problem.dtype) for x in rounded]
  return arrays, golden


def run(cfg: DeviationConfig, *, progress: bool = True) -> dict:
  """Runs both sweeps; returns {"records": [...], "wall_s": ...}."""
  from pallas_fa3.tools.numerics import report  # pylint: disable=g-import-not-at-top

  start = time.perf_counter()
  cases = plan(cfg)
  records = []
  total = sum(len(c) for _, c in cases)
  with report.progress(total, "deviation", progress) as advance:
    for problem, cands in cases:
      arrays, golden = _problem_inputs(problem, cfg)
      base = dict(
        dataclasses.asdict(problem),
        batch=cfg.batch,
        heads=cfg.heads,
        golden_max_abs=float(np.abs(golden).max()),
        golden_rms=float(np.sqrt(np.mean(golden**2))),
      )
      for cand in cands:
        rec = dict(
          base,
          candidate=cand.name,
          algorithm=cand.algorithm,
          mode=cand.mode,
          impl=cand.impl,
          block_q=cand.tile[0] if cand.tile else None,
          block_kv=cand.tile[1] if cand.tile else None,
          status="ok",
          reason="",
        )
        reason = _skip_reason(cand, arrays[0], cfg)
        if reason:
          rec.update(status="skipped", reason=reason)
        else:
          try:
            out = np.asarray(
              jax.block_until_ready(_compute(cand, *arrays, cfg))
            )
            rec.update(metrics.deviation_stats(out, golden))
          except NotImplementedError as e:
            rec.update(status="skipped", reason=f"NotImplementedError: {e}")
          except Exception as e:  # pylint: disable=broad-except
            rec.update(status="error", reason=f"{type(e).__name__}: {e}")
        records.append(rec)
        advance(
          f"{problem.sweep} seq {problem.seq} d {problem.head_dim}"
          f" {problem.distribution} {problem.dtype} {cand.name}"
        )
  return {"records": records, "wall_s": time.perf_counter() - start}
