"""Report side of `cpu_memory.py`: markdown tables and derived figures.

`main_report` formats the blockwise-vs-reference comparison (per-case table,
reference/blockwise ratios, growth factor per doubling of the sequence
length, checks) and returns the derived figures for the JSON output;
`sweep_report` formats the block-size sweep.
"""

from __future__ import annotations

import math

_MIB = 1024.0 * 1024.0
IMPLEMENTATIONS = ("blockwise", "reference")
PASSES = ("fwd", "fwdbwd")


def _fmt_mib(nbytes) -> str:
  return "-" if nbytes is None else f"{nbytes / _MIB:.2f}"


def _fmt_ms(seconds) -> str:
  return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _fmt_load(x) -> str:
  return "-" if x is None else f"{x:.2f}"


def _fmt_ratio(x) -> str:
  return "-" if x is None else f"{x:.1f}x"


def _ratio(a, b):
  if a is None or b is None or b <= 0:
    return None
  return a / b


def _metrics(res: dict) -> dict:
  """The figures the tables use, in bytes and seconds (None when missing)."""
  ok = "error" not in res and "skipped" not in res
  comp = res.get("compiled", {})
  kib = lambda k: res[k] * 1024 if ok and k in res else None
  m = dict(
    temp=comp.get("temp_size_in_bytes"),
    out=comp.get("output_size_in_bytes"),
    args=comp.get("argument_size_in_bytes"),
    peak=kib("peak_delta_first_kib"),
    peak_max=kib("peak_delta_max_kib"),
    t_med=res.get("time_median_s") if ok else None,
    t_min=res.get("time_min_s") if ok else None,
    t_max=res.get("time_max_s") if ok else None,
    load=res.get("loadavg_before"),
    note=res.get("error") or res.get("skipped") or "",
  )
  total = (
    None if m["temp"] is None or m["out"] is None else m["temp"] + m["out"]
  )
  # RSS can only under-read (reused resident pages); flag implausible peaks.
  m["under_read"] = (
    m["peak"] is not None and total is not None and m["peak"] < 0.9 * total
  )
  return m


def progress_note(res: dict) -> str:
  """One-line summary of a finished case, for the progress log."""
  m = _metrics(res)
  return (
    m["note"][:200]
    if m["note"]
    else f"median {_fmt_ms(m['t_med'])} ms, temp"
    f" {_fmt_mib(m['temp'])} MiB, peak Δ {_fmt_mib(m['peak'])}"
    f" MiB (load {_fmt_load(m['load'])})"
  )


def main_report(results: list[dict], seqs: list[int]) -> tuple[str, dict]:
  """Markdown for the main comparison, plus the derived figures for JSON."""
  by = {
    (r["case"]["pass"], r["case"]["impl"], r["case"]["seq"]): _metrics(r)
    for r in results
  }
  lines = []
  lines.append(
    "| pass | seq | impl | compiled temp MiB | output MiB |"
    " args MiB | measured peak Δ MiB (1st exec) |"
    " max Δ of 1st+repeats MiB | time median ms | min–max ms | load |"
  )
  lines.append("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
  for pas in PASSES:
    for seq in seqs:
      for impl in IMPLEMENTATIONS:
        m = by.get((pas, impl, seq))
        if m is None:
          continue
        row = (
          f"| {pas} | {seq} | {impl} | {_fmt_mib(m['temp'])} |"
          f" {_fmt_mib(m['out'])} | {_fmt_mib(m['args'])} |"
        )
        if m["note"]:
          row += f" {m['note'][:80]} | | | | |"
        else:
          row += (
            f" {_fmt_mib(m['peak'])}{' †' if m['under_read'] else ''} |"
            f" {_fmt_mib(m['peak_max'])} |"
            f" {_fmt_ms(m['t_med'])} |"
            f" {_fmt_ms(m['t_min'])}–{_fmt_ms(m['t_max'])} |"
            f" {_fmt_load(m['load'])} |"
          )
        lines.append(row)

  derived = {"ratios": {}, "growth": {}, "checks": []}
  lines.append("")
  lines.append(
    "Reference / blockwise ratios (>1: blockwise is smaller or faster):"
  )
  lines.append("")
  lines.append(
    "| pass | seq | time (median) | compiled temp |"
    " compiled temp+output | measured peak Δ |"
  )
  lines.append("|---|---:|---:|---:|---:|---:|")
  for pas in PASSES:
    for seq in seqs:
      b, r = by.get((pas, "blockwise", seq)), by.get((pas, "reference", seq))
      if b is None or r is None:
        continue
      tot = lambda m: (
        None if m["temp"] is None or m["out"] is None else m["temp"] + m["out"]
      )
      rat = dict(
        time=_ratio(r["t_med"], b["t_med"]),
        temp=_ratio(r["temp"], b["temp"]),
        temp_plus_output=_ratio(tot(r), tot(b)),
        peak=_ratio(r["peak"], b["peak"]),
      )
      derived["ratios"][f"{pas}/{seq}"] = rat
      lines.append(
        f"| {pas} | {seq} | {_fmt_ratio(rat['time'])} |"
        f" {_fmt_ratio(rat['temp'])} |"
        f" {_fmt_ratio(rat['temp_plus_output'])} |"
        f" {_fmt_ratio(rat['peak'])} |"
      )

  # Growth per doubling of seq (only between consecutive seqs that double).
  pairs = [(a, b) for a, b in zip(seqs, seqs[1:]) if b == 2 * a]
  if pairs:
    lines.append("")
    lines.append(
      "Growth factor per doubling of seq (linear memory: ~2x;"
      " quadratic: ~4x; quadratic time: ~4x):"
    )
    lines.append("")
    header = " | ".join(f"{a}→{b}" for a, b in pairs)
    lines.append(f"| pass | impl | metric | {header} |")
    lines.append("|---|---|---|" + "---:|" * len(pairs))
    for pas in PASSES:
      for impl in IMPLEMENTATIONS:
        for metric, label in (
          ("temp", "compiled temp"),
          ("temp+out", "compiled temp+output"),
          ("peak", "measured peak Δ"),
          ("t_med", "time (median)"),
        ):
          vals = []
          for a, b in pairs:
            ma, mb = by.get((pas, impl, a)), by.get((pas, impl, b))
            if ma is None or mb is None:
              vals.append(None)
              continue
            if metric == "temp+out":
              va = None if ma["temp"] is None else ma["temp"] + (ma["out"] or 0)
              vb = None if mb["temp"] is None else mb["temp"] + (mb["out"] or 0)
            else:
              va, vb = ma[metric], mb[metric]
            vals.append(_ratio(vb, va))
          derived["growth"][f"{pas}/{impl}/{label}"] = dict(
            zip([f"{a}->{b}" for a, b in pairs], vals)
          )
          cells = " | ".join("-" if v is None else f"{v:.2f}" for v in vals)
          lines.append(f"| {pas} | {impl} | {label} | {cells} |")

  # Checks (reported, not fatal unless --strict).
  checks = derived["checks"]

  def check(ok, text):
    checks.append(dict(ok=bool(ok), text=text))

  for pas in PASSES:
    g_b = [
      v
      for v in derived["growth"]
      .get(f"{pas}/blockwise/compiled temp+output", {})
      .values()
      if v
    ]
    g_r = [
      v
      for v in derived["growth"]
      .get(f"{pas}/reference/compiled temp", {})
      .values()
      if v
    ]
    if g_b:
      gm = math.exp(sum(map(math.log, g_b)) / len(g_b))
      check(
        max(g_b) <= 2.5,
        f"{pas}: blockwise compiled temp+output grows linearly: per-doubling"
        f" factors {', '.join(f'{v:.2f}' for v in g_b)} (geo-mean {gm:.2f};"
        " want <= 2.5)",
      )
    if g_r:
      gm = math.exp(sum(map(math.log, g_r)) / len(g_r))
      check(
        min(g_r) >= 3.0,
        f"{pas}: reference compiled temp grows ~quadratically: per-doubling"
        f" factors {', '.join(f'{v:.2f}' for v in g_r)} (geo-mean {gm:.2f};"
        " want >= 3)",
      )
    top = max(seqs)
    b, r = by.get((pas, "blockwise", top)), by.get((pas, "reference", top))
    if b and r and b["peak"] and r["peak"]:
      check(
        b["peak"] < 0.1 * r["peak"],
        f"{pas}: at seq {top} blockwise measured peak Δ"
        f" {b['peak'] / _MIB:.1f} MiB vs reference {r['peak'] / _MIB:.1f}"
        f" MiB ({r['peak'] / b['peak']:.0f}x less; want > 10x)",
      )
    if b and r and b["temp"] and r["temp"]:
      check(
        b["temp"] < 0.1 * r["temp"],
        f"{pas}: at seq {top} blockwise compiled temp"
        f" {b['temp'] / _MIB:.1f} MiB vs reference {r['temp'] / _MIB:.1f}"
        f" MiB ({r['temp'] / b['temp']:.0f}x less; want > 10x)",
      )
  under = [f"{p}/{i}/{q}" for (p, i, q), m in by.items() if m["under_read"]]
  check(
    not under,
    "measured peak Δ >= 90% of compiled temp+output in every case"
    + (f" (under-read, marked †: {', '.join(under)})" if under else ""),
  )
  lines.append("")
  lines.append("Checks:")
  lines.append("")
  for c in checks:
    lines.append(f"- {'PASS' if c['ok'] else 'FAIL'}: {c['text']}")
  return "\n".join(lines), derived


def sweep_report(results: list[dict]) -> tuple[str, dict]:
  rows = {}
  for r in results:
    blk = tuple(r["case"]["block"])
    rows.setdefault(blk, {})[r["case"]["pass"]] = _metrics(r)
  lines = [
    "| block_q | block_kv | fwd median ms | fwd min–max ms |"
    " fwd+bwd median ms | fwd+bwd min–max ms | fwd temp MiB |"
    " fwd+bwd temp MiB | fwd+bwd peak Δ MiB |",
    "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  best = {}
  for pas in PASSES:
    cands = [
      (m[pas]["t_med"], blk)
      for blk, m in rows.items()
      if pas in m and m[pas]["t_med"] is not None
    ]
    if cands:
      best[pas] = min(cands)[1]
  for blk, m in rows.items():
    f, fb = m.get("fwd"), m.get("fwdbwd")
    star = lambda pas: " **(fastest)**" if best.get(pas) == blk else ""
    lines.append(
      f"| {blk[0]} | {blk[1]} |"
      f" {_fmt_ms(f and f['t_med'])}{star('fwd')} |"
      f" {_fmt_ms(f and f['t_min'])}–{_fmt_ms(f and f['t_max'])} |"
      f" {_fmt_ms(fb and fb['t_med'])}{star('fwdbwd')} |"
      f" {_fmt_ms(fb and fb['t_min'])}–{_fmt_ms(fb and fb['t_max'])} |"
      f" {_fmt_mib(f and f['temp'])} | {_fmt_mib(fb and fb['temp'])} |"
      f" {_fmt_mib(fb and fb['peak'])} |"
    )
  return "\n".join(lines), {k: list(v) for k, v in best.items()}
