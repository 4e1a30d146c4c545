"""The public entry point: validate -> canonical spec -> choose backend -> custom_vjp."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_fa3 import backends, modifiers, segments, vjp
from pallas_fa3.backends.base import Backend
from pallas_fa3.fp8 import FP8Config, check_fp8
from pallas_fa3.parallel import context, sharding_checks
from pallas_fa3.spec import check_arrays, check_bool, make_spec
from pallas_fa3.stable_max import StableMax, check_stable_max


def _attention(
  call: vjp.StaticCall,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  sinks: jax.Array | None,
  segment_ids: segments.SegmentIds | None,
) -> tuple[jax.Array, jax.Array]:
  if sinks is not None:  # [hq] -> float32 [b, hq]; d/dsinks sums over b
    sinks = modifiers.batch_sinks(sinks, call.spec.batch)
  # Inside a shard_map: every operand varies like q (cotangents then have
  # their primal's type; a replicated one's gradient is summed by the cast).
  q, k, v, sinks, segment_ids = sharding_checks.vary_alike(
    (q, k, v, sinks, segment_ids)
  )
  return vjp.attention_with_lse(call, q, k, v, sinks, segment_ids)


# Jitted once per static call, so that eager (un-jitted) use compiles each
# shape once instead of dispatching the tiled loops op by op.
_attention_jit = jax.jit(_attention, static_argnums=0)


def flash_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  causal: bool = False,
  softmax_scale: float | None = None,
  return_lse: bool = False,
  implementation: str | None = None,
  config: Any = None,
  deterministic: bool = False,
  stable_max: bool | StableMax | None = None,
  fp8: bool | FP8Config = False,
  window_size: tuple[int | None, int | None] | None = None,
  softcap: float | None = None,
  sinks: jax.Array | None = None,
  segment_ids: segments.SegmentIds | tuple | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Scaled dot-product attention, computed FlashAttention-style.

  `out[b, i, h] = sum_j softmax_j(scale * q[b, i, h] . k[b, j, h // g]) v[b, j, h // g]`
  with `g = heads_q // heads_kv` query heads per key/value head (MHA when
  g = 1, MQA when heads_kv = 1, GQA otherwise; K/V are never repeated).

  Causal masking is **bottom-right aligned** as in FlashAttention-2/3: query i
  sees key j iff `j <= i + seq_kv - seq_q`. With `seq_q > seq_kv` the first
  `seq_q - seq_kv` queries see no key: their output is 0 and their lse is
  `-inf`, and their gradients are finite (zero). Windows, softcap and sinks
  are described in `pallas_fa3.modifiers`.

  Args:
    q: `[batch, seq_q, heads_q, head_dim]`, float16, bfloat16 or float32.
    k: `[batch, seq_kv, heads_kv, head_dim]`, same dtype, `heads_q % heads_kv == 0`.
    v: `[batch, seq_kv, heads_kv, head_dim_v]`, same dtype; head dims <= 256.
    causal: apply the bottom-right aligned causal mask.
    softmax_scale: positive finite scale of the scores; default `1/sqrt(head_dim)`.
    return_lse: also return the log-sum-exp of the scaled scores.
    implementation: None (automatic: the fastest backend that supports the
      call among those computing the kernels' function -- `mosaic` on a Hopper
      GPU, else `blockwise`), or one of "mosaic", "interpret", "blockwise",
      "reference".
    config: backend-specific tiling: `pallas_fa3.BlockwiseConfig` for
      blockwise; `pallas_fa3.Sm90Config(forward=Sm90ForwardConfig(...),
      backward=Sm90BackwardConfig(...))` for mosaic/interpret (a bare
      `Sm90ForwardConfig` means `Sm90Config(forward=...)`; a None part is the
      heuristic default). None picks the backend's default.
    deterministic: require bitwise run-to-run reproducible gradients. The
      Hopper backward is by default one fused kernel that sums dQ in
      float32 by TMA reduce-add (order varies run to run); with True it
      runs a dK/dV kernel and a separate dQ kernel that sums dQ in a fixed
      order. The blockwise twin and the reference are deterministic either
      way.
    stable_max: the repeated-max fix of arXiv 2510.04212 (see
      `pallas_fa3.stable_max`): None/False (off), True (defaults) or a
      `pallas_fa3.StableMax`. Implemented by `blockwise` (the automatic
      choice then runs blockwise); other backends raise NotImplementedError.
    fp8: False (default), True or a `pallas_fa3.FP8Config`: quantize Q, K, V
      to e4m3 (block quantization and randomized-Hadamard rotation unless
      the config turns them off) and run the FP8 forward on "mosaic",
      "interpret" or "blockwise" (see `pallas_fa3.fp8`). The output keeps the
      input dtype. Not differentiable: gradients raise NotImplementedError.
    window_size: `(left, right)` keys visible around each query's diagonal
      (None for an unbounded side), see `pallas_fa3.modifiers`.
    softcap: `c * tanh(scores / c)` before the softmax.
    sinks: float32 `[heads_q]` learnable sink logits (one extra softmax
      term per head, no value).
    segment_ids: packed sequences: a `pallas_fa3.SegmentIds(q, kv)`, a
      `(q_ids, kv_ids)` tuple of int32 `[batch, seq]` arrays, or for
      self-attention one int32 `[batch, seq]` array; query i sees key j
      only where their ids are equal (see `pallas_fa3.segments`).

  Returns:
    out `[batch, seq_q, heads_q, head_dim_v]` in the input dtype; with
    `return_lse`, `(out, lse)` where lse is float32 `[batch, heads_q, seq_q]`
    in natural log.

  Raises:
    TypeError / ValueError: bad inputs; the message names the argument.
      That includes a sharding that can run neither shard-locally nor as a
      ring (see `pallas_fa3.parallel.partitioning` and
      `pallas_fa3.parallel.context`); when the sharding is only known at
      compile time, XLA raises it as a `jax.errors.JaxRuntimeError`.
    NotImplementedError: the requested implementation cannot serve the call;
      also on a second derivative (`jax.grad` of `jax.grad`): flash_attention
      has first derivatives only.

  Example:
    >>> import jax, pallas_fa3
    >>> q = jax.random.normal(jax.random.key(0), (2, 128, 8, 64), "bfloat16")
    >>> k = jax.random.normal(jax.random.key(1), (2, 128, 2, 64), "bfloat16")
    >>> out, lse = pallas_fa3.flash_attention(q, k, k, causal=True, return_lse=True)
    >>> out.shape, lse.shape
    ((2, 128, 8, 64), (2, 8, 128))
  """
  check_arrays(q=q, k=k, v=v)
  spec = make_spec(
    q,
    k,
    v,
    causal=causal,
    softmax_scale=softmax_scale,
    fp8=check_fp8(fp8),
    stable_max=check_stable_max(stable_max),
    deterministic=deterministic,
    window_size=window_size,
    softcap=softcap,
    sinks=sinks is not None,
    segmented=segment_ids is not None,
  )
  sinks = modifiers.check_sinks(sinks, spec.heads_q)
  segment_ids = segments.check_segment_ids(
    segment_ids, spec.batch, spec.seq_q, spec.seq_kv
  )
  if spec.fp8 is not None and spec.head_dim != spec.head_dim_v:
    raise ValueError(
      f"fp8 needs v's head_dim equal to q's; got q.shape="
      f"{tuple(q.shape)}, v.shape={tuple(v.shape)}"
    )
  return_lse = check_bool("return_lse", return_lse)
  backend, config = backends.resolve(spec, implementation, config)
  # A sequence split runs the ring (context parallelism); see
  # pallas_fa3.parallel.context.
  context.check_array_shardings(
    vjp.StaticCall(spec, backend, config), q=q, k=k, v=v
  )
  _check_device_for_eager_call(backend, q, k, v)
  out, lse = _attention_jit(
    vjp.StaticCall(spec, backend, config),
    jnp.asarray(q),
    jnp.asarray(k),
    jnp.asarray(v),
    sinks,
    segment_ids,
  )
  return (out, lse) if return_lse else out


def _check_device_for_eager_call(backend: Backend, *arrays: Any) -> None:
  """An eager call of a backend the devices cannot run raises, saying why.

  Traced calls (under `jit`, `export`, ...) pass: lowering for another
  platform, e.g. `jax.export(..., platforms=['cuda'])` of `mosaic` on a
  machine without a GPU, is legitimate (run under `jit` on a CPU, Pallas
  itself refuses: "Only interpret mode is supported on CPU backend").
  """
  if not any(isinstance(a, jax.core.Tracer) for a in arrays):
    backends.require_runnable_here(backend)
