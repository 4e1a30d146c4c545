"""`FlashMultiHeadAttention`: a Flax NNX attention layer backed by
flash_attention, with the parameters of `flax.nnx.MultiHeadAttention`
(created in Flax's order, so a Flax checkpoint loads as it is and the same
seed initializes both alike) plus `num_kv_heads` (GQA) and `sinks=True`,
and with `decode=True` a KV cache (`init_cache`): docs/flax.md#native-layers.

Example:
  >>> import jax
  >>> from flax import nnx
  >>> from pallas_fa3.flax import FlashMultiHeadAttention
  >>> layer = FlashMultiHeadAttention(4, 32, num_kv_heads=2, causal=True,
  ...                                 rope=True, rngs=nnx.Rngs(0))
  >>> x = jax.random.normal(jax.random.key(1), (2, 16, 32))
  >>> layer(x).shape
  (2, 16, 32)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.linear import default_kernel_init
from flax.typing import Dtype, Initializer

from pallas_fa3 import modifiers
from pallas_fa3.backends import check_implementation
from pallas_fa3.flax import attend, decode as decode_lib
from pallas_fa3.flax.rope import (
  DEFAULT_ROPE_BASE,
  check_rope_base,
  check_rope_head_dim,
)
from pallas_fa3.spec import check_bool


class FlashMultiHeadAttention(nnx.Module):
  """Multi-head (MHA/GQA/MQA) attention whose attention step is flash_attention.

  Projects the inputs to q `[batch..., seq, num_heads, head_dim]` and k/v
  `[batch..., seq, num_kv_heads, head_dim]`, optionally applies RoPE to q and k
  (`pallas_fa3.flax.rope`, float32), runs `pallas_fa3.flash_attention` with
  the softmax scale `1/sqrt(head_dim)` (Flax's), and projects back. K/V are
  never repeated for GQA. No attention dropout, dense mask or bias: use
  `make_attention_fn` with `flax.nnx.MultiHeadAttention` for those. Sliding
  windows, a logit softcap and learnable attention sinks are options;
  packed sequences and padding are `segment_ids` at call time.

  Args:
    num_heads: number of query heads.
    in_features: features of the inputs (query, and key/value inputs).
    qkv_features: total q/k/v features (default `in_features`), split evenly
      over the heads: `head_dim = qkv_features // num_heads`.
    out_features: features of the output (default `in_features`).
    num_kv_heads: key/value heads (default `num_heads`); must divide
      `num_heads` (GQA; 1 is MQA).
    causal: causal self-attention. With `seq_q != seq_kv` the mask is
      bottom-right aligned (pallas_fa3's convention, FlashAttention-2/3).
    rope: apply rotary position embeddings to q and k.
    rope_base: RoPE frequency base.
    window_size: None, or `(left, right)` (ints >= 0, or None for an
      unbounded side): query i, at key position `p = i + seq_kv - seq_q`,
      sees key j iff `p - left <= j <= p + right` (bottom-right aligned like
      `causal`, and intersected with it: `(w, None)` with `causal=True` is a
      causal sliding window of w keys back).
    softcap: None (off) or c > 0: the scaled scores s become
      `c * tanh(s / c)` (0.0 is also off).
    sinks: add a learnable sink logit per query head to every row's softmax
      denominator: a parameter `sinks`, float32 `[num_heads]`, zeros at
      initialization (see `pallas_fa3.modifiers`).
    decode: decode with a KV cache (Flax's convention: `init_cache` first;
      a call's `decode=` overrides it); see `pallas_fa3.flax.decode`.
    decode_config: tiling of `flash_attention_with_kvcache` in decode steps
      (`pallas_fa3.Sm90DecodeConfig` or `BlockwiseConfig`; None: the
      backend's default).
    dtype: computation dtype (default: inferred from inputs and params, as
      in Flax); the attention runs in the projections' dtype.
    param_dtype: dtype of the parameters.
    use_bias: whether the projections have biases.
    implementation: `flash_attention` backend (None: automatic).
    config: backend tiling config, e.g. `pallas_fa3.BlockwiseConfig`.
    kernel_init: initializer of the projection kernels.
    out_kernel_init: initializer of the output kernel (default `kernel_init`).
    bias_init: initializer of the biases.
    rngs: `nnx.Rngs` for the parameter initializers.
  """

  def __init__(
    self,
    num_heads: int,
    in_features: int,
    qkv_features: int | None = None,
    out_features: int | None = None,
    *,
    num_kv_heads: int | None = None,
    causal: bool = False,
    rope: bool = False,
    rope_base: float = DEFAULT_ROPE_BASE,
    window_size: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    sinks: bool = False,
    decode: bool = False,
    decode_config: Any = None,
    dtype: Dtype | None = None,
    param_dtype: Dtype = jnp.float32,
    use_bias: bool = True,
    implementation: str | None = None,
    config: Any = None,
    kernel_init: Initializer = default_kernel_init,
    out_kernel_init: Initializer | None = None,
    bias_init: Initializer = nnx.initializers.zeros_init(),
    rngs: nnx.Rngs,
  ) -> None:
    qkv_features = in_features if qkv_features is None else qkv_features
    out_features = in_features if out_features is None else out_features
    self.num_heads, self.num_kv_heads, self.head_dim = attend.head_layout(
      num_heads, num_kv_heads, qkv_features
    )
    self.in_features = in_features
    self.qkv_features = qkv_features
    self.out_features = out_features
    self.causal = check_bool("causal", causal)
    self.rope = check_bool("rope", rope)
    self.rope_base = check_rope_base(rope_base)
    if self.rope:
      check_rope_head_dim(self.head_dim)
    self.window_size = attend.check_window(window_size)
    self.softcap = modifiers.check_softcap(softcap)
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.use_bias = use_bias
    self.implementation = check_implementation(implementation)
    self.config = config
    self.decode = check_bool("decode", decode)
    self.decode_config = decode_config

    def projection(
      in_feats: Any, out_feats: Any, **kwargs: Any
    ) -> nnx.LinearGeneral:
      return nnx.LinearGeneral(
        in_feats,
        out_feats,
        dtype=dtype,
        param_dtype=param_dtype,
        bias_init=bias_init,
        use_bias=use_bias,
        rngs=rngs,
        **kwargs,
      )

    # Same order as flax.nnx.MultiHeadAttention, so one seed gives one init.
    self.query = projection(
      in_features, (self.num_heads, self.head_dim), kernel_init=kernel_init
    )
    self.key = projection(
      in_features, (self.num_kv_heads, self.head_dim), kernel_init=kernel_init
    )
    self.value = projection(
      in_features, (self.num_kv_heads, self.head_dim), kernel_init=kernel_init
    )
    self.out = projection(
      (self.num_heads, self.head_dim),
      out_features,
      axis=(-2, -1),
      kernel_init=out_kernel_init or kernel_init,
    )
    # After Flax's parameters (zeros: draws no random numbers). Float32
    # whatever `param_dtype`: the softmax statistics it joins are float32.
    self.sinks = (
      nnx.Param(jnp.zeros((self.num_heads,), jnp.float32))
      if check_bool("sinks", sinks)
      else None
    )
    # The KV cache (`init_cache`): per kv head, and each sequence's length.
    self.cached_key: nnx.Cache | None = nnx.data(None)
    self.cached_value: nnx.Cache | None = nnx.data(None)
    self.cache_lengths: nnx.Cache | None = nnx.data(None)

  def init_cache(self, input_shape: Any, dtype: Any = jnp.float32) -> None:
    """Creates an empty KV cache for decoding (Flax's `init_cache`).

    Args:
      input_shape: `[batch..., max_length, features]`: the batch and the
        most tokens any sequence will hold.
      dtype: the cache's dtype, which must be the dtype the layer computes
        in (its `dtype`, else the inputs' and parameters').
    """
    state = decode_lib.empty_state(
      input_shape, self.num_kv_heads, self.head_dim, dtype
    )
    self.cached_key = nnx.Cache(state.key)
    self.cached_value = nnx.Cache(state.value)
    self.cache_lengths = nnx.Cache(state.lengths)

  def __call__(
    self,
    inputs_q: jax.Array,
    inputs_k: jax.Array | None = None,
    inputs_v: jax.Array | None = None,
    *,
    positions: jax.Array | None = None,
    segment_ids: Any = None,
    decode: bool | None = None,
    prefill: bool = False,
    chunk_lengths: jax.Array | None = None,
    cu_seqlens: jax.Array | None = None,
    max_seqlen_q: int | None = None,
  ) -> jax.Array:
    """Attends `inputs_q` over `inputs_k`/`inputs_v` (self-attention if None).

    Args:
      inputs_q: `[batch..., seq_q, in_features]`.
      inputs_k: `[batch..., seq_kv, in_features]`; default `inputs_q`.
      inputs_v: `[batch..., seq_kv, in_features]`; default `inputs_k`.
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

      decode: override the layer's `decode`. In decode mode the call is
        causal self-attention of a chunk `[batch..., chunk, features]` over
        the cache (`init_cache` first), which it updates; positions come
        from each sequence's cached length (no `inputs_k`, `inputs_v`,
        `positions` or `segment_ids`).
      prefill: decode mode: start every sequence afresh with this chunk
        (attended by `flash_attention`); else the chunk is appended to each
        sequence (attended by `flash_attention_with_kvcache`).
      chunk_lengths: decode mode: int32 `[batch...]`, the tokens of the
        chunk each sequence keeps (right-padded ragged chunks; default:
        all).
      cu_seqlens: decode mode: int32 `[batch + 1]` (a cache with one batch
        axis): `inputs_q` is packed `[total, features]`, sequence i's new
        tokens the rows `cu_seqlens[i]:cu_seqlens[i+1]` (0 allowed),
        appended at its length: a continuous batch (a prompt's prefill
        beside other sequences' decode tokens) in one ragged
        `flash_attention_with_kvcache` call.
      max_seqlen_q: with `cu_seqlens`: a static bound on any sequence's new
        tokens (the ragged call's; default the whole packed length).

    Returns:
      `[batch..., seq_q, out_features]`.

    Raises:
      ValueError: in decode mode, a cache that is missing or does not fit,
        or a chunk that overflows it (lengths known outside `jit`).
    """
    decode = self.decode if decode is None else check_bool("decode", decode)
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
    for name, x in (
      ("inputs_q", inputs_q),
      ("inputs_k", inputs_k),
      ("inputs_v", inputs_v),
    ):
      if x.shape[-1] != self.in_features:
        raise ValueError(
          f"{name} has {x.shape[-1]} features (last axis of shape"
          f" {tuple(x.shape)}); the layer expects in_features="
          f"{self.in_features}"
        )
    sinks = None if self.sinks is None else self.sinks[...]
    if decode:
      packed = None if cu_seqlens is None else (cu_seqlens, max_seqlen_q)
      return self.out(
        self._decode(inputs_q, prefill, chunk_lengths, sinks, packed)
      )
    x = attend.attend(
      self.query(inputs_q),
      self.key(inputs_k),
      self.value(inputs_v),
      causal=self.causal,
      rope=self.rope,
      rope_base=self.rope_base,
      positions=positions,
      implementation=self.implementation,
      config=self.config,
      window_size=self.window_size,
      softcap=self.softcap,
      sinks=sinks,
      segment_ids=segment_ids,
    )
    return self.out(x)

  def _decode(
    self,
    inputs: jax.Array,
    prefill: bool,
    chunk_lengths: Any,
    sinks: jax.Array | None,
    packed: tuple | None = None,
  ) -> jax.Array:
    """A decode call's attention output, updating the cache (`packed`:
    `(cu_seqlens, max_seqlen_q)` of a continuous batch)."""
    if self.cached_key is None:
      raise ValueError(
        "decode mode needs a KV cache: call init_cache(input_shape, dtype)"
        " first"
      )
    state = decode_lib.DecodeState(
      self.cached_key[...], self.cached_value[...], self.cache_lengths[...]
    )
    common = dict(
      causal=self.causal,
      rope=self.rope,
      rope_base=self.rope_base,
      implementation=self.implementation,
      decode_config=self.decode_config,
      window_size=self.window_size,
      softcap=self.softcap,
      sinks=sinks,
    )
    qkv = (self.query(inputs), self.key(inputs), self.value(inputs))
    if packed is not None:
      x, state = decode_lib.packed_attend(
        *qkv, state, cu_seqlens=packed[0], max_seqlen_q=packed[1], **common
      )
    else:
      x, state = decode_lib.decode_attend(
        *qkv,
        state,
        prefill=prefill,
        chunk_lengths=chunk_lengths,
        config=self.config,
        **common,
      )
    self.cached_key[...] = state.key
    self.cached_value[...] = state.value
    self.cache_lengths[...] = state.lengths
    return x
