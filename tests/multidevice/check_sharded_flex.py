"""Flex calls (score_mod, mask_mod, bias with dbias, block_mask) and decoding
with a mask_mod under SPMD sharding (8 devices; 2-way cases too): they run
shard-locally over batch and heads like every other call (issue 65). Each
case, under jit with batch- and head-sharded inputs: the backend sees
shard-local shapes (a spy), the outputs and gradients equal the
single-device call's within the tolerance rule of the float64 golden, and
the compiled program gathers none of q, k, v or the bias.

Run through `tests/test_scale_out.py`, or directly with
`XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu`.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import mesh_helpers as mh
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_fa3
from pallas_fa3 import mods
from pallas_fa3.backends.blockwise import backend as blockwise_backend
from pallas_fa3.testing import flex_golden_and_naive

mh.require_devices()

_AXES = ("data", "model")
B, S, HQ, HK, D = 8, 64, 8, 4, 32
_IDS = jnp.asarray(
  np.arange(S)[None] // (16 + 4 * np.arange(B)[:, None]), jnp.int32
)


@contextlib.contextmanager
def _spy():
  """The q shapes the blockwise backend's passes see."""
  cls = blockwise_backend.BlockwiseBackend
  seen, saved = [], (cls.forward, cls.backward, cls.decode)

  def wrap(name, fn):
    def spied(self, spec, config, *args, **kw):
      q = args[1].q if name == "decode" else args[0]
      seen.append((name, tuple(q.shape)))
      return fn(self, spec, config, *args, **kw)

    return spied

  cls.forward = wrap("forward", saved[0])
  cls.backward = wrap("backward", saved[1])
  cls.decode = wrap("decode", saved[2])
  try:
    yield seen
  finally:
    cls.forward, cls.backward, cls.decode = saved


# kind -> (params, options(params)): every flex kind, each reading batch
# and / or head indices, learnable arrays where the kind has them.
CASES = {
  "alibi_learnable": (
    (jnp.asarray(mods.alibi_slopes(HQ)),),
    lambda p: dict(score_mod=mods.alibi(p[0]), causal=True),
  ),
  "document_mask": ((), lambda p: dict(mask_mod=mods.document_mask(_IDS))),
  "bias_per_head": (
    (0.5 * jax.random.normal(jax.random.key(3), (1, HQ, S, S)),),
    lambda p: dict(bias=p[0]),
  ),
  "bias_per_batch_and_head": (
    (0.5 * jax.random.normal(jax.random.key(4), (B, HQ, S, S)),),
    lambda p: dict(bias=p[0], mask_mod=mods.causal_top_left),
  ),
  "block_mask": (
    (),
    lambda p: dict(
      block_mask=pallas_fa3.create_block_mask(
        mods.and_masks(mods.document_mask(_IDS), mods.causal_top_left),
        B,
        None,
        S,
        S,
        block_q=32,
        block_kv=32,
      )
    ),  # fmt: skip
  ),
  "batch_head_offsets": (
    (0.3 * jax.random.normal(jax.random.key(5), (B, HQ)),),
    lambda p: dict(
      score_mod=lambda s, b, h, qi, ki: s + p[0][b, h] * (ki % 2 == 0),
    ),
  ),
}

# (id, mesh shape, q spec, bias spec where the bias has a batch dim)
MESHES = {
  "2x4_batch_heads": ((2, 4), P("data", None, "model")),
  "8x1_batch": ((8, 1), P(("data", "model"))),
  "1x2_heads": ((1, 2), P(None, None, "model")),
}
_QUICK = {
  ("alibi_learnable", "2x4_batch_heads"),
  ("bias_per_batch_and_head", "2x4_batch_heads"),
  ("block_mask", "8x1_batch"),
  ("document_mask", "1x2_heads"),
  ("batch_head_offsets", "2x4_batch_heads"),
  ("bias_per_head", "8x1_batch"),
}


def _bias_spec(q_spec: P, bias: jax.Array) -> P:
  b, _, h = tuple(q_spec) + (None,) * (3 - len(tuple(q_spec)))
  return P(b if bias.shape[0] > 1 else None, h if bias.shape[1] > 1 else None)


@pytest.mark.parametrize(
  "kind, layout, explicit",
  [
    pytest.param(
      kind,
      layout,
      explicit,
      marks=()
      if (kind, layout) in _QUICK
      and not explicit
      or (kind, layout, explicit) == ("bias_per_head", "2x4_batch_heads", True)
      else pytest.mark.slow,
    )  # fmt: skip
    for kind in CASES
    for layout in MESHES
    for explicit in (False, True)
  ],
)
def test_flex_calls_run_shard_locally(kind, layout, explicit):
  shape, q_spec = MESHES[layout]
  mesh = mh.mesh(shape, _AXES, explicit=explicit)
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (B, S, HQ, D), jnp.float32)
  k = jax.random.normal(ks[1], (B, S, HK, D), jnp.float32)
  v = jax.random.normal(ks[2], (B, S, HK, D), jnp.float32)
  do = jax.random.normal(ks[3], (B, S, HQ, D), jnp.float32)
  params, options = CASES[kind]

  def run(q, k, v, params, do):
    f = lambda q, k, v, p: pallas_fa3.flash_attention(
      q, k, v, implementation="blockwise", **options(p)
    )
    out, pull = jax.vjp(f, q, k, v, params)
    return (out,) + tuple(pull(do))

  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  sharded_params = tuple(
    put(p, _bias_spec(q_spec, p)) if p.ndim == 4 else p for p in params
  )
  args = (put(q, q_spec), put(k, q_spec), put(v, q_spec), sharded_params)
  args += (put(do, q_spec),)
  with _spy() as seen:
    got = jax.jit(run)(*args)
  local_batch = B // mh_ways(mesh, q_spec, 0)
  local_heads = HQ // mh_ways(mesh, q_spec, 2)
  run_shapes = {s for _, s in seen}
  assert (local_batch, S, local_heads, D) in run_shapes, seen
  assert {"forward", "backward"} <= {n for n, _ in seen}, seen
  single = run(q, k, v, params, do)
  golden, naive = flex_golden_and_naive(q, k, v, do, params, options)
  names = ("out", "dq", "dk", "dv", "dparams")
  for name, g, one, n, gl in zip(names, got, single, naive, golden):
    for i, (a, b, c, d) in enumerate(
      zip(*(jax.tree.leaves(x) for x in (g, one, n, gl)))
    ):
      mh.assert_same_within_rule(f"{kind} {name}[{i}]", a, b, c, d)
  hlo = jax.jit(run).lower(*args).compile().as_text()
  gathered = [
    line
    for line in hlo.splitlines()
    if " all-gather(" in line or " all-gather-start(" in line
  ]
  assert not [ln for ln in gathered if _is_qkv_or_bias(ln)], gathered


def mh_ways(mesh, spec, dim):
  entries = tuple(spec) + (None,) * (4 - len(tuple(spec)))
  axes = entries[dim]
  axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
  return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1


def _is_qkv_or_bias(line: str) -> bool:
  """An all-gather whose result is shaped like q, k, v (`[.., S, heads,
  D]`) or the bias (`[.., .., S, S]`)."""
  result = line.split("=", 1)[1].split("all-gather")[0]
  return (
    f",{S},{S}]" in result
    or f"{S},{HQ},{D}]" in result
    or (f"{S},{HK},{D}]" in result)
  )


@pytest.mark.parametrize(
  "explicit", [False, pytest.param(True, marks=pytest.mark.slow)]
)
def test_decode_with_a_mask_mod_runs_shard_locally(explicit):
  """flash_attention_with_kvcache with a mask_mod and a score_mod reading
  batch and head, a contiguous cache sharded with the batch: shard-local
  shapes, the single-device result, no collective at all."""
  mesh = mh.mesh((2, 4), _AXES, explicit=explicit)
  sq, cap = 3, 64
  ks = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(ks[0], (B, sq, HQ, D), jnp.float32)
  kc = jax.random.normal(ks[1], (B, cap, HK, D), jnp.float32)
  vc = jax.random.normal(ks[2], (B, cap, HK, D), jnp.float32)
  lens = jnp.array([10, 40, 64, 5, 1, 33, 17, 60], jnp.int32)
  ids = jnp.asarray(np.arange(cap)[None] // (8 + 4 * np.arange(B)[:, None]))
  slopes = jnp.asarray(mods.alibi_slopes(HQ))

  def f(q, kc, vc, lens):
    return pallas_fa3.flash_attention_with_kvcache(
      q, kc, vc, cache_seqlens=lens, causal=True,
      mask_mod=mods.document_mask(ids), score_mod=mods.alibi(slopes),
      implementation="blockwise",
    )  # fmt: skip

  spec = P("data", None, "model")
  put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
  args = (put(q, spec), put(kc, spec), put(vc, spec), put(lens, P("data")))
  with _spy() as seen:
    got = jax.jit(f)(*args)
  assert ("decode", (B // 2, sq, HQ // 4, D)) in seen, seen
  np.testing.assert_allclose(
    np.asarray(got), np.asarray(f(q, kc, vc, lens)), atol=2e-6
  )
  counts = mh.collectives(jax.jit(f).lower(*args).compile().as_text())
  assert not any(counts.values()), counts


def test_sequence_split_with_flex_is_refused_with_the_reason():
  mesh = mh.mesh((2, 4), _AXES)
  q = jax.random.normal(jax.random.key(0), (B, S, HQ, D), jnp.float32)
  k = jax.random.normal(jax.random.key(1), (B, S, HK, D), jnp.float32)
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "data")))
  with pytest.raises(NotImplementedError, match="sequence axis.*shard the"):
    pallas_fa3.flash_attention(
      put(q), put(k), put(k), mask_mod=mods.causal_top_left,
      implementation="blockwise",
    )  # fmt: skip
