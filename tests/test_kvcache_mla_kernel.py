"""The Hopper MLA decode kernel (`kernels/sm90/decode_mla.py`) on a CPU:
interpret mode with race detection against the float64 golden (576 / 512,
contiguous and paged caches, seq_q 1 and 2, 16 / 64 / 128 query heads
packed into one or two query tiles, split-KV, appended tokens,
cache_leftpad, causal / window / softcap / sinks, NaN and Inf past every
length), the 320 / 256 split, and the CUDA lowering (one Mosaic kernel,
the MLA one, no fallback). The deviceless sm_90a compile is `pallas-fa3
aot --decode`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import pallas_fa3
from pallas_fa3.kernels.sm90 import compat
from pallas_fa3.kvcache import make_decode_spec
from pallas_fa3.reference import golden_decode
from pallas_fa3.testing import (
  assert_within_tolerance,
  decode_case,
  decode_golden_and_naive,
  lowered_kernel_count,
)

_TIMEOUT_S = 300

# (d, dv, heads_q, seq_q, capacity, lengths, page_size, seq_new, splits,
#  options)
CASES = [
  pytest.param(
    576, 512, 16, 1, 256, [0, 100, 256], None, 0, (1, 3), dict(causal=True),
    id="contiguous-h16-q1-lengths-0-to-full",
  ),
  pytest.param(
    576, 512, 64, 2, 256, [37, 190], 64, 1, (2,), dict(causal=True),
    id="paged64-h64-q2-two-query-tiles-append",
  ),
  pytest.param(
    576, 512, 128, 1, 256, [150, 9], 128, 0, (1,),
    dict(window_size=(60, 0), softcap=8.0, sinks=True),
    id="paged128-h128-two-tiles-a-page-window-softcap-sinks",
  ),
  pytest.param(
    320, 256, 16, 2, 256, [70, 200], None, 2, (1,), dict(causal=True),
    id="d320-dv256-contiguous-append",
  ),
]  # fmt: skip


def _run(case, options, splits, sinks=None, **extra):
  args, kwargs = case.call_args()
  try:
    with compat.capture_race_report() as report:
      result = pallas_fa3.flash_attention_with_kvcache(
        *args, **kwargs, **options, **extra, sinks=sinks, return_lse=True,
        num_splits=splits, implementation="interpret",
      )  # fmt: skip
      jax.block_until_ready(result)
  except Exception:
    compat.reset_interpret_state()
    raise
  assert not compat.races_found(), report.getvalue()[-3000:]
  return result


@pytest.mark.timeout(_TIMEOUT_S)
@pytest.mark.parametrize("d,dv,hq,sq,cap,lengths,ps,new,splits,options", CASES)
def test_interpret_mla_against_float64_golden(
  d, dv, hq, sq, cap, lengths, ps, new, splits, options, rng
):
  options = dict(options)
  sinks = None
  if options.pop("sinks", False):
    sinks = jnp.asarray(rng.normal(size=hq), jnp.float32)
  case = decode_case(
    rng, batch=len(lengths), seq_q=sq, heads_q=hq, heads_kv=1, head_dim=d,
    head_dim_v=dv, capacity=cap,
    lengths=[max(n - new, 0) for n in lengths], page_size=ps, seq_new=new,
    v_in_k=True,
  )  # fmt: skip
  args, kwargs = case.call_args()
  spec = make_decode_spec(*args, **kwargs, **options, sinks=sinks is not None)
  for n in splits:
    result = _run(case, options, n, sinks)
    out, lse = result[:2]
    cache = result[2] if new else case.k_cache
    golden, naive = decode_golden_and_naive(spec, case, cache, None, sinks)
    for name, got, nv, g in zip(("out", "lse"), (out, lse), naive, golden):
      assert_within_tolerance(f"{name} splits={n}", got, nv, g)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))


def _left_padded_case(rng, lengths, pads):
  """A paged (64-token pages) 576 / 512 MLA case, 16 heads, whose slots
  before `pads[b]` hold NaN (cache_leftpad's padding)."""
  case = decode_case(
    rng, batch=len(lengths), seq_q=1, heads_q=16, heads_kv=1, head_dim=576,
    head_dim_v=512, capacity=256, lengths=lengths, page_size=64, v_in_k=True,
  )  # fmt: skip
  kc = np.array(case.k_cache, np.float32)
  for b, pad in enumerate(pads):
    for t in range(pad):
      kc[int(case.page_table[b, t // 64]), t % 64] = np.nan
  case.k_cache = jnp.asarray(kc, jnp.bfloat16)
  return case


@pytest.mark.timeout(_TIMEOUT_S)
def test_interpret_mla_with_cache_leftpad(rng):
  """A left-padded MLA cache (NaN keys in the padding, V their columns):
  the padding's V rows are zeroed in the K tile, both halves."""
  lengths, pads = [120, 250], [65, 3]
  case = _left_padded_case(rng, lengths, pads)
  out, lse = _run(
    case, dict(causal=True), 2, cache_leftpad=jnp.asarray(pads, jnp.int32)
  )
  args, kwargs = case.call_args()
  spec = make_decode_spec(*args, **kwargs, causal=True)
  golden, naive = decode_golden_and_naive(
    spec, case, case.k_cache, None, starts=pads
  )
  for name, got, nv, g in zip(("out", "lse"), (out, lse), naive, golden):
    assert_within_tolerance(name, got, nv, g)


@pytest.mark.timeout(_TIMEOUT_S)
def test_interpret_mla_e4m3_cache_with_cache_leftpad(rng):
  """An e4m3 MLA cache with NaN in its left padding: the converter zeroes
  V's rows before cache_leftpad as it converts (its `lo` path); against
  the float64 golden on the dequantized cache's sequences."""
  lengths, pads = [120, 250], [65, 3]
  case = _left_padded_case(rng, lengths, pads)
  starts = jnp.asarray(pads, jnp.int32)
  x = pallas_fa3.quantize_kv_cache(
    case.k_cache, None, page_table=case.page_table,
    cache_seqlens=case.cache_seqlens, cache_leftpad=starts,
  )  # fmt: skip
  case.k_cache = x.k_cache
  out, lse = _run(
    case, dict(causal=True), 2, cache_leftpad=starts, k_descale=x.k_descale
  )
  args, kwargs = case.call_args()
  spec = make_decode_spec(*args, **kwargs, causal=True)
  g_out, g_lse = golden_decode(
    spec, case.q, x.k_cache, None, np.asarray(lengths), None,
    case.page_table, descale=(x.k_descale, x.k_descale), starts=pads,
  )  # fmt: skip
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  assert _relative_rmse(out, g_out) <= 1e-2
  np.testing.assert_allclose(np.asarray(lse), g_lse, atol=1e-2)


# (heads_q, seq_q, lengths, page_size, seq_new, splits, column groups,
# options)
E4M3_CASES = [
  pytest.param(
    16, 1, [0, 100, 256], None, 0, 3, False, dict(causal=True),
    id="contiguous-h16-q1-lengths-0-to-full-3-splits",
  ),
  pytest.param(
    64, 2, [37, 190], 64, 1, 1, False, dict(window_size=(80, 0), softcap=8.0),
    id="paged64-h64-q2-append-window-softcap",
  ),
  pytest.param(
    16, 1, [200, 255], 64, 1, 2, True, dict(causal=True),
    id="paged64-h16-append-column-group-descales",
  ),
]  # fmt: skip


def _relative_rmse(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2))


@pytest.mark.timeout(_TIMEOUT_S)
@pytest.mark.parametrize(
  "hq,sq,lengths,ps,new,splits,groups,options", E4M3_CASES
)
def test_interpret_mla_e4m3_cache_against_the_dequantized_golden(
  hq, sq, lengths, ps, new, splits, groups, options, rng
):
  """An e4m3 MLA cache (`quantize_kv_cache(k_cache, None)`, NaN and Inf
  past the lengths; per (sequence, KV head) or per 128-column group
  descales, the RoPE columns the fifth group) in the kernel: the producer
  converts each tile to float16 and zeroes V's rows past the length;
  against the float64 golden on the dequantized cache
  (tests/test_kvcache_fp8.py's bound) and the blockwise twin."""
  case = decode_case(
    rng, batch=len(lengths), seq_q=sq, heads_q=hq, heads_kv=1,
    head_dim=576, head_dim_v=512, capacity=256,
    lengths=[max(n - new, 0) for n in lengths], page_size=ps, seq_new=new,
    v_in_k=True,
  )  # fmt: skip
  x = pallas_fa3.quantize_kv_cache(
    case.k_cache, None, page_table=case.page_table,
    cache_seqlens=case.cache_seqlens, column_groups=groups,
  )  # fmt: skip
  assert x.k_descale.shape == (len(lengths), 1) + ((5,) if groups else ())
  case.k_cache = x.k_cache
  out, lse, *cache = _run(case, options, splits, k_descale=x.k_descale)
  k8 = cache[0] if new else x.k_cache
  assert k8.dtype == jnp.float8_e4m3fn
  args, kwargs = case.call_args()
  spec = make_decode_spec(*args, **kwargs, **options)
  n = np.asarray(case.cache_seqlens) + new
  g_out, g_lse = golden_decode(
    spec, case.q, k8, None, n, None, case.page_table,
    descale=(x.k_descale, x.k_descale),
  )  # fmt: skip
  assert _relative_rmse(out, g_out) <= 1e-2
  empty = np.isinf(g_lse)
  np.testing.assert_array_equal(np.isinf(np.asarray(lse)), empty)
  np.testing.assert_allclose(np.asarray(lse)[~empty], g_lse[~empty], atol=1e-2)
  twin = pallas_fa3.flash_attention_with_kvcache(
    *args, **kwargs, **options, k_descale=x.k_descale,
    num_splits=splits, return_lse=True, implementation="blockwise",
  )[0]  # fmt: skip
  np.testing.assert_allclose(
    np.asarray(out, np.float32), np.asarray(twin, np.float32), atol=2e-2
  )


@pytest.mark.newest
@pytest.mark.parametrize(
  "paged,cache",
  [(False, jnp.bfloat16), (True, jnp.bfloat16), (True, jnp.float8_e4m3fn)],
  ids=["contiguous", "paged64", "paged64-e4m3"],
)
def test_mosaic_lowers_mla_to_the_mla_kernel(paged, cache):
  """576 / 512 with 128 query heads lowers for CUDA to one Mosaic kernel,
  the MLA one, from a bf16 or an e4m3 cache: no fallback to the blockwise
  twin."""
  S = jax.ShapeDtypeStruct
  b, hq, cap = 4, 128, 4096
  q = S((b, 1, hq, 576), jnp.bfloat16)
  if paged:
    kc, pt = S((b * cap // 64, 64, 1, 576), cache), S((b, cap // 64), jnp.int32)  # fmt: skip
  else:
    kc, pt = S((b, cap, 1, 576), cache), None
  fp8 = cache == jnp.float8_e4m3fn

  def step(q, kc, n, pt, kd):
    return pallas_fa3.flash_attention_with_kvcache(
      q, kc, None, cache_seqlens=n, page_table=pt, head_dim_v=512,
      causal=True, k_descale=kd if fp8 else None, implementation="mosaic",
    )  # fmt: skip

  text = export.export(jax.jit(step), platforms=["cuda"])(
    q, kc, S((b,), jnp.int32), pt, S((b, 1), jnp.float32)
  ).mlir_module()
  assert lowered_kernel_count(text) == 1
  assert "fa3_mla_decode" in text
