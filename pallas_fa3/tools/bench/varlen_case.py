"""`pallas-fa3 bench --mode varlen`: a variable-length batch (issue 68) of
16 sequences whose lengths are drawn from a long-tailed (log-normal)
distribution, causal self-attention, through `flash_attention_varlen` on
the packed layout, beside the same tokens as segment ids
(`flash_attention(segment_ids=)`, `[1, total]`), the padded call
(`[n, max_len]`, causal) and `jax.nn.dot_product_attention` on the padded
batch with its `query_seq_lengths` / `key_value_seq_lengths` (xla; cudnn on
a GPU). Forward and forward+backward, TFLOP/s over the visible pairs (the
sequences' own causal triangles: padding counts as waste), % of the varlen
call's, and the largest difference from the float32 blockwise varlen call
over the used tokens. docs/benchmarks.md#variable-length-batches
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import pallas_fa3
from pallas_fa3.tools.bench import timing

VARLEN = "varlen"
MODES = ("fwd", "fwd+bwd")
OURS = "ours varlen"


def shapes(platform: str) -> dict:
  """(sequences, seq = the packed tokens, heads, head_dim) of a run: the
  issue's 64k tokens at d128 on a GPU, 4k at d64 on a CPU."""
  if platform == "gpu":
    return dict(sequences=16, seq=65536, heads=16, head_dim=128)
  return dict(sequences=16, seq=4096, heads=4, head_dim=64)


def lengths(sequences: int, tokens: int, seed: int = 0) -> np.ndarray:
  """`sequences` long-tailed lengths (log-normal, sigma 1.2), each >= 1,
  summing to about `tokens`."""
  rng = np.random.default_rng(seed)
  raw = rng.lognormal(mean=0.0, sigma=1.2, size=sequences)
  return np.maximum(1, np.round(raw / raw.sum() * tokens)).astype(np.int64)


def _layouts(lens: np.ndarray) -> tuple[Callable, Callable]:
  """(to_padded, to_packed): packed `[total, ...]` <-> padded `[n,
  max_len, ...]` (zeros past each length)."""
  n, width, total = len(lens), int(lens.max()), int(lens.sum())
  starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
  pos = np.arange(width)
  rows = np.where(pos[None] < lens[:, None], starts[:, None] + pos[None], total)
  seq = np.repeat(np.arange(n), lens)
  flat = jnp.asarray(seq * width + np.arange(total) - starts[seq])
  rows = jnp.asarray(rows)

  def to_padded(x):
    zero = jnp.zeros((1,) + x.shape[1:], x.dtype)
    return jnp.concatenate([x, zero])[rows]

  def to_packed(x):
    return x.reshape((-1,) + x.shape[2:])[flat]

  return to_padded, to_packed


def implementations(lens: np.ndarray, platform: str) -> dict:
  """name -> fn(q, k, v) on packed `[total, heads, dim]` arrays, giving the
  packed output (the layout changes of the padded rows are outside the
  timed call's attention but inside its program, as a user pays them)."""
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  total = int(lens.sum())
  ids = pallas_fa3.segment_ids_from_lengths(jnp.asarray(lens)[None], total)
  to_padded, to_packed = _layouts(lens)
  seq_lens = jnp.asarray(lens, jnp.int32)
  fa = pallas_fa3.flash_attention
  out = {
    OURS: lambda q, k, v: pallas_fa3.flash_attention_varlen(
      q, k, v, cu, cu, causal=True
    ),
    "ours segment ids": lambda q, k, v: fa(
      q[None], k[None], v[None], causal=True, segment_ids=ids
    )[0],
    "ours padded": lambda q, k, v: to_packed(
      fa(to_padded(q), to_padded(k), to_padded(v), causal=True)
    ),
  }
  for impl in ("xla", "cudnn") if platform == "gpu" else ("xla",):

    def call(q, k, v, impl=impl):
      o = jax.nn.dot_product_attention(
        to_padded(q), to_padded(k), to_padded(v), is_causal=True,
        query_seq_lengths=seq_lens, key_value_seq_lengths=seq_lens,
        implementation=impl,
      )  # fmt: skip
      return to_packed(o)

    out[f"jax.nn {impl} (padded, seq lengths)"] = call
  return out


def run_varlen(
  platform: str,
  *,
  dtype: str = "bfloat16",
  runs: int = 5,
  warmup: int = 1,
  out_dir: str | None = None,
  shape: dict | None = None,
  modes: tuple[str, ...] = MODES,
  seed: int = 0,
  printer: Callable[[str], None] = print,
) -> list[dict]:
  """Times every implementation; returns the records (and writes
  varlen.json / varlen.md into `out_dir`)."""
  shp = shape or shapes(platform)
  lens = lengths(shp["sequences"], shp["seq"], seed)
  total, h, d = int(lens.sum()), shp["heads"], shp["head_dim"]
  keys = jax.random.split(jax.random.key(seed), 4)
  q, k, v, do = (
    jax.random.normal(kk, (total, h, d), jnp.float32).astype(dtype)
    for kk in keys
  )
  impls = implementations(lens, platform)
  want = np.asarray(
    pallas_fa3.flash_attention_varlen(
      *(x.astype(jnp.float32) for x in (q, k, v)),
      *(jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32),) * 2,
      causal=True,
      implementation="blockwise",
    )
  )
  pairs = int(sum(n * (n + 1) // 2 for n in lens))
  base = dict(sequences=len(lens), tokens=total, max_len=int(lens.max()),
              heads=h, head_dim=d, dtype=dtype)  # fmt: skip
  records = []
  for name, fn in impls.items():
    for mode in modes:
      rec = dict(impl=name, mode=mode, **base)
      rec |= timing.measure_mode(
        fn, mode, (q, k, v, do), warmup, runs, 4 * h * d * pairs, want
      )
      records.append(rec)
  ours = {r["mode"]: r["tflops"] for r in records if r["impl"] == OURS and r["status"] == "ok"}  # fmt: skip
  for rec in records:
    if rec["status"] == "ok" and rec["mode"] in ours:
      rec["pct_of_varlen"] = 100 * rec["tflops"] / ours[rec["mode"]]
  table = markdown(records, lens)
  printer(table)
  if out_dir:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "varlen.json"), "w") as f:
      json.dump(
        dict(platform=platform, lengths=lens.tolist(), records=records),
        f,
        indent=1,
      )
    with open(os.path.join(out_dir, "varlen.md"), "w") as f:
      f.write(table + "\n")
  return records


def markdown(records: list[dict], lens: np.ndarray) -> str:
  """The records as a Markdown table, after a line with the lengths."""
  lines = [
    f"{len(lens)} sequences, {int(lens.sum())} tokens, causal; lengths"
    f" {lens.tolist()}",
    "",
    "| implementation | mode | ms | TFLOP/s | % of varlen |"
    " max err (fwd, vs float32) |",
    "| --- | --- | --- | --- | --- | --- |",
  ]
  for r in records:
    if r["status"] != "ok":
      lines.append(f"| {r['impl']} | {r['mode']} | error: {r['error']} | | | |")
      continue
    err = r.get("max_err")
    lines.append(
      f"| {r['impl']} | {r['mode']} | {r['ms']:.3f} | {r['tflops']:.3g} |"
      f" {r['pct_of_varlen']:.0f} | {'' if err is None else f'{err:.2g}'} |"
    )
  return "\n".join(lines)
