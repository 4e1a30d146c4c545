"""FA3 Table 3 on a CPU: FP8 attention error with and without our techniques.

Runs the paper's error test (`pallas_fa3.tools.numerics.fp8_methods`: Q, K, V
entries N(0,1) + N(0,100) * Bernoulli(0.001), float16, RMSE of the output
against float64) for baseline FP16, flash FP16, baseline FP8 with per-tensor
scaling, ours FP8 (the blockwise twin of the FP8 kernel: block quantization
+ randomized Hadamard) and its two ablations, then:

- the ours / per-tensor ratio over several input draws (the bar: >= 2x at
  d = 128);
- the ratio against sequence length and head dim.

Prints a markdown section; `--write` puts it into benchmarks/RESULTS.md
between the `fp8-error-table` markers (replacing an earlier run), and
`--json` writes the raw figures.

    PYTHONPATH=. python benchmarks/fp8_error_table.py --write --json bench_out/fp8_error_table.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import sys
import time

import jax
import numpy as np

from pallas_fa3.tools.numerics import fp8_methods

_RESULTS = pathlib.Path(__file__).resolve().parent / "RESULTS.md"
_START, _END = "<!-- fp8-error-table:start -->", "<!-- fp8-error-table:end -->"
_PAIR = ("baseline FP8 per-tensor", "ours FP8", fp8_methods.Q_RESIDUAL)
_RES = fp8_methods.Q_RESIDUAL


def _ratio(r: dict, method: str = "ours FP8") -> float:
  return r["baseline FP8 per-tensor"] / r[method]


def _run(args) -> dict:
  b, s, h, d = args.shape
  t0 = time.time()
  main = fp8_methods.error_table(jax.random.key(0), b, s, h, d)
  print(f"main table {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
  draws = [main] + [
    fp8_methods.error_table(jax.random.key(i), b, s, h, d, _PAIR)
    for i in range(1, args.draws)
  ]
  short = args.short_seq
  short_heads = max(1, args.tokens // short)
  draws_short = [
    fp8_methods.error_table(jax.random.key(i), 1, short, short_heads, d, _PAIR)
    for i in range(args.draws)
  ]
  print(f"draws {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
  by_seq = {}
  for seq in args.seqs:
    heads = max(1, args.tokens // seq)
    by_seq[seq] = (
      heads,
      fp8_methods.error_table(jax.random.key(0), 1, seq, heads, d, _PAIR),
    )
  print(f"seqs {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
  by_dim = {
    dim: fp8_methods.error_table(jax.random.key(0), b, s, h, dim, _PAIR)
    for dim in args.head_dims
  }
  print(f"dims {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
  sources = fp8_methods.error_sources(jax.random.key(0), b, s, h, d)
  return dict(
    shape=args.shape,
    main=main,
    draws=draws,
    draws_short=dict(seq=short, heads=short_heads, tables=draws_short),
    by_seq=by_seq,
    by_dim=by_dim,
    sources=sources,
    seconds=time.time() - t0,
    finished=time.time(),
  )


def _markdown(res: dict, command: str) -> str:
  b, s, h, d = res["shape"]
  main, draws = res["main"], res["draws"]
  ratios = [_ratio(r) for r in draws]
  ours = [r["ours FP8"] for r in draws]
  now = datetime.datetime.fromtimestamp(res["finished"], datetime.UTC)
  lines = [
    _START,
    "## FP8 attention error: FA3 Table 3 on a CPU (issues 8 and 18)",
    "",
    f"- **Date:** {now:%a %b %d %Y %H:%M} UTC. **Machine:** CPU"
    f" ({platform.machine()}, `{platform.platform()}`), no GPU."
    f" **Software:** JAX {jax.__version__}, Python {platform.python_version()}.",
    f"- **Command:** `{command}` ({res['seconds']:.0f} s).",
    "- **Setup** (paper, section 4.3): every entry of Q, K, V is"
    " N(0,1) + N(0,100) x Bernoulli(0.001), rounded to float16; RMSE of the"
    " output against float64 attention of the same inputs; non-causal,"
    f" MHA, batch {b}, seq {s}, {h} heads, head_dim {d}, softmax scale"
    " 1/sqrt(d). Definitions of each method:"
    " `pallas_fa3/tools/numerics/fp8_methods.py`."
    ' "ours" is the blockwise twin of the FP8 kernel'
    ' (`implementation="blockwise"`: the kernel\'s default tiles'
    " 64 x 128, its descales and its P rounding), i.e. what the kernel"
    " computes up to exp2/summation order; the kernel itself has not run"
    " on a GPU.",
    "",
    "| method | RMSE (ours, input draw 0) | RMSE (paper) |",
    "|---|---:|---:|",
  ]
  for m in fp8_methods.METHODS:
    paper = fp8_methods.PAPER_RMSE.get(m)
    paper = "-" if paper is None else f"{paper:.1e}"
    lines.append(f"| {m} | {main[m]:.2e} | {paper} |")
  lines += [
    "",
    f"Ours FP8 vs per-tensor baseline over {len(draws)} input draws"
    f" (same shape): ratio min {min(ratios):.2f}, mean"
    f" {np.mean(ratios):.2f}, max {max(ratios):.2f} (paper: 2.6); ours RMSE"
    f" {min(ours):.2e} .. {max(ours):.2e} (paper 9.1e-3).",
    "",
    "Over input draws (RMSE min .. max; ratio = per-tensor baseline / ours,"
    " min / mean / max):",
    "",
    "| seq | heads | draws | baseline FP8 per-tensor | ours FP8 | ratio |"
    f" {_RES} | ratio |",
    "|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  short = res.get("draws_short")
  for seq, heads, tables in [(s, h, draws)] + (
    [(short["seq"], short["heads"], short["tables"])] if short else []
  ):
    cells = []
    for m in _PAIR:
      v = [t[m] for t in tables]
      cells.append(f"{min(v):.2e} .. {max(v):.2e}")
      if m != _PAIR[0]:
        r = [_ratio(t, m) for t in tables]
        cells.append(f"{min(r):.2f} / {np.mean(r):.2f} / {max(r):.2f}")
    lines.append(
      f"| {seq} | {heads} | {len(tables)} | " + " | ".join(cells) + " |"
    )
  lines += [
    "",
    "Ratio against sequence length (head_dim "
    f"{d}, heads = {res.get('tokens', '')} tokens / seq; draw 0):",
    "",
    "| seq | heads | baseline FP8 per-tensor | ours FP8 | ratio |"
    f" {_RES} | ratio |",
    "|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for seq, (heads, r) in sorted(res["by_seq"].items()):
    lines.append(
      f"| {seq} | {heads} | {r[_PAIR[0]]:.2e} | {r[_PAIR[1]]:.2e}"
      f" | {_ratio(r):.2f} | {r[_RES]:.2e} | {_ratio(r, _RES):.2f} |"
    )
  lines += [
    "",
    f"Ratio against head_dim (batch {b}, seq {s}, {h} heads; draw 0):",
    "",
    f"| head_dim | baseline FP8 per-tensor | ours FP8 | ratio | {_RES} |"
    " ratio |",
    "|---:|---:|---:|---:|---:|---:|",
  ]
  for dim, r in sorted(res["by_dim"].items()):
    lines.append(
      f"| {dim} | {r[_PAIR[0]]:.2e} | {r[_PAIR[1]]:.2e} | {_ratio(r):.2f}"
      f" | {r[_RES]:.2e} | {_ratio(r, _RES):.2f} |"
    )
  src = res["sources"]
  lines += [
    "",
    f"What limits ours (draw 0, batch {b}, seq {s}, {h} heads, d {d}): RMSE"
    " of float64 attention with a single FP8 error source"
    " (`fp8_methods.error_sources`):",
    "",
    "| error source alone | RMSE |",
    "|---|---:|",
  ]
  lines += [f"| {name} | {value:.2e} |" for name, value in src.items()]
  quad = np.sqrt(sum(v**2 for k, v in src.items() if "not rotated" not in k))
  lines += [
    "",
    f"Reading: the three sources of ours add in quadrature ({quad:.2e} vs"
    f" {main['ours FP8']:.2e} measured). Ours is limited by e4m3's 3-bit"
    " mantissa on the rotated Q and K and on V (V is not rotated, as in the"
    " paper); block quantization changes little on this input"
    " (relative rounding error does not depend on the scale while values"
    " stay in e4m3's normal range), as the paper's 9.1e-3 vs 9.3e-3 says;"
    " the rotation is what cuts the Q/K error (the two Q/K rows above)."
    " The per-tensor baseline carries the unrotated Q/K error plus float16"
    " scores and a per-tensor e4m3 P, and its error grows with sequence"
    " length while ours does not, so the ratio grows from ~1.9 at seq 1024"
    " to ~2.8 at 8192 (not separated here; the likely cause is P: with one"
    " scale for all of P, more small probabilities fall into e4m3's"
    " subnormal range as rows get longer). The paper's 2.6 at its"
    " unstated shape is within that range. Beyond the paper,"
    f" `FP8Config(q_residual=True)` ({_RES}) quantizes Q's rounding"
    " residual again and adds a second Q K^T product: Q's half of the Q/K"
    " error goes, leaving K, V and P (design notes, FP8 accuracy).",
    "",
    _END,
  ]
  return "\n".join(lines)


def _write(section: str) -> None:
  text = _RESULTS.read_text()
  if _START in text and _END in text:
    head, rest = text.split(_START, 1)
    text = head + section + rest.split(_END, 1)[1]
  else:
    text = text.rstrip("\n") + "\n\n" + section + "\n"
  _RESULTS.write_text(text)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--shape",
    type=int,
    nargs=4,
    default=(1, 4096, 8, 128),
    metavar=("BATCH", "SEQ", "HEADS", "HEAD_DIM"),
  )
  parser.add_argument("--draws", type=int, default=5)
  parser.add_argument(
    "--short-seq",
    type=int,
    default=1024,
    help="the second sequence length drawn --draws times",
  )
  parser.add_argument(
    "--seqs", type=int, nargs="*", default=(1024, 2048, 4096, 8192)
  )
  parser.add_argument(
    "--tokens",
    type=int,
    default=16384,
    help="seq x heads for the sequence-length rows",
  )
  parser.add_argument(
    "--head-dims", type=int, nargs="*", default=(64, 128, 256)
  )
  parser.add_argument(
    "--write",
    action="store_true",
    help="put the section into benchmarks/RESULTS.md",
  )
  parser.add_argument("--json", type=pathlib.Path, default=None)
  parser.add_argument(
    "--from-json",
    type=pathlib.Path,
    default=None,
    help="re-render a previous --json run instead of running",
  )
  args = parser.parse_args(argv)
  if args.from_json:
    res = json.loads(args.from_json.read_text())
    res["by_seq"] = {int(k): v for k, v in res["by_seq"].items()}
    res["by_dim"] = {int(k): v for k, v in res["by_dim"].items()}
    command = res["command"]
  else:
    res = _run(args)
    res["tokens"] = args.tokens
    command = "PYTHONPATH=. python benchmarks/fp8_error_table.py " + " ".join(
      argv if argv is not None else sys.argv[1:]
    )
    res["command"] = command.strip()
  section = _markdown(res, command.strip())
  print(section)
  if args.write:
    _write(section)
  if args.json and not args.from_json:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    serial = dict(
      res,
      by_seq={str(k): v for k, v in res["by_seq"].items()},
      by_dim={str(k): v for k, v in res["by_dim"].items()},
    )
    args.json.write_text(json.dumps(serial, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
