"""The terminal summary: small tables that fit 80 columns.

One table per (mode, dtype, options): its title names the window, softcap,
sinks and docs when set; a row per shape (head dim, "d/dv" where the value
head dim differs, causal, seq), a column per implementation that ran
(FLOP/s of the median time in the run's one unit, `report.rate_unit`, as
in summary.md and the plots), and the speedup of ours over the fastest
other implementation. fp8 cells are total/kernel (quantization
included / attention alone). Times, min/max, batch and heads, memory and
compile seconds are in the CSV, JSON and summary.md; correctness cases and
skip reasons follow the tables as lines.
"""

from __future__ import annotations

import collections
import textwrap
from typing import Any

from pallas_fa3.tools.bench import options, report

WIDTH = 80
_KEY_COLUMNS = ("d", "causal", "seq")


def _rate(tflops: float, scale: float) -> str:
  value = tflops * scale
  return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _cell(r: dict, scale: float) -> str:
  if r["status"] != "ok":
    return "-" if r["status"] == "skipped" else "error"
  cell = _rate(r["tflops"], scale)
  if r.get("kernel_tflops"):  # fp8: total / the attention alone
    cell += "/" + _rate(r["kernel_tflops"], scale)
  return cell


def _speedup(cases: dict, ours: str) -> str:
  """ours / the fastest other implementation of one shape, or ''."""
  mine = cases.get(ours)
  others = [
    r["tflops"] for n, r in cases.items() if n != ours and r["status"] == "ok"
  ]
  if not (mine and mine["status"] == "ok" and others):
    return ""
  return f"{mine['tflops'] / max(others):.2f}x"


def tables(
  result: dict, ours: str
) -> list[tuple[str, list[str], list[list[str]]]]:
  """(title, header, rows) of each (mode, dtype, options) table, in sweep
  order.

  An implementation gets a column where it ran at least one shape of the
  table (its skips are listed after the tables).
  """
  timed = [r for r in result["records"] if not r["note"]]
  unit, scale = report.rate_unit(timed)
  runs = result["settings"]["runs"]
  groups = collections.defaultdict(lambda: collections.defaultdict(dict))
  for r in timed:
    key = (r["mode"], r["dtype"], options.record_label(r))
    groups[key][r["spec"]][r["impl"]] = r
  out = []
  for (mode, dtype, label), by_spec in groups.items():
    names = list(
      dict.fromkeys(
        n
        for cases in by_spec.values()
        for n, r in cases.items()
        if r["status"] != "skipped"
      )
    )
    if not names:
      continue
    speedup = ours in names and len(names) > 1
    dims = report.head_dims_header(
      [r for cases in by_spec.values() for r in cases.values()]
    )
    header = (
      [dims, *_KEY_COLUMNS[1:]] + names + (["speedup"] if speedup else [])
    )
    rows = []
    for cases in by_spec.values():
      first = next(iter(cases.values()))
      seq = (
        str(first["seq_q"])
        if first["seq_q"] == first["seq_kv"]
        else f"{first['seq_q']}x{first['seq_kv']}"
      )
      rows.append(
        [report.head_dims_label(first), "yes" if first["causal"] else "no", seq]
        + [_cell(cases[n], scale) if n in cases else "" for n in names]
        + ([_speedup(cases, ours)] if speedup else [])
      )
    title = f"{mode} {dtype}{', ' + label if label else ''}: {unit}, median"
    title += f" of {runs} runs"
    if dtype == "fp8":
      title += "; cells: total/kernel"
    out.append((title, header, rows))
  return out


def format_table(header: list[str], rows: list[list[str]]) -> list[str]:
  """Fixed-width lines: the key columns left-aligned, figures right-aligned."""
  widths = [max(map(len, col)) for col in zip(header, *rows)]

  def line(cells):
    return "  ".join(
      c.ljust(w) if i < 2 else c.rjust(w)
      for i, (c, w) in enumerate(zip(cells, widths))
    ).rstrip()

  return [line(header), "  ".join("-" * w for w in widths)] + [
    line(row) for row in rows
  ]


def text(result: dict, ours: str, width: int = WIDTH) -> str:
  """The whole terminal summary, every line at most `width` columns."""
  env = result["environment"]
  lines = textwrap.wrap(
    f"pallas-fa3 bench on {env['device']}, JAX {env['jax']} (compile excluded)",
    width,
  )
  if result.get("matmul_peak_tflops"):
    lines += textwrap.wrap(
      f"bf16 matmul peak: {result['matmul_peak_tflops']:.0f} TFLOP/s"
      " (each case's % of it: results.csv)",
      width,
    )
  made = tables(result, ours)
  for title, header, rows in made:
    lines += [""] + textwrap.wrap(title, width) + format_table(header, rows)
  if any("speedup" in header for _, header, _ in made):
    lines += [""] + textwrap.wrap(
      f"speedup: {ours} / the fastest other implementation (> 1: {ours}"
      " faster). Times, min/max, batch x heads, memory: results.csv.",
      width,
    )
  checks = [r for r in result["records"] if r["note"] and r["status"] == "ok"]
  if checks:
    lines.append("")
  for r in checks:
    lines += textwrap.wrap(
      f"correctness only: {r['impl']} {r['spec']}: max |error| vs the"
      f" reference {r['max_abs_err']:.2g}",
      width,
      subsequent_indent="  ",
    )
  groups = report.skipped(result["records"])
  if groups:
    lines.append("")
  for impl, why, n, first in groups:
    lines += textwrap.wrap(
      f"{impl} x{n} (e.g. {first}): {why}", width, subsequent_indent="  "
    )  # why: "[status] reason"
  return "\n".join(lines)


def print_summary(result: dict, ours: str, console: Any = None) -> None:
  """Prints `text(result, ours)` (rich markup off: reasons hold brackets)."""
  console = console or report.make_console()
  console.print(text(result, ours), markup=False, highlight=False)
