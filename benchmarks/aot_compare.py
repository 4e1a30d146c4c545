"""Two `pallas-fa3 aot --json` reports compared field by field (every
kernel's registers, spills, shared memory, setmaxnreg, wgmma, wait_group
depths, barriers, TMA, loop mix, PTX instruction count), and optionally
both as per-kernel Markdown tables (benchmarks/aot_issue42.md).

  python benchmarks/aot_compare.py BEFORE.json AFTER.json [--md OUT --title T]
"""

from __future__ import annotations

import argparse
import json


def _table(report: list[dict]) -> str:
  rows = [
    "| kernel | regs | spill B (st/ld) | smem B | wgmma shapes | wait_group"
    " depth:sites | named barrier ops | loop instr | PTX instr |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  seen = set()
  for call in sorted(report, key=lambda c: c["name"]):
    for k in call["kernels"]:
      key = json.dumps(k, sort_keys=True)
      if key in seen:
        continue
      seen.add(key)
      waits = " ".join(f"{d}:{n}" for d, n in sorted(k["wait_group"].items()))
      bars = " ".join(
        f"{op.split('.')[1]}:{n}"
        for op, n in sorted(k["named_barrier_ops"].items())
      )
      mma = ", ".join(
        f"{s.split()[0]}x{n}" for s, n in sorted(k["wgmma"].items())
      )
      rows.append(
        f"| {k['name']} | {k['registers']} | {k['spill_store_bytes']}/"
        f"{k['spill_load_bytes']} | {k['smem_bytes']} | {mma} | {waits} |"
        f" {bars} | {k['loop']['total']} | {k['instructions']} |"
      )
  return "\n".join(rows) + "\n"


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("before")
  p.add_argument("after")
  p.add_argument("--md", help="append both tables to this file")
  p.add_argument("--title", default="sweep")
  args = p.parse_args()
  with open(args.before) as f:
    before = json.load(f)
  with open(args.after) as f:
    after = json.load(f)
  b = {c["name"]: c for c in before}
  a = {c["name"]: c for c in after}
  count = lambda rep: sum(len(c["kernels"]) for c in rep)
  print(
    f"calls {len(b)} -> {len(a)}, kernels {count(before)} -> {count(after)}"
  )
  print("only before:", sorted(set(b) - set(a)))
  print("only after:", sorted(set(a) - set(b)))
  differ = 0
  for name in sorted(set(a) & set(b)):
    if a[name] == b[name]:
      continue
    differ += 1
    for x, y in zip(b[name]["kernels"], a[name]["kernels"], strict=False):
      for field in sorted(set(x) | set(y)):
        if x.get(field) != y.get(field):
          print(
            "DIFF", name, x["name"], field, x.get(field), "->", y.get(field)
          )
  print("calls differing:", differ)
  if args.md:
    with open(args.md, "a") as out:
      out.write(f"\n## {args.title}: before\n\n{_table(before)}")
      out.write(f"\n## {args.title}: after\n\n{_table(after)}")
  return 1 if differ or set(a) != set(b) else 0


if __name__ == "__main__":
  raise SystemExit(main())
