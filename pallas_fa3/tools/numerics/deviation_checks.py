"""The deviation study's checks against the paper and the tables they read:
each check returns `{claim, paper, ours, verdict, note}`, the verdict
"reproduced", "partly reproduced" or "not reproduced", always with the
figure it rests on (the markdown, plots and headline are in
`deviation_report`): docs/numerics.md#deviation.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Iterable

from pallas_fa3.tools.numerics import metrics, report

# Golden et al. (arXiv 2405.02803): at BF16, flash ~10x the baseline's
# deviation (isolated forward pass; the only number the text gives).
PAPER_RATIO_BF16 = 10.0
# "About 10x" is read as within a factor 3 either way.
RATIO_BAND = 3.0
# Two deviations count as equal (no effect) within this relative difference.
SAME_REL = 0.01
_MANTISSA_ORDER = ("bfloat16", "float16", "float32")  # 8, 11, 24 bits
_PAIRS = (
  ("flash/all", "baseline/all"),
  ("blockwise/kernel", "baseline/kernel"),
)


def _ok(records: Iterable[dict], **where) -> list[dict]:
  return [
    r
    for r in records
    if r["status"] == "ok" and all(r.get(k) == v for k, v in where.items())
  ]


def candidate_kind(r: dict) -> str:
  """Candidate without its tile: 'flash/all', 'blockwise/kernel', ..."""
  return r["candidate"].split(" ")[0]


def by_point(records, sweep="seq") -> dict[tuple, dict[str, dict]]:
  """{(dtype, d, dist, seq): {kind: record}} of one sweep."""
  points = collections.defaultdict(dict)
  for r in _ok(records, sweep=sweep):
    points[(r["dtype"], r["head_dim"], r["distribution"], r["seq"])][
      candidate_kind(r)
    ] = r
  return points


def flash_baseline_ratios(
  records, dtype="bfloat16", pair=_PAIRS[0]
) -> list[dict]:
  """max|diff| of flash / of baseline at each sequence-sweep point of `dtype`."""
  out = []
  for (dt, d, dist, seq), got in sorted(by_point(records).items()):
    if dt == dtype and pair[0] in got and pair[1] in got:
      out.append(
        dict(
          head_dim=d,
          distribution=dist,
          seq=seq,
          ratio=metrics.ratio(got[pair[0]]["max_abs"], got[pair[1]]["max_abs"]),
        )
      )
  return [x for x in out if x["ratio"] is not None]


def _check_ratio(records) -> dict:
  rows = flash_baseline_ratios(records)
  kern = flash_baseline_ratios(records, pair=_PAIRS[1])
  claim = "flash / baseline max deviation at BF16 (all intermediates in F)"
  if not rows:
    return dict(
      claim=claim,
      paper="~10x",
      ours="not measured",
      verdict="not measured",
      note="needs bf16 and mode 'all'",
    )
  ratios = [x["ratio"] for x in rows]
  med = statistics.median(ratios)
  longest = max(x["seq"] for x in rows)
  at_long = [x["ratio"] for x in rows if x["seq"] == longest]
  ours = (
    f"median {med:.2g}x (range {min(ratios):.2g}-{max(ratios):.2g}x"
    f" over {len(rows)} points; {statistics.median(at_long):.2g}x at"
    f" seq {longest})"
  )
  if PAPER_RATIO_BF16 / RATIO_BAND <= med <= PAPER_RATIO_BF16 * RATIO_BAND:
    verdict = "reproduced"
  elif med > 1:
    verdict = "partly reproduced"
  else:
    verdict = "not reproduced"
  note = (
    "flash is worse than the baseline when its running statistics and"
    " accumulator are rounded to bf16 after every tile; the ratio grows"
    " with the number of kv tiles (sequence length / Bc), so its size"
    " depends on the sweep's lengths and tile, which the paper does not"
    " state."
  )
  by_tile = tile_ratios(records)
  if by_tile:
    note += (
      " By tile (tile sweep, Br = Bc): "
      + ", ".join(
        f"{x['tile']}: {report.fmt(x['ratio'])}x ({x['distribution']})"
        for x in by_tile
        if x["dtype"] == "bfloat16"
      )
      + "."
    )
  if kern:
    kr = statistics.median(x["ratio"] for x in kern)
    note += (
      f" Kernel-like (float32 statistics, as our backends):"
      f" blockwise / baseline = {kr:.2g}x, i.e. flash is then"
      f" {'better' if kr < 1 else 'worse'}."
    )
  return dict(claim=claim, paper="~10x", ours=ours, verdict=verdict, note=note)


def _check_mantissa(records) -> dict:
  points = by_point(records)
  total = good = 0
  bad = []
  for d, dist, seq in sorted({p[1:] for p in points}):
    per = [points.get((x, d, dist, seq), {}) for x in _MANTISSA_ORDER]
    for kind in sorted(set(per[0]) & set(per[1]) & set(per[2])):
      devs = [p[kind]["max_abs"] for p in per]
      total += 1
      if devs[0] > devs[1] > devs[2]:
        good += 1
      else:
        bad.append(f"{kind} d{d} {dist} seq {seq}")
  claim = "deviation falls as mantissa bits increase (bf16 > fp16 > fp32)"
  if not total:
    return dict(
      claim=claim,
      paper="yes",
      ours="not measured",
      verdict="not measured",
      note="needs all three formats",
    )
  verdict = (
    "reproduced"
    if good == total
    else ("partly reproduced" if good else "not reproduced")
  )
  return dict(
    claim=claim,
    paper="yes",
    ours=f"holds in {good}/{total} (point, candidate) pairs",
    verdict=verdict,
    note="exceptions: " + ", ".join(sorted(set(bad))[:6])
    if bad
    else "every candidate, every point",
  )


def seq_slopes(records, kind="flash/all", dtype="bfloat16") -> list[dict]:
  """Log-log slopes of max|diff| (absolute and / rms(golden)) vs seq."""
  groups = collections.defaultdict(list)
  for r in _ok(records, sweep="seq", dtype=dtype):
    if candidate_kind(r) == kind:
      groups[(r["head_dim"], r["distribution"])].append(r)
  out = []
  for (d, dist), rs in sorted(groups.items()):
    if len({r["seq"] for r in rs}) < 2:
      continue
    rs.sort(key=lambda r: r["seq"])
    seqs = [r["seq"] for r in rs]
    out.append(
      dict(
        head_dim=d,
        distribution=dist,
        first=rs[0]["max_abs"],
        last=rs[-1]["max_abs"],
        seq_first=seqs[0],
        seq_last=seqs[-1],
        slope=metrics.loglog_slope(seqs, [r["max_abs"] for r in rs]),
        slope_rel=metrics.loglog_slope(
          seqs, [r["max_abs"] / r["golden_rms"] for r in rs]
        ),
      )
    )
  return out


def _check_seq(records) -> dict:
  rows = seq_slopes(records)
  claim = (
    "deviation rises with sequence length at a fixed tile (flash/all, bf16)"
  )
  if not rows:
    return dict(
      claim=claim,
      paper="yes",
      ours="not measured",
      verdict="not measured",
      note="needs >= 2 sequence lengths",
    )
  ours = "; ".join(
    f"d{x['head_dim']} {x['distribution']}: {x['first']:.2g} -> "
    f"{x['last']:.2g} (slope {x['slope']:+.2f}, relative to rms(out)"
    f" {x['slope_rel']:+.2f})"
    for x in rows
  )
  rises = sum(x["slope"] > 0 for x in rows)
  rises_rel = sum(x["slope_rel"] > 0 for x in rows)
  ratios = flash_baseline_ratios(records)
  ratio_slope = None
  if len({x["seq"] for x in ratios}) > 1:
    ratio_slope = metrics.loglog_slope(
      [x["seq"] for x in ratios], [x["ratio"] for x in ratios]
    )
  if rises == len(rows):
    verdict = "reproduced"
  elif rises_rel or (ratio_slope or 0) > 0:
    verdict = "partly reproduced"
  else:
    verdict = "not reproduced"
  note = (
    "slopes are d log(max|diff|) / d log(seq). With random inputs the"
    " output itself shrinks like seq^-1/2 (each row averages more"
    " values), which pulls the absolute deviation down; relative to"
    f" rms(out) it rises in {rises_rel}/{len(rows)} groups"
  )
  if ratio_slope is not None:
    note += (
      f", and the flash/baseline ratio grows as seq^{ratio_slope:.2f}"
      " (more rescaling steps)"
    )
  return dict(
    claim=claim, paper="yes", ours=ours, verdict=verdict, note=note + "."
  )


def tile_table(records, kind="flash/all") -> list[dict]:
  """Tile-sweep records of `kind`: dtype, distribution, Br, Bc, figures."""
  return sorted(
    (r for r in _ok(records, sweep="tile") if candidate_kind(r) == kind),
    key=lambda r: (r["dtype"], r["distribution"], r["block_kv"], r["block_q"]),
  )


def _tile_devs(records, metric="max_abs") -> dict[tuple, dict[tuple, float]]:
  groups = collections.defaultdict(dict)
  for r in tile_table(records):
    groups[(r["dtype"], r["distribution"])][(r["block_q"], r["block_kv"])] = r[
      metric
    ]
  return groups


def tile_ratios(records) -> list[dict]:
  """flash/all / baseline/all (max |diff|) at each square tile of the tile sweep."""
  base = {
    (r["dtype"], r["distribution"]): r["max_abs"]
    for r in _ok(records, sweep="tile")
    if candidate_kind(r) == "baseline/all"
  }
  return [
    dict(
      dtype=r["dtype"],
      distribution=r["distribution"],
      tile=r["block_kv"],
      ratio=metrics.ratio(r["max_abs"], base[(r["dtype"], r["distribution"])]),
    )
    for r in tile_table(records)
    if r["block_q"] == r["block_kv"] and (r["dtype"], r["distribution"]) in base
  ]


def _both(records, judge) -> tuple[str, str]:
  """Runs `judge(devs_by_group) -> (good, total, parts)` on max and on mean
  |diff|; returns (ours, verdict), the verdict resting on the max (the
  paper's metric) and saying so when only the mean agrees."""
  results = {m: judge(_tile_devs(records, m)) for m in ("max_abs", "mean_abs")}
  (good, total, parts), (good_m, total_m, parts_m) = results.values()
  if not total:
    return "not measured", "not measured"
  ours = "max: " + "; ".join(parts) + ". mean: " + "; ".join(parts_m)
  if good == total:
    return ours, "reproduced"
  if total_m and good_m == total_m:
    return ours, (
      "reproduced on mean |diff|; partly on max |diff| (a single"
      " worst element can be the same for several tiles)"
    )
  return ours, "partly reproduced" if good or good_m else "not reproduced"


def _judge_tiles(groups):
  parts, good, total = [], 0, 0
  for (dt, dist), devs in sorted(groups.items()):
    squares = sorted(t for t in devs if t[0] == t[1])
    if len(squares) >= 2:
      lo, hi = squares[0], squares[-1]
      total += 1
      good += devs[hi] < devs[lo]
      parts.append(
        f"{dt} {dist} {lo[0]}x{lo[1]} {devs[lo]:.2g} ->"
        f" {hi[0]}x{hi[1]} {devs[hi]:.2g}"
      )
  return good, total, parts


def _check_tiles(records) -> dict:
  ours, verdict = _both(records, _judge_tiles)
  return dict(
    claim="larger tiles (Br x Bc) lower the deviation (squares, flash/all)",
    paper="yes",
    ours=ours,
    verdict=verdict,
    note="fewer kv tiles means fewer roundings of the running max,"
    " row sum and accumulator; the kernel-like blockwise backend"
    " (float32 statistics) barely depends on the tile (tile table)",
  )


def _judge_swap(groups):
  parts, worse, total = [], 0, 0
  for (dt, dist), devs in sorted(groups.items()):
    for a, b in sorted(devs):
      if a < b and (b, a) in devs:
        r = metrics.ratio(devs[(b, a)], devs[(a, b)])
        total += 1
        worse += (r or 0) > 1
        parts.append(f"{dt} {dist} {b}x{a} / {a}x{b} = {report.fmt(r)}")
  return worse, total, parts


def _check_swap(records) -> dict:
  ours, verdict = _both(records, _judge_swap)
  return dict(
    claim="swapping Br and Bc changes the deviation (paper: Br > Bc is worse)",
    paper="raises it",
    ours=ours,
    verdict=verdict,
    note="swapping changes Bc, the number of kv steps each row"
    " takes; see the next check: Br alone changes nothing",
  )


def _judge_square(groups):
  parts, same, total = [], 0, 0
  for (dt, dist), devs in sorted(groups.items()):
    for (br, bc), dev in sorted(devs.items()):
      if br != bc and (bc, bc) in devs:
        rel = abs(dev - devs[(bc, bc)]) / max(devs[(bc, bc)], 1e-300)
        total += 1
        same += rel <= SAME_REL
        parts.append(f"{dt} {dist} {br}x{bc} vs {bc}x{bc}: {100 * rel:.2g}%")
  return same, total, parts


def _check_square(records) -> dict:
  ours, verdict = _both(records, _judge_square)
  return dict(
    claim="forcing square tiles has no effect (same Bc, different Br)",
    paper="no effect",
    ours=ours,
    verdict=verdict,
    note="each query row's arithmetic depends only on the kv tiling"
    " (Bc): Br only groups rows, so the deviation is a function of"
    " Bc alone",
  )


def checks(records: list[dict]) -> list[dict]:
  return [
    _check_ratio(records),
    _check_mantissa(records),
    _check_seq(records),
    _check_tiles(records),
    _check_swap(records),
    _check_square(records),
  ]
