"""Gradients only of what was differentiated (`vjp.Needed`): a score_mod
whose arrays are not differentiated runs its backward as a function
without learnable arrays (`UserFunction.frozen`: the fused kernel, no
per-array sums, relative-position tables read in the backward kernels),
an undifferentiated bias writes no dS; the gradients that are taken stay
right (float64 golden, tolerance rule), and those of differentiated arrays
still come back."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import pallas_fa3
from pallas_fa3 import flex, mods
from pallas_fa3.testing import assert_within_tolerance, flex_golden_and_naive

B, S, HQ, HK, D = 1, 256, 4, 2, 64


def _inputs(seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  shapes = ((B, S, HQ, D), (B, S, HK, D), (B, S, HK, D), (B, S, HQ, D))
  return tuple(
    jax.random.normal(kk, s, jnp.float32).astype(jnp.bfloat16)
    for kk, s in zip(ks, shapes)
  )


def test_frozen_function_computes_the_same_scores():
  """The frozen function (its floating arrays passed as their bits) gives
  the original's scores, float32 and bfloat16 arrays alike, and carries no
  floating array; a function without floating arrays is its own."""
  grid = np.stack(np.meshgrid(np.arange(HQ), np.arange(20), np.arange(20)), -1)
  h, qi, ki = (jnp.asarray(grid[..., i].ravel(), jnp.int32) for i in range(3))
  s = jnp.linspace(-3.0, 3.0, h.size, dtype=jnp.float32)
  b = jnp.zeros_like(h)

  def both(slopes, table):  # (traced: lifted into the function's consts)
    def score(s, b, h, qi, ki):
      rel = table[h, jnp.clip(ki - qi, -8, 8) + 8]
      return s + slopes[h].astype(jnp.float32) * (ki - qi) + rel

    fs, ops = flex.prepare(
      score_mod=score, mask_mod=None, block_mask=None, bias=None,
      batch=B, heads=HQ, seq_q=S, seq_kv=S,
    )  # fmt: skip
    assert flex.differentiable(ops.score_consts) == (True, True)
    frozen_fs, frozen_ops = flex.frozen(fs, ops)
    assert not any(flex.differentiable(frozen_ops.score_consts))
    assert frozen_fs.score_mod is fs.score_mod.frozen()
    at = lambda fn, c: jax.vmap(lambda *a: fn(c, *a))(s, b, h, qi, ki)
    return (
      at(fs.score_mod, ops.score_consts),
      at(frozen_fs.score_mod, frozen_ops.score_consts),
    )

  slopes = jnp.asarray(mods.alibi_slopes(HQ), jnp.bfloat16)
  table = jnp.linspace(-1.0, 1.0, HQ * 17, dtype=jnp.float32).reshape(HQ, 17)
  want, got = jax.jit(both)(slopes, table)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  ints = flex.UserFunction("mask_mod", lambda b, h, qi, ki: qi >= ki)
  assert ints.frozen() is ints


def _lowered(fn, *args):
  return export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()


def test_undifferentiated_slopes_run_the_fused_backward():
  """ALiBi's slopes passed in (traced) but not differentiated: the fused
  kernel alone; differentiated: the dK/dV and dQ kernels (their sums)."""
  q = jax.ShapeDtypeStruct((B, S, HQ, D), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((B, S, HK, D), jnp.bfloat16)
  slopes = jax.ShapeDtypeStruct((HQ,), jnp.float32)

  def loss(q, k, v, p):
    o = pallas_fa3.flash_attention(
      q, k, v, causal=True, score_mod=mods.alibi(p), implementation="mosaic"
    )
    return o.astype(jnp.float32).sum()

  frozen = _lowered(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, slopes)
  learned = _lowered(jax.grad(loss, argnums=(0, 1, 2, 3)), q, k, k, slopes)
  assert "fa3_bwd_dkdv" in frozen and "fa3_bwd_dq" not in frozen
  assert "fa3_bwd_dkdv" in learned and "fa3_bwd_dq" in learned


def test_undifferentiated_bias_writes_no_ds():
  """A bias not differentiated: the dQ kernel has no float32 dS output
  (`[b, h, sq, skv]`); differentiated (one bias for two batch rows, summed
  over them), it has; with one batch row dS is dbias, written in the
  bias's dtype (no float32 temporary either)."""
  q = jax.ShapeDtypeStruct((2, S, HQ, D), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, S, HK, D), jnp.bfloat16)
  bias = jax.ShapeDtypeStruct((1, HQ, S, S), jnp.bfloat16)

  def loss(q, k, v, b):
    o = pallas_fa3.flash_attention(q, k, v, bias=b, implementation="mosaic")
    return o.astype(jnp.float32).sum()

  ds = f"x{HQ}x{S}x{S}xf32>"
  frozen = _lowered(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, bias)
  learned = _lowered(jax.grad(loss, argnums=(0, 1, 2, 3)), q, k, k, bias)
  assert "fa3_bwd_dq" in frozen and ds not in frozen
  assert f"tensor<2{ds}" in learned
  one = (jax.ShapeDtypeStruct((1,) + x.shape[1:], x.dtype) for x in (q, k))
  q1, k1 = one
  alone = _lowered(jax.grad(loss, argnums=(0, 1, 2, 3)), q1, k1, k1, bias)
  assert "fa3_bwd_dq" in alone and ds not in alone


@pytest.mark.filterwarnings("error:the sm90 backward kernels cannot")
@pytest.mark.parametrize(
  "impl",
  [
    # (the kernels' frozen reads also run in the tables' test below)
    pytest.param("interpret", marks=pytest.mark.slow),
    "blockwise",
  ],
)
def test_undifferentiated_arrays_against_golden(impl):
  """Slopes and a bias passed into a jitted gradient of q, k, v only: the
  gradients taken, against the float64 golden; then with the slopes and
  the bias differentiated too, theirs."""
  q, k, v, do = _inputs()
  params = (
    jnp.asarray(mods.alibi_slopes(HQ)),
    0.5 * jax.random.normal(jax.random.key(3), (1, HQ, S, S), jnp.float32),
  )
  options = lambda p: dict(score_mod=mods.alibi(p[0]), bias=p[1], causal=True)
  golden, naive = flex_golden_and_naive(q, k, v, do, params, options)
  names = ("out", "dq", "dk", "dv", "dparams")

  def run(q, k, v, p):
    o = pallas_fa3.flash_attention(q, k, v, implementation=impl, **options(p))
    return (o.astype(jnp.float32) * do.astype(jnp.float32)).sum()

  taken = jax.jit(jax.grad(run, argnums=(0, 1, 2)))(q, k, v, params)
  for name, g, n, ref in zip(names[1:4], taken, naive[1:4], golden[1:4]):
    assert_within_tolerance(f"{impl} {name}", g, n, ref)
  dparams = jax.jit(jax.grad(run, argnums=3))(q, k, v, params)
  for i, (g, n, ref) in enumerate(zip(dparams, naive[4], golden[4])):
    assert_within_tolerance(f"{impl} dparams[{i}]", g, n, ref)


_SQ, _SKV = 160, 192
_DILATED = jnp.asarray(np.arange(_SQ + _SKV) % 3 == 0)
# Tables read at a function of kv_idx - q_idx (and one at a function of
# q_idx), passed in and not differentiated: the backward kernels read them
# (the dQ kernel's tiles have queries as rows, the dK/dV kernels' keys).
FROZEN_TABLES = {
  "clipped": (
    (HQ, 33),
    lambda t: dict(score_mod=mods.relative_position_bias(t, 16)),
  ),
  "t5_causal": (
    (HQ, 16),
    lambda t: dict(
      score_mod=mods.t5_relative_position_bias(
        t, bidirectional=False, max_distance=64
      ),
      causal=True,
    ),
  ),
  "per_batch_and_mask": (
    (B, HQ, 40),
    lambda t: dict(
      score_mod=lambda s, b, h, qi, ki: (
        s + t[b, h, jnp.clip(qi - ki, -20, 19) + 20]
      ),
      mask_mod=lambda b, h, qi, ki: _DILATED[ki - qi + _SQ] | (ki <= qi),
    ),
  ),
  "gathered": (
    (HQ, 7),
    lambda t: dict(
      score_mod=lambda s, b, h, qi, ki: (
        s + t[h, qi % 7] - 0.5 * t[h, (ki * 5) % 7]
      ),
      causal=True,
    ),
  ),
}


@pytest.mark.filterwarnings("error:the sm90 backward kernels cannot")
@pytest.mark.parametrize(
  "case, d, deterministic",
  [
    ("per_batch_and_mask", 64, False),  # the fused kernel's own tiles
    ("t5_causal", 128, False),  # its shared-tile layout
    ("per_batch_and_mask", 64, True),  # the pair, own-tile dK/dV
    pytest.param("t5_causal", 128, True, marks=pytest.mark.slow),
    pytest.param("clipped", 64, False, marks=pytest.mark.slow),
    pytest.param("gathered", 64, False, marks=pytest.mark.slow),
  ],
)
def test_interpret_undifferentiated_tables_in_the_backward_kernels(
  case, d, deterministic
):
  """A relative-position table (or a table read at a computed position)
  that is not differentiated: the backward kernels read it (no fallback:
  its warning is an error here), tiles with queries as rows skewed one way
  and the own-tile dK/dV consumers' (keys as rows) the other; dq, dk, dv
  against the float64 golden."""
  shape, options = FROZEN_TABLES[case]
  ks = jax.random.split(jax.random.key(5), 5)
  q = jax.random.normal(ks[0], (B, _SQ, HQ, d), jnp.float32)
  k, v = (jax.random.normal(x, (B, _SKV, HK, d), jnp.float32) for x in ks[1:3])
  do = jax.random.normal(ks[3], (B, _SQ, HQ, d), jnp.float32)
  q, k, v, do = (x.astype(jnp.bfloat16) for x in (q, k, v, do))
  table = 0.5 * jax.random.normal(ks[4], shape, jnp.float32)
  golden, naive = flex_golden_and_naive(q, k, v, do, table, options)

  def run(q, k, v, t):
    o = pallas_fa3.flash_attention(
      q, k, v, implementation="interpret", deterministic=deterministic,
      **options(t),
    )  # fmt: skip
    return (o.astype(jnp.float32) * do.astype(jnp.float32)).sum()

  taken = jax.jit(jax.grad(run, argnums=(0, 1, 2)))(q, k, v, table)
  for name, g, n, ref in zip(
    ("dq", "dk", "dv"), taken, naive[1:4], golden[1:4]
  ):
    assert_within_tolerance(f"{case} d{d} {name}", g, n, ref)
