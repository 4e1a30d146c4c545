"""Packed sequences and padding in the Flax integration: the native layers'
`segment_ids`, and `make_attention_fn` turning padding/segment masks into ids.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx
from flax_checks import (
  BIAS_INIT,
  assert_layer_within_tolerance,
  flat,
  linen_forward_and_grads,
  normal,
  random_layer_inputs,
)

import pallas_fa3
from pallas_fa3 import segments
from pallas_fa3.flax import (
  FlashMultiHeadAttention,
  FlashMultiHeadDotProductAttention,
  adapter_masks as mask_segments,
  apply_rope,
  make_attention_fn,
)
from pallas_fa3.testing import assert_within_tolerance

_FEATURES, _HEADS, _KV_HEADS, _BATCH, _SEQ = 32, 4, 2, 2, 12
# Row 0: three documents and padding; row 1: two documents.
_DOCS = np.array(
  [
    [0, 0, 0, 1, 1, 1, 1, 2, 2, -1, -1, -1],
    [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1],
  ],
  np.int32,
)
_PAD_Q = np.where(_DOCS < 0, -1, _DOCS).astype(np.int32)
_PAD_KV = np.where(_DOCS < 0, -2, _DOCS).astype(np.int32)


def _nnx_layer(rng, **options):
  layer = FlashMultiHeadAttention(
    _HEADS,
    _FEATURES,
    num_kv_heads=_KV_HEADS,
    rngs=nnx.Rngs(int(rng.integers(2**30))),
    **options,
  )
  # Non-zero biases, so that every projection shows in the output.
  for name in ("query", "key", "value", "out"):
    bias = getattr(layer, name).bias
    if bias is not None:
      bias[...] = normal(rng, bias.shape)
  return layer


# ---------------------------------------------------------------------------
# Native layers: segment_ids at call time.


@pytest.mark.parametrize(
  "form", ["SegmentIds", "tuple", "one array"], ids=lambda f: f
)
def test_nnx_layer_with_segment_ids_is_attention_of_its_projections(rng, form):
  layer = _nnx_layer(rng, causal=True, rope=True)
  x = normal(rng, (_BATCH, _SEQ, _FEATURES))
  ids = {
    "SegmentIds": pallas_fa3.SegmentIds(_PAD_Q, _PAD_KV),
    "tuple": (jnp.asarray(_PAD_Q), jnp.asarray(_PAD_KV)),
    "one array": jnp.asarray(_DOCS),
  }[form]
  both = ids if isinstance(ids, tuple) else (ids, ids)
  positions = pallas_fa3.segment_positions(jnp.asarray(_DOCS))
  got = layer(x, segment_ids=ids, positions=positions)
  q = apply_rope(layer.query(x), positions)
  k = apply_rope(layer.key(x), positions)
  v = layer.value(x)
  kw = dict(causal=True, segment_ids=both)
  np.testing.assert_array_equal(
    got, layer.out(pallas_fa3.flash_attention(q, k, v, **kw))
  )
  want = layer.out(pallas_fa3.reference_attention(q, k, v, **kw))
  assert_within_tolerance("out", got, want, want)
  # The ids change the function.
  plain = layer(x, positions=positions)
  assert float(jnp.max(jnp.abs(plain - got))) > 1e-3


def test_linen_layer_with_segment_ids_is_attention_of_its_projections(rng):
  module = FlashMultiHeadDotProductAttention(
    num_heads=_HEADS, num_kv_heads=_KV_HEADS, causal=True
  )
  x = normal(rng, (_BATCH, _SEQ, _FEATURES))
  ids = pallas_fa3.SegmentIds(jnp.asarray(_PAD_Q), jnp.asarray(_PAD_KV))
  params = module.init(jax.random.key(0), x, segment_ids=ids)
  params = jax.tree.map(lambda p: p + 0.5 * normal(rng, p.shape), params)
  got = jax.jit(lambda p, x, ids: module.apply(p, x, segment_ids=ids))(
    params, x, ids
  )
  p = params["params"]
  hi = jax.lax.Precision.HIGHEST
  q, k, v = (
    jnp.einsum("bsf,fhd->bshd", x, p[name]["kernel"], precision=hi)
    + p[name]["bias"]
    for name in ("query", "key", "value")
  )
  o = pallas_fa3.reference_attention(q, k, v, causal=True, segment_ids=ids)
  want = (
    jnp.einsum("bshd,hdf->bsf", o, p["out"]["kernel"], precision=hi)
    + p["out"]["bias"]
  )
  assert_within_tolerance("out", got, want, want)


def test_padding_rows_are_zero_and_gradients_finite(rng):
  layer = _nnx_layer(rng, causal=True, use_bias=False)
  x = normal(rng, (_BATCH, _SEQ, _FEATURES))
  ids = pallas_fa3.SegmentIds(jnp.asarray(_PAD_Q), jnp.asarray(_PAD_KV))

  @nnx.jit
  def run(layer, x):
    def loss(m, x):
      y = m(x, segment_ids=ids)
      return jnp.sum(y**2), y

    return nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(layer, x)

  (_, y), (g_layer, g_x) = run(layer, x)
  pad = _DOCS < 0
  np.testing.assert_array_equal(y[pad], 0.0)
  assert float(jnp.max(jnp.abs(y[~pad]))) > 0
  for g in jax.tree.leaves(g_layer) + [g_x]:
    assert bool(jnp.all(jnp.isfinite(g)))
  np.testing.assert_array_equal(g_x[pad], 0.0)  # padding affects nothing


def test_ids_broadcast_over_extra_batch_axes(rng):
  layer = _nnx_layer(rng)
  x = normal(rng, (3, _BATCH, _SEQ, _FEATURES))
  ids = jnp.asarray(_DOCS[1])  # [seq]: the same for every batch entry
  got = layer(x, segment_ids=ids)
  want = layer(
    x.reshape(-1, _SEQ, _FEATURES), segment_ids=jnp.tile(ids, (6, 1))
  )
  np.testing.assert_allclose(got.reshape(want.shape), want, rtol=0, atol=0)


@pytest.mark.parametrize(
  "ids, error, match",
  [
    (np.zeros((_BATCH, _SEQ), np.float32), TypeError, "segment_ids.q"),
    (np.zeros((_BATCH, _SEQ + 1), np.int32), ValueError, "segment_ids.q"),
    ((np.zeros((_BATCH, _SEQ), np.int32),) * 3, TypeError, "segment_ids"),
    (
      (np.zeros((_BATCH, _SEQ), np.int32), np.zeros((3, _SEQ), np.int32)),
      ValueError,
      "segment_ids.kv",
    ),
  ],
)
def test_bad_segment_ids_raise_naming_them(rng, ids, error, match):
  layer = _nnx_layer(rng)
  x = normal(rng, (_BATCH, _SEQ, _FEATURES))
  with pytest.raises(error, match=match):
    layer(x, segment_ids=ids)


def test_one_array_needs_equal_lengths(rng):
  layer = _nnx_layer(rng)
  x = normal(rng, (_BATCH, _SEQ, _FEATURES))
  with pytest.raises(ValueError, match="seq_q == seq_kv"):
    layer(x, x[:, :5], segment_ids=np.zeros((_BATCH, _SEQ), np.int32))


# ---------------------------------------------------------------------------
# make_attention_fn: padding and segment masks.


def _qkv(rng, seq_kv=_SEQ):
  q = normal(rng, (_BATCH, _SEQ, _HEADS, 8))
  k = normal(rng, (_BATCH, seq_kv, _KV_HEADS, 8))
  v = normal(rng, (_BATCH, seq_kv, _KV_HEADS, 8))
  return q, k, v


def _valid(lengths, seq):
  return jnp.arange(seq)[None, :] < jnp.asarray(lengths)[:, None]


def _assert_like_flax(got, want, valid_q):
  """Equal to Flax's attention on every row: those that see no key (the
  padded queries, `~valid_q`) give Flax's mean of the values, not 0."""
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # The empty rows are really there (the comparison covers them).
  assert not np.asarray(valid_q).all()


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("seq_kv", [_SEQ, 8])
def test_lengths_padding_mask_is_recognised(rng, is_causal, seq_kv):
  q, k, v = _qkv(rng, seq_kv)
  q_valid, kv_valid = _valid([9, _SEQ], _SEQ), _valid([6, seq_kv], seq_kv)
  mask = nnx.make_attention_mask(q_valid, kv_valid)  # float 0/1 [b,1,s,s]
  got = make_attention_fn()(q, k, v, mask=mask, is_causal=is_causal)
  want = nnx.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal)
  _assert_like_flax(got, want, q_valid)


def test_padding_combined_with_the_causal_mask_is_recognised(rng):
  q, k, v = _qkv(rng)
  valid = _valid([7, 10], _SEQ)
  mask = nnx.combine_masks(
    nnx.make_attention_mask(valid, valid),
    nnx.make_causal_mask(jnp.ones((_BATCH, _SEQ))),
  )
  for fn in (make_attention_fn(), make_attention_fn(causal=True)):
    got = fn(q, k, v, mask=mask)
    _assert_like_flax(got, nnx.dot_product_attention(q, k, v, mask=mask), valid)


def test_segment_mask_is_recognised(rng):
  q, k, v = _qkv(rng)
  seg = jnp.asarray(_DOCS)
  mask = nnx.make_attention_mask(seg, seg, jnp.equal)
  for is_causal in (False, True):
    got = make_attention_fn()(q, k, v, mask=mask, is_causal=is_causal)
    want = nnx.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_mask_ids_rebuild_the_mask():
  seg = np.array([[0, 0, 1, 1, 0, 2, -1]])  # not sorted: a 0 comes back
  visible = seg[:, :, None] == seg[:, None, :]
  for causal in (False, True):
    target = visible & np.tril(np.ones((7, 7), bool)) if causal else visible
    q_ids, kv_ids = mask_segments.segment_ids_of(target, causal)
    rebuilt = q_ids[:, :, None] == kv_ids[:, None, :]
    if causal:
      rebuilt &= np.tril(np.ones((7, 7), bool))
    np.testing.assert_array_equal(rebuilt, target)
  padding = mask_segments.padding_ids(
    np.outer([1, 1, 0], [1, 0, 0]).astype(bool)[None], causal=False
  )
  assert [x.tolist() for x in padding] == [[[0, 0, -1]], [[0, -2, -2]]]


_OTHER_MASKS = {
  # Every row sees keys, but no ids give it (one connected component).
  "arbitrary": (np.arange(_SEQ)[:, None] + np.arange(_SEQ)[None, :]) % 3 != 0,
  # A padding mask that differs between heads: ids are per batch entry.
  "per-head": np.stack(
    [np.ones((_SEQ, _SEQ), bool), np.tri(_SEQ, dtype=bool)] * 2
  )[None],
}


@pytest.mark.parametrize("name", sorted(_OTHER_MASKS))
def test_other_masks_run_as_dense_masks(rng, name):
  """A concrete mask no segment ids give runs as a dense mask (blockwise,
  the kernels' twin), with Flax's numbers: no fallback, nothing raised."""
  q, k, v = _qkv(rng)
  mask = _OTHER_MASKS[name]
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    got = make_attention_fn()(q, k, v, mask=mask)
  np.testing.assert_allclose(
    got, nnx.dot_product_attention(q, k, v, mask=mask), rtol=1e-5, atol=1e-5
  )


def test_other_mask_asked_of_the_kernels_says_where_it_runs(rng):
  q, k, v = _qkv(rng)
  mask = _OTHER_MASKS["arbitrary"]
  with pytest.warns(UserWarning, match="runs in 'blockwise'"):
    got = make_attention_fn("interpret")(q, k, v, mask=mask)
  np.testing.assert_allclose(
    got, nnx.dot_product_attention(q, k, v, mask=mask), rtol=1e-5, atol=1e-5
  )


def test_declared_causal_refuses_a_mask_above_the_diagonal(rng):
  q, k, v = _qkv(rng)
  valid = _valid([7, 10], _SEQ)
  mask = nnx.make_attention_mask(valid, valid)
  with pytest.raises(ValueError, match="padding_mask=True"):
    make_attention_fn(causal=True)(q, k, v, mask=mask)
  # Declared as a padding mask too, it is intersected with the causal mask.
  got = make_attention_fn(causal=True, padding_mask=True)(q, k, v, mask=mask)
  want = nnx.dot_product_attention(q, k, v, mask=mask, is_causal=True)
  _assert_like_flax(got, want, valid)


# ---------------------------------------------------------------------------
# make_attention_fn(padding_mask=True): traced padding masks.


@pytest.mark.parametrize("causal", [False, True])
def test_declared_padding_traced_mask(rng, causal):
  q, k, v = _qkv(rng)
  valid = _valid([5, 11], _SEQ)
  mask = nnx.make_attention_mask(valid, valid)
  fn = make_attention_fn(padding_mask=True, causal=causal)
  run = jax.jit(lambda m: fn(q, k, v, mask=m))
  want = nnx.dot_product_attention(q, k, v, mask=mask, is_causal=causal)
  _assert_like_flax(run(mask), want, valid)
  # A traced mask that breaks the promise cannot raise: the output is NaN.
  seg = jnp.asarray(_DOCS)
  broken = nnx.make_attention_mask(seg, seg, jnp.equal)
  assert bool(jnp.all(jnp.isnan(run(broken))))


def test_flax_layer_with_a_traced_padding_mask(rng):
  """nnx.MultiHeadAttention + make_attention_fn(padding_mask=True) under
  nnx.jit, vs the same layer with Flax's attention (padded rows too)."""
  seed = int(rng.integers(2**30))
  layers = [
    nnx.MultiHeadAttention(
      _HEADS,
      _FEATURES,
      decode=False,
      rngs=nnx.Rngs(seed),
      **({"attention_fn": fn} if fn else {}),
    )
    for fn in (make_attention_fn(padding_mask=True), None)
  ]
  x = normal(rng, (_BATCH, _SEQ, _FEATURES))
  valid = _valid([4, _SEQ], _SEQ)
  mask = nnx.make_attention_mask(valid, valid)
  run = nnx.jit(lambda m, x, mask: m(x, mask=mask))
  got, want = (run(layer, x, mask) for layer in layers)
  _assert_like_flax(got, want, valid)


def test_padding_mask_option_is_checked():
  with pytest.raises(TypeError, match="padding_mask"):
    make_attention_fn(padding_mask=1)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    make_attention_fn(padding_mask=False)


# ---------------------------------------------------------------------------
# Traced masks with nothing declared: padding (segment ids, the kernels) or
# not (the dense mask, blockwise), decided on the device as
# pallas_fa3.dot_product_attention decides (`segments.padding_or_dense`).


def _branches_taken(monkeypatch) -> list:
  """Which side of the adapter's device-side choice ran ("padding" or
  "dense"), recorded on the device as the calls run."""
  taken, choose = [], segments.padding_or_dense

  def spy(mask, operands, *, padded, dense, **kw):
    def tell(name, branch):
      def f(*args):
        jax.debug.callback(lambda: taken.append(name))
        return branch(*args)

      return f

    return choose(
      mask,
      operands,
      padded=tell("padding", padded),
      dense=tell("dense", dense),
      **kw,
    )

  monkeypatch.setattr(segments, "padding_or_dense", spy)
  return taken


def _nnx_forward_and_grads(layer, x, cotangent, mask):
  """`flax_checks.nnx_forward_and_grads` with the mask an argument of the
  jitted function (a tracer, as in a training step)."""

  @nnx.jit
  def run(layer, x, cotangent, mask):
    def loss(m):
      y = m(x, mask=mask)
      return jnp.sum(y.astype(jnp.float32) * cotangent), y

    (_, y), grads = nnx.value_and_grad(loss, has_aux=True)(layer)
    return y, grads

  y, grads = run(layer, x, cotangent, mask)
  return y, flat(grads)


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_flax_default_call_with_a_traced_padding_mask(rng, api, monkeypatch):
  """Flax's layer with `attention_fn=make_attention_fn()` (nothing
  declared) and a padding mask from `make_attention_mask`, under jit:
  output and parameter gradients within the tolerance rule of Flax's own
  layer (float32: at the rule's floor), through the segment-id side of
  the choice."""
  dtype = jnp.float32
  x, x32, ct = random_layer_inputs(rng, (_BATCH, _SEQ), _FEATURES, dtype)
  valid = _valid([7, _SEQ], _SEQ)
  seed = int(rng.integers(2**30))
  taken = _branches_taken(monkeypatch)
  if api == "nnx":
    mask = nnx.make_attention_mask(valid, valid)

    def run(dtype, x, **kw):
      layer = nnx.MultiHeadAttention(
        _HEADS,
        _FEATURES,
        dtype=dtype,
        decode=False,
        bias_init=BIAS_INIT,
        rngs=nnx.Rngs(seed),
        **kw,
      )
      return _nnx_forward_and_grads(layer, x, ct, mask)

  else:
    mask = linen.make_attention_mask(valid, valid)
    module = lambda dtype, **kw: linen.MultiHeadDotProductAttention(
      num_heads=_HEADS, dtype=dtype, bias_init=BIAS_INIT, **kw
    )
    params = module(None).init(jax.random.key(seed), x32)

    def run(dtype, x, **kw):
      return linen_forward_and_grads(
        module(dtype, **kw), params, x, ct, {"mask": mask}
      )

  got = run(dtype, x, attention_fn=make_attention_fn())
  assert taken == ["padding"], taken
  golden = run(None, x32)
  assert_layer_within_tolerance(got, golden, golden, dtype)
  # The padded queries are there, and give Flax's mean of the values.
  assert not np.asarray(valid).all()


_TRACED = {
  # name: (the mask, is_causal, seq_kv)
  "padding": (lambda: nnx.make_attention_mask(*_lengths_valid(8)), False, 8),
  "padding-causal": (
    lambda: nnx.make_attention_mask(*_lengths_valid(_SEQ)),
    True,
    _SEQ,
  ),
  "segments": (
    lambda: nnx.make_attention_mask(_DOCS, _DOCS, jnp.equal),
    False,
    _SEQ,
  ),
  "segments-causal": (
    lambda: nnx.make_attention_mask(_DOCS, _DOCS, jnp.equal),
    True,
    _SEQ,
  ),
  "arbitrary": (lambda: _OTHER_MASKS["arbitrary"], False, _SEQ),
  "per-head": (lambda: _OTHER_MASKS["per-head"], False, _SEQ),
}


def _lengths_valid(seq_kv):
  return _valid([9, _SEQ], _SEQ), _valid([6, seq_kv], seq_kv)


@pytest.mark.parametrize("name", sorted(_TRACED))
def test_traced_mask_is_decided_on_the_device(rng, name, monkeypatch):
  """Any traced mask, nothing declared: Flax's numbers (float32, rows that
  see no key included), by the segment ids where it is a padding mask and
  by the dense mask otherwise."""
  make, is_causal, seq_kv = _TRACED[name]
  q, k, v = _qkv(rng, seq_kv)
  mask = make()
  taken = _branches_taken(monkeypatch)
  fn = make_attention_fn()
  got = jax.jit(lambda m: fn(q, k, v, mask=m, is_causal=is_causal))(mask)
  assert taken == ["padding" if name.startswith("padding") else "dense"]
  want = nnx.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_traced_mask_gradients_on_both_sides(rng):
  """Gradients of q, k, v through the choice, both sides, vs Flax's."""
  q, k, v = _qkv(rng)
  valid = _valid([7, 10], _SEQ)
  masks = (
    nnx.make_attention_mask(valid, valid),
    nnx.make_attention_mask(_DOCS, _DOCS, jnp.equal),
  )
  for mask in masks:
    grads = [
      jax.jit(
        jax.grad(
          lambda q, k, v, m: jnp.sum(fn(q, k, v, mask=m) ** 2),
          argnums=(0, 1, 2),
        )
      )(q, k, v, mask)
      for fn in (make_attention_fn(), nnx.dot_product_attention)
    ]
    for got, want in zip(*grads):
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_traced_mask_asked_of_the_kernels_says_so(rng):
  """A kernel backend named: the warning says that other masks run in
  blockwise (the program holds both sides; traced only here)."""
  q = normal(rng, (_BATCH, _SEQ, _HEADS, 64), jnp.bfloat16)
  k, v = (
    normal(rng, (_BATCH, _SEQ, _KV_HEADS, 64), jnp.bfloat16) for _ in "kv"
  )
  valid = _valid([5, 11], _SEQ)
  mask = nnx.make_attention_mask(valid, valid)
  fn = make_attention_fn("interpret")
  with pytest.warns(UserWarning, match="checked on the device"):
    out = jax.eval_shape(lambda m: fn(q, k, v, mask=m), mask)
  assert out.shape == q.shape


def test_declared_padding_mask_makes_no_choice(rng, monkeypatch):
  """`padding_mask=True` keeps its promise semantics: only the segment-id
  route is in the program (no choice on the device)."""
  q, k, v = _qkv(rng)
  valid = _valid([5, 11], _SEQ)
  mask = nnx.make_attention_mask(valid, valid)

  def refuse(*args, **kwargs):
    raise AssertionError("padding_mask=True made a choice on the device")

  monkeypatch.setattr(segments, "padding_or_dense", refuse)
  fn = make_attention_fn(padding_mask=True)
  got = jax.jit(lambda m: fn(q, k, v, mask=m))(mask)
  _assert_like_flax(got, nnx.dot_product_attention(q, k, v, mask=mask), valid)


def test_interpret_under_vmap_says_why_and_what_serves_it(rng):
  """`"interpret"` under jax.vmap with a traced mask: the choice is a cond,
  which cannot vmap the interpreter's effects; the error names the call
  and padding_mask=True, which makes no choice and runs (traced only)."""
  x = jax.ShapeDtypeStruct((3, _BATCH, 64, 2, 64), jnp.bfloat16)
  valid = _valid([50, 64], 64)
  mask = nnx.make_attention_mask(valid, valid)

  def shape_of(fn):
    attend = lambda q, m: fn(q, q, q, mask=m)
    return jax.eval_shape(jax.vmap(attend, in_axes=(0, None)), x, mask)

  with pytest.warns(UserWarning, match="checked on the device"):
    with pytest.raises(NotImplementedError, match="padding_mask=True"):
      shape_of(make_attention_fn("interpret"))
  assert shape_of(make_attention_fn("interpret", padding_mask=True)).shape == (
    x.shape
  )
