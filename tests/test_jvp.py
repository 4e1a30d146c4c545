"""Forward-mode differentiation (issue 69): `jax.jvp`, `jax.linearize`,
`jax.jacfwd` and `jax.hessian` through `flash_attention` and the other
entry points, against `jax.jvp` of an independent float64 materialized
attention written here (x64), with the tolerance rule; the jvp/vjp
identity `<jvp(x; u), w> == <u, vjp(x; w)>`; the sCM/MeanFlow pattern
(`jax.grad` of a loss holding a jvp); and reverse mode bit for bit the
hand-written backward, as before the change.

The 2- and 8-device shard_map cases: tests/multidevice/check_sharded_jvp.py.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import case_id

import pallas_fa3
from pallas_fa3 import tangent
from pallas_fa3.backends.base import Backward
from pallas_fa3.backends.blockwise import backend as blockwise_backend
from pallas_fa3.parallel import partitioning
from pallas_fa3.reference import reference_attention
from pallas_fa3.testing import assert_within_tolerance

_TILES = pallas_fa3.BlockwiseConfig(block_q=16, block_kv=16)


def _golden(q, k, v, *, causal=False, window=None, softcap=None, sinks=None,
            ids=None, bias=None, score_mod=None, mask_mod=None):  # fmt: skip
  """(out, lse) of materialized attention in float64 (call under x64):
  scale, softcap, bias, score_mod, masks (bottom-right causal and window,
  segment ids, mask_mod), sinks in the denominator."""
  f64 = lambda x: None if x is None else jnp.asarray(x, jnp.float64)
  q, k, v, sinks, bias = map(f64, (q, k, v, sinks, bias))
  b, sq, hq, d = q.shape
  skv, hk = k.shape[1], k.shape[2]
  kr, vr = (jnp.repeat(x, hq // hk, axis=2) for x in (k, v))
  s = jnp.einsum("bqhd,bkhd->bhqk", q, kr) / np.sqrt(d)
  if softcap is not None:
    s = softcap * jnp.tanh(s / softcap)
  if bias is not None:
    s = s + bias
  bi, hi, qi, ki = np.meshgrid(
    np.arange(b), np.arange(hq), np.arange(sq), np.arange(skv), indexing="ij"
  )
  if score_mod is not None:
    s = score_mod(s, bi, hi, qi, ki)
  off = skv - sq
  vis = np.ones(s.shape, bool)
  if causal:
    vis &= ki <= qi + off
  if window is not None:
    vis &= (ki >= qi + off - window[0]) & (ki <= qi + off + window[1])
  if ids is not None:
    vis = vis & (ids[0][:, None, :, None] == ids[1][:, None, None, :])
  if mask_mod is not None:
    vis = vis & mask_mod(bi, hi, qi, ki)
  s = jnp.where(vis, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  if sinks is not None:
    m = jnp.maximum(m, sinks[None, :, None, None])
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  e = jnp.exp(s - m)
  l = e.sum(-1, keepdims=True)
  if sinks is not None:
    l = l + jnp.exp(sinks[None, :, None, None] - m)
  safe = jnp.where(l == 0, 1.0, l)
  out = jnp.einsum("bhqk,bkhd->bqhd", e / safe, vr)
  lse = jnp.where(l == 0, -jnp.inf, m + jnp.log(safe))[..., 0]
  return out, lse


def _golden_jvp(primals, tangents, **options):
  with jax.enable_x64(True):
    f64 = lambda t: jax.tree.map(lambda x: np.asarray(x, np.float64), t)
    f = lambda *a: _golden(*a[:3], sinks=a[3], bias=a[4], **options)
    (out, lse), (dout, dlse) = jax.jvp(f, f64(primals), f64(tangents))
    return tuple(np.asarray(x) for x in (out, lse, dout, dlse))


def _assert_rule(got, naive, golden, names=("out", "lse", "dout", "dlse")):
  """Each of `got` finite where its golden is, and within the tolerance
  rule of the float64 `golden` against the low-precision `naive`."""
  for name, g, n, gd in zip(names, got, naive, golden):
    gd = np.asarray(gd)
    assert np.all(np.isfinite(np.asarray(g, np.float32)[np.isfinite(gd)]))
    assert_within_tolerance(name, g, n, gd)


def _inputs(rng, b, sq, skv, hq, hk, d, dv=None, dtype=jnp.bfloat16):
  dv = d if dv is None else dv
  shapes = [(b, sq, hq, d), (b, skv, hk, d), (b, skv, hk, dv)]
  x = [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]
  u = [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]
  return x, u


def _mod_array(rng, hq):
  return jnp.asarray(rng.standard_normal(hq) * 0.1, jnp.float32)


# (name, shape (b, sq, skv, hq, hk, d, dv), options, tangents of sinks/bias)
_CASES = [
  ("causal-gqa-segments", (2, 40, 56, 4, 2, 64, None), dict(causal=1, ids=1)),
  ("window-mqa-dv", (1, 48, 48, 4, 1, 32, 48), dict(window=(9, 3))),
  (
    "softcap-sinks-d128",
    (1, 33, 47, 2, 2, 128, None),
    dict(softcap=3.0, sinks=1),
  ),
  ("bias-score-mask", (1, 32, 40, 2, 1, 32, None), dict(bias=1, mods=1)),
  pytest.param(
    ("d256", (1, 20, 20, 2, 2, 256, None), dict()), marks=pytest.mark.slow
  ),
]


def _build(rng, shape, options):
  """(flash_attention kwargs, golden kwargs, sinks, bias, their tangents)."""
  b, sq, skv, hq, hk, d, dv = shape
  kw, gold = {}, {}
  sinks = bias = dsinks = dbias = None
  if options.get("causal"):
    kw["causal"] = gold["causal"] = True
  if "window" in options:
    kw["window_size"] = gold["window"] = options["window"]
  if "softcap" in options:
    kw["softcap"] = gold["softcap"] = options["softcap"]
  if options.get("sinks"):
    sinks = jnp.asarray(rng.standard_normal(hq), jnp.float32)
    dsinks = jnp.asarray(rng.standard_normal(hq), jnp.float32)
  if options.get("ids"):  # row 0 of batch 1 meets no key: tangent 0
    q_ids = np.repeat(np.arange(4), sq // 4)[None].repeat(b, 0)
    kv_ids = np.repeat(np.arange(4), skv // 4)[None].repeat(b, 0)
    q_ids[-1, :3] = 9
    kw["segment_ids"] = (jnp.asarray(q_ids), jnp.asarray(kv_ids))
    gold["ids"] = (q_ids, kv_ids)
  if options.get("bias"):
    bias = jnp.asarray(rng.standard_normal((1, hq, sq, skv)), jnp.float32)
    dbias = jnp.asarray(rng.standard_normal((1, hq, sq, skv)), jnp.float32)
  if options.get("mods"):
    slopes = _mod_array(rng, hq)  # captured array
    kw["score_mod"] = lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j)
    kw["mask_mod"] = lambda b, h, i, j: (i + j) % 7 != 0
    gold["score_mod"] = lambda s, b, h, i, j: (
      s - np.asarray(slopes, np.float64)[h] * np.abs(i - j)
    )
    gold["mask_mod"] = lambda b, h, i, j: (i + j) % 7 != 0
  return kw, gold, sinks, bias, dsinks, dbias


def _flash(implementation, kw, config=None):
  def f(q, k, v, sinks, bias):
    return pallas_fa3.flash_attention(
      q, k, v, sinks=sinks, bias=bias, return_lse=True,
      implementation=implementation, config=config, **kw,
    )  # fmt: skip

  return f


@pytest.mark.parametrize("implementation", ["blockwise", "reference"])
@pytest.mark.parametrize("case", _CASES, ids=lambda c: c[0])
def test_jvp_matches_the_float64_golden(implementation, case, rng):
  _, shape, options = case
  (q, k, v), (dq, dk, dv) = _inputs(rng, *shape)
  kw, gold, sinks, bias, dsinks, dbias = _build(rng, shape, options)
  config = _TILES if implementation == "blockwise" else None
  primals = (q, k, v, sinks, bias)
  tangents = (dq, dk, dv, dsinks, dbias)
  got = jax.jit(lambda p, t: jax.jvp(_flash(implementation, kw, config), p, t))(
    primals, tangents
  )
  (out, lse), (dout, dlse) = got
  golden = _golden_jvp(primals, tangents, **gold)
  # The naive low-precision computation of the rule: the materialized
  # reference's jvp with bf16 intermediates.
  naive_kw = {k_: v_ for k_, v_ in kw.items()}
  naive = jax.jvp(
    lambda q, k, v, s, b: reference_attention(
      q,
      k,
      v,
      sinks=s,
      bias=b,
      return_lse=True,
      intermediate_dtype=jnp.bfloat16,
      **naive_kw,
    ),  # fmt: skip
    primals,
    tangents,
  )
  naive = (naive[0][0], naive[0][1], naive[1][0], naive[1][1])
  _assert_rule((out, lse, dout, dlse), naive, golden)
  if options.get("ids"):  # the rows that see no key: tangents exactly 0
    assert np.all(np.asarray(dout[-1, :3]) == 0)
    assert np.all(np.asarray(dlse[-1, :, :3]) == 0)


def test_large_logits_give_finite_tangents(rng):
  (q, k, v), (dq, dk, dv) = _inputs(rng, 1, 32, 32, 2, 2, 32, dtype=jnp.float32)
  f = _flash("blockwise", dict(causal=True), _TILES)
  _, (dout, dlse) = jax.jvp(lambda q: f(q * 1e4, k, v, None, None), (q,), (dq,))
  assert np.all(np.isfinite(dout)) and np.all(np.isfinite(dlse))


def _vdot(a, b):
  return sum(
    jnp.vdot(x.astype(jnp.float32), y.astype(jnp.float32))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


@pytest.mark.parametrize("implementation", ["blockwise", "reference"])
def test_jvp_and_vjp_are_transposes(implementation, rng):
  """<jvp(x; u), w> == <u, vjp(x; w)> (sinks and bias included)."""
  shape = (1, 24, 40, 4, 2, 32, None)
  (q, k, v), (dq, dk, dv) = _inputs(rng, *shape, dtype=jnp.float32)
  kw, _, sinks, bias, dsinks, dbias = _build(
    rng, shape, dict(causal=True, sinks=1, bias=1)
  )
  f = _flash(
    implementation, kw, _TILES if implementation == "blockwise" else None
  )
  x, u = (q, k, v, sinks, bias), (dq, dk, dv, dsinks, dbias)
  y, ydot = jax.jvp(f, x, u)
  w = jax.tree.map(
    lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), y
  )
  _, pullback = jax.vjp(f, *x)
  lhs, rhs = _vdot(ydot, w), _vdot(u, pullback(w))
  scale = float(jnp.sqrt(_vdot(ydot, ydot) * _vdot(w, w)))
  assert abs(float(lhs - rhs)) <= 1e-5 * scale, (lhs, rhs)


@contextlib.contextmanager
def _count_passes():
  """How often the blockwise backward and tangent pass are traced."""
  cls = blockwise_backend.BlockwiseBackend
  seen = {"backward": 0, "forward_tangent": 0}
  saved = {n: getattr(cls, n) for n in seen}

  def wrap(name):
    def spied(self, *a, **kw):
      seen[name] += 1
      return saved[name](self, *a, **kw)

    return spied

  for n in seen:
    setattr(cls, n, wrap(n))
  try:
    yield seen
  finally:
    for n, fn in saved.items():
      setattr(cls, n, fn)


def test_linearize_and_transpose_run_the_backward(rng):
  (q, k, v), (dq, dk, dv) = _inputs(rng, 1, 24, 24, 2, 2, 32, dtype=jnp.float32)
  f = lambda q, k, v: _flash("blockwise", dict(causal=True), _TILES)(
    q, k, v, None, None
  )
  with _count_passes() as seen:
    y, f_lin = jax.linearize(f, q, k, v)
    ydot = f_lin(dq, dk, dv)
    _, ydot_ref = jax.jvp(f, (q, k, v), (dq, dk, dv))
    cts = jax.linear_transpose(f_lin, q, k, v)(y)
  assert seen["backward"] >= 1  # the transpose is the hand-written backward
  for a, b in zip(ydot, ydot_ref):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  grads = jax.vjp(f, q, k, v)[1](y)
  for a, b in zip(cts, grads):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_jacfwd_equals_jacrev_on_a_tiny_call(rng):
  (q, k, v), _ = _inputs(rng, 1, 5, 7, 2, 1, 4, dtype=jnp.float32)
  f = lambda q: pallas_fa3.flash_attention(
    q, k, v, causal=True, implementation="blockwise", config=_TILES
  )
  np.testing.assert_allclose(
    jax.jacfwd(f)(q), jax.jacrev(f)(q), rtol=1e-5, atol=1e-6
  )


@pytest.mark.parametrize("transform", ["jit", "vmap", "remat"])
def test_jvp_under_transformations(transform, rng):
  (q, k, v), (dq, dk, dv) = _inputs(rng, 3, 16, 24, 2, 1, 16, dtype=jnp.float32)
  f = lambda q, k, v: pallas_fa3.flash_attention(
    q, k, v, causal=True, implementation="blockwise", config=_TILES
  )
  plain = [jax.jvp(f, (q[i : i + 1], k[i : i + 1], v[i : i + 1]),
                   (dq[i : i + 1], dk[i : i + 1], dv[i : i + 1]))
           for i in range(3)]  # fmt: skip
  jvp = lambda q, k, v, dq, dk, dv: jax.jvp(f, (q, k, v), (dq, dk, dv))
  if transform == "jit":
    got = jax.jit(jvp)(q, k, v, dq, dk, dv)
  elif transform == "remat":
    got = jax.jvp(jax.checkpoint(f), (q, k, v), (dq, dk, dv))
  else:  # over a leading axis of size 1 per example
    got = jax.vmap(jvp)(*(x[:, None] for x in (q, k, v, dq, dk, dv)))
    got = jax.tree.map(lambda x: x[:, 0], got)
  for i in range(3):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(plain[i])):
      np.testing.assert_allclose(a[i : i + 1], b, rtol=2e-6, atol=2e-6)


def test_hessian_on_blockwise(rng):
  (q, k, v), _ = _inputs(rng, 1, 4, 6, 1, 1, 3, dtype=jnp.float32)

  def loss(q, implementation):
    out = pallas_fa3.flash_attention(
      q, k, v, causal=True, implementation=implementation
    )
    return jnp.sum(jnp.sin(out))

  h = jax.hessian(loss)(q, "blockwise")
  with jax.enable_x64(True):
    h64 = jax.hessian(
      lambda q: jnp.sum(jnp.sin(_golden(q, k, v, causal=True)[0]))
    )(np.asarray(q, np.float64))
  np.testing.assert_allclose(h, h64, rtol=1e-4, atol=1e-5)


def _scm_loss(implementation):
  """sCM / MeanFlow: a loss holding jvp(attention), its tangent under
  stop_gradient, differentiated in reverse mode."""

  def loss(q, k, v, dq):
    f = lambda q: pallas_fa3.flash_attention(
      q, k, v, causal=True, implementation=implementation
    )
    out, dout = jax.jvp(f, (q,), (dq,))
    target = jax.lax.stop_gradient(out + 0.1 * dout)
    return jnp.sum((out - target * 0.5) ** 2)

  return loss


def test_grad_of_a_loss_holding_a_jvp_runs_the_backward(rng):
  (q, k, v), (dq, _, _) = _inputs(rng, 1, 24, 24, 2, 2, 32, dtype=jnp.float32)
  with _count_passes() as seen:
    got = jax.jit(jax.grad(_scm_loss("blockwise"), argnums=(0, 1, 2)))(
      q, k, v, dq
    )
  assert seen["backward"] >= 1
  want = jax.grad(_scm_loss("reference"), argnums=(0, 1, 2))(q, k, v, dq)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("implementation", ["blockwise", "reference"])
def test_grad_through_the_tangent(implementation, rng):
  (q, k, v), (dq, dk, dv) = _inputs(rng, 1, 20, 20, 2, 1, 16, dtype=jnp.float32)

  def loss(q, k, v, implementation):
    f = lambda q, k, v: pallas_fa3.flash_attention(
      q, k, v, causal=True, softcap=4.0, implementation=implementation
    )
    _, dout = jax.jvp(f, (q, k, v), (dq, dk, dv))
    return jnp.sum(dout**2)

  got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, implementation)
  with jax.enable_x64(True):
    f64 = lambda x: np.asarray(x, np.float64)

    def gold(q, k, v):
      g = lambda q, k, v: _golden(q, k, v, causal=True, softcap=4.0)[0]
      _, dout = jax.jvp(g, (q, k, v), tuple(map(f64, (dq, dk, dv))))
      return jnp.sum(dout**2)

    want = jax.grad(gold, argnums=(0, 1, 2))(*map(f64, (q, k, v)))
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


_BITWISE = [
  dict(window_size=(7, 2), softcap=5.0, sinks=1),
  pytest.param(dict(causal=True), marks=pytest.mark.slow),
  pytest.param(dict(bias=1, score_mod=1), marks=pytest.mark.slow),
]


def _legacy_attention(call, operands):
  """The one custom_vjp every call went through before issue 69 (its
  forward and backward, the sinks' gradient beside them)."""

  @jax.custom_vjp
  def run(operands):
    return partitioning.run(call, operands)

  def fwd(operands):
    result = run(operands)
    return result, (operands, result)

  def bwd(residuals, cts):
    operands, (out, lse) = residuals
    back = dataclasses.replace(call, op="backward")
    g = partitioning.run(back, Backward(operands, out, lse, *cts))
    dflex = dsinks = None
    if operands.flex is not None:
      dflex = pallas_fa3.flex.cotangents(operands.flex, *g.dflex)
    if operands.sinks is not None:
      dsinks = pallas_fa3.modifiers.sinks_gradient(
        operands.sinks, out, lse, *cts
      )
    return (
      operands._replace(q=g.dq, k=g.dk, v=g.dv, sinks=dsinks, flex=dflex),
    )

  run.defvjp(fwd, bwd)
  return run(operands)


@pytest.mark.parametrize("options", _BITWISE, ids=case_id)
def test_reverse_mode_is_the_hand_written_backward_bit_for_bit(options, rng):
  """jax.grad (and under checkpoint) gives the gradients of the
  custom_vjp before issue 69, bit for bit, and traces no tangent pass."""
  (q, k, v), _ = _inputs(rng, 2, 40, 56, 4, 2, 32)
  kw = dict(options)
  if kw.get("sinks"):
    kw["sinks"] = jnp.asarray(rng.standard_normal(4), jnp.float32)
  if kw.get("bias"):
    kw["bias"] = jnp.asarray(rng.standard_normal((1, 4, 40, 56)), jnp.float32)
  if kw.get("score_mod"):
    kw["score_mod"] = lambda s, b, h, i, j: s + 0.01 * (i - j)
  f = lambda q, k, v: pallas_fa3.flash_attention(
    q, k, v, return_lse=True, implementation="blockwise", **kw
  )
  dout = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
  dlse = jnp.asarray(rng.standard_normal((2, 4, 40)), jnp.float32)
  grad = lambda f: jax.jit(lambda *x: jax.vjp(f, *x)[1]((dout, dlse)))
  with _count_passes() as seen:
    got = grad(f)(q, k, v)
    remat = grad(jax.checkpoint(f))(q, k, v)
  assert seen["backward"] == 2 and seen["forward_tangent"] == 0, seen
  jax.clear_caches()  # flash_attention's inner jit traces again, patched
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(pallas_fa3.vjp, "call", _legacy_attention)
    want = grad(f)(q, k, v), grad(jax.checkpoint(f))(q, k, v)
  jax.clear_caches()
  for a, b in zip(jax.tree.leaves((got, remat)), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fp8_jvp_is_refused_with_the_reason(rng):
  (q, k, v), (dq, _, _) = _inputs(rng, 1, 32, 32, 2, 2, 64)
  f = lambda q: pallas_fa3.flash_attention(
    q, k, v, fp8=True, implementation="blockwise"
  )
  with pytest.raises(NotImplementedError, match="FP8"):
    jax.jvp(f, (q,), (dq,))
  plan = pallas_fa3.explain(q, k, v, fp8=True, implementation="blockwise")
  assert "jvp: refused" in plan


def _jvp_line(*args, **kw):
  plan = pallas_fa3.explain(*args, implementation="interpret", **kw)
  return next(ln for ln in plan.splitlines() if ln.startswith("jvp:"))


def test_explain_names_the_tangent_kernel_or_its_fallback(rng):
  (q, k, v), _ = _inputs(rng, 1, 64, 64, 2, 2, 64)
  line = _jvp_line(q, k, v, causal=True)
  assert "forward-tangent kernel (fa3_fwd_tangent" in line
  assert "fallback" not in line and "blockwise" in line  # (grad through it)
  slopes = _mod_array(rng, 2)
  line = _jvp_line(q, k, v, score_mod=lambda s, b, h, i, j: s + slopes[h])
  assert "fa3_fwd_tangent" in line  # (a constant array: no tangent)
  lines = []

  def traced(slopes):  # learnable: its tangent enters S' in the kernel
    mod = lambda s, b, h, i, j: s + slopes[h]
    lines.append(_jvp_line(q, k, v, score_mod=mod))
    return slopes

  jax.eval_shape(traced, slopes)
  assert "fa3_fwd_tangent" in lines[0]
  line = _jvp_line(q, k, v, mask_mod=lambda b, h, i, j: (i + j) % 7 != 0)
  assert "fa3_fwd_tangent" in line
  (q, k, v), _ = _inputs(rng, 1, 64, 64, 2, 2, 96)
  assert "multiples of 64" in _jvp_line(q, k, v)
  (q, k, v), _ = _inputs(rng, 1, 64, 64, 2, 2, 256)
  assert "spills above 192" in _jvp_line(q, k, v)
  assert tangent.NO_FP8_JVP  # named once, imported by the refusal


# The tangent kernel's cases (interpret mode, races detected): each option
# it takes, ragged lengths, GQA/MQA, dv != d.
_KERNEL_CASES = [
  ("causal-gqa-segments", (2, 40, 56, 4, 2, 64, None), dict(causal=1, ids=1)),
  (
    "softcap-sinks-d128",
    (1, 33, 47, 2, 2, 128, None),
    dict(softcap=3.0, sinks=1),
  ),
  ("window-mqa-dv", (1, 70, 70, 4, 1, 64, 128), dict(window=(9, 3))),
  ("d192-one-consumer", (1, 40, 72, 2, 1, 192, 128), dict(causal=1)),
  pytest.param(
    ("causal-sq-gt-skv", (1, 150, 90, 2, 1, 64, None), dict(causal=1)),
    marks=pytest.mark.slow,
  ),
]


@pytest.mark.parametrize("case", _KERNEL_CASES, ids=lambda c: c[0])
def test_tangent_kernel_matches_the_float64_golden(case, rng):
  """The forward-tangent kernel (interpret mode) within the tolerance rule
  of the float64 golden, rows that see no key exactly 0."""
  _, shape, options = case
  (q, k, v), (dq, dk, dv) = _inputs(rng, *shape)
  kw, gold, sinks, bias, dsinks, dbias = _build(rng, shape, options)
  primals, tangents = (q, k, v, sinks, bias), (dq, dk, dv, dsinks, dbias)
  assert "fa3_fwd_tangent" in _jvp_line(q, k, v, sinks=sinks, **kw)
  with _count_passes() as seen:
    got = jax.jit(lambda p, t: jax.jvp(_flash("interpret", kw), p, t))(
      primals, tangents
    )
  if not options.get("ids"):  # (ids trace the twin beside the kernel)
    assert seen["forward_tangent"] == 0  # not the twin's pass
  golden = _golden_jvp(primals, tangents, **gold)
  naive = jax.jvp(
    lambda q, k, v, s, b: reference_attention(
      q, k, v, sinks=s, bias=b, return_lse=True,
      intermediate_dtype=jnp.bfloat16, **kw,
    ),
    primals,
    tangents,
  )  # fmt: skip
  (out, lse), (dout, dlse) = got
  naive = (*naive[0], *naive[1])
  _assert_rule((out, lse, dout, dlse), naive, golden)
  if options.get("ids"):  # the rows that see no key: tangents exactly 0
    assert np.all(np.asarray(dout[-1, :3]) == 0)
    assert np.all(np.asarray(dlse[-1, :, :3]) == 0)


@pytest.mark.parametrize(
  "options,kernel",
  [
    (dict(mods=1, causal=1), True),  # slopes and ids captured: no tangent
    (dict(bias=1), True),  # a bias closed over: no tangent
    (dict(bias=1, bias_tangent=1), True),  # its tangent: a tile a step
    (dict(bias=1, bias_tangent=1, mods=1, causal=1), True),
  ],
  ids=["score-and-mask-mods", "bias", "bias-with-tangent", "all-three"],
)
def test_tangent_kernel_with_flex_options(options, kernel, rng):
  """A score_mod whose arrays carry no tangent, a mask_mod, and a bias
  with and without a tangent in the tangent kernel (interpret mode),
  within the rule of the float64 golden."""
  shape = (1, 40, 72, 4, 2, 64, None)
  (q, k, v), (dq, dk, dv) = _inputs(rng, *shape)
  kw, gold, _, bias, _, dbias = _build(rng, shape, options)
  if not options.get("bias_tangent") and bias is not None:
    dbias = jnp.zeros_like(bias)
  attend = lambda q, k, v, b: pallas_fa3.flash_attention(
    q, k, v, bias=b, return_lse=True, implementation="interpret", **kw
  )
  if options.get("bias_tangent"):
    run = lambda x, u: jax.jvp(attend, x, u)
    x, u = (q, k, v, bias), (dq, dk, dv, dbias)
  else:
    run = lambda x, u: jax.jvp(lambda q, k, v: attend(q, k, v, bias), x, u)
    x, u = (q, k, v), (dq, dk, dv)
  with _count_passes() as seen:
    (out, lse), (dout, dlse) = jax.jit(run)(x, u)
  assert (seen["forward_tangent"] == 0) == kernel
  primals, tangents = (q, k, v, None, bias), (dq, dk, dv, None, dbias)
  golden = _golden_jvp(primals, tangents, **gold)
  naive = jax.jvp(
    lambda q, k, v, b: reference_attention(
      q, k, v, bias=b, return_lse=True, intermediate_dtype=jnp.bfloat16,
      **kw,
    ),
    (q, k, v, bias),
    (dq, dk, dv, dbias),
  )  # fmt: skip
  naive = (*naive[0], *naive[1])
  _assert_rule((out, lse, dout, dlse), naive, golden)


@pytest.mark.parametrize("d", [64, 128])  # (d128: 32-key tiles)
def test_tangent_kernel_takes_the_score_mods_arrays_tangents(d, rng):
  """ALiBi with slopes differentiated in forward mode (their tangent
  enters S' through the score_mod's jvp along them) and a mask_mod, in the
  tangent kernel, within the rule of the float64 golden."""
  shape = (1, 40, 72, 4, 2, d, None)
  (q, k, v), (dq, dk, dv) = _inputs(rng, *shape)
  slopes, dslopes = _mod_array(rng, 4), _mod_array(rng, 4)
  mask = lambda b, h, i, j: (i + j) % 7 != 0
  mod = lambda sl: lambda s, b, h, i, j: s - sl[h] * jnp.abs(i - j)

  def attend(implementation, **kw):
    return lambda q, k, v, sl: pallas_fa3.flash_attention(
      q, k, v, causal=True, score_mod=mod(sl), mask_mod=mask,
      return_lse=True, implementation=implementation, **kw,
    )  # fmt: skip

  x, u = (q, k, v, slopes), (dq, dk, dv, dslopes)
  with _count_passes() as seen:
    (out, lse), (dout, dlse) = jax.jit(
      lambda x, u: jax.jvp(attend("interpret"), x, u)
    )(x, u)
  assert seen["forward_tangent"] == 0
  with jax.enable_x64(True):
    f64 = lambda t: tuple(np.asarray(a, np.float64) for a in t)
    gold = jax.jvp(
      lambda q, k, v, sl: _golden(
        q, k, v, causal=True, score_mod=mod(sl), mask_mod=mask
      ),
      f64(x),
      f64(u),
    )
  gold = tuple(np.asarray(a) for a in (*gold[0], *gold[1]))
  naive = jax.jvp(
    lambda q, k, v, sl: reference_attention(
      q, k, v, causal=True, score_mod=mod(sl), mask_mod=mask,
      return_lse=True, intermediate_dtype=jnp.bfloat16,
    ),
    x,
    u,
  )  # fmt: skip
  naive = (*naive[0], *naive[1])
  _assert_rule((out, lse, dout, dlse), naive, gold)


@pytest.mark.parametrize(
  "which", ["t5-table", "t5-table-tangent", "block-mask"]
)
def test_tangent_kernel_reads_tables_and_skips_blocks(which, rng):
  """A T5 relative-position table (a lookup at q - kv; with its own
  tangent, looked up the same way) and a document block mask (empty tiles
  skipped, partial ones masked) in the tangent kernel, within the rule of
  the float64 golden."""
  from pallas_fa3 import mods

  b, s, h = 1, 256, 2
  (q, k, v), (dq, dk, dv) = _inputs(rng, b, s, s, h, h, 64)
  if which == "t5-table-tangent":
    table = jnp.asarray(rng.standard_normal((h, 8)), jnp.float32)
    dtable = jnp.asarray(rng.standard_normal((h, 8)), jnp.float32)
    t5 = lambda t: mods.t5_relative_position_bias(t, max_distance=64)
    f = lambda impl: (
      lambda q, k, v, t: pallas_fa3.flash_attention(
        q, k, v, score_mod=t5(t), return_lse=True, implementation=impl
      )
    )
    with _count_passes() as seen:
      got = jax.jit(lambda x, u: jax.jvp(f("interpret"), x, u))(
        (q, k, v, table), (dq, dk, dv, dtable)
      )
    assert seen["forward_tangent"] == 0
    with jax.enable_x64(True):
      f64 = lambda t: tuple(np.asarray(a, np.float64) for a in t)
      gold = jax.jvp(
        lambda q, k, v, t: _golden(q, k, v, score_mod=t5(t)),
        f64((q, k, v, table)),
        f64((dq, dk, dv, dtable)),
      )[1]
    naive = jax.jvp(
      lambda q, k, v, t: reference_attention(
        q, k, v, score_mod=t5(t), return_lse=True,
        intermediate_dtype=jnp.bfloat16,
      ),
      (q, k, v, table),
      (dq, dk, dv, dtable),
    )[1]  # fmt: skip
    _assert_rule(got[1], naive, gold, ("dout", "dlse"))
    return
  if which == "t5-table":
    table = jnp.asarray(rng.standard_normal((h, 8)), jnp.float32)
    kw = dict(score_mod=mods.t5_relative_position_bias(table, max_distance=64))
  else:
    ids = jnp.asarray(np.arange(s)[None] // 100, jnp.int32)
    doc = mods.document_mask(ids)
    kw = dict(
      mask_mod=doc,
      block_mask=pallas_fa3.create_block_mask(
        doc, 1, None, s, s, block_q=128, block_kv=128
      ),
    )
  attend = lambda impl: (
    lambda q, k, v: pallas_fa3.flash_attention(
      q, k, v, return_lse=True, implementation=impl, **kw
    )
  )
  assert "fa3_fwd_tangent" in _jvp_line(q, k, v, **kw)
  with _count_passes() as seen:
    _, (dout, dlse) = jax.jit(lambda x, u: jax.jvp(attend("interpret"), x, u))(
      (q, k, v), (dq, dk, dv)
    )
  assert seen["forward_tangent"] == 0
  gold_kw = {n: f for n, f in kw.items() if n != "block_mask"}
  gold = _golden_jvp((q, k, v, None, None), (dq, dk, dv, None, None), **gold_kw)
  gold = gold[2:]
  _, naive = jax.jvp(
    lambda q, k, v: reference_attention(
      q, k, v, return_lse=True, intermediate_dtype=jnp.bfloat16, **kw
    ),
    (q, k, v),
    (dq, dk, dv),
  )
  _assert_rule((dout, dlse), naive, gold, ("dout", "dlse"))


def test_grad_through_the_kernels_tangent_runs_the_twins_pass(rng):
  """sCM's pattern and a gradient through the tangent itself, the kernel
  serving the tangent: the gradient differentiates the blockwise pass
  (the same function), equal to the blockwise call's own."""
  (q, k, v), (dq, dk, dv) = _inputs(rng, 1, 64, 64, 2, 2, 64)

  def loss(q, k, v, implementation):
    f = lambda q, k, v: pallas_fa3.flash_attention(
      q, k, v, causal=True, implementation=implementation
    )
    out, dout = jax.jvp(f, (q, k, v), (dq, dk, dv))
    tgt = jax.lax.stop_gradient(dout.astype(jnp.float32))
    return jnp.sum(out.astype(jnp.float32) * tgt) + jnp.sum(
      dout.astype(jnp.float32) ** 2
    )

  got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, "interpret")
  want = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, "blockwise")
  for a, b in zip(got, want):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=0.05, atol=0.05 * np.abs(b).max())


def test_dot_product_attention_jvp(rng):
  (q, k, v), (dq, dk, dv) = _inputs(rng, 1, 24, 24, 2, 2, 32, dtype=jnp.float32)
  f = lambda q, k, v: pallas_fa3.dot_product_attention(
    q, k, v, is_causal=True, implementation="blockwise"
  )
  g = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
  _, got = jax.jvp(f, (q, k, v), (dq, dk, dv))
  _, want = jax.jvp(g, (q, k, v), (dq, dk, dv))
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_kvcache_jvp_and_no_gradient(rng):
  b, hq, hk, d, cap = 2, 4, 2, 32, 48
  q = jnp.asarray(rng.standard_normal((b, 1, hq, d)), jnp.float32)
  dq = jnp.asarray(rng.standard_normal((b, 1, hq, d)), jnp.float32)
  kc = jnp.asarray(rng.standard_normal((b, cap, hk, d)), jnp.float32)
  vc = jnp.asarray(rng.standard_normal((b, cap, hk, d)), jnp.float32)
  dkc = jnp.asarray(rng.standard_normal((b, cap, hk, d)), jnp.float32)
  lengths = jnp.asarray([30, 41], jnp.int32)
  f = lambda q, kc: pallas_fa3.flash_attention_with_kvcache(
    q, kc, vc, cache_seqlens=lengths, causal=True
  )
  _, got = jax.jvp(f, (q, kc), (dq, dkc))
  for i, n in enumerate((30, 41)):
    want = _golden_jvp(
      (q[i : i + 1], kc[i : i + 1, :n], vc[i : i + 1, :n], None, None),
      (dq[i : i + 1], dkc[i : i + 1, :n], jnp.zeros_like(vc[i : i + 1, :n]),
       None, None),
      causal=True,
    )[2]  # fmt: skip
    np.testing.assert_allclose(got[i : i + 1], want, rtol=1e-5, atol=1e-5)
  with pytest.raises(NotImplementedError, match="forward only"):
    jax.grad(lambda q: f(q, kc).sum())(q)


def test_flax_layer_jvp(rng):
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from pallas_fa3.flax import FlashMultiHeadAttention  # pylint: disable=g-import-not-at-top

  x = jnp.asarray(rng.standard_normal((2, 16, 32)), jnp.float32)
  dx = jnp.asarray(rng.standard_normal((2, 16, 32)), jnp.float32)
  tangents = []
  for implementation in ("blockwise", "reference"):
    layer = FlashMultiHeadAttention(
      4, 32, causal=True, implementation=implementation, rngs=nnx.Rngs(0)
    )
    tangents.append(jax.jvp(layer, (x,), (dx,))[1])
  np.testing.assert_allclose(*tangents, rtol=2e-5, atol=2e-5)


def test_varlen_jvp(rng):
  t = 40
  q, k, v, dq, dk, dv = (
    jnp.asarray(rng.standard_normal((t, 2, 16)), jnp.float32) for _ in range(6)
  )
  cu = jnp.asarray([0, 15, 40], jnp.int32)
  f = lambda q, k, v: pallas_fa3.flash_attention_varlen(
    q, k, v, cu, cu, max_seqlen_q=25, max_seqlen_k=25, causal=True
  )
  _, got = jax.jvp(f, (q, k, v), (dq, dk, dv))
  for a, b in ((0, 15), (15, 40)):
    want = _golden_jvp(
      (q[None, a:b], k[None, a:b], v[None, a:b], None, None),
      (dq[None, a:b], dk[None, a:b], dv[None, a:b], None, None),
      causal=True,
    )[2]
    np.testing.assert_allclose(got[a:b], want[0], rtol=2e-5, atol=2e-5)


@pytest.mark.slow
def test_interpret_jvp_runs_the_kernel_and_the_kernels_tangent(rng):
  """The kernels in interpret mode (races detected): the primal is the
  forward kernel's, the tangent the tangent kernel's, within the rule of
  the golden; the gradient still runs."""
  (q, k, v), (dq, dk, dv) = _inputs(rng, 1, 64, 64, 2, 2, 64)
  x, u = (q, k, v, None, None), (dq, dk, dv, None, None)
  f = _flash("interpret", dict(causal=True))
  (out, lse), (dout, dlse) = jax.jit(lambda x, u: jax.jvp(f, x, u))(x, u)
  golden = _golden_jvp(x, u, causal=True)
  naive = jax.jvp(
    lambda q, k, v: reference_attention(
      q, k, v, causal=True, return_lse=True, intermediate_dtype=jnp.bfloat16
    ),
    (q, k, v),
    (dq, dk, dv),
  )
  naive = (*naive[0], *naive[1])
  _assert_rule((out, lse, dout, dlse), naive, golden)
  grads = jax.grad(
    lambda q: f(q, k, v, None, None)[0].astype(jnp.float32).sum()
  )(q)
  assert np.all(np.isfinite(np.asarray(grads, np.float32)))
