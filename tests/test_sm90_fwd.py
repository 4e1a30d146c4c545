"""The sm90 forward kernel on a CPU: interpret mode, CUDA lowering, config.

Tier 1 (interpret mode) runs the kernel itself at small shapes against the
float64 golden with the tolerance rule, with race detection on, each under a
timeout (a missing barrier wait can hang the interpreter). Tier 2 lowers
every supported config for CUDA with `jax.export`. Tier 3 (the deviceless
sm_90a compile) lives in `test_sm90_aot.py`.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import case_id
from jax import export

import pallas_fa3
from pallas_fa3.kernels.sm90 import (
  compat,
  config as sm90_config,
  forward as sm90_fwd,
)
from pallas_fa3.kernels.sm90.config import Sm90ForwardConfig
from pallas_fa3.spec import make_spec
from pallas_fa3.testing import (
  Shape,
  assert_lowered_attention,
  assert_within_tolerance,
  golden_and_naive,
  random_inputs,
)

_INTERPRET_TIMEOUT_S = 240


def _interpret(spec, config, q, k, v):
  """Runs the kernel in interpret mode with race detection; (out, lse)."""
  params = compat.interpret_params(detect_races=True)
  try:
    with compat.capture_race_report() as report:
      out, lse = sm90_fwd.sm90_forward(spec, config, q, k, v, interpret=params)
      out, lse = jax.block_until_ready((out, lse))
  except Exception:
    compat.reset_interpret_state()
    raise
  assert not compat.races_found(), report.getvalue()[-3000:]
  return out, lse


def _check(key, shape, dtype, causal, config):
  q, k, v, dout = random_inputs(key, shape, dtype)
  spec = make_spec(q, k, v, causal=causal)
  assert sm90_config.forward_unsupported(spec, config) is None
  out, lse = _interpret(spec, config, q, k, v)
  golden, naive = golden_and_naive(q, k, v, dout, causal=causal)
  assert out.dtype == dtype and out.shape == q.shape
  assert lse.dtype == jnp.float32 and lse.shape == (
    shape.batch,
    shape.heads_q,
    shape.seq_q,
  )
  # Never-written memory reads as NaN in the interpreter, so a row the
  # kernel forgot to write fails here as well as against the golden.
  np.testing.assert_array_equal(
    np.isneginf(np.asarray(lse)), np.isneginf(golden[1])
  )
  assert_within_tolerance("out", out, naive[0], golden[0])
  assert_within_tolerance("lse", lse, naive[1], golden[1])
  return out, lse, (q, k, v)


_CASES = [
  # (shape, dtype, causal, config)
  # GQA, ragged kv, non-causal; kv 330 / 64 = 6 steps through 2 slots:
  # the ring wraps twice.
  (
    Shape(1, 200, 330, 2, 1, 64),
    jnp.bfloat16,
    False,
    Sm90ForwardConfig(64, 64, 2),
  ),
  # causal, sq < skv (bottom-right: every row sees a prefix plus the offset)
  (
    Shape(1, 130, 400, 2, 1, 64),
    jnp.float16,
    True,
    Sm90ForwardConfig(64, 64, 3),
  ),
  # MQA, d 128, 128-row K/V tiles, ragged q
  (
    Shape(2, 70, 300, 2, 1, 128),
    jnp.bfloat16,
    True,
    Sm90ForwardConfig(64, 128, 2),
  ),
  # block_q 128 per consumer (a 256-row CTA), fp16
  (
    Shape(1, 256, 256, 1, 1, 64),
    jnp.float16,
    True,
    Sm90ForwardConfig(128, 64, 4),
  ),
  # The persistent grid: 3 query tiles x 4 heads = 12 tiles of 1-3 K/V steps
  # on the interpreter's 2 CTAs, longest first; the ring runs on across
  # tiles of different lengths, so a tile's first step lands in any slot.
  (
    Shape(1, 260, 260, 4, 2, 64),
    jnp.bfloat16,
    True,
    Sm90ForwardConfig(64, 128, 3),
  ),
  # One CTA per query tile (the form d256 uses), ragged, GQA.
  (
    Shape(2, 200, 330, 2, 1, 64),
    jnp.bfloat16,
    True,
    Sm90ForwardConfig(64, 64, 2, persistent=False),
  ),
  # Without the intra-warpgroup overlap (d256 flex's form), causal with
  # sq < skv, the persistent ring wrapping across tiles.
  (
    Shape(1, 200, 330, 2, 1, 64),
    jnp.bfloat16,
    True,
    Sm90ForwardConfig(64, 64, 3, overlap=False),
  ),
]


@pytest.mark.timeout(_INTERPRET_TIMEOUT_S)
@pytest.mark.parametrize("shape,dtype,causal,config", _CASES, ids=case_id)
def test_interpret_matches_golden(shape, dtype, causal, config, key):
  _check(key, shape, dtype, causal, config)


@pytest.mark.newest
@pytest.mark.timeout(_INTERPRET_TIMEOUT_S)
def test_interpret_rows_without_keys_are_zero_with_neg_inf_lse(key):
  shape = Shape(1, 300, 110, 2, 1, 64)
  out, lse, (q, k, v) = _check(
    key, shape, jnp.bfloat16, True, Sm90ForwardConfig(64, 64, 2)
  )
  n_empty = shape.seq_q - shape.seq_kv
  assert np.all(np.asarray(out[:, :n_empty]) == 0)
  assert np.all(np.isneginf(np.asarray(lse[..., :n_empty])))
  # The first row that sees a key sees exactly key 0.
  np.testing.assert_array_equal(
    np.asarray(out[:, n_empty]), np.repeat(np.asarray(v[:, 0]), 2, axis=1)
  )


@pytest.mark.timeout(_INTERPRET_TIMEOUT_S)
def test_interpret_is_the_blockwise_function(key):
  """Same tiles, same P rounding: the kernel and its twin agree closely."""
  shape = Shape(1, 128, 192, 2, 1, 64)
  q, k, v, _ = random_inputs(key, shape, jnp.bfloat16)
  spec = make_spec(q, k, v, causal=True)
  out, lse = _interpret(spec, Sm90ForwardConfig(64, 64, 2), q, k, v)
  twin = pallas_fa3.flash_attention(
    q,
    k,
    v,
    causal=True,
    return_lse=True,
    implementation="blockwise",
    config=pallas_fa3.BlockwiseConfig(block_q=64, block_kv=64),
  )
  # Only the order of the O rescale differs (alpha * O + P V vs the wgmma
  # accumulating into the rescaled O): within one bf16 ulp of the output.
  np.testing.assert_allclose(
    np.float32(out), np.float32(twin[0]), atol=2**-7, rtol=2**-7
  )
  np.testing.assert_allclose(
    np.asarray(lse), np.asarray(twin[1]), atol=1e-5, rtol=1e-6
  )


@pytest.mark.newest
@pytest.mark.timeout(_INTERPRET_TIMEOUT_S)
def test_interpret_backend_with_gradients(key):
  """`implementation="interpret"` through jit and grad (backward: blockwise)."""
  shape = Shape(1, 100, 140, 2, 1, 64)
  q, k, v, dout = random_inputs(key, shape, jnp.bfloat16)

  @jax.jit
  def run(q, k, v):
    f = lambda q, k, v: pallas_fa3.flash_attention(
      q, k, v, causal=True, implementation="interpret"
    )
    out, pullback = jax.vjp(f, q, k, v)
    return (out,) + pullback(dout)

  got = run(q, k, v)
  golden, naive = golden_and_naive(q, k, v, dout, causal=True)
  for name, x, n, g in zip(
    ("out", "dq", "dk", "dv"),
    got,
    (naive[0],) + naive[2:],
    (golden[0],) + golden[2:],
  ):
    assert_within_tolerance(name, x, n, g)


# -- tier 2: lowering for CUDA ---------------------------------------------------


def _lower(spec, config):
  shapes = [
    jax.ShapeDtypeStruct(s, spec.dtype)
    for s in (
      (spec.batch, spec.seq_q, spec.heads_q, spec.head_dim),
      (spec.batch, spec.seq_kv, spec.heads_kv, spec.head_dim),
      (spec.batch, spec.seq_kv, spec.heads_kv, spec.head_dim_v),
    )
  ]
  fn = jax.jit(lambda q, k, v: sm90_fwd.sm90_forward(spec, config, q, k, v))
  return export.export(fn, platforms=["cuda"])(*shapes)


def _every_supported_config():
  # The default run lowers the first config of each head dim's space in
  # bfloat16, and float16 (which changes only the wgmma's input type) at
  # d128; the default configs are compiled by the aot tier; every config of
  # every space, here and compiled by `pallas-fa3 aot`, under -m slow.
  for dtype in ("bfloat16", "float16"):
    for d in sm90_config.KERNEL_HEAD_DIMS:
      for i, config in enumerate(sm90_config.forward_config_space(d)):
        default = i == 0 and (dtype == "bfloat16" or d == 128)
        yield pytest.param(
          dtype,
          d,
          config,
          id=f"{dtype}-d{d}-{config.block_q}x"
          f"{config.block_kv}x{config.num_stages}",
          marks=[] if default else [pytest.mark.slow],
        )


@pytest.mark.newest
@pytest.mark.parametrize(
  "dtype,head_dim,config", list(_every_supported_config())
)
def test_every_supported_config_lowers_for_cuda(dtype, head_dim, config):
  for causal, (sq, skv, hq, hk) in (
    (True, (1000, 1100, 4, 2)),
    (False, (257, 320, 3, 1)),
  ):
    q = jax.ShapeDtypeStruct((2, sq, hq, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((2, skv, hk, head_dim), dtype)
    exported = _lower(make_spec(q, kv, kv, causal=causal), config)
    assert_lowered_attention(
      exported.mlir_module(), kernels=1, seq_q=sq, seq_kv=skv
    )


@pytest.mark.parametrize(
  "head_dim,head_dim_v,config",
  [
    (128, 128, Sm90ForwardConfig(64, 128, 3)),
    (256, 256, Sm90ForwardConfig(64, 128, 2)),
    (64, 64, Sm90ForwardConfig(64, 256, 4)),
    # Q's and O's tiles in one union per consumer (`forward_qo_layout`).
    (192, 256, Sm90ForwardConfig(64, 64, 3, persistent=False)),
    (256, 128, Sm90ForwardConfig(64, 128, 2, persistent=False)),
  ],
)
def test_smem_estimate_is_exactly_what_mosaic_allocates(
  head_dim, head_dim_v, config
):
  """Configs the estimate rejects for shared memory fail lowering with that very number."""
  reason = sm90_config.forward_config_unsupported(
    config, head_dim, 2, head_dim_v
  )
  assert reason and "shared memory" in reason
  q = jax.ShapeDtypeStruct((1, 512, 2, head_dim), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, 512, 2, head_dim_v), jnp.bfloat16)
  with pytest.raises(ValueError, match="exceeds available shared memory") as e:
    _lower(make_spec(q, q, v), config)
  used = int(re.search(r"smem_bytes=(\d+)", str(e.value)).group(1))
  assert used == sm90_config.forward_smem_bytes(config, head_dim, 2, head_dim_v)


@pytest.mark.newest
def test_mosaic_through_flash_attention_exports_with_grad():
  """An explicit `mosaic` traces and lowers on a machine without a GPU, grad included."""
  q = jax.ShapeDtypeStruct((2, 448, 8, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 512, 2, 128), jnp.bfloat16)

  def loss(q, k, v):
    out = pallas_fa3.flash_attention(
      q, k, v, causal=True, implementation="mosaic"
    )
    return out.astype(jnp.float32).sum()

  exported = export.export(
    jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["cuda"]
  )(q, kv, kv)
  # The forward and the fused backward; no score matrix anywhere.
  assert_lowered_attention(
    exported.mlir_module(), kernels=2, seq_q=448, seq_kv=512
  )
  assert [a.shape for a in exported.out_avals] == [q.shape, kv.shape, kv.shape]


# -- config and capability -----------------------------------------------------


@pytest.mark.parametrize(
  "field,value,error",
  [
    ("block_q", 32, ValueError),
    ("block_kv", 96, ValueError),
    ("num_stages", 1, ValueError),
    ("block_q", 64.0, TypeError),
    ("num_stages", True, TypeError),
    ("persistent", 1, TypeError),
    ("overlap", "no", TypeError),
  ],
)
def test_config_validation_names_the_field(field, value, error):
  with pytest.raises(error, match=rf"Sm90ForwardConfig\.{field} .*{value}"):
    Sm90ForwardConfig(**{field: value})


def test_config_is_hashable_static_data():
  a, b = Sm90ForwardConfig(64, 128, 2), Sm90ForwardConfig(64, 128, 2)
  assert a == b and hash(a) == hash(b)
  with pytest.raises(AttributeError):
    a.block_q = 128


def test_serial_order_frees_p_and_is_the_bf16_kernels_only():
  """overlap=False counts S or P, not both, beside O: 64x192x2 at d96
  fits its room where FA3's order does not; the FP8 kernel refuses it."""
  from pallas_fa3.kernels.sm90 import config_fp8

  fa3 = Sm90ForwardConfig(64, 192, 2)
  serial = Sm90ForwardConfig(64, 192, 2, overlap=False)
  assert "tile registers" in sm90_config.forward_config_unsupported(fa3, 96, 2)
  assert sm90_config.forward_config_unsupported(serial, 96, 2) is None
  reason = config_fp8.fp8_forward_config_unsupported(
    Sm90ForwardConfig(64, 128, 2, overlap=False), 128
  )
  assert "overlap=False" in reason


def test_persistent_walk_is_refused_where_it_spills():
  persistent = Sm90ForwardConfig(64, 64, 2)
  per_tile = Sm90ForwardConfig(64, 64, 2, persistent=False)
  reason = sm90_config.forward_config_unsupported(persistent, 256, 2)
  assert "persistent=False" in reason and "head_dim 256" in reason
  assert sm90_config.forward_config_unsupported(per_tile, 256, 2) is None
  assert sm90_config.forward_config_unsupported(persistent, 192, 2) is None
  # Each tiling appears once in the space, persistent wherever that fits.
  for d in sm90_config.KERNEL_HEAD_DIMS:
    space = sm90_config.forward_config_space(d)
    tilings = [(c.block_q, c.block_kv, c.num_stages) for c in space]
    assert len(set(tilings)) == len(tilings)
    assert all(c.persistent == (d <= 192) for c in space)


@pytest.mark.parametrize("head_dim", sm90_config.KERNEL_HEAD_DIMS)
def test_default_config_is_in_the_space(head_dim):
  q = jax.ShapeDtypeStruct((1, 128, 2, head_dim), jnp.bfloat16)
  spec = make_spec(q, q, q)
  assert sm90_config.default_forward_config(
    spec
  ) in sm90_config.forward_config_space(head_dim)


@pytest.mark.newest
@pytest.mark.parametrize(
  "shapes,dtype,match",
  [
    (((1, 64, 2, 64),) * 3, jnp.float32, "dtype float32"),
    (((1, 64, 2, 80),) * 3, jnp.bfloat16, "head_dim 80"),
    (
      ((1, 64, 2, 64), (1, 64, 2, 64), (1, 64, 2, 32)),
      jnp.bfloat16,
      "head_dim_v 32 is not one of the kernel's",
    ),
  ],
)
def test_unsupported_calls_say_why(shapes, dtype, match):
  q, k, v = (jax.ShapeDtypeStruct(s, dtype) for s in shapes)
  assert re.search(match, sm90_config.forward_unsupported(make_spec(q, k, v)))
  with pytest.raises(NotImplementedError, match=match):
    pallas_fa3.flash_attention(
      jnp.ones(shapes[0], dtype),
      jnp.ones(shapes[1], dtype),
      jnp.ones(shapes[2], dtype),
      implementation="interpret",
    )


def test_eager_mosaic_without_a_gpu_says_why():
  if jax.default_backend() == "gpu":
    pytest.skip("checks a machine without a GPU")
  x = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
  with pytest.raises(
    NotImplementedError,
    match=r"implementation='mosaic' cannot run here: no GPU",
  ):
    pallas_fa3.flash_attention(x, x, x, implementation="mosaic")
