#!/usr/bin/env python3
"""Per-device memory and traffic of ring attention on simulated CPU devices (issue 9).

What is measured
----------------
For every case -- implementation ("unsharded": `flash_attention` on one
device; "ring": `ring_attention` over an n-device ring, sequence sharded
`P(None, "seq")`) x pass ("fwd"; "fwdbwd": `jax.grad` of `sum(out * ct)`
with respect to q, k, v, `ct` an argument) x causal x sequence length --

* Compiled memory per device: `jax.jit(f).lower(*specs).compile()
  .memory_analysis()` of the SPMD program (each device runs the same
  partitioned program, so these are per-device figures): temp, argument and
  output bytes, and their total (minus aliased bytes). Nothing is executed
  and no input is allocated (the arguments are `jax.ShapeDtypeStruct`s).
  All simulated devices share one process, so a measured RSS could not be
  split per device; XLA's buffer assignment is the per-device number.
  The device sweep (`--rings`) compiles the ring at the longest sequence
  for several ring sizes: per-device memory should halve per doubling.
* Bytes each device sends, read from the compiled HLO: every
  `collective-permute` instruction's result shape, grouped by where it sits
  -- in the body of a `while` loop (one ring step; the loop runs n - 2
  times) or elsewhere (step 0, the last step's dK/dV hop home, and the
  natural <-> zig-zag permutation of causal calls). Checked against the
  analytic per-step traffic: the K and V shards forward; K, V and the
  float32 dK, dV accumulators backward.

The script sets `XLA_FLAGS=--xla_force_host_platform_device_count=N` itself
(before importing JAX), prints markdown tables, and writes JSON (`--out`)
with the date, machine, JAX version and command line.

Usage:
  python benchmarks/ring_memory.py                      # the RESULTS.md tables
  python benchmarks/ring_memory.py --seqs 4096 --rings 2 8 --out /tmp/r.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import re
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MIB = 1024.0 * 1024.0
_DEFAULT_DEVICES = 8
# HLO element types -> bytes (the ones a ring program sends).
HLO_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "bf16": 2,
  "f16": 2,
  "s16": 2,
  "u16": 2,
  "f32": 4,
  "s32": 4,
  "u32": 4,
  "f64": 8,
  "s64": 8,
}


@dataclasses.dataclass(frozen=True)
class Problem:
  """The attention problem size (sequence length varies)."""

  batch: int = 1
  heads_q: int = 8
  heads_kv: int = 8
  head_dim: int = 128
  dtype: str = "bfloat16"


def _parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument(
    "--seqs", type=int, nargs="+", default=[4096, 8192, 16384, 32768]
  )
  p.add_argument(
    "--ring",
    type=int,
    default=_DEFAULT_DEVICES,
    help="ring size of the sequence sweep",
  )
  p.add_argument(
    "--rings",
    type=int,
    nargs="+",
    default=[2, 4, 8],
    help="ring sizes of the device sweep (at the largest seq)",
  )
  p.add_argument("--passes", nargs="+", default=["fwd", "fwdbwd"])
  p.add_argument(
    "--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"]
  )
  p.add_argument(
    "--out", default=os.path.join(REPO_ROOT, "bench_out", "ring_memory.json")
  )
  args = p.parse_args(argv)
  args.devices = max([args.ring] + args.rings)
  return args


def set_device_count(n: int) -> None:
  flag = f"--xla_force_host_platform_device_count={n}"
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


# ---------------------------------------------------------------------------
# Compiling one case.


def _function(impl, pass_, causal, mesh):
  import jax
  import jax.numpy as jnp

  import pallas_fa3

  if impl == "ring":
    attend = functools.partial(
      pallas_fa3.ring_attention, mesh=mesh, seq_axis="seq", causal=causal
    )
  else:
    attend = functools.partial(pallas_fa3.flash_attention, causal=causal)
  if pass_ == "fwd":
    return attend
  loss = lambda q, k, v, ct: jnp.sum(attend(q, k, v).astype(jnp.float32) * ct)
  return jax.grad(loss, argnums=(0, 1, 2))


def _specs(problem: Problem, seq: int, mesh, pass_: str):
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  sharding = None if mesh is None else NamedSharding(mesh, P(None, "seq"))
  shape_q = (problem.batch, seq, problem.heads_q, problem.head_dim)
  shape_kv = (problem.batch, seq, problem.heads_kv, problem.head_dim)
  spec = lambda shape, dtype=problem.dtype: jax.ShapeDtypeStruct(
    shape, dtype, sharding=sharding
  )
  specs = (spec(shape_q), spec(shape_kv), spec(shape_kv))
  return specs if pass_ == "fwd" else specs + (spec(shape_q, "float32"),)


def _permute_bytes(hlo: str) -> dict[str, int]:
  """Bytes sent by collective-permutes: {"loop": per iteration, "other": rest}."""
  bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
  where, sent = None, {"loop": 0, "other": 0}
  for line in hlo.splitlines():
    header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
    if header:
      where = header.group(1)
      continue
    m = re.search(r"= (.*?) collective-permute(?:-start)?\(", line)
    if not m:
      continue
    result = m.group(1)
    if "collective-permute-start" in line:  # (operand, result, contexts)
      result = re.findall(r"\w+\[[\d,]*\]", result)[0]
    nbytes = sum(
      HLO_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d)
      for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", result)
    )
    sent["loop" if where in bodies else "other"] += nbytes
  return sent


def _analytic_step_bytes(problem: Problem, seq: int, ring: int, pass_: str):
  """Bytes one device sends per ring step: the K and V shards in the forward;
  for "fwdbwd" plus the backward's step: K, V and the float32 dK, dV."""
  import jax.numpy as jnp

  item = jnp.dtype(problem.dtype).itemsize
  kv = problem.batch * (seq // ring) * problem.heads_kv * 2 * problem.head_dim
  fwd = kv * item
  return fwd if pass_ == "fwd" else fwd + kv * (item + 4)


def _case(problem, impl, pass_, causal, seq, ring, meshes):
  mesh = meshes(ring) if impl == "ring" else None
  import jax

  fn = jax.jit(_function(impl, pass_, causal, mesh))
  compiled = fn.lower(*_specs(problem, seq, mesh, pass_)).compile()
  mem = compiled.memory_analysis()
  row = {
    "impl": impl,
    "pass": pass_,
    "causal": causal,
    "seq": seq,
    "devices": ring if impl == "ring" else 1,
    "temp_bytes": mem.temp_size_in_bytes,
    "argument_bytes": mem.argument_size_in_bytes,
    "output_bytes": mem.output_size_in_bytes,
    "alias_bytes": mem.alias_size_in_bytes,
  }
  row["total_bytes"] = (
    row["temp_bytes"]
    + row["argument_bytes"]
    + row["output_bytes"]
    - row["alias_bytes"]
  )
  if impl == "ring":
    sent = _permute_bytes(compiled.as_text())
    row["permute_loop_bytes"] = sent["loop"]
    row["permute_other_bytes"] = sent["other"]
    row["analytic_step_bytes"] = _analytic_step_bytes(problem, seq, ring, pass_)
    row["sent_per_call_bytes"] = sent["other"] + sent["loop"] * max(ring - 2, 0)
  return row


# ---------------------------------------------------------------------------
# Reporting.


def _mib(x):
  return f"{x / _MIB:.2f}"


def _total_table(rows, unsharded) -> list[str]:
  out = [
    "| pass | causal | seq | devices | temp MiB | args MiB | output MiB |"
    " total MiB/device | unsharded total MiB | unsharded / ring |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    base = unsharded[(r["pass"], r["causal"], r["seq"])]
    out.append(
      f"| {r['pass']} | {r['causal']} | {r['seq']} | {r['devices']} |"
      f" {_mib(r['temp_bytes'])} | {_mib(r['argument_bytes'])} |"
      f" {_mib(r['output_bytes'])} | {_mib(r['total_bytes'])} |"
      f" {_mib(base['total_bytes'])} |"
      f" {base['total_bytes'] / r['total_bytes']:.2f}x |"
    )
  return out


def _device_table(rows, unsharded) -> list[str]:
  """Per-device total vs ring size at one seq: should halve per doubling."""
  out = [
    "| pass | causal | seq | devices | total MiB/device |"
    " vs previous row | unsharded / ring |",
    "|---|---|---:|---:|---:|---:|---:|",
  ]
  for (pass_, causal, seq), base in sorted(unsharded.items()):
    ring = sorted(
      (
        r
        for r in rows
        if (r["pass"], r["causal"], r["seq"]) == (pass_, causal, seq)
      ),
      key=lambda r: r["devices"],
    )
    if len(ring) < 2:
      continue
    prev = base
    for r in [base] + ring:
      step = prev["total_bytes"] / r["total_bytes"]
      out.append(
        f"| {pass_} | {causal} | {seq} | {r['devices']} |"
        f" {_mib(r['total_bytes'])} | {step:.2f}x |"
        f" {base['total_bytes'] / r['total_bytes']:.2f}x |"
      )
      prev = r
  return out


def _traffic_table(rows) -> list[str]:
  out = [
    "| pass | causal | seq | devices | per ring step (loop bodies) MiB |"
    " analytic MiB | outside the loops MiB | per call MiB |",
    "|---|---|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    out.append(
      f"| {r['pass']} | {r['causal']} | {r['seq']} | {r['devices']} |"
      f" {_mib(r['permute_loop_bytes'])} | {_mib(r['analytic_step_bytes'])}"
      f" | {_mib(r['permute_other_bytes'])} |"
      f" {_mib(r['sent_per_call_bytes'])} |"
    )
  return out


def _tables(rows, args) -> str:
  unsharded = {
    (r["pass"], r["causal"], r["seq"]): r
    for r in rows
    if r["impl"] == "unsharded"
  }
  ring = [r for r in rows if r["impl"] == "ring"]
  sweep = [r for r in ring if r["devices"] == args.ring]
  out = [f"Per-device compiled memory, ring of {args.ring} vs one device:", ""]
  out += _total_table(sweep, unsharded)
  out += ["", f"Per-device total vs ring size at seq {max(args.seqs)}:", ""]
  out += _device_table(ring, unsharded)
  out += [
    "",
    "Bytes each device sends (collective-permute results in the"
    " compiled HLO; each ring loop runs devices - 2 times; fwdbwd has"
    " two, forward and backward):",
    "",
  ]
  out += _traffic_table(ring)
  return "\n".join(out)


def environment(argv) -> dict:
  import jax

  try:
    commit = subprocess.run(
      ["git", "rev-parse", "--short", "HEAD"],
      cwd=REPO_ROOT,
      capture_output=True,
      text=True,
      check=False,
    ).stdout.strip()
  except OSError:
    commit = ""
  return {
    "date": datetime.datetime.now(datetime.UTC).isoformat(),
    "machine": platform.platform(),
    "cpus": os.cpu_count(),
    "jax": jax.__version__,
    "devices": [str(d) for d in jax.devices()],
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "command": " ".join([os.path.basename(sys.executable)] + argv),
    "commit": commit,
  }


def main(argv=None):
  argv = sys.argv if argv is None else argv
  args = _parse_args(argv[1:])
  set_device_count(args.devices)
  sys.path.insert(0, REPO_ROOT)
  import jax
  import numpy as np

  if jax.device_count() < args.devices:
    sys.exit(
      f"need {args.devices} devices, JAX sees {jax.device_count()}"
      " (XLA_FLAGS was set before this script started?)"
    )

  @functools.cache
  def meshes(ring):
    return jax.sharding.Mesh(np.array(jax.devices()[:ring]), ("seq",))

  problem = Problem(dtype=args.dtype)
  cases = [
    (impl, p, c, s, args.ring)
    for p in args.passes
    for c in (False, True)
    for s in args.seqs
    for impl in ("unsharded", "ring")
  ]
  cases += [
    ("ring", p, c, max(args.seqs), r)
    for p in args.passes
    for c in (False, True)
    for r in args.rings
    if r != args.ring
  ]
  rows = []
  for impl, pass_, causal, seq, ring in cases:
    row = _case(problem, impl, pass_, causal, seq, ring, meshes)
    print(
      f"{impl:9s} {pass_:6s} causal={causal!s:5s} seq={seq:6d}"
      f" devices={row['devices']}: total {_mib(row['total_bytes'])} MiB",
      flush=True,
    )
    rows.append(row)
  rows.sort(
    key=lambda r: (r["pass"], r["causal"], r["impl"], r["devices"], r["seq"])
  )
  print()
  print(f"Problem: {dataclasses.asdict(problem)}")
  print(_tables(rows, args))
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(
      {
        "environment": environment(argv),
        "problem": dataclasses.asdict(problem),
        "rows": rows,
      },
      f,
      indent=1,
    )
  print(f"\nwrote {args.out}")


if __name__ == "__main__":
  main()
