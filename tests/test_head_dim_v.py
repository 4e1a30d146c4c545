"""Value head dims unlike the query's in the Hopper kernels (DeepSeek's MLA
training shapes 192/128 and the others of issue 32): interpret mode
against the float64 golden (forward, lse, gradients; fused and
deterministic backwards; GQA, ragged lengths, causal and not, windows,
softcap, sinks, segment ids), the decode kernel, the CUDA lowering of
`jax.grad` through `mosaic` (the kernels, no `[seq_q, seq_kv]` tensor) and
the refusals naming head_dim_v."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import pallas_fa3
from pallas_fa3 import backends
from pallas_fa3.kernels.sm90 import config_backward
from pallas_fa3.spec import make_spec
from pallas_fa3.testing import (
  Shape,
  assert_lowered_attention,
  assert_within_tolerance,
  golden_and_naive,
  random_inputs,
)

_TIMEOUT_S = 300
PAIRS = ((192, 128), (128, 64), (64, 128), (256, 128))
_SLOW = pytest.mark.slow


def _check(shape, dtype, key, deterministic=False, **options):
  q, k, v, dout = random_inputs(key, shape, dtype)
  sinks = options.pop("sinks", None)

  def fwd_bwd(q, k, v):
    f = lambda q, k, v: pallas_fa3.flash_attention(
      q, k, v, return_lse=True, implementation="interpret",
      deterministic=deterministic, sinks=sinks, **options,
    )  # fmt: skip
    (out, lse), pullback = jax.vjp(f, q, k, v)
    return (out, lse) + pullback((dout, jnp.zeros_like(lse)))

  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no fallback to the blockwise twin
    # Done before XLA compiles the golden: the CI's XLA CPU compiler
    # segfaulted compiling it while the interpreted kernels still ran.
    got = jax.block_until_ready(jax.jit(fwd_bwd)(q, k, v))
  golden, naive = golden_and_naive(q, k, v, dout, sinks=sinks, **options)
  for name, g, n, gold in zip(
    ("out", "lse", "dq", "dk", "dv"), got, naive, golden
  ):
    assert_within_tolerance(name, g, n, gold)
  assert got[0].shape == (shape.batch, shape.seq_q, shape.heads_q, shape.dv)


@pytest.mark.timeout(_TIMEOUT_S)
@pytest.mark.parametrize(
  "d,dv,causal,deterministic,dtype",
  [
    pytest.param(192, 128, True, False, jnp.bfloat16, id="192-128-causal-fused"),
    pytest.param(128, 64, False, True, jnp.float16, id="128-64-full-det-fp16"),
    pytest.param(64, 128, True, True, jnp.bfloat16, id="64-128-causal-det"),
    pytest.param(256, 128, False, False, jnp.bfloat16, id="256-128-full"),
    pytest.param(192, 128, False, True, jnp.float16, id="192-128-full-det", marks=_SLOW),
    pytest.param(128, 64, True, False, jnp.bfloat16, id="128-64-causal-fused", marks=_SLOW),
    pytest.param(64, 128, False, False, jnp.float16, id="64-128-full-fused", marks=_SLOW),
    pytest.param(256, 128, True, True, jnp.bfloat16, id="256-128-causal-det", marks=_SLOW),
  ],
)  # fmt: skip
def test_interpret_against_float64_golden(
  d, dv, causal, deterministic, dtype, key
):
  shape = Shape(1, 200, 330, 4, 2, d, dv)  # GQA, ragged, sq != skv
  _check(shape, dtype, key, deterministic=deterministic, causal=causal)


@pytest.mark.timeout(_TIMEOUT_S)
def test_interpret_with_every_modifier(key, rng):
  """Window, softcap, sinks and segment ids (packed documents) together."""
  shape = Shape(1, 192, 256, 2, 1, 192, 128)
  ids = np.repeat(np.arange(3), [64, 64, 128])[None].astype(np.int32)
  _check(
    shape,
    jnp.bfloat16,
    key,
    causal=True,
    window_size=(100, None),
    softcap=6.0,
    sinks=jnp.asarray([0.5, -0.5]),
    segment_ids=(jnp.asarray(ids[:, :192]), jnp.asarray(ids)),
  )


@pytest.mark.parametrize("deterministic", [False, True], ids=["fused", "det"])
@pytest.mark.parametrize("d,dv", PAIRS, ids=[f"{d}-{v}" for d, v in PAIRS])
def test_grad_through_mosaic_lowers_to_the_kernels(d, dv, deterministic):
  q = jax.ShapeDtypeStruct((2, 1000, 4, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, 1100, 2, d), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((2, 1100, 2, dv), jnp.bfloat16)

  def loss(q, k, v):
    out = pallas_fa3.flash_attention(
      q, k, v, causal=True, implementation="mosaic",
      deterministic=deterministic,
    )  # fmt: skip
    return out.astype(jnp.float32).sum()

  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no blockwise fallback
    exported = export.export(
      jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["cuda"]
    )(q, k, v)
  spec = make_spec(q, k, v, causal=True, deterministic=deterministic)
  config = config_backward.default_backward_config(spec)
  fused = config_backward.fused_backward(spec, config)
  assert_lowered_attention(
    exported.mlir_module(), kernels=2 if fused else 3, seq_q=1000, seq_kv=1100
  )
  assert [a.shape for a in exported.out_avals] == [q.shape, k.shape, v.shape]


@pytest.mark.timeout(_TIMEOUT_S)
def test_decode_kernel_with_head_dim_v(rng):
  from pallas_fa3.kvcache import make_decode_spec
  from pallas_fa3.testing import decode_case, decode_golden_and_naive

  case = decode_case(
    rng, batch=2, seq_q=2, heads_q=8, heads_kv=2, head_dim=192,
    head_dim_v=128, capacity=256, lengths=[40, 200], page_size=64,
  )  # fmt: skip
  args, kwargs = case.call_args()
  spec = make_decode_spec(*args, **kwargs, causal=True)
  out, lse = pallas_fa3.flash_attention_with_kvcache(
    *args, **kwargs, causal=True, return_lse=True, num_splits=2,
    implementation="interpret",
    config=pallas_fa3.Sm90DecodeConfig(block_kv=64, num_stages=2),
  )  # fmt: skip
  golden, naive = decode_golden_and_naive(
    spec, case, case.k_cache, case.v_cache
  )
  assert out.shape == (2, 2, 8, 128)
  for name, g, n, gold in zip(("out", "lse"), (out, lse), naive, golden):
    assert_within_tolerance(name, g, n, gold)


def test_other_pairs_are_refused_naming_head_dim_v():
  q = jax.ShapeDtypeStruct((1, 128, 2, 128), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, 128, 2, 80), jnp.bfloat16)
  spec = make_spec(q, q, v)
  reason = backends.unsupported_reason("mosaic", spec)
  assert reason and "head_dim_v 80" in reason
  with pytest.raises(NotImplementedError, match="head_dim_v 80"):
    jax.eval_shape(
      lambda q, v: pallas_fa3.flash_attention(q, q, v, implementation="mosaic"),
      q,
      v,
    )
  # The automatic choice serves it with the blockwise twin (the same
  # function), never silently under an explicit "mosaic".
  choices = dict(backends.explain_choice(spec))
  assert choices["blockwise"] is None
