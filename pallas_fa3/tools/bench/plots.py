"""PNG plots made from the records: FLOP/s vs sequence length, in the unit
of the run's tables (`report.rate_unit`), which the file names start with.

One figure per (mode, dtype, options: window, softcap, sinks, docs); one
panel per head dims (d, and dv where it differs) x causal; one line per implementation at the median
time, with error bars from the fastest and the slowest timed call
(min/max). The title names the device, the JAX version and the options
that are set (they also suffix the file name), wrapped to the figure's
width. fp8 plots the total (quantization + attention). matplotlib with the Agg backend (no display
needed).
"""

from __future__ import annotations

import collections
import os
import re
import textwrap
from typing import Any

from pallas_fa3.tools.bench import options, report


def rate_band(r: dict, scale: float = 1.0) -> tuple[float, float, float]:
  """(slowest, median, fastest) rate: FLOPs / max, median, min time."""

  def rate(ms):
    return r["flops"] / (ms * 1e-3) / 1e12 * scale

  return (
    rate(r["time_max_ms"]),
    rate(r["time_median_ms"]),
    rate(r["time_min_ms"]),
  )


# Share of the figure's width a title row may take: the rest is margin.
_TITLE_WIDTH_SHARE = 0.96
# Height a suptitle row takes ("large" font, 14.4 pt, with line spacing).
TITLE_ROW_INCHES = 0.3


def fit_title(fig, lines: list[list[str]]) -> int:
  """Sets the figure's suptitle from `lines` of phrases, packed so that no
  row is wider than the figure (a single-panel figure clipped the one-line
  title at both sides).

  Each line's phrases fill rows greedily, a phrase never split; a phrase
  wider than the figure by itself is wrapped by words (textwrap). Widths
  are measured with the figure's own renderer. Returns the number of rows.
  """
  renderer = fig.canvas.get_renderer()
  limit = _TITLE_WIDTH_SHARE * fig.bbox.width

  def fits(row: str) -> bool:
    return fig.suptitle(row).get_window_extent(renderer).width <= limit

  def by_words(phrase: str) -> list[str]:
    for width in range(len(phrase), 0, -1):
      rows = textwrap.wrap(phrase, width, break_on_hyphens=False)
      if all(map(fits, rows)):
        return rows
    return textwrap.wrap(phrase, 1)

  rows = []
  for phrases in lines:
    row = ""
    for phrase in phrases:
      if row and fits(f"{row} {phrase}"):
        row = f"{row} {phrase}"
        continue
      if row:
        rows.append(row)
      *done, row = [phrase] if fits(phrase) else by_words(phrase)
      rows.extend(done)
    rows.append(row)
  fig.suptitle("\n".join(rows))
  return len(rows)


def figures(
  records: list[dict], environment: dict | None = None
) -> list[tuple[str, Any]]:
  """(file name, matplotlib Figure) for each (mode, dtype) of the records."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  env = environment or {}
  device = env.get("device", "unknown device")
  if device.startswith("cpu") and env.get("cpu_count"):
    device += f" ({env['cpu_count']} cores)"
  ok = [r for r in records if r["status"] == "ok" and not r["note"]]
  unit, scale = report.rate_unit(ok)
  prefix = unit.replace("/", "").lower()  # names the file: tflops, gflops
  groups = collections.defaultdict(list)
  for r in ok:
    groups[(r["mode"], r["dtype"], options.record_label(r))].append(r)
  out = []
  for (mode, dtype, label), rows in sorted(groups.items()):
    dims = sorted(
      {report.head_dims_label(r) for r in rows},
      key=lambda x: tuple(map(int, x.split("/"))),
    )
    causals = sorted({r["causal"] for r in rows})
    fig, axes = plt.subplots(
      len(causals),
      len(dims),
      squeeze=False,
      figsize=(4.5 * len(dims), 3.5 * len(causals)),
    )
    for i, causal in enumerate(causals):
      for j, d in enumerate(dims):
        ax = axes[i][j]
        lines = collections.defaultdict(list)
        for r in rows:
          if report.head_dims_label(r) == d and r["causal"] == causal:
            lines[r["impl"]].append((r["seq_q"], *rate_band(r, scale)))
        for impl, pts in sorted(lines.items()):
          pts.sort()
          seqs, lo, mid, hi = zip(*pts)
          ax.errorbar(
            seqs,
            mid,
            yerr=[
              [m - a for a, m in zip(lo, mid)],
              [b - m for b, m in zip(hi, mid)],
            ],
            fmt="o-",
            capsize=3,
            label=impl,
          )
        ax.set_xscale("log", base=2)
        seqs = sorted({p[0] for pts in lines.values() for p in pts})
        ax.set_xticks(seqs, [str(n) for n in seqs])
        ax.minorticks_off()
        d_dv = d.replace("/", ", dv=")
        ax.set_title(f"d={d_dv}, {'causal' if causal else 'non-causal'}")
        ax.set_xlabel("sequence length")
        ax.set_ylabel(unit)
        ax.grid(True, alpha=0.3)
        if lines:
          ax.legend(fontsize="small")
    # "<mode> <dtype>[ (quantization + attention)][, <option>...]: ..."
    what = [f"{mode} {dtype}"]
    what[0] += " (quantization + attention)" if dtype == "fp8" else ""
    what += label.split(", ") if label else []
    what = [f"{w}," for w in what[:-1]] + [f"{what[-1]}:"]
    title_rows = fit_title(
      fig,
      [
        what + [f"{unit} of the median call,", "bars: fastest to slowest"],
        [f"{device},", f"JAX {env.get('jax', '?')}"],
      ],
    )
    # Room for the title's rows above the panels (the width stays).
    fig.set_figheight(3.5 * len(causals) + TITLE_ROW_INCHES * title_rows)
    fig.tight_layout()
    slug = re.sub(r"[^0-9a-z.]+", "_", label).strip("_")
    name = (
      f"{prefix}_{mode.replace('+', '_')}_{dtype}{'_' if slug else ''}{slug}"
    )
    out.append((f"{name}.png", fig))
  return out


def plot(
  records: list[dict], out_dir: str, environment: dict | None = None
) -> list[str]:
  """Writes `<unit>_<mode>_<dtype>[_<options>].png` files (unit: tflops, or
  gflops where every figure is under 1 TFLOP/s, as the axes); returns paths.

  Args:
    records: the sweep's records.
    out_dir: folder for the PNGs (created).
    environment: `runner.environment()`: its device and jax go in the titles.
  """
  made = figures(records, environment)  # selects the Agg backend first
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  os.makedirs(out_dir, exist_ok=True)
  paths = []
  for name, fig in made:
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    paths.append(path)
  return paths
