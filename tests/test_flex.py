"""Flex attention (`score_mod`, `mask_mod`, `block_mask`, `bias`;
`pallas_fa3.flex`, `pallas_fa3.mods`): every ready-made function and user
closures over arrays in reference and blockwise, forward and every gradient
(captured slopes, tables and the bias included) against the float64
golden with the tolerance rule; block masks (built under jit, reused in a
scan, their tiles and skipping); the Hopper backends' refusal and the
automatic fallback; bad input. dot_product_attention: test_dot_product.py.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa3
from pallas_fa3 import flex, mods
from pallas_fa3.testing import assert_within_tolerance, flex_golden_and_naive

B, SQ, SKV, HQ, HK, D = 2, 160, 192, 4, 2, 32
TILES = pallas_fa3.BlockwiseConfig(block_q=64, block_kv=64)
NAMES = ("out", "dq", "dk", "dv", "dparams")


def _inputs(dtype=jnp.bfloat16, sq=SQ, skv=SKV, seed=0, d=D):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (B, sq, HQ, d), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (B, skv, HK, d), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (B, skv, HK, d), jnp.float32).astype(dtype)
  do = jax.random.normal(ks[3], (B, sq, HQ, d), jnp.float32).astype(dtype)
  return q, k, v, do


_IDS = jnp.asarray(
  np.repeat(np.arange(4), [40, 70, 50, 32])[None].repeat(B, 0), jnp.int32
)
_QIDS = _IDS[:, SKV - SQ :]
_DILATED = jnp.asarray(np.arange(SQ + SKV) % 3 == 0)

# name -> (params, options(params)); every one at sq != skv.
CASES = {
  "causal_bottom_right": (
    (),
    lambda p: dict(mask_mod=mods.causal_bottom_right(SQ, SKV)),
  ),
  "causal_top_left": ((), lambda p: dict(mask_mod=mods.causal_top_left)),
  "sliding_window": (
    (),
    lambda p: dict(mask_mod=mods.sliding_window(24, 8, offset=SKV - SQ)),
  ),
  "document": ((), lambda p: dict(mask_mod=mods.document_mask(_QIDS, _IDS))),
  "prefix_lm": (
    (),
    lambda p: dict(mask_mod=mods.prefix_lm(jnp.array([30, 90]))),
  ),
  "chunked": ((), lambda p: dict(mask_mod=mods.chunked(48, offset=SKV - SQ))),
  "softcap": ((), lambda p: dict(score_mod=mods.softcap(2.0))),
  "alibi": (
    mods.alibi_slopes(HQ),
    lambda p: dict(score_mod=mods.alibi(p, offset=SKV - SQ), causal=True),
  ),
  "relative_bias": (
    0.5 * jax.random.normal(jax.random.key(7), (HQ, 2 * 16 + 1)),
    lambda p: dict(score_mod=mods.relative_position_bias(p, 16)),
  ),
  # T5's log buckets (causal: the decoder's one direction), a table per
  # batch read at a clipped relative position, and a mask_mod reading a
  # table at one (dilated keys beside causal): the forward kernel's
  # skewed relative-position operands.
  "t5_bias": (
    0.5 * jax.random.normal(jax.random.key(16), (HQ, 16)),
    lambda p: dict(
      score_mod=mods.t5_relative_position_bias(
        p, bidirectional=False, max_distance=64
      ),
      causal=True,
    ),
  ),
  "relative_tables": (
    0.3 * jax.random.normal(jax.random.key(17), (B, HQ, 40)),
    lambda p: dict(
      score_mod=lambda s, b, h, qi, ki: (
        s + p[b, h, jnp.clip(qi - ki, -20, 19) + 20]
      ),
      mask_mod=lambda b, h, qi, ki: _DILATED[ki - qi + SQ] | (ki <= qi),
    ),
  ),
  # Arrays read at an index computed from one position (not `+ c`): a
  # mask_mod comparing ids at 3 q_idx // 2 with the key's, and a learnable
  # table at q_idx % 7 and at 5 kv_idx % 7 (per-position operands).
  "gathered_mask": (
    (),
    lambda p: dict(
      mask_mod=lambda b, h, qi, ki: _IDS[b, (qi * 3) // 2 % SKV] >= _IDS[b, ki]
    ),
  ),
  "gathered_table": (
    0.3 * jax.random.normal(jax.random.key(18), (HQ, 7)),
    lambda p: dict(
      score_mod=lambda s, b, h, qi, ki: (
        s + p[h, qi % 7] - 0.5 * p[h, (ki * 5) % 7]
      ),
      causal=True,
    ),
  ),
  "bias": (
    0.5 * jax.random.normal(jax.random.key(8), (1, HQ, SQ, SKV)),
    lambda p: dict(bias=p),
  ),
  "bias_batch": (
    0.5 * jax.random.normal(jax.random.key(9), (B, 1, SQ, SKV)),
    lambda p: dict(bias=p, mask_mod=mods.causal_top_left),
  ),
  # One per (batch, head): dbias is dS itself (the dQ kernel writes it in
  # the bias's dtype, nothing summed).
  "bias_full": (
    (0.5 * jax.random.normal(jax.random.key(19), (B, HQ, SQ, SKV))).astype(
      jnp.bfloat16
    ),
    lambda p: dict(bias=p, causal=True),
  ),
  # A learnable offset per (batch, head), the dQ kernel's 2-D attribution
  # (on every other key: a row-wide offset would have a zero gradient).
  "batch_head_offset": (
    0.5 * jax.random.normal(jax.random.key(11), (B, HQ)),
    lambda p: dict(
      score_mod=lambda s, b, h, qi, ki: s + p[b, h] * (ki % 2 == 0),
      causal=True,
    ),
  ),
  # Learnable per-(head, key) bias: the dK/dV kernel's per-key sums.
  "per_key_bias": (
    0.5 * jax.random.normal(jax.random.key(12), (HQ, SKV)),
    lambda p: dict(score_mod=lambda s, b, h, qi, ki: s + p[h, ki], causal=True),
  ),
  # Arrays read by key and by query position (offset) in one closure: the
  # dK/dV kernel sums one's gradient, the dQ kernel the other's.
  "positional_closure": (
    (
      0.3 * jax.random.normal(jax.random.key(13), (SKV,)),
      0.3 * jax.random.normal(jax.random.key(14), (B, SQ + 3)),
    ),
    lambda p: dict(
      score_mod=lambda s, b, h, qi, ki: s * (1 + p[1][b, qi + 3]) + p[0][ki],
      mask_mod=mods.causal_bottom_right(SQ, SKV),
    ),
  ),
  # A bias beside learnable slopes: dbias and the slopes' sums together.
  "bias_alibi": (
    (
      0.5 * jax.random.normal(jax.random.key(15), (1, HQ, SQ, SKV)),
      mods.alibi_slopes(HQ),
    ),
    lambda p: dict(bias=p[0], score_mod=mods.alibi(p[1]), causal=True),
  ),
  # The kernels skip tiles past the diagonal: dbias 0 there.
  "bias_causal": (
    0.5 * jax.random.normal(jax.random.key(10), (1, 1, SQ, SKV)),
    lambda p: dict(bias=p, causal=True),
  ),
  # A user closure: learnable per-head slope and per-head offset table
  # (on every third key: a row-wide offset would have a zero gradient),
  # a document mask and a key-length cut, with the built-in softcap.
  "user_closure": (
    (jnp.array([0.05, 0.1, 0.2, 0.3]), jnp.array([0.0, 0.5, -0.5, 1.0])),
    lambda p: dict(
      score_mod=lambda s, b, h, qi, ki: (
        s * (1 + p[0][h])
        + p[1][h] * (ki % 3 == 0)
        - 0.01 * (qi - ki).astype(s.dtype)
      ),
      mask_mod=lambda b, h, qi, ki: (_QIDS[b, qi] == _IDS[b, ki]) & (ki < 180),
      softcap=5.0,
    ),
  ),
}


def _check(impl, case, dtype=jnp.bfloat16, config=None, d=D):
  params, options = CASES[case]
  q, k, v, do = _inputs(dtype, d=d)
  golden, naive = flex_golden_and_naive(q, k, v, do, params, options)

  def f(q, k, v, params):
    return pallas_fa3.flash_attention(
      q, k, v, implementation=impl, config=config, **options(params)
    )

  out, pull = jax.vjp(f, q, k, v, params)
  got = (out,) + tuple(pull(do))
  for name, g, n, ref in zip(NAMES, got, naive, golden):
    for i, (gl, nl, rl) in enumerate(
      zip(jax.tree.leaves(g), jax.tree.leaves(n), jax.tree.leaves(ref))
    ):
      assert_within_tolerance(f"{case} {name}[{i}]", gl, nl, rl)


# One of each kind in the default run (a positional mask, vector reads, a
# score_mod with learnable arrays, a gather, a closure, a bias); the rest
# `slow`.
_GOLDEN_QUICK = {
  "causal_bottom_right", "document", "alibi", "relative_bias",
  "user_closure", "bias_batch",
}  # fmt: skip


@pytest.mark.parametrize(
  "case",
  [
    c if c in _GOLDEN_QUICK else pytest.param(c, marks=pytest.mark.slow)
    for c in sorted(CASES)
  ],
)
@pytest.mark.parametrize("impl", ["reference", "blockwise"])
def test_ready_made_and_closures_against_golden(impl, case):
  _check(impl, case, config=TILES if impl == "blockwise" else None)


@pytest.mark.parametrize("case", ["alibi", "user_closure"])
def test_float32_against_golden(case):
  _check("blockwise", case, jnp.float32, TILES)


# The Hopper kernels in interpret mode (race detection on): the functions
# traced into the forward's tile loop, into the fused backward kernel
# (masks, a score_mod without floating arrays) and into the deterministic
# dK/dV and dQ kernels (score_mod with its derivative; dbias and the
# score_mod's float arrays' gradients summed by the kernels where they can:
# by query in the dQ kernel, by key in the dK/dV kernel); the rest are the
# blockwise backward's on the kernel's residuals (said by a warning).
# The default run keeps one of each kind the dK/dV + dQ kernels take
# (learnable arrays read by batch/head beside a mask_mod's vector reads,
# arrays read by key and by position, a bias); the rest are `slow`. The
# fused kernel's kinds (`document`: a mask_mod's vector reads; `softcap`:
# a score_mod's derivative) run in the block-mask tests below, with the
# same document mask and a softcap score_mod (without a block mask: the
# same tile functions, less the tile's state, `flex_tile._with_state`).
# Each runs in the kernels: the fallback's warning is an error.
# Learnable arrays read at a computed index, or any at kv_idx - q_idx: the
# forward kernel's, the backward the blockwise twin's (said).
RELATIVE_CASES = (
  "relative_bias", "t5_bias", "relative_tables", "gathered_table",
)  # fmt: skip
_KERNEL_QUICK = {
  "bias_full",
  "gathered_mask",
  "user_closure",
  "bias_batch",
  "positional_closure",
}
KERNEL_CASES = [
  c if c in _KERNEL_QUICK else pytest.param(c, marks=pytest.mark.slow)
  for c in sorted(set(CASES) - set(RELATIVE_CASES))
]


@pytest.mark.filterwarnings("error:the sm90 backward kernels cannot")
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_interpret_kernel_against_golden(case):
  _check("interpret", case, d=64)


@pytest.mark.parametrize(
  "case",
  [
    c if c == "relative_tables" else pytest.param(c, marks=pytest.mark.slow)
    for c in RELATIVE_CASES
  ],
)
def test_interpret_relative_position_tables(case):
  """Tables read at a function of `kv_idx - q_idx` (issue 66, item 7), and
  learnable ones at a computed position: the forward kernel loads them
  (an explicit implementation raises where it cannot); their gradients
  and the rest of the backward are the blockwise twin's, said by a
  warning."""
  with pytest.warns(UserWarning, match="relative position|computed index"):
    _check("interpret", case, d=64)


@pytest.mark.slow
@pytest.mark.parametrize(
  "case",
  [
    "alibi",
    "user_closure",
    "batch_head_offset",
    "per_key_bias",
    "positional_closure",
  ],
)
def test_interpret_learnable_arrays_at_d128(case):
  """d128: the shared-tile dK/dV kernel beside the dQ kernel's sums of the
  learnable arrays' gradients, or with arrays read by key the lone
  consumer's per-key sums (the head dim split across CTAs), no fallback."""
  with warnings.catch_warnings():
    warnings.simplefilter("error", UserWarning)
    _check("interpret", case, d=128)


_SHARED_TILES = pallas_fa3.Sm90Config(
  backward=pallas_fa3.Sm90BackwardConfig(
    block_q=64, block_kv=64, num_stages=2, dkdv_consumers=2,
    dkdv_head_splits=2, dq_consumers=2, dq_head_splits=2,
  )
)  # fmt: skip


@pytest.mark.parametrize(
  "case, d",
  [
    ("bias_alibi", 128),  # d128 made shared-tile (cheaper than d192)
    pytest.param("bias_causal", 192, marks=pytest.mark.slow),
    pytest.param("batch_head_offset", 192, marks=pytest.mark.slow),
    pytest.param("bias_batch", 256, marks=pytest.mark.slow),
    pytest.param("user_closure", 256, marks=pytest.mark.slow),
    # arrays read by key: a lone dK/dV consumer beside the shared dQ one
    pytest.param("per_key_bias", 192, marks=pytest.mark.slow),
    pytest.param("positional_closure", 256, marks=pytest.mark.slow),
  ],
)
def test_interpret_shared_tile_gradients(case, d):
  """Both backward kernels' consumers sharing tiles (the d192/d256
  defaults): dbias comes from the shared dQ kernel's halves of dS (one
  staging tile each at d256), the shared dK/dV kernel reads the bias
  untransposed, and the learnable arrays' row sums are added over the two
  dQ consumers (arrays read by key: a lone dK/dV consumer beside them);
  no fallback."""
  with warnings.catch_warnings():
    warnings.simplefilter("error", UserWarning)
    _check("interpret", case, d=d, config=_SHARED_TILES if d == 128 else None)


@pytest.mark.parametrize(
  "case",
  [
    # a score_mod's arrays read by head: user_closure's too; causal in the
    # serial form: test_sm90_fwd's `serial` case
    pytest.param("alibi", marks=pytest.mark.slow),
    "user_closure",
  ],
)
def test_interpret_d256_forward_without_overlap(case):
  """d256's flex default runs each step's S, softmax and P V in turn
  (`overlap=False`: the P tile's registers free for the user's function)."""
  from pallas_fa3.kernels.sm90 import config as sm90_config
  from pallas_fa3.spec import make_spec

  params, options = CASES[case]
  q, k, v, do = _inputs(d=256)
  golden, naive = flex_golden_and_naive(q, k, v, do, params, options)
  kw = options(params)
  fspec, _ = flex.prepare(
    **{n: kw.get(n) for n in ("score_mod", "mask_mod", "block_mask", "bias")},
    batch=B, heads=HQ, seq_q=SQ, seq_kv=SKV,
  )  # fmt: skip
  spec = dataclasses.replace(make_spec(q, k, v), flex=fspec)
  assert not sm90_config.default_forward_config(spec).overlap
  out = pallas_fa3.flash_attention(
    q, k, v, implementation="interpret", **options(params)
  )
  assert_within_tolerance(f"{case} out", out, naive[0], golden[0])


@pytest.mark.parametrize(
  "case, light",
  [("softcap", True), ("alibi", True), ("sliding_window", False),
   ("document", False), ("bias", False)],
)  # fmt: skip
def test_interpret_d128_light_functions_take_128_key_tiles(case, light):
  """A function adding no registers (`flex_tile.register_light`: no bias,
  reads by batch/head alone) runs the plain d128 tiling, 64 x 128: ALiBi
  there against the float64 golden, forward and gradients."""
  from pallas_fa3.kernels.sm90 import config as sm90_config, flex_tile
  from pallas_fa3.spec import make_spec

  params, options = CASES[case]
  q, k, v, do = _inputs(d=128)
  kw = options(params)
  fspec, _ = flex.prepare(
    **{n: kw.get(n) for n in ("score_mod", "mask_mod", "block_mask", "bias")},
    batch=B, heads=HQ, seq_q=SQ, seq_kv=SKV,
  )  # fmt: skip
  spec = dataclasses.replace(make_spec(q, k, v), flex=fspec)
  assert flex_tile.register_light(spec) is light
  assert sm90_config.default_forward_config(spec).block_kv == (
    128 if light else 64
  )
  if case != "alibi":
    return
  golden, naive = flex_golden_and_naive(q, k, v, do, params, options)

  def loss(q, k, v, p):
    out = pallas_fa3.flash_attention(
      q, k, v, implementation="interpret", **options(p)
    )
    return (out.astype(jnp.float32) * do.astype(jnp.float32)).sum(), out

  grads, out = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
    q, k, v, params
  )
  for name, got, n, g in zip(NAMES, (out, *grads), naive, golden):
    assert_within_tolerance(f"{case} {name}", got, n, g)


def test_kernel_backward_says_when_it_cannot():
  q, k, v, do = _inputs(d=64)
  grad = lambda **kw: jax.vjp(
    lambda q: pallas_fa3.flash_attention(
      q, k, v, implementation="interpret", **kw
    ),
    q,
  )[1](do)
  # (What the kernels differentiate, the golden tests above run with the
  # fallback's warning as an error.)
  with pytest.warns(UserWarning, match="bias with softcap"):
    grad(bias=jnp.zeros((1, 1, SQ, SKV)), softcap=5.0)
  table = jnp.zeros((HQ // 2,))  # learnable, read at a computed index
  with pytest.warns(UserWarning, match="floating captured array 0"):
    jax.vjp(
      lambda t: pallas_fa3.flash_attention(
        q,
        k,
        v,
        score_mod=lambda s, b, h, qi, ki: s + t[h // 2],
        implementation="interpret",
      ),
      table,
    )[1](do)


@pytest.mark.parametrize(
  "state_edit",
  [pytest.param("as_built", marks=pytest.mark.slow), "odd_states", "per_head"],
)
def test_interpret_backward_with_block_masks(state_edit):
  """Gradients through the dK/dV and dQ kernels with a block mask (both
  walking only their spans; the dK/dV kernel the union of its KV head's
  query heads'), hand-edited states included."""
  q, k, v, do = _inputs(d=64)
  mask = mods.and_masks(_DOC, mods.causal_bottom_right(SQ, SKV))
  heads = None
  if state_edit == "per_head":  # a window per head: 0, 0, 1 and 2 tiles
    widths = jnp.array([8, 40, 64, 150])
    mask = lambda b, h, qi, ki: (
      (ki <= qi + SKV - SQ) & (qi + SKV - SQ - ki <= widths[h])
    )
    heads = HQ
  bm = pallas_fa3.create_block_mask(
    mask, B, heads, SQ, SKV, block_q=64, block_kv=64
  )
  if state_edit == "odd_states":
    state = bm.state.at[:, :, 1, 1].set(flex.EMPTY)
    bm = flex.BlockMask(state, None, SQ, SKV, 64, 64, mask)
  golden, naive = flex_golden_and_naive(
    q, k, v, do, (), lambda p: dict(block_mask=bm)
  )
  out, pull = jax.vjp(
    lambda q, k, v: pallas_fa3.flash_attention(
      q, k, v, block_mask=bm, implementation="interpret"
    ),
    q,
    k,
    v,
  )
  for name, g, n, ref in zip(NAMES, (out,) + pull(do), naive, golden):
    assert_within_tolerance(f"block mask {name}", g, n, ref)


def test_kernels_refuse_a_gather_and_automatic_choice_falls_back():
  q, k, v, _ = _inputs(d=64)
  table = jnp.zeros((HQ, 33))
  rel = lambda s, b, h, qi, ki: s + table[h, (qi * ki) % 33]
  with pytest.raises(NotImplementedError, match="score_mod reads a captured"):
    pallas_fa3.flash_attention(
      q, k, v, score_mod=rel, implementation="interpret"
    )
  got = pallas_fa3.flash_attention(q, k, v, score_mod=rel)
  want = pallas_fa3.flash_attention(
    q, k, v, score_mod=rel, implementation="blockwise"
  )
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with pytest.raises(NotImplementedError, match="uses `(stack|cumsum)`"):
    pallas_fa3.flash_attention(
      q, k, v, implementation="interpret",
      mask_mod=lambda b, h, qi, ki: jnp.cumsum(jnp.stack([qi, ki]))[1] > 9,
    )  # fmt: skip


def test_interpret_kernel_honors_block_mask_states():
  """Inside the producer's span an empty tile is hidden and a full one
  shows every pair, whatever the mask_mod says (the block mask rules)."""
  q, k, v, _ = _inputs(jnp.float32, d=64)
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  bm = pallas_fa3.create_block_mask(
    mods.causal_top_left, B, None, SQ, SKV, block_q=64, block_kv=64
  )
  state = bm.state.at[:, :, 1, 0].set(flex.EMPTY).at[:, :, 0, 1].set(flex.FULL)
  odd = flex.BlockMask(state, None, SQ, SKV, 64, 64, mods.causal_top_left)
  got = pallas_fa3.flash_attention(
    q, k, v, block_mask=odd, implementation="interpret"
  )
  want = pallas_fa3.flash_attention(
    q, k, v, block_mask=odd, implementation="reference"
  )
  np.testing.assert_allclose(
    np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2
  )


def test_kernel_producer_visits_the_segment_id_tiles():
  """The producer's span per CTA tile from a 16-document block mask equals
  the segment-id kernel's (`id_operands`)."""
  from pallas_fa3.kernels.sm90 import common, flex_tile
  from pallas_fa3.kernels.sm90.config import Sm90ForwardConfig

  s = 2048
  ids = jnp.asarray(np.arange(s)[None] // (s // 16), jnp.int32)
  bm = pallas_fa3.create_block_mask(mods.document_mask(ids), 1, None, s, s)
  q = jax.ShapeDtypeStruct((1, s, 1, 64), jnp.bfloat16)
  spec = pallas_fa3.spec.make_spec(q, q, q)
  fspec, ops = flex.prepare(
    score_mod=None, mask_mod=None, block_mask=bm, bias=None, batch=1,
    heads=1, seq_q=s, seq_kv=s,
  )  # fmt: skip
  spec = dataclasses.replace(spec, flex=fspec)
  cfg = Sm90ForwardConfig(64, 128, 2)
  plan = common.QueryPlan(spec, cfg, seq_q_pad=s, seq_kv_pad=s)
  spans = flex_tile.kernel_operands(
    spec, ops, q_pad=s, kv_pad=s, rows_per_cta=128, block_kv=128
  )["bm_spans"][:, :, 0]
  seg_spec = dataclasses.replace(spec, flex=None, segmented=True)
  (lo, hi, _, _), _ = pallas_fa3.segments.kernel_bounds(seg_spec, (ids, ids))
  seg = common.id_operands(plan, lo, hi)[2]
  np.testing.assert_array_equal(np.asarray(spans), np.asarray(seg))
  assert int((spans[1] - spans[0]).sum()) == 16  # one tile per CTA tile


def test_dkdv_producer_visits_the_segment_id_query_tiles():
  """The dK/dV producer's query tile span per K/V CTA from a 16-document
  block mask equals the segment-id kernel's (`dkdv_operands`), and per KV
  head it is the union of its group's query heads' spans."""
  from pallas_fa3.kernels.sm90 import common, flex_tile
  from pallas_fa3.kernels.sm90.backward_dkdv import DkdvPlan
  from pallas_fa3.kernels.sm90.config import Sm90BackwardConfig

  s = 2048
  ids = jnp.asarray(np.arange(s)[None] // (s // 16), jnp.int32)
  q = jax.ShapeDtypeStruct((1, s, 1, 64), jnp.bfloat16)
  spec = pallas_fa3.spec.make_spec(q, q, q)
  cfg = Sm90BackwardConfig(64, 64, 2, 2, 1)
  plan = DkdvPlan(spec, cfg, s, s)

  def qspans(spec, bm, heads):
    fspec, ops = flex.prepare(
      score_mod=None, mask_mod=None, block_mask=bm, bias=None, batch=1,
      heads=heads, seq_q=s, seq_kv=s,
    )  # fmt: skip
    spec = dataclasses.replace(spec, flex=fspec)
    return flex_tile.kernel_operands(
      spec, ops, q_pad=s, kv_pad=s, kv_rows_per_cta=plan.kv_rows_per_cta,
      block_q=cfg.block_q,
    )["bm_qspans"]  # fmt: skip

  bm = pallas_fa3.create_block_mask(mods.document_mask(ids), 1, None, s, s)
  spans = qspans(spec, bm, 1)[:, :, 0]
  seg_spec = dataclasses.replace(spec, segmented=True)
  bounds, _ = pallas_fa3.segments.kernel_bounds(seg_spec, (ids, ids))
  seg = common.dkdv_operands(plan, bounds)[2]
  np.testing.assert_array_equal(np.asarray(spans), np.asarray(seg))
  assert int((spans[1] - spans[0]).sum()) == 16 * 2  # 128 keys a CTA
  # Four query heads on two KV heads, a window per head: the union.
  q4 = jax.ShapeDtypeStruct((1, s, 4, 64), jnp.bfloat16)
  k2 = jax.ShapeDtypeStruct((1, s, 2, 64), jnp.bfloat16)
  spec4 = pallas_fa3.spec.make_spec(q4, k2, k2)
  widths = jnp.array([0, 256, 512, 1024])
  win = lambda b, h, qi, ki: (ki <= qi) & (qi - ki <= widths[h])
  bm4 = pallas_fa3.create_block_mask(win, 1, 4, s, s)
  got = np.asarray(qspans(spec4, bm4, 4))
  each = np.asarray(qspans(pallas_fa3.spec.make_spec(q4, q4, q4), bm4, 4))
  np.testing.assert_array_equal(
    got[0], np.minimum(each[0, :, ::2], each[0, :, 1::2])
  )
  np.testing.assert_array_equal(
    got[1], np.maximum(each[1, :, ::2], each[1, :, 1::2])
  )
  assert (got[1] - got[0] < s // 64).all()  # the windows skip tiles


def test_flex_lowers_to_the_mosaic_gpu_kernel_for_cuda():
  from jax import export

  q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
  ids = jnp.asarray(np.arange(256)[None] // 64, jnp.int32)
  bm = pallas_fa3.create_block_mask(mods.document_mask(ids), 1, None, 256, 256)
  for kw in (
    dict(score_mod=mods.alibi(mods.alibi_slopes(4)), mask_mod=_DOC4(ids)),
    dict(bias=jnp.zeros((1, 4, 256, 256), jnp.bfloat16), block_mask=bm),
    dict(score_mod=mods.t5_relative_position_bias(jnp.zeros((4, 32)))),
  ):
    f = jax.jit(
      lambda q, k, v, kw=kw: pallas_fa3.flash_attention(
        q, k, v, implementation="mosaic", **kw
      )
    )
    text = export.export(f, platforms=["cuda"])(q, k, k).mlir_module()
    assert "mosaic_gpu" in text


def _DOC4(ids):
  return mods.document_mask(ids)


def _backward_kernels(deterministic, d=64, **kw):
  """The backward kernels `jax.grad` of a flex call lowers to for CUDA."""
  from jax import export

  q = jax.ShapeDtypeStruct((1, 256, 4, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 256, 2, d), jnp.bfloat16)
  f = lambda q, k, v: (
    pallas_fa3.flash_attention(
      q, k, v, implementation="mosaic", deterministic=deterministic, **kw
    )
    .astype(jnp.float32)
    .sum()
  )
  grad = jax.jit(jax.grad(f, argnums=(0, 1, 2)))
  text = export.export(grad, platforms=["cuda"])(q, k, k).mlir_module()
  return {n for n in ("fa3_bwd_dkdv", "fa3_bwd_dq") if n in text}


def test_fused_backward_takes_masks_and_score_mods_without_arrays():
  """A mask_mod, a block mask or a score_mod without floating arrays:
  the fused kernel (no dQ kernel) unless deterministic, at d64/d96 in its
  own tiles, at d128 and d192 in its shared-tile layout (d128's own-tile
  consumer spilled with flex); a bias or a score_mod's learnable arrays:
  the dK/dV and dQ kernels."""
  ids = jnp.asarray(np.arange(256)[None] // 64, jnp.int32)
  bm = pallas_fa3.create_block_mask(mods.document_mask(ids), 1, None, 256, 256)
  fused = {"fa3_bwd_dkdv"}
  pair = {"fa3_bwd_dkdv", "fa3_bwd_dq"}
  for d, want in ((64, fused), (128, fused), (192, fused)):
    assert _backward_kernels(False, d, mask_mod=_DOC4(ids)) == want, d
  assert _backward_kernels(False, block_mask=bm, causal=True) == fused
  assert _backward_kernels(False, score_mod=mods.softcap(5.0)) == fused
  assert _backward_kernels(True, mask_mod=_DOC4(ids)) == pair
  bias = jnp.zeros((1, 4, 256, 256), jnp.bfloat16)
  assert _backward_kernels(False, bias=bias) == pair


def test_vmapped_fused_flex_backward_lowers_to_the_fused_kernel():
  """The compiled fused kernel reduce-adds dQ into an in-place ref, which
  has no vmap rule: plain calls fold a vmapped axis into the batch, flex
  calls (whose functions read the batch index) run the vmapped elements
  one after another; both lower for CUDA to the fused kernel alone."""
  from jax import export

  ids = jnp.asarray(np.arange(256)[None] // 64, jnp.int32)
  q = jax.ShapeDtypeStruct((3, 1, 256, 4, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((3, 1, 256, 2, 64), jnp.bfloat16)
  f = lambda q, k, v: (
    pallas_fa3.flash_attention(
      q, k, v, implementation="mosaic", mask_mod=_DOC4(ids)
    )
    .astype(jnp.float32)
    .sum()
  )
  grad = jax.jit(jax.vmap(jax.grad(f, argnums=(0, 1, 2))))
  text = export.export(grad, platforms=["cuda"])(q, k, k).mlir_module()
  assert "fa3_bwd_dkdv" in text and "fa3_bwd_dq" not in text


@pytest.mark.filterwarnings("error:the sm90 backward kernels cannot")
@pytest.mark.parametrize(
  "deterministic, d",
  [(False, 64), (True, 64), (False, 128)],
  ids=["fused", "det", "fused_d128_shared_tile"],
)
def test_interpret_fused_and_deterministic_flex_backward(deterministic, d):
  """A document mask_mod with a score_mod (softcap) and a block mask that
  skips tiles, through the fused kernel (own tiles at d64, the shared-tile
  layout at d128) and through the dK/dV + dQ pair, against the float64
  golden; the fused kernel's dQ slots of query tiles outside a CTA's
  block-mask span are never written (the interpreter's slab sums only the
  spans)."""
  q, k, v, do = _inputs(d=d)
  bm = pallas_fa3.create_block_mask(
    _DOC, B, None, SQ, SKV, block_q=64, block_kv=64
  )
  options = lambda p: dict(
    block_mask=bm, score_mod=mods.softcap(3.0), deterministic=deterministic
  )
  golden, naive = flex_golden_and_naive(
    q, k, v, do, (), lambda p: dict(block_mask=bm, score_mod=mods.softcap(3.0))
  )
  out, pull = jax.vjp(
    lambda q, k, v: pallas_fa3.flash_attention(
      q, k, v, implementation="interpret", **options(())
    ),
    q,
    k,
    v,
  )
  for name, g, n, ref in zip(NAMES, (out,) + pull(do), naive, golden):
    assert_within_tolerance(f"{name} deterministic={deterministic}", g, n, ref)


def test_t5_buckets_follow_the_published_formula():
  """T5's buckets (32, max distance 128), worked by hand from
  mesh-tensorflow's formula: exact below half a direction's buckets, then
  `exact + int(log(d / exact) / log(128 / exact) * (buckets - exact))`,
  capped; the later keys' direction after the earlier's."""
  table = jnp.arange(32, dtype=jnp.float32)[None]
  cases = {
    True: {0: 0, -3: 3, 3: 19, -8: 8, -16: 10, -127: 15, -1000: 15, 1000: 31},
    False: {5: 0, 0: 0, -5: 5, -16: 16, -32: 21, -200: 31},
  }
  for bidirectional, want in cases.items():
    fn = mods.t5_relative_position_bias(table, bidirectional=bidirectional)
    for rel, bucket in want.items():
      got = fn(jnp.float32(0), 0, 0, jnp.int32(0), jnp.int32(rel))
      assert int(got) == bucket, (bidirectional, rel, int(got), bucket)
  with pytest.raises(ValueError, match="num_buckets"):
    mods.t5_relative_position_bias(jnp.zeros((4,)))


def test_a_relative_table_too_large_for_its_operand_is_refused(monkeypatch):
  from pallas_fa3.kernels.sm90 import flex_tile

  monkeypatch.setattr(flex_tile, "RELATIVE_OPERAND_MAX_BYTES", 2**18)
  q, k, v, _ = _inputs(d=64)
  table = jnp.zeros((HQ, 33))
  rel = mods.relative_position_bias(table, 16)
  with pytest.raises(NotImplementedError, match="MiB at seq_q=160"):
    pallas_fa3.flash_attention(
      q, k, v, score_mod=rel, implementation="interpret"
    )


def test_explain_says_where_a_relative_table_runs():
  q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
  text = pallas_fa3.explain(
    q, q, q, implementation="mosaic",
    score_mod=mods.t5_relative_position_bias(jnp.zeros((4, 32))),
  )  # fmt: skip
  assert "forward: the sm90 forward kernel" in text
  assert "#0 at kv_idx - q_idx" in text
  # (a constant table: no gradient, so the backward kernels read it too)
  assert "backward: the fused backward kernel" in text


def test_score_mod_softcap_equals_builtin_softcap():
  q, k, v, _ = _inputs(jnp.float32)
  a = pallas_fa3.flash_attention(
    q, k, v, softcap=3.0, implementation="blockwise"
  )
  b = pallas_fa3.flash_attention(
    q, k, v, score_mod=mods.softcap(3.0), implementation="blockwise"
  )
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)


# ---------------------------------------------------------------------------
# Block masks.

_DOC = mods.document_mask(_QIDS, _IDS)


def test_create_block_mask_matches_dense_and_brute_force():
  mask = mods.and_masks(_DOC, mods.causal_bottom_right(SQ, SKV))
  bm = pallas_fa3.create_block_mask(
    mask, B, None, SQ, SKV, block_q=32, block_kv=64
  )
  b, h, qi, ki = np.meshgrid(
    np.arange(B), [0], np.arange(SQ), np.arange(SKV), indexing="ij"
  )
  dense = np.asarray(_QIDS)[b, qi] == np.asarray(_IDS)[b, ki]
  dense &= ki <= qi + SKV - SQ
  np.testing.assert_array_equal(np.asarray(bm.to_dense()), dense)
  # brute-force tile states
  for i in range(bm.state.shape[2]):
    for j in range(bm.state.shape[3]):
      t = dense[:, :, i * 32 : (i + 1) * 32, j * 64 : (j + 1) * 64]
      want = np.where(t.all(axis=(2, 3)), 2, np.where(t.any(axis=(2, 3)), 1, 0))
      np.testing.assert_array_equal(np.asarray(bm.state[:, :, i, j]), want)
  dm = pallas_fa3.BlockMask.from_dense(dense, block_q=32, block_kv=64)
  np.testing.assert_array_equal(np.asarray(dm.state), np.asarray(bm.state))
  assert bm.kv_num_blocks.shape == (B, 1, 5)
  assert int(bm.tiles_visited()) == int((np.asarray(bm.state) > 0).sum())


def test_create_block_mask_chunks_bounded(monkeypatch):
  monkeypatch.setattr(flex, "_CHUNK_ELEMENTS", 64 * 64)  # one tile a step
  bm = pallas_fa3.create_block_mask(
    _DOC, B, None, SQ, SKV, block_q=64, block_kv=64
  )
  monkeypatch.undo()
  ref = pallas_fa3.create_block_mask(
    _DOC, B, None, SQ, SKV, block_q=64, block_kv=64
  )
  np.testing.assert_array_equal(np.asarray(bm.state), np.asarray(ref.state))


def test_block_mask_equals_mask_mod_and_skips_empty_tiles():
  q, k, v, do = _inputs(jnp.float32)
  bm = jax.jit(
    lambda: pallas_fa3.create_block_mask(
      _DOC, B, None, SQ, SKV, block_q=64, block_kv=64
    )
  )()
  assert int((np.asarray(bm.state) == 0).sum()) > 0  # something to skip
  f = lambda **kw: jax.vjp(
    lambda q, k, v: pallas_fa3.flash_attention(
      q, k, v, implementation="blockwise", **kw
    ),
    q,
    k,
    v,
  )
  out_a, pull_a = f(block_mask=bm)
  out_b, pull_b = f(mask_mod=_DOC, config=TILES)
  np.testing.assert_allclose(np.asarray(out_a), np.asarray(out_b), atol=1e-6)
  for a, b in zip(pull_a(do), pull_b(do)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
  # An empty tile is never computed: marking a visible tile empty hides it.
  state = bm.state.at[:, :, 0, 0].set(flex.EMPTY)
  hidden = flex.BlockMask(state, None, SQ, SKV, 64, 64, _DOC)
  got = pallas_fa3.flash_attention(
    q, k, v, block_mask=hidden, implementation="blockwise"
  )
  want = pallas_fa3.reference_attention(
    q, k, v, mask_mod=lambda b, h, qi, ki: _DOC(b, h, qi, ki)
    & ~((qi < 64) & (ki < 64)),
  )  # fmt: skip
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_block_mask_reused_under_jit_and_scan():
  q, k, v, _ = _inputs(jnp.float32)
  bm = pallas_fa3.create_block_mask(_DOC, B, None, SQ, SKV)
  want = pallas_fa3.flash_attention(q, k, v, mask_mod=_DOC)

  @jax.jit
  def layers(q, bm):
    def layer(x, _):
      return pallas_fa3.flash_attention(x, k, v, block_mask=bm), None

    return jax.lax.scan(layer, q, None, length=2)[0]

  got = layers(q, bm)
  want2 = pallas_fa3.flash_attention(want, k, v, mask_mod=_DOC)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want2), atol=1e-5)


def test_tiles_visited_equal_segment_id_and_window_skipping():
  """A block mask visits the tiles today's segment-id / window skipping
  does (full and partial together), for 16 documents and a window."""
  from pallas_fa3 import masking, segments

  s = 1024
  lengths = np.full(16, s // 16)
  ids = jnp.asarray(np.repeat(np.arange(16), lengths)[None], jnp.int32)
  bm = pallas_fa3.create_block_mask(
    mods.document_mask(ids), 1, None, s, s, block_q=64, block_kv=64
  )
  spans = segments.kv_tile_spans(segments.SegmentIds(ids, ids), 64, 64)
  spec = pallas_fa3.AttentionSpec(
    1, s, s, 1, 1, 64, 64, jnp.bfloat16, False, 1.0
  )
  walked = sum(
    int(e - f)
    for i in range(s // 64)
    for f, e in [
      pallas_fa3.backends.blockwise.tiles.clip_range(
        masking.kv_block_range(spec, i * 64, (i + 1) * 64, 64, s // 64),
        spans,
        i,
      )[:2]
    ]
  )
  assert int(bm.tiles_visited()) == walked == 16 * 1
  window = pallas_fa3.create_block_mask(
    mods.sliding_window(100, 0), None, None, s, s, block_q=64, block_kv=64
  )
  wspec = pallas_fa3.AttentionSpec(
    1, s, s, 1, 1, 64, 64, jnp.bfloat16, True, 1.0, window_size=(100, None)
  )
  wwalked = sum(
    int(e - f)
    for i in range(s // 64)
    for f, e, *_ in [
      masking.kv_block_range(wspec, i * 64, (i + 1) * 64, 64, s // 64)
    ]
  )
  assert int(window.tiles_visited()) == wwalked


# ---------------------------------------------------------------------------
# Bad input.


def test_bad_functions_and_masks_name_the_argument():
  q, k, v, _ = _inputs()
  call = lambda **kw: pallas_fa3.flash_attention(
    q, k, v, implementation="blockwise", **kw
  )
  with pytest.raises(TypeError, match="mask_mod must return one bool"):
    call(mask_mod=lambda b, h, qi, ki: qi - ki)
  with pytest.raises(TypeError, match="mask_mod must return one bool"):
    call(mask_mod=lambda b, h, qi, ki: jnp.stack([qi >= ki, qi >= ki]))
  with pytest.raises(TypeError, match="score_mod must return a score"):
    call(score_mod=lambda s, b, h, qi, ki: s.astype(jnp.bfloat16))
  with pytest.raises(TypeError, match="score_mod must return a score"):
    call(score_mod=lambda s, b, h, qi, ki: jnp.stack([s, s]))
  with pytest.raises(TypeError, match="score_mod must be a function"):
    call(score_mod=lambda s: s)
  with pytest.raises(TypeError, match="mask_mod must be a callable"):
    call(mask_mod=3)
  bm = pallas_fa3.create_block_mask(mods.causal_top_left, None, None, 64, 64)
  with pytest.raises(ValueError, match="block_mask was built for"):
    call(block_mask=bm)
  with pytest.raises(
    TypeError, match="block_mask must be a pallas_fa3.BlockMask"
  ):
    call(block_mask=np.ones((1, 1, SQ, SKV), bool))
  with pytest.raises(ValueError, match="bias must have shape"):
    call(bias=jnp.zeros((B, HQ, SQ, SKV - 1)))
  with pytest.raises(ValueError, match="bias must have shape"):
    call(bias=jnp.zeros((3, HQ, SQ, SKV)))
  with pytest.raises(TypeError, match="bias must be a floating"):
    call(bias=jnp.zeros((1, 1, SQ, SKV), jnp.int32))
  with pytest.raises(NotImplementedError, match="fp8 is not implemented"):
    call(fp8=True, bias=jnp.zeros((1, 1, SQ, SKV)))


# ---------------------------------------------------------------------------
# Decoding: score_mod / mask_mod / block_mask at sequence positions.

CAP, DSQ = 96, 3
_DIDS = jnp.asarray(np.repeat(np.arange(4), 24)[None].repeat(B, 0), jnp.int32)


def _decode_mask(b, h, qi, ki):
  return _DIDS[b, qi] == _DIDS[b, ki]


def _decode_golden(q, kc, vc, lens, mask_mod, score_mod):
  """Each sequence through the float64 reference prefill over its own
  keys, the user functions shifted to the queries' sequence positions."""
  outs = []
  with jax.enable_x64(True):
    for b in range(q.shape[0]):
      n, off = int(lens[b]), int(lens[b]) - DSQ
      f64 = lambda x: jnp.asarray(x[b : b + 1], jnp.float32)
      outs.append(
        np.asarray(
          pallas_fa3.reference_attention(
            f64(q), f64(kc)[:, :n], f64(vc)[:, :n], causal=True,
            mask_mod=lambda bb, h, qi, ki: mask_mod(bb + b, h, qi + off, ki),
            score_mod=lambda s, bb, h, qi, ki: score_mod(
              s, bb + b, h, qi + off, ki
            ),
            intermediate_dtype=jnp.float64,
          ),
          np.float64,
        )
      )  # fmt: skip
  return np.concatenate(outs)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("impl", ["reference", "blockwise"])
def test_decode_with_mask_and_score_mod(impl, paged):
  ks = jax.random.split(jax.random.key(3), 4)
  q = jax.random.normal(ks[0], (B, DSQ, HQ, D), jnp.float32)
  kc = jax.random.normal(ks[1], (B, CAP, HK, D), jnp.float32)
  vc = jax.random.normal(ks[2], (B, CAP, HK, D), jnp.float32)
  lens = jnp.array([50, 96], jnp.int32)
  score_mod = mods.alibi(mods.alibi_slopes(HQ))
  want = _decode_golden(q, kc, vc, lens, _decode_mask, score_mod)
  kw = dict(causal=True, score_mod=score_mod, implementation=impl)
  if impl == "blockwise":
    kw["config"] = pallas_fa3.BlockwiseConfig(block_kv=32)
  if paged:  # pages of 16 in a shuffled order
    order = np.random.default_rng(0).permutation(B * CAP // 16)
    table = jnp.asarray(order.reshape(B, CAP // 16), jnp.int32)
    to_pages = lambda c: (
      jnp.zeros((B * CAP // 16, 16, HK, D))
      .at[table.reshape(-1)]
      .set(c.reshape(B * CAP // 16, 16, HK, D))
    )
    kc_, vc_, kw["page_table"] = to_pages(kc), to_pages(vc), table
  else:
    kc_, vc_ = kc, vc
  got = pallas_fa3.flash_attention_with_kvcache(
    q, kc_, vc_, cache_seqlens=lens, mask_mod=_decode_mask, **kw
  )
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)
  # A block mask over sequence positions gives the same rows.
  bm = pallas_fa3.create_block_mask(_decode_mask, B, None, CAP, CAP)
  got_bm = pallas_fa3.flash_attention_with_kvcache(
    q, kc_, vc_, cache_seqlens=lens, block_mask=bm, **kw
  )
  np.testing.assert_allclose(np.asarray(got_bm), want, atol=2e-6)


def test_decode_flex_kernel_refuses_and_automatic_choice_falls_back():
  """Where the decode kernel cannot serve a flex call (here its head dim:
  the kernel's flex tests are tests/test_flex_decode_kernel.py) it says
  why, and the automatic choice runs blockwise."""
  q = jnp.ones((1, 1, HQ, D), jnp.bfloat16)
  kc = jnp.ones((1, 64, HK, D), jnp.bfloat16)
  call = lambda **kw: pallas_fa3.flash_attention_with_kvcache(
    q, kc, kc, cache_seqlens=10, mask_mod=mods.causal_top_left, **kw
  )
  with pytest.raises(NotImplementedError, match=f"head_dim {D} is not one"):
    call(implementation="interpret")
  np.testing.assert_array_equal(
    np.asarray(call()), np.asarray(call(implementation="blockwise"))
  )
  bm = pallas_fa3.create_block_mask(mods.causal_top_left, None, None, 32, 32)
  with pytest.raises(ValueError, match="block_mask was built for"):
    pallas_fa3.flash_attention_with_kvcache(
      q, kc, kc, cache_seqlens=10, block_mask=bm
    )
