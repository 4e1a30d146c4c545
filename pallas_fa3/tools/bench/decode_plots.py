"""PNG plots of the decode sweep: K/V bytes read per second vs cache length.

One figure per dtype; one panel per (batch, heads, head dim, cache layout,
ragged or not); one line per implementation (and per requested split
count where a panel has several) at the median time, error bars from the
fastest and the slowest call; the HBM peak as a dashed line where the
device has one. Made from the records, matplotlib's Agg backend.
"""

from __future__ import annotations

import collections
import math
import os
from typing import Any

from pallas_fa3.tools.bench import plots, report

_PANEL_INCHES = (4.5, 3.5)
_MAX_COLUMNS = 3


def _panel(r: dict) -> str:
  layout = "contiguous" if r["page_size"] is None else f"page {r['page_size']}"
  ragged = ", ragged" if r["ragged"] else ""
  return (
    f"b={r['batch']}, {r['heads_q']}/{r['heads_kv']} heads,"
    f" d={r['head_dim']}, {layout}{ragged}"
  )


def _band(r: dict) -> tuple[float, float, float]:
  """(slowest, median, fastest) GB/s: bytes / max, median, min time."""
  rate = lambda ms: r["kv_bytes"] / (ms * 1e-3) / 1e9
  return (
    rate(r["time_max_ms"]),
    rate(r["time_median_ms"]),
    rate(r["time_min_ms"]),
  )


def figures(
  records: list[dict],
  environment: dict | None = None,
  peak: float | None = None,
) -> list[tuple[str, Any]]:
  """(file name, Figure) per dtype; `peak`: HBM bytes/s or None."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  env = environment or {}
  device = env.get("device", "unknown device")
  if device.startswith("cpu") and env.get("cpu_count"):
    device += f" ({env['cpu_count']} cores)"
  ok = [r for r in records if r["status"] == "ok"]
  by_dtype = collections.defaultdict(lambda: collections.defaultdict(list))
  for r in ok:
    by_dtype[r["dtype"]][_panel(r)].append(r)
  out = []
  for dtype, panels in sorted(by_dtype.items()):
    cols = min(_MAX_COLUMNS, len(panels))
    rows = math.ceil(len(panels) / cols)
    width, height = _PANEL_INCHES
    fig, axes = plt.subplots(
      rows, cols, squeeze=False, figsize=(width * cols, height * rows)
    )
    for ax in axes.flat[len(panels) :]:
      ax.set_visible(False)
    for ax, (title, recs) in zip(axes.flat, panels.items()):
      several = len({r["num_splits"] for r in recs}) > 1
      lines = collections.defaultdict(list)
      for r in recs:
        label = r["impl"] + (f", splits {r['num_splits']}" if several else "")
        lines[label].append((r["cache_len"], *_band(r)))
      for label, pts in sorted(lines.items()):
        pts.sort()
        lens, lo, mid, hi = zip(*pts)
        ax.errorbar(
          lens,
          mid,
          yerr=[
            [m - a for a, m in zip(lo, mid)],
            [b - m for b, m in zip(hi, mid)],
          ],
          fmt="o-",
          capsize=3,
          label=label,
        )
      if peak:
        ax.axhline(peak / 1e9, color="gray", linestyle="--", label="HBM peak")
      ax.set_xscale("log", base=2)
      lens = sorted({r["cache_len"] for r in recs})
      ax.set_xticks(lens, [report.tokens(n) for n in lens])
      ax.minorticks_off()
      ax.set_title(title, fontsize="medium")
      ax.set_xlabel("cache length (tokens)")
      ax.set_ylabel("GB/s of K/V read")
      ax.grid(True, alpha=0.3)
      ax.legend(fontsize="x-small")
    title_rows = plots.fit_title(
      fig,
      [
        [
          f"decode {dtype}:",
          "K/V GB/s of the median call,",
          "bars: fastest to slowest",
        ],
        [f"{device},", f"JAX {env.get('jax', '?')}"],
      ],
    )
    fig.set_figheight(height * rows + plots.TITLE_ROW_INCHES * title_rows)
    fig.tight_layout()
    out.append((f"decode_gbps_{dtype}.png", fig))
  return out


def plot(
  records: list[dict],
  out_dir: str,
  environment: dict | None = None,
  peak: float | None = None,
) -> list[str]:
  """Writes `decode_gbps_<dtype>.png` files into `out_dir`; returns paths."""
  made = figures(records, environment, peak)  # selects the Agg backend first
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  os.makedirs(out_dir, exist_ok=True)
  paths = []
  for name, fig in made:
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    paths.append(path)
  return paths
