"""Reports made from the sweep's records, every mode's: ratios, results.csv
(the environment on every row), results.json and summary.md (one wide
table: a row per case, a cell per implementation, ours over each other;
decode's also the largest error per implementation); the terminal's tables
are terminal.py's: docs/benchmarks.md#the-code.
"""

from __future__ import annotations

import collections
import csv
import json
import os

from pallas_fa3.tools.bench import options, specs

CSV_FILE = "results.csv"
# Environment fields repeated on every CSV row, so that the CSV loads with a
# plain `pandas.read_csv(path)` and CSVs of several machines concatenate;
# results.json beside it holds the whole environment and the settings.
CSV_ENVIRONMENT = ("device", "jax", "jaxlib", "git_commit", "date")
JSON_FILE = "results.json"
MARKDOWN_FILE = "summary.md"
_FILE_WIDTH = 180  # columns of the table when stdout is not a terminal
# A case whose median call took more than this many times its fastest one
# was timed on a busy machine (or a clock still ramping up): its median is
# not its speed, and the reports say so. Issue 64's busy 2-core machine
# gave a forward 1.64 (min 92 ms, median 151 ms), slower than its
# forward+backward.
NOISY_SPREAD = 1.25
_NOISY_SHOWN = 3  # the noisiest cases the warning names


def head_dims_label(record: dict) -> str:
  """A record's head dim, "192/128" where its value head dim differs
  (older records, and decode's, have no head_dim_v: equal)."""
  d, dv = record["head_dim"], record.get("head_dim_v")
  return f"{d}" if dv in (None, d) else f"{d}/{dv}"


def head_dims_header(records: list[dict]) -> str:
  """ "d", or "d/dv" when some record's value head dim differs."""
  differs = any(head_dims_label(r) != f"{r['head_dim']}" for r in records)
  return "d/dv" if differs else "d"


def is_decode(records: list[dict]) -> bool:
  """Whether the records are a decode sweep's."""
  return any(r["mode"] == specs.DECODE for r in records)


def by_spec(records: list[dict]) -> dict[str, dict[str, dict]]:
  """{spec: {impl: record}}, in the records' order."""
  cases = collections.defaultdict(dict)
  for r in records:
    cases[r["spec"]][r["impl"]] = r
  return cases


def tokens(n: int) -> str:
  """8192 -> "8k", 131072 -> "128k", 1000 -> "1000"."""
  return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def cache_columns(r: dict, paged: bool | None = None) -> list[str]:
  """The columns naming a decode record's case (`cache_header`); a table
  of one layout (`paged` True or False) names only the page size, if any."""
  size = f"{r['batch']}x{tokens(r['cache_len'])}" + ("r" if r["ragged"] else "")
  if r.get("seq_q", 1) > 1:  # speculative: new tokens per sequence
    size += f" q{r['seq_q']}"
  if r.get("batch_invariant"):
    size += " inv"
  if r.get("flex"):
    size += f" {r['flex']}"
  heads = f"{r['heads_q']}/{r['heads_kv']} d{r['head_dim']}"
  if paged is None:
    layout = [
      "contiguous" if r["page_size"] is None else f"page {r['page_size']}"
    ]
  else:
    layout = [str(r["page_size"])] if paged else []
  return [size, heads] + layout + [str(r["num_splits"])]


def cache_header(paged: bool | None = None) -> list[str]:
  layout = {None: ["cache"], True: ["page"], False: []}[paged]
  return ["b x L", "hq/hk d"] + layout + ["splits"]


def errors(records: list[dict]) -> list[str]:
  """ "impl 0.0039" per implementation: its largest |out - reference|."""
  worst = {}
  for r in records:
    if r["status"] == "ok" and r["max_abs_err"] is not None:
      worst[r["impl"]] = max(worst.get(r["impl"], 0.0), r["max_abs_err"])
  return [f"{impl} {err:.2g}" for impl, err in worst.items()]


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


def spread(r: dict) -> float | None:
  """A timed record's median time over its fastest (None: not timed; a
  correctness case or a record without min and median)."""
  fastest, median = r.get("time_min_ms"), r.get("time_median_ms")
  if r["status"] != "ok" or r["note"] or not fastest or median is None:
    return None
  return median / fastest


def noisy(records: list[dict]) -> list[dict]:
  """The timed records whose `spread` exceeds NOISY_SPREAD, widest first."""
  wide = [r for r in records if (spread(r) or 0.0) > NOISY_SPREAD]
  return sorted(wide, key=spread, reverse=True)


def runs_label(records: list[dict], runs: int) -> str:
  """The timed calls per case: "3", or "3-15" where cheap cases took more
  (records without a count: `runs`, the setting)."""
  counts = [
    r.get("runs") or runs for r in records if spread(r) is not None
  ] or [runs]
  low, high = min(counts), max(counts)
  return f"{low}" if low == high else f"{low}-{high}"


def noise_warning(records: list[dict]) -> str | None:
  """What to say of the `noisy` records (None: none is)."""
  wide = noisy(records)
  if not wide:
    return None
  timed = sum(spread(r) is not None for r in records)
  shown = "; ".join(
    f"{r['impl']} {r['spec']}: min {r['time_min_ms']:.3g} ms, median"
    f" {r['time_median_ms']:.3g} ms"
    for r in wide[:_NOISY_SHOWN]
  )
  return (
    f"Noisy timings: in {len(wide)} of {timed} cases the median call took"
    f" more than {NOISY_SPREAD:g}x the fastest (NOISY_SPREAD), e.g. {shown}:"
    " the machine was likely busy, so those medians (and their ratios) are"
    " not the cases' speed; rerun on an idle machine or with more --runs."
  )


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
  """ "<rate>[ <% of peak>][ (noisy)] (<median> ms, min <min>[<more>])";
  the correctness case: its error."""
  if r["status"] != "ok":
    return "skip" if r["status"] == "skipped" else "error"
  if r["note"]:
    return f"err {r['max_abs_err']:.2g} ({r['time_median_ms']:.3g} ms)"
  if r["mode"] == specs.DECODE:
    rate, pct, n = r["gbps"], r["pct_hbm"], r["splits"]
    more = "" if n is None else f", {n} split{'s' if n != 1 else ''}"
    if r.get("tokens_per_s"):
      more += f", {r['tokens_per_s']:.3g} tok/s"
  else:
    rate, pct = r["tflops"] * scale, show_peak and r["pct_peak"]
    more = (  # fp8: the attention alone and the quantization alone
      f"; kernel {r['kernel_tflops'] * scale:.3g} in {r['kernel_ms']:.3g} ms,"
      f" quantization {r['quantize_ms']:.3g} ms"
      if r.get("kernel_tflops")
      else ""
    )
  pct = f" {pct:.0f}%" if pct else ""
  fastest = r.get("time_min_ms")
  times = f"{r['time_median_ms']:.3g} ms" + (
    "" if fastest is None else f", min {fastest:.3g}"
  )
  mark = "" if (spread(r) or 0.0) <= NOISY_SPREAD else " (noisy)"
  return f"{rate:.3g}{pct}{mark} ({times}{more})"


def pivot(result: dict, ours: str) -> tuple[list[str], list[list[str]]]:
  """Header and rows of the summary table: one row per spec (the attention
  modes: an "options" column (window, softcap, sinks) when any case sets
  one; decode: the cache's columns), a cell per implementation, then ours'
  temp MiB (the attention modes) and ours over each other implementation."""
  records = result["records"]
  decode = is_decode(records)
  show_peak = bool(result.get("matmul_peak_tflops"))
  unit, scale = rate_unit(records)
  names = list(dict.fromkeys(r["impl"] for r in records))
  speed = collections.defaultdict(list)
  for x in ratios(records, ours):
    speed[x["spec"]].append(f"{x['baseline']} {x['speedup']:.2f}x")
  if decode:
    header = cache_header() + [f"{n} GB/s %HBM (ms)" for n in names]
    header += [f"{ours} / other"]
    key = cache_columns
  else:
    with_options = any(options.record_label(r) for r in records)
    header = (
      ["mode", "dtype", head_dims_header(records), "causal"]
      + (["options"] if with_options else [])
      + ["seq", "b x hq/hk"]
      + [f"{n} {unit}{' %peak' if show_peak else ''} (ms)" for n in names]
      + [f"{ours} temp MiB", f"{ours} / baseline"]
    )
    key = lambda r: (
      [
        r["mode"],
        r["dtype"],
        head_dims_label(r),
        "yes" if r["causal"] else "no",
      ]
      + ([options.record_label(r) or "-"] if with_options else [])
      + [
        str(r["seq_q"])
        if r["seq_q"] == r["seq_kv"]
        else f"{r['seq_q']}x{r['seq_kv']}",
        f"{r['batch']} x {r['heads_q']}/{r['heads_kv']}",
      ]
    )
  rows = []
  for spec, cases in by_spec(records).items():
    first = next(iter(cases.values()))
    row = key(first) + [
      _cell(cases[n], show_peak, scale) if n in cases else "" for n in names
    ]
    if not decode:
      temp = cases.get(ours) and cases[ours]["temp_mib"]
      row.append("" if temp is None else f"{temp:.1f}")
    rows.append(row + [first["note"] or ", ".join(speed[spec])])
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
  """summary.md: the environment, the summary table, (decode) the errors
  and the skipped cases, as markdown."""
  env, records = result["environment"], result["records"]
  decode = is_decode(records)
  header, rows = pivot(result, ours)
  runs = runs_label(records, result["settings"]["runs"])
  noisy_note = (
    f"; (noisy): median over {NOISY_SPREAD:g}x the fastest call, not the"
    " case's speed"
  )
  if decode:
    about = [
      "- cells: GB/s of K/V read (sum of each sequence's length x heads_kv x"
      f" (d + dv) x itemsize, over the median of {runs} runs, compile"
      " excluded), % of the HBM peak, median and fastest ms, split-KV"
      f" ranges run{noisy_note}; ratios: ours GB/s / other GB/s",
      f"- HBM peak: {result['hbm_peak']}",
    ]
    holds = (
      "- CSV/JSON also hold max times, runs, compile seconds, bytes, FLOPs"
      " and TFLOP/s, temp and peak MiB, each case's max |out - reference|"
    )
  else:
    unit, _ = rate_unit(records)
    about = [
      f"- cells: {unit} (median and fastest ms of {runs} runs, compile"
      f" excluded){noisy_note}; ratios = ours FLOP/s / baseline FLOP/s",
      f"- matmul peak: {result['matmul_peak_tflops'] or 'not measured'}"
      + (" TFLOP/s" if result["matmul_peak_tflops"] else ""),
    ]
    holds = (
      "- CSV/JSON also hold max times, runs, compile seconds, FLOPs, % of"
      " the matmul peak (GPU) and peak_mib: the device's"
      " peak_bytes_in_use after the case (the process's high-water mark"
      " so far; GPU only)"
    )
  lines = [
    f"# pallas-fa3 bench{' --mode decode' if decode else ''}: {env['device']}",
    "",
    f"- date: {env['date']}; JAX {env['jax']} / jaxlib {env['jaxlib']};"
    f" platform {env['platform_version']}; commit {env['git_commit']}",
    f"- command: `{env['command']}`",
    *about,
    f"- sweep wall time: {result['sweep_wall_s']:.1f} s",
    holds,
    "",
    "| " + " | ".join(header) + " |",
    "|" + "|".join("---" for _ in header) + "|",
  ]
  lines += ["| " + " | ".join(row) + " |" for row in rows]
  warning = noise_warning(records)
  if warning:
    lines += ["", f"**{warning}**"]
  if decode:
    lines += [
      "",
      "Largest |out - reference| (float32):"
      f" {', '.join(errors(records)) or '-'}",
    ]
  lines += ["", "Skipped or failed (impl, reason, cases, first case):", ""]
  lines += [
    f"- {i}: {why} ({n} cases, e.g. {first})"
    for i, why, n, first in skipped(records)
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


def write_files(result: dict, out_dir: str, ours: str) -> dict[str, str]:
  """Writes CSV, JSON and markdown into `out_dir`; returns their paths.

  The CSV is a header line and one row per record (no comment lines), each
  row with the `CSV_ENVIRONMENT` fields appended.
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
    f.write(markdown(result, ours))
  return paths


def read_csv(path: str) -> list[dict]:
  """Rows of a results CSV, as dicts of strings."""
  with open(path, newline="") as f:
    return list(csv.DictReader(f))
