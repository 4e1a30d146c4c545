"""`pallas-fa3 bench --mode flex`: flex attention against the same function
elsewhere. Cases: plain causal (the baseline), ALiBi as a score_mod,
16 packed documents as a mask_mod and as a block mask, and a dense bias;
each through `flash_attention` with the flex options (the automatic
choice: the Hopper forward kernel on a GPU, blockwise on a CPU), through
our built-in option where one computes it (causal, segment ids), and
through `jax.nn.dot_product_attention` with the dense arrays it takes
(xla; cudnn on a GPU). Forward and forward+backward, TFLOP/s over the
visible pairs, % of our plain causal, and the largest difference from the
float32 reference on the first case. docs/benchmarks.md#flex-attention
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pallas_fa3
from pallas_fa3 import mods
from pallas_fa3.tools.bench import timing

FLEX = "flex"
DOCS = 16
CASES = ("causal", "alibi", "document", "document_block_mask", "bias")
MODES = ("fwd", "fwd+bwd")
# GPU targets (issue 44): % of plain causal TFLOP/s.
TARGETS = {"alibi": 90, "document": 90, "document_block_mask": 90, "bias": 70}


def shapes(platform: str) -> dict:
  """(batch, seq, heads, head_dim) of a run: a CPU's small one, a GPU's
  16k tokens at d128."""
  if platform == "gpu":
    return dict(batch=2, seq=8192, heads=16, head_dim=128)
  return dict(batch=1, seq=1024, heads=4, head_dim=64)


def _pairs(case: str, seq: int) -> int:
  """Visible (query, key) pairs of one head."""
  causal = seq * (seq + 1) // 2
  if case == "bias":
    return seq * seq
  if case.startswith("document"):
    n = seq // DOCS
    return DOCS * n * (n + 1) // 2
  return causal


def implementations(case: str, b: int, s: int, h: int, platform: str) -> dict:
  """name -> fn(q, k, v) for `case` (the dense arrays jax.nn needs are
  built once, outside the timed function)."""
  ids = jnp.asarray(np.arange(s)[None] // (s // DOCS), jnp.int32)
  ids = jnp.broadcast_to(ids, (b, s))
  slopes = mods.alibi_slopes(h)
  fa = pallas_fa3.flash_attention
  nn = jax.nn.dot_product_attention
  out: dict[str, Callable] = {}
  nn_impls = ("xla", "cudnn") if platform == "gpu" else ("xla",)
  dense: dict[str, Any] = {}
  if case == "causal":
    out["ours"] = lambda q, k, v: fa(q, k, v, causal=True)
    dense = dict(is_causal=True)
  elif case == "alibi":
    out["ours"] = lambda q, k, v: fa(
      q, k, v, causal=True, score_mod=mods.alibi(slopes)
    )
    i = jnp.arange(s)
    dist = jnp.abs(i[:, None] - i[None, :]).astype(jnp.float32)
    dense = dict(bias=(-slopes[:, None, None] * dist)[None], is_causal=True)
  elif case.startswith("document"):
    doc = mods.and_masks(mods.causal_top_left, mods.document_mask(ids))
    if case == "document":
      out["ours"] = lambda q, k, v: fa(q, k, v, mask_mod=doc)
    else:
      bm = pallas_fa3.create_block_mask(doc, b, None, s, s)
      out["ours"] = lambda q, k, v: fa(q, k, v, block_mask=bm)
    out["ours builtin (segment_ids)"] = lambda q, k, v: fa(
      q, k, v, causal=True, segment_ids=ids
    )
    mask = (ids[:, None, :, None] == ids[:, None, None, :]) & jnp.tril(
      jnp.ones((s, s), bool)
    )
    dense = dict(mask=mask)
  elif case == "bias":
    bias = 0.1 * jax.random.normal(jax.random.key(7), (1, h, s, s))
    out["ours"] = lambda q, k, v: fa(q, k, v, bias=bias.astype(q.dtype))
    dense = dict(bias=bias)
  for impl in nn_impls:

    def call(q, k, v, impl=impl, dense=dense):
      kw = {
        n: (x.astype(q.dtype) if n == "bias" else x) for n, x in dense.items()
      }
      return nn(q, k, v, implementation=impl, **kw)

    out[f"jax.nn {impl}"] = call
  return out


def _reference(case: str, impls: dict, q, k, v) -> np.ndarray:
  """float32 output of the case (jax.nn xla in float32)."""
  f = impls["jax.nn xla"]
  f32 = lambda x: x.astype(jnp.float32)
  return np.asarray(f(f32(q), f32(k), f32(v)), np.float32)


def run_flex(
  platform: str,
  *,
  dtype: str = "bfloat16",
  runs: int = 5,
  warmup: int = 1,
  out_dir: str | None = None,
  shape: dict | None = None,
  modes: tuple[str, ...] = MODES,
  cases: tuple[str, ...] = CASES,
  printer: Callable[[str], None] = print,
) -> list[dict]:
  """Times every case and implementation; returns the records (and writes
  flex.json / flex.md into `out_dir`)."""
  shp = shape or shapes(platform)
  b, s, h, d = (shp[n] for n in ("batch", "seq", "heads", "head_dim"))
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (
    jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(dtype)
    for kk in keys
  )
  records = []
  baseline: dict[str, float] = {}
  for case in cases:
    impls = implementations(case, b, s, h, platform)
    want = _reference(case, impls, q, k, v)
    flops_fwd = 4 * b * h * d * _pairs(case, s)
    for name, fn in impls.items():
      for mode in modes:
        rec = dict(case=case, impl=name, mode=mode, batch=b, seq=s, heads=h,
                   head_dim=d, dtype=dtype)  # fmt: skip
        rec |= timing.measure_mode(
          fn, mode, (q, k, v, do), warmup, runs, flops_fwd, want
        )
        if rec["status"] == "ok" and name == "ours" and case == "causal":
          baseline[mode] = rec["tflops"]
        records.append(rec)
  for rec in records:
    if rec.get("status") == "ok" and rec["mode"] in baseline:
      rec["pct_of_causal"] = 100 * rec["tflops"] / baseline[rec["mode"]]
  table = markdown(records, platform)
  printer(table)
  if out_dir:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "flex.json"), "w") as f:
      json.dump(dict(platform=platform, records=records), f, indent=1)
    with open(os.path.join(out_dir, "flex.md"), "w") as f:
      f.write(table + "\n")
  return records


def markdown(records: list[dict], platform: str) -> str:
  """The records as a Markdown table (GPU targets beside our rows)."""
  lines = [
    "| case | implementation | mode | ms | TFLOP/s | % of our causal |"
    " target | max err (fwd, vs float32) |",
    "| --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for r in records:
    if r.get("status") != "ok":
      lines.append(
        f"| {r['case']} | {r['impl']} | {r['mode']} | error: {r['error']} |"
        " | | | |"
      )
      continue
    target = TARGETS.get(r["case"]) if r["impl"] == "ours" else None
    pct = r.get("pct_of_causal")
    err = r.get("max_err")
    lines.append(
      f"| {r['case']} | {r['impl']} | {r['mode']} | {r['ms']:.3f} |"
      f" {r['tflops']:.3g} | {'' if pct is None else f'{pct:.0f}'} |"
      f" {'' if target is None or platform != 'gpu' else f'>= {target}'} |"
      f" {'' if err is None else f'{err:.2g}'} |"
    )
  return "\n".join(lines)
