#!/usr/bin/env python3
"""Do the ring's and Ulysses' transfers overlap attention? Read it off the
scheduled HLO of an 8 x H200 compile, made without a GPU (issue 33).

The program is compiled for a compile-only target of eight H200s (the
deviceless tier's target description, `pallas_fa3/tools/aot/data/
h200_target_config.txtpb`, topology 1x1x8; needs the `aot` extra). On a GPU
XLA issues each collective-permute and all-to-all as an async
`*-start` / `*-done` pair, and its latency-hiding scheduler places
independent work between the two. For every pair this script lists what
the scheduled HLO runs between start and done, and counts the pairs with
attention work inside (a fusion with a dot or an exp, a `dot`, or a Mosaic
kernel's custom-call). On the CPU backend the collectives are synchronous
and nothing overlaps, which is why this is a GPU compile.

Usage (CPU only; JAX_PLATFORMS=cpu is set here):
  python benchmarks/context_overlap.py                    # blockwise backend
  python benchmarks/context_overlap.py --implementation mosaic --cases ring
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import re
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
_TARGET = (
  REPO_ROOT / "pallas_fa3" / "kernels" / "data" / "h200_target_config.txtpb"
)
_ASYNC = ("collective-permute", "all-to-all")


def _parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--seq", type=int, default=8192)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--window", type=int, default=256)
  p.add_argument("--implementation", default="blockwise")
  p.add_argument(
    "--cases", nargs="+", default=["ring", "ring-window", "ulysses"]
  )
  p.add_argument("--passes", nargs="+", default=["fwd", "fwdbwd"])
  p.add_argument("--dump", default=None, help="write each scheduled HLO here")
  return p.parse_args(argv)


_CALLS = re.compile(
  r"(?:calls|body|to_apply|condition)=%?([\w.\-]+)"
  r"|branch_computations=\{([^}]*)\}"
)
_WORK = re.compile(r" (dot|convolution|exponential)\(|mosaic_gpu|__cublas")


def _called(line: str) -> list[str]:
  names = []
  for single, branches in _CALLS.findall(line):
    names += [single] if single else re.findall(r"%?([\w.\-]+)", branches)
  return names


def _attention_work(line: str, comps: dict[str, str], seen=None) -> bool:
  """Whether one scheduled instruction is attention work: a dot, an exp or
  a Mosaic kernel, itself or in a computation it calls (fusions, the
  blockwise loops' `while`s, `conditional`s)."""
  if _WORK.search(line.split(", metadata=")[0]):
    return True
  seen = set() if seen is None else seen
  for name in _called(line):
    if name in seen or name not in comps:
      continue
    seen.add(name)
    if any(_attention_work(ln, comps, seen) for ln in comps[name].splitlines()):
      return True
  return False


def _computations(hlo: str) -> dict[str, str]:
  """Computation name -> its text."""
  out, name, lines = {}, None, []
  for line in hlo.splitlines():
    header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
    if header:
      name, lines = header.group(1), []
    elif line.startswith("}") and name:
      out[name] = "\n".join(lines)
      name = None
    elif name:
      lines.append(line)
  return out


def overlaps(hlo: str) -> list[dict]:
  """Every async collective pair: kind, computation, and the attention
  instructions scheduled between its start and its done."""
  comps = _computations(hlo)
  pairs = []
  for comp, text in comps.items():
    lines = text.splitlines()
    for i, line in enumerate(lines):
      m = re.search(
        r"%([\w.\-]+) = .* (" + "|".join(_ASYNC) + r")-start\(", line
      )
      if not m:
        continue
      start, kind = m.group(1), m.group(2)
      done = next(
        (
          j
          for j in range(i + 1, len(lines))
          if f"-done(%{start})" in lines[j]
          or re.search(rf"-done\([^)]*%{re.escape(start)}\b", lines[j])
        ),
        None,
      )
      between = lines[i + 1 : done] if done is not None else []
      work = [ln for ln in between if _attention_work(ln, comps)]
      pairs.append(
        {
          "kind": kind,
          "computation": comp,
          "between": len(between),
          "attention_ops": len(work),
          "done_found": done is not None,
        }
      )
  return pairs


def _cases(args, mesh):
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  import pallas_fa3

  seq = NamedSharding(mesh, P(None, "seq"))
  x = jax.ShapeDtypeStruct(
    (1, args.seq, args.heads, args.head_dim), "bfloat16", sharding=seq
  )
  ct = jax.ShapeDtypeStruct(x.shape, "float32", sharding=seq)
  common = dict(
    mesh=mesh, seq_axis="seq", causal=True, implementation=args.implementation
  )
  fns = {
    "ring": functools.partial(pallas_fa3.ring_attention, **common),
    "ring-window": functools.partial(
      pallas_fa3.ring_attention, window_size=(args.window, None), **common
    ),
    "ulysses": functools.partial(pallas_fa3.ulysses_attention, **common),
  }
  for name in args.cases:
    for pass_ in args.passes:
      attend = fns[name]
      if pass_ == "fwd":
        yield name, pass_, attend, (x, x, x)
      else:
        loss = lambda q, k, v, c, f=attend: jnp.sum(
          f(q, k, v).astype(jnp.float32) * c
        )
        yield name, pass_, jax.grad(loss, argnums=(0, 1, 2)), (x, x, x, ct)


def main(argv=None):
  argv = sys.argv if argv is None else argv
  args = _parse_args(argv[1:])
  os.environ["JAX_PLATFORMS"] = "cpu"
  sys.path.insert(0, str(REPO_ROOT))
  import jax
  from jax.experimental import topologies

  topo = topologies.get_topology_desc(
    platform="cuda", target_config=_TARGET.read_text(), topology="1x1x8"
  )
  mesh = jax.sharding.Mesh(topo.devices, ("seq",))
  print(
    f"8 x {topo.devices[0].device_kind} (compile only), causal, 1 x {args.seq}"
    f" tokens x {args.heads} heads x d{args.head_dim} bf16,"
    f" implementation={args.implementation}\n"
  )
  print(
    "| case | pass | async pairs | with attention between start and done |"
    " pairs without | attention ops overlapped (sum) |"
  )
  print("|---|---|---|---|---|---:|")
  for name, pass_, fn, shapes in _cases(args, mesh):
    hlo = jax.jit(fn).lower(*shapes).compile().as_text()
    if args.dump:
      os.makedirs(args.dump, exist_ok=True)
      pathlib.Path(args.dump, f"{name}-{pass_}.hlo.txt").write_text(hlo)
    pairs = overlaps(hlo)
    kinds = sorted({p["kind"] for p in pairs})
    covered = [p for p in pairs if p["attention_ops"]]
    print(
      f"| {name} | {pass_} | {len(pairs)} ({', '.join(kinds) or '-'}) |"
      f" {len(covered)} | {len(pairs) - len(covered)} |"
      f" {sum(p['attention_ops'] for p in pairs)} |",
      flush=True,
    )


if __name__ == "__main__":
  main()
