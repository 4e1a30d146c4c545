"""The terminal summary, every mode's, every line at most 80 columns: a
table per (mode, dtype, options), decode's per (dtype, cache layout), a
column per implementation that ran and ours over the fastest other (a
noisy median marked), then the noisy timings, the correctness cases,
decode's errors and the skip reasons as lines:
docs/benchmarks.md#the-code.
"""

from __future__ import annotations

import collections
import textwrap
from typing import Any

from pallas_fa3.tools.bench import options, report

WIDTH = 80
# After a cell whose median is over report.NOISY_SPREAD x its fastest call.
_NOISY_MARK = "*"
_KEY_COLUMNS = ("d", "causal", "seq")
# Decode's column names (the legend under its tables says so).
_SHORT = {
  "blockwise": "blockw",
  "reference": "ref",
  "triton-gqa": "triton",
  "triton-paged": "triton",
}


def _rate(value: float, whole: bool = False) -> str:
  return f"{value:.0f}" if value >= 100 or whole else f"{value:.3g}"


def _speedup(cases: dict, ours: str, rate: str) -> str:
  """ours / the fastest other implementation of one shape, or ''."""
  mine = cases.get(ours)
  others = [
    r[rate] for n, r in cases.items() if n != ours and r["status"] == "ok"
  ]
  if not (mine and mine["status"] == "ok" and others):
    return ""
  return f"{mine[rate] / max(others):.2f}x"


def tables(
  result: dict, ours: str
) -> list[tuple[str, list[str], list[list[str]]]]:
  """(title, header, rows) of each table, in sweep order.

  An implementation gets a column where it ran at least one shape of the
  table (its skips are listed after the tables).
  """
  timed = [r for r in result["records"] if not r["note"]]
  decode = report.is_decode(timed)
  runs = result["settings"]["runs"]
  noisy = {id(r) for r in report.noisy(timed)}
  if decode:
    percent = bool(result["settings"].get("hbm_peak_bytes_s"))
    unit = "% of the HBM peak" if percent else "GB/s of K/V read"
    scale, rate = 1.0, "gbps"
    label = lambda r: (
      f"{'contiguous' if r['page_size'] is None else 'paged'} cache"
    )
  else:
    unit, scale = report.rate_unit(timed)
    percent, rate, label = False, "tflops", options.record_label
  groups = collections.defaultdict(lambda: collections.defaultdict(dict))
  for r in timed:
    groups[(r["mode"], r["dtype"], label(r))][r["spec"]][r["impl"]] = r

  def cell(r: dict | None) -> str:
    if r is None:
      return ""
    if r["status"] != "ok":
      return "-" if r["status"] == "skipped" else "error"
    mark = _NOISY_MARK if id(r) in noisy else ""
    if decode:
      rate = r["pct_hbm"] if percent else r["gbps"]
      return _rate(rate, whole=percent) + mark
    text = _rate(r["tflops"] * scale)
    if r.get("kernel_tflops"):  # fp8: total / the attention alone
      text += "/" + _rate(r["kernel_tflops"] * scale)
    return text + mark

  out = []
  for (mode, dtype, group), by_spec in groups.items():
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
    paged = group == "paged cache"
    if decode:
      header = report.cache_header(paged) + [_SHORT.get(n, n) for n in names]
    else:
      dims = report.head_dims_header(
        [r for cases in by_spec.values() for r in cases.values()]
      )
      header = [dims, *_KEY_COLUMNS[1:]] + names
    rows = []
    for cases in by_spec.values():
      first = next(iter(cases.values()))
      if decode:
        key = report.cache_columns(first, paged)
      else:
        seq = (
          str(first["seq_q"])
          if first["seq_q"] == first["seq_kv"]
          else f"{first['seq_q']}x{first['seq_kv']}"
        )
        key = [
          report.head_dims_label(first),
          "yes" if first["causal"] else "no",
          seq,
        ]
      rows.append(
        key
        + [cell(cases.get(n)) for n in names]
        + ([_speedup(cases, ours, rate)] if speedup else [])
      )
    title = f"{mode} {dtype}{', ' + group if group else ''}: {unit}, median"
    table = [r for cases in by_spec.values() for r in cases.values()]
    title += f" of {report.runs_label(table, runs)} runs"
    if dtype == "fp8" and not decode:
      title += "; cells: total/kernel"
    out.append((title, header + (["speedup"] if speedup else []), rows))
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
  env, records = result["environment"], result["records"]
  decode = report.is_decode(records)
  head = f"pallas-fa3 bench{' --mode decode' if decode else ''} on"
  head += f" {env['device']}, JAX {env['jax']} (compile excluded)"
  if decode:
    head += f"; HBM peak: {result['hbm_peak']}"
  lines = textwrap.wrap(head, width)
  if result.get("matmul_peak_tflops"):
    lines += textwrap.wrap(
      f"bf16 matmul peak: {result['matmul_peak_tflops']:.0f} TFLOP/s"
      " (each case's % of it: results.csv)",
      width,
    )
  made = tables(result, ours)
  for title, header, rows in made:
    lines += [""] + textwrap.wrap(title, width) + format_table(header, rows)
  if decode and made:
    lines += [""] + textwrap.wrap(
      "b x L: batch x cache length (r: ragged lengths); page: tokens per"
      " page; splits: split-KV ranges asked for; blockw: blockwise, ref:"
      " reference, triton: decode_attention.gqa (contiguous) or"
      f" paged_attention (paged); speedup: {ours} / the fastest other (> 1:"
      f" {ours} faster). GB/s, ms, splits run, TFLOP/s: summary.md and"
      " results.csv.",
      width,
    )
  elif any("speedup" in header for _, header, _ in made):
    lines += [""] + textwrap.wrap(
      f"speedup: {ours} / the fastest other implementation (> 1: {ours}"
      " faster). Times, min/max, batch x heads, memory: results.csv.",
      width,
    )
  warning = report.noise_warning(records)
  if warning:
    lines += [""] + textwrap.wrap(
      f"{_NOISY_MARK} {warning}", width, subsequent_indent="  "
    )
  errs = report.errors(records) if decode else []
  if errs:
    lines += [""] + textwrap.wrap(
      f"largest |out - reference|: {', '.join(errs)}", width
    )
  checks = [r for r in records if r["note"] and r["status"] == "ok"]
  if checks:
    lines.append("")
  for r in checks:
    lines += textwrap.wrap(
      f"correctness only: {r['impl']} {r['spec']}: max |error| vs the"
      f" reference {r['max_abs_err']:.2g}",
      width,
      subsequent_indent="  ",
    )
  groups = report.skipped(records)
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
