"""What a sliding window saves on the blockwise backend (issue 19), on this
machine: `window_size=(256, 0)` + causal against the full causal call and the
full non-causal call at 4096 tokens.

  python benchmarks/window_skipping.py [--json PATH] [--dtype float32]

Each variant is `pallas_fa3.flash_attention(implementation="blockwise")`
under `jax.jit`, forward and forward+backward (the pullback of a random
cotangent), timed as `pallas-fa3 bench` times (compile excluded, warm-up
calls, then --runs calls rotating two random input sets; median, min, max).
float32 by default: XLA's CPU matmuls run float32 natively (bf16 is
converted). GFLOP/s count only the visible (query, key) pairs. Before
timing, the script checks that the window's first LEFT + 1 rows equal the
causal call's (they see the same keys) and that later rows differ.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys

import jax
import numpy as np

import pallas_fa3
from pallas_fa3.tools.bench import flops, specs, timing

MODES = ("fwd", "fwd+bwd")


def _variants(left: int) -> list[tuple[str, bool, tuple | None]]:
  """(label, causal, window) of the three calls compared."""
  return [
    (f"window ({left}, 0) + causal", True, (left, 0)),
    ("causal", True, None),
    ("full (non-causal)", False, None),
  ]


def _call(causal, window):
  def fn(q, k, v):
    return pallas_fa3.flash_attention(
      q, k, v, causal=causal, window_size=window, implementation="blockwise"
    )

  return fn


def _check_window(args, inputs) -> None:
  """The window's first `left + 1` rows see what causal rows see; later
  rows see fewer keys, so they differ."""
  q, k, v = inputs[0][:3]
  win = np.asarray(jax.jit(_call(True, (args.left, 0)))(q, k, v), np.float32)
  causal = np.asarray(jax.jit(_call(True, None))(q, k, v), np.float32)
  head = args.left + 1
  atol = 1e-5 if args.dtype == "float32" else 2e-2
  np.testing.assert_allclose(win[:, :head], causal[:, :head], atol=atol)
  assert np.max(np.abs(win[:, head:] - causal[:, head:])) > 1e-2


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--seq", type=int, default=4096)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--left", type=int, default=256, help="the window's left")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--runs", type=int, default=5)
  p.add_argument("--warmup", type=int, default=1)
  p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
  p.add_argument("--json", type=pathlib.Path, help="also write the rows here")
  args = p.parse_args(argv)

  short = {"float32": "fp32", "bfloat16": "bf16"}[args.dtype]
  shape = specs.BenchSpec(
    "shape",
    args.batch,
    args.seq,
    args.seq,
    args.heads,
    args.heads,
    args.head_dim,
    False,
    short,
    "fwd",
  )
  inputs = timing.make_inputs(shape, args.dtype, 2, seed=0)
  _check_window(args, inputs)
  print(
    f"blockwise on {jax.devices()[0].device_kind} ({os.cpu_count()} cores),"
    f" JAX {jax.__version__}, {args.dtype},"
    f" batch {args.batch}, seq {args.seq}, {args.heads} heads of dim"
    f" {args.head_dim}; median of {args.runs} runs after {args.warmup}"
    " warm-up, compile excluded",
    flush=True,
  )
  rows = []
  for mode in args.modes:
    for label, causal, window in _variants(args.left):
      spec = specs.BenchSpec(
        "case",
        args.batch,
        args.seq,
        args.seq,
        args.heads,
        args.heads,
        args.head_dim,
        causal,
        short,
        mode,
        window=window,
      )
      fn, arg_sets = timing.mode_function(_call(causal, window), mode, inputs)
      t, _ = timing.measure(fn, arg_sets, args.warmup, args.runs)
      pairs = flops.visible_pairs(args.seq, args.seq, causal, window)
      rows.append(
        dict(
          variant=label,
          mode=mode,
          causal=causal,
          window=None if window is None else list(window),
          median_ms=t.median_s * 1e3,
          min_ms=t.min_s * 1e3,
          max_ms=t.max_s * 1e3,
          compile_s=t.compile_s,
          visible_pairs=pairs,
          gflops=flops.attention_flops(spec) / t.median_s / 1e9,
        )
      )
      print(f"  {mode} {label}: {t.median_s * 1e3:.0f} ms", flush=True)
  for r in rows:
    same = [x for x in rows if x["mode"] == r["mode"]]
    r["causal_over_this"] = same[1]["median_ms"] / r["median_ms"]
    r["full_over_this"] = same[2]["median_ms"] / r["median_ms"]
  print()
  print(
    f"{'mode':<8} {'variant':<26} {'median ms':>10} {'min..max ms':>15}"
    f" {'pairs':>6} {'GFLOP/s':>8} {'vs causal':>9} {'vs full':>8}"
  )
  square = args.seq * args.seq
  for r in rows:
    spread = f"{r['min_ms']:.0f}..{r['max_ms']:.0f}"
    print(
      f"{r['mode']:<8} {r['variant']:<26} {r['median_ms']:>10.1f}"
      f" {spread:>15} {r['visible_pairs'] / square:>6.1%}"
      f" {r['gflops']:>8.1f} {r['causal_over_this']:>8.2f}x"
      f" {r['full_over_this']:>7.2f}x"
    )
  print(
    "\nvs causal / vs full: that call's median time over this one's"
    " (> 1: this one is faster); pairs: visible (query, key) pairs of"
    " the square."
  )
  if args.json:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
      json.dumps(
        dict(
          command=" ".join(
            ["python", "benchmarks/window_skipping.py"]
            + (sys.argv[1:] if argv is None else list(argv))
          ),
          device=f"{jax.devices()[0].platform} {jax.devices()[0].device_kind}",
          machine=platform.platform(),
          jax=jax.__version__,
          dtype=args.dtype,
          shape=dict(
            batch=args.batch,
            seq=args.seq,
            heads=args.heads,
            head_dim=args.head_dim,
          ),
          runs=args.runs,
          warmup=args.warmup,
          rows=rows,
        ),
        indent=1,
      )
    )
    print(f"wrote {args.json}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
