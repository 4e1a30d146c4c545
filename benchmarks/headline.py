"""The device check's headline table, from the files its steps wrote.

    python benchmarks/headline.py DIR      # writes DIR/headline.md

Reads DIR/bench_fwd/results.json and DIR/bench_bwd/results.json (from
`pallas-fa3 bench`), DIR/fp8/fp8.json (from fp8_device_check.py) and
DIR/decode/results.json and DIR/decode_modes/results.json (from
`pallas-fa3 bench --mode decode`: q_len, batch_invariant, flex); any of
them may be missing (a step that timed out): its rows say so. One row per
(pass, head dim, causal) at 16k tokens: TFLOPs/s of ours (mosaic), the
blockwise twin on the GPU, cuDNN, XLA and attention_mgpu, and ours over the
best baseline. Then a decode table, a row per case: GB/s of K/V read and %
of the HBM peak of ours (mosaic), JAX's Triton decode ops
(decode_attention.gqa, paged_attention), XLA and cuDNN, and ours over the
best of them.
"""

from __future__ import annotations

import json
import pathlib
import sys

IMPLS = ("mosaic", "mosaic-det", "blockwise", "cudnn", "xla", "mgpu")
BASELINES = ("cudnn", "xla", "mgpu")
DECODE_IMPLS = ("mosaic", "triton-gqa", "triton-paged", "xla", "cudnn")
DECODE_BASELINES = DECODE_IMPLS[1:]


def _load(path: pathlib.Path):
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return None


def _cell(rec) -> str:
  if rec is None:
    return "-"
  if rec.get("status") == "ok" and rec.get("tflops") is not None:
    return f"{rec['tflops']:.0f}"
  return rec.get("status", "?")


def bench_rows(result: dict | None, label: str) -> list[str]:
  if result is None:
    return [f"| {label} | (missing: the step did not finish) |"]
  cases: dict[tuple, dict] = {}
  for rec in result.get("records", []):
    key = (
      rec["mode"],
      rec["dtype"],
      rec["head_dim"],
      rec["causal"],
      rec["seq_q"],
    )
    cases.setdefault(key, {})[rec["impl"]] = rec
  rows = []
  for (mode, dtype, d, causal, seq), by_impl in sorted(cases.items()):
    ours = by_impl.get("mosaic", {}).get("tflops")
    best = max(
      (
        by_impl[b]["tflops"]
        for b in BASELINES
        if by_impl.get(b, {}).get("tflops")
      ),
      default=None,
    )
    ratio = f"{ours / best:.2f}" if ours and best else "-"
    rows.append(
      f"| {mode} {dtype} d{d} {'causal' if causal else 'full'}"
      f" s{seq} | "
      + " | ".join(_cell(by_impl.get(i)) for i in IMPLS)
      + f" | {ratio} |"
    )
  return rows


def fp8_rows(result: dict | None) -> list[str]:
  if result is None:
    return ["| fwd fp8 | (missing: the step did not finish) |"]
  rows = []
  for r in result.get("timings", []):
    total = r.get("fp8 total TFLOPs/s")
    kernel = r.get("fp8 kernel TFLOPs/s")
    fmt = lambda x: f"{x:.0f}" if isinstance(x, float) else "-"
    rows.append(
      f"| fwd fp8 d{r['head_dim']} {'causal' if r['causal'] else 'full'}"
      f" s16384 | {fmt(total)} (kernel {fmt(kernel)}) | - | - | - | - |"
      f" - |"
    )
  return rows


def _decode_cell(rec) -> str:
  if rec is None:
    return "-"
  if rec.get("status") == "ok" and rec.get("gbps") is not None:
    pct = rec.get("pct_hbm")
    gbps = rec["gbps"]
    text = f"{gbps:.0f}" if gbps >= 100 else f"{gbps:.3g}"
    return text + ("" if pct is None else f" ({pct:.0f}%)")
  return rec.get("status", "?")


def _decode_case(rec: dict) -> str:
  """ "b64 L8192 32/8 d128 page 64 splits auto" """
  layout = (
    "contiguous" if rec["page_size"] is None else f"page {rec['page_size']}"
  )
  modes = "".join(
    (
      f" q{rec['seq_q']}" if rec.get("seq_q", 1) > 1 else "",
      " batch-invariant" if rec.get("batch_invariant") else "",
      f" {rec['flex']}" if rec.get("flex") else "",
    )
  )
  return (
    f"b{rec['batch']} L{rec['cache_len']} {rec['heads_q']}/{rec['heads_kv']}"
    f" d{rec['head_dim']} {rec['dtype']} {layout} splits {rec['num_splits']}"
    + modes
  )


def decode_rows(result: dict | None) -> list[str]:
  """The decode table's header and rows (GB/s and % of the HBM peak)."""
  header = [
    "| decode case | " + " | ".join(DECODE_IMPLS) + " | ours / best baseline |",
    "|---|" + "---:|" * (len(DECODE_IMPLS) + 1),
  ]
  if result is None:
    return header + ["| decode | (missing: the step did not finish) |"]
  cases: dict[str, dict] = {}
  for rec in result.get("records", []):
    cases.setdefault(rec["spec"], {})[rec["impl"]] = rec
  rows = []
  for by_impl in cases.values():
    first = next(iter(by_impl.values()))
    ours = by_impl.get("mosaic", {}).get("gbps")
    best = max(
      (
        by_impl[b]["gbps"]
        for b in DECODE_BASELINES
        if by_impl.get(b, {}).get("gbps")
      ),
      default=None,
    )
    ratio = f"{ours / best:.2f}" if ours and best else "-"
    rows.append(
      f"| {_decode_case(first)} | "
      + " | ".join(_decode_cell(by_impl.get(i)) for i in DECODE_IMPLS)
      + f" | {ratio} |"
    )
  return header + rows


def main(argv=None) -> int:
  out = pathlib.Path((argv or sys.argv[1:])[0])
  lines = [
    "| case (16k tokens) | " + " | ".join(IMPLS) + " | ours / best baseline |",
    "|---|" + "---:|" * (len(IMPLS) + 1),
  ]
  lines += bench_rows(_load(out / "bench_fwd" / "results.json"), "fwd")
  lines += bench_rows(_load(out / "bench_bwd" / "results.json"), "bwd")
  lines += fp8_rows(_load(out / "fp8" / "fp8.json"))
  decode = _load(out / "decode" / "results.json")
  modes = _load(out / "decode_modes" / "results.json")
  if decode is not None and modes is not None:  # issue 67's rows after
    decode = dict(decode, records=decode["records"] + modes["records"])
  peak = (decode or {}).get("hbm_peak", "unknown")
  text = (
    "TFLOPs/s (median; attention_mgpu on float16 copies)\n\n"
    + "\n".join(lines)
    + "\n\nDecoding: GB/s of K/V read (median), in brackets % of the HBM"
    + f" peak ({peak})\n\n"
    + "\n".join(decode_rows(decode))
    + "\n"
  )
  (out / "headline.md").write_text(text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
