"""Flex decode on the GQA-packed rows (issue 67 item 2): the decode kernel
runs the user's functions on the group's packed rows
(`UserFunction.packed`: head `kv_head * g + row % g`, query `row // g`),
one CTA per KV head: a softcap score_mod, window or causal mask_mods, and
arrays read at the packed row's head or query (ALiBi's slopes[head], a
document mask's ids[q_idx]: per-row operands built outside the kernel,
`flex_tile.DerivedRead`); block masks keep one query head per CTA.
(`tests/test_flex_decode_kernel.py`'s ALiBi and document cases, GQA 4,
run packed.) docs/flex.md#decoding"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_fa3
from pallas_fa3 import flex, mods
from pallas_fa3.kernels.sm90 import config_decode
from pallas_fa3.kvcache import make_decode_spec
from pallas_fa3.testing import (
  assert_within_tolerance,
  decode_case,
  decode_golden_and_naive,
  run_interpreted,
)

_IDS = jnp.asarray((np.arange(256) // 37)[None].repeat(2, 0), jnp.int32)


def _flex_spec(hq, hk, score_mod=None, mask_mod=None):
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  spec = make_decode_spec(
    s(2, 1, hq, 64), s(2, 256, hk, 64), s(2, 256, hk, 64), cache_seqlens=9
  )
  fs, _ = flex.prepare(
    score_mod=score_mod, mask_mod=mask_mod, block_mask=None, bias=None,
    batch=2, heads=hq, seq_q=256, seq_kv=256,
  )  # fmt: skip
  return dataclasses.replace(spec, flex=fs)


@pytest.mark.parametrize(
  "fns,packs",
  [
    (dict(score_mod=mods.softcap(20.0)), True),
    (dict(mask_mod=mods.sliding_window(40)), True),
    (dict(mask_mod=lambda b, h, q, k: q >= k), True),
    (dict(score_mod=mods.alibi(mods.alibi_slopes(8))), True),
    (dict(mask_mod=mods.document_mask(_IDS)), True),
    (dict(mask_mod=lambda b, h, q, k: _IDS[b, q * k % 256] > 0), False),
  ],
  ids=["softcap", "window", "causal", "alibi", "documents", "gather"],
)
def test_which_functions_pack(fns, packs):
  spec = _flex_spec(8, 2, **fns)
  assert config_decode.flex_packs(spec) is packs
  assert config_decode.packed_heads(spec) == (4 if packs else 1)
  assert config_decode.grid_heads(spec) == (2 if packs else 8)


@pytest.mark.timeout(300)
def test_packed_window_and_softcap_against_float64_golden(rng):
  """GQA 4, q_len 4 (16 packed rows), paged, 2 splits, sinks: a window
  mask_mod and a softcap score_mod on packed rows give the golden of the
  built-in window_size and softcap."""
  case = decode_case(
    rng, batch=2, seq_q=4, heads_q=8, heads_kv=2, head_dim=64,
    capacity=256, lengths=[200, 61], page_size=64,
  )  # fmt: skip
  args, kwargs = case.call_args()
  sinks = jnp.asarray(rng.normal(size=8), jnp.float32)
  fns = dict(score_mod=mods.softcap(20.0), mask_mod=mods.sliding_window(40))
  out, lse = run_interpreted(
    pallas_fa3.flash_attention_with_kvcache, *args, **kwargs, **fns,
    causal=True, sinks=sinks, num_splits=2, return_lse=True,
    implementation="interpret",
    config=pallas_fa3.Sm90DecodeConfig(64, 2),
  )  # fmt: skip
  spec = make_decode_spec(
    *args, **kwargs, causal=True, window_size=(40, 0), softcap=20.0,
    sinks=True,
  )  # fmt: skip
  golden, naive = decode_golden_and_naive(
    spec, case, case.k_cache, case.v_cache, sinks
  )
  for name, got, nv, g in zip(("out", "lse"), (out, lse), naive, golden):
    assert_within_tolerance(name, got, nv, g)
