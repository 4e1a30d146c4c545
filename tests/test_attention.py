"""One suite for every backend: outputs, lse and gradients against the float64 golden.

Each case checks out, lse, dq, dk and dv with the tolerance rule of
`pallas_fa3.testing` (2x the naive low-dtype error + a small floor). Products
are pruned: shapes x causal at bf16, head dims at each dtype, block configs
on one ragged shape.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ALL_IMPLEMENTATIONS, forward_and_grads, skip_if_unsupported

import pallas_fa3
from pallas_fa3.testing import (
  Shape,
  assert_within_tolerance,
  golden_and_naive,
  random_inputs,
)

_NAMES = ("out", "lse", "dq", "dk", "dv")

SHAPES = [
  Shape(1, 1, 1, 2, 2, 64),  # seq 1
  Shape(2, 17, 17, 4, 4, 64),  # ragged, MHA
  Shape(1, 113, 203, 4, 2, 64),  # sq < skv, GQA
  Shape(1, 203, 113, 4, 1, 64),  # sq > skv (empty causal rows), MQA
  Shape(1, 1, 300, 8, 2, 64),  # decoding: one query, many keys
  Shape(1, 64, 1, 2, 1, 64),  # one key: only the last causal row sees it
  Shape(1, 1023, 1024, 2, 1, 64),  # long, off by one from a tile multiple
]


def _check_case(
  implementation,
  key,
  shape,
  dtype,
  causal,
  *,
  config=None,
  softmax_scale=None,
  with_dlse=False,
):
  q, k, v, dout = random_inputs(key, shape, dtype)
  skip_if_unsupported(implementation, q, k, v, causal, softmax_scale)
  dlse = None
  if with_dlse:
    dlse = jax.random.normal(
      jax.random.fold_in(key, 7), (shape.batch, shape.heads_q, shape.seq_q)
    )
  got = forward_and_grads(
    implementation,
    q,
    k,
    v,
    dout,
    causal=causal,
    softmax_scale=softmax_scale,
    config=config,
    dlse=dlse,
  )
  golden, naive = golden_and_naive(
    q, k, v, dout, causal=causal, softmax_scale=softmax_scale, dlse=dlse
  )
  assert got[0].dtype == dtype and got[0].shape == (
    shape.batch,
    shape.seq_q,
    shape.heads_q,
    shape.dv,
  )
  assert got[1].dtype == jnp.float32 and got[1].shape == (
    shape.batch,
    shape.heads_q,
    shape.seq_q,
  )
  for name, x, arg in zip(_NAMES[2:], got[2:], (q, k, v)):
    assert x.dtype == dtype and x.shape == arg.shape, name
  # Rows that see no key: exactly -inf lse, exactly zero output.
  empty = np.isneginf(golden[1])
  np.testing.assert_array_equal(np.isneginf(np.asarray(got[1])), empty)
  for name, x, n, g in zip(_NAMES, got, naive, golden):
    assert_within_tolerance(name, x, n, g)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("implementation", ALL_IMPLEMENTATIONS)
def test_shapes_bf16(implementation, shape, causal, key):
  _check_case(implementation, key, shape, jnp.bfloat16, causal)


@pytest.mark.parametrize(
  "dtype,head_dim",
  [
    pytest.param(
      dtype, d, id=f"{jnp.dtype(dtype).name}-{d}",
      # float16 and float32 at the middle head dims: under -m slow
      marks=[pytest.mark.slow] if dtype != jnp.bfloat16 and d in (80, 96, 128) else [],
    )
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32)
    for d in (64, 80, 96, 128, 256)
  ],
)  # fmt: skip
@pytest.mark.parametrize("implementation", ALL_IMPLEMENTATIONS)
def test_head_dims_and_dtypes(implementation, dtype, head_dim, key):
  shape = Shape(1, 150, 130, 4, 2, head_dim)
  _check_case(implementation, key, shape, dtype, causal=head_dim % 64 == 0)


@pytest.mark.parametrize(
  "dtype", [jnp.float16, jnp.float32], ids=lambda d: jnp.dtype(d).name
)
@pytest.mark.parametrize("shape", [SHAPES[2], SHAPES[3]], ids=str)
@pytest.mark.parametrize("implementation", ALL_IMPLEMENTATIONS)
def test_causal_alignments_other_dtypes(implementation, shape, dtype, key):
  _check_case(implementation, key, shape, dtype, causal=True)


@pytest.mark.newest
@pytest.mark.parametrize("implementation", ALL_IMPLEMENTATIONS)
def test_value_head_dim_differs(implementation, key):
  _check_case(
    implementation,
    key,
    Shape(2, 70, 90, 4, 2, 64, head_dim_v=32),
    jnp.bfloat16,
    causal=True,
  )


@pytest.mark.newest
@pytest.mark.parametrize("implementation", ALL_IMPLEMENTATIONS)
def test_softmax_scale_and_lse_cotangent(implementation, key):
  """A custom scale, and gradients flowing through the lse output too."""
  _check_case(
    implementation,
    key,
    Shape(1, 96, 160, 4, 2, 64),
    jnp.float32,
    causal=True,
    softmax_scale=0.3,
    with_dlse=True,
  )
  _check_case(
    implementation,
    jax.random.fold_in(key, 1),
    Shape(1, 96, 160, 2, 2, 64),
    jnp.bfloat16,
    causal=False,
    softmax_scale=1.7,
    with_dlse=True,
  )


@pytest.mark.parametrize(
  "block_q,block_kv",
  [(16, 16), (16, 64), (64, 16), (32, 48), (128, 128), (512, 512)],
)
def test_blockwise_tile_configs(block_q, block_kv, key):
  """Many tiles, ragged edges on both axes, non-power-of-two tiles."""
  config = pallas_fa3.BlockwiseConfig(block_q=block_q, block_kv=block_kv)
  _check_case(
    "blockwise",
    key,
    Shape(1, 203, 113, 4, 2, 64),
    jnp.bfloat16,
    causal=True,
    config=config,
  )
  _check_case(
    "blockwise",
    jax.random.fold_in(key, 1),
    Shape(1, 113, 203, 2, 2, 64),
    jnp.float32,
    causal=False,
    config=config,
  )


@pytest.mark.newest
@pytest.mark.parametrize("implementation", ALL_IMPLEMENTATIONS)
def test_rows_without_keys(implementation, key):
  """Bottom-right causal with sq > skv: rows 0..sq-skv-1 see nothing."""
  shape = Shape(2, 50, 20, 2, 1, 32)
  q, k, v, dout = random_inputs(key, shape, jnp.bfloat16)
  skip_if_unsupported(implementation, q, k, v, True)
  out, lse, dq, dk, dv = forward_and_grads(
    implementation, q, k, v, dout, causal=True
  )
  n_empty = shape.seq_q - shape.seq_kv
  assert np.all(np.asarray(out[:, :n_empty]) == 0)
  assert np.all(np.isneginf(np.asarray(lse[..., :n_empty])))
  assert np.all(np.isfinite(np.asarray(lse[..., n_empty:])))
  for g in (dq, dk, dv):
    assert np.all(np.isfinite(np.asarray(g, np.float32)))
  assert np.all(np.asarray(dq[:, :n_empty]) == 0)
  # The first row that sees a key sees exactly key 0: its output is v[0].
  np.testing.assert_array_equal(
    np.asarray(out[:, n_empty]),
    np.repeat(np.asarray(v[:, 0]), shape.heads_q // shape.heads_kv, axis=1),
  )


@pytest.mark.newest
@pytest.mark.parametrize("implementation", ALL_IMPLEMENTATIONS)
def test_causal_mask_hides_the_future(implementation, key):
  """Changing keys/values a query cannot see leaves its output bit-identical."""
  shape = Shape(1, 200, 260, 2, 2, 64)
  q, k, v, _ = random_inputs(key, shape, jnp.bfloat16)
  skip_if_unsupported(implementation, q, k, v, True)
  f = jax.jit(
    lambda q, k, v: pallas_fa3.flash_attention(
      q, k, v, causal=True, implementation=implementation
    )
  )
  cut = 100  # queries < cut see keys <= cut - 1 + 60
  first_hidden = cut + shape.seq_kv - shape.seq_q
  noise = 1e3 * jax.random.normal(jax.random.fold_in(key, 1), k.shape, k.dtype)
  k2 = k.at[:, first_hidden:].set(noise[:, first_hidden:])
  v2 = v.at[:, first_hidden:].set(noise[:, first_hidden:])
  a, b = f(q, k, v), f(q, k2, v2)
  np.testing.assert_array_equal(np.asarray(a[:, :cut]), np.asarray(b[:, :cut]))
  assert not np.array_equal(np.asarray(a[:, cut:]), np.asarray(b[:, cut:]))


@pytest.mark.newest
@pytest.mark.parametrize("implementation", ALL_IMPLEMENTATIONS)
def test_deterministic(implementation, key):
  """With deterministic=True two runs of forward and backward are bit-equal
  (on a GPU the default fused backward sums dQ by reduce-add, in no fixed
  order)."""
  shape = Shape(1, 190, 170, 4, 2, 64)
  q, k, v, dout = random_inputs(key, shape, jnp.bfloat16)
  skip_if_unsupported(implementation, q, k, v, True)
  run = functools.partial(
    forward_and_grads, implementation, causal=True, deterministic=True
  )
  first, second = run(q, k, v, dout), run(q, k, v, dout)
  for name, a, b in zip(_NAMES, first, second):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.newest
def test_automatic_choice_is_blockwise_on_cpu(key):
  """On a CPU the automatic choice computes exactly the blockwise function."""
  if jax.default_backend() != "cpu":
    pytest.skip("checks the CPU choice")
  q, k, v, _ = random_inputs(key, Shape(1, 70, 90, 4, 2, 64), jnp.bfloat16)
  auto = pallas_fa3.flash_attention(q, k, v, causal=True, return_lse=True)
  explicit = pallas_fa3.flash_attention(
    q, k, v, causal=True, return_lse=True, implementation="blockwise"
  )
  for a, b in zip(auto, explicit):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.newest
def test_blockwise_memory_is_linear_in_sequence_length():
  """Compiled temp bytes: blockwise ~doubles per seq doubling, reference ~4x."""

  def temp_bytes(implementation, seq, grad):
    spec = jax.ShapeDtypeStruct((1, seq, 1, 64), jnp.float32)
    f = lambda q, k, v: pallas_fa3.flash_attention(
      q, k, v, implementation=implementation
    ).sum()
    f = jax.grad(f, argnums=(0, 1, 2)) if grad else f
    compiled = jax.jit(f).lower(spec, spec, spec).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  for grad in (False, True):
    small, big = (temp_bytes("blockwise", s, grad) for s in (2048, 4096))
    ref_big = temp_bytes("reference", 4096, grad)
    assert big <= 2.5 * small, (grad, small, big)
    # The full float32 score matrix alone would be 4096^2 * 4 bytes = 64 MiB.
    assert big < 4096 * 4096 * 4 / 8, (grad, big)
    assert ref_big >= 4096 * 4096 * 4, (grad, ref_big)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
  "shape",
  [
    Shape(1, 2048, 2048, 4, 1, 128),
    Shape(1, 4096, 3000, 2, 2, 64),
    Shape(2, 1500, 4096, 8, 2, 256),
  ],
  ids=str,
)
@pytest.mark.parametrize(
  "dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name
)
@pytest.mark.parametrize("implementation", ALL_IMPLEMENTATIONS)
def test_slow_long_sequences(implementation, dtype, shape, causal, key):
  """Long sequences (more online-softmax rescaling steps): `pytest -m slow`."""
  _check_case(implementation, key, shape, dtype, causal)
