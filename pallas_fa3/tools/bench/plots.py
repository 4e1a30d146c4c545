"""PNG plots made from the records, every mode's: the rate of the median
call against the length, bars from the fastest to the slowest call, a
title naming the device and JAX wrapped to the figure (`fit_title`);
FLOP/s vs sequence length per (mode, dtype, options) with a panel per head
dims x causal, or decode's K/V GB/s vs cache length per dtype with a panel
per case and the HBM peak dashed: docs/benchmarks.md#pallas-fa3-bench.
"""

from __future__ import annotations

import collections
import os
import re
import textwrap
from typing import Any

from pallas_fa3.tools.bench import options, report, specs

_PANEL_INCHES = (4.5, 3.5)
_MAX_COLUMNS = 3  # decode's panels per row


def rate_band(r: dict, scale: float = 1.0) -> tuple[float, float, float]:
  """(slowest, median, fastest) rate: the record's work / max, median, min
  time, in tera per second x `scale`; the work: FLOPs, decode's K/V bytes
  (GB/s at scale 1e3)."""
  work = r["kv_bytes"] if r["mode"] == specs.DECODE else r["flops"]

  def rate(ms):
    return work / (ms * 1e-3) / 1e12 * scale

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


def _panels(rows: list[dict], decode: bool) -> list[list]:
  """The panels of one figure, row by row: (title, records), None for an
  empty place (hidden)."""
  if decode:
    by_case = collections.defaultdict(list)
    for r in rows:
      layout = (
        "contiguous" if r["page_size"] is None else f"page {r['page_size']}"
      )
      by_case[
        f"b={r['batch']}, {r['heads_q']}/{r['heads_kv']} heads,"
        f" d={r['head_dim']}, {layout}{', ragged' if r['ragged'] else ''}"
      ].append(r)
    panels = list(by_case.items())
    cols = min(_MAX_COLUMNS, len(panels))
    panels += [None] * (-len(panels) % cols)
    return [panels[i : i + cols] for i in range(0, len(panels), cols)]
  dims = sorted(
    {report.head_dims_label(r) for r in rows},
    key=lambda x: tuple(map(int, x.split("/"))),
  )
  return [
    [
      (
        f"d={d.replace('/', ', dv=')}, {'causal' if c else 'non-causal'}",
        [
          r for r in rows if report.head_dims_label(r) == d and r["causal"] == c
        ],
      )
      for d in dims
    ]
    for c in sorted({r["causal"] for r in rows})
  ]


def figures(
  records: list[dict],
  environment: dict | None = None,
  peak: float | None = None,
) -> list[tuple[str, Any]]:
  """(file name, matplotlib Figure) for each figure of the records;
  `peak`: decode's HBM bytes/s or None."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  env = environment or {}
  device = env.get("device", "unknown device")
  if device.startswith("cpu") and env.get("cpu_count"):
    device += f" ({env['cpu_count']} cores)"
  ok = [r for r in records if r["status"] == "ok" and not r["note"]]
  decode = report.is_decode(ok)
  unit, scale = ("GB/s of K/V read", 1e3) if decode else report.rate_unit(ok)
  groups = collections.defaultdict(list)
  for r in ok:
    label = "" if decode else options.record_label(r)
    groups[(r["mode"], r["dtype"], label)].append(r)
  out = []
  for (mode, dtype, label), rows in sorted(groups.items()):
    panels = _panels(rows, decode)
    width, height = _PANEL_INCHES
    fig, axes = plt.subplots(
      len(panels),
      len(panels[0]),
      squeeze=False,
      figsize=(width * len(panels[0]), height * len(panels)),
    )
    for ax, panel in zip(axes.flat, [p for row in panels for p in row]):
      if panel is None:
        ax.set_visible(False)
        continue
      title, recs = panel
      several = decode and len({r["num_splits"] for r in recs}) > 1
      lines = collections.defaultdict(list)
      for r in recs:
        name = r["impl"] + (f", splits {r['num_splits']}" if several else "")
        length = r["cache_len"] if decode else r["seq_q"]
        lines[name].append((length, *rate_band(r, scale)))
      for name, pts in sorted(lines.items()):
        pts.sort()
        lengths, lo, mid, hi = zip(*pts)
        ax.errorbar(
          lengths,
          mid,
          yerr=[
            [m - a for a, m in zip(lo, mid)],
            [b - m for b, m in zip(hi, mid)],
          ],
          fmt="o-",
          capsize=3,
          label=name,
        )
      if peak:
        ax.axhline(peak / 1e9, color="gray", linestyle="--", label="HBM peak")
      ax.set_xscale("log", base=2)
      lengths = sorted({p[0] for pts in lines.values() for p in pts})
      ticks = report.tokens if decode else str
      ax.set_xticks(lengths, [ticks(n) for n in lengths])
      ax.minorticks_off()
      ax.set_title(title, **({"fontsize": "medium"} if decode else {}))
      ax.set_xlabel("cache length (tokens)" if decode else "sequence length")
      ax.set_ylabel(unit)
      ax.grid(True, alpha=0.3)
      if lines:
        ax.legend(fontsize="x-small" if decode else "small")
    # "<mode> <dtype>[ (quantization + attention)][, <option>...]: ..."
    what = [f"{mode} {dtype}"]
    what[0] += (
      " (quantization + attention)" if dtype == "fp8" and not decode else ""
    )
    what += label.split(", ") if label else []
    what = [f"{w}," for w in what[:-1]] + [f"{what[-1]}:"]
    title_rows = fit_title(
      fig,
      [
        what
        + [
          f"{'K/V GB/s' if decode else unit} of the median call,",
          "bars: fastest to slowest",
        ],
        [f"{device},", f"JAX {env.get('jax', '?')}"],
      ],
    )
    # Room for the title's rows above the panels (the width stays).
    fig.set_figheight(height * len(panels) + TITLE_ROW_INCHES * title_rows)
    fig.tight_layout()
    if decode:
      name = f"decode_gbps_{dtype}"
    else:
      slug = re.sub(r"[^0-9a-z.]+", "_", label).strip("_")
      prefix = unit.replace("/", "").lower()  # names the file: tflops, gflops
      name = f"{prefix}_{mode.replace('+', '_')}_{dtype}"
      name += f"{'_' if slug else ''}{slug}"
    out.append((f"{name}.png", fig))
  return out


def plot(
  records: list[dict],
  out_dir: str,
  environment: dict | None = None,
  peak: float | None = None,
) -> list[str]:
  """Writes the records' figures into `out_dir`; returns their paths:
  `<unit>_<mode>_<dtype>[_<options>].png` (unit: tflops, or gflops where
  every figure is under 1 TFLOP/s, as the axes), `decode_gbps_<dtype>.png`.

  Args:
    records: the sweep's records.
    out_dir: folder for the PNGs (created).
    environment: `runner.environment()`: its device and jax go in the titles.
    peak: decode's HBM bytes/s (a dashed line), or None.
  """
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
