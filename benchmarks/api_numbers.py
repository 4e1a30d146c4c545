"""The public API's results over a grid of options, saved to an .npz so two
trees can be compared bitwise (the redesign's "numbers unchanged" check,
benchmarks/RESULTS.md, issue 42).

  JAX_PLATFORMS=cpu PJRT_NPROC=6 PYTHONPATH=TREE python benchmarks/api_numbers.py OUT.npz
  python benchmarks/api_numbers.py --compare A.npz B.npz

Run it from outside the checkout (or as a file path, as above) so that
PYTHONPATH picks the tree. Covers `flash_attention` (out, lse, dq, dk, dv)
for reference, blockwise and interpret in 8 option sets (and head_dim_v 96),
the FP8 forward, and `flash_attention_with_kvcache` contiguous, paged and
from an e4m3 cache.
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp
import numpy as np

import pallas_fa3 as fa

_IMPLS = ("reference", "blockwise", "interpret")


def _rnd(i, shape, dtype=jnp.bfloat16):
  key = jax.random.fold_in(jax.random.key(0), i)
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def results(impls=_IMPLS) -> dict[str, np.ndarray]:
  b, s, hq, hk, d = 1, 160, 4, 2, 64
  q = _rnd(1, (b, s, hq, d))
  k, v = _rnd(2, (b, s + 32, hk, d)), _rnd(3, (b, s + 32, hk, d))
  v96 = _rnd(4, (b, s + 32, hk, 96))
  ids = lambda n0, n1: jnp.concatenate(
    [jnp.zeros((1, n0)), jnp.ones((1, n1))], 1
  ).astype(jnp.int32)
  options = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(causal=True, window_size=(48, 0)),
    "softcap": dict(softcap=20.0),
    "sinks": dict(sinks=_rnd(5, (hq,), jnp.float32)),
    "fa3win": dict(window_size=(-1, 0)),
    "segments": dict(segment_ids=(ids(100, 60), ids(120, 72))),
  }
  out = {}
  for impl, (name, opts) in itertools.product(impls, options.items()):
    for vv, tag in ((v, ""), (v96, "dv96")):
      if impl == "interpret" and tag and name not in ("plain", "causal"):
        continue  # interpret is slow on a CPU: head_dim_v 96 twice

      def loss(q, k, vv, impl=impl, opts=opts):
        o, lse = fa.flash_attention(
          q, k, vv, implementation=impl, return_lse=True, **opts
        )
        return (o.astype(jnp.float32) ** 2).sum() + 0.01 * lse.sum(), (o, lse)

      grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
      (_, (o, lse)), grads = grad(q, k, vv)
      key = f"{impl}/{name}{tag}"
      out[key + "/out"] = np.asarray(o.astype(jnp.float32))
      out[key + "/lse"] = np.asarray(lse)
      for n, g in zip("qkv", grads, strict=True):
        out[key + f"/d{n}"] = np.asarray(g.astype(jnp.float32))
  for impl in (i for i in impls if i != "reference"):
    o = fa.flash_attention(q, k, v, implementation=impl, fp8=True, causal=True)
    out[f"{impl}/fp8"] = np.asarray(o.astype(jnp.float32))
  kc, vc = _rnd(6, (2, 256, hk, d)), _rnd(7, (2, 256, hk, d))
  qd, lens = _rnd(8, (2, 1, hq, d)), jnp.array([200, 77], jnp.int32)
  pages = jnp.arange(8, dtype=jnp.int32).reshape(2, 4)[:, ::-1]
  kp, vp = kc.reshape(8, 64, hk, d), vc.reshape(8, 64, hk, d)
  for impl in impls:
    call = _decode_call(fa.flash_attention_with_kvcache, impl, lens)
    o, lse = call(qd, kc, vc, return_lse=True)
    out[f"{impl}/decode/out"], out[f"{impl}/decode/lse"] = map(
      np.asarray, (o.astype(jnp.float32), lse)
    )
    o = call(qd, kp, vp, page_table=pages)
    out[f"{impl}/decode_paged"] = np.asarray(o.astype(jnp.float32))
    c = fa.quantize_kv_cache(kc, vc, cache_seqlens=lens)
    o = call(
      qd, c.k_cache, c.v_cache, k_descale=c.k_descale, v_descale=c.v_descale
    )
    out[f"{impl}/decode_e4m3"] = np.asarray(o.astype(jnp.float32))
  return out


def _decode_call(fn, impl, lens):
  return lambda *a, **kw: fn(*a, cache_seqlens=lens, implementation=impl, **kw)


def compare(a_path: str, b_path: str) -> int:
  a, b = np.load(a_path), np.load(b_path)
  if set(a.files) != set(b.files):
    print("different keys:", sorted(set(a.files) ^ set(b.files)))
    return 1
  differ = [n for n in a.files if a[n].tobytes() != b[n].tobytes()]
  values = sum(a[n].size for n in a.files)
  print(f"{len(a.files)} arrays, {values} values; bitwise different: {differ}")
  return 1 if differ else 0


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("out", nargs="?")
  p.add_argument("--compare", nargs=2, metavar=("A", "B"))
  args = p.parse_args()
  if args.compare:
    return compare(*args.compare)
  np.savez(args.out, **results())
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
