"""One plan per call (issue 65): `pallas_fa3.explain` says what a call
would run (backend, kernels and tiles, the backward's form and why, the
flex lowering, the sharding) without running it; each backward form the
plan can choose; the plan is decided once and is what the backward runs
(no re-derivation at backward trace time); `pallas-fa3 info --explain`.
"""

from __future__ import annotations

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

import pallas_fa3
from pallas_fa3 import mods
from pallas_fa3.kernels.sm90 import config_backward
from pallas_fa3.tools import cli


def _sds(b, s, h, d, dtype=jnp.bfloat16, sharding=None):
  return jax.ShapeDtypeStruct((b, s, h, d), dtype, sharding=sharding)


Q, KV = _sds(2, 512, 8, 128), _sds(2, 512, 2, 128)
_IDS = jnp.asarray(np.arange(512)[None].repeat(2, 0) // 100, jnp.int32)

# name -> (kwargs, the backward line's expected start, its reason)
FORMS = {
  "plain_fused": (dict(causal=True), "the fused backward kernel", None),
  "deterministic_pair": (
    dict(causal=True, deterministic=True),
    "the dK/dV and dQ kernels",
    "deterministic=True",
  ),
  "bias_pair": (
    dict(bias=jax.ShapeDtypeStruct((1, 8, 512, 512), jnp.float32)),
    "the dK/dV and dQ kernels",
    "a bias",
  ),
  "flex_d128_shared_tile": (
    dict(mask_mod=mods.document_mask(_IDS)),
    "the fused backward kernel (dQ by reduce-add), tiles 64x64, 2 stages,"
    " dK/dV consumers 2 (head splits 2)",
    None,
  ),
  "flex_deterministic_pair": (
    dict(mask_mod=mods.document_mask(_IDS), deterministic=True),
    "the dK/dV and dQ kernels",
    "deterministic=True",
  ),
  "bias_softcap_blockwise": (
    dict(
      bias=jax.ShapeDtypeStruct((1, 8, 512, 512), jnp.float32), softcap=30.0
    ),
    "the blockwise twin's recomputation",
    "bias with softcap",
  ),
}


@pytest.mark.parametrize("name", FORMS)
def test_explain_says_each_backward_form_and_why(name):
  kwargs, form, why = FORMS[name]
  text = pallas_fa3.explain(Q, KV, KV, implementation="mosaic", **kwargs)
  backward = next(ln for ln in text.splitlines() if ln.startswith("backward:"))
  assert backward.startswith(f"backward: {form}"), text
  if why is None:
    assert "why:" not in backward, backward
  else:
    assert f"why: {why}" in backward, backward
  assert "forward: the sm90 forward kernel (mosaic), tiles " in text


@pytest.mark.parametrize(
  "q, kwargs, pair",
  [
    (_sds(2, 512, 8, 128), dict(softcap=30.0), True),
    (_sds(2, 512, 8, 128), dict(segment_ids=(_IDS, _IDS)), True),
    (_sds(2, 512, 8, 128), dict(causal=False, window_size=(128, 128)), True),
    (_sds(2, 512, 8, 128), dict(causal=False, window_size=(128, 0)), False),
    (_sds(2, 512, 8, 128), dict(), False),
    (Q, dict(softcap=30.0), False),  # GQA: the shared-tile fused layout
    # both: the pair's dK/dV spilled 12-20 B in its loop; the shared tile
    (_sds(2, 512, 8, 128), dict(softcap=30.0, segment_ids=(_IDS, _IDS)), False),
    (_sds(2, 512, 8, 64), dict(segment_ids=(_IDS, _IDS)), False),
  ],
)
def test_d128_segment_ids_and_softcap_leave_the_spilling_fused_layout(
  q, kwargs, pair
):
  """The fused kernel's own-tile layout spilled with segment ids, softcap or
  a window open on both sides at d128 (no GQA group): the default runs the
  dK/dV and dQ pair there and says why; elsewhere the fused kernel."""
  kv = q if q is not Q else KV
  kwargs = {"causal": True, **kwargs}
  text = pallas_fa3.explain(q, kv, kv, implementation="mosaic", **kwargs)
  backward = next(ln for ln in text.splitlines() if ln.startswith("backward:"))
  if pair:
    assert backward.startswith("backward: the dK/dV and dQ kernels"), text
    assert "own-tile layout spills" in backward, backward
  else:
    assert backward.startswith("backward: the fused backward kernel"), text


def test_light_flex_functions_take_the_plain_d128_forward_tiles():
  """softcap / ALiBi score_mods add no registers: 64 x 128 at d128; a
  document mask (vectors of ids) keeps 64 x 64."""
  q = _sds(2, 512, 8, 128)
  light = pallas_fa3.explain(
    q, q, q, score_mod=mods.softcap(20.0), implementation="mosaic"
  )
  heavy = pallas_fa3.explain(
    q, q, q, mask_mod=mods.document_mask(_IDS), implementation="mosaic"
  )
  assert "forward: the sm90 forward kernel (mosaic), tiles 64x128," in light
  assert "forward: the sm90 forward kernel (mosaic), tiles 64x64," in heavy


def test_explain_fused_flex_at_d64_and_the_automatic_choice():
  q, kv = _sds(2, 512, 8, 64), _sds(2, 512, 2, 64)
  text = pallas_fa3.explain(
    q, kv, kv, implementation="mosaic", mask_mod=mods.document_mask(_IDS)
  )
  assert "backward: the fused backward kernel" in text, text
  assert "mask_mod <mask_mod document>: elementwise" in text
  assert "#0[batch, q_idx]; #0[batch, kv_idx]" in text
  auto = pallas_fa3.explain(q, kv, kv, causal=True)
  if jax.default_backend() == "cpu":
    assert "backend: blockwise (the automatic choice)" in auto, auto
    assert "skipped mosaic: no GPU" in auto
    assert "backward: the blockwise recomputation" in auto


def test_explain_takes_flash_attention_arguments_and_raises_the_same():
  params = inspect.signature(pallas_fa3.flash_attention).parameters
  keywords = {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
  # every keyword of flash_attention is accepted (arrays as shapes)
  ok = dict(
    causal=True, softmax_scale=0.1, return_lse=True, implementation=None,
    config=None, deterministic=False, stable_max=None, fp8=False,
    window_size=None, softcap=None, sinks=None, segment_ids=None,
    score_mod=None, mask_mod=None, block_mask=None, bias=None,
    batch_invariant=False,
  )  # fmt: skip
  assert set(ok) == keywords
  pallas_fa3.explain(Q, KV, KV, **ok)
  with pytest.raises(TypeError, match="unknown"):
    pallas_fa3.explain(Q, KV, KV, casual=True)
  q, bad = jnp.zeros(Q.shape, Q.dtype), jnp.zeros((2, 512, 3, 128), Q.dtype)
  for fn in (pallas_fa3.explain, pallas_fa3.flash_attention):
    with pytest.raises(ValueError, match="heads"):
      fn(q, bad, bad)


def test_explain_sharded_calls_and_refusals():
  mesh = AbstractMesh(
    (2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2
  )
  sharded = lambda shape, spec: jax.ShapeDtypeStruct(
    shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec)
  )
  spec = PartitionSpec("data", None, "model")
  q, kv = sharded((4, 512, 8, 128), spec), sharded((4, 512, 4, 128), spec)
  text = pallas_fa3.explain(
    q, kv, kv, implementation="mosaic", mask_mod=mods.causal_top_left
  )
  assert "sharding: batch 2 ways over ('data',), heads 4 ways over" in text
  assert "each device runs batch 2, heads 2/1 (q/kv)" in text
  assert "they see global batch and head indices" in text
  seq = PartitionSpec(None, "data")
  q, kv = sharded((4, 512, 8, 128), seq), sharded((4, 512, 4, 128), seq)
  plain = pallas_fa3.explain(q, kv, kv, causal=True)
  assert "the ring (context parallelism)" in plain, plain
  flexed = pallas_fa3.explain(q, kv, kv, mask_mod=mods.causal_top_left)
  assert "sharding: refused: mask_mod with q sharded along its sequence" in (
    flexed
  )


def test_explain_flags_segment_ids_with_causal_across_lengths():
  q, kv = _sds(2, 256, 8, 128), _sds(2, 512, 2, 128)
  ids = (
    jax.ShapeDtypeStruct((2, 256), jnp.int32),
    jax.ShapeDtypeStruct((2, 512), jnp.int32),
  )
  text = pallas_fa3.explain(q, kv, kv, causal=True, segment_ids=ids)
  assert "note: causal / window_size beside segment_ids align over the" in text
  same = pallas_fa3.explain(
    _sds(2, 512, 8, 128), kv, kv, causal=True, segment_ids=(ids[1], ids[1])
  )
  assert "note:" not in same


def test_the_plan_is_decided_once_and_is_what_the_backward_runs(monkeypatch):
  """A forward + backward trace (interpret) decides the backward once, at
  plan time, and the kernels run that form: the fused kernel for a mask,
  the pair for learnable slopes."""
  from pallas_fa3.kernels.sm90 import backward as kernel

  decided, ran = [], []
  plan_fn, run_fn = config_backward.backward_plan, kernel.sm90_backward
  monkeypatch.setattr(
    config_backward,
    "backward_plan",
    lambda *a, **k: decided.append(1) or plan_fn(*a, **k),
  )
  monkeypatch.setattr(
    kernel,
    "sm90_backward",
    lambda *a, fused=None, **k: (
      ran.append(fused) or run_fn(*a, fused=fused, **k)
    ),
  )
  b, s, h, d = 1, 128, 2, 64
  q = jnp.zeros((b, s, h, d), jnp.bfloat16)

  def loss(q, slopes, score):
    kw = dict(mask_mod=mods.causal_top_left, implementation="interpret")
    if score:
      kw["score_mod"] = mods.alibi(slopes)
    return pallas_fa3.flash_attention(q, q, q, **kw).astype(jnp.float32).sum()

  for score, fused in ((False, True), (True, False)):
    decided.clear()
    ran.clear()
    jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(
      q, jnp.ones((h,)), score
    )
    assert decided == [1], decided
    assert ran == [fused], ran


def test_a_gradient_that_leaves_the_kernels_is_in_the_plan():
  """The plan says it before the call; the backward's warning repeats it."""
  bias = jnp.zeros((1, 2, 128, 128), jnp.float32)
  q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
  kw = dict(bias=bias, softcap=5.0, implementation="interpret")
  text = pallas_fa3.explain(q, q, q, **kw)
  assert "backward: the blockwise twin's recomputation" in text
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jax.make_jaxpr(
      jax.grad(
        lambda q: (
          pallas_fa3.flash_attention(q, q, q, **kw).astype(jnp.float32).sum()
        )
      )
    )(q)
  assert any("bias with softcap" in str(w.message) for w in caught)


def test_info_explain(capsys):
  args = ["info", "--explain", "--batch", "8", "--heads-q", "8"]
  args += ["--heads-kv", "8", "--head-dim", "128", "--implementation"]
  args += ["mosaic", "--alibi", "--learnable", "--document-mask", "64"]
  args += ["--shard-batch", "8"]
  assert cli.main(args) == 0
  out = capsys.readouterr().out
  assert "backend: mosaic (requested: implementation='mosaic')" in out
  assert "learnable arrays' gradients summed: #0 in the dQ kernel" in out
  assert "each device runs batch 1" in out
