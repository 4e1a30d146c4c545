"""`pallas_fa3.dot_product_attention` against
`jax.nn.dot_product_attention(implementation="xla")` on jax.nn's own
argument grid (bias and boolean masks of every broadcast shape, is_causal
with T != S, sequence lengths, local windows, GQA, rank 3), outputs,
residuals and gradients, in float32; jax.nn's errors; the jax.nn names.
"""

from __future__ import annotations

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa3
from pallas_fa3 import segments
from pallas_fa3.backends import sm90
from pallas_fa3.testing import (
  Shape,
  assert_within_tolerance,
  golden_and_naive,
  lowered_kernel_count,
  random_inputs,
  run_interpreted,
)

B, T, S, N, K, H = 2, 48, 80, 4, 2, 16


def _inputs(t=T, s=S, n=N, k=K, seed=0):
  ks = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(ks[0], (B, t, n, H), jnp.float32)
  kk = jax.random.normal(ks[1], (B, s, k, H), jnp.float32)
  v = jax.random.normal(ks[2], (B, s, k, H), jnp.float32)
  do = jax.random.normal(ks[3], (B, t, n, H), jnp.float32)
  return q, kk, v, do, ks[4], ks[5]


def _both(q, k, v, do, impl="blockwise", **kw):
  """(ours, jax.nn's) outputs and gradients for q, k, v (and bias)."""
  bias = kw.pop("bias", None)

  def run(fn, **extra):
    def f(q, k, v, bias):
      return fn(q, k, v, bias, **kw, **extra)

    out, pull = jax.vjp(f, q, k, v, bias)
    return (out,) + pull(do)

  ours = run(pallas_fa3.dot_product_attention, implementation=impl)
  theirs = run(jax.nn.dot_product_attention, implementation="xla")
  return ours, theirs


def _close(ours, theirs, atol=2e-5):
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol)


GRID = {
  "plain": {},
  "causal_T_ne_S": dict(is_causal=True),
  "causal_T_eq_S": dict(is_causal=True, _t=S),
  "window_T_ne_S": dict(local_window_size=(10, 3)),
  "window_int_causal": dict(local_window_size=7, is_causal=True, _t=S),
  "kv_lengths": dict(key_value_seq_lengths=jnp.array([80, 33], jnp.int32)),
  "q_lengths_causal": dict(
    query_seq_lengths=jnp.array([20, 48], jnp.int32), is_causal=True
  ),
  "both_lengths_window": dict(
    query_seq_lengths=jnp.array([48, 9], jnp.int32),
    key_value_seq_lengths=jnp.array([50, 80], jnp.int32),
    local_window_size=(30, 30),
  ),
  "mha": dict(_k=N),
  "mqa_causal": dict(_k=1, is_causal=True),
}


@pytest.mark.parametrize("case", sorted(GRID))
def test_grid_matches_jax_nn(case):
  kw = dict(GRID[case])
  t, k = kw.pop("_t", T), kw.pop("_k", K)
  q, kk, v, do, _, _ = _inputs(t=t, k=k)
  _close(*_both(q, kk, v, do, **kw))


# Dense masks that are padding after all (the segment-id branch of the
# device-side choice), beside the other options, at seq_q != seq_kv.
DENSE_PADDING = {
  "window_kv_lengths_bias": dict(
    local_window_size=(10, 3),
    key_value_seq_lengths=jnp.array([70, 33], jnp.int32),
    _bias=True,
  ),
  "causal_tril_q_lengths": dict(
    is_causal=True, query_seq_lengths=jnp.array([40, 48], jnp.int32), _tril=True
  ),
  "per_head_mqa": dict(_heads=True, _k=1),
}


@pytest.mark.parametrize("case", sorted(DENSE_PADDING))
def test_dense_padding_masks_match_jax_nn(case):
  """jax.nn's results and gradients (float32) for a dense `(B|1, N|1, T,
  S)` mask built as `q_valid & kv_valid`, which takes the segment-id
  branch (`segments.padding_of_mask` says exact)."""
  kw = dict(DENSE_PADDING[case])
  q, k, v, do, kb, _ = _inputs(k=kw.pop("_k", K))
  q_ok = jnp.arange(T)[None] < jnp.array([[40], [T]])
  kv_ok = jnp.arange(S)[None] >= jnp.array([[5], [0]])
  mask = q_ok[:, None, :, None] & kv_ok[:, None, None, :]
  if kw.pop("_tril", False):
    mask = mask & jnp.tril(jnp.ones((T, S), bool))
  if kw.pop("_heads", False):
    mask = jnp.broadcast_to(mask, (B, N, T, S))
  if kw.pop("_bias", False):
    kw["bias"] = jax.random.normal(kb, (1, N, T, S), jnp.float32)
  causal = kw.get("is_causal", False)
  assert bool(segments.padding_of_mask(mask, causal)[2])
  _close(*_both(q, k, v, do, mask=mask, **kw))


# Every broadcast shape of jax.nn's (B, N, T, S) bias and mask (four of
# them `slow`: the default run keeps one per kind of broadcast).
_slow = lambda s: pytest.param(s, marks=pytest.mark.slow)
SHAPES = [
  (B, N, T, S),
  _slow((1, N, T, S)),
  _slow((B, 1, T, S)),
  (1, 1, T, S),
  (B, N, 1, S),
  _slow((1, 1, 1, S)),
  (B, N, T, 1),
  _slow((T, S)),
  (S,),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bias_broadcast_shapes_and_dbias(shape):
  q, k, v, do, kb, _ = _inputs()
  bias = jax.random.normal(kb, shape, jnp.float32)
  _close(*_both(q, k, v, do, bias=bias))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_mask_broadcast_shapes(shape):
  q, k, v, do, _, km = _inputs()
  mask = jax.random.bernoulli(km, 0.7, shape)
  _close(*_both(q, k, v, do, mask=mask))


def test_mask_bias_causal_lengths_together_and_residual():
  q, k, v, do, kb, km = _inputs()
  bias = jax.random.normal(kb, (1, N, T, S), jnp.float32)
  mask = jax.random.bernoulli(km, 0.8, (B, 1, T, S))
  kw = dict(
    bias=bias,
    mask=mask,
    is_causal=True,
    key_value_seq_lengths=jnp.array([70, 40], jnp.int32),
  )
  _close(*_both(q, k, v, do, **kw))
  ours = pallas_fa3.dot_product_attention(
    q, k, v, return_residual=True, implementation="blockwise", **kw
  )
  theirs = jax.nn.dot_product_attention(
    q, k, v, return_residual=True, implementation="xla", **kw
  )
  np.testing.assert_allclose(ours[0], theirs[0], atol=2e-5)
  np.testing.assert_allclose(ours[1], theirs[1], rtol=1e-5, atol=1e-5)


def test_rows_without_keys_match_jax_nn():
  """A row whose mask hides every key: jax.nn gives the mean of V."""
  q, k, v, do, _, _ = _inputs()
  mask = jnp.ones((B, N, T, S), bool).at[:, :, 5].set(False)
  _close(*_both(q, k, v, do, mask=mask))


def test_rank3_operands():
  q, k, v, do, kb, _ = _inputs()
  q3, k3, v3, do3 = q[0], k[0], v[0], do[0]
  bias = jax.random.normal(kb, (N, T, S), jnp.float32)
  _close(*_both(q3, k3, v3, do3, bias=bias, is_causal=True))


def test_vmap_of_rank3_calls_matches_jax_nn():
  """vmap over the batch of rank-3 GQA calls, a per-example bias and one
  mask for all (`in_axes=(0, 0, 0, 0, None)`, as jax.nn's and tokamax's
  own suites call it): outputs and gradients, dbias included."""
  q, k, v, do, kb, km = _inputs()
  bias = jax.random.normal(kb, (B, N, T, S), jnp.float32)
  mask = jax.random.bernoulli(km, 0.8, (1, 1, S))

  def run(fn, **extra):
    one = lambda q, k, v, b, m: fn(q, k, v, b, m, is_causal=True, **extra)
    out, pull = jax.vjp(jax.vmap(one, in_axes=(0, 0, 0, 0, None)), q, k, v,
                        bias, mask)  # fmt: skip
    return (out,) + pull(do)[:4]

  ours = run(pallas_fa3.dot_product_attention, implementation="blockwise")
  theirs = run(jax.nn.dot_product_attention, implementation="xla")
  _close(ours, theirs)


def _dense_attention(q, k, v, mask, is_causal):
  """jax.nn's function with every intermediate in the inputs' dtype (a
  hidden row's logits all one large negative number: the mean of V)."""
  t, s = q.shape[1], k.shape[1]
  if is_causal:
    mask = mask & jnp.tril(jnp.ones((t, s), bool))
  logits = jnp.einsum("btnh,bsnh->bnts", q, k) / jnp.sqrt(q.shape[-1]).astype(
    q.dtype
  )
  big = jnp.asarray(-0.7 * np.finfo(np.float32).max, q.dtype)
  p = jax.nn.softmax(jnp.where(mask, logits, big), axis=-1)
  return jnp.einsum("bnts,bsnh->btnh", p, v)


def _dense_grads(q, k, v, do, mask, is_causal):
  out, pull = jax.vjp(
    lambda q, k, v: _dense_attention(q, k, v, mask, is_causal), q, k, v
  )
  return (out,) + pull(do)


# One executable each: op-by-op, the float32 golden's eager dispatch hung
# once in a clean-clone CI run after the interpret kernels (02:39, fac310f).
_golden_f32 = jax.jit(_dense_grads, static_argnames="is_causal")
_naive_bf16 = jax.jit(
  _dense_grads,
  static_argnames="is_causal",
  compiler_options={"xla_allow_excess_precision": False},
)


def _branches_taken(monkeypatch) -> list:
  """Which side of every kernel-or-twin choice (`backends.sm90._on_device`)
  executed ("kernel" or "twin"), recorded on the device as the calls run
  (jit caches cleared: a cached trace would run without the spy)."""
  taken, choose = [], sm90._on_device

  def spy(exact, run, twin, operands):
    def tell(name, branch):
      def f(ops):
        jax.debug.callback(lambda: taken.append(name))
        return branch(ops)

      return f

    return choose(exact, tell("kernel", run), tell("twin", twin), operands)

  monkeypatch.setattr(sm90, "_on_device", spy)
  jax.clear_caches()  # calls traced before the spy would not tell it
  return taken


@pytest.mark.parametrize(
  "kind",
  [
    "keys",
    "queries",
    "rank3_all_keys",
    "keys_and_lengths_causal",
    pytest.param("dense_padding", marks=pytest.mark.slow),
    "dense_padding_causal",
  ],
)
def test_padding_masks_run_the_kernels(kind, monkeypatch):
  """A mask that varies along the keys alone or the queries alone (per
  batch row) becomes segment ids, which the Hopper kernels take (a dense
  mask would raise with `implementation="interpret"`), left padding beside
  lengths included (the pad id in two runs), and so does a dense
  `(B, 1, T, S)` mask that is a padding mask after all (checked on the
  device, said by a warning): every kernel-or-twin choice takes the kernel. bf16 in the kernels against the float32 golden,
  within the tolerance rule (the naive is the same dense attention in
  bf16); the golden is jax.nn's."""
  b, t, s, n, h = 2, 80, 130, 2, 64
  ks = jax.random.split(jax.random.key(3), 4)
  shapes = [(b, t, n, h), (b, s, n, h), (b, s, n, h), (b, t, n, h)]
  q, k, v, do = (
    jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
    for key, shape in zip(ks, shapes)
  )
  keys = jnp.arange(s)[None] >= jnp.array([[20], [0]])  # left padding
  queries = jnp.arange(t)[None] < jnp.array([[70], [t]])  # 70.. see none
  kw, dense = {}, None
  if kind == "keys":
    kw["mask"] = keys[:, None, None, :]
  elif kind == "queries":
    kw["mask"] = queries[:, None, :, None]
  elif kind == "rank3_all_keys":
    kw["mask"] = jnp.ones((1, 1, s), bool)
  elif kind.startswith("dense_padding"):  # nnx.make_attention_mask's
    kw["mask"] = queries[:, None, :, None] & keys[:, None, None, :]
    if kind.endswith("causal"):  # beside Flax's causal mask
      kw["mask"] &= jnp.tril(jnp.ones((t, s), bool))
      kw["is_causal"] = True
  else:
    lengths = jnp.array([120, 130], jnp.int32)
    kw = dict(
      mask=keys[:, None, None, :], is_causal=True,
      key_value_seq_lengths=lengths,
    )  # fmt: skip
    dense = kw["mask"] & (jnp.arange(s) < lengths[:, None])[:, None, None]
  dense = jnp.broadcast_to(
    kw["mask"] if dense is None else dense, (b, 1, t, s)
  ).reshape(b, 1, t, s)
  causal = kw.get("is_causal", False)

  def grads(f, dtype):
    cast = lambda x: x.astype(dtype)
    out, pull = jax.vjp(f, cast(q), cast(k), cast(v))
    return (out,) + pull(cast(do))

  taken = _branches_taken(monkeypatch)
  with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    got = run_interpreted(  # done before anything else is dispatched
      grads,
      lambda q, k, v: pallas_fa3.dot_product_attention(
        q, k, v, implementation="interpret", **kw
      ),
      jnp.bfloat16,
    )
  on_device = [w for w in said if "checked on the device" in str(w.message)]
  assert bool(on_device) == kind.startswith("dense"), [str(w) for w in said]
  assert taken and "twin" not in taken, taken
  naive = _naive_bf16(q, k, v, do, dense, is_causal=causal)
  f32 = (x.astype(jnp.float32) for x in (q, k, v, do))
  golden = _golden_f32(*f32, dense, is_causal=causal)
  theirs = grads(
    lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **kw), jnp.float32
  )
  _close(golden, theirs, atol=1e-5)
  for name, a, nv, g in zip(("out", "dq", "dk", "dv"), got, naive, golden):
    assert_within_tolerance(f"{kind} {name}", a, nv, g)


@pytest.mark.filterwarnings("error:the sm90 backward kernels cannot")
def test_bias_beside_a_padding_mask_differentiates_in_the_kernels():
  """A learned bias over padded batches (T5's relative bias, ALiBi as a
  bias): the padding mask becomes segment ids and the gradients, dbias
  among them, lower for CUDA to the dK/dV and dQ kernels, with no
  blockwise fallback (its warning is an error here)."""
  from jax import export

  b, t, n, h = 2, 256, 4, 64
  q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct((1, n, t, t), jnp.float32)
  keys = jnp.arange(t)[None] < jnp.array([[200], [t]])  # right padding

  def loss(q, k, v, bias):
    out = pallas_fa3.dot_product_attention(
      q, k, v, bias=bias, mask=keys[:, None, None, :],
      implementation="mosaic",
    )  # fmt: skip
    return out.astype(jnp.float32).sum()

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
  text = export.export(grad, platforms=["cuda"])(q, q, q, bias).mlir_module()
  assert "fa3_bwd_dkdv" in text and "fa3_bwd_dq" in text


def test_dense_padding_masks_lower_to_the_kernels_under_vmap_and_grad():
  """A dense `(B, 1, T, S)` mask goes through a device-side choice: the
  vmapped gradient lowers for CUDA with the kernels in it (the padding
  branch) and says so; the choice itself is checked by the interpret
  cases of test_padding_masks_run_the_kernels."""
  from jax import export

  b, t, n, h = 2, 256, 4, 64
  x = jax.ShapeDtypeStruct((3, b, t, n, h), jnp.bfloat16)
  m = jax.ShapeDtypeStruct((3, b, 1, t, t), jnp.bool_)

  def loss(q, k, v, mask):
    out = pallas_fa3.dot_product_attention(
      q, k, v, mask=mask, is_causal=True, implementation="mosaic"
    )
    return out.astype(jnp.float32).sum()

  grad = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))
  with pytest.warns(UserWarning, match="checked on the device"):
    text = export.export(grad, platforms=["cuda"])(x, x, x, m).mlir_module()
  # the forward and the fused backward (the padding branch); the twin is
  # blockwise, no kernel (vmapped, the forward kernel's name is not kept)
  assert lowered_kernel_count(text) == 2, lowered_kernel_count(text)
  assert "fa3_bwd_dkdv" in text


def test_interpret_under_vmap_with_a_dense_mask_says_why_it_cannot():
  """`"interpret"` under jax.vmap with a dense mask: a NotImplementedError
  naming the call and what serves it (the interpreter's effects in the
  device-side cond), raised while tracing."""
  x = jax.ShapeDtypeStruct((2, 1, 64, 2, 64), jnp.bfloat16)
  valid = jnp.arange(64) < 50
  mask = (valid[:, None] & valid[None])[None, None]
  attend = lambda q: pallas_fa3.dot_product_attention(
    q, q, q, mask=mask, implementation="interpret"
  )
  with pytest.warns(UserWarning, match="checked on the device"):
    with pytest.raises(NotImplementedError, match="cannot run under jax.vmap"):
      jax.eval_shape(jax.vmap(attend), x)


def test_padding_of_mask_tells_padding_from_other_masks():
  """`segments.padding_of_mask`: exact for `q_valid & kv_valid` (with the
  causal tril where causal; the mask's upper triangle then does not
  matter), not for other masks, per-head differences or a padding mask
  missing the tril's lower part."""
  t = 6
  qv = jnp.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], bool)
  kv = jnp.array([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]], bool)
  pad = (qv[:, :, None] & kv[:, None, :])[:, None]
  tril = jnp.tril(jnp.ones((t, t), bool))
  q_ok, kv_ok, exact = segments.padding_of_mask(pad, causal=False)
  assert bool(exact)
  np.testing.assert_array_equal(q_ok, qv & kv.any(-1, keepdims=True))
  np.testing.assert_array_equal(kv_ok, kv & qv.any(-1, keepdims=True))
  assert bool(segments.padding_of_mask(pad & tril, causal=True)[2])
  assert bool(segments.padding_of_mask(pad, causal=True)[2])
  assert not bool(segments.padding_of_mask(pad & tril, causal=False)[2])
  assert not bool(
    segments.padding_of_mask(pad.at[0, 0, 1, 2].set(False), False)[2]
  )
  heads = jnp.concatenate([pad, pad.at[:, :, 0, 1].set(False)], axis=1)
  assert not bool(segments.padding_of_mask(heads, causal=False)[2])


def test_reference_backend_and_default_choice():
  q, k, v, do, _, _ = _inputs()
  for impl in ("reference", None):
    _close(*_both(q, k, v, do, impl=impl, is_causal=True))


def test_bfloat16_close_to_jax_nn():
  q, k, v, _, kb, _ = _inputs()
  bf = lambda x: x.astype(jnp.bfloat16)
  bias = jax.random.normal(kb, (1, 1, T, S), jnp.float32)
  ours = pallas_fa3.dot_product_attention(
    bf(q), bf(k), bf(v), bf(bias), is_causal=True
  )
  exact = jax.nn.dot_product_attention(q, k, v, bias, is_causal=True)
  naive = jax.nn.dot_product_attention(
    bf(q), bf(k), bf(v), bf(bias), is_causal=True, implementation="xla"
  )
  err = np.abs(np.asarray(ours, np.float32) - np.asarray(exact)).max()
  naive_err = np.abs(np.asarray(naive, np.float32) - np.asarray(exact)).max()
  assert err <= 2 * naive_err + 1e-2


def test_xla_implementation_is_jax_nn():
  q, k, v, _, _, _ = _inputs()
  got = pallas_fa3.dot_product_attention(q, k, v, implementation="xla")
  want = jax.nn.dot_product_attention(q, k, v, implementation="xla")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_signature_is_jax_nns():
  ours = inspect.signature(pallas_fa3.dot_product_attention).parameters
  theirs = inspect.signature(jax.nn.dot_product_attention).parameters
  assert list(ours) == list(theirs)
  for name, p in theirs.items():
    assert ours[name].kind == p.kind, name


@pytest.mark.parametrize(
  "dtype, seq_kv, dv, impl",
  [
    (jnp.float32, 48, 24, "blockwise"),  # causal (T == S)
    (jnp.bfloat16, 80, 32, "blockwise"),  # key lengths (T != S)
    (jnp.float32, 80, 8, "reference"),
  ],
)
def test_value_head_dim_unlike_the_querys(dtype, seq_kv, dv, impl):
  """Value heads of another width than the query's (jax.nn refuses them,
  flash_attention serves them): output `[..., Hv]` and gradients within
  the tolerance rule of the float64 golden and the naive attention."""
  shape = Shape(B, T, seq_kv, N, K, H, dv)
  q, k, v, do = random_inputs(jax.random.key(seq_kv + dv), shape, dtype)
  kw, ids, causal = {}, None, seq_kv == T
  if causal:
    kw["is_causal"] = True
  else:
    lengths = jnp.array([seq_kv, 33], jnp.int32)
    kw["key_value_seq_lengths"] = lengths
    ids = segments.ids_of_padding(
      jnp.ones((B, T), bool), jnp.arange(seq_kv)[None] < lengths[:, None]
    )
  out, pull = jax.vjp(
    lambda q, k, v: pallas_fa3.dot_product_attention(
      q, k, v, implementation=impl, **kw
    ),
    q,
    k,
    v,
  )
  assert out.shape == (B, T, N, dv) and out.dtype == dtype
  got = (out,) + pull(do)
  golden, naive = golden_and_naive(q, k, v, do, causal=causal, segment_ids=ids)
  names = ("out", "dq", "dk", "dv")
  picked = lambda x: (x[0],) + tuple(x[2:5])  # lse left out
  for name, a, n, g in zip(names, got, picked(naive), picked(golden)):
    assert_within_tolerance(name, a, n, g)


def test_value_head_dim_with_a_residual_and_rank3():
  q, k, v, _, _, _ = _inputs()
  v = jnp.concatenate([v, v[..., :4]], axis=-1)  # Hv = H + 4
  out, res = pallas_fa3.dot_product_attention(
    q[0], k[0], v[0], is_causal=True, return_residual=True
  )
  assert out.shape == (T, N, H + 4) and res.shape == (T, N)
  want = pallas_fa3.dot_product_attention(q, k, v, is_causal=True)[0]
  np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
  "size, error, match",
  [
    ((-2, 3), ValueError, "local_window_size left must be >= 0"),
    ((3, -1), ValueError, "local_window_size right must be >= 0"),
    ((2.5, 1), TypeError, "local_window_size left must be an int"),
    ((None, 2), TypeError, "local_window_size left must be an int"),
    ((1, 2, 3), ValueError, "local_window_size must be .* a pair"),
    ("a", TypeError, "local_window_size must be None, an int"),
    (-1, ValueError, "local_window_size left must be >= 0"),
  ],
  ids=str,
)
@pytest.mark.parametrize("t", [T, S], ids=["T!=S", "T==S"])
def test_local_window_size_errors_name_it(size, error, match, t):
  """Errors name `local_window_size` (not flash_attention's window_size),
  at T == S (the built-in window) and T != S (a mask_mod) alike."""
  q, k, v, _, _, _ = _inputs(t=t)
  with pytest.raises(error, match=match):
    pallas_fa3.dot_product_attention(q, k, v, local_window_size=size)


def test_errors_match_jax_nn():
  q, k, v, _, _, _ = _inputs()
  f = pallas_fa3.dot_product_attention
  with pytest.raises(ValueError, match="value shape"):
    f(q, k, v[:, :-1])
  with pytest.raises(ValueError, match="multiple of key/value heads"):
    f(q[:, :, :3], k, v)
  with pytest.raises(ValueError, match="mask dtype"):
    f(q, k, v, mask=jnp.ones((T, S), jnp.int32))
  with pytest.raises(ValueError, match="key_value_seq_lengths"):
    f(q, k, v, key_value_seq_lengths=jnp.ones((B + 1,), jnp.int32))
  with pytest.raises(ValueError, match="bias of shape"):
    f(q, k, v, bias=jnp.zeros((3, N, T, S)))
  with pytest.raises(ValueError, match="mask of shape"):
    f(q, k, v, mask=jnp.ones((1, 1, T, S - 1), bool))
