"""The sm90 deterministic backward (`deterministic=True`: the dK/dV and dQ
kernels) on a CPU: interpret mode and CUDA lowering; the fused kernel is in
test_sm90_fused_bwd.py.

Interpret mode runs the dK/dV and dQ kernels at small shapes against the
float64 golden gradients with the tolerance rule, race detection on, under
a timeout; two runs must be bit-equal. Lowering covers `jax.grad` of every
supported config. The deviceless sm_90a compile is in test_sm90_aot.py.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import case_id
from jax import export

import pallas_fa3
from pallas_fa3 import reference
from pallas_fa3.kernels.sm90 import (
  backward as sm90_bwd,
  compat,
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


def _interpret_grads(spec, config, q, k, v, dout, dlse=None):
  out, lse = reference.reference_forward(spec, q, k, v)
  out = out.astype(spec.dtype)
  dlse = jnp.zeros_like(lse) if dlse is None else dlse
  params = compat.interpret_params(detect_races=True)
  try:
    with compat.capture_race_report() as report:
      grads = jax.block_until_ready(
        sm90_bwd.sm90_backward(
          spec, config, q, k, v, out, lse, dout, dlse, interpret=params
        )
      )
  except Exception:
    compat.reset_interpret_state()
    raise
  assert not compat.races_found(), report.getvalue()[-3000:]
  return grads


_CASES = [
  # GQA, non-causal, ragged kv; dK/dV summed over 2 query heads.
  (
    Shape(1, 128, 150, 2, 1, 64),
    jnp.bfloat16,
    False,
    Sm90BackwardConfig(64, 64, 2),
  ),
  # causal, sq < skv, ragged both; 3 stages: the Q/dO ring wraps; one
  # dK/dV consumer warpgroup.
  (
    Shape(1, 200, 260, 1, 1, 64),
    jnp.float16,
    True,
    Sm90BackwardConfig(64, 64, 3, 1),
  ),
  # causal, sq > skv: rows that see no key (lse = -inf; a whole dQ CTA
  # of them) get zero dq.
  (
    Shape(1, 200, 70, 1, 1, 64),
    jnp.bfloat16,
    True,
    Sm90BackwardConfig(64, 64, 2),
  ),
  # d 128 (one dK/dV consumer: two do not fit the registers), MQA.
  (
    Shape(1, 100, 128, 2, 1, 128),
    jnp.bfloat16,
    True,
    Sm90BackwardConfig(64, 64, 2, 1),
  ),
  # d 256 (the default): two dK/dV consumers sharing each K/V tile, each
  # with half of dK/dV's head dim, exchanging P and dS through shared
  # memory; two dQ consumers sharing each query tile the same way; MQA.
  (
    Shape(1, 100, 130, 2, 1, 256),
    jnp.bfloat16,
    True,
    Sm90BackwardConfig(64, 64, 2, 2, 2, 2, 2),
  ),
  # d 256 with the head dim split across two CTAs per K/V tile (query
  # tiles in halves) and one dQ consumer taking K/V tiles in halves:
  # selectable, outside the config space, so only in the slow run.
  pytest.param(
    Shape(1, 100, 130, 2, 1, 256),
    jnp.bfloat16,
    True,
    Sm90BackwardConfig(64, 64, 2, 1, 2, 1),
    marks=pytest.mark.slow,
  ),
  # The shared-tile layout at d 128, fp16, 3 stages (ring and the P/dS
  # parity buffers wrap), GQA.
  (
    Shape(1, 200, 260, 2, 1, 128),
    jnp.float16,
    True,
    Sm90BackwardConfig(64, 64, 3, 2, 2, 2),
  ),
  # ... at d 64 with 128-key tiles (64-column halves of S), non-causal,
  # one dQ consumer (slow run only: both layouts are covered above).
  pytest.param(
    Shape(1, 130, 300, 2, 1, 64),
    jnp.bfloat16,
    False,
    Sm90BackwardConfig(64, 128, 2, 2, 2, 1),
    marks=pytest.mark.slow,
  ),
  # d 192 (96-column halves), the default layout, causal sq > skv, fp16,
  # 3 stages.
  (
    Shape(1, 130, 70, 1, 1, 192),
    jnp.float16,
    True,
    Sm90BackwardConfig(64, 64, 3, 2, 2, 2, 2),
  ),
  # One query head a K/V head: the dK/dV consumers' pipelined loop (dK's
  # GEMM in flight into the next step, which releases the last step's
  # slot). Causal with a whole tile as offset at d 64, 3 stages wrapping
  # the ring (the masked diagonal's loop first, then the pipelined one),
  # and not causal with ragged tails at d 128 (the default tiling).
  (
    Shape(1, 200, 264, 2, 2, 64),
    jnp.bfloat16,
    True,
    Sm90BackwardConfig(64, 64, 3),
  ),
  (
    Shape(1, 150, 140, 2, 2, 128),
    jnp.bfloat16,
    False,
    Sm90BackwardConfig(64, 64, 2),
  ),
  # block_q 128 at d 64: one dQ consumer (128 rows) taking K/V in halves.
  (
    Shape(1, 200, 260, 2, 1, 64),
    jnp.bfloat16,
    True,
    Sm90BackwardConfig(128, 64, 2, 1, 1, 1),
  ),
]


@pytest.mark.timeout(_TIMEOUT_S)
@pytest.mark.parametrize("shape,dtype,causal,config", _CASES, ids=case_id)
def test_interpret_gradients_match_golden(shape, dtype, causal, config, key):
  q, k, v, dout = random_inputs(key, shape, dtype)
  spec = make_spec(q, k, v, causal=causal, deterministic=True)
  assert (
    sm90_bwd_config.backward_config_unsupported(config, shape.head_dim, 2)
    is None
  )
  dq, dk, dv = _interpret_grads(spec, config, q, k, v, dout)
  golden, naive = golden_and_naive(q, k, v, dout, causal=causal)
  for name, x, arg, n, g in zip(
    ("dq", "dk", "dv"), (dq, dk, dv), (q, k, v), naive[2:], golden[2:]
  ):
    assert x.dtype == dtype and x.shape == arg.shape, name
    assert_within_tolerance(name, x, n, g)
  if causal and shape.seq_q > shape.seq_kv:
    assert np.all(np.asarray(dq[:, : shape.seq_q - shape.seq_kv]) == 0)


@pytest.mark.timeout(2 * _TIMEOUT_S)
@pytest.mark.parametrize(
  "head_dim,config",
  [
    # The newest-JAX tier runs the first (its d256 twin is the same check).
    pytest.param(64, Sm90BackwardConfig(64, 64, 2), marks=pytest.mark.newest),
    (256, Sm90BackwardConfig(64, 64, 2, 2, 2, 2, 2)),  # P/dS exchanges
  ],
)
def test_interpret_gradients_are_bitwise_deterministic_with_lse_cotangent(
  key, head_dim, config
):
  shape = Shape(1, 70, 100, 1, 1, head_dim)
  q, k, v, dout = random_inputs(key, shape, jnp.bfloat16)
  dlse = jax.random.normal(jax.random.fold_in(key, 1), (1, 1, 70))
  spec = make_spec(q, k, v, causal=True, deterministic=True)
  first = _interpret_grads(spec, config, q, k, v, dout, dlse)
  second = _interpret_grads(spec, config, q, k, v, dout, dlse)
  for name, a, b in zip(("dq", "dk", "dv"), first, second):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
  golden, naive = golden_and_naive(q, k, v, dout, causal=True, dlse=dlse)
  for name, x, n, g in zip(("dq", "dk", "dv"), first, naive[2:], golden[2:]):
    assert_within_tolerance(name, x, n, g)


# -- lowering for CUDA ---------------------------------------------------------


def _backward_configs():
  # The default run lowers the first config of each head dim's space in
  # bfloat16, and float16 (which changes only the wgmma's input type) at
  # d128; the default configs are compiled by the aot tier; every config of
  # every space, here and compiled by `pallas-fa3 aot`, under -m slow.
  for dtype in ("bfloat16", "float16"):
    for d in sm90_config.KERNEL_HEAD_DIMS:
      for i, config in enumerate(sm90_bwd_config.backward_config_space(d)):
        default = i == 0 and (dtype == "bfloat16" or d == 128)
        slow = [] if default else [pytest.mark.slow]
        yield pytest.param(
          dtype, d, config, id=case_id(dtype, d, config), marks=slow
        )


@pytest.mark.newest
@pytest.mark.parametrize("dtype,head_dim,config", list(_backward_configs()))
def test_every_backward_config_lowers_for_cuda(dtype, head_dim, config):
  for causal, (sq, skv, hq, hk) in (
    (True, (1000, 1100, 4, 2)),
    (False, (257, 320, 3, 1)),
  ):
    q = jax.ShapeDtypeStruct((2, sq, hq, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((2, skv, hk, head_dim), dtype)
    spec = make_spec(q, kv, kv, causal=causal, deterministic=True)
    stats = jax.ShapeDtypeStruct((2, hq, sq), jnp.float32)
    fn = jax.jit(
      lambda q, k, v, o, lse, do, dlse: sm90_bwd.sm90_backward(
        spec, config, q, k, v, o, lse, do, dlse
      )
    )
    exported = export.export(fn, platforms=["cuda"])(
      q, kv, kv, q, stats, q, stats
    )
    assert_lowered_attention(
      exported.mlir_module(), kernels=2, seq_q=sq, seq_kv=skv
    )  # dK/dV and dQ


@pytest.mark.newest
@pytest.mark.parametrize("head_dim", sm90_config.KERNEL_HEAD_DIMS)
def test_grad_of_mosaic_exports_for_cuda(head_dim):
  """`jax.grad` through `implementation="mosaic"`: kernels where they fit."""
  q = jax.ShapeDtypeStruct((2, 384, 4, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 384, 2, head_dim), jnp.bfloat16)

  def loss(q, k, v):
    out, lse = pallas_fa3.flash_attention(
      q,
      k,
      v,
      causal=True,
      return_lse=True,
      implementation="mosaic",
      deterministic=True,
    )
    return out.astype(jnp.float32).sum() + lse.sum()

  spec = make_spec(q, kv, kv, causal=True, deterministic=True)
  reason = sm90_bwd_config.backward_unsupported(spec)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    exported = export.export(
      jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["cuda"]
    )(q, kv, kv)
  fallback = [w for w in caught if "blockwise recomputation" in str(w.message)]
  # Forward, dK/dV, dQ; or, where no backward tiling fits, said (not silent)
  # and the forward is still the kernel.
  assert_lowered_attention(
    exported.mlir_module(),
    kernels=3 if reason is None else 1,
    seq_q=q.shape[1],
    seq_kv=kv.shape[1],
  )
  assert bool(fallback) == (reason is not None)
  if fallback:
    assert reason in str(fallback[0].message)


@pytest.mark.parametrize(
  "head_dim,config,kernel",
  [
    (256, Sm90BackwardConfig(64, 64, 3, 1, 2, 1), "dkdv"),
    (128, Sm90BackwardConfig(128, 128, 4, 1, 1, 2), "dkdv"),
    (96, Sm90BackwardConfig(64, 128, 4, 1, 1, 2), "dq"),
    (128, Sm90BackwardConfig(64, 128, 3, 1, 1, 2, 2), "dq"),  # shared rows
  ],
)
def test_backward_smem_estimate_is_exactly_what_mosaic_allocates(
  head_dim, config, kernel
):
  """A config rejected for shared memory fails lowering with the estimate's
  number for the first kernel over the limit (dK/dV is lowered first)."""
  reason = sm90_bwd_config.backward_config_unsupported(config, head_dim, 2)
  assert reason and "shared memory" in reason
  q = jax.ShapeDtypeStruct((1, 512, 2, head_dim), jnp.bfloat16)
  stats = jax.ShapeDtypeStruct((1, 2, 512), jnp.float32)
  spec = make_spec(q, q, q, deterministic=True)
  fn = jax.jit(lambda *a: sm90_bwd.sm90_backward(spec, config, *a))
  with pytest.raises(ValueError, match="exceeds available shared memory") as e:
    export.export(fn, platforms=["cuda"])(q, q, q, q, stats, q, stats)
  used = int(re.search(r"smem_bytes=(\d+)", str(e.value)).group(1))
  sizes = sm90_bwd_config.backward_kernel_smem_bytes(config, head_dim, 2)
  assert used == sizes[kernel] > sm90_config.MAX_SMEM_BYTES


def test_every_head_dim_has_a_backward_kernel_config():
  for d in sm90_config.KERNEL_HEAD_DIMS:
    q = jax.ShapeDtypeStruct((1, 128, 2, d), jnp.bfloat16)
    spec = make_spec(q, q, q, deterministic=True)
    assert sm90_bwd_config.backward_unsupported(spec) is None, d
    config = sm90_bwd_config.default_backward_config(spec)
    assert config in sm90_bwd_config.backward_config_space(d)
    # Head-dim splits only where nothing else fits; never recomputation.
    assert (config.dkdv_head_splits == 2) == (d >= 192), (d, config)
    assert (config.dq_head_splits == 2) == (d >= 192), (d, config)
    assert config.dkdv_consumers == 2 or config.dkdv_head_splits == 1
    assert config.dq_consumers == 2


def test_deterministic_defaults_have_two_consumers_up_to_d128():
  """Two dK/dV consumers owning 64 keys each (0 spills at 64 x 64 x 2 over
  the backward shapes, issue 43), not one; 64/192 (4 B) keeps the shared
  tile."""
  for d, dv in ((96, 96), (128, 128), (96, 128), (128, 64)):
    q = jax.ShapeDtypeStruct((1, 1000, 4, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 1100, 2, d), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((1, 1100, 2, dv), jnp.bfloat16)
    spec = make_spec(q, k, v, causal=True, deterministic=True)
    config = sm90_bwd_config.default_backward_config(spec)
    assert config == Sm90BackwardConfig(64, 64, 2, 2, 1, 2, 1), (d, dv)
  space = sm90_bwd_config.backward_config_space(64, 2, True, 192)
  assert Sm90BackwardConfig(64, 64, 2, 2, 1, 2, 1) not in space


def test_head_split_needs_32_column_chunks():
  reason = sm90_bwd_config.backward_config_unsupported(
    Sm90BackwardConfig(64, 64, 2, 1, 2, 2), 96, 2
  )
  assert reason and "48-column chunks" in reason and "multiples of 32" in reason


def test_backward_config_validation_names_the_field():
  with pytest.raises(ValueError, match=r"Sm90BackwardConfig\.block_kv .* 32"):
    Sm90BackwardConfig(block_kv=32)
  with pytest.raises(TypeError, match=r"Sm90BackwardConfig\.num_stages"):
    Sm90BackwardConfig(num_stages="2")
  with pytest.raises(
    ValueError, match=r"Sm90BackwardConfig\.dkdv_head_splits .* 4"
  ):
    Sm90BackwardConfig(dkdv_head_splits=4)
  with pytest.raises(
    ValueError, match=r"Sm90BackwardConfig\.dq_consumers .* 3"
  ):
    Sm90BackwardConfig(dq_consumers=3)
  with pytest.raises(
    ValueError, match=r"dq_head_splits=2 needs dq_consumers=2"
  ):
    Sm90BackwardConfig(dq_consumers=1, dq_head_splits=2)


def test_deterministic_flag_is_validated():
  x = jnp.ones((1, 8, 1, 64), jnp.bfloat16)
  with pytest.raises(TypeError, match="deterministic must be a bool"):
    pallas_fa3.flash_attention(x, x, x, deterministic=1)
