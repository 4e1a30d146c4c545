"""`flash_attention_with_kvcache(cache_leftpad=)`, FA3's left-padded
caches (sequence b's tokens are the slots `[cache_leftpad[b],
cache_seqlens[b])`): every backend, the kernel in interpret mode with race
detection, against the float64 golden of the same sequences without the
padding (which holds NaN, never read into the output), appended tokens at
`cache_seqlens[b]`, traced values out of range as NaN rows, the refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa3
from pallas_fa3.kernels.sm90 import compat
from pallas_fa3.kvcache import make_decode_spec
from pallas_fa3.testing import (
  assert_within_tolerance,
  decode_case,
  decode_golden_and_naive,
)

_TIMEOUT_S = 300


def _padded_case(rng, pads, **kw):
  """A decode case whose sequence b holds garbage (NaN keys, Inf values)
  in its first `pads[b]` slots."""
  case = decode_case(rng, **kw)
  kc, vc = (
    np.array(case.k_cache, np.float32),
    np.array(case.v_cache, np.float32),
  )
  for b, pad in enumerate(pads):
    for t in range(pad):
      if case.page_table is not None:
        ps = kc.shape[1]
        where = (int(case.page_table[b, t // ps]), t % ps)
      else:
        rows = case.cache_batch_idx
        where = (b if rows is None else int(rows[b]), t)
      kc[where], vc[where] = np.nan, np.inf
  case.k_cache = jnp.asarray(kc, case.q.dtype)
  case.v_cache = jnp.asarray(vc, case.q.dtype)
  return case


# (page_size, seq_q, seq_new, lengths, pads, options)
CASES = [
  pytest.param(None, 1, 1, [40, 100, 9], [17, 0, 8], dict(causal=True), id="contiguous-causal-append-one-empty"),
  pytest.param(16, 4, 4, [70, 120, 33], [20, 64, 1], dict(causal=True, sinks=True), id="paged16-q4-sinks"),
  pytest.param(None, 2, 0, [90, 127, 60], [30, 5, 59], dict(window_size=(20, 0), softcap=6.0), id="window-softcap"),
  pytest.param(32, 2, 0, [50, 128, 64], [3, 100, 32], {}, id="paged32-not-causal"),
]  # fmt: skip


def _check(case, pads, options, impl, splits=1, config=None, sinks=None):
  args, kwargs = case.call_args()
  result = pallas_fa3.flash_attention_with_kvcache(
    *args, **kwargs, **options, sinks=sinks, return_lse=True,
    implementation=impl, num_splits=splits, config=config,
    cache_leftpad=jnp.asarray(pads, jnp.int32),
  )  # fmt: skip
  out, lse = result[:2]
  caches = result[2:] if case.k is not None else (case.k_cache, case.v_cache)
  spec = make_decode_spec(*args, **kwargs, **options, sinks=sinks is not None)
  golden, naive = decode_golden_and_naive(
    spec, case, *caches, sinks, starts=pads
  )
  for name, got, nv, g in zip(("out", "lse"), (out, lse), naive, golden):
    assert_within_tolerance(f"{impl} {name} splits={splits}", got, nv, g)
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  return result


@pytest.mark.parametrize("ps,sq,new,lengths,pads,options", CASES)
@pytest.mark.parametrize("impl", ["reference", "blockwise"])
def test_leftpad_against_the_unpadded_golden(
  impl, ps, sq, new, lengths, pads, options, rng
):
  options = dict(options)
  sinks = None
  if options.pop("sinks", False):
    sinks = jnp.asarray(rng.normal(size=8), jnp.float32)
  case = _padded_case(
    rng, pads, batch=3, seq_q=sq, heads_q=8, heads_kv=2, head_dim=64,
    capacity=128, lengths=lengths if not new else [n - new for n in lengths],
    page_size=ps, seq_new=new,
  )  # fmt: skip
  for splits in (1, 3):
    result = _check(case, pads, options, impl, splits, sinks=sinks)
  if new:  # appended at cache_seqlens[b], after the padding and the tokens
    k_cache = np.asarray(result[2], np.float32)
    for b in range(3):
      t = int(case.cache_seqlens[b])
      if ps is None:
        slot = k_cache[b, t : t + new]
      else:
        slot = np.stack([k_cache[int(case.page_table[b, (t + i) // ps]), (t + i) % ps] for i in range(new)])  # fmt: skip
      np.testing.assert_array_equal(slot, np.asarray(case.k[b], np.float32))


def test_leftpad_equals_the_same_sequences_shifted_to_slot_zero(rng):
  """A contiguous cache with padding against the same tokens moved to the
  front, through the same backend: the same function."""
  pads, lengths = [10, 0, 31], [50, 64, 40]
  case = _padded_case(
    rng, pads, batch=3, seq_q=1, heads_q=4, heads_kv=2, head_dim=32,
    capacity=64, lengths=lengths, dtype=jnp.float32,
  )  # fmt: skip
  args, kwargs = case.call_args()
  got = pallas_fa3.flash_attention_with_kvcache(
    *args, **kwargs, causal=True, implementation="blockwise",
    cache_leftpad=jnp.asarray(pads, jnp.int32),
  )  # fmt: skip
  kc, vc = np.asarray(case.k_cache), np.asarray(case.v_cache)
  shifted = [np.roll(x, -p, axis=1) for p, x in zip(pads, zip(kc, vc))]
  kc2 = jnp.asarray(
    np.stack([np.roll(kc[b], -pads[b], axis=0) for b in range(3)])
  )
  vc2 = jnp.asarray(
    np.stack([np.roll(vc[b], -pads[b], axis=0) for b in range(3)])
  )
  del shifted
  want = pallas_fa3.flash_attention_with_kvcache(
    case.q, kc2, vc2, cache_seqlens=jnp.asarray(np.subtract(lengths, pads), jnp.int32),
    causal=True, implementation="blockwise",
  )  # fmt: skip
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


# (page_size, lengths, pads, block_kv, splits, fp8, options)
KERNEL_CASES = [
  pytest.param(None, [0, 100, 256], [0, 70, 129], 64, (1, 3), False, dict(causal=True), id="contiguous-pad-mid-tile"),
  pytest.param(64, [37, 190], [36, 128], 128, (2,), False, dict(window_size=(60, 0), softcap=5.0), id="paged64-two-pages-per-tile-window"),
  pytest.param(None, [200, 90], [65, 7], 64, (1, 2), True, dict(causal=True), id="e4m3-cache"),
]  # fmt: skip


@pytest.mark.timeout(_TIMEOUT_S)
@pytest.mark.parametrize(
  "ps,lengths,pads,block,splits,fp8,options", KERNEL_CASES
)
def test_interpret_leftpad_against_float64_golden(
  ps, lengths, pads, block, splits, fp8, options, rng
):
  case = _padded_case(
    rng, pads, batch=len(lengths), seq_q=2, heads_q=8, heads_kv=2,
    head_dim=64, capacity=256, lengths=lengths, page_size=ps,
  )  # fmt: skip
  extra = {}
  if fp8:
    q8 = pallas_fa3.quantize_kv_cache(
      case.k_cache,
      case.v_cache,
      cache_seqlens=jnp.asarray(lengths, jnp.int32),
      cache_leftpad=jnp.asarray(pads, jnp.int32),
    )
    # The padding's NaN sets no descale: they are the tokens' alone.
    case.k_cache, case.v_cache = q8.k_cache, q8.v_cache
    extra = dict(k_descale=q8.k_descale, v_descale=q8.v_descale)
  config = pallas_fa3.Sm90DecodeConfig(block_kv=block, num_stages=2)
  args, kwargs = case.call_args()
  for n in splits:
    try:
      with compat.capture_race_report() as report:
        out, lse = pallas_fa3.flash_attention_with_kvcache(
          *args, **kwargs, **options, **extra, return_lse=True, num_splits=n,
          implementation="interpret", config=config,
          cache_leftpad=jnp.asarray(pads, jnp.int32),
        )  # fmt: skip
        jax.block_until_ready(out)
    except Exception:
      compat.reset_interpret_state()
      raise
    assert not compat.races_found(), report.getvalue()[-3000:]
    want = pallas_fa3.flash_attention_with_kvcache(
      *args, **kwargs, **options, **extra, return_lse=True,
      implementation="reference", cache_leftpad=jnp.asarray(pads, jnp.int32),
    )  # fmt: skip
    if fp8:  # the e4m3 path: against the reference on the same cache
      np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want[0], np.float32), atol=3e-2)  # fmt: skip
      continue
    spec = make_decode_spec(*args, **kwargs, **options)
    golden, naive = decode_golden_and_naive(
      spec, case, case.k_cache, case.v_cache, starts=pads
    )
    for name, got, nv, g in zip(("out", "lse"), (out, lse), naive, golden):
      assert_within_tolerance(f"{name} splits={n}", got, nv, g)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))


def test_traced_leftpad_out_of_range_gives_nan_rows(rng):
  case = decode_case(
    rng, batch=2, seq_q=1, heads_q=4, heads_kv=2, head_dim=32, capacity=64,
    lengths=[20, 30],
  )  # fmt: skip
  args, kwargs = case.call_args()
  step = jax.jit(
    lambda pad: pallas_fa3.flash_attention_with_kvcache(
      *args, **kwargs, cache_leftpad=pad, implementation="blockwise"
    )
  )
  out = np.asarray(step(jnp.asarray([21, 4], jnp.int32)), np.float32)
  assert np.all(np.isnan(out[0])) and np.all(np.isfinite(out[1]))
  out = np.asarray(step(jnp.asarray([0, -1], jnp.int32)), np.float32)
  assert np.all(np.isfinite(out[0])) and np.all(np.isnan(out[1]))


@pytest.mark.parametrize(
  "pad,error,match",
  [
    (np.asarray([21, 0], np.int32), ValueError, r"cache_leftpad\[0\] = 21 must be in 0..cache_seqlens\[0\] = 20"),
    (np.asarray([0, -2], np.int32), ValueError, r"cache_leftpad\[1\] = -2"),
    (np.asarray([1, 2, 3], np.int32), ValueError, r"cache_leftpad must have shape \[batch\] = \(2,\)"),
    (np.asarray([1.0, 2.0], np.float32), TypeError, "cache_leftpad must be int32"),
    ([1, 2], TypeError, "cache_leftpad must be an int32 array"),
  ],
  ids=["past-the-length", "negative", "wrong-shape", "float", "list"],
)  # fmt: skip
def test_leftpad_bad_input_names_the_argument(pad, error, match, rng):
  case = decode_case(
    rng, batch=2, seq_q=1, heads_q=4, heads_kv=2, head_dim=32, capacity=64,
    lengths=[20, 30],
  )  # fmt: skip
  args, kwargs = case.call_args()
  with pytest.raises(error, match=match):
    pallas_fa3.flash_attention_with_kvcache(
      *args, **kwargs, cache_leftpad=pad, implementation="reference"
    )


def test_leftpad_with_rotary_rotates_at_slot_positions(rng):
  """FA3's positions stay cache slots with padding: the appended token of
  a sequence padded by p sits at position cache_seqlens[b] (p included)."""
  case = decode_case(
    rng, batch=2, seq_q=1, heads_q=4, heads_kv=2, head_dim=32, capacity=64,
    lengths=[20, 30], seq_new=1, dtype=jnp.float32,
  )  # fmt: skip
  args, kwargs = case.call_args()
  angle = rng.uniform(0, 6, size=(64, 16))
  cos, sin = (
    jnp.asarray(np.cos(angle), jnp.float32),
    jnp.asarray(np.sin(angle), jnp.float32),
  )
  pads = jnp.asarray([5, 12], jnp.int32)
  call = lambda pad: pallas_fa3.flash_attention_with_kvcache(
    *args, **kwargs, causal=True, rotary_cos=cos, rotary_sin=sin,
    cache_leftpad=pad, implementation="reference",
  )  # fmt: skip
  padded, unpadded = call(pads), call(None)
  # The appended keys (rotated at the same slots) are identical either way.
  np.testing.assert_array_equal(np.asarray(padded[1]), np.asarray(unpadded[1]))
  assert not np.allclose(np.asarray(padded[0]), np.asarray(unpadded[0]))


@pytest.mark.newest
def test_mosaic_lowers_leftpad_and_rotary_to_one_kernel():
  """With cache_leftpad and rotary tables the CUDA lowering still holds
  the one decode kernel (no fallback to the twin)."""
  from jax import export  # pylint: disable=g-import-not-at-top

  from pallas_fa3.testing import lowered_kernel_count  # pylint: disable=g-import-not-at-top

  S = jax.ShapeDtypeStruct
  b, hq, hk, d, cap = 4, 16, 4, 128, 4096
  q, new = S((b, 1, hq, d), jnp.bfloat16), S((b, 1, hk, d), jnp.bfloat16)
  kc = S((b * cap // 64, 64, hk, d), jnp.bfloat16)
  ints = lambda *s: S(s, jnp.int32)

  def step(q, kc, vc, k, v, n, pt, pad, cos, sin):
    return pallas_fa3.flash_attention_with_kvcache(
      q, kc, vc, k, v, cache_seqlens=n, page_table=pt, causal=True,
      cache_leftpad=pad, rotary_cos=cos, rotary_sin=sin,
      implementation="mosaic",
    )  # fmt: skip

  table = S((cap, d // 2), jnp.bfloat16)
  exported = export.export(jax.jit(step), platforms=["cuda"])(
    q, kc, kc, new, new, ints(b), ints(b, cap // 64), ints(b), table, table
  )
  assert lowered_kernel_count(exported.mlir_module()) == 1
