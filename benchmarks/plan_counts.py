"""Issue 65's counts: static jaxpr walks of the user functions per forward +
backward trace (`flex_tile._walk` with no tile), and how many times a call
decides its backward's form (`config_backward.backward_plan`), for two flex
calls traced with the interpreted kernels (no GPU needed):

  JAX_PLATFORMS=cpu PJRT_NPROC=8 python benchmarks/plan_counts.py
"""

from __future__ import annotations

import collections
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import pallas_fa3
from pallas_fa3 import mods
from pallas_fa3.kernels.sm90 import config_backward, flex_tile


def main() -> None:
  warnings.simplefilter("ignore")
  counts = collections.Counter()
  walk, plan = flex_tile._walk, config_backward.backward_plan  # pylint: disable=protected-access

  def counted_walk(fn, score, tile, *a, **k):
    counts["static walks" if tile is None else "in-kernel walks"] += 1
    return walk(fn, score, tile, *a, **k)

  def counted_plan(*a, **k):
    counts["backward decisions"] += 1
    return plan(*a, **k)

  flex_tile._walk = counted_walk  # pylint: disable=protected-access
  config_backward.backward_plan = counted_plan
  b, s, h, d = 2, 128, 4, 64
  q = jnp.zeros((b, s, h, d), jnp.bfloat16)
  ids = jnp.asarray(np.arange(s)[None].repeat(b, 0) // 40, jnp.int32)

  def loss(q, slopes, learnable):
    kw = dict(mask_mod=mods.document_mask(ids), implementation="interpret")
    if learnable:
      kw["score_mod"] = mods.alibi(slopes)
    out = pallas_fa3.flash_attention(q, q, q, **kw)
    return out.astype(jnp.float32).sum()

  for name, learnable in (
    ("learnable ALiBi + document mask (the pair)", True),
    ("document mask (the fused kernel)", False),
  ):
    counts.clear()
    grad = jax.grad(loss, argnums=(0, 1))
    jax.make_jaxpr(grad, static_argnums=2)(q, jnp.ones((h,)), learnable)
    print(f"{name}: {dict(counts)}")


if __name__ == "__main__":
  main()
