"""The Hopper decode kernel on a CPU: interpret mode (race detection on)
against the float64 golden of every logical sequence with FA3's rule, and
the CUDA lowering of `implementation="mosaic"` (one kernel, no float32
`[.., cache_len]` score tensor in HBM). The deviceless sm_90a compile of
its configs is `pallas-fa3 aot --decode` (tests/test_sm90_aot.py compiles
the defaults)."""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import pallas_fa3
from pallas_fa3.kernels.sm90 import compat, config_decode
from pallas_fa3.kvcache import make_decode_spec
from pallas_fa3.testing import (
  assert_within_tolerance,
  decode_case,
  decode_golden_and_naive,
  lowered_kernel_count,
  run_interpreted,
)

_TIMEOUT_S = 300

# (batch, seq_q, heads_q, heads_kv, d, capacity, lengths, page_size, seq_new,
#  batch_idx, block_kv, splits, options)
CASES = [
  pytest.param(
    3, 1, 8, 2, 64, 256, [0, 100, 256], None, 0, False, 64, (1, 3),
    dict(causal=True),
    id="contiguous-g4-q1-lengths0-to-full",
  ),
  pytest.param(
    2, 4, 8, 1, 64, 256, [37, 190], 64, 2, False, 128, (2,),
    dict(window_size=(60, 0), softcap=5.0, sinks=True),
    id="paged64-two-pages-per-tile-mqa-q4-append-window-softcap-sinks",
  ),
  pytest.param(
    2, 16, 4, 4, 64, 192, [0, 150], None, 16, True, 64, (1,),
    dict(causal=True),
    id="batch-idx-mha-q16-prefill-chunk",
  ),
  pytest.param(
    1, 1, 16, 1, 128, 512, [300], 256, 0, False, 64, (4,),
    dict(causal=True),
    id="paged256-tiles-within-a-page-g16-d128",
  ),
  # Packed rows past one 64-row tile (a prefill chunk against the cache):
  # a CTA per query tile, each walking only the keys its queries see.
  pytest.param(
    2, 128, 6, 1, 64, 384, [0, 100], None, 128, False, 64, (1, 2),
    dict(causal=True),
    id="query-tiles-12-gqa6-q128-prefill-chunk-append",
  ),
  pytest.param(
    1, 40, 8, 2, 64, 256, [150], 64, 0, False, 128, (1,),
    dict(window_size=(30, 0), sinks=True),
    id="query-tiles-5-partial-last-paged64-window-sinks",
  ),
  pytest.param(
    2, 20, 4, 1, 128, 256, [50, 200], None, 20, True, 64, (3,), {},
    id="query-tiles-2-not-causal-batch-idx-3-splits",
  ),
]  # fmt: skip


@pytest.mark.timeout(_TIMEOUT_S)
@pytest.mark.parametrize(
  "b,sq,hq,hk,d,cap,lengths,ps,new,idx,block,splits,options", CASES
)
def test_interpret_against_float64_golden(
  b, sq, hq, hk, d, cap, lengths, ps, new, idx, block, splits, options, rng
):
  options = dict(options)
  sinks = None
  if options.pop("sinks", False):
    sinks = jnp.asarray(rng.normal(size=hq), jnp.float32)
  case = decode_case(
    rng, batch=b, seq_q=sq, heads_q=hq, heads_kv=hk, head_dim=d,
    capacity=cap, lengths=lengths, page_size=ps, seq_new=new, batch_idx=idx,
  )  # fmt: skip
  args, kwargs = case.call_args()
  spec = make_decode_spec(*args, **kwargs, **options, sinks=sinks is not None)
  config = pallas_fa3.Sm90DecodeConfig(block_kv=block, num_stages=2)
  for n in splits:
    try:
      with compat.capture_race_report() as report:
        result = pallas_fa3.flash_attention_with_kvcache(
          *args, **kwargs, **options, sinks=sinks, return_lse=True,
          num_splits=n, implementation="interpret", config=config,
        )  # fmt: skip
        jax.block_until_ready(result)
    except Exception:
      compat.reset_interpret_state()
      raise
    assert not compat.races_found(), report.getvalue()[-3000:]
    out, lse = result[:2]
    caches = result[2:] if new else (case.k_cache, case.v_cache)
    golden, naive = decode_golden_and_naive(spec, case, *caches, sinks)
    for name, got, nv, g in zip(("out", "lse"), (out, lse), naive, golden):
      assert_within_tolerance(f"{name} splits={n}", got, nv, g)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))


@pytest.mark.timeout(_TIMEOUT_S)
@pytest.mark.parametrize("ps", [128, 256], ids=["page128", "page256"])
def test_interpret_traced_overflowing_length_reads_no_page_past_the_table(
  ps, rng
):
  """A traced length past the capacity walks tiles past the page table:
  the one-page-per-tile read of the table is clamped, as the multi-page
  one is (else it reads past the table: the interpreter's out-of-bounds
  error, another sequence's page on a GPU), and that sequence's rows are
  NaN while the other's are right."""
  case = decode_case(
    rng, batch=2, seq_q=1, heads_q=4, heads_kv=1, head_dim=64,
    capacity=256, lengths=[100, 30], page_size=ps,
  )  # fmt: skip
  args, kwargs = case.call_args()
  step = jax.jit(
    lambda a, kw: pallas_fa3.flash_attention_with_kvcache(
      *a, **kw, implementation="interpret",
      config=pallas_fa3.Sm90DecodeConfig(block_kv=128, num_stages=2),
    )
  )  # fmt: skip
  lengths = jnp.asarray([256 + 200, 30], jnp.int32)
  out = np.asarray(step(args, {**kwargs, "cache_seqlens": lengths}), np.float32)
  assert np.all(np.isnan(out[0]))
  want = pallas_fa3.flash_attention_with_kvcache(
    *args, **kwargs, implementation="reference"
  )
  np.testing.assert_allclose(out[1], np.asarray(want[1], np.float32), atol=2e-2)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("ps", [None, 64], ids=["contiguous", "paged64"])
def test_interpret_fa3_kvcache_grid_seq_q_512_gqa6(ps, rng):
  """FA3's own kvcache grid's largest chunk: seq_q 512 with GQA 6 (3072
  packed rows, 48 query tiles), appended tokens, causal: the kernel serves
  it (no refusal) against the float64 golden."""
  sq = 512
  case = decode_case(
    rng, batch=2, seq_q=sq, heads_q=6, heads_kv=1, head_dim=64,
    capacity=768, lengths=[100, 0], page_size=ps, seq_new=sq,
  )  # fmt: skip
  args, kwargs = case.call_args()
  spec = make_decode_spec(*args, **kwargs, causal=True)
  assert pallas_fa3.backends.unsupported_reason("interpret", spec) is None
  with compat.capture_race_report() as report:
    out, lse, kc, vc = pallas_fa3.flash_attention_with_kvcache(
      *args, **kwargs, causal=True, return_lse=True,
      implementation="interpret",
      config=pallas_fa3.Sm90DecodeConfig(block_kv=64, num_stages=2),
    )  # fmt: skip
    jax.block_until_ready(out)
  assert not compat.races_found(), report.getvalue()[-3000:]
  golden, naive = decode_golden_and_naive(spec, case, kc, vc)
  for name, got, nv, g in zip(("out", "lse"), (out, lse), naive, golden):
    assert_within_tolerance(name, got, nv, g)


# FA3's `test_flash_attn_kvcache` grid (hopper/test_flash_attn.py): its
# (seqlen_q, seqlen_k) pairs and page sizes; a paged point needs seqlen_k
# a multiple of the page size, as there.
FA3_SEQLENS = (
  (1, 128), (1, 339), (3, 1024), (64, 800), (64, 256), (3, 799),
  (64, 2048), (16, 20000), (1, 128 * 1024), (16, 128 * 1024), (128, 128),
  (256, 512), (2048, 3577),
)  # fmt: skip
FA3_PAGE_SIZES = (None, 1, 4, 128)


@pytest.mark.parametrize("heads_kv", [6, 3, 1], ids=["mha", "gqa", "mqa"])
def test_the_kernel_serves_fa3s_kvcache_grid(heads_kv):
  """Every point of FA3's grid (d128, 6 query heads, appended tokens where
  FA3 appends them) is served by the decode kernel: pages of 1 and 4
  tokens and lengths like 339 run on a gathered contiguous copy
  (`config_decode.kernel_spec`), none is refused."""
  S = jax.ShapeDtypeStruct
  b, d = 5, 128
  for (sq, sk), ps in itertools.product(FA3_SEQLENS, FA3_PAGE_SIZES):
    if ps is not None and sk % ps:
      continue
    if ps is None:
      kc, pt = S((b, sk, heads_kv, d), jnp.bfloat16), None
    else:
      pages = sk // ps * b * 3
      kc = S((pages, ps, heads_kv, d), jnp.bfloat16)
      pt = S((b, pages // b), jnp.int32)
    new = S((b, sq, heads_kv, d), jnp.bfloat16) if sq <= sk else None
    spec = make_decode_spec(
      S((b, sq, 6, d), jnp.bfloat16), kc, kc, new, new, cache_seqlens=0,
      page_table=pt, causal=True,
    )  # fmt: skip
    reason = pallas_fa3.backends.unsupported_reason("interpret", spec)
    assert reason is None, (sq, sk, ps, reason)


# (batch, seq_q, heads_q, heads_kv, d, capacity, lengths, page_size,
#  seq_new, batch_idx, leftpad)
FA3_LAYOUTS = [
  pytest.param(
    3, 1, 6, 3, 128, 339, [0, 200, 338], None, 1, True, False,
    id="contiguous-339-batch-idx-append",
  ),
  pytest.param(
    2, 3, 6, 1, 64, 128, [0, 100], 1, 3, False, True,
    id="page1-mqa-q3-append-leftpad",
  ),
  pytest.param(
    2, 64, 6, 3, 64, 256, [50, 192], 4, 64, False, False,
    id="page4-gqa-q64-append",
  ),
]  # fmt: skip


@pytest.mark.timeout(_TIMEOUT_S)
@pytest.mark.parametrize(
  "b,sq,hq,hk,d,cap,lengths,ps,new,idx,leftpad", FA3_LAYOUTS
)
def test_interpret_layouts_the_tma_boxes_cannot_tile(
  b, sq, hq, hk, d, cap, lengths, ps, new, idx, leftpad, rng
):
  """FA3's pages of 1 and 4 tokens and a length of 339 (with
  cache_batch_idx, appended tokens, cache_leftpad): the kernel runs on a
  gathered contiguous copy (race detection on) against the float64
  golden, and the caches come back with the new tokens in place."""
  case = decode_case(
    rng, batch=b, seq_q=sq, heads_q=hq, heads_kv=hk, head_dim=d,
    capacity=cap, lengths=lengths, page_size=ps, seq_new=new, batch_idx=idx,
  )  # fmt: skip
  args, kwargs = case.call_args()
  starts = None
  if leftpad:  # up to half of each sequence's cached tokens
    starts = jnp.asarray([n // 2 for n in lengths], jnp.int32)
    kwargs["cache_leftpad"] = starts
  spec = make_decode_spec(*args, **kwargs, causal=True)
  assert config_decode.kernel_spec(spec) is not spec  # (gathered)
  out, lse, kc, vc = run_interpreted(
    pallas_fa3.flash_attention_with_kvcache, *args, **kwargs, causal=True,
    return_lse=True, implementation="interpret",
  )  # fmt: skip
  twin = pallas_fa3.flash_attention_with_kvcache(
    *args, **kwargs, causal=True, return_lse=True,
    implementation="blockwise",
  )  # fmt: skip
  for got, want in zip((kc, vc), twin[2:]):  # the same appended caches
    np.testing.assert_array_equal(
      np.asarray(got, np.float32), np.asarray(want, np.float32)
    )
  golden, naive = decode_golden_and_naive(spec, case, kc, vc, starts=starts)
  for name, got, nv, g in zip(("out", "lse"), (out, lse), naive, golden):
    assert_within_tolerance(name, got, nv, g)


def _lowered(cap=8192, sq=4, paged=False, **options) -> str:
  S = jax.ShapeDtypeStruct
  b, hq, hk, d = 4, 16, 4, 128
  q = S((b, sq, hq, d), jnp.bfloat16)
  if paged:
    kc = S((b * cap // 64, 64, hk, d), jnp.bfloat16)
    pt = S((b, cap // 64), jnp.int32)
  else:
    kc, pt = S((b, cap, hk, d), jnp.bfloat16), None
  new = S((b, 1, hk, d), jnp.bfloat16)

  def step(q, kc, vc, k, v, n, pt):
    return pallas_fa3.flash_attention_with_kvcache(
      q, kc, vc, k, v, cache_seqlens=n, page_table=pt,
      implementation="mosaic", return_lse=True, **options,
    )  # fmt: skip

  exported = export.export(jax.jit(step), platforms=["cuda"])(
    q, kc, kc, new, new, S((b,), jnp.int32), pt
  )
  return exported.mlir_module()


@pytest.mark.newest  # the decode kernel runs in test_interpret_paths
@pytest.mark.parametrize(
  "options",
  [
    dict(causal=True),
    dict(paged=True, window_size=(1000, 0), softcap=30.0),
    dict(num_splits=8, causal=True),
    dict(sq=128, causal=True),
    dict(cap=339, causal=True),
  ],
  ids=[
    "contiguous",
    "paged-window-softcap",
    "8-splits",
    "q128-8-query-tiles",
    "contiguous-339-gathered",
  ],
)
def test_mosaic_lowers_to_one_kernel_without_a_score_tensor(options):
  text = _lowered(**options)
  assert lowered_kernel_count(text) == 1
  scores = re.findall(r"tensor<[0-9x]*8192x[0-9x]*f32>", text)
  assert not scores, scores


@pytest.mark.timeout(_TIMEOUT_S)
@pytest.mark.parametrize(
  "d,dv,ps",
  [(192, 128, None), (64, 128, 64), (128, 64, None)],
  ids=["d192-dv128-contiguous", "d64-dv128-paged64", "d128-dv64-contiguous"],
)
def test_interpret_value_head_dim_unlike_the_query(d, dv, ps, rng):
  """head_dim_v != head_dim (issue 32): the V ring, O and the output
  follow dv; the scores follow d."""
  case = decode_case(
    rng, batch=2, seq_q=1, heads_q=8, heads_kv=2, head_dim=d, head_dim_v=dv,
    capacity=256, lengths=[70, 256 - 1], page_size=ps, seq_new=1,
  )  # fmt: skip
  args, kwargs = case.call_args()
  spec = make_decode_spec(*args, **kwargs, causal=True)
  try:
    with compat.capture_race_report() as report:
      result = pallas_fa3.flash_attention_with_kvcache(
        *args, **kwargs, causal=True, return_lse=True, num_splits=2,
        implementation="interpret",
        config=pallas_fa3.Sm90DecodeConfig(block_kv=64, num_stages=2),
      )  # fmt: skip
      jax.block_until_ready(result)
  except Exception:
    compat.reset_interpret_state()
    raise
  assert not compat.races_found(), report.getvalue()[-3000:]
  out, lse, kc, vc = result
  assert out.shape == (2, 1, 8, dv)
  golden, naive = decode_golden_and_naive(spec, case, kc, vc)
  for name, got, nv, g in zip(("out", "lse"), (out, lse), naive, golden):
    assert_within_tolerance(name, got, nv, g)
