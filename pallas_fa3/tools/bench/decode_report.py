"""The decode sweep's summaries: summary.md (one wide table) and the
terminal's tables (80 columns).

A row per case (batch x cache length, heads, head dim, cache layout,
requested split-KV ranges), a column per implementation. summary.md's
cells: GB/s of K/V read (`flops.decode_kv_bytes` / median time), % of the
HBM peak where the device has one, the median ms and the split count the
implementation ran. The terminal: one table per (dtype, contiguous or
paged), cells in % of the HBM peak when it is known, else GB/s, and ours
over the fastest other implementation. Both list the largest difference
from our reference per implementation and every skipped case with its
reason.
"""

from __future__ import annotations

import collections
import textwrap
from typing import Any

from pallas_fa3.tools.bench import report, terminal

WIDTH = terminal.WIDTH
# Column names of the terminal tables (the legend under them says so).
_SHORT = {
  "blockwise": "blockw",
  "reference": "ref",
  "triton-gqa": "triton",
  "triton-paged": "triton",
}


def tokens(n: int) -> str:
  """8192 -> "8k", 131072 -> "128k", 1000 -> "1000"."""
  return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _key(r: dict, paged: bool | None = None) -> list[str]:
  """The columns naming a record's case (`_header`); a terminal table of
  one layout (`paged` True or False) names only the page size, if any."""
  size = f"{r['batch']}x{tokens(r['cache_len'])}" + ("r" if r["ragged"] else "")
  heads = f"{r['heads_q']}/{r['heads_kv']} d{r['head_dim']}"
  if paged is None:
    layout = [
      "contiguous" if r["page_size"] is None else f"page {r['page_size']}"
    ]
  else:
    layout = [str(r["page_size"])] if paged else []
  return [size, heads] + layout + [str(r["num_splits"])]


def _header(paged: bool | None = None) -> list[str]:
  layout = {None: ["cache"], True: ["page"], False: []}[paged]
  return ["b x L", "hq/hk d"] + layout + ["splits"]


def _by_spec(records: list[dict]) -> dict[str, dict[str, dict]]:
  cases = collections.defaultdict(dict)
  for r in records:
    cases[r["spec"]][r["impl"]] = r
  return cases


def _md_cell(r: dict) -> str:
  if r["status"] != "ok":
    return "skip" if r["status"] == "skipped" else "error"
  pct = "" if r["pct_hbm"] is None else f" {r['pct_hbm']:.0f}%"
  n = r["splits"]
  splits = "" if n is None else f", {n} split{'s' if n != 1 else ''}"
  return f"{r['gbps']:.3g}{pct} ({r['time_median_ms']:.3g} ms{splits})"


def errors(records: list[dict]) -> list[str]:
  """ "impl 0.0039" per implementation: its largest |out - reference|."""
  worst = {}
  for r in records:
    if r["status"] == "ok" and r["max_abs_err"] is not None:
      worst[r["impl"]] = max(worst.get(r["impl"], 0.0), r["max_abs_err"])
  return [f"{impl} {err:.2g}" for impl, err in worst.items()]


def markdown(result: dict, ours: str) -> str:
  """summary.md: the environment, one wide table, the errors, the skips."""
  env, records = result["environment"], result["records"]
  names = list(dict.fromkeys(r["impl"] for r in records))
  speed = collections.defaultdict(list)
  for x in report.ratios(records, ours):
    speed[x["spec"]].append(f"{x['baseline']} {x['speedup']:.2f}x")
  header = (
    _header() + [f"{n} GB/s %HBM (ms)" for n in names] + [f"{ours} / other"]
  )
  lines = [
    f"# pallas-fa3 bench --mode decode: {env['device']}",
    "",
    f"- date: {env['date']}; JAX {env['jax']} / jaxlib {env['jaxlib']};"
    f" platform {env['platform_version']}; commit {env['git_commit']}",
    f"- command: `{env['command']}`",
    f"- cells: GB/s of K/V read (sum of each sequence's length x heads_kv x"
    f" (d + dv) x itemsize, over the median of"
    f" {result['settings']['runs']} runs, compile excluded), % of the HBM"
    " peak, median ms, split-KV ranges run; ratios: ours GB/s / other GB/s",
    f"- HBM peak: {result['hbm_peak']}",
    f"- sweep wall time: {result['sweep_wall_s']:.1f} s",
    "- CSV/JSON also hold min/max times, compile seconds, bytes, FLOPs and"
    " TFLOP/s, temp and peak MiB, each case's max |out - reference|",
    "",
    "| " + " | ".join(header) + " |",
    "|" + "|".join("---" for _ in header) + "|",
  ]
  for spec, cases in _by_spec(records).items():
    first = next(iter(cases.values()))
    cells = [_md_cell(cases[n]) if n in cases else "" for n in names]
    row = _key(first) + cells + [", ".join(speed[spec])]
    lines.append("| " + " | ".join(row) + " |")
  lines += [
    "",
    f"Largest |out - reference| (float32): {', '.join(errors(records)) or '-'}",
  ]
  lines += ["", "Skipped or failed (impl, reason, cases, first case):", ""]
  lines += [
    f"- {i}: {why} ({n} cases, e.g. {first})"
    for i, why, n, first in report.skipped(records)
  ] or ["- none"]
  return "\n".join(lines) + "\n"


def _speedup(cases: dict, ours: str) -> str:
  mine = cases.get(ours)
  others = [
    r["gbps"] for n, r in cases.items() if n != ours and r["status"] == "ok"
  ]
  if not (mine and mine["status"] == "ok" and others):
    return ""
  return f"{mine['gbps'] / max(others):.2f}x"


def tables(
  result: dict, ours: str
) -> list[tuple[str, list[str], list[list[str]]]]:
  """(title, header, rows) per (dtype, contiguous or paged): a column per
  implementation that ran one of its cases."""
  percent = bool(result["settings"].get("hbm_peak_bytes_s"))
  unit = "% of the HBM peak" if percent else "GB/s of K/V read"
  groups = collections.defaultdict(dict)
  for spec, cases in _by_spec(result["records"]).items():
    first = next(iter(cases.values()))
    layout = "contiguous" if first["page_size"] is None else "paged"
    groups[(first["dtype"], layout)][spec] = cases
  out = []
  for (dtype, layout), by_spec in groups.items():
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
    header = (
      _header(layout == "paged")
      + [_SHORT.get(n, n) for n in names]
      + (["speedup"] if speedup else [])
    )
    rows = []
    for cases in by_spec.values():
      row = _key(next(iter(cases.values())), layout == "paged")
      for n in names:
        r = cases.get(n)
        if r is None or r["status"] != "ok":
          row.append(
            "" if r is None else "-" if r["status"] == "skipped" else "error"
          )
        else:
          value = r["pct_hbm"] if percent else r["gbps"]
          row.append(
            f"{value:.0f}" if value >= 100 or percent else f"{value:.3g}"
          )
      rows.append(row + ([_speedup(cases, ours)] if speedup else []))
    title = f"decode {dtype}, {layout} cache: {unit}, median of"
    title += f" {result['settings']['runs']} runs"
    out.append((title, header, rows))
  return out


def text(result: dict, ours: str, width: int = WIDTH) -> str:
  """The whole terminal summary, every line at most `width` columns."""
  env = result["environment"]
  lines = textwrap.wrap(
    f"pallas-fa3 bench --mode decode on {env['device']}, JAX {env['jax']}"
    f" (compile excluded); HBM peak: {result['hbm_peak']}",
    width,
  )
  made = tables(result, ours)
  for title, header, rows in made:
    lines += [""] + textwrap.wrap(title, width)
    lines += terminal.format_table(header, rows)
  if made:
    lines += [""] + textwrap.wrap(
      "b x L: batch x cache length (r: ragged lengths); page: tokens per"
      " page; splits: split-KV ranges asked for; blockw: blockwise, ref: reference, triton:"
      " decode_attention.gqa (contiguous) or paged_attention (paged);"
      f" speedup: {ours} / the fastest other (> 1: {ours} faster)."
      " GB/s, ms, splits run, TFLOP/s: summary.md and results.csv.",
      width,
    )
  errs = errors(result["records"])
  if errs:
    lines += [""] + textwrap.wrap(
      f"largest |out - reference|: {', '.join(errs)}", width
    )
  groups = report.skipped(result["records"])
  if groups:
    lines.append("")
  for impl, why, n, first in groups:
    lines += textwrap.wrap(
      f"{impl} x{n} (e.g. {first}): {why}", width, subsequent_indent="  "
    )
  return "\n".join(lines)


def print_summary(result: dict, ours: str, console: Any = None) -> None:
  """Prints `text(result, ours)` (rich markup off: reasons hold brackets)."""
  console = console or report.make_console()
  console.print(text(result, ours), markup=False, highlight=False)
