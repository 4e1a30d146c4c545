"""`FlashMultiHeadDotProductAttention`: a Flax Linen attention layer backed by
flash_attention, with the parameters of
`flax.linen.MultiHeadDotProductAttention` (a Linen params dict loads as it
is) plus `num_kv_heads` (GQA) and `sinks=True`, and with `decode=True` a KV
cache in the `cache` collection: docs/flax.md#native-layers.

Example:
  >>> import jax
  >>> from pallas_fa3.flax import FlashMultiHeadDotProductAttention
  >>> layer = FlashMultiHeadDotProductAttention(num_heads=4, causal=True)
  >>> x = jax.random.normal(jax.random.key(1), (2, 16, 32))
  >>> params = layer.init(jax.random.key(0), x)
  >>> layer.apply(params, x).shape
  (2, 16, 32)
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen.linear import default_kernel_init
from flax.typing import Dtype, Initializer, PrecisionLike

from pallas_fa3 import modifiers
from pallas_fa3.backends import check_implementation
from pallas_fa3.flax import attend, decode as decode_lib
from pallas_fa3.flax.rope import (
  DEFAULT_ROPE_BASE,
  check_rope_base,
  check_rope_head_dim,
)
from pallas_fa3.spec import check_bool


class FlashMultiHeadDotProductAttention(nn.Module):
  """Linen multi-head (MHA/GQA/MQA) attention whose attention step is flash_attention.

  Same fields (first ones in the same order) and parameters as
  `flax.linen.MultiHeadDotProductAttention`, minus dropout, masks and
  weight sowing (use `make_attention_fn` with Flax's module for those),
  plus `num_kv_heads`, `causal`, `rope`, `window_size`, `softcap`, `sinks`,
  `implementation`, `config` and `decode_config`, and `segment_ids` at
  call time (packed sequences and padding). The softmax scale is
  `1/sqrt(head_dim)`, Flax's.

  Attributes:
    num_heads: number of query heads.
    dtype: computation dtype (default: inferred from inputs and params).
    param_dtype: dtype of the parameters.
    qkv_features: total q/k/v features (default: the inputs' features).
    out_features: output features (default: the inputs' features).
    precision: matmul precision of the projections.
    kernel_init: initializer of the projection kernels.
    out_kernel_init: initializer of the output kernel (default `kernel_init`).
    bias_init: initializer of the biases.
    out_bias_init: initializer of the output bias (default `bias_init`).
    use_bias: whether the projections have biases.
    num_kv_heads: key/value heads (default `num_heads`); must divide it.
    causal: causal self-attention; bottom-right aligned when seq_q != seq_kv.
    rope: apply rotary position embeddings (float32) to q and k.
    rope_base: RoPE frequency base.
    window_size: None, or `(left, right)` (ints >= 0, or None for an
      unbounded side): query i, at key position `p = i + seq_kv - seq_q`,
      sees key j iff `p - left <= j <= p + right` (bottom-right aligned like
      `causal`, and intersected with it).
    softcap: None (off) or c > 0: the scaled scores s become
      `c * tanh(s / c)` (0.0 is also off).
    sinks: add a learnable sink logit per query head to every row's softmax
      denominator: the param `sinks`, float32 `[num_heads]`, zeros at init.
    implementation: `flash_attention` backend (None: automatic).
    config: backend tiling config, e.g. `pallas_fa3.BlockwiseConfig`.
    decode: decode with the KV cache of the `cache` collection (apply with
      `mutable=["cache"]`); see `pallas_fa3.flax.decode`. `init` creates the
      cache from its input `[batch..., max_length, features]` and computes
      the plain (non-decode) call.
    decode_config: tiling of `flash_attention_with_kvcache` in decode steps
      (`pallas_fa3.Sm90DecodeConfig` or `BlockwiseConfig`).
  """

  num_heads: int
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  qkv_features: int | None = None
  out_features: int | None = None
  precision: PrecisionLike = None
  kernel_init: Initializer = default_kernel_init
  out_kernel_init: Initializer | None = None
  bias_init: Initializer = nn.initializers.zeros_init()
  out_bias_init: Initializer | None = None
  use_bias: bool = True
  num_kv_heads: int | None = None
  causal: bool = False
  rope: bool = False
  rope_base: float = DEFAULT_ROPE_BASE
  window_size: tuple[int | None, int | None] | None = None
  softcap: float | None = None
  sinks: bool = False
  implementation: str | None = None
  config: Any = None
  decode: bool = False
  decode_config: Any = None

  @nn.compact
  def __call__(
    self,
    inputs_q: jax.Array,
    inputs_k: jax.Array | None = None,
    inputs_v: jax.Array | None = None,
    *,
    positions: jax.Array | None = None,
    segment_ids: Any = None,
    prefill: bool = False,
    chunk_lengths: jax.Array | None = None,
    cu_seqlens: jax.Array | None = None,
    max_seqlen_q: int | None = None,
  ) -> jax.Array:
    """Attends `inputs_q` over `inputs_k`/`inputs_v` (self-attention if None).

    Args:
      inputs_q: `[batch..., seq_q, features]`.
      inputs_k: `[batch..., seq_kv, features_kv]`; default `inputs_q`.
      inputs_v: `[batch..., seq_kv, features_kv]`; default `inputs_k`.
      positions: RoPE positions, integers `[seq]` or `[batch..., seq]`
        (default `arange(seq)`); only with `rope=True`. For packed
        sequences, `pallas_fa3.segment_positions(ids)` restarts them per
        document (RoPE scores depend only on position differences, so
        within a document this changes rounding, not the function).
      segment_ids: packed sequences: query i sees key j only if their ids
        are equal (intersected with `causal` / `window_size`). None; a
        `pallas_fa3.SegmentIds(q_ids, kv_ids)` or `(q_ids, kv_ids)` tuple of
        integer arrays `[batch..., seq_q]` / `[batch..., seq_kv]`; or, for
        self-attention, one array `[batch..., seq]` for both (padding with
        one id then attends to itself). A query whose id matches no key
        (e.g. -1 for padded queries, -2 for padded keys) attends to nothing:
        0 before the output projection.
      prefill: decode: start every sequence afresh with this chunk
        (`flash_attention`); else the chunk is appended to each sequence
        (`flash_attention_with_kvcache`).
      chunk_lengths: decode: int32 `[batch...]`, the tokens of the chunk
        each sequence keeps (right-padded ragged chunks; default: all).
      cu_seqlens: decode, with a cache of one batch axis: int32
        `[batch + 1]`; `inputs_q` is packed `[total, features]`, sequence
        i's new tokens the rows `cu_seqlens[i]:cu_seqlens[i+1]` (0 allowed),
        appended to cache row i and attended in one ragged
        `flash_attention_with_kvcache` call (a continuous batch: prefill
        chunks beside decode tokens). The cache comes from an earlier
        `init` with a `[batch, max_length, features]` input.
      max_seqlen_q: with `cu_seqlens`: a static bound on any sequence's new
        tokens (default: the total).

    Returns:
      `[batch..., seq_q, out_features]`.
    """
    decode = check_bool("decode", self.decode)
    prefill = decode_lib.check_call_options(
      decode,
      inputs_k=inputs_k,
      inputs_v=inputs_v,
      positions=positions,
      segment_ids=segment_ids,
      prefill=prefill,
      chunk_lengths=chunk_lengths,
      cu_seqlens=cu_seqlens,
    )
    inputs_q, inputs_k, inputs_v = attend.self_attention_inputs(
      inputs_q, inputs_k, inputs_v
    )
    features = self.out_features or inputs_q.shape[-1]
    qkv_features = self.qkv_features or inputs_q.shape[-1]
    num_heads, num_kv_heads, head_dim = attend.head_layout(
      self.num_heads, self.num_kv_heads, qkv_features
    )
    causal = check_bool("causal", self.causal)
    rope = check_bool("rope", self.rope)
    if rope:
      check_rope_head_dim(head_dim)
    window_size = attend.check_window(self.window_size)
    softcap = modifiers.check_softcap(self.softcap)
    sinks = (
      # Float32 whatever `param_dtype`: the softmax statistics are float32.
      self.param(
        "sinks", nn.initializers.zeros_init(), (num_heads,), jnp.float32
      )
      if check_bool("sinks", self.sinks)
      else None
    )
    dense = functools.partial(
      nn.DenseGeneral,
      axis=-1,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      kernel_init=self.kernel_init,
      bias_init=self.bias_init,
      use_bias=self.use_bias,
      precision=self.precision,
    )
    query = dense(features=(num_heads, head_dim), name="query")(inputs_q)
    key = dense(features=(num_kv_heads, head_dim), name="key")(inputs_k)
    value = dense(features=(num_kv_heads, head_dim), name="value")(inputs_v)
    options = dict(
      causal=causal,
      rope=rope,
      rope_base=check_rope_base(self.rope_base),
      implementation=check_implementation(self.implementation),
      config=self.config,
      window_size=window_size,
      softcap=softcap,
      sinks=sinks,
    )
    # Flax's convention: the first decode call (init) creates the cache
    # from its input's shape and computes the plain call.
    if decode and self.has_variable("cache", "cached_key"):
      packed = None if cu_seqlens is None else (cu_seqlens, max_seqlen_q)
      x = self._decode(
        query, key, value, prefill, chunk_lengths, options, packed
      )
    else:
      if cu_seqlens is not None:
        raise ValueError(
          "cu_seqlens appends to an existing cache: init the layer with"
          " decode=True on a [batch, max_length, features] input first"
        )
      if decode:
        self._init_cache(inputs_q.shape, num_kv_heads, head_dim, key.dtype)
      x = attend.attend(
        query,
        key,
        value,
        positions=positions,
        segment_ids=segment_ids,
        **options,
      )
    return nn.DenseGeneral(
      features=features,
      axis=(-2, -1),
      kernel_init=self.out_kernel_init or self.kernel_init,
      bias_init=self.out_bias_init or self.bias_init,
      use_bias=self.use_bias,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      precision=self.precision,
      name="out",
    )(x)

  def _init_cache(self, input_shape, heads_kv, head_dim, dtype) -> None:
    state = decode_lib.empty_state(input_shape, heads_kv, head_dim, dtype)
    for name, value in zip(
      ("cached_key", "cached_value", "cache_lengths"), state
    ):
      self.variable("cache", name, lambda v=value: v)

  def _decode(
    self, query, key, value, prefill, chunk_lengths, options, packed=None
  ):
    """A decode call's attention output, updating the `cache` collection
    (`packed`: `(cu_seqlens, max_seqlen_q)` of a continuous batch)."""
    names = ("cached_key", "cached_value", "cache_lengths")
    variables = [self.get_variable("cache", n) for n in names]
    state = decode_lib.DecodeState(*variables)
    if packed is not None:
      x, state = decode_lib.packed_attend(
        query,
        key,
        value,
        state,
        cu_seqlens=packed[0],
        max_seqlen_q=packed[1],
        decode_config=self.decode_config,
        **{n: v for n, v in options.items() if n != "config"},
      )
    else:
      x, state = decode_lib.decode_attend(
        query,
        key,
        value,
        state,
        prefill=prefill,
        chunk_lengths=chunk_lengths,
        decode_config=self.decode_config,
        **options,
      )
    for name, new in zip(names, state):
      self.put_variable("cache", name, new)
    return x
