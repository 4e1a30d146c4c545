"""Reports made from the sweep's records: ratios, CSV, JSON, markdown.

The terminal summary is terminal.py's.
"""

from __future__ import annotations

import collections
import csv
import json
import os

from pallas_fa3.tools.bench import options

CSV_FILE = "results.csv"
# Environment fields repeated on every CSV row, so that the CSV loads with a
# plain `pandas.read_csv(path)` and CSVs of several machines concatenate;
# results.json beside it holds the whole environment and the settings.
CSV_ENVIRONMENT = ("device", "jax", "jaxlib", "git_commit", "date")
JSON_FILE = "results.json"
MARKDOWN_FILE = "summary.md"
_FILE_WIDTH = 180  # columns of the table when stdout is not a terminal


def head_dims_label(record: dict) -> str:
  """A record's head dim, "192/128" where its value head dim differs
  (older records, and decode's, have no head_dim_v: equal)."""
  d, dv = record["head_dim"], record.get("head_dim_v")
  return f"{d}" if dv in (None, d) else f"{d}/{dv}"


def head_dims_header(records: list[dict]) -> str:
  """ "d", or "d/dv" when some record's value head dim differs."""
  differs = any(head_dims_label(r) != f"{r['head_dim']}" for r in records)
  return "d/dv" if differs else "d"


def rate_unit(records: list[dict]) -> tuple[str, float]:
  """The FLOP/s unit of a run, and its scale from TFLOP/s: TFLOP/s, or
  GFLOP/s (1e3) when every timed figure is under 1 TFLOP/s (a CPU). The
  terminal table, summary.md and the plots (axes and file names) all use
  it; the CSV and JSON keep `tflops`."""
  fastest = max(
    (r["tflops"] for r in records if r["status"] == "ok" and not r["note"]),
    default=0.0,
  )
  return ("TFLOP/s", 1.0) if fastest >= 1 else ("GFLOP/s", 1e3)


def ratios(records: list[dict], ours: str) -> list[dict]:
  """Per spec and baseline: ours TFLOPs/s / baseline TFLOPs/s (> 1: ours faster).

  Equal to baseline time / our time, as both count the same FLOPs.
  """
  by_spec = collections.defaultdict(dict)
  for r in records:
    if r["status"] == "ok" and not r["note"]:
      by_spec[r["spec"]][r["impl"]] = r
  out = []
  for spec, got in by_spec.items():
    if ours not in got:
      continue
    for impl, r in got.items():
      if impl != ours:
        out.append(
          dict(
            spec=spec,
            ours=ours,
            baseline=impl,
            speedup=got[ours]["tflops"] / r["tflops"],
          )
        )
  return out


def _cell(r: dict, show_peak: bool, scale: float) -> str:
  if r["status"] != "ok":
    return "skip" if r["status"] == "skipped" else "error"
  if r["note"]:
    return f"err {r['max_abs_err']:.2g} ({r['time_median_ms']:.3g} ms)"
  peak = f" {r['pct_peak']:.0f}%" if show_peak and r["pct_peak"] else ""
  kernel = (  # fp8: the attention alone and the quantization alone
    f"; kernel {r['kernel_tflops'] * scale:.3g} in {r['kernel_ms']:.3g} ms,"
    f" quantization {r['quantize_ms']:.3g} ms"
    if r.get("kernel_tflops")
    else ""
  )
  rate = r["tflops"] * scale
  return f"{rate:.3g}{peak} ({r['time_median_ms']:.3g} ms{kernel})"


def pivot(result: dict, ours: str) -> tuple[list[str], list[list[str]]]:
  """Header and rows of the summary table: one row per spec; an "options"
  column (window, softcap, sinks) when any case sets one."""
  records = result["records"]
  with_options = any(options.record_label(r) for r in records)
  show_peak = bool(result.get("matmul_peak_tflops"))
  unit, scale = rate_unit(records)
  impl_names = list(dict.fromkeys(r["impl"] for r in records))
  specs = list(dict.fromkeys(r["spec"] for r in records))
  cell = {(r["spec"], r["impl"]): r for r in records}
  speed = collections.defaultdict(list)
  for x in ratios(records, ours):
    speed[x["spec"]].append(f"{x['baseline']} {x['speedup']:.2f}x")
  header = (
    ["mode", "dtype", head_dims_header(records), "causal"]
    + (["options"] if with_options else [])
    + ["seq", "b x hq/hk"]
    + [f"{n} {unit}{' %peak' if show_peak else ''} (ms)" for n in impl_names]
    + [f"{ours} temp MiB", f"{ours} / baseline"]
  )
  rows = []
  for s in specs:
    first = next(r for r in records if r["spec"] == s)
    ours_rec = cell.get((s, ours))
    temp = ours_rec and ours_rec["temp_mib"]
    rows.append(
      [
        first["mode"],
        first["dtype"],
        head_dims_label(first),
        "yes" if first["causal"] else "no",
      ]
      + ([options.record_label(first) or "-"] if with_options else [])
      + [
        str(first["seq_q"])
        if first["seq_q"] == first["seq_kv"]
        else f"{first['seq_q']}x{first['seq_kv']}",
        f"{first['batch']} x {first['heads_q']}/{first['heads_kv']}",
      ]
      + [
        _cell(cell[(s, n)], show_peak, scale) if (s, n) in cell else ""
        for n in impl_names
      ]
      + [
        "" if temp is None else f"{temp:.1f}",
        first["note"] or ", ".join(speed[s]),
      ]
    )
  return header, rows


def skipped(records: list[dict]) -> list[tuple[str, str, int, str]]:
  """(impl, reason, count, first case) for every skipped or failed group."""
  groups = collections.OrderedDict()
  for r in records:
    if r["status"] != "ok":
      key = (r["impl"], f"[{r['status']}] {r['reason']}")
      n, first = groups.get(key, (0, r["spec"]))
      groups[key] = (n + 1, first)
  return [(i, why, n, first) for (i, why), (n, first) in groups.items()]


def markdown(result: dict, ours: str) -> str:
  """The summary table and the skipped cases, as markdown."""
  env = result["environment"]
  header, rows = pivot(result, ours)
  unit, _ = rate_unit(result["records"])
  lines = [
    f"# pallas-fa3 bench: {env['device']}",
    "",
    f"- date: {env['date']}; JAX {env['jax']} / jaxlib {env['jaxlib']};"
    f" platform {env['platform_version']}; commit {env['git_commit']}",
    f"- command: `{env['command']}`",
    f"- cells: {unit} (median ms of {result['settings']['runs']} runs,"
    " compile excluded); ratios = ours FLOP/s / baseline FLOP/s",
    f"- matmul peak: {result['matmul_peak_tflops'] or 'not measured'}"
    + (" TFLOP/s" if result["matmul_peak_tflops"] else ""),
    f"- sweep wall time: {result['sweep_wall_s']:.1f} s",
    "- CSV/JSON also hold min/max times, compile seconds, FLOPs, % of"
    " the matmul peak (GPU) and peak_mib: the device's"
    " peak_bytes_in_use after the case (the process's high-water mark"
    " so far; GPU only)",
    "",
    "| " + " | ".join(header) + " |",
    "|" + "|".join("---" for _ in header) + "|",
  ]
  lines += ["| " + " | ".join(row) + " |" for row in rows]
  lines += ["", "Skipped or failed (impl, reason, cases, first case):", ""]
  lines += [
    f"- {i}: {why} ({n} cases, e.g. {first})"
    for i, why, n, first in skipped(result["records"])
  ] or ["- none"]
  return "\n".join(lines) + "\n"


class _PlainConsole:
  """Stands in for rich's Console where rich is not installed."""

  def print(self, *objects, **kwargs):
    del kwargs
    print(*objects, flush=True)


def make_console():
  """A rich Console (wide when not on a terminal), or a plain printer."""
  try:
    from rich.console import Console  # pylint: disable=g-import-not-at-top
  except ImportError:
    return _PlainConsole()
  console = Console()
  if not console.is_terminal:
    console.width = max(console.width, _FILE_WIDTH)
  return console


def write_files(
  result: dict, out_dir: str, ours: str, summary=None
) -> dict[str, str]:
  """Writes CSV, JSON and markdown into `out_dir`; returns their paths.

  The CSV is a header line and one row per record (no comment lines), each
  row with the `CSV_ENVIRONMENT` fields appended. `summary(result, ours)`
  makes the markdown (default: `markdown`; decode has its own).
  """
  os.makedirs(out_dir, exist_ok=True)
  paths = {
    k: os.path.join(out_dir, f)
    for k, f in (("csv", CSV_FILE), ("json", JSON_FILE), ("md", MARKDOWN_FILE))
  }
  records = result["records"]
  env = {k: result["environment"][k] for k in CSV_ENVIRONMENT}
  with open(paths["csv"], "w", newline="") as f:
    fields = list(records[0]) if records else []
    writer = csv.DictWriter(
      f, fieldnames=fields + [k for k in CSV_ENVIRONMENT if k not in fields]
    )
    writer.writeheader()
    writer.writerows({**r, **env} for r in records)
  with open(paths["json"], "w") as f:
    json.dump(
      dict(result, ratios=ratios(records, ours), ours=ours), f, indent=1
    )
  with open(paths["md"], "w") as f:
    f.write((summary or markdown)(result, ours))
  return paths


def read_csv(path: str) -> list[dict]:
  """Rows of a results CSV, as dicts of strings."""
  with open(path, newline="") as f:
    return list(csv.DictReader(f))
