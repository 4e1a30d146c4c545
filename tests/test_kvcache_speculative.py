"""Speculative / multi-token decoding: 2-16 new query tokens per sequence
against a long cache, causal among themselves (appended with the call or
already cached), GQA-packed into the decode kernel's 64-row tiles; interpret
(race detection on) and blockwise against the float64 golden, contiguous
and paged. docs/decoding.md#speculative-decoding"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import pallas_fa3
from pallas_fa3.kernels.sm90 import config_decode
from pallas_fa3.kvcache import make_decode_spec
from pallas_fa3.testing import (
  assert_within_tolerance,
  decode_case,
  decode_golden_and_naive,
  run_interpreted,
)

_SLOW = pytest.mark.slow


def _case_params():
  """(implementation, q_len, page_size): every q_len both ways in
  blockwise; the interpreter's default run one of each layout and the
  widest group x q_len, the rest slow."""
  out = []
  for impl in ("blockwise", "interpret"):
    for sq in (2, 4, 8, 16):
      for ps in (None, 64):
        fast = impl == "blockwise" or (sq, ps) in ((2, None), (16, 64))
        out.append(
          pytest.param(
            impl, sq, ps,
            id=f"{impl}-q{sq}-{'paged64' if ps else 'contiguous'}",
            marks=() if fast else _SLOW,
          )
        )  # fmt: skip
  return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("impl,sq,ps", _case_params())
def test_q_len_against_float64_golden(impl, sq, ps, rng):
  """q_len new tokens appended and attended to causally (the last one sees
  the whole sequence, the first its prefix), GQA 4: q_len x 4 packed rows
  (one 64-row tile up to q_len 16), two ranges of split-KV."""
  case = decode_case(
    rng, batch=2, seq_q=sq, heads_q=8, heads_kv=2, head_dim=64,
    capacity=512, lengths=[500 - sq, 133], page_size=ps, seq_new=sq,
  )  # fmt: skip
  args, kwargs = case.call_args()
  spec = make_decode_spec(*args, **kwargs, causal=True)
  assert config_decode.query_tiles(spec) == 1  # the group's rows packed
  options = dict(causal=True, return_lse=True, num_splits=2)
  if impl == "interpret":
    options["config"] = pallas_fa3.Sm90DecodeConfig(64, 2)
  out, lse, kc, vc = run_interpreted(
    pallas_fa3.flash_attention_with_kvcache, *args, **kwargs, **options,
    implementation=impl,
  )  # fmt: skip
  golden, naive = decode_golden_and_naive(spec, case, kc, vc)
  for name, got, nv, g in zip(("out", "lse"), (out, lse), naive, golden):
    assert_within_tolerance(f"{name} q_len={sq}", got, nv, g)


@pytest.mark.timeout(600)
def test_wide_group_q16_takes_two_query_tiles(rng):
  """GQA 8 x q_len 16 = 128 packed rows: two 64-row tiles, a CTA each
  (each reads the K/V tiles its queries see), against the golden."""
  case = decode_case(
    rng, batch=1, seq_q=16, heads_q=8, heads_kv=1, head_dim=64,
    capacity=256, lengths=[200], seq_new=0,
  )  # fmt: skip
  args, kwargs = case.call_args()
  spec = make_decode_spec(*args, **kwargs, causal=True)
  assert config_decode.query_tiles(spec) == 2
  out, lse = run_interpreted(
    pallas_fa3.flash_attention_with_kvcache, *args, **kwargs, causal=True,
    return_lse=True, implementation="interpret",
    config=pallas_fa3.Sm90DecodeConfig(64, 2),
  )  # fmt: skip
  golden, naive = decode_golden_and_naive(
    spec, case, case.k_cache, case.v_cache
  )
  for name, got, nv, g in zip(("out", "lse"), (out, lse), naive, golden):
    assert_within_tolerance(name, got, nv, g)


@pytest.mark.parametrize("sq", [1, 2, 4, 8, 16])
def test_packed_rows_and_kv_reads_per_step(sq):
  """The kernel's rows for q_len new tokens at the bench's 32/8 heads
  (GQA 4): q_len x 4 rows in one 64-row tile, so each K/V tile is read
  once per step whatever q_len (the bytes of one token); at GQA 8 q_len 16
  needs two tiles (two reads)."""
  shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  for hq, tiles in ((32, 1), (64, 1 if sq <= 8 else 2)):
    q, kc = shape(1, sq, hq, 128), shape(1, 8192, 8, 128)
    spec = make_decode_spec(q, kc, kc, cache_seqlens=8192 - sq, causal=True)
    assert config_decode.packed_heads(spec) == hq // 8
    assert config_decode.query_tiles(spec) == tiles
    assert pallas_fa3.backends.unsupported_reason("mosaic", spec) is None
