"""Segment ids in the sm90 kernels, on a CPU: interpret mode against the
float64 golden, forward and gradients (contiguous ids: the kernels' per-row
key bounds and per-key query bounds; other ids: the blockwise twin, chosen
on the device), the bounds themselves, the backward kernels never reading
another document's tiles, and the CUDA lowering of `jax.grad` through
`mosaic` (all kernels, no `[sq, skv]` tensor)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import pallas_fa3
from pallas_fa3 import mods, segments
from pallas_fa3.backends import sm90
from pallas_fa3.kernels.sm90 import backward as kernel, compat, config_backward
from pallas_fa3.spec import make_spec
from pallas_fa3.testing import (
  Shape,
  assert_lowered_attention,
  assert_within_tolerance,
  flex_golden_and_naive,
  golden_and_naive,
  random_inputs,
  run_interpreted,
)

_TIMEOUT_S = 300


def test_key_bounds_are_each_rows_segment(rng):
  kv = np.array([[0, 0, 1, 1, 1, 2, -2, -2]], np.int32)
  q = np.array([[1, 0, 2, -1, 5, 1, 1, 0]], np.int32)
  lo, hi, contiguous = segments.key_bounds((q, kv))
  for i in range(8):
    keys = np.nonzero(kv[0] == q[0, i])[0]
    want = (keys.min(), keys.max() + 1) if keys.size else (0, 0)
    got = (int(lo[0, i]), int(hi[0, i]))
    assert got == want or (want == (0, 0) and got[0] >= got[1])
  assert bool(contiguous)
  split = np.array([[0, 1, 0, 1, 1, 1, 1, 1]], np.int32)  # id 0 twice
  assert not bool(segments.key_bounds((q, split))[2])
  # An id no query holds may lie in several runs (left padding beside
  # lengths): the bounds stay exact.
  padded = np.array([[-2, -2, 0, 0, 0, 1, 1, -2]], np.int32)
  lo, hi, exact = segments.key_bounds((q, padded))
  assert bool(exact) and (int(lo[0, 1]), int(hi[0, 1])) == (2, 5)
  assert not bool(segments.key_bounds((np.full_like(q, -2), padded))[2])


# (shape, causal, window, sinks, contiguous kv ids)
CASES = [
  (Shape(2, 256, 256, 2, 1, 64), True, None, False, True),
  (Shape(1, 200, 330, 2, 2, 64), False, (40, None), True, True),
  (Shape(1, 192, 192, 2, 1, 64), False, None, False, False),
]


@pytest.mark.timeout(_TIMEOUT_S)
@pytest.mark.parametrize(
  "shape,causal,window,sinks,contiguous",
  CASES,
  ids=["packed-causal-gqa", "padded-window-sinks", "interleaved-ids"],
)
def test_interpret_forward_against_float64_golden(
  shape, causal, window, sinks, contiguous, rng, key
):
  q, k, v, dout = random_inputs(key, shape, jnp.bfloat16)
  b, sq, skv = shape.batch, shape.seq_q, shape.seq_kv
  q_ids = np.sort(rng.integers(0, 4, (b, sq)), axis=1).astype(np.int32)
  kv_ids = np.sort(rng.integers(0, 4, (b, skv)), axis=1).astype(np.int32)
  q_ids[:, -7:] = -1  # padded queries
  if not contiguous:  # every id's keys in two runs
    kv_ids = np.broadcast_to(np.arange(skv) % 3, (b, skv)).astype(np.int32)
  snk = jnp.linspace(-1.0, 1.0, shape.heads_q) if sinks else None
  options = dict(causal=causal, window_size=window, segment_ids=(q_ids, kv_ids))
  out, lse = pallas_fa3.flash_attention(
    q, k, v, sinks=snk, return_lse=True, implementation="interpret", **options
  )
  golden, naive = golden_and_naive(q, k, v, dout, sinks=snk, **options)
  for name, g, n, gold in zip(("out", "lse"), (out, lse), naive, golden):
    assert_within_tolerance(name, g, n, gold)
  assert not np.any(np.asarray(out[:, -7:], np.float32))


@pytest.mark.timeout(_TIMEOUT_S)
@pytest.mark.parametrize("contiguous", [True, False], ids=["packed", "mixed"])
def test_interpret_vmap_over_calls_with_segment_ids(contiguous, rng, key):
  """vmap over two calls with segment ids, and with a dense bias (a flex
  option, which runs whole): one device-side choice for the vmapped batch
  (the kernel when every example's ids are contiguous, else the twin for
  all), not vmap's both-then-select, which interpret mode's effects cannot
  do. Each example against its float64 golden (with the bias: against the
  same call unvmapped)."""
  shape = Shape(1, 128, 192, 2, 1, 64)
  ins = [random_inputs(k, shape, jnp.bfloat16) for k in jax.random.split(key)]
  q, k, v, dout = (jnp.stack(x) for x in zip(*ins))
  ids = [np.sort(rng.integers(0, 3, (2, 1, n)), axis=-1) for n in (128, 192)]
  q_ids, kv_ids = (x.astype(np.int32) for x in ids)
  if not contiguous:  # the second example's ids each in three runs
    kv_ids[1] = np.arange(192) % 3
  bias = jax.random.normal(key, (2, 1, 2, 128, 192), jnp.float32)

  def attend(q, k, v, q_ids, kv_ids, bias=None):
    return pallas_fa3.flash_attention(
      q, k, v, segment_ids=(q_ids, kv_ids), bias=bias, causal=True,
      implementation="interpret",
    )  # fmt: skip

  def with_grads(f, *args):
    out, pull = jax.vjp(lambda q, k, v: f(q, k, v, *args), q, k, v)
    return (out,) + pull(dout)

  got = run_interpreted(with_grads, jax.vmap(attend), q_ids, kv_ids)
  for i in range(2):
    golden, naive = golden_and_naive(
      q[i], k[i], v[i], dout[i], causal=True,
      segment_ids=(q_ids[i], kv_ids[i]),
    )  # fmt: skip
    pick = (0, 2, 3, 4)  # (out, lse, dq, dk, dv) without lse
    for name, g, n, gold in zip(
      ("out", "dq", "dk", "dv"),
      (x[i] for x in got),
      (naive[j] for j in pick),
      (golden[j] for j in pick),
    ):
      assert_within_tolerance(f"example {i} {name}", g, n, gold)
  with warnings.catch_warnings():  # no fallback to blockwise, said
    warnings.simplefilter("error", UserWarning)
    got = jax.vmap(attend)(q, k, v, q_ids, kv_ids, bias)
    want = [attend(q[i], k[i], v[i], q_ids[i], kv_ids[i], bias[i])
            for i in range(2)]  # fmt: skip
  np.testing.assert_allclose(
    np.asarray(got, np.float32),
    np.asarray(jnp.stack(want), np.float32),
    atol=2e-2,
  )


# name -> (deterministic, options(params), params(key)): flex options beside
# segment ids in the backward kernels. The fused kernel: a mask_mod and a
# score_mod without arrays; the dK/dV + dQ pair: a bias (dbias, the dQ
# kernel's dS) with ALiBi (its slopes' gradients, the kernels' row sums).
_FLEX_SEGMENT_CASES = {
  "fused-mask-softcap": (
    False,
    lambda p: dict(
      mask_mod=mods.sliding_window(48, 16, offset=64),
      score_mod=mods.softcap(3.0),
    ),
    lambda key: (),
  ),
  "dkdv-dq-bias-alibi": (
    True,
    lambda p: dict(bias=p["bias"], score_mod=mods.alibi(p["slopes"])),
    lambda key: dict(
      bias=jax.random.normal(key, (2, 1, 128, 192), jnp.float32),
      slopes=mods.alibi_slopes(2),
    ),
  ),
}


@pytest.mark.timeout(_TIMEOUT_S)
@pytest.mark.filterwarnings("error:the sm90 backward kernels cannot")
@pytest.mark.parametrize("case", list(_FLEX_SEGMENT_CASES))
def test_interpret_flex_backward_with_segment_ids(case, monkeypatch, rng, key):
  """Flex options and packed segment ids (padding included) together in the
  backward kernels, every gradient (dbias and a score_mod's arrays among
  them) against the float64 golden. `_on_device` is made to take the
  kernel: with contiguous ids it would, and the twin computes the same
  function, so the test would pass on a twin alone."""
  monkeypatch.setattr(sm90, "_on_device", lambda ok, run, twin, x: run(x))
  deterministic, options, make_params = _FLEX_SEGMENT_CASES[case]
  shape = Shape(2, 128, 192, 2, 1, 64)
  q, k, v, dout = random_inputs(key, shape, jnp.bfloat16)
  params = make_params(jax.random.fold_in(key, 1))
  q_ids = np.sort(rng.integers(0, 3, (2, 128)), axis=1).astype(np.int32)
  kv_ids = np.sort(rng.integers(0, 3, (2, 192)), axis=1).astype(np.int32)
  q_ids[:, -5:] = -1  # padded queries
  kv_ids[:, -3:] = -2  # padded keys
  ids = (q_ids, kv_ids)
  with_ids = lambda p: dict(options(p), segment_ids=ids, causal=True)
  golden, naive = flex_golden_and_naive(q, k, v, dout, params, with_ids)
  f = lambda q, k, v, p: pallas_fa3.flash_attention(
    q, k, v, implementation="interpret", deterministic=deterministic,
    **with_ids(p),
  )  # fmt: skip

  def fwd_bwd(*args):
    out, pull = jax.vjp(f, *args)
    return (out,) + pull(dout)

  got = run_interpreted(fwd_bwd, q, k, v, params)  # race report checked
  names = ("out", "dq", "dk", "dv")
  for name, g, n, gold in zip(names, got, naive, golden):
    assert_within_tolerance(name, g, n, gold)
  for name in params:
    g, n, gold = (x[4][name] for x in (got, naive, golden))
    assert_within_tolerance(f"d{name}", g, n, gold)
  assert not np.any(np.asarray(got[1][:, -5:], np.float32))
  for g in got[2:4]:  # padded keys are seen by no query
    assert not np.any(np.asarray(g[:, -3:], np.float32))


def test_flex_beside_segment_ids_at_d256_differentiates_blockwise_and_says_so():
  """At d256 the backward kernels do not take flex options beside segment
  ids (they spilled; with a bias, past shared memory): the blockwise
  backward, with a warning naming why."""
  q = jnp.zeros((1, 128, 2, 256), jnp.bfloat16)
  ids = jnp.zeros((1, 128), jnp.int32)
  loss = lambda q: pallas_fa3.flash_attention(
    q, q, q, segment_ids=(ids, ids), score_mod=mods.softcap(3.0),
    implementation="interpret",
  ).astype(jnp.float32).sum()  # fmt: skip
  with pytest.warns(UserWarning, match="beside segment_ids at head dim 256"):
    jax.eval_shape(jax.grad(loss), q)


# (shape, deterministic, options): the fused kernel (own and shared-tile
# layouts), and dK/dV + dQ (own and shared-tile)
_SLOW = pytest.mark.slow  # interpreted runs beyond one per kernel layout
BACKWARD_CASES = [
  pytest.param(
    Shape(2, 256, 256, 4, 2, 64), False, dict(causal=True), id="fused-gqa"
  ),
  pytest.param(
    Shape(1, 200, 330, 2, 2, 64), True, {}, id="dkdv-dq-cross-padded"
  ),
  pytest.param(
    Shape(1, 320, 192, 2, 1, 64),
    True,
    dict(causal=True),
    id="dkdv-dq-causal-sq>skv",
    marks=_SLOW,
  ),
  # softcap beside segment ids at d128, one query head a K/V head: the
  # default's shared-tile fused layout (the pair spilled)
  pytest.param(
    Shape(1, 192, 192, 2, 2, 128),
    False,
    dict(causal=True, softcap=30.0),
    id="fused-d128-softcap-shared-tile",
  ),
  pytest.param(
    Shape(1, 256, 256, 2, 1, 128),
    False,
    dict(causal=True, window_size=(70, None), softcap=4.0, sinks=True),
    id="fused-d128-window-softcap-sinks",
    marks=_SLOW,
  ),
  pytest.param(
    Shape(1, 192, 256, 2, 1, 256),
    True,
    dict(window_size=(40, 60)),
    id="dkdv-dq-d256-window",
    marks=_SLOW,
  ),
]


def _kernel_gradients(q, k, v, dout, dlse, ids, deterministic, sinks, **opts):
  """(dq, dk, dv) of the sm90 backward kernels in interpret mode (race
  detection on), called jitted on their own with the reference's residuals
  (the whole differentiated `interpret` call, forward and backward kernels
  in one executable: tests/test_interpret_paths.py)."""
  out, lse = pallas_fa3.flash_attention(
    q,
    k,
    v,
    sinks=sinks,
    segment_ids=ids,
    implementation="reference",
    return_lse=True,
    **opts,
  )
  spec = make_spec(
    q,
    k,
    v,
    deterministic=deterministic,
    segmented=True,
    sinks=sinks is not None,
    causal=opts.get("causal", False),
    window_size=opts.get("window_size"),
    softcap=opts.get("softcap"),
  )
  config = config_backward.default_backward_config(spec)
  run = jax.jit(
    lambda residuals, ids: kernel.sm90_backward(
      spec,
      config,
      *residuals,
      interpret=compat.interpret_params(detect_races=True),
      segment_ids=segments.kernel_bounds(spec, ids)[0],
    )
  )
  try:
    with compat.capture_race_report() as report:
      grads = jax.block_until_ready(
        run((q, k, v, out, lse, dout, dlse), tuple(map(jnp.asarray, ids)))
      )
  except Exception:
    compat.reset_interpret_state()
    raise
  assert not compat.races_found(), report.getvalue()[-3000:]
  return grads


@pytest.mark.timeout(_TIMEOUT_S)
@pytest.mark.parametrize(
  "shape,deterministic,options",
  BACKWARD_CASES,
)
def test_interpret_backward_kernels_against_float64_golden(
  shape, deterministic, options, rng, key
):
  """dQ, dK, dV of the backward kernels with segment ids (the rows' key
  bounds and the keys' query bounds, positions folded in) against the
  float64 golden."""
  q, k, v, dout = random_inputs(key, shape, jnp.bfloat16)
  b, sq, skv = shape.batch, shape.seq_q, shape.seq_kv
  q_ids = np.sort(rng.integers(0, 4, (b, sq)), axis=1).astype(np.int32)
  kv_ids = np.sort(rng.integers(0, 4, (b, skv)), axis=1).astype(np.int32)
  q_ids[:, -5:] = -1  # padded queries
  kv_ids[:, -3:] = -2  # padded keys
  dlse = jax.random.normal(jax.random.fold_in(key, 2), (b, shape.heads_q, sq))
  options = dict(options)
  snk = None
  if options.pop("sinks", False):
    snk = jnp.linspace(-1.0, 2.0, shape.heads_q)
  ids = (q_ids, kv_ids)
  grads = _kernel_gradients(
    q, k, v, dout, dlse, ids, deterministic, snk, **options
  )
  golden, naive = golden_and_naive(
    q, k, v, dout, dlse=dlse, sinks=snk, segment_ids=ids, **options
  )
  for name, g, n, gold in zip(("dq", "dk", "dv"), grads, naive[2:], golden[2:]):
    assert_within_tolerance(name, g, n, gold)
  assert not np.any(np.asarray(grads[0][:, -5:], np.float32))
  for g in grads[1:]:  # padded keys are seen by no query
    assert not np.any(np.asarray(g[:, -3:], np.float32))


@pytest.mark.timeout(_TIMEOUT_S)
@pytest.mark.parametrize(
  "deterministic", [pytest.param(False, marks=_SLOW), True]
)
def test_interpret_backward_kernels_never_load_other_documents(
  deterministic, key
):
  """The backward kernels with K and V NaN on every key of documents no
  query belongs to (whole tiles): a tile loaded and masked would still
  give 0 * NaN = NaN somewhere."""
  shape = Shape(1, 128, 512, 2, 1, 64)
  q, k, v, dout = random_inputs(key, shape, jnp.bfloat16)
  q_ids = np.full((1, 128), 3, np.int32)  # every query in document 3
  kv_ids = (np.arange(512, dtype=np.int32) // 128)[None]  # keys 384.. are 3
  ids = (q_ids, kv_ids)
  k_bad = k.at[:, :384].set(jnp.nan)
  v_bad = v.at[:, :384].set(jnp.nan)
  dlse = jnp.zeros((1, 2, 128), jnp.float32)
  out, lse = pallas_fa3.flash_attention(
    q, k, v, segment_ids=ids, implementation="reference", return_lse=True
  )
  spec = make_spec(q, k, v, deterministic=deterministic, segmented=True)
  run = jax.jit(
    lambda residuals, ids: kernel.sm90_backward(
      spec,
      config_backward.default_backward_config(spec),
      *residuals,
      interpret=compat.interpret_params(detect_races=True),
      segment_ids=segments.kernel_bounds(spec, ids)[0],
    )
  )
  grads = jax.block_until_ready(
    run((q, k_bad, v_bad, out, lse, dout, dlse), tuple(map(jnp.asarray, ids)))
  )
  golden, naive = golden_and_naive(q, k, v, dout, segment_ids=ids)
  for name, g, n, gold in zip(("dq", "dk", "dv"), grads, naive[2:], golden[2:]):
    assert_within_tolerance(name, g, n, gold)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_grad_through_mosaic_lowers_with_segment_ids(head_dim, deterministic):
  q = jax.ShapeDtypeStruct((2, 512, 4, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 640, 2, head_dim), jnp.bfloat16)
  q_ids = jax.ShapeDtypeStruct((2, 512), jnp.int32)
  kv_ids = jax.ShapeDtypeStruct((2, 640), jnp.int32)

  def loss(q, k, v, q_ids, kv_ids):
    out = pallas_fa3.flash_attention(
      q,
      k,
      v,
      causal=True,
      segment_ids=(q_ids, kv_ids),
      implementation="mosaic",
      deterministic=deterministic,
    )
    return out.astype(jnp.float32).sum()

  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no fallback said: the kernels run
    exported = export.export(
      jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["cuda"]
    )(q, kv, kv, q_ids, kv_ids)
  # The forward kernel and the backward's (fused, or dK/dV and dQ); the
  # blockwise twin is only the non-contiguous ids' branch of a `lax.cond`.
  assert_lowered_attention(
    exported.mlir_module(),
    kernels=3 if deterministic else 2,
    seq_q=512,
    seq_kv=640,
  )
