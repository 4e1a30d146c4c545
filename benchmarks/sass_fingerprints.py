"""Whether a change moved the compiled kernels: each aot sweep item's SASS,
hashed as is and with register names erased, one JSON line per item.

  JAX_PLATFORMS=cpu python benchmarks/sass_fingerprints.py record OUT.jsonl \\
      defaults:0-74 modifiers:77-120 flex:95-147 decode:148,149 fp8sc:26
  python benchmarks/sass_fingerprints.py compare BEFORE.jsonl AFTER.jsonl

`record` compiles the items of `pallas_fa3.tools.aot`'s sweeps (the
deviceless sm_90a compile; `fp8sc:N` is defaults item N with softcap=30)
and is resumable (items already in OUT are skipped); run it once per
checkout (`PYTHONPATH` picks the code). `compare` prints how many items
compiled to the same SASS, the same but for register names, or other
code, with the changed kernels' registers, spills and loop sizes.
Refactors that should not move a kernel (benchmarks/RESULTS.md, issue 66
item 1) are checked with it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import sys
import time


def _items(spec: str) -> list[str]:
  which, idx = spec.split(":")
  out = []
  for part in idx.split(","):
    lo, _, hi = part.partition("-")
    out += [f"{which}:{i}" for i in range(int(lo), int(hi or lo) + 1)]
  return out


def _digest(text: str, registers: bool) -> str:
  text = re.sub(r"/\*[0-9a-f]{4,}\*/", "", text)  # addresses
  if not registers:
    text = re.sub(r"\b(U?R|U?P)\d+\b", r"\1", text)
  return hashlib.sha1(text.encode()).hexdigest()[:12]


def record(out: pathlib.Path, specs: list[str]) -> None:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from pallas_fa3.tools.aot import compiler, decode, sweeps

  sass: list = []
  profiles = compiler.kernel_profiles

  def keep_sass(dump, label):
    for f in sorted(pathlib.Path(dump).glob("*.sass_ctrl")):
      t = f.read_text()
      sass.append((f.name, _digest(t, True), _digest(t, False)))
    return profiles(dump, label)

  compiler.kernel_profiles = keep_sass
  gens = dict(
    defaults=sweeps.defaults_sweep, modifiers=sweeps.modifiers_sweep,
    flex=sweeps.flex_sweep, decode=decode.decode_sweep,
    fp8=sweeps.fp8_forward_sweep,
  )  # fmt: skip
  lists: dict = {}
  done = set()
  if out.exists():
    done = {json.loads(line)["item"] for line in out.read_text().splitlines()}
  mesh = compiler.h200_mesh()
  for item in [i for s in specs for i in _items(s)]:
    if item in done:
      continue
    which, i = item.split(":")
    sweep = "defaults" if which == "fp8sc" else which
    if sweep not in lists:
      lists[sweep] = list(gens[sweep]())
    fn, spec, config = lists[sweep][int(i)]
    if which == "fp8sc":
      spec = dataclasses.replace(spec, softcap=30.0)
    sass.clear()
    t0 = time.time()
    rec: dict = dict(item=item)
    try:
      rep = fn(spec, config, mesh)
      rec["kernels"] = [
        dict(name=k.name, regs=k.registers,
             spill=(k.spill_store_bytes, k.spill_load_bytes),
             loop=(k.loop or {}).get("total"))
        for k in rep.kernels
      ]  # fmt: skip
      rec["sass"] = list(sass)
    except Exception as e:  # noqa: BLE001 (recorded, the sweep goes on)
      rec["error"] = f"{type(e).__name__}: {str(e)[-400:]}"
    rec["seconds"] = round(time.time() - t0, 1)
    with out.open("a") as f:
      f.write(json.dumps(rec) + "\n")


def compare(before: pathlib.Path, after: pathlib.Path) -> dict:
  load = lambda p: {
    r["item"]: r for r in map(json.loads, p.read_text().splitlines())
  }
  b, a = load(before), load(after)
  counts = dict(identical=0, registers_only=0, changed=0, errors=0)
  for item in b:
    if item not in a:
      continue
    rb, ra = b[item], a[item]
    if "error" in rb or "error" in ra:
      counts["errors"] += 1
      print(item, "error:", rb.get("error"), "|", ra.get("error"))
      continue
    if [s[1] for s in rb["sass"]] == [s[1] for s in ra["sass"]]:
      counts["identical"] += 1
    elif [s[2] for s in rb["sass"]] == [s[2] for s in ra["sass"]]:
      counts["registers_only"] += 1
    else:
      counts["changed"] += 1
      for kb, ka in zip(rb["kernels"], ra["kernels"]):
        print(
          f"{item} {kb['name']}: regs {kb['regs']}->{ka['regs']}, spills"
          f" {kb['spill']}->{ka['spill']}, loop {kb['loop']}->{ka['loop']}"
        )
  print(", ".join(f"{k} {v}" for k, v in counts.items()))
  return counts


if __name__ == "__main__":
  cmd, *args = sys.argv[1:]
  if cmd == "record":
    record(pathlib.Path(args[0]), args[1:])
  else:
    compare(pathlib.Path(args[0]), pathlib.Path(args[1]))
