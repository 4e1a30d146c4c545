"""The fused sm90 backward (`deterministic=False`, the default) on a CPU.

Interpret mode runs the one kernel (dQ stored per CTA to a slab the
interpreter sums: it has no TMA reduce-add) against the float64 golden
with the tolerance rule, race detection on. Lowering checks that every
fused config is one Mosaic kernel whose dQ is a TMA reduce-add into an
aliased float32 accumulator, for `sm90_backward`, `jax.grad` and `vmap`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import case_id
from jax import export
from test_sm90_bwd import _interpret_grads

import pallas_fa3
from pallas_fa3.kernels.sm90 import (
  backward as sm90_bwd,
  config as sm90_config,
  config_backward as sm90_bwd_config,
)
from pallas_fa3.kernels.sm90.config import Sm90BackwardConfig
from pallas_fa3.spec import make_spec
from pallas_fa3.testing import (
  Shape,
  assert_lowered_attention,
  assert_within_tolerance,
  golden_and_naive,
  random_inputs,
)

_TIMEOUT_S = 300

_CASES = [
  # d 128, FA3's layout (the default): two consumers with their own 64 keys
  # exchange dS^T and each adds half of dQ's head dim; causal, ragged both,
  # GQA (one masked loop inside the group loop, K and V indexed by a zero
  # the compiler cannot see).
  (
    Shape(1, 130, 200, 4, 2, 128),
    jnp.bfloat16,
    True,
    Sm90BackwardConfig(64, 64, 2, 2, 1),
  ),
  # The causal split (offsets a whole number of tiles, no GQA group): the
  # query tiles that see all of a consumer's keys in an unmasked loop; 130
  # rows padded to 256, so the loops must end at the plan's padded tile
  # count (issue 43).
  (
    Shape(1, 130, 130, 2, 2, 128),
    jnp.bfloat16,
    True,
    Sm90BackwardConfig(64, 64, 2, 2, 1),
  ),
  # ... d 64, sq < skv by one tile, MQA.
  (
    Shape(1, 136, 200, 2, 1, 64),
    jnp.bfloat16,
    True,
    Sm90BackwardConfig(64, 64, 2, 2, 1),
  ),
  # d 64: each consumer adds its own keys' dQ over the whole head dim;
  # non-causal, ragged kv (masked padded keys), MQA, 3 stages.
  (
    Shape(1, 128, 150, 2, 1, 64),
    jnp.float16,
    False,
    Sm90BackwardConfig(64, 64, 3, 2, 1),
  ),
  # causal, sq > skv: rows that see no key get zero dq.
  (
    Shape(1, 200, 70, 1, 1, 64),
    jnp.bfloat16,
    True,
    Sm90BackwardConfig(64, 64, 2, 2, 1),
  ),
  # d 96 (48-column halves: whole-head-dim dQ per consumer), causal sq < skv.
  (
    Shape(1, 100, 260, 1, 1, 96),
    jnp.bfloat16,
    True,
    Sm90BackwardConfig(64, 64, 2, 2, 1),
  ),
  # Two consumers sharing one K/V tile (d 192; d 128's default): dQ_w =
  # dS K_w from the exchanged dS; causal, GQA.
  (
    Shape(1, 130, 100, 2, 1, 192),
    jnp.bfloat16,
    True,
    Sm90BackwardConfig(64, 64, 2, 2, 2),
  ),
  # One consumer (256-thread CTA), fp16, ragged.
  (
    Shape(1, 100, 190, 1, 1, 64),
    jnp.float16,
    True,
    Sm90BackwardConfig(64, 64, 2, 1, 1),
  ),
]


@pytest.mark.timeout(_TIMEOUT_S)
@pytest.mark.parametrize("shape,dtype,causal,config", _CASES, ids=case_id)
def test_fused_interpret_gradients_match_golden(
  shape, dtype, causal, config, key
):
  q, k, v, dout = random_inputs(key, shape, dtype)
  spec = make_spec(q, k, v, causal=causal)
  assert sm90_bwd_config.fused_backward(spec, config)
  dlse = jax.random.normal(jax.random.fold_in(key, 1), spec.lse_shape)
  dq, dk, dv = _interpret_grads(spec, config, q, k, v, dout, dlse)
  golden, naive = golden_and_naive(q, k, v, dout, causal=causal, dlse=dlse)
  for name, x, arg, n, g in zip(
    ("dq", "dk", "dv"), (dq, dk, dv), (q, k, v), naive[2:], golden[2:]
  ):
    assert x.dtype == dtype and x.shape == arg.shape, name
    assert_within_tolerance(name, x, n, g)
  if causal and shape.seq_q > shape.seq_kv:
    assert np.all(np.asarray(dq[:, : shape.seq_q - shape.seq_kv]) == 0)


@pytest.mark.newest
def test_fused_padded_keys_cannot_overflow_dq(key):
  """Scores far below zero (lse ~ -200): a padded key's P would be
  exp(200) = inf without its mask, and inf * 0 = NaN in dQ."""
  shape = Shape(1, 64, 100, 1, 1, 64)
  q, k, v, dout = random_inputs(key, shape, jnp.bfloat16)
  q = jnp.abs(q) + 1.0
  k = -(jnp.abs(k) + 1.0)
  spec = make_spec(q, k, v, softmax_scale=10.0)
  config = Sm90BackwardConfig(64, 64, 2, 2, 1)
  dq, dk, dv = _interpret_grads(spec, config, q, k, v, dout)
  for name, x in (("dq", dq), ("dk", dk), ("dv", dv)):
    assert np.all(np.isfinite(np.asarray(x, np.float32))), name


# -- config space ---------------------------------------------------------------


def test_fused_defaults_have_two_consumers_up_to_d128():
  for d in sm90_config.KERNEL_HEAD_DIMS:
    q = jax.ShapeDtypeStruct((1, 128, 2, d), jnp.bfloat16)
    spec = make_spec(q, q, q)
    config = sm90_bwd_config.default_backward_config(spec)
    assert config in sm90_bwd_config.backward_config_space(d, 2, False)
    assert sm90_bwd_config.fused_backward(spec, config) == (d < 256), d
    if d <= 128:
      assert config.dkdv_consumers == 2, d


def test_fused_space_falls_back_where_nothing_fits():
  """d 256 leaves no shared memory for the dQ staging: the space and the
  run are the deterministic ones (the same function)."""
  assert not any(
    sm90_bwd_config.fused_unsupported(c, 256, 2) is None
    for c in sm90_bwd_config.backward_config_space(256, 2, False)
  )
  reason = sm90_bwd_config.fused_unsupported(
    Sm90BackwardConfig(64, 64, 2, 2, 2, 2, 2), 256, 2
  )
  assert reason and "shared memory" in reason
  reason = sm90_bwd_config.fused_unsupported(
    Sm90BackwardConfig(64, 64, 2, 1, 2), 128, 2
  )
  assert reason and "once per CTA" in reason
  # Over the register model (FA3's layout at 3 stages spills 4-8 B):
  # selectable, outside the space.
  config = Sm90BackwardConfig(64, 64, 3, 2, 1)
  assert sm90_bwd_config.fused_unsupported(config, 128, 2) is None
  assert not sm90_bwd_config.fused_fits_registers(config, 128, 2)
  assert config not in sm90_bwd_config.backward_config_space(128, 2, False)


def test_d128_fused_default_is_fa3s_layout():
  """Two consumers each owning 64 keys (no shared K/V tile): 0 spills
  causal and not since the transposed mask compares against immediates
  (issue 43); 64/192 and 3 stages stay outside the space (they spill)."""
  for dv in (128, 96, 64):
    q = jax.ShapeDtypeStruct((1, 1000, 4, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 1100, 2, 128), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((1, 1100, 2, dv), jnp.bfloat16)
    spec = make_spec(q, k, v, causal=True)
    config = sm90_bwd_config.default_backward_config(spec)
    assert config == Sm90BackwardConfig(64, 64, 2, 2, 1), dv
    assert sm90_bwd_config.fused_backward(spec, config)
  space = sm90_bwd_config.backward_config_space(64, 2, False, 192)
  assert Sm90BackwardConfig(64, 64, 2, 2, 1) not in space


def test_d128_gqa_with_modifiers_takes_the_shared_tile():
  """With GQA and a window, softcap, sinks or segment ids, FA3's d128
  layout spilled 4-184 B; the shared tile compiles with 0 (issue 43), at
  dV 128 and 64, and fuses. Deterministic, softcap's derivative tile
  spilled the own tiles: the shared preset of a score_mod. Without GQA,
  without a modifier, or at 128/96 (no 32-column halves of V) the own
  tiles stay."""
  own = Sm90BackwardConfig(64, 64, 2, 2, 1)
  shared = Sm90BackwardConfig(64, 64, 2, 2, 2)
  det_shared = Sm90BackwardConfig(64, 64, 2, 2, 2, 2, 1)

  def spec_of(hq, dv=128, **options):
    q = jax.ShapeDtypeStruct((1, 1024, hq, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((1, 1024, 2, dv), jnp.bfloat16)
    return make_spec(q, k, v, causal=True, **options)

  pick = lambda *a, **kw: sm90_bwd_config.default_backward_config(
    spec_of(*a, **kw)
  )
  for options in (
    dict(window_size=(256, None)),
    dict(softcap=30.0),
    dict(sinks=True),
    dict(segmented=True),
  ):
    assert pick(8, **options) == shared, options
    assert sm90_bwd_config.fused_backward(spec_of(8, **options), shared)
    assert pick(8, dv=64, **options) == shared, options
    assert pick(2, **options) == own, options  # no GQA group
    assert pick(8, dv=96, **options) == own, options
    det = det_shared if "softcap" in options else own
    assert pick(8, deterministic=True, **options) == det, options
  assert pick(2, softcap=30.0, deterministic=True) == own
  assert pick(8, dv=96, softcap=30.0, deterministic=True) == own
  assert pick(8) == own  # GQA alone: FA3's layout


def test_fused_only_configs_are_validated_by_mode():
  """d 128 with two own-tile consumers at 3 stages: fused only (the
  deterministic dK/dV kernel's measured room of 192 registers holds at 2
  stages; other forms keep 128), while at 2 stages both modes run it."""
  two_stages = Sm90BackwardConfig(64, 64, 2, 2, 1)
  for deterministic in (False, True):
    assert (
      sm90_bwd_config.backward_config_unsupported(
        two_stages, 128, 2, deterministic
      )
      is None
    )
  config = Sm90BackwardConfig(64, 64, 3, 2, 1)
  assert (
    sm90_bwd_config.backward_config_unsupported(config, 128, 2, False) is None
  )
  reason = sm90_bwd_config.backward_config_unsupported(config, 128, 2, True)
  assert reason and "registers" in reason


# -- lowering for CUDA ---------------------------------------------------------


def _fused_configs():
  # The default run lowers the first fused config of each head dim (the
  # defaults are compiled by the aot tier); the rest under -m slow.
  for d in sm90_config.KERNEL_HEAD_DIMS:
    first = True
    for config in sm90_bwd_config.backward_config_space(d, 2, False):
      if sm90_bwd_config.fused_unsupported(config, d, 2) is None:
        marks = [] if first else [pytest.mark.slow]
        yield pytest.param(d, config, id=case_id(d, config), marks=marks)
        first = False
  # FA3's d128 layout, outside the space.
  config = Sm90BackwardConfig(64, 64, 2, 2, 1)
  yield pytest.param(128, config, id=case_id(128, config))


def _assert_fused_lowering(text: str, sq: int, skv: int, kernels: int = 1):
  assert_lowered_attention(text, kernels=kernels, seq_q=sq, seq_kv=skv)
  assert "cp.reduce.async.bulk.tensor" in text  # dQ by TMA reduce-add
  assert "output_operand_alias" in text  # into the aliased accumulator


@pytest.mark.newest
@pytest.mark.parametrize("head_dim,config", list(_fused_configs()))
def test_every_fused_config_lowers_to_one_kernel(head_dim, config):
  for causal, (sq, skv, hq, hk) in (
    (True, (1000, 1100, 4, 2)),
    (False, (257, 320, 3, 1)),
  ):
    q = jax.ShapeDtypeStruct((2, sq, hq, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, skv, hk, head_dim), jnp.bfloat16)
    spec = make_spec(q, kv, kv, causal=causal)
    stats = jax.ShapeDtypeStruct((2, hq, sq), jnp.float32)
    fn = jax.jit(lambda *a: sm90_bwd.sm90_backward(spec, config, *a))
    exported = export.export(fn, platforms=["cuda"])(
      q, kv, kv, q, stats, q, stats
    )
    _assert_fused_lowering(exported.mlir_module(), sq, skv)


def _loss(deterministic):
  def loss(q, k, v):
    out, lse = pallas_fa3.flash_attention(
      q,
      k,
      v,
      causal=True,
      return_lse=True,
      implementation="mosaic",
      deterministic=deterministic,
    )
    return out.astype(jnp.float32).sum() + lse.sum()

  return loss


@pytest.mark.newest
@pytest.mark.parametrize("head_dim", [64, 128, 192])
def test_grad_and_vmap_of_mosaic_lower_to_two_kernels(head_dim):
  """`jax.grad` (and `vmap` of it) through "mosaic" with the default
  deterministic=False: the forward and the fused backward."""
  q = jax.ShapeDtypeStruct((2, 384, 4, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 384, 2, head_dim), jnp.bfloat16)
  grad = jax.grad(_loss(False), argnums=(0, 1, 2))
  exported = export.export(jax.jit(grad), platforms=["cuda"])(q, kv, kv)
  _assert_fused_lowering(exported.mlir_module(), 384, 384, kernels=2)
  stacked = [jax.ShapeDtypeStruct((3,) + x.shape, x.dtype) for x in (q, kv)]
  exported = export.export(jax.jit(jax.vmap(grad)), platforms=["cuda"])(
    stacked[0], stacked[1], stacked[1]
  )
  _assert_fused_lowering(exported.mlir_module(), 384, 384, kernels=2)
  assert "6x384x4" in exported.mlir_module()  # vmap folded into the batch
