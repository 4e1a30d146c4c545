"""The forward-tangent kernel against the plain forward in perfcmp's model
(issue 69): `jax.jvp` of `flash_attention(..., implementation="mosaic")`
and the forward alone, compiled deviceless for an H200 (sm_90a) with
Mosaic's dumps kept, each kernel's SASS main loop read by
`../shared/perfcmp/compare.py` (model B cycles per 128 x 128 score block;
the masked loop weighted by the causal share of masked tiles, as
`compare_ext.block_cost` does).

  $PERFCMP_WORK/venv/bin/python benchmarks/tangent_model.py OUT \\
      --head-dim 128 [--causal]
      [--option plain|alibi_doc|alibi_doc_tangent|t5_tangent|softcap_mod|
                bias|bias_tangent]

4 x 4096 tokens, 16 heads, bf16. Prints model B of both kernels, their
ratio, the tangent kernel's spills and its exp2s under an in-flight wgmma.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import pallas_fa3  # noqa: E402
from pallas_fa3 import mods  # noqa: E402
from pallas_fa3.tools.aot import compiler as aot  # noqa: E402

B, S, H = 4, 4096, 16


def _options(option: str, causal: bool) -> tuple[dict, list]:
  """(flash_attention kwargs, extra traced arguments) of one option."""
  kw = dict(causal=causal)
  if option == "alibi_doc":  # constant slopes and ids: no tangent
    ids = jnp.asarray(np.arange(S)[None].repeat(B, 0) // 512, jnp.int32)
    slopes = jnp.asarray(mods.alibi_slopes(H))
    kw.update(score_mod=mods.alibi(slopes), mask_mod=mods.document_mask(ids))
  elif option == "softcap_mod":
    kw.update(score_mod=mods.softcap(30.0))
  elif option in ("bias", "bias_tangent"):  # closed over (no tangent) or
    return kw, [(B, H, S, S)]  # differentiated along with q, k, v
  elif option == "alibi_doc_tangent":  # the slopes differentiated too
    ids = jnp.asarray(np.arange(S)[None].repeat(B, 0) // 512, jnp.int32)
    kw.update(mask_mod=mods.document_mask(ids))
    return kw, [(H,)]
  elif option == "t5_tangent":  # a T5 table differentiated too
    return kw, [(H, 32)]
  elif option != "plain":
    raise SystemExit(f"unknown --option {option!r}")
  return kw, []


def _compile(out: pathlib.Path, fn, shapes) -> pathlib.Path:
  if out.exists():
    shutil.rmtree(out)
  out.mkdir(parents=True)
  flags = dict(
    MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1",
    MOSAIC_GPU_DUMP_SASS_CTRL="1", MOSAIC_GPU_DUMP_RESOURCES="1",
    MOSAIC_GPU_DUMP_TO=str(out),
  )  # fmt: skip
  os.environ.update(flags)
  try:
    jax.jit(fn).lower(*shapes).compile()
  finally:
    for f in flags:
      os.environ.pop(f)
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("out")
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--option", default="plain")
  parser.add_argument(
    "--perfcmp", default=os.environ.get("PERFCMP_DIR", "../shared/perfcmp")
  )
  args = parser.parse_args()
  sys.path.insert(0, args.perfcmp)
  import compare  # noqa: PLC0415 (perfcmp's, not ours)
  import compare_ext  # noqa: PLC0415

  d, out = args.head_dim, pathlib.Path(args.out)
  kw, extra = _options(args.option, args.causal)
  sharding = NamedSharding(aot.h200_mesh(), PartitionSpec())
  arr = lambda shape: jax.ShapeDtypeStruct(
    shape, jnp.bfloat16, sharding=sharding
  )
  qkv = [arr((B, S, H, d))] * 3

  # (extra: the slopes or the table)
  slopes = args.option in ("alibi_doc_tangent", "t5_tangent")

  def attend(q, k, v, *extra):
    if slopes:
      mod = (
        mods.alibi(extra[0])
        if args.option == "alibi_doc_tangent"
        else mods.t5_relative_position_bias(extra[0])
      )
      return pallas_fa3.flash_attention(
        q, k, v, implementation="mosaic", score_mod=mod, **kw
      )
    return pallas_fa3.flash_attention(
      q, k, v, implementation="mosaic", bias=extra[0] if extra else None,
      **kw,
    )  # fmt: skip

  def jvp(q, k, v, dq, dk, dv, *extra):
    if args.option in ("bias_tangent", "alibi_doc_tangent", "t5_tangent"):
      x, dx = extra
      return jax.jvp(attend, (q, k, v, x), (dq, dk, dv, dx))
    f = lambda q, k, v: attend(q, k, v, *extra)
    return jax.jvp(f, (q, k, v), (dq, dk, dv))

  bias = [
    jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding)
    if slopes
    else arr(s)
    for s in extra
  ]
  two = args.option in ("bias_tangent", "alibi_doc_tangent", "t5_tangent")
  tangent_bias = bias * (2 if two else 1)
  dirs = {
    "tangent": _compile(out / "tangent", jvp, qkv * 2 + tangent_bias),
    "forward": _compile(out / "forward", attend, qkv + bias),
  }
  case = ("pfa3", "fwd", d, int(args.causal), B, S, "")
  cost = {}
  for name, prefix, g in (
    ("tangent", "fa3_fwd_tangent", 5),
    ("forward", "fa3_fwd_", 2),
  ):
    stem = sorted(p.name[:-4] for p in dirs[name].glob(f"{prefix}*.ptx"))[0]
    k = compare.analyze_kernel(
      case, compare.read_kernel(dirs[name], stem), g, dict(config="", d=d)
    )
    share = 0.0
    if args.causal and "m_masked" in k:
      rows = 128  # two consumers of 64 query rows, both kernels
      bkv = k["fwd_geom"][1] if name == "forward" else 64
      seen, masked = compare_ext.tile_fraction(compare_ext.causal, S, rows, bkv)
      share = masked / seen
    cost[name] = (1 - share) * k["m"]["b_blk"] + share * k.get(
      "m_masked", k["m"]
    )["b_blk"]
    if name == "tangent":
      loop = k["loops"][0]
      print(
        f"tangent kernel: spills {k['spill']}, loop {loop['n']} instructions,"
        f" exp2 under a wgmma {loop.get('mufu_overlapped')}/{loop.get('mufu')},"
        f" bound {k['m']['bound_a']}"
      )
  t, f = cost["tangent"], cost["forward"]
  print(
    f"d{d} {'causal' if args.causal else 'full'} {args.option}: model B"
    f" tangent {t:.0f} / forward {f:.0f} = {t / f:.2f}"
  )


if __name__ == "__main__":
  main()
