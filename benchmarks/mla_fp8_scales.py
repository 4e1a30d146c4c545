"""How much an e4m3 MLA cache's error depends on its descales' granularity
(issue 45 item 2): FA3's one descale per (sequence, KV head), which the
library and the MLA kernel use, against one per 128-column group, per
token, per token and 128-column group, and FlashMLA's format (per token
and 128-column group over the 512 NoPE columns, the 64 RoPE columns kept
in bf16).

One MLA decode step (128 query heads, 576 / 512, 4096 cached tokens, one
KV head) in float64 on a cache rounded to bf16, then quantized each way;
relative RMSE of the output against the same step on the bf16 cache.
Caches: N(0, 1); per-column standard deviations log-uniform over 100x
(RMSNorm weights) with RoPE columns at 4; 0.1% of tokens x100; RoPE
columns x1000. The median of `--trials` draws.

  python benchmarks/mla_fp8_scales.py
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

E4M3_MAX = 448.0
D, DV, ROPE_FROM, GROUP = 576, 512, 512, 128


def _rounded(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
  """x through e4m3 at `x / scale` (saturating), back in float64."""
  y = np.clip(x / scale, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
  return y.astype(np.float64) * scale


def _by_groups(k: np.ndarray, stop: int, axis: int | None) -> list:
  """k's columns `[0, stop)` rounded per 128-column group, each group's
  descale its amax over `axis` (None: the whole group) / 448."""
  out = []
  for c in range(0, stop, GROUP):
    g = k[:, c : min(c + GROUP, stop)]
    out.append(_rounded(g, np.abs(g).max(axis=axis, keepdims=True) / E4M3_MAX))
  return out


def schemes(k: np.ndarray) -> dict[str, np.ndarray]:
  whole = lambda axis: _rounded(
    k, np.abs(k).max(axis=axis, keepdims=True) / E4M3_MAX
  )
  return {
    "per (sequence, KV head): FA3, ours": whole(None),
    "per 128-column group": np.concatenate(_by_groups(k, D, None), 1),
    "per token": whole(1),
    "per token x 128-column group": np.concatenate(_by_groups(k, D, 1), 1),
    "FlashMLA: per token x 128 NoPE columns, RoPE bf16": np.concatenate(
      _by_groups(k, ROPE_FROM, 1) + [k[:, ROPE_FROM:]], 1
    ),
  }


def cache(kind: str, rng: np.random.Generator, tokens: int) -> np.ndarray:
  k = rng.normal(size=(tokens, D))
  if kind == "column spread":
    sd = np.exp(rng.uniform(np.log(0.1), np.log(10.0), size=D))
    sd[ROPE_FROM:] = 4.0
    k *= sd
  elif kind == "token outliers":
    k[rng.random(tokens) < 1e-3] *= 100.0
  elif kind == "RoPE x1000":
    k[:, ROPE_FROM:] *= 1000.0
  return k.astype(ml_dtypes.bfloat16).astype(np.float64)


def attend(q: np.ndarray, k: np.ndarray, scale: float) -> np.ndarray:
  s = q @ k.T * scale
  p = np.exp(s - s.max(-1, keepdims=True))
  return (p / p.sum(-1, keepdims=True)) @ k[:, :DV]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--trials", type=int, default=3)
  parser.add_argument("--tokens", type=int, default=4096)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  rng = np.random.default_rng(args.seed)
  kinds = ("N(0, 1)", "column spread", "token outliers", "RoPE x1000")
  rows: dict[str, dict[str, list[float]]] = {}
  for kind in kinds:
    scale = 192**-0.5 * (1e-3 if kind == "RoPE x1000" else 1.0)
    for _ in range(args.trials):
      k = cache(kind, rng, args.tokens)
      q = rng.normal(size=(128, D)).astype(ml_dtypes.bfloat16)
      q = q.astype(np.float64)
      want = attend(q, k, scale)
      for name, k8 in schemes(k).items():
        got = attend(q, k8, scale)
        err = np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2))
        rows.setdefault(name, {}).setdefault(kind, []).append(err)
  print("| descales | " + " | ".join(kinds) + " |")
  print("|---" * (len(kinds) + 1) + "|")
  for name, errs in rows.items():
    cells = " | ".join(f"{np.median(errs[k]):.4f}" for k in kinds)
    print(f"| {name} | {cells} |")


if __name__ == "__main__":
  main()
