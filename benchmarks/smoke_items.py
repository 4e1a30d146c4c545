"""The `smoke` items of `device_smoke.py`: one small call of every kernel
path that had only been compiled before its first GPU run, each checked
against the float64 golden with the tolerance rule (FP8 paths and the
decode kernel: their blockwise twins; quantization: its twin's bits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_fa3
from pallas_fa3.testing import (
  Shape,
  golden_and_naive,
  max_abs_err,
  random_inputs,
  tolerance,
)


def check(name, got, naive, golden) -> dict:
  err, bound = max_abs_err(got, golden), tolerance(naive, golden)
  return {f"{name}_err": err, f"{name}_bound": bound}


def kernel_item(
  head_dim: int,
  backward: bool,
  dtype=jnp.bfloat16,
  causal=True,
  shape=None,
  deterministic=False,
  config=None,
  implementation="mosaic",
  **options,
):
  """One call through `implementation` against the float64 golden (with
  `options`: window_size, softcap)."""
  shape = shape or Shape(1, 200, 330, 4, 2, head_dim)
  q, k, v, dout = random_inputs(jax.random.key(head_dim), shape, dtype)
  golden, naive = golden_and_naive(q, k, v, dout, causal=causal, **options)
  f = lambda q, k, v: pallas_fa3.flash_attention(
    q,
    k,
    v,
    causal=causal,
    return_lse=True,
    implementation=implementation,
    deterministic=deterministic,
    config=config,
    **options,
  )
  out, lse = jax.jit(f)(q, k, v)
  result = {
    **check("out", out, naive[0], golden[0]),
    **check("lse", lse, naive[1], golden[1]),
  }
  if backward:
    loss = lambda q, k, v: (
      f(q, k, v)[0].astype(jnp.float32) * dout.astype(jnp.float32)
    ).sum()
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for name, g, n, gold in zip(
      ("dq", "dk", "dv"), grads, naive[2:], golden[2:]
    ):
      result.update(check(name, g, n, gold))
  return result


def _fp8_item():
  q, k, v, _ = random_inputs(
    jax.random.key(8), Shape(1, 256, 512, 4, 2, 128), jnp.bfloat16
  )
  f = lambda impl: jax.jit(
    lambda q, k, v: pallas_fa3.flash_attention(
      q, k, v, causal=True, fp8=True, implementation=impl
    )
  )(q, k, v)
  got = np.asarray(f("mosaic"), np.float32)
  twin = np.asarray(f("blockwise"), np.float32)
  return {
    "out_vs_twin_err": float(np.max(np.abs(got - twin))),
    "out_vs_twin_bound": 0.05,
  }


def _fp8_options_item():
  """The FP8 forward with a window, softcap, sinks and packed documents
  against its twin."""
  q, k, v, _ = random_inputs(
    jax.random.key(8), Shape(1, 512, 512, 4, 2, 128), jnp.bfloat16
  )
  ids = jnp.repeat(
    jnp.arange(3), jnp.asarray([200, 200, 112]), total_repeat_length=512
  )[None]
  opts = dict(
    window_size=(100, None),
    softcap=5.0,
    sinks=jnp.asarray([0.3, -0.2, 1.0, 0.0], jnp.float32),
    segment_ids=ids.astype(jnp.int32),
  )
  f = lambda impl: jax.jit(
    lambda q, k, v: pallas_fa3.flash_attention(
      q, k, v, causal=True, fp8=True, implementation=impl, **opts
    )
  )(q, k, v)
  got = np.asarray(f("mosaic"), np.float32)
  twin = np.asarray(f("blockwise"), np.float32)
  return {
    "out_vs_twin_err": float(np.max(np.abs(got - twin))),
    "out_vs_twin_bound": 0.05,
  }


def _max_diff(a, b) -> float:
  return float(
    np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)))
  )


def _decode_item(fp8_cache: bool):
  """One decode step, GQA 4, paged (64-token pages), two appended tokens,
  against the blockwise twin; with an e4m3 cache the converter warpgroup's
  handshake."""
  b, hq, hk, d, cap, ps = 4, 16, 4, 128, 4096, 64
  keys = jax.random.split(jax.random.key(11), 5)
  q = jax.random.normal(keys[0], (b, 1, hq, d), jnp.bfloat16)
  kc = jax.random.normal(keys[1], (b * cap // ps, ps, hk, d), jnp.bfloat16)
  vc = jax.random.normal(keys[2], (b * cap // ps, ps, hk, d), jnp.bfloat16)
  k = jax.random.normal(keys[3], (b, 2, hk, d), jnp.bfloat16)
  table = jax.random.permutation(keys[4], b * cap // ps).reshape(b, -1)
  lengths = jnp.asarray([4000, 3001, 17, 0], jnp.int32)
  extra = {}
  if fp8_cache:
    x = pallas_fa3.quantize_kv_cache(kc, vc, page_table=table)
    kc, vc = x.k_cache, x.v_cache
    extra = dict(k_descale=x.k_descale, v_descale=x.v_descale)
  f = lambda impl: jax.jit(
    lambda q, kc, vc, k: pallas_fa3.flash_attention_with_kvcache(
      q,
      kc,
      vc,
      k,
      k,
      cache_seqlens=lengths,
      page_table=table.astype(jnp.int32),
      causal=True,
      implementation=impl,
      **extra,
    )
  )(q, kc, vc, k)
  got, twin = f("mosaic"), f("blockwise")
  return {
    "out_vs_twin_err": _max_diff(got[0], twin[0]),
    "out_vs_twin_bound": 0.03,
    "cache_vs_twin_err": max(
      _max_diff(got[1], twin[1]), _max_diff(got[2], twin[2])
    ),
    "cache_vs_twin_bound": 0.0,
  }


def _mla_item(fp8_cache: bool = False):
  """One DeepSeek MLA step (576 / 512, 128 query heads: two query tiles),
  paged, left-padded, one appended token, against the blockwise twin: the
  MLA kernel's three warpgroups (setmaxnreg 256/224/24), its P hand-off
  and its Q / output union; with an e4m3 cache its converter (256/176/72,
  one float16 slot)."""
  b, hq, d, dv, cap, ps = 2, 128, 576, 512, 2048, 64
  keys = jax.random.split(jax.random.key(12), 4)
  q = jax.random.normal(keys[0], (b, 1, hq, d), jnp.bfloat16)
  kc = jax.random.normal(keys[1], (b * cap // ps, ps, 1, d), jnp.bfloat16)
  k = jax.random.normal(keys[2], (b, 1, 1, d), jnp.bfloat16)
  table = jax.random.permutation(keys[3], b * cap // ps).reshape(b, -1)
  extra = {}
  if fp8_cache:
    x = pallas_fa3.quantize_kv_cache(kc, None, page_table=table)
    kc, extra = x.k_cache, dict(k_descale=x.k_descale)
  f = lambda impl: jax.jit(
    lambda q, kc, k: pallas_fa3.flash_attention_with_kvcache(
      q, kc, None, k, cache_seqlens=jnp.asarray([2000, 130], jnp.int32),
      page_table=table.astype(jnp.int32), head_dim_v=dv, causal=True,
      cache_leftpad=jnp.asarray([70, 0], jnp.int32), implementation=impl,
      **extra,
    )
  )(q, kc, k)  # fmt: skip
  got, twin = f("mosaic"), f("blockwise")
  return {
    "out_vs_twin_err": _max_diff(got[0], twin[0]),
    "out_vs_twin_bound": 0.03,
    "cache_vs_twin_err": _max_diff(got[1], twin[1]),
    "cache_vs_twin_bound": 0.0,
  }


def _flex_item():
  """A document mask_mod with a softcap score_mod, forward and gradients
  (the fused backward kernel at d64), against the float64 golden."""
  from pallas_fa3 import mods  # pylint: disable=g-import-not-at-top
  from pallas_fa3.testing import flex_golden_and_naive  # pylint: disable=g-import-not-at-top

  shape = Shape(2, 300, 300, 4, 2, 64)
  q, k, v, dout = random_inputs(jax.random.key(5), shape, jnp.bfloat16)
  ids = jnp.asarray(np.arange(300)[None].repeat(2, 0) // 70, jnp.int32)
  options = lambda p: dict(
    mask_mod=mods.document_mask(ids), score_mod=mods.softcap(5.0)
  )
  golden, naive = flex_golden_and_naive(q, k, v, dout, (), options)
  f = lambda q, k, v: pallas_fa3.flash_attention(
    q, k, v, implementation="mosaic", **options(())
  )
  out, pull = jax.vjp(jax.jit(f), q, k, v)
  result = check("out", out, naive[0], golden[0])
  for name, g, n, gold in zip(
    ("dq", "dk", "dv"), pull(dout), naive[1:], golden[1:]
  ):
    result.update(check(name, g, n, gold))
  return result


def _quantize_item():
  """The quantization kernel with four warpgroups (256 output rows: V^T at
  d256) against its pure-JAX twin, bit for bit."""
  from pallas_fa3.kernels.sm90 import quantize  # pylint: disable=g-import-not-at-top
  from pallas_fa3.quant import e4m3  # pylint: disable=g-import-not-at-top

  q, k, v, _ = random_inputs(
    jax.random.key(9), Shape(1, 512, 512, 2, 2, 256), jnp.bfloat16
  )
  args = (q, k, v, jax.random.key(1))
  opts = dict(block_q=128, block_kv=128, block_quantization=True)
  opts.update(rotation=True, q_residual=False)
  got = jax.jit(lambda *a: quantize.quantize_inputs_kernel(*a, **opts))(*args)
  want = jax.jit(lambda *a: e4m3.quantize_inputs(*a, **opts))(*args)
  diff = [
    float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
  ]
  return {"bits_vs_twin_err": max(diff), "bits_vs_twin_bound": 0.0}


# The split of the dQ columns between two consumers owning their keys (FA3's
# d128 layout, the default since issue 43): the exchange barrier.
_DQ_BY_COLS = pallas_fa3.Sm90Config(
  backward=pallas_fa3.Sm90BackwardConfig(64, 64, 2, 2, 1)
)


# (name, what it is the first run of, function): each runs in a process of
# its own under its own timeout (`smoke`), so a hang is reported as a hang.
def _jvp_item():
  """jax.jvp through the forward kernel and the forward-tangent kernel
  (GQA, causal, ragged) against the blockwise twin's tangent pass."""
  q, k, v, _ = random_inputs(
    jax.random.key(69), Shape(1, 200, 330, 4, 2, 128), jnp.bfloat16
  )
  dq, dk, dv, _ = random_inputs(
    jax.random.key(70), Shape(1, 200, 330, 4, 2, 128), jnp.bfloat16
  )
  f = lambda impl: jax.jit(
    lambda x, u: jax.jvp(
      lambda q, k, v: pallas_fa3.flash_attention(
        q, k, v, causal=True, return_lse=True, implementation=impl
      ),
      x,
      u,
    )[1]
  )((q, k, v), (dq, dk, dv))
  got, twin = f("mosaic"), f("blockwise")
  result = {}
  for name, a, b in zip(("dout", "dlse"), got, twin):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    result[f"{name}_vs_twin_err"] = float(np.max(np.abs(a - b)))
    result[f"{name}_vs_twin_bound"] = 0.02 * float(np.max(np.abs(b)))
  return result


SMOKE_ITEMS = {
  "fwd bf16 d128": (
    "pingpong turn barriers (named, inline PTX)",
    lambda: kernel_item(128, False),
  ),
  "fwd+bwd bf16 d128 fused": (
    "TMA reduce-add of dQ into the in-place jax.new_ref accumulator",
    lambda: kernel_item(128, True),
  ),
  "fwd+bwd bf16 d128 fused dQ by columns": (
    "the consumers' dS exchange barrier",
    lambda: kernel_item(128, True, config=_DQ_BY_COLS),
  ),
  "fwd+bwd bf16 d128 deterministic": (
    "the dK/dV and dQ kernels",
    lambda: kernel_item(128, True, deterministic=True),
  ),
  "fwd+bwd bf16 d128 GQA window softcap": (
    "the shared-tile fused layout at d128 (GQA with a modifier)",
    lambda: kernel_item(
      128,
      True,
      shape=Shape(1, 200, 256, 4, 2, 128),
      window_size=(100, None),
      softcap=5.0,
    ),  # fmt: skip
  ),
  "fwd+bwd bf16 d192 fused": (
    "the shared-tile fused layout",
    lambda: kernel_item(192, True),
  ),
  "fwd+bwd bf16 d256": ("d256 tiles", lambda: kernel_item(256, True)),
  "quantize d256 4 warpgroups": (
    "the multi-warpgroup quantization kernel (named-barrier amax)",
    _quantize_item,
  ),
  "fwd fp8 d128": (
    "the FP8 forward (its setmaxnreg split) after the quantization kernel",
    _fp8_item,
  ),
  "fwd fp8 d128 window softcap sinks docs": (
    "the FP8 forward's masks, softcap, sinks and segment bounds",
    _fp8_options_item,
  ),
  "decode bf16 d128 paged": (
    "the decode kernel (paged TMA, split-KV, V rows zeroed)",
    lambda: _decode_item(False),
  ),
  "decode e4m3 d128 paged": (
    "the e4m3 decode's converter warpgroup (setmaxnreg 256/168, handshake)",
    lambda: _decode_item(True),
  ),
  "decode mla 576/512 paged leftpad": (
    "the MLA decode kernel (two consumers, P through shared memory)",
    _mla_item,
  ),
  "decode mla 576/512 e4m3 paged leftpad": (
    "the MLA kernel's converter warpgroup (setmaxnreg 256/176/72)",
    lambda: _mla_item(True),
  ),
  "fwd+bwd bf16 d64 flex fused": (
    "the fused backward with a mask_mod and a score_mod's derivative",
    _flex_item,
  ),
  "jvp bf16 d128 tangent kernel": (
    "the forward-tangent kernel (K and K', V and V' on one ring barrier)",
    _jvp_item,
  ),
}
