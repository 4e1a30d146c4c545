"""Decoding from an e4m3 KV cache (issue 34): `quantize_kv_cache`, every
backend against the float64 golden on the dequantized cache (contiguous,
paged, appended tokens, GQA, garbage past the lengths), the appended
tokens' quantization, the rotation, refusals and the CUDA lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import pallas_fa3
from pallas_fa3 import kvcache
from pallas_fa3.kernels.sm90 import compat
from pallas_fa3.kvcache import make_decode_spec
from pallas_fa3.reference import golden_decode
from pallas_fa3.testing import decode_case, lowered_kernel_count

_TIMEOUT_S = 300
_TIMEOUT = pytest.mark.timeout(_TIMEOUT_S)
F8 = jnp.float8_e4m3fn
# Relative RMSE against the golden on the dequantized cache: the issue's
# target is 3e-2; the products are 16-bit, so the output's own rounding
# (bf16: ~2e-3) is what remains.
_REL_RMSE = 1e-2


def _relative_rmse(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2))


def _fp8_case(rng, column_groups=False, **kw):
  """A bf16 decode case (NaN/Inf past the lengths) and its e4m3 cache."""
  case = decode_case(rng, **kw)
  x = pallas_fa3.quantize_kv_cache(
    case.k_cache,
    case.v_cache,
    page_table=case.page_table,
    cache_seqlens=case.cache_seqlens
    if case.page_table is not None
    else _row_lengths(case),
    column_groups=column_groups,
  )
  return case, x


def _row_lengths(case):
  """Each cache row's tokens (a spare row of cache_batch_idx: 0)."""
  n = case.k_cache.shape[0]
  rows = np.arange(n) if case.cache_batch_idx is None else case.cache_batch_idx
  out = np.zeros(n, np.int32)
  out[np.asarray(rows)] = case.cache_seqlens
  return jnp.asarray(out)


def _call(case, x, impl, **options):
  args, kwargs = case.call_args()
  kd, vd = x.k_descale, x.v_descale
  if case.cache_batch_idx is not None:  # descales per sequence
    kd, vd = kd[case.cache_batch_idx], vd[case.cache_batch_idx]
  return pallas_fa3.flash_attention_with_kvcache(
    case.q, x.k_cache, x.v_cache, case.k, case.v, **kwargs, **options,
    k_descale=kd, v_descale=vd, return_lse=True, implementation=impl,
  ), (kd, vd)  # fmt: skip


def _golden(case, caches, descale, **options):
  args, kwargs = case.call_args()
  sinks = options.pop("sinks", None)
  spec = make_decode_spec(
    case.q, *caches, case.k, case.v, **kwargs, **options,
    sinks=sinks is not None,
  )  # fmt: skip
  lengths = np.asarray(case.cache_seqlens) + spec.seq_new
  return golden_decode(
    spec, case.q, *caches, lengths, case.cache_batch_idx, case.page_table,
    sinks, descale,
  )  # fmt: skip


CASES = [
  pytest.param(
    dict(batch=3, seq_q=1, heads_q=8, heads_kv=2, head_dim=64, capacity=256,
         lengths=[0, 100, 256]), dict(causal=True),
    id="contiguous-g4",
  ),
  pytest.param(
    dict(batch=2, seq_q=2, heads_q=8, heads_kv=1, head_dim=64, capacity=256,
         lengths=[37, 190], page_size=64, seq_new=2),
    dict(window_size=(60, 0), softcap=5.0, sinks=True),
    id="paged64-mqa-append-window-softcap-sinks",
  ),
  pytest.param(
    dict(batch=2, seq_q=1, heads_q=4, heads_kv=4, head_dim=128,
         capacity=192, lengths=[0, 150], seq_new=1, batch_idx=True),
    dict(causal=True),
    id="batch-idx-mha-append-d128",
  ),
  pytest.param(
    dict(batch=2, seq_q=1, heads_q=4, heads_kv=2, head_dim=128,
         head_dim_v=64, capacity=128, lengths=[60, 128], page_size=64),
    dict(causal=True),
    id="paged64-d128-dv64",
  ),
  # Head dims whose e4m3 rows are not whole 128-byte swizzle spans: the
  # converter's chunks are 64 (d192) or 32 (d96) columns wide.
  pytest.param(
    dict(batch=2, seq_q=1, heads_q=4, heads_kv=2, head_dim=192,
         capacity=128, lengths=[60, 128], page_size=64),
    dict(causal=True),
    id="paged64-d192",
  ),
  pytest.param(
    dict(batch=2, seq_q=1, heads_q=2, heads_kv=1, head_dim=192,
         head_dim_v=128, capacity=192, lengths=[1, 150], seq_new=1),
    dict(),
    id="contiguous-d192-dv128-append",
  ),
  pytest.param(
    dict(batch=1, seq_q=2, heads_q=4, heads_kv=2, head_dim=128,
         head_dim_v=192, capacity=128, lengths=[100], page_size=64),
    dict(causal=True),
    id="paged64-d128-dv192",
  ),
  pytest.param(
    dict(batch=2, seq_q=1, heads_q=8, heads_kv=2, head_dim=96,
         capacity=128, lengths=[128, 33]),
    dict(causal=True),
    id="contiguous-d96",
  ),
]  # fmt: skip


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
@pytest.mark.parametrize("kw,options", CASES)
def test_against_golden_on_the_dequantized_cache(impl, kw, options, rng):
  options = dict(options)
  if options.pop("sinks", False):
    options["sinks"] = jnp.asarray(rng.normal(size=kw["heads_q"]), jnp.float32)
  case, x = _fp8_case(rng, **kw)
  result, descale = _call(case, x, impl, **options)
  out, lse = result[:2]
  caches = result[2:] if case.k is not None else (x.k_cache, x.v_cache)
  assert all(c.dtype == F8 for c in caches)
  g_out, g_lse = _golden(case, caches, descale, **options)
  assert _relative_rmse(out, g_out) <= _REL_RMSE
  live = np.isfinite(g_lse)
  np.testing.assert_allclose(np.asarray(lse)[live], g_lse[live], atol=1e-2)
  assert np.all(np.isfinite(np.asarray(out, np.float32)))


# Cases with more than one 128-column group in K or V.
GROUPED = [c for c in CASES if "d192" in c.id or "dv192" in c.id]


@pytest.mark.parametrize(
  "impl",
  ["reference", "blockwise", pytest.param("interpret", marks=_TIMEOUT)],
)
@pytest.mark.parametrize("kw,options", GROUPED)
def test_column_group_descales_against_golden(impl, kw, options, rng):
  """`quantize_kv_cache(column_groups=True)`: one descale per 128-column
  group, `[b, hk, ceil(d / 128)]`, each group's amax at 448; every backend
  against the golden on the cache dequantized per group, and appended
  tokens quantized per group."""
  case, x = _fp8_case(rng, column_groups=True, **kw)
  d, dv = case.k_cache.shape[-1], case.v_cache.shape[-1]
  rows, hk = case.k_cache.shape[0], case.k_cache.shape[2]
  if case.page_table is None:
    assert x.k_descale.shape == (rows, hk, -(-d // 128))
    assert x.v_descale.shape == (rows, hk, -(-dv // 128))
  result, descale = _call(case, x, impl, **options)
  out, lse = result[:2]
  caches = result[2:] if case.k is not None else (x.k_cache, x.v_cache)
  g_out, g_lse = _golden(case, caches, descale, **options)
  assert _relative_rmse(out, g_out) <= _REL_RMSE
  live = np.isfinite(g_lse)
  np.testing.assert_allclose(np.asarray(lse)[live], g_lse[live], atol=1e-2)
  if case.k is not None:  # contiguous here: the slots after each length
    for b, n in enumerate(np.asarray(case.cache_seqlens)):
      row = b if case.cache_batch_idx is None else case.cache_batch_idx[b]
      want = kvcache.quantize_tokens(case.k[b : b + 1], descale[0][b : b + 1])
      np.testing.assert_array_equal(
        np.asarray(caches[0][row, n : n + case.k.shape[1]], np.float32),
        np.asarray(want[0], np.float32),
      )


def test_column_group_descales_keep_a_small_group(rng):
  """V's second 128-column group at 1e-5 of the first: one descale per
  sequence puts it among e4m3's subnormals (its output columns lose
  nearly everything), one per group keeps e4m3's relative error."""
  case = decode_case(
    rng, batch=2, seq_q=1, heads_q=4, heads_kv=2, head_dim=64,
    head_dim_v=256, capacity=128, lengths=[60, 128],
  )  # fmt: skip
  v = np.asarray(case.v_cache, np.float32)
  v[..., 128:] *= 1e-5
  case.v_cache = jnp.asarray(v, jnp.bfloat16)
  args, kwargs = case.call_args()
  want = _golden(case, (case.k_cache, case.v_cache), None)[0][..., 128:]
  errors = {}
  for groups in (False, True):
    x = pallas_fa3.quantize_kv_cache(
      case.k_cache, case.v_cache, cache_seqlens=case.cache_seqlens,
      column_groups=groups,
    )  # fmt: skip
    out = pallas_fa3.flash_attention_with_kvcache(
      case.q, x.k_cache, x.v_cache, **kwargs, k_descale=x.k_descale,
      v_descale=x.v_descale, implementation="blockwise",
    )  # fmt: skip
    errors[groups] = _relative_rmse(np.asarray(out)[..., 128:], want)
  assert errors[False] > 0.3 and errors[True] < 0.05, errors


@pytest.mark.timeout(_TIMEOUT_S)
@pytest.mark.parametrize("kw,options", CASES)
def test_interpret_kernel_matches_its_twin(kw, options, rng):
  """The kernel (race detection on) against the blockwise twin, which
  computes the same float16 products."""
  options = dict(options)
  if options.pop("sinks", False):
    options["sinks"] = jnp.asarray(rng.normal(size=kw["heads_q"]), jnp.float32)
  case, x = _fp8_case(rng, **kw)
  twin = _call(case, x, "blockwise", **options)[0]
  try:
    with compat.capture_race_report() as report:
      got = jax.block_until_ready(_call(case, x, "interpret", **options)[0])
  except Exception:
    compat.reset_interpret_state()
    raise
  assert not compat.races_found(), report.getvalue()[-3000:]
  np.testing.assert_allclose(
    np.asarray(got[0], np.float32), np.asarray(twin[0], np.float32), atol=2e-2
  )
  for a, b in zip(got[2:], twin[2:]):  # the same appended bytes
    np.testing.assert_array_equal(
      np.asarray(a, np.float32), np.asarray(b, np.float32)
    )


def test_appended_tokens_are_quantized_with_the_descales(rng):
  case, x = _fp8_case(
    rng, batch=2, seq_q=1, heads_q=4, heads_kv=2, head_dim=64,
    capacity=128, lengths=[5, 60], seq_new=3,
  )  # fmt: skip
  kd = jnp.asarray([[0.5, 2.0], [0.25, 1.0]], jnp.float32)
  vd = jnp.asarray([[1.0, 0.125], [4.0, 0.5]], jnp.float32)
  k = case.k.at[0, 0, 0, 0].set(1000.0)  # saturates: 1000 / 0.5 > 448
  _, _, k8, v8 = pallas_fa3.flash_attention_with_kvcache(
    case.q, x.k_cache, x.v_cache, k, case.v, cache_seqlens=case.cache_seqlens,
    k_descale=kd, v_descale=vd, return_lse=True, implementation="blockwise",
  )  # fmt: skip
  for b, start in enumerate(case.cache_seqlens):
    got_k = np.asarray(k8[b, start : start + 3], np.float32)
    want_k = np.clip(
      np.asarray(k[b], np.float32) / kd[b][None, :, None], -448, 448
    )
    np.testing.assert_array_equal(
      got_k, np.asarray(jnp.asarray(want_k).astype(F8), np.float32)
    )
    got_v = np.asarray(v8[b, start : start + 3], np.float32)
    want_v = np.asarray(case.v[b], np.float32) / vd[b][None, :, None]
    np.testing.assert_array_equal(
      got_v, np.asarray(jnp.asarray(want_v).astype(F8), np.float32)
    )
  assert float(k8[0, 5, 0, 0].astype(jnp.float32)) == 448.0
  np.testing.assert_array_equal(  # the rest of the cache is untouched
    np.asarray(k8[0, :5], np.float32), np.asarray(x.k_cache[0, :5], np.float32)
  )


def test_quantize_kv_cache_scales_and_error(rng):
  kc = jnp.asarray(
    rng.normal(size=(3, 64, 2, 32)) * [[[1.0], [30.0]]], jnp.bfloat16
  )
  vc = jnp.asarray(rng.normal(size=(3, 64, 2, 16)), jnp.bfloat16)
  kc = kc.at[:, 40:].set(jnp.nan)  # garbage past the lengths
  lengths = jnp.asarray([40, 10, 0], jnp.int32)
  x = pallas_fa3.quantize_kv_cache(kc, vc, cache_seqlens=lengths)
  assert x.k_cache.dtype == F8 and x.k_descale.shape == (3, 2)
  amax = np.nanmax(
    np.abs(np.asarray(kc[:, :40], np.float32)[:, :10]), axis=(1, 3)
  )
  np.testing.assert_allclose(
    np.asarray(x.k_descale)[1], amax[1] / 448, rtol=1e-6
  )
  assert float(x.k_descale[2, 0]) == 1.0  # no token: scale 1
  deq = kvcache.dequantize(x.k_cache[:1, :40], x.k_descale[:1])
  ref = np.asarray(kc[:1, :40], np.float32)
  assert (
    np.max(np.abs(deq - ref) / np.maximum(np.abs(ref), 1e-3 * 30)) <= 2.0**-4
  )
  # Paged: one descale per KV head over every sequence's pages.
  pt = jnp.asarray([[2, 0], [1, 3]], jnp.int32)
  pages = jnp.asarray(rng.normal(size=(4, 16, 2, 32)), jnp.float32)
  y = pallas_fa3.quantize_kv_cache(pages, pages, page_table=pt)
  assert y.k_descale.shape == (2, 2)
  np.testing.assert_array_equal(y.k_descale[0], y.k_descale[1])
  want = np.max(np.abs(np.asarray(pages)), axis=(0, 1, 3)) / 448
  np.testing.assert_allclose(np.asarray(y.k_descale[0]), want, rtol=1e-6)


def test_rotation_stores_rotated_keys_and_keeps_the_function(rng):
  case, _ = _fp8_case(
    rng, batch=2, seq_q=1, heads_q=8, heads_kv=2, head_dim=64,
    capacity=128, lengths=[128, 77],
  )  # fmt: skip
  lengths = _row_lengths(case)
  signs = kvcache.rotation_signs(7, 64)
  rot = pallas_fa3.quantize_kv_cache(
    case.k_cache, case.v_cache, cache_seqlens=lengths, rotation=7
  )
  by_hand = pallas_fa3.quantize_kv_cache(
    kvcache.rotate(case.k_cache, signs), case.v_cache, cache_seqlens=lengths
  )
  for a, b in zip(rot, by_hand):
    np.testing.assert_array_equal(
      np.asarray(a, np.float32), np.asarray(b, np.float32)
    )
  plain = pallas_fa3.quantize_kv_cache(
    case.k_cache, case.v_cache, cache_seqlens=lengths
  )
  golden = _golden(case, (case.k_cache, case.v_cache), None, causal=True)[0]
  errors = []
  for x, rotation in ((plain, None), (rot, 7)):
    out = pallas_fa3.flash_attention_with_kvcache(
      case.q, x.k_cache, x.v_cache, cache_seqlens=case.cache_seqlens,
      causal=True, k_descale=x.k_descale, v_descale=x.v_descale,
      cache_rotation=rotation, implementation="blockwise",
    )  # fmt: skip
    errors.append(_relative_rmse(out, golden))
  # Both within e4m3's rounding of the cache (against the 16-bit cache).
  assert max(errors) < 0.05, errors
  # Without the rotation of q the scores are wrong.
  wrong = pallas_fa3.flash_attention_with_kvcache(
    case.q, rot.k_cache, rot.v_cache, cache_seqlens=case.cache_seqlens,
    causal=True, k_descale=rot.k_descale, v_descale=rot.v_descale,
    implementation="blockwise",
  )  # fmt: skip
  assert _relative_rmse(wrong, golden) > 0.2


def test_rotation_rotates_appended_keys(rng):
  case, _ = _fp8_case(
    rng, batch=1, seq_q=1, heads_q=2, heads_kv=2, head_dim=64,
    capacity=64, lengths=[9], seq_new=2,
  )  # fmt: skip
  x = pallas_fa3.quantize_kv_cache(
    case.k_cache, case.v_cache, cache_seqlens=_row_lengths(case), rotation=True
  )
  _, k8, _ = pallas_fa3.flash_attention_with_kvcache(
    case.q, x.k_cache, x.v_cache, case.k, case.v, cache_seqlens=9,
    k_descale=x.k_descale, v_descale=x.v_descale, cache_rotation=True,
    implementation="blockwise",
  )  # fmt: skip
  signs = kvcache.rotation_signs(True, 64)
  want = kvcache.quantize_tokens(kvcache.rotate(case.k, signs), x.k_descale)
  np.testing.assert_array_equal(
    np.asarray(k8[:, 9:11], np.float32), np.asarray(want, np.float32)
  )


def test_traced_descales_under_jit(rng):
  case, x = _fp8_case(
    rng, batch=2, seq_q=1, heads_q=4, heads_kv=2, head_dim=64,
    capacity=128, lengths=[10, 100],
  )  # fmt: skip

  @jax.jit
  def step(q, kc, vc, n, kd, vd):
    return pallas_fa3.flash_attention_with_kvcache(
      q, kc, vc, cache_seqlens=n, k_descale=kd, v_descale=vd,
      implementation="blockwise",
    )  # fmt: skip

  got = step(case.q, x.k_cache, x.v_cache, jnp.asarray(case.cache_seqlens),
             x.k_descale, x.v_descale)  # fmt: skip
  want = _call(case, x, "blockwise")[0][0]
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize(
  "change,error,match",
  [
    (
      dict(k_descale=jnp.ones((2, 2))),
      ValueError,
      "k_descale applies to an e4m3",
    ),
    (dict(cache_rotation=3), ValueError, "cache_rotation applies"),
  ],
  ids=["descale-on-bf16", "rotation-on-bf16"],
)
def test_refusals_on_a_16_bit_cache(change, error, match):
  q = jnp.zeros((2, 1, 4, 64), jnp.bfloat16)
  kc = jnp.zeros((2, 128, 2, 64), jnp.bfloat16)
  with pytest.raises(error, match=match):
    pallas_fa3.flash_attention_with_kvcache(
      q, kc, kc, cache_seqlens=3, **change
    )


@pytest.mark.parametrize(
  "change,error,match",
  [
    (dict(k_descale=jnp.ones((3, 2))), ValueError, r"k_descale must be a scalar or float32 \[batch, heads_kv\]"),
    (dict(k_descale=jnp.ones((2, 2, 2))), ValueError, r"k_descale .* one per 128-column group \[batch, heads_kv, ceil\(head_dim / 128\)\] = \(2, 2, 1\); got shape \(2, 2, 2\)"),
    (dict(v_descale=jnp.asarray([[1.0, -1.0]] * 2)), ValueError, "v_descale must be positive"),
    (dict(k_descale=jnp.ones((2, 2), jnp.int32)), TypeError, "k_descale must be float32"),
    (dict(v_cache=jnp.zeros((2, 128, 2, 64), jnp.bfloat16)), TypeError, "same dtype"),
    (dict(q=jnp.zeros((2, 1, 4, 64), jnp.float32), implementation="interpret"), NotImplementedError, "bfloat16 or float16"),
  ],
  ids=["descale-shape", "descale-groups", "descale-negative", "descale-int", "mixed-caches", "f32-q-on-the-kernel"],
)  # fmt: skip
def test_refusals_on_an_e4m3_cache(change, error, match):
  kw = dict(
    q=jnp.zeros((2, 1, 4, 64), jnp.bfloat16),
    k_cache=jnp.zeros((2, 128, 2, 64), F8),
    v_cache=jnp.zeros((2, 128, 2, 64), F8),
    cache_seqlens=3,
  )
  kw.update(change)
  with pytest.raises(error, match=match):
    pallas_fa3.flash_attention_with_kvcache(**kw)


@pytest.mark.parametrize(
  "d,dv", [(128, 128), (96, 96), (192, 192), (192, 128), (128, 192)],
  ids=lambda d: f"d{d}",
)  # fmt: skip
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_mosaic_lowers_to_one_kernel(paged, d, dv):
  S = jax.ShapeDtypeStruct
  b, hq, hk, cap = 4, 16, 2, 4096
  q = S((b, 1, hq, d), jnp.bfloat16)
  kc = S((b * cap // 64, 64, hk, d), F8) if paged else S((b, cap, hk, d), F8)
  vc = S((*kc.shape[:3], dv), F8)
  pt = S((b, cap // 64), jnp.int32) if paged else None
  new = S((b, 1, hk, d), jnp.bfloat16)
  new_v = S((b, 1, hk, dv), jnp.bfloat16)
  scale = S((b, hk), jnp.float32)

  def step(q, kc, vc, k, v, n, pt, kd, vd):
    return pallas_fa3.flash_attention_with_kvcache(
      q, kc, vc, k, v, cache_seqlens=n, page_table=pt, k_descale=kd,
      v_descale=vd, implementation="mosaic", causal=True,
    )  # fmt: skip

  text = export.export(jax.jit(step), platforms=["cuda"])(
    q, kc, vc, new, new_v, S((b,), jnp.int32), pt, scale, scale
  ).mlir_module()
  assert lowered_kernel_count(text) == 1
