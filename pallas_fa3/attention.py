"""The entry points: `flash_attention` and `flash_attention_with_kvcache`.
Each validates its arguments into one spec (`prepare.prepare`,
`kvcache.make_decode_spec`), plans it once (`backends.plan`: the backend
from one registry, either mode, and how its gradients run; `explain`
prints the plan) and runs through the one custom_vjp
(`pallas_fa3.vjp`). docs/api.md, docs/decoding.md
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp

from pallas_fa3 import (
  backends,
  flex,
  kvcache,
  kvcache_ragged,
  modifiers,
  prepare,
  rotary,
  segments,
  vjp,
)
from pallas_fa3.backends import Implementation
from pallas_fa3.backends.base import Backend, Decode, Prefill, StaticCall
from pallas_fa3.fp8 import FP8Config, check_fp8
from pallas_fa3.kvcache import DecodeSpec, make_decode_spec
from pallas_fa3.parallel import context, partitioning, sharding_checks
from pallas_fa3.spec import check_bool
from pallas_fa3.stable_max import StableMax, check_stable_max


def _attention(
  call: StaticCall,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  sinks: jax.Array | None,
  segment_ids: segments.SegmentIds | None,
  flex_ops: flex.FlexOperands | None = None,
) -> tuple[jax.Array, jax.Array]:
  if sinks is not None:  # [hq] -> float32 [b, hq]; d/dsinks sums over b
    sinks = modifiers.batch_sinks(sinks, call.spec.batch)
  # Inside a shard_map: every operand varies like q (cotangents then have
  # their primal's type; a replicated one's gradient is summed by the cast).
  operands = sharding_checks.vary_alike(
    Prefill(q, k, v, sinks, segment_ids, flex_ops)
  )
  return vjp.call(call, operands)


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
  implementation: Implementation | None = None,
  config: Any = None,
  deterministic: bool = False,
  stable_max: bool | StableMax | None = None,
  fp8: bool | FP8Config = False,
  window_size: tuple[int | None, int | None] | None = None,
  softcap: float | None = None,
  sinks: jax.Array | None = None,
  segment_ids: segments.SegmentIds | tuple | None = None,
  score_mod: Any = None,
  mask_mod: Any = None,
  block_mask: flex.BlockMask | None = None,
  bias: jax.Array | None = None,
  batch_invariant: bool = False,
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
      only where their ids are equal (see `pallas_fa3.segments`). `causal`
      and `window_size` stay aligned over the whole row (`j <= i + seq_kv -
      seq_q`), not per segment: where a segment's queries and keys sit at
      different places (FA3 varlen's cu_seqlens_q != cu_seqlens_k as ids)
      that is not FA3's per-sequence causal, which a `mask_mod` gives
      (docs/api.md#causal-across-packed-documents).
    score_mod: `score_mod(score, batch, head, q_idx, kv_idx) -> score` on
      scalars: score the float32 scaled logit (after softmax_scale and
      softcap, with the bias added), indices int32 absolute positions and
      the query head. Arrays it closes over are operands of the call and
      get gradients (docs/flex.md).
    mask_mod: `mask_mod(batch, head, q_idx, kv_idx) -> bool`: the pairs
      that may attend (and-ed with every other mask).
    block_mask: a `pallas_fa3.BlockMask` (`create_block_mask`,
      `BlockMask.from_dense`) for this call's sizes: its empty tiles are
      never computed, its full ones not masked, its partial ones masked by
      `mask_mod` (default: the block mask's own) or its dense mask.
    bias: `[batch|1, heads_q|1, seq_q, seq_kv]` added to the scaled
      logits (differentiable).
    batch_invariant: True: each sequence's output and lse are bitwise the
      same whatever else is in the batch and its place in it (every
      backend's tiles are chosen without the batch, and each sequence's
      tiles are reduced in a fixed order); implies `deterministic`. On
      mosaic/interpret with segment_ids: NotImplementedError (their
      kernel-or-twin choice is made for the whole batch).

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
  call, _, operands = _prepare(
    q,
    k,
    v,
    causal=causal,
    softmax_scale=softmax_scale,
    implementation=implementation,
    config=config,
    deterministic=deterministic,
    stable_max=stable_max,
    fp8=fp8,
    window_size=window_size,
    softcap=softcap,
    sinks=sinks,
    segment_ids=segment_ids,
    score_mod=score_mod,
    mask_mod=mask_mod,
    block_mask=block_mask,
    bias=bias,
    batch_invariant=batch_invariant,
  )
  return_lse = check_bool("return_lse", return_lse)
  context.check_array_shardings(call, q=q, k=k, v=v)
  _check_device_for_eager_call(call.backend, q, k, v)
  out, lse = _attention_jit(call, *operands)
  return (out, lse) if return_lse else out


# flash_attention's keywords and their defaults: what `explain` takes.
_KEYWORDS = {
  name: p.default
  for name, p in inspect.signature(flash_attention).parameters.items()
  if p.kind is p.KEYWORD_ONLY
}
_ARRAY_ARGS = ("sinks", "segment_ids", "block_mask", "bias")


def explain(q: Any, k: Any, v: Any, **kwargs: Any) -> str:
  """What `flash_attention(q, k, v, **kwargs)` would run, forward and
  backward, and why, without running it: the backend (and for the
  automatic choice the faster ones skipped, with their reasons), the
  kernels and their tiles, how the gradients run (the fused kernel, the
  dK/dV and dQ pair, or the blockwise twin, and why), how each flex
  function compiles and which captured arrays become operands, and with
  sharded inputs how the call splits over the devices.

  Args:
    q, k, v: arrays or `jax.ShapeDtypeStruct`s (a `sharding=` on them, a
      `NamedSharding` over a real or `jax.sharding.AbstractMesh`, says
      how they are sharded).
    **kwargs: exactly `flash_attention`'s keywords; `sinks`,
      `segment_ids`, `bias` and `block_mask` may hold ShapeDtypeStructs.

  Returns:
    The plan in lines of text (docs/api.md#explain-a-call).

  Raises:
    What `flash_attention` would raise for these arguments (TypeError /
    ValueError naming the argument, NotImplementedError with the reason).
  """
  unknown = sorted(set(kwargs) - set(_KEYWORDS))
  if unknown:
    raise TypeError(
      f"explain takes flash_attention's arguments; got unknown {unknown}"
    )
  options = {n: kwargs.get(n, default) for n, default in _KEYWORDS.items()}
  check_bool("return_lse", options.pop("return_lse"))
  arrays = {n: options.pop(n) for n in _ARRAY_ARGS}
  shardings, sizes = {}, {}
  for name, x in (("q", q), ("k", k), ("v", v)):
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
      shardings[name] = sharding_checks.spec_entries(sharding)
      sizes.update(dict(sharding.mesh.shape))
  abstract = lambda x: (
    jax.ShapeDtypeStruct(jnp.shape(x), x.dtype) if hasattr(x, "dtype") else x
  )
  held = {}

  def trace(q, k, v, arrays):
    held["call"], held["plan"], _ = _prepare(q, k, v, **options, **arrays)
    return jnp.zeros(())

  jax.eval_shape(
    trace, *(abstract(x) for x in (q, k, v)), jax.tree.map(abstract, arrays)
  )
  lines = held["plan"].explain().splitlines()
  if shardings:
    lines += partitioning.describe(held["call"], sizes, shardings)
  return "\n".join(lines)


def _prepare(
  q: Any,
  k: Any,
  v: Any,
  *,
  implementation: Any,
  config: Any,
  fp8: Any,
  stable_max: Any,
  batch_invariant: Any = False,
  **options: Any,
) -> tuple[StaticCall, backends.Plan, tuple]:
  """flash_attention's arguments checked once (`prepare.prepare`, with
  `options` its other keywords) into its call: the static call (spec,
  backend, config, the backward's plan), the plan, and the operands
  `_attention` takes. Raises naming the argument."""
  if check_bool("batch_invariant", batch_invariant):
    check_bool("deterministic", options.get("deterministic", False))
    options["deterministic"] = True
  spec, sinks, segment_ids, flex_ops = prepare.prepare(
    q,
    k,
    v,
    fp8=check_fp8(fp8),
    stable_max=check_stable_max(stable_max),
    **options,
  )
  plan = backends.plan(spec, implementation, config)
  sm90 = plan.backend.name in ("mosaic", "interpret")
  if batch_invariant and spec.segmented and sm90:
    raise NotImplementedError(
      f"batch_invariant with segment_ids on implementation="
      f"{plan.backend.name!r}: the sm90 forward decides between its kernel"
      " and the blockwise twin for the whole batch at once; pass"
      " implementation='blockwise'"
    )
  # A sequence split runs the ring (context parallelism); see
  # pallas_fa3.parallel.context.
  call = StaticCall(
    spec, plan.backend, plan.config, backward_plan=plan.backward
  )
  operands = (
    jnp.asarray(q),
    jnp.asarray(k),
    jnp.asarray(v),
    sinks,
    segment_ids,
    flex_ops,
  )
  return call, plan, operands


def _check_device_for_eager_call(backend: Backend, *arrays: Any) -> None:
  """An eager call of a backend the devices cannot run raises, saying why.

  Traced calls (under `jit`, `export`, ...) pass: lowering for another
  platform, e.g. `jax.export(..., platforms=['cuda'])` of `mosaic` on a
  machine without a GPU, is legitimate (run under `jit` on a CPU, Pallas
  itself refuses: "Only interpret mode is supported on CPU backend").
  """
  if not any(isinstance(a, jax.core.Tracer) for a in arrays):
    backends.require_runnable_here(backend)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _decode(
  call: StaticCall, return_lse: bool, q, k_cache, v_cache, k, v, seqlens,
  pages, batch_idx, sinks, descale, signs, flex_ops=None, starts=None,
  cos_sin=None,
):  # fmt: skip
  spec = call.spec
  rows = kvcache.cache_rows(spec, batch_idx)
  if spec.rotary_dim:  # at each sequence's slots (FA3's positions)
    rope = lambda x, pos: rotary.apply_rotary(
      x, *cos_sin, pos, interleaved=spec.rotary_interleaved
    )
    per_token = spec.causal or spec.window_size is not None
    q = rope(
      q, rotary.decode_positions(seqlens, spec.seq_q, per_token=per_token)
    )
    k = rope(k, rotary.decode_positions(seqlens, spec.seq_new, per_token=True))
  if signs is not None:  # the cache holds K M: the scores need q M
    q = kvcache.rotate(q, signs).astype(q.dtype)
  if k is not None:  # one scatter each: in place when the caches are donated
    if spec.fp8_cache:
      k = kvcache.quantize_tokens(kvcache.rotate(k, signs), descale[0])
      if v is not None:
        v = kvcache.quantize_tokens(v, descale[1])
    k_cache = kvcache.append(spec, k_cache, k, seqlens, rows, pages)
    if not spec.v_in_k:  # (else V is k_cache's columns: written with K)
      v_cache = kvcache.append(spec, v_cache, v, seqlens, rows, pages)
  lengths = seqlens + spec.seq_new
  if sinks is not None:
    sinks = modifiers.batch_sinks(sinks, spec.batch)
  out_cols = None
  if descale is not None:
    q, descale, out_cols = _folded_column_descales(spec, q, descale)
  operands = Decode(
    q, k_cache, v_cache, lengths, rows, pages, sinks, descale, flex_ops, starts
  )
  out, lse = vjp.call(call, sharding_checks.vary_alike(operands))
  if out_cols is not None:
    out = (out.astype(jnp.float32) * out_cols).astype(out.dtype)
  # A traced length past the cache (or negative), or a traced page or row
  # index that is not the cache's, cannot raise: its sequence's rows are
  # NaN, never a silently wrong result.
  bad = (seqlens < 0) | (lengths > spec.capacity)
  if starts is not None:
    bad |= (starts < 0) | (starts > seqlens)
  bad |= kvcache.invalid_sequences(spec, lengths, rows, pages)
  out = jnp.where(bad[:, None, None, None], jnp.nan, out)
  lse = jnp.where(bad[:, None, None], jnp.nan, lse)
  result = (out, lse) if return_lse else (out,)
  if k is not None:
    result += (k_cache,) if spec.v_in_k else (k_cache, v_cache)
  return result[0] if len(result) == 1 else result


def _descales(spec: DecodeSpec, k_descale: Any, v_descale: Any) -> Any:
  """(k_descale, v_descale) as float32 `[b, hk]` for an e4m3 cache (with
  v_cache=None, k_descale twice), None for a 16-bit one."""
  if spec.v_in_k and v_descale is not None:
    raise ValueError(
      "v_descale must be None when v_cache is None: V is the K cache's"
      " first head_dim_v columns and is dequantized by k_descale"
    )
  names = ("k_descale", "v_descale")
  pair = (k_descale, k_descale if spec.v_in_k else v_descale)
  dims = (spec.head_dim, spec.head_dim if spec.v_in_k else spec.head_dim_v)
  descale = tuple(
    kvcache.check_descale(name, x, spec.fp8_cache, spec.batch, spec.heads_kv, d)
    for name, x, d in zip(names, pair, dims)
  )
  return descale if spec.fp8_cache else None


def _folded_column_descales(
  spec: DecodeSpec, q: jax.Array, descale: tuple
) -> tuple[jax.Array, tuple, jax.Array | None]:
  """Grouped (per 128-column) descales folded out of the backends: K's
  into q's columns (`q (k8 s)^T = (q s) k8^T`), V's returned per column
  for the output (`P (v8 s) = (P v8) s`), ones left in their place; per
  (sequence, KV head) descales pass through. Returns (q, descale, V's
  column descales `[b, 1, hq, dv]` or None)."""
  k_d, v_d = descale
  per_head = lambda cols: jnp.repeat(cols, spec.group_size, axis=1)[:, None]
  ones = jnp.ones((spec.batch, spec.heads_kv), jnp.float32)
  out_cols = None
  if k_d.ndim == 3:
    k_cols = kvcache.column_descales(k_d, spec.head_dim)
    q = (q.astype(jnp.float32) * per_head(k_cols)).astype(q.dtype)
    if spec.v_in_k:  # V: the first head_dim_v columns, k_descale's
      out_cols, v_d = per_head(k_cols[..., : spec.head_dim_v]), ones
    k_d = ones
  if v_d.ndim == 3:
    out_cols = per_head(kvcache.column_descales(v_d, spec.head_dim_v))
    v_d = ones
  return q, (k_d, v_d), out_cols


def flash_attention_with_kvcache(
  q: jax.Array,
  k_cache: jax.Array,
  v_cache: jax.Array | None,
  k: jax.Array | None = None,
  v: jax.Array | None = None,
  *,
  cache_seqlens: Any,
  page_table: jax.Array | None = None,
  cache_batch_idx: jax.Array | None = None,
  causal: bool = False,
  softmax_scale: float | None = None,
  window_size: tuple[int | None, int | None] | None = None,
  softcap: float | None = None,
  sinks: jax.Array | None = None,
  num_splits: int | None = None,
  return_lse: bool = False,
  implementation: Implementation | None = None,
  config: Any = None,
  k_descale: Any = None,
  v_descale: Any = None,
  cache_rotation: Any = None,
  head_dim_v: int | None = None,
  score_mod: Any = None,
  mask_mod: Any = None,
  block_mask: flex.BlockMask | None = None,
  rotary_cos: jax.Array | None = None,
  rotary_sin: jax.Array | None = None,
  rotary_interleaved: bool = True,
  cache_leftpad: jax.Array | None = None,
  batch_invariant: bool = False,
  cu_seqlens_q: jax.Array | None = None,
  max_seqlen_q: int | None = None,
  cu_seqlens_k_new: jax.Array | None = None,
) -> Any:
  """Attention of new queries over each sequence's cached keys (decoding).

  Sequence b has `L_b = cache_seqlens[b] + seq_new` keys; its query i sits
  at position `L_b - seq_q + i` and sees the keys `causal`, `window_size`,
  `softcap` and `sinks` allow, exactly as `flash_attention` with
  `seq_kv = L_b` (bottom-right alignment). A row that sees no key gives 0
  and lse -inf (the sink with sinks). The cache past each sequence's length
  is garbage (any value, NaN included): none of it reaches the output.

  Args:
    q: `[batch, seq_q, heads_q, head_dim]` (seq_q 1 for plain decoding;
      more for speculative decoding or a prefill chunk).
    k_cache: contiguous `[batch_cache, cache_len, heads_kv, head_dim]`, or
      paged `[num_pages, page_size, heads_kv, head_dim]` with `page_table`.
    v_cache: the same with `head_dim_v`; or None (DeepSeek MLA's layout,
      FlashMLA's): V is the first `head_dim_v` columns of k_cache, read in
      place (no copy), and `head_dim_v` is required.
    k, v: optional new tokens `[batch, seq_new, heads_kv, head_dim(_v)]`,
      written at positions `cache_seqlens[b] ..` of each sequence and
      attended to; the updated caches are returned. With `v_cache=None`
      pass k only (v None): its first `head_dim_v` columns are the values.
    cache_seqlens: a Python int or int32 `[batch]`: tokens already cached
      (traced: one compilation serves every length).
    page_table: int32 `[batch, pages_per_seq]`: token t of sequence b is
      slot `t % page_size` of page `page_table[b, t // page_size]`.
    cache_batch_idx: int32 `[batch]` (contiguous only): each sequence's
      cache row (default: b).
    causal, softmax_scale, window_size, softcap, sinks: as in
      `pallas_fa3.flash_attention`.
    num_splits: split-KV ranges per sequence (flash-decoding; None: the
      backend chooses). Every value computes the same function.
    return_lse: also return the natural-log lse `[batch, heads_q, seq_q]`.
    implementation: None (automatic: `mosaic` on a Hopper GPU when it
      serves the call, else `blockwise`), "mosaic", "interpret",
      "blockwise" or "reference".
    config: `pallas_fa3.Sm90DecodeConfig` (mosaic, interpret) or
      `pallas_fa3.BlockwiseConfig` (blockwise: its `block_kv`).
    k_descale, v_descale: an e4m3 cache's (`float8_e4m3fn`) float32
      descales `[batch, heads_kv]` (or scalars; default 1): attention runs
      over `k_cache * k_descale`, `v_cache * v_descale`, and appended k/v
      are divided by them, saturated at 448 and rounded into the cache
      (FA3's convention; `pallas_fa3.quantize_kv_cache` makes them). Or
      one per 128-column group, `[batch, heads_kv, ceil(head_dim(_v) /
      128)]` (`quantize_kv_cache(column_groups=True)`): K's are folded
      into q's columns and V's applied to the output's, in float32 before
      each is rounded to q's dtype. With `v_cache=None`, V is
      dequantized by `k_descale` (v_descale None).
    cache_rotation: None, or the `rotation=` the cache was quantized with
      (`quantize_kv_cache`): q and appended k are rotated to match (not
      with `v_cache=None`: V would be rotated too).
    head_dim_v: with `v_cache=None`, V's columns (<= head_dim; 512 for
      DeepSeek MLA's 576); with a v_cache, None or its last dim.
    score_mod, mask_mod: as in `flash_attention`, with sequence positions:
      query i of sequence b is `q_idx = L_b - seq_q + i`, key t is
      `kv_idx = t` (docs/flex.md#decoding).
    block_mask: a `BlockMask` over sequence positions, built for
      `seq_q = seq_kv =` the cache capacity (`cache_len`, or
      `pages_per_seq * page_size`); query rows read it at their positions.
    rotary_cos, rotary_sin: optional `[seqlen_ro, rotary_dim / 2]` tables
      (FA3's): the appended k (required with them) is rotated at positions
      `cache_seqlens[b] + i` before it is written, and q at the same
      positions when `causal` or a `window_size` is set, else all at
      `cache_seqlens[b]`. The first `rotary_dim` features rotate, in
      float32; `seqlen_ro` must cover the cache's capacity.
    rotary_interleaved: True (FA3's default, GPT-J): pairs `(2i, 2i+1)`;
      False (GPT-NeoX): pairs `(i, i + rotary_dim / 2)`.
    cache_leftpad: optional int32 `[batch]`: sequence b's cached tokens
      are the slots `[cache_leftpad[b], cache_seqlens[b])` (left padding;
      `cache_seqlens` counts the padding, and new tokens go at
      `cache_seqlens[b]`, as in FA3). Positions (masks, score_mod,
      rotary) stay slot indices; the slots before it are never read into
      the output (garbage, NaN included, is fine there).
    batch_invariant: True: each sequence's output (and lse) is bitwise
      the same whatever else is in the batch, its place in it and the
      batch size: split-KV ranges are fixed runs of
      `kvcache.INVARIANT_SPLIT_KEYS` keys from key 0 (or the capacity cut
      into `num_splits`), never a count chosen from the batch or the SM
      count, and merged in a fixed order. Costs a small batch of short
      sequences its split parallelism (docs/decoding.md#batch-invariant-decoding).
    cu_seqlens_q: int32 `[n + 1]` (FA3's): a ragged batch (continuous
      batching). q is packed `[total_q, heads_q, head_dim]` and sequence i
      has the `cu_seqlens_q[i+1] - cu_seqlens_q[i]` new queries (0
      allowed) at positions `L_i - n_i ..` (bottom-right per sequence);
      k/v (optional) are packed `[total_k_new, heads_kv, d(v)]` the same
      way by `cu_seqlens_k_new`; cache_seqlens, page_table,
      cache_batch_idx, cache_leftpad, sinks' batch as above with batch n.
      How it runs: the uniform call of the chosen backend on the queries
      left-padded to `[n, max_seqlen_q, heads_q, head_dim]` (padded rows
      are computed and dropped: `n * max_seqlen_q - total_q` extra query
      rows), after one scatter of the new keys into the cache. Not (yet)
      one launch of the decode kernel scheduled by work. Rotary: k at
      `cache_seqlens[i] + j`, q the same (all at `cache_seqlens[i]`
      without causal or a window). An e4m3 cache: new tokens divided by
      their sequence's descales (not with `v_cache=None`:
      NotImplementedError).
      Returns out `[total_q, heads_q, head_dim_v]`, lse `[heads_q,
      total_q]` (FA3's varlen layout); tokens past `cu_seqlens_q[-1]`
      get 0 (lse -inf); an invalid traced `cu_seqlens_*` gives NaN.
    max_seqlen_q: with cu_seqlens_q, a static Python int >= every
      sequence's new queries (default: total_q): the padded width.
    cu_seqlens_k_new: int32 `[n + 1]`: the packing of k/v (default:
      cu_seqlens_q); sequence i's new keys are written at
      `cache_seqlens[i] ..` and `L_i = cache_seqlens[i] + its new keys`.

  Returns:
    out `[batch, seq_q, heads_q, head_dim_v]` in q's dtype; `(out, lse)`
    with `return_lse`; with k/v, the updated caches after them: `(out,
    k_cache, v_cache)` or `(out, lse, k_cache, v_cache)`; with
    `v_cache=None` the one cache: `(out[, lse], k_cache)`. Under `jax.jit`
    with the caches donated, they are updated in place. A sequence whose
    traced length is negative or overflows the cache, or whose traced
    `page_table` entries (for its tokens) or `cache_batch_idx` entry name
    no page or row of the cache, gets NaN rows (and its new tokens are not
    written).

  Raises:
    TypeError / ValueError naming the argument (a concrete `page_table`
    or `cache_batch_idx` entry out of range: naming the entry and the
    bound); NotImplementedError for a
    valid call the requested backend does not serve, and for `jax.grad`
    (forward only).
  """
  ragged = (cu_seqlens_q, max_seqlen_q, cu_seqlens_k_new)
  if any(x is not None for x in ragged):  # the uniform call, left-padded
    arguments = dict(locals())
    del arguments["ragged"]
    return kvcache_ragged.attend(flash_attention_with_kvcache, **arguments)
  spec = make_decode_spec(
    q,
    k_cache,
    v_cache,
    k,
    v,
    cache_seqlens=cache_seqlens,
    page_table=page_table,
    cache_batch_idx=cache_batch_idx,
    causal=causal,
    softmax_scale=softmax_scale,
    window_size=window_size,
    softcap=softcap,
    sinks=sinks is not None,
    num_splits=num_splits,
    head_dim_v=head_dim_v,
    cache_leftpad=cache_leftpad,
    rotary_cos=rotary_cos,
    rotary_sin=rotary_sin,
    rotary_interleaved=rotary_interleaved,
    batch_invariant=batch_invariant,
  )
  sinks = modifiers.check_sinks(sinks, spec.heads_q)
  flex_spec, flex_ops = flex.prepare(
    score_mod=score_mod,
    mask_mod=mask_mod,
    block_mask=block_mask,
    bias=None,
    batch=spec.batch,
    heads=spec.heads_q,
    seq_q=spec.capacity,
    seq_kv=spec.capacity,
  )
  if flex_spec is not None:
    spec = dataclasses.replace(spec, flex=flex_spec)
  descale = _descales(spec, k_descale, v_descale)
  if cache_rotation is not None and not spec.fp8_cache:
    raise ValueError(
      "cache_rotation applies to an e4m3 cache (quantize_kv_cache's"
      f" rotation=); this cache is {spec.cache_dtype}: pass None"
    )
  if cache_rotation is not None and spec.v_in_k:
    raise ValueError(
      "cache_rotation cannot be combined with v_cache=None: V is the K"
      " cache's columns, and a rotated K cache holds rotated values"
    )
  signs = kvcache.rotation_signs(cache_rotation, spec.head_dim)
  return_lse = check_bool("return_lse", return_lse)
  backend, config = backends.resolve(spec, implementation, config)
  splits = backend.decode_splits(spec, config)
  _check_device_for_eager_call(
    backend, q, k_cache, v_cache, k, v, cache_seqlens, page_table
  )
  seqlens = jnp.broadcast_to(
    jnp.asarray(cache_seqlens, jnp.int32), (spec.batch,)
  )
  return _decode(
    StaticCall(spec, backend, config, op="decode", splits=splits),
    return_lse,
    jnp.asarray(q),
    k_cache,
    v_cache,
    k,
    v,
    seqlens,
    page_table,
    cache_batch_idx,
    sinks,
    descale,
    signs,
    flex_ops,
    None if cache_leftpad is None else jnp.asarray(cache_leftpad, jnp.int32),
    (rotary_cos, rotary_sin) if spec.rotary_dim else None,
  )
