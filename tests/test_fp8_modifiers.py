"""FP8 attention with windows, softcap, sinks and segment ids (issue 34):
the FP8 kernel in interpret mode against its blockwise twin (the same
steps), the twin's error against the float64 golden (relative RMSE within
1.5x of plain FP8's on the same inputs), tile skipping, and the CUDA
lowering with every option."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import pallas_fa3
from pallas_fa3.reference import golden_attention
from pallas_fa3.testing import Shape, lowered_kernel_count, random_inputs

_TIMEOUT_S = 300
_IDS_Q = np.repeat(np.arange(3), [100, 100, 56])[None].astype(np.int32)
_IDS_K = np.repeat(np.arange(3), [150, 150, 84])[None].astype(np.int32)
_SINKS = np.asarray([0.3, -0.2, 1.0, 0.0], np.float32)
OPTIONS = {
  "window": dict(window_size=(100, None)),
  "softcap": dict(softcap=5.0),
  "sinks": dict(sinks=_SINKS),
  "segment_ids": dict(segment_ids=(_IDS_Q, _IDS_K)),
  "all": dict(
    window_size=(100, None),
    softcap=5.0,
    sinks=_SINKS,
    segment_ids=(_IDS_Q, _IDS_K),
  ),
}


def _inputs(key):
  return random_inputs(key, Shape(1, 256, 384, 4, 2, 128), jnp.bfloat16)[:3]


def _fp8(impl, q, k, v, **options):
  run = lambda q, k, v: pallas_fa3.flash_attention(
    q, k, v, causal=True, fp8=True, implementation=impl, **options
  )
  return np.asarray(jax.jit(run)(q, k, v), np.float64)


def _relative_rmse(out, golden):
  err = np.sqrt(np.mean((out - golden) ** 2))
  return err / np.sqrt(np.mean(golden**2))


@pytest.mark.parametrize("name", list(OPTIONS))
def test_twin_error_stays_within_plain_fp8s(name, key):
  """The error relative to the output's size: a window or documents leave
  each row fewer keys, hence larger outputs, and every implementation's
  absolute error grows with them (bf16's too)."""
  q, k, v = _inputs(key)
  plain_golden, _ = golden_attention(q, k, v, causal=True)
  plain = _relative_rmse(_fp8("blockwise", q, k, v), plain_golden)
  golden, _ = golden_attention(q, k, v, causal=True, **OPTIONS[name])
  got = _relative_rmse(_fp8("blockwise", q, k, v, **OPTIONS[name]), golden)
  assert got <= 1.5 * plain, (name, got, plain)


@pytest.mark.timeout(_TIMEOUT_S)
@pytest.mark.parametrize(
  "name",
  [
    # One at a time under -m slow: "all" runs the same code together.
    pytest.param("window", marks=pytest.mark.slow),
    "all",
    pytest.param("softcap", marks=pytest.mark.slow),
  ],
)
def test_interpret_kernel_is_the_twin(name, key):
  q, k, v = _inputs(key)
  got = _fp8("interpret", q, k, v, **OPTIONS[name])
  twin = _fp8("blockwise", q, k, v, **OPTIONS[name])
  # The same operands and steps; only exp2 and summation order differ.
  np.testing.assert_allclose(got, twin, atol=2e-2)


def test_window_skips_tiles_no_row_reaches(key):
  """K and V NaN on a whole tile no row's window reaches: skipped tiles are
  never read (a read tile would spread NaN through P V)."""
  q, k, v, _ = random_inputs(key, Shape(1, 256, 512, 4, 2, 128), jnp.bfloat16)
  # Rows sit at positions 256..511 and see 64 keys back: no row sees keys
  # 0..191, and the first 128-key tile (the FP8 default's) holds none it does.
  k = k.at[:, :128].set(jnp.nan)
  v = v.at[:, :128].set(jnp.nan)
  out = _fp8("blockwise", q, k, v, window_size=(64, None))
  assert np.all(np.isfinite(out))


@pytest.mark.parametrize("name", list(OPTIONS))
def test_mosaic_lowers_with_every_option(name):
  q = jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)
  opts = dict(OPTIONS[name])
  if "segment_ids" in opts:
    ids = jnp.asarray(np.repeat(np.arange(4), 256)[None].astype(np.int32))
    opts["segment_ids"] = (ids, ids)
  run = lambda q, k, v: pallas_fa3.flash_attention(
    q, k, v, causal=True, fp8=True, implementation="mosaic", **opts
  )
  text = export.export(jax.jit(run), platforms=["cuda"])(
    q, kv, kv
  ).mlir_module()
  # The quantization kernel (3 launches) and the FP8 attention kernel.
  assert lowered_kernel_count(text) >= 4


@pytest.mark.parametrize(
  "name", [pytest.param("window", marks=pytest.mark.slow), "all"]
)  # "window" alone under -m slow: "all" passes it with the rest
def test_prequantized_entry_takes_the_options(name, key):
  """flash_attention_fp8 on `quantize`'s operands computes what
  flash_attention(fp8=True) does with the same options."""
  q, k, v = _inputs(key)
  config = pallas_fa3.BlockwiseConfig(128, 128)
  x = pallas_fa3.fp8.quantize(q, k, v, block_q=128, block_kv=128)
  got = pallas_fa3.fp8.flash_attention_fp8(
    *x, causal=True, implementation="blockwise", config=config, **OPTIONS[name]
  )
  want = pallas_fa3.flash_attention(
    q,
    k,
    v,
    causal=True,
    fp8=True,
    implementation="blockwise",
    config=config,
    **OPTIONS[name],
  )
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  plain = pallas_fa3.fp8.flash_attention_fp8(
    *x, causal=True, implementation="blockwise", config=config
  )
  assert not np.array_equal(np.asarray(plain), np.asarray(got))


def test_prequantized_entry_checks_the_options(key):
  q, k, v = _inputs(key)
  x = pallas_fa3.fp8.quantize(q, k, v, block_q=128, block_kv=128)
  with pytest.raises(ValueError, match="sinks"):
    pallas_fa3.fp8.flash_attention_fp8(
      *x, implementation="blockwise", sinks=np.zeros(3, np.float32)
    )
  with pytest.raises(ValueError, match="window_size"):
    pallas_fa3.fp8.flash_attention_fp8(
      *x, implementation="blockwise", window_size=(-2, 0)
    )
