"""Decoding and the FP8 forward under SPMD sharding (8 devices): every call
goes through the one partitioner, so `flash_attention_with_kvcache` and
`flash_attention_fp8` run shard-locally over batch and heads like
`flash_attention` (issue 42). Each case: the outputs equal the
single-device call's (the same backend on the same shards), and a cache
that shards with the batch (contiguous, no cache_batch_idx) is never
gathered.

Run through `tests/test_scale_out.py`, or directly with
`XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import mesh_helpers as mh
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_fa3
from pallas_fa3 import fp8
from pallas_fa3.testing import decode_case

mh.require_devices()

_AXES = ("data", "model")


def _put(mesh, x, *spec):
  return jax.device_put(x, NamedSharding(mesh, P(*spec)))


@pytest.mark.parametrize(
  "layout,explicit",
  [
    pytest.param(layout, explicit, id=f"{layout}-{explicit}", marks=marks)
    for layout in ("contiguous", "paged", "batch_idx")
    for explicit, marks in (
      (False, ()),
      # Explicit axes: paged and batch_idx are slow; [paged-False] and
      # [batch_idx-False] plan and run the same local call, and
      # [contiguous-True] the Explicit shard_map.
      (True, () if layout == "contiguous" else pytest.mark.slow),
    )
  ],
)
def test_decode_shards_over_batch_and_heads(layout, explicit, rng):
  mesh = mh.mesh((2, 4), _AXES, explicit=explicit)
  case = decode_case(
    rng, batch=4, seq_q=2, heads_q=16, heads_kv=4, head_dim=32,
    capacity=128, lengths=[5, 60, 128 - 3, 30], seq_new=2,
    page_size=32 if layout == "paged" else None,
    batch_idx=layout == "batch_idx",
  )  # fmt: skip
  args, kwargs = case.call_args()
  q, kc, vc, k, v = args
  follows = layout == "contiguous"
  cache_spec = ("data" if follows else None, None, "model")
  sharded = (
    _put(mesh, q, "data", None, "model"),
    _put(mesh, kc, *cache_spec),
    _put(mesh, vc, *cache_spec),
    _put(mesh, k, "data", None, "model"),
    _put(mesh, v, "data", None, "model"),
  )
  kw = dict(kwargs, cache_seqlens=_put(mesh, kwargs["cache_seqlens"], "data"))
  if kwargs["page_table"] is not None:
    kw["page_table"] = _put(mesh, kwargs["page_table"], "data")
  if kwargs["cache_batch_idx"] is not None:
    kw["cache_batch_idx"] = _put(mesh, kwargs["cache_batch_idx"], "data")

  def step(args, kw):
    return pallas_fa3.flash_attention_with_kvcache(
      *args, **kw, causal=True, return_lse=True, implementation="blockwise"
    )

  compiled = jax.jit(step).lower(sharded, kw).compile()
  if follows:  # the cache stays where it is: no gather of it
    cache_bytes = [f"[{','.join(map(str, kc.shape))}]"]
    gathers = [
      line
      for line in compiled.as_text().splitlines()
      if "all-gather" in line and any(c in line for c in cache_bytes)
    ]
    assert not gathers, gathers
  got = compiled(sharded, kw)
  want = jax.jit(step)(args, kwargs)
  for name, g, w in zip(("out", "lse", "k_cache", "v_cache"), got, want):
    np.testing.assert_allclose(
      np.asarray(g, np.float32), np.asarray(w, np.float32), atol=2e-2,
      err_msg=name,
    )  # fmt: skip
  assert got[0].sharding.spec[0] == "data"


def test_decode_with_leftpad_and_rotary_shards_over_the_batch(rng):
  """cache_leftpad shards with the batch (its partition spec), the
  rotary tables are replicated; the cache is never gathered."""
  mesh = mh.mesh((2, 4), _AXES)
  case = decode_case(
    rng, batch=4, seq_q=1, heads_q=16, heads_kv=4, head_dim=32,
    capacity=128, lengths=[5, 60, 120, 30], seq_new=1,
  )  # fmt: skip
  args, kwargs = case.call_args()
  q, kc, vc, k, v = args
  angle = rng.uniform(0, 6, size=(128, 8))
  tables = dict(
    rotary_cos=jnp.asarray(np.cos(angle), jnp.float32),
    rotary_sin=jnp.asarray(np.sin(angle), jnp.float32),
  )
  pads = jnp.asarray([0, 17, 100, 3], jnp.int32)
  sharded = (
    _put(mesh, q, "data", None, "model"),
    _put(mesh, kc, "data", None, "model"),
    _put(mesh, vc, "data", None, "model"),
    _put(mesh, k, "data", None, "model"),
    _put(mesh, v, "data", None, "model"),
  )
  kw = dict(kwargs, cache_seqlens=_put(mesh, kwargs["cache_seqlens"], "data"))

  def step(args, kw, pad):
    return pallas_fa3.flash_attention_with_kvcache(
      *args, **kw, **tables, causal=True, cache_leftpad=pad,
      implementation="blockwise",
    )  # fmt: skip

  compiled = jax.jit(step).lower(sharded, kw, _put(mesh, pads, "data"))
  text = compiled.compile().as_text()
  shape = f"[{','.join(map(str, kc.shape))}]"
  assert not [x for x in text.splitlines() if "all-gather" in x and shape in x]
  got = jax.jit(step)(sharded, kw, _put(mesh, pads, "data"))
  want = jax.jit(step)(args, kwargs, pads)
  for name, g, w in zip(("out", "k_cache", "v_cache"), got, want):
    np.testing.assert_allclose(
      np.asarray(g, np.float32), np.asarray(w, np.float32), atol=2e-2,
      err_msg=name,
    )  # fmt: skip


def test_mqa_decode_with_head_sharded_queries(rng):
  mesh = mh.mesh((2, 4), _AXES)
  case = decode_case(
    rng, batch=2, seq_q=1, heads_q=8, heads_kv=1, head_dim=32, capacity=64,
    lengths=[10, 64],
  )  # fmt: skip
  args, kwargs = case.call_args()
  q = _put(mesh, args[0], "data", None, "model")
  step = jax.jit(
    lambda q, kc, vc, kw: pallas_fa3.flash_attention_with_kvcache(
      q, kc, vc, **kw, implementation="blockwise"
    )
  )
  got = step(q, args[1], args[2], kwargs)
  want = step(args[0], args[1], args[2], kwargs)
  np.testing.assert_allclose(
    np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2
  )


@pytest.mark.parametrize(
  "explicit",
  [
    False,
    # Slow: [False] plans and runs the same local call; the Explicit
    # shard_map: test_decode_shards_over_batch_and_heads[contiguous-True].
    pytest.param(True, marks=pytest.mark.slow),
  ],
)
def test_prequantized_fp8_shards_over_batch_and_heads(explicit, rng):
  mesh = mh.mesh((2, 4), _AXES, explicit=explicit)
  shape = (4, 256, 8, 64)
  q = jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
  kv = jnp.asarray(rng.normal(size=(4, 256, 4, 64)), jnp.bfloat16)
  x = fp8.quantize(q, kv, kv, block_q=64, block_kv=128)
  specs = (
    ("data", None, "model"), ("data", None, "model"), ("data", "model"),
    ("data", "model"), ("data", "model"), ("data", "model"),
  )  # fmt: skip
  sharded = [_put(mesh, a, *s) for a, s in zip(x[:6], specs)]
  config = pallas_fa3.BlockwiseConfig(64, 128)
  call = jax.jit(
    lambda *a: fp8.flash_attention_fp8(
      *a, causal=True, return_lse=True, implementation="blockwise",
      config=config,
    )
  )  # fmt: skip
  got = call(*sharded)
  want = call(*x[:6])
  for g, w in zip(got, want):
    np.testing.assert_allclose(
      np.asarray(g, np.float32), np.asarray(w, np.float32), atol=2e-2
    )
  assert got[0].sharding.spec[0] == "data"
