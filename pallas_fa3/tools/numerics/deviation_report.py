"""The deviation study's report: markdown, plots and headline figures, from
the records of `deviation` and the checks of `deviation_checks`:
docs/numerics.md#deviation.
"""

from __future__ import annotations

import collections
import statistics
from typing import Any

import numpy as np

from pallas_fa3.spec import cdiv
from pallas_fa3.tools.numerics import deviation_checks, metrics, report

_SEQ_KINDS = (
  "baseline/all",
  "flash/all",
  "baseline/kernel",
  "blockwise/kernel",
  "interpret/kernel",
  "mosaic/kernel",
)


def markdown(result: dict) -> str:
  env, cfg, records = result["environment"], result["config"], result["records"]
  lines = report.header_lines(
    "pallas-fa3 numerics deviation",
    env,
    [
      f"- inputs: batch {cfg['batch']}, heads {cfg['heads']}, seq_q = seq_kv,"
      " non-causal; q, k, v drawn in float64 and rounded to F; golden ="
      " float64 attention of the rounded values",
      f"- all-in-F flash: {cfg['flash_algorithm']} ("
      + (
        "normalized once at the end"
        if cfg["flash_algorithm"] == "fa2"
        else "FlashAttention-1: normalized after every tile"
      )
      + ")",
      f"- sequence sweep at tile Br x Bc = {cfg['tile'][0]}x{cfg['tile'][1]};"
      f" tile sweep at seq {cfg['tile_seq']}, d {cfg['tile_head_dim']}",
      f"- wall time {result['wall_s']:.0f} s",
    ],
  )
  lines += ["## Checks against Golden et al. 2024 (arXiv 2405.02803)", ""]
  lines += report.table(
    ["claim", "paper", "ours", "verdict", "note"],
    [
      [c["claim"], c["paper"], c["ours"], c["verdict"], c["note"]]
      for c in result["checks"]
    ],
  )
  points = deviation_checks.by_point(records)
  kinds = [k for k in _SEQ_KINDS if any(k in p for p in points.values())]
  lines += [
    "",
    "## Sequence sweep: max |out - golden|",
    "",
    "ratio = flash/all / baseline/all.",
    "",
  ]
  rows = []
  for (dt, d, dist, seq), got in sorted(points.items()):
    ratio = (
      metrics.ratio(got["flash/all"]["max_abs"], got["baseline/all"]["max_abs"])
      if "flash/all" in got and "baseline/all" in got
      else None
    )
    rows.append(
      [dt, d, dist, seq]
      + [got[k]["max_abs"] if k in got else None for k in kinds]
      + [ratio]
    )
  lines += report.table(
    ["dtype", "d", "inputs", "seq"] + kinds + ["ratio"], rows
  )
  lines += ["", "## Sequence sweep, bfloat16: mean |out - golden|", ""]
  lines += report.table(
    ["d", "inputs", "seq"] + kinds,
    [
      [d, dist, seq] + [got[k]["mean_abs"] if k in got else None for k in kinds]
      for (dt, d, dist, seq), got in sorted(points.items())
      if dt == "bfloat16"
    ],
  )
  tiles = deviation_checks.tile_table(records) + deviation_checks.tile_table(
    records, "blockwise/kernel"
  )
  if tiles:
    lines += ["", "## Tile sweep (max / mean |out - golden|)", ""]
    lines += report.table(
      ["dtype", "inputs", "candidate", "Br", "Bc", "max", "mean", "rmse"],
      [
        [
          r["dtype"],
          r["distribution"],
          deviation_checks.candidate_kind(r),
          r["block_q"],
          r["block_kv"],
          r["max_abs"],
          r["mean_abs"],
          r["rmse"],
        ]
        for r in tiles
      ],
    )
  skipped = collections.Counter(
    (r["candidate"], r["status"], r["reason"])
    for r in records
    if r["status"] != "ok"
  )
  lines += ["", "## Skipped or failed", ""]
  lines += [
    f"- {c} ({s}, {n} cases): {why}" for (c, s, why), n in skipped.items()
  ] or ["- none"]
  lines += [
    "",
    "Every figure (mean, std and RMSE of |diff| too) is in"
    f" `{report.JSON_FILE}`.",
  ]
  return "\n".join(lines) + "\n"


def _seq_axis(ax, seqs) -> None:
  ax.set_xscale("log", base=2)
  ax.set_xticks(seqs, [str(n) for n in seqs])
  ax.minorticks_off()


def plot(result: dict, out_dir: str) -> list[str]:
  """deviation_vs_seq_<mode>.png, ratio_vs_seq.png, deviation_vs_tile.png."""
  plt = report.pyplot()
  records, paths = result["records"], []
  points = deviation_checks.by_point(records)
  groups = sorted({(d, dist) for (_, d, dist, _) in points})
  colors = {"bfloat16": "C0", "float16": "C1", "float32": "C2"}
  for mode, kinds in (
    ("all", ("baseline/all", "flash/all")),
    ("kernel", ("baseline/kernel", "blockwise/kernel")),
  ):
    if not groups or not any(k in p for p in points.values() for k in kinds):
      continue
    ncol = min(2, len(groups))
    nrow = cdiv(len(groups), ncol)
    fig, axes = plt.subplots(
      nrow, ncol, squeeze=False, figsize=(5.5 * ncol, 4 * nrow)
    )
    for ax, (d, dist) in zip(axes.ravel(), groups):
      for dt in colors:
        for kind, style in zip(kinds, ("--", "-")):
          pts = sorted(
            (seq, got[kind]["max_abs"])
            for (x, dd, di, seq), got in points.items()
            if (x, dd, di) == (dt, d, dist) and kind in got
          )
          if pts:
            ax.plot(
              *zip(*pts),
              style,
              marker="o",
              color=colors[dt],
              label=f"{kind.split('/')[0]} {dt}",
            )
      ax.set(
        yscale="log",
        title=f"d={d}, {dist}",
        xlabel="sequence length",
        ylabel="max |out - golden|",
      )
      _seq_axis(ax, sorted({p[3] for p in points}))
      ax.grid(True, alpha=0.3)
      ax.legend(fontsize="x-small")
    fig.suptitle(f"deviation vs sequence length, mode '{mode}'")
    paths.append(
      report.save_figure(fig, out_dir, f"deviation_vs_seq_{mode}.png")
    )
  ratios = deviation_checks.flash_baseline_ratios(records)
  if ratios:
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for d, dist in groups:
      pts = sorted(
        (x["seq"], x["ratio"])
        for x in ratios
        if (x["head_dim"], x["distribution"]) == (d, dist)
      )
      if pts:
        ax.plot(*zip(*pts), "o-", label=f"d={d}, {dist}")
    ax.axhline(
      deviation_checks.PAPER_RATIO_BF16, color="k", ls=":", label="paper ~10x"
    )
    _seq_axis(ax, sorted({x["seq"] for x in ratios}))
    ax.set(
      yscale="log",
      xlabel="sequence length",
      ylabel="max dev flash / baseline",
      title="bf16, all intermediates in F",
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="x-small")
    paths.append(report.save_figure(fig, out_dir, "ratio_vs_seq.png"))
  tiles = deviation_checks.tile_table(records) + deviation_checks.tile_table(
    records, "blockwise/kernel"
  )
  if tiles:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    labels = sorted(
      {(r["block_q"], r["block_kv"]) for r in tiles}, key=lambda t: (t[1], t[0])
    )
    xs = {t: i for i, t in enumerate(labels)}
    for ax, metric in zip(axes, ("max_abs", "mean_abs")):
      series = collections.defaultdict(list)
      for r in tiles:
        series[
          (deviation_checks.candidate_kind(r), r["dtype"], r["distribution"])
        ].append((xs[(r["block_q"], r["block_kv"])], r[metric]))
      for name, pts in sorted(series.items()):
        ax.plot(*zip(*sorted(pts)), "o-", label=" ".join(name))
      ax.set_xticks(
        range(len(labels)), [f"{a}x{b}" for a, b in labels], rotation=45
      )
      ax.set(
        yscale="log",
        xlabel="Br x Bc (sorted by Bc)",
        ylabel=f"{metric.split('_')[0]} |out - golden|",
      )
      ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize="x-small")
    fig.suptitle(
      f"tile sweep (seq {tiles[0]['seq']}, d {tiles[0]['head_dim']})"
    )
    paths.append(report.save_figure(fig, out_dir, "deviation_vs_tile.png"))
  return paths


def summary_numbers(result: dict) -> dict[str, Any]:
  """Headline figures for the terminal and RESULTS.md."""
  ratios = [
    x["ratio"]
    for x in deviation_checks.flash_baseline_ratios(result["records"])
  ]
  return {
    "median_ratio_bf16_all": statistics.median(ratios) if ratios else None,
    "verdicts": {c["claim"]: c["verdict"] for c in result["checks"]},
    "max_ratio_bf16_all": float(np.max(ratios)) if ratios else None,
  }
