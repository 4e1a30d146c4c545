"""Flex options at their edges (issue 64's wrong results): a decode
mask_mod at negative query positions, the backward kernels' reductions of
dS (a score_mod's captured arrays, dbias) at ragged key tails, a block
mask whose mask_mod reads the batch or head index built for every one, and
captured arrays traced by an enclosing `jax.jit` (forward and gradients).
Each against the float64 golden (or an exact identity) at ragged sizes, in
every backend that serves the call, the kernels interpreted with race
detection.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa3
from pallas_fa3 import mods
from pallas_fa3.testing import (
  assert_within_tolerance,
  flex_golden_and_naive,
  run_interpreted,
)

B, HQ, HK, D = 2, 4, 2, 64
NAMES = ("out", "dq", "dk", "dv", "dparams")


def _inputs(sq, skv, dtype=jnp.bfloat16, seed=0, d=D):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (B, sq, HQ, d), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (B, skv, HK, d), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (B, skv, HK, d), jnp.float32).astype(dtype)
  do = jax.random.normal(ks[3], (B, sq, HQ, d), jnp.float32).astype(dtype)
  return q, k, v, do


def _check(impl, q, k, v, do, params, options, label, jit=False, config=None):
  """`flash_attention` and its vjp (in every operand and `params`)
  against the float64 golden with the tolerance rule."""
  golden, naive = flex_golden_and_naive(q, k, v, do, params, options)

  def run(q, k, v, params, do):
    f = lambda q, k, v, p: pallas_fa3.flash_attention(
      q, k, v, implementation=impl, config=config, **options(p)
    )
    out, pull = jax.vjp(f, q, k, v, params)
    return (out,) + tuple(pull(do))

  fn = jax.jit(run) if jit else run
  if impl == "interpret":
    got = run_interpreted(fn, q, k, v, params, do)
  else:
    got = fn(q, k, v, params, do)
  for name, g, n, ref in zip(NAMES, got, naive, golden):
    for i, (gl, nl, rl) in enumerate(
      zip(jax.tree.leaves(g), jax.tree.leaves(n), jax.tree.leaves(ref))
    ):
      if rl.dtype == jax.dtypes.float0:  # an integer array's cotangent
        assert gl.dtype == jax.dtypes.float0, f"{label} {name}[{i}]"
        continue
      assert_within_tolerance(f"{label} {name}[{i}]", gl, nl, rl)


# ---------------------------------------------------------------------------
# 1. Decoding: mask_mod sees the queries' true positions, negative ones too.

CAP, DSQ = 256, 8


def _decode_golden(q, kc, vc, lens, mask_mod):
  """Float64 numpy: query i of sequence b at position `L_b - seq_q + i`
  sees key j < L_b where `mask_mod` allows (a row that sees none: 0)."""
  q, kc, vc = (np.asarray(x, np.float64) for x in (q, kc, vc))
  g = HQ // HK
  out = np.zeros(q.shape[:3] + (vc.shape[-1],))
  for b, n in enumerate(lens):
    for h in range(HQ):
      s = q[b, :, h] @ kc[b, :n, h // g].T / np.sqrt(q.shape[-1])
      pos = n - q.shape[1] + np.arange(q.shape[1])
      vis = np.array(
        [[bool(mask_mod(b, h, int(i), int(j))) for j in range(n)] for i in pos]
      ).reshape(len(pos), n)
      s = np.where(vis, s, -np.inf)
      m = np.max(s, axis=1, keepdims=True, initial=-np.inf)
      p = np.where(vis, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
      l = p.sum(1, keepdims=True)
      out[b, :, h] = (p / np.where(l > 0, l, 1.0)) @ vc[b, :n, h // g]
  return out


def _causal_mask(b, h, qi, ki):
  return ki <= qi


# FA3's attention_chunk as a mask_mod: keys of the query's own chunk of 4,
# up to itself.
_chunk = mods.chunked(4)


@pytest.mark.parametrize("lens", [(5, 100), (3, 255)])
@pytest.mark.parametrize("impl", ["reference", "blockwise", "interpret"])
def test_decode_mask_mod_at_negative_query_positions(impl, lens):
  """Sequences shorter than seq_q put their first queries before position
  0: mask_mod sees those positions (as score_mod and the kernel do), so
  `ki <= qi` equals `causal=True` there (those rows see no key) and a
  chunked mask holds its chunks; against the float64 golden."""
  ks = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(ks[0], (B, DSQ, HQ, D), jnp.bfloat16)
  kc = jax.random.normal(ks[1], (B, CAP, HK, D), jnp.bfloat16)
  vc = jax.random.normal(ks[2], (B, CAP, HK, D), jnp.bfloat16)
  lengths = jnp.asarray(lens, jnp.int32)

  def call(**kw):
    f = lambda: pallas_fa3.flash_attention_with_kvcache(
      q, kc, vc, cache_seqlens=lengths, implementation=impl, **kw
    )
    return run_interpreted(f) if impl == "interpret" else f()

  causal = call(causal=True)
  np.testing.assert_array_equal(
    np.asarray(call(mask_mod=_causal_mask), np.float32),
    np.asarray(causal, np.float32),
  )
  for name, fn in (("causal", _causal_mask), ("chunked", _chunk)):
    want = _decode_golden(q, kc, vc, lens, lambda *a, fn=fn: fn(*a))
    got = np.asarray(call(mask_mod=fn), np.float64)
    np.testing.assert_allclose(got, want, atol=2e-2, err_msg=name)
    # rows before position 0 see no key under the causal mask: exactly 0
    if name == "causal":
      for b, n in enumerate(lens):
        assert not np.any(got[b, : max(DSQ - n, 0)])


# ---------------------------------------------------------------------------
# 2. The backward kernels' reductions of dS at ragged key tails.


def _ragged_options(p):
  ph, pq, tk, bias = p
  return dict(
    # ph[h] and pq[b, q_idx] shift whole rows (no effect: zero gradients
    # exactly); tk[h, kv_idx] is the dK/dV kernel's per-key sum.
    score_mod=lambda s, b, h, qi, ki: s + ph[h] + pq[b, qi] + tk[h, ki],
    bias=bias,  # dbias: the dQ kernel's dS, summed over the batch
  )


def _ragged_params(seq):
  ks = jax.random.split(jax.random.key(seq), 4)
  return (
    0.5 * jax.random.normal(ks[0], (HQ,)),
    0.5 * jax.random.normal(ks[1], (B, seq)),
    0.5 * jax.random.normal(ks[2], (HQ, seq)),
    0.5 * jax.random.normal(ks[3], (1, HQ, seq, seq)),
  )


# The default run: the interpreted kernels at 64 (a key tile wholly past
# seq_kv: what went wrong), the twin at every size, the oracle at 64.
_RAGGED_SLOW = {
  ("interpret", 100),
  ("interpret", 192),
  ("interpret", 255),
  ("reference", 100),
  ("reference", 192),
  ("reference", 255),
}


@pytest.mark.filterwarnings("error:the sm90 backward kernels cannot")
@pytest.mark.parametrize(
  "impl, seq",
  [
    pytest.param(
      impl, seq, marks=pytest.mark.slow if (impl, seq) in _RAGGED_SLOW else ()
    )
    for impl in ("reference", "blockwise", "interpret")
    for seq in (64, 192, 100, 255)
  ],
)
def test_score_mod_array_gradients_at_ragged_tails(impl, seq):
  """A score_mod's captured arrays read by head, by query and by key, and a
  bias broadcast over the batch, where seq_kv is not a multiple of the
  key tile (the dQ kernel's keys padded to the dK/dV kernel's CTAs walked
  a tile wholly past seq_kv, whose dS reached the arrays' sums)."""
  q, k, v, do = _inputs(seq, seq)
  _check(impl, q, k, v, do, _ragged_params(seq), _ragged_options, impl)


@pytest.mark.slow
@pytest.mark.filterwarnings("error:the sm90 backward kernels cannot")
def test_score_mod_array_gradients_at_ragged_tails_shared_tiles():
  """The same in the shared-tile dQ kernel (two consumers, one tile)."""
  config = pallas_fa3.Sm90Config(
    backward=pallas_fa3.Sm90BackwardConfig(
      block_q=64, block_kv=64, num_stages=2, dkdv_consumers=2,
      dkdv_head_splits=2, dq_consumers=2, dq_head_splits=2,
    )
  )  # fmt: skip
  q, k, v, do = _inputs(100, 100, d=128)
  # (arrays read by key: not in the shared-tile dK/dV kernel)
  ph, pq, _, bias = _ragged_params(100)
  options = lambda p: dict(
    score_mod=lambda s, b, h, qi, ki: s + p[0][h] + p[1][b, qi], bias=p[2]
  )
  _check(
    "interpret", q, k, v, do, (ph, pq, bias), options, "shared", config=config
  )


# ---------------------------------------------------------------------------
# 3. create_block_mask(batch=None / heads=None) with a mask_mod that reads
# the batch / head index.


def test_create_block_mask_refuses_shared_masks_that_read_batch_or_head():
  ids = jnp.asarray(
    np.stack([np.arange(64) // 16, np.arange(64) // 32]), jnp.int32
  )
  doc = mods.document_mask(ids)
  with pytest.raises(ValueError, match=r"batch=None .* reads its batch"):
    pallas_fa3.create_block_mask(doc, None, None, 64, 64)
  per_head = lambda b, h, qi, ki: (h == 0) | (ki <= qi)
  with pytest.raises(ValueError, match=r"heads=None .* reads its head"):
    pallas_fa3.create_block_mask(per_head, B, None, 64, 64)
  # what does not read them is shared as before
  bm = pallas_fa3.create_block_mask(mods.causal_top_left, None, None, 64, 64)
  assert bm.state.shape[:2] == (1, 1)
  # built per batch row, each row keeps its own documents
  bm = pallas_fa3.create_block_mask(doc, B, None, 64, 64, block_q=16)
  dense = np.asarray(bm.to_dense())
  want = np.asarray(ids[:, :, None] == ids[:, None, :])[:, None]
  np.testing.assert_array_equal(dense, want)
  q, k, v, _ = _inputs(64, 64, jnp.float32)
  got = pallas_fa3.flash_attention(
    q, k, v, block_mask=bm, implementation="blockwise"
  )
  ref = pallas_fa3.reference_attention(q, k, v, mask_mod=doc)
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5)


# ---------------------------------------------------------------------------
# 4. Captured arrays traced by an enclosing jax.jit, forward and gradients.

_SEQ = 100  # ragged


def _doc_ids(seq):
  return jnp.asarray(
    np.stack([np.arange(seq) // 30, np.arange(seq) // 45]), jnp.int32
  )


# kind -> (params, options(params)): integer ids (and an integer table)
# among the params, so an outer jit traces them too.
_TRACED = {
  "mask_mod": (
    (_doc_ids(_SEQ),),
    lambda p: dict(mask_mod=mods.document_mask(p[0])),
  ),
  "score_mod": (
    (jnp.asarray(np.arange(_SEQ) % 7, jnp.int32), mods.alibi_slopes(HQ)),
    lambda p: dict(
      score_mod=lambda s, b, h, qi, ki: (
        s - p[1][h] * jnp.abs(p[0][qi] - p[0][ki]).astype(s.dtype)
      ),
    ),
  ),
  "block_mask": (
    (_doc_ids(_SEQ),),
    lambda p: dict(
      block_mask=pallas_fa3.create_block_mask(
        mods.document_mask(p[0]),
        B,
        None,
        _SEQ,
        _SEQ,
        block_q=64,
        block_kv=64,
      ),
    ),  # fmt: skip
  ),
  "bias": (
    (0.5 * jax.random.normal(jax.random.key(5), (B, 1, _SEQ, _SEQ)),),
    lambda p: dict(bias=p[0], mask_mod=mods.causal_top_left),
  ),
}
_TRACED_QUICK_INTERPRET = {"mask_mod", "score_mod"}


@pytest.mark.parametrize(
  "impl, kind",
  [
    pytest.param(
      impl,
      kind,
      marks=pytest.mark.slow
      if impl == "interpret" and kind not in _TRACED_QUICK_INTERPRET
      else (),
    )
    for impl in ("reference", "blockwise", "interpret")
    for kind in _TRACED
  ],
)
def test_captured_arrays_traced_by_an_outer_jit(impl, kind):
  """The ids passed into a jitted train step (`mods.document_mask(ids)`
  built inside it): forward and every gradient against the float64
  golden (the integer arrays' cotangents are float0 zeros)."""
  params, options = _TRACED[kind]
  q, k, v, do = _inputs(_SEQ, _SEQ)
  with warnings.catch_warnings():
    # the kernels serve every kind but a block mask without its mask_mod
    # in the call (that one falls back to the twin, said by a warning)
    fallback = impl == "interpret" and kind == "block_mask"
    warnings.simplefilter("ignore" if fallback else "error", UserWarning)
    _check(impl, q, k, v, do, params, options, kind, jit=True)


def test_document_mask_in_a_jitted_train_step():
  """The issue's case: a loss summed over the output (jax.grad's constant
  cotangent) in a jitted step that builds the mask from its ids."""
  q, k, v, _ = _inputs(64, 64, jnp.float32)
  ids = _doc_ids(64)

  def loss(q, k, v, ids, impl):
    out = pallas_fa3.flash_attention(
      q, k, v, mask_mod=mods.document_mask(ids), implementation=impl
    )
    return out.sum()

  step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=4)
  want = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, ids, "reference")
  for impl in ("reference", "blockwise"):
    for g, w in zip(step(q, k, v, ids, impl), want):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5)


@pytest.mark.parametrize(
  "options", [{}, {"causal": True}, {"mask_mod": mods.causal_top_left}]
)
def test_blockwise_gradients_with_constant_cotangents_under_jit(options):
  """jax.grad of `out.sum()` and a vjp with a constant cotangent, under
  jit: the constant made XLA's CPU YNNPACK fusion (the dP dot with the
  delta reduction) compute garbage on jaxlib 0.11.2
  (docs/design_notes.md, "A miscompiled fusion")."""
  # One head, dq alone, K and V operands of the jit: the programs that
  # went wrong (XLA's fusion decisions depend on all of it).
  ks = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(x, (1, 64, 1, 64), jnp.float32) for x in ks)
  attend = lambda q, k, v, impl: pallas_fa3.flash_attention(
    q, k, v, implementation=impl, **options
  )
  want = jax.grad(lambda q: attend(q, k, v, "reference").sum())(q)
  ones = jnp.ones_like(q)

  def dq_by_vjp(q, k, v):
    return jax.vjp(lambda q: attend(q, k, v, "blockwise"), q)[1](ones)[0]

  def dq_by_grad(q, k, v):
    return jax.grad(lambda q: attend(q, k, v, "blockwise").sum())(q)

  for fn in (dq_by_vjp, dq_by_grad):
    got = jax.jit(fn)(q, k, v)
    np.testing.assert_allclose(got, want, atol=2e-5, err_msg=fn.__name__)


def test_bias_shape_message_says_one_where_the_call_has_one():
  """A leading dim of size 1 in the call allows only 1: `[1, 4 or 1, ..]`,
  not `[1 or 1, ..]`."""
  q = jnp.zeros((1, 64, 4, 32), jnp.float32)
  with pytest.raises(ValueError, match=r"bias must have shape \[1, 4 or 1, 64"):
    pallas_fa3.flash_attention(
      q, q, q, bias=jnp.zeros((2, 4, 64, 64)), implementation="blockwise"
    )
  bm = pallas_fa3.create_block_mask(mods.causal_top_left, 2, None, 64, 64)
  with pytest.raises(ValueError, match=r"this call needs \[1, 4 or 1, 64"):
    pallas_fa3.flash_attention(q, q, q, block_mask=bm)


# ---------------------------------------------------------------------------
# A shard of a call split over batch and heads, in the kernels.


@pytest.mark.filterwarnings("error:the sm90 backward kernels cannot")
def test_a_shards_kernels_compute_its_rows_of_the_whole_call():
  """What each device of a batch- and head-sharded call runs
  (`flex.shard_local`: functions that read batch / head see global
  indices), in the kernels (interpret): batches 2-3 and query heads 2-3 of
  a 4 x 4 call, learnable ALiBi slopes (their gradient summed in the dQ
  kernel at the global heads) and a document mask per batch row, against
  the float64 golden of the whole call's rows."""
  import dataclasses

  from pallas_fa3 import backends, flex
  from pallas_fa3.spec import make_spec

  b, s, hq, hk, d = 4, 64, 4, 2, 64
  ks = jax.random.split(jax.random.key(0), 4)
  q, do = (jax.random.normal(x, (b, s, hq, d), jnp.bfloat16) for x in ks[:2])
  k, v = (jax.random.normal(x, (b, s, hk, d), jnp.bfloat16) for x in ks[2:])
  ids = jnp.asarray(
    np.arange(s)[None] // (16 + 8 * np.arange(b)[:, None]), jnp.int32
  )
  slopes = jnp.asarray(mods.alibi_slopes(hq))
  options = lambda p: dict(
    score_mod=mods.alibi(p[0]), mask_mod=mods.document_mask(ids)
  )
  rows = (slice(2, 4), slice(None), slice(2, 4))  # batch 2-3, heads 2-3
  # the golden of the shard's rows: the whole call, cotangent on them only
  do_rows = jnp.zeros_like(do).at[rows].set(do[rows])
  golden, naive = flex_golden_and_naive(q, k, v, do_rows, (slopes,), options)
  backend = backends.get("interpret")
  ql, dol = q[rows], do[rows]
  kl, vl = k[2:, :, 1:], v[2:, :, 1:]

  def shard(ql, kl, vl, slopes):
    fs, ops = flex.prepare(
      **options((slopes,)), block_mask=None, bias=None, batch=b, heads=hq,
      seq_q=s, seq_kv=s,
    )  # fmt: skip
    fs, ops = flex.shard_local(
      fs, ops, batch=2, heads=2, first=(jnp.int32(2), jnp.int32(2)),
      split=(True, True),
    )  # fmt: skip
    spec = dataclasses.replace(make_spec(ql, kl, vl), flex=fs)
    config = backend.make_config(spec, None)
    out, lse = backend.run_forward(spec, config, ql, kl, vl, flex=ops)
    dq, dk, dv, (_, dscore) = backend.run_backward(
      spec, config, ql, kl, vl, out, lse, dol, jnp.zeros_like(lse), flex=ops
    )
    return out, dq, dscore[0]

  out, dq, dslopes = run_interpreted(jax.jit(shard), ql, kl, vl, slopes)
  assert_within_tolerance("out", out, naive[0][rows], golden[0][rows])
  assert_within_tolerance("dq", dq, naive[1][rows], golden[1][rows])
  assert_within_tolerance("dslopes", dslopes, naive[4][0], golden[4][0])
