"""The forward kernel's two grids on an H100/H200: persistent vs one CTA per
tile, bf16, 16k tokens, hidden 2048, causal and not (issue 16 keeps the
per-tile form only where it measures better; d256 uses it for registers).

  python benchmarks/grid_check.py --out DIR [--head-dim 64 128] [--time-budget S]

Writes DIR/grid.json and prints one line per case (median ms, TFLOP/s).
Without a Hopper GPU, or past --time-budget seconds, cases are listed as
skipped with the reason (the CPU rehearsal of `device_check.sh`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import jax.numpy as jnp

from pallas_fa3 import backends
from pallas_fa3.kernels.sm90 import config as sm90_config, forward as sm90_fwd
from pallas_fa3.spec import AttentionSpec
from pallas_fa3.tools.bench import flops, timing

TOKENS, HIDDEN, SEQ = 16384, 2048, 16384


@dataclasses.dataclass(frozen=True)
class _Fwd:
  """`spec` as `flops.attention_flops` reads it: a forward case."""

  spec: AttentionSpec
  mode: str = "fwd"

  def __getattr__(self, name):
    return getattr(self.spec, name)


def _cases(head_dims):
  for d in head_dims:
    for causal in (False, True):
      spec = AttentionSpec(
        TOKENS // SEQ,
        SEQ,
        SEQ,
        HIDDEN // d,
        HIDDEN // d,
        d,
        d,
        jnp.dtype(jnp.bfloat16),
        causal,
        d**-0.5,
      )
      base = sm90_config.default_forward_config(spec)
      for persistent in (True, False):
        yield spec, dataclasses.replace(base, persistent=persistent)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, help="output folder")
  parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
  parser.add_argument("--time-budget", type=float, default=60.0)
  parser.add_argument("--runs", type=int, default=10)
  args = parser.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  why_not = backends.hopper_reason()
  start, rows = time.monotonic(), []
  for spec, config in _cases(args.head_dim):
    row = dict(
      head_dim=spec.head_dim,
      causal=spec.causal,
      persistent=config.persistent,
      config=repr(config),
    )
    reason = why_not or sm90_config.forward_config_unsupported(
      config, spec.head_dim, 2
    )
    if reason is None and time.monotonic() - start > args.time_budget:
      reason = f"past the time budget of {args.time_budget} s"
    if reason is not None:
      row["skipped"] = reason
    else:
      sets = timing.make_inputs(spec, "bfloat16", 2, seed=0)
      fn = lambda q, k, v, c=config, s=spec: sm90_fwd.sm90_forward(
        s, c, q, k, v
      )
      jitted, arg_sets = timing.mode_function(fn, "fwd", sets)
      result, _ = timing.measure(jitted, arg_sets, warmup=2, runs=args.runs)
      row["median_ms"] = result.median_s * 1e3
      work = flops.attention_flops(_Fwd(spec))
      row["tflops"] = work / result.median_s / 1e12
    rows.append(row)
    label = (
      f"d{spec.head_dim} {'causal' if spec.causal else 'full'}"
      f" {'persistent' if config.persistent else 'per-tile'}"
    )
    if "skipped" in row:
      print(f"{label}: skipped ({row['skipped']})")
    else:
      print(f"{label}: {row['median_ms']:.3f} ms, {row['tflops']:.0f} TFLOP/s")
    sys.stdout.flush()
  (out / "grid.json").write_text(json.dumps(rows, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
