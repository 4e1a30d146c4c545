"""DeepSeek MLA decoding in FlashMLA's layout (issue 32's stretch): one KV
head of head_dim 576, 16 query heads, `v_cache=None` with `head_dim_v=512`
(V is the K cache's first 512 columns). The pure-JAX backends against the
float64 golden with FA3's tolerance rule (contiguous, paged, appended
tokens, cache_batch_idx, seq_q 1 and 2, causal / window / softcap / sinks,
split-KV, an e4m3 cache); bit-equality with an explicit sliced v_cache;
no copy of the cache in the compiled step; the refusals, the kernel's
included."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa3
from pallas_fa3.backends import resolve
from pallas_fa3.kvcache import make_decode_spec
from pallas_fa3.reference import golden_decode
from pallas_fa3.testing import (
  assert_within_tolerance,
  decode_case,
  decode_golden_and_naive,
)

D, DV, HQ = 576, 512, 16
call = pallas_fa3.flash_attention_with_kvcache

# (batch, seq_q, capacity, lengths, page_size, seq_new, batch_idx, options)
CASES = [
  pytest.param(
    2, 1, 128, [37, 128], None, 0, False, dict(causal=True),
    id="contiguous-q1-ragged-to-full",
  ),
  pytest.param(
    2, 2, 128, [5, 90], 32, 1, False, dict(causal=True),
    id="paged32-q2-append",
  ),
  pytest.param(
    2, 2, 96, [0, 70], None, 1, True,
    dict(window_size=(40, 0), softcap=8.0, sinks=True),
    id="batch-idx-q2-append-window-softcap-sinks",
  ),
]  # fmt: skip


def _mla_case(rng, b, sq, cap, lengths, ps, new, idx):
  return decode_case(
    rng, batch=b, seq_q=sq, heads_q=HQ, heads_kv=1, head_dim=D,
    head_dim_v=DV, capacity=cap, lengths=lengths, page_size=ps,
    seq_new=new, batch_idx=idx, v_in_k=True,
  )  # fmt: skip


def _sinks(options, rng):
  options = dict(options)
  sinks = None
  if options.pop("sinks", False):
    sinks = jnp.asarray(rng.normal(size=HQ), jnp.float32)
  return options, sinks


@pytest.mark.parametrize("b,sq,cap,lengths,ps,new,idx,options", CASES)
@pytest.mark.parametrize("impl", ["reference", "blockwise"])
def test_against_float64_golden(
  b, sq, cap, lengths, ps, new, idx, options, impl, rng
):
  options, sinks = _sinks(options, rng)
  case = _mla_case(rng, b, sq, cap, lengths, ps, new, idx)
  args, kwargs = case.call_args()
  spec = make_decode_spec(*args, **kwargs, **options, sinks=sinks is not None)
  assert spec.v_in_k and spec.head_dim_v == DV
  for splits in (1, 3) if impl == "blockwise" else (None,):
    result = call(
      *args, **kwargs, **options, sinks=sinks, return_lse=True,
      num_splits=splits, implementation=impl,
    )  # fmt: skip
    out, lse = result[:2]
    assert out.shape == (b, sq, HQ, DV) and len(result) == (3 if new else 2)
    k_cache = result[2] if new else case.k_cache
    golden, naive = decode_golden_and_naive(spec, case, k_cache, None, sinks)
    for name, got, n, g in zip(("out", "lse"), (out, lse), naive, golden):
      assert_within_tolerance(f"{name} splits={splits}", got, n, g)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
def test_equals_an_explicit_sliced_v_cache(impl, rng):
  """v_cache=None computes what v_cache=k_cache[..., :512] (and v = k's
  columns) computes, bit for bit; the one returned cache holds the new
  tokens."""
  case = _mla_case(rng, 2, 1, 64, [20, 50], 16, 2, False)
  args, kwargs = case.call_args()
  opts = dict(causal=True, return_lse=True, implementation=impl)
  out, lse, kc = call(*args, **kwargs, **opts, num_splits=2)
  del kwargs["head_dim_v"]
  q, k_cache, _, k, _ = args
  v_cache, v = k_cache[..., :DV], k[..., :DV]
  out2, lse2, kc2, vc2 = call(q, k_cache, v_cache, k, v, **kwargs, **opts)
  if impl == "reference":  # (blockwise: 2 splits vs 1, the same to rounding)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out2))
  np.testing.assert_allclose(
    np.asarray(out, np.float32), np.asarray(out2, np.float32), atol=2e-2
  )
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse2), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(kc), np.asarray(kc2))
  np.testing.assert_array_equal(np.asarray(kc[..., :DV]), np.asarray(vc2))


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
def test_e4m3_cache_dequantized_by_k_descale(impl, rng):
  """quantize_kv_cache(k_cache, None) gives one e4m3 cache and k_descale;
  V is its first 512 columns times k_descale (appended k quantized once)."""
  case = _mla_case(rng, 2, 1, 64, [30, 63], 32, 1, False)
  x = pallas_fa3.quantize_kv_cache(
    case.k_cache, None, page_table=case.page_table,
    cache_seqlens=case.cache_seqlens,
  )  # fmt: skip
  assert x.v_cache is None and x.v_descale is None
  args, kwargs = case.call_args()
  out, lse, k8 = call(
    case.q, x.k_cache, None, case.k, **kwargs, causal=True,
    k_descale=x.k_descale, return_lse=True, implementation=impl,
  )  # fmt: skip
  assert k8.dtype == jnp.float8_e4m3fn
  spec = make_decode_spec(
    case.q, k8, None, case.k, **kwargs, causal=True
  )  # fmt: skip
  lengths = np.asarray(case.cache_seqlens) + 1
  g_out, g_lse = golden_decode(
    spec, case.q, k8, None, lengths, None, case.page_table,
    descale=(x.k_descale, x.k_descale),
  )  # fmt: skip
  got = np.asarray(out, np.float64)
  rmse = np.sqrt(np.mean((got - g_out) ** 2) / np.mean(g_out**2))
  assert rmse <= 1e-2  # the bf16 output's rounding (tests/test_kvcache_fp8.py)
  np.testing.assert_allclose(np.asarray(lse), g_lse, atol=1e-2)


def test_the_compiled_step_copies_no_cache():
  """Blockwise reads V from the K tiles: no [.., cache_len, 1, 512] array
  (a sliced copy of the cache) in the compiled step, and the donated cache
  is updated in place."""
  S = jax.ShapeDtypeStruct
  b, cap = 2, 4096
  kc = S((b, cap, 1, D), jnp.bfloat16)

  def step(kc, q, k, n):
    return call(q, kc, None, k, cache_seqlens=n, head_dim_v=DV, causal=True)

  text = (
    jax.jit(step, donate_argnums=0)
    .lower(
      kc, S((b, 1, HQ, D), jnp.bfloat16), S((b, 1, 1, D), jnp.bfloat16),
      S((b,), jnp.int32),
    )
    .compile()
    .as_text()
  )  # fmt: skip
  assert f"[{b},{cap},1,{DV}]" not in text
  assert "input_output_alias" in text or "must-alias" in text


def _bad_calls():
  q = jnp.zeros((1, 1, HQ, D), jnp.bfloat16)
  kc = jnp.zeros((1, 64, 1, D), jnp.bfloat16)
  k = kc[:, :1]
  n = 3
  yield (
    "head-dim-v-over-head-dim",
    lambda: call(q, kc, None, cache_seqlens=n, head_dim_v=600),
    ValueError,
    r"head_dim_v \(600\) must be <= k_cache's head_dim \(576\)",
  )
  yield (
    "head-dim-v-missing",
    lambda: call(q, kc, None, cache_seqlens=n),
    ValueError,
    "head_dim_v is required when v_cache is None",
  )
  yield (
    "head-dim-v-not-int",
    lambda: call(q, kc, None, cache_seqlens=n, head_dim_v=512.0),
    TypeError,
    "head_dim_v must be an int",
  )
  yield (
    "v-with-v-cache-none",
    lambda: call(q, kc, None, k, k[..., :DV], cache_seqlens=n, head_dim_v=DV),
    ValueError,
    r"v must be None when v_cache is None.*v.shape=\(1, 1, 1, 512\)",
  )
  yield (
    "k-shape",
    lambda: call(q, kc, None, k[..., :DV], cache_seqlens=n, head_dim_v=DV),
    ValueError,
    r"k must have shape \(1, 1, 1, 576\)",
  )
  yield (
    "head-dim-v-vs-v-cache",
    lambda: call(q, kc, kc[..., :DV], cache_seqlens=n, head_dim_v=256),
    ValueError,
    r"head_dim_v \(256\) must be None or equal v_cache's last dim \(512\)",
  )
  yield (
    "head-dim-over-576",
    lambda: call(
      jnp.zeros((1, 1, HQ, 640), jnp.bfloat16),
      jnp.zeros((1, 64, 1, 640), jnp.bfloat16),
      None,
      cache_seqlens=n,
      head_dim_v=DV,
    ),  # fmt: skip
    ValueError,
    "q head_dim 640 exceeds the maximum 576",
  )
  k8 = kc.astype(jnp.float8_e4m3fn)
  yield (
    "v-descale",
    lambda: call(
      q, k8, None, cache_seqlens=n, head_dim_v=DV, v_descale=1.0
    ),  # fmt: skip
    ValueError,
    "v_descale must be None when v_cache is None",
  )
  yield (
    "cache-rotation",
    lambda: call(
      q, k8, None, cache_seqlens=n, head_dim_v=DV, cache_rotation=True
    ),  # fmt: skip
    ValueError,
    "cache_rotation cannot be combined with v_cache=None",
  )
  yield (
    "quantize-rotation",
    lambda: pallas_fa3.quantize_kv_cache(kc, None, rotation=True),
    ValueError,
    "rotation cannot be combined with v_cache=None",
  )
  for impl in ("interpret", "mosaic"):
    yield (
      f"{impl}-576-512-with-a-v-cache",
      lambda impl=impl: call(
        q, kc, kc[..., :DV], cache_seqlens=n, implementation=impl
      ),
      NotImplementedError,
      r"head_dim 576 / head_dim_v 512 .* 256 registers per thread",
    )
  q256 = jnp.zeros((1, 1, 8, 256), jnp.bfloat16)
  kc256 = jnp.zeros((1, 256, 1, 256), jnp.bfloat16)
  yield (
    "interpret-mla-head-dim-v-192",
    lambda: call(
      q256,
      kc256,
      None,
      cache_seqlens=n,
      head_dim_v=192,
      implementation="interpret",
    ),  # fmt: skip
    NotImplementedError,
    r"head_dim_v 192: the MLA kernel splits V's columns",
  )


@pytest.mark.parametrize(
  "name,fn,error,match", [pytest.param(*c, id=c[0]) for c in _bad_calls()]
)
def test_bad_calls_are_errors_naming_the_argument(name, fn, error, match):
  with pytest.raises(error, match=match):
    fn()


def test_the_mla_kernel_serves_576_512_and_names_what_it_does_not():
  """The Hopper kernels serve the MLA shape (the MLA kernel: the
  automatic choice on a Hopper GPU), from a bf16 or an e4m3 cache."""
  q = jnp.zeros((1, 1, HQ, D), jnp.bfloat16)
  kc = jnp.zeros((1, 64, 1, D), jnp.bfloat16)
  spec = make_decode_spec(q, kc, None, cache_seqlens=3, head_dim_v=DV)
  backend, config = resolve(spec, "mosaic", None)
  assert backend.name == "mosaic" and config.block_kv == 64
  k8 = kc.astype(jnp.float8_e4m3fn)
  spec8 = make_decode_spec(q, k8, None, cache_seqlens=3, head_dim_v=DV)
  backend, config = resolve(spec8, "mosaic", None)
  assert backend.name == "mosaic" and config.block_kv == 64
