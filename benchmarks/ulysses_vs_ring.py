#!/usr/bin/env python3
"""Long context across devices (issue 33): ring vs Ulysses, and the windowed ring.

What is measured, on simulated CPU devices (`--xla_force_host_platform_
device_count`, set by the script before JAX starts):

* Axis sweep: for every scheme ("ring": `ring_attention`; "ulysses":
  `ulysses_attention`; at 1 device plain `flash_attention`), axis size n
  and pass ("fwd"; "fwdbwd": `jax.grad` of `sum(out * ct)` in q, k, v) at
  one sequence length: the compiled per-device memory
  (`compiled.memory_analysis()`: temp + arguments + outputs - aliased,
  each device runs the same SPMD program), the bytes each device sends
  (collective-permute / all-to-all results in the compiled HLO, loop
  bodies counted once per trip), and the wall time of one call (median of
  `--repeats` after a warm-up). All simulated devices share this
  machine's cores, so the time is the whole ring's work on those cores,
  not one device's: it shows the work and the overheads each scheme adds,
  not a speed-up.
* Window: the causal ring (zig-zag, K/V all the way round) against the
  causal ring with a left window (`--window`), in the order the library
  picks (natural) and forced to zig-zag, at `--window-seqs` tokens on
  `--ring` devices: time, the ratio to the full ring, K/V steps and bytes
  sent.

Prints markdown tables and writes JSON (`--out`) with the date, machine,
JAX version, commit and command line.

Usage:
  python benchmarks/ulysses_vs_ring.py                    # RESULTS.md tables
  python benchmarks/ulysses_vs_ring.py --seq 2048 --repeats 2 --out /tmp/u.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import statistics
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
import ring_memory  # noqa: E402  (the HLO byte counter and environment)

_MIB = 1024.0 * 1024.0
_KINDS = ("collective-permute", "all-to-all")


def _parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--seq", type=int, default=4096, help="axis sweep length")
  p.add_argument("--rings", type=int, nargs="+", default=[1, 2, 4, 8])
  p.add_argument("--ring", type=int, default=8, help="devices of the window")
  p.add_argument("--window", type=int, default=256)
  p.add_argument("--window-seqs", type=int, nargs="+", default=[8192, 1024])
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--passes", nargs="+", default=["fwd", "fwdbwd"])
  p.add_argument(
    "--out",
    default=os.path.join(REPO_ROOT, "bench_out", "ulysses_vs_ring.json"),
  )
  return p.parse_args(argv)


def _sent_bytes(hlo: str, trips: int) -> int:
  """Bytes of collective results (permutes, all-to-alls) one device sends
  per call: loop bodies counted `trips` times (an upper bound when loops
  differ; the window's rings have one short loop per stream)."""
  bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
  where, total = None, 0
  for line in hlo.splitlines():
    header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
    if header:
      where = header.group(1)
      continue
    m = re.search(r"= (.*?) (collective-permute|all-to-all)(?:-start)?\(", line)
    if not m:
      continue
    shapes = re.findall(r"(\w+)\[([\d,]*)\]", m.group(1))
    nbytes = sum(
      ring_memory.HLO_BYTES.get(t, 0)
      * math.prod(int(x) for x in d.split(",") if x)
      for t, d in shapes
    )
    total += nbytes * (trips if where in bodies else 1)
  return total


def _timed(fn, args, repeats):
  import jax

  jax.block_until_ready(fn(*args))  # compile + warm-up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _with_pass(attend, pass_):
  import jax
  import jax.numpy as jnp

  if pass_ == "fwd":
    return attend
  loss = lambda q, k, v, ct: jnp.sum(attend(q, k, v).astype(jnp.float32) * ct)
  return jax.grad(loss, argnums=(0, 1, 2))


def _inputs(args, seq, mesh, pass_):
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  shape = (1, seq, args.heads, args.head_dim)
  keys = jax.random.split(jax.random.key(0), 4)
  xs = [jax.random.normal(key, shape, args.dtype) for key in keys[:3]]
  if pass_ != "fwd":
    xs.append(jax.random.normal(keys[3], shape, "float32"))
  if mesh is None:
    return xs
  seq_sharding = NamedSharding(mesh, P(None, "seq"))
  return [jax.device_put(x, seq_sharding) for x in xs]


def _measure(args, attend, seq, mesh, pass_, trips):
  import jax

  xs = _inputs(args, seq, mesh, pass_)
  fn = jax.jit(_with_pass(attend, pass_))
  compiled = fn.lower(*xs).compile()
  mem = compiled.memory_analysis()
  total = (
    mem.temp_size_in_bytes
    + mem.argument_size_in_bytes
    + mem.output_size_in_bytes
    - mem.alias_size_in_bytes
  )
  hlo = compiled.as_text()
  return {
    "total_bytes": total,
    "temp_bytes": mem.temp_size_in_bytes,
    "sent_bytes": _sent_bytes(hlo, trips),
    "collectives": {
      k: hlo.count(f" {k}(") + hlo.count(f" {k}-start(") for k in _KINDS
    },
    "seconds": _timed(compiled, xs, args.repeats),
  }


def _axis_sweep(args, meshes):
  import pallas_fa3

  rows = []
  for pass_ in args.passes:
    for n in args.rings:
      mesh = meshes(n) if n > 1 else None
      schemes = ("ring", "ulysses") if n > 1 else ("one device",)
      for scheme in schemes:
        if scheme == "ring":
          attend = functools.partial(
            pallas_fa3.ring_attention, mesh=mesh, seq_axis="seq", causal=True
          )
        elif scheme == "ulysses":
          attend = functools.partial(
            pallas_fa3.ulysses_attention, mesh=mesh, seq_axis="seq", causal=True
          )
        else:
          attend = functools.partial(pallas_fa3.flash_attention, causal=True)
        row = _measure(args, attend, args.seq, mesh, pass_, max(n - 2, 0))
        row.update(scheme=scheme, devices=n, pass_=pass_, seq=args.seq)
        print(
          f"{scheme:10s} n={n} {pass_:6s} {row['seconds']:.3f}s"
          f" {row['total_bytes'] / _MIB:.1f} MiB",
          flush=True,
        )
        rows.append(row)
  return rows


def _window_rows(args, meshes):
  import pallas_fa3
  from pallas_fa3.parallel.ring import attention as ring, plan as ring_plan
  from pallas_fa3.spec import make_spec

  n, mesh, rows = args.ring, meshes(args.ring), []
  for seq in args.window_seqs:
    for pass_ in args.passes:
      x = _inputs(args, seq, mesh, "fwd")[0]
      full = functools.partial(
        pallas_fa3.ring_attention, mesh=mesh, seq_axis="seq", causal=True
      )
      variants = [("causal ring (zig-zag)", full, None, n - 1)]
      window = (args.window, None)
      spec = make_spec(x, x, x, causal=True, window_size=window)
      for order in ("natural", "zigzag"):
        plan = ring_plan.make_plan(
          spec, mesh, "seq", (), (), "natural", None, None, order=order
        )
        attend = lambda q, k, v, plan=plan: ring.run_plan(plan, q, k, v)[0]
        label = f"window {args.window} ({order})"
        variants.append(
          (label, attend, plan.blocks.hops, sum(plan.blocks.hops))
        )
      base = None
      for label, attend, hops, steps in variants:
        row = _measure(args, attend, seq, mesh, pass_, max(steps - 2, 0))
        base = row["seconds"] if base is None else base
        row.update(
          variant=label,
          seq=seq,
          pass_=pass_,
          devices=n,
          hops=hops,
          ratio=row["seconds"] / base,
        )
        print(
          f"{label:24s} seq={seq} {pass_:6s} {row['seconds']:.3f}s"
          f" x{row['ratio']:.2f}",
          flush=True,
        )
        rows.append(row)
  return rows


def _tables(sweep, windows, args) -> str:
  out = [
    f"Axis sweep: causal, 1 x {args.seq} tokens x {args.heads} heads x"
    f" d{args.head_dim}, {args.dtype}:",
    "",
    "| pass | scheme | devices | total MiB/device | temp MiB | sent MiB/device"
    " | collectives | time s |",
    "|---|---|---:|---:|---:|---:|---|---:|",
  ]
  for r in sweep:
    kinds = ", ".join(f"{v} {k}" for k, v in r["collectives"].items() if v)
    out.append(
      f"| {r['pass_']} | {r['scheme']} | {r['devices']} |"
      f" {r['total_bytes'] / _MIB:.2f} | {r['temp_bytes'] / _MIB:.2f} |"
      f" {r['sent_bytes'] / _MIB:.2f} | {kinds or '-'} | {r['seconds']:.3f} |"
    )
  out += [
    "",
    f"Window {args.window} vs the full causal ring, {args.ring} devices:",
    "",
    "| seq (per device) | pass | variant | K/V steps (fwd, bwd) |"
    " sent MiB/device | time s | vs causal ring |",
    "|---|---|---|---|---:|---:|---:|",
  ]
  for r in windows:
    hops = "all (7)" if r["hops"] is None else str(tuple(r["hops"]))
    out.append(
      f"| {r['seq']} ({r['seq'] // r['devices']}) | {r['pass_']} |"
      f" {r['variant']} | {hops} | {r['sent_bytes'] / _MIB:.2f} |"
      f" {r['seconds']:.3f} | {r['ratio']:.2f}x |"
    )
  return "\n".join(out)


def main(argv=None):
  argv = sys.argv if argv is None else argv
  args = _parse_args(argv[1:])
  devices = max(args.rings + [args.ring])
  ring_memory.set_device_count(devices)
  sys.path.insert(0, REPO_ROOT)
  import jax
  import numpy as np

  if jax.device_count() < devices:
    sys.exit(f"need {devices} devices, JAX sees {jax.device_count()}")

  @functools.cache
  def meshes(n):
    return jax.sharding.Mesh(np.array(jax.devices()[:n]), ("seq",))

  sweep = _axis_sweep(args, meshes)
  windows = _window_rows(args, meshes)
  tables = _tables(sweep, windows, args)
  print()
  print(tables)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(
      {
        "environment": ring_memory.environment(argv),
        "sweep": sweep,
        "window": windows,
      },
      f,
      indent=1,
    )
  print(f"\nwrote {args.out}")


if __name__ == "__main__":
  main()
