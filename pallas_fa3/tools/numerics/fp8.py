"""`pallas-fa3 numerics fp8`: the FA3 paper's FP8 error table (its Table 3),
with the inputs, metric and methods of `fp8_methods` (outlier inputs in
float16, RMSE against float64), on the blockwise twin and on the Hopper
kernels where they run, plus the ratios the paper quotes and the RMSE of
each FP8 error source alone: docs/numerics.md#fp8.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from pallas_fa3 import backends
from pallas_fa3.backends.blockwise import BlockwiseConfig
from pallas_fa3.kernels.sm90.config_fp8 import FP8_HEAD_DIMS
from pallas_fa3.spec import check_int, make_spec
from pallas_fa3.tools.numerics import fp8_methods, metrics, report
from pallas_fa3.tools.numerics.fp8_methods import BASELINES, METHODS, PAPER_RMSE

# Implementation label of the baselines' rows.
MATERIALIZED = "materialized"


@dataclasses.dataclass(frozen=True)
class FP8StudyConfig:
  """The table's problem size (CPU default).

  Attributes:
    batch, seq, heads, head_dim: q, k, v are `[batch, seq, heads, head_dim]`;
      head_dim one of the FP8 kernel's head dims.
    block_q, block_kv: tiles of block quantization (and of the flash) of the
      blockwise FP8 rows and of the error sources; None: the FP8 kernel's
      default tiles for head_dim. Kernel rows use the kernel's default config.
    seed: `jax.random.key(seed)` draws the inputs and the rotation's key
      (as `fp8_methods.error_table` does).
    kernels: kernel backends tried for the flash rows.
    interpret_max_seq: longest sequence run through `interpret` (the
      interpreter is slow: tens of seconds per call at seq 256 on a CPU).
  """

  batch: int = 1
  seq: int = 2048
  heads: int = 4
  head_dim: int = 128
  block_q: int | None = None
  block_kv: int | None = None
  seed: int = 0
  kernels: tuple[str, ...] = ("interpret", "mosaic")
  interpret_max_seq: int = 256

  def __post_init__(self):
    object.__setattr__(self, "kernels", tuple(self.kernels))
    for name in (
      "batch",
      "seq",
      "heads",
      "head_dim",
      "block_q",
      "block_kv",
      "seed",
      "interpret_max_seq",
    ):
      value = getattr(self, name)
      if value is None and name in ("block_q", "block_kv"):
        continue
      low = 0 if name in ("seed", "interpret_max_seq") else 1
      check_int(f"FP8StudyConfig.{name}", value, minimum=low)
    if self.head_dim not in FP8_HEAD_DIMS:
      raise ValueError(
        f"FP8StudyConfig.head_dim must be one of the FP8"
        f" kernel's head dims {FP8_HEAD_DIMS}; got"
        f" {self.head_dim}"
      )
    BlockwiseConfig(*self.tiles())  # within the blockwise limits
    for k in self.kernels:
      if k not in ("interpret", "mosaic"):
        raise ValueError(
          f"FP8StudyConfig.kernels entries must be 'interpret'"
          f" or 'mosaic'; got {k!r}"
        )

  def tiles(self) -> tuple[int, int]:
    """(block_q, block_kv) of the blockwise FP8 rows, defaults filled in."""
    block_q, block_kv = fp8_methods.default_tiles(self.head_dim)
    return (self.block_q or block_q, self.block_kv or block_kv)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


GPU_DEFAULT = FP8StudyConfig(batch=4, seq=4096, heads=16, interpret_max_seq=0)


def _kernel_reason(
  impl: str, method: str, q, k, v, key, cfg: FP8StudyConfig
) -> str | None:
  if impl in (MATERIALIZED, "blockwise"):
    return None
  spec = make_spec(q, k, v, fp8=fp8_methods.fp8_config(method, key))
  reason = backends.get(impl).device_reason() or backends.unsupported_reason(
    impl, spec
  )
  if reason is None and impl == "interpret" and cfg.seq > cfg.interpret_max_seq:
    reason = (
      f"interpret runs only up to seq {cfg.interpret_max_seq}"
      " (--interpret-max-seq): the interpreter is slow"
    )
  return reason


def _row(
  method: str, impl: str, got=None, golden=None, status="ok", reason=""
) -> dict:
  row = dict(
    method=method,
    impl=impl,
    status=status,
    reason=reason,
    paper_rmse=PAPER_RMSE.get(method),
  )
  if got is not None:
    row.update(metrics.deviation_stats(got, golden))
  return row


def _measure(
  method: str, impl: str, q, k, v, golden, key, cfg: FP8StudyConfig
) -> dict:
  reason = _kernel_reason(impl, method, q, k, v, key, cfg)
  if reason:
    return _row(method, impl, status="skipped", reason=reason)
  try:
    got = fp8_methods.run_method(
      method,
      q,
      k,
      v,
      key,
      implementation="blockwise" if impl == MATERIALIZED else impl,
      tiles=cfg.tiles(),
    )
    return _row(method, impl, np.asarray(got, np.float64), golden)
  except NotImplementedError as e:
    return _row(
      method, impl, status="skipped", reason=f"NotImplementedError: {e}"
    )
  except Exception as e:  # pylint: disable=broad-except
    return _row(method, impl, status="error", reason=f"{type(e).__name__}: {e}")


def run(cfg: FP8StudyConfig, *, progress: bool = True) -> dict:
  """Measures every row of the table and the error sources.

  Returns:
    {"rows": [...], "ratios": [...], "sources": {...}, "tiles": (block_q,
    block_kv) of the blockwise FP8 rows, "golden_rms", "wall_s"}.
  """
  start = time.perf_counter()
  q, k, v, golden, key = fp8_methods.draw(
    jax.random.key(cfg.seed), cfg.batch, cfg.seq, cfg.heads, cfg.head_dim
  )
  steps = [
    (m, impl)
    for m in METHODS
    for impl in (
      (MATERIALIZED,) if m in BASELINES else ("blockwise",) + cfg.kernels
    )
  ]
  rows = []
  with report.progress(len(steps) + 1, "fp8", progress) as advance:
    for method, impl in steps:
      rows.append(_measure(method, impl, q, k, v, golden, key, cfg))
      advance(f"{method} ({impl})")
    sources = fp8_methods.source_errors(q, k, v, golden, key, tiles=cfg.tiles())
    advance("error sources")
  return {
    "rows": rows,
    "ratios": ratios(rows),
    "sources": sources,
    "tiles": cfg.tiles(),
    "golden_rms": float(np.sqrt(np.mean(golden**2))),
    "wall_s": time.perf_counter() - start,
  }


def _rmse_of(rows, method, impls) -> float | None:
  for impl in impls:
    for r in rows:
      if r["method"] == method and r["impl"] == impl and r["status"] == "ok":
        return r["rmse"]
  return None


def ratios(rows: list[dict]) -> list[dict]:
  """The paper's two comparisons, ours beside theirs (> 1: the second is better)."""
  flash16 = _rmse_of(rows, "flash FP16", ("mosaic", "blockwise"))
  base16 = _rmse_of(rows, "baseline FP16", (MATERIALIZED,))
  base8 = _rmse_of(rows, "baseline FP8 per-tensor", (MATERIALIZED,))
  out = [
    dict(
      comparison="baseline FP16 / flash FP16",
      paper=PAPER_RMSE["baseline FP16"] / PAPER_RMSE["flash FP16"],
      ours=metrics.ratio(base16, flash16) if base16 and flash16 else None,
    )
  ]
  for impl in ("mosaic", "interpret", "blockwise"):
    ours = _rmse_of(rows, "ours FP8", (impl,))
    if ours and base8:
      out.append(
        dict(
          comparison=f"baseline FP8 per-tensor / ours FP8 ({impl})",
          paper=PAPER_RMSE["baseline FP8 per-tensor"] / PAPER_RMSE["ours FP8"],
          ours=metrics.ratio(base8, ours),
        )
      )
  return out


def markdown(result: dict) -> str:
  cfg = result["config"]
  block_q, block_kv = result["tiles"]
  lines = report.header_lines(
    "pallas-fa3 numerics fp8 (FA3 Table 3)",
    result["environment"],
    [
      f"- q, k, v `[{cfg['batch']}, {cfg['seq']}, {cfg['heads']},"
      f" {cfg['head_dim']}]`, entries N(0,1) + N(0,100) * Bernoulli(0.001)"
      " rounded to fp16, drawn from `jax.random.key"
      f"({cfg['seed']})`; RMSE against the float64 attention of those"
      f" values (rms of the golden output: {result['golden_rms']:.3g});"
      " methods as defined in `pallas_fa3/tools/numerics/fp8_methods.py`",
      f"- blockwise FP8 rows: block quantization tiles {block_q} x d (q)"
      f" and {block_kv} x d (k, v); kernel rows: the kernel's default"
      " config; the paper does not state its tiles",
      f"- wall time {result['wall_s']:.0f} s",
    ],
  )
  lines += ["## RMSE against float64", ""]
  lines += report.table(
    [
      "method",
      "implementation",
      "paper RMSE",
      "our RMSE",
      "our max |diff|",
      "status",
    ],
    [
      [
        r["method"],
        r["impl"],
        r["paper_rmse"],
        r.get("rmse"),
        r.get("max_abs"),
        r["status"] + (f": {r['reason']}" if r["reason"] else ""),
      ]
      for r in result["rows"]
    ],
  )
  lines += ["", "## Ratios (> 1: the second method is more accurate)", ""]
  lines += report.table(
    ["comparison", "paper", "ours"],
    [[x["comparison"], x["paper"], x["ours"]] for x in result["ratios"]],
  )
  sources = result["sources"]
  lines += [
    "",
    "## What limits ours FP8: one error source at a time",
    "",
    *report.table(
      ["error source alone (float64 otherwise)", "RMSE"], list(sources.items())
    ),
  ]
  ours = _rmse_of(result["rows"], "ours FP8", ("blockwise",))
  if ours:
    quad = np.sqrt(
      sum(x**2 for name, x in sources.items() if "not rotated" not in name)
    )
    lines += [
      "",
      f"The three sources of ours in quadrature: {quad:.3g};"
      f" ours FP8 (blockwise) measured: {ours:.3g}.",
    ]
  return "\n".join(lines) + "\n"


def plot(result: dict, out_dir: str) -> list[str]:
  """rmse.png: ours (bars) and the paper's figure (markers) per method."""
  plt = report.pyplot()
  rows = [r for r in result["rows"] if r["status"] == "ok"]
  if not rows:
    return []
  fig, ax = plt.subplots(figsize=(8, 4))
  labels = [f"{r['method']}\n({r['impl']})" for r in rows]
  ax.bar(range(len(rows)), [r["rmse"] for r in rows], label="ours")
  ax.plot(
    range(len(rows)),
    [
      float("nan") if r["paper_rmse"] is None else r["paper_rmse"] for r in rows
    ],
    "k_",
    markersize=20,
    mew=2,
    label="paper",
  )
  ax.set_xticks(
    range(len(rows)), labels, rotation=60, ha="right", fontsize="x-small"
  )
  ax.set(yscale="log", ylabel="RMSE vs float64", title="FA3 Table 3 setup")
  ax.legend()
  return [report.save_figure(fig, out_dir, "rmse.png")]
