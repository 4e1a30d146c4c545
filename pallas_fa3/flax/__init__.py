"""Flax integration: flash attention inside Flax's modules, and native layers.

Public API:
  make_attention_fn                  `attention_fn` for `flax.nnx.MultiHeadAttention`
                                     and `flax.linen.MultiHeadDotProductAttention`
  FlashAttentionFallbackWarning      warned (once) when an unsupported call
                                     falls back to Flax's attention
  FlashMultiHeadAttention            NNX layer, parameters of nnx.MultiHeadAttention
  FlashMultiHeadDotProductAttention  Linen layer, parameters of
                                     linen.MultiHeadDotProductAttention
  apply_rope                         rotary position embedding (half-split, float32)

The native layers take flash_attention's `window_size`, `softcap` and
`sinks=True` (a learnable float32 sink logit per head, zeros at init);
`make_attention_fn(window_size=..., softcap=...)` applies a window (aligned
top-left, like Flax's `is_causal`) and a softcap to every call of Flax's
layers. Packed sequences and padding: the native layers take
`segment_ids=` at call time; `make_attention_fn` turns padding and segment
masks into segment ids (`pallas_fa3.flax.adapter_masks`; traced padding
masks with `make_attention_fn(padding_mask=True)`). Decoding: Flax's layers
with `decode=True` run flash attention through `make_attention_fn`
(`pallas_fa3.flax.adapter_masks`); the native layers take `decode=True` too,
with a KV cache per kv head and per-sequence lengths
(`pallas_fa3.flax.decode`).

Example:
  >>> import jax
  >>> from flax import nnx
  >>> import pallas_fa3.flax as fa3_flax
  >>> x = jax.random.normal(jax.random.key(0), (2, 16, 32))
  >>> # 1. Flax's own layer, flash attention inside (same parameters).
  >>> flax_layer = nnx.MultiHeadAttention(
  ...     num_heads=4, in_features=32, decode=False, rngs=nnx.Rngs(0),
  ...     attention_fn=fa3_flax.make_attention_fn())
  >>> flax_layer(x, is_causal=True).shape
  (2, 16, 32)
  >>> # 2. The native layer: GQA and RoPE; loads nnx.MultiHeadAttention's state.
  >>> layer = fa3_flax.FlashMultiHeadAttention(
  ...     4, 32, num_kv_heads=2, causal=True, rope=True, rngs=nnx.Rngs(0))
  >>> local = fa3_flax.FlashMultiHeadAttention(
  ...     4, 32, causal=True, window_size=(8, None), softcap=50.0, sinks=True,
  ...     rngs=nnx.Rngs(0))
  >>> local.sinks[...].shape
  (4,)
  >>> y = nnx.jit(lambda m, x: m(x))(layer, x)
  >>> y.shape, y.dtype
  ((2, 16, 32), dtype('float32'))
"""

from pallas_fa3.flax.adapter import (
  FlashAttentionFallbackWarning as FlashAttentionFallbackWarning,
  make_attention_fn as make_attention_fn,
)
from pallas_fa3.flax.linen_modules import (
  FlashMultiHeadDotProductAttention as FlashMultiHeadDotProductAttention,
)
from pallas_fa3.flax.nnx_modules import (
  FlashMultiHeadAttention as FlashMultiHeadAttention,
)
from pallas_fa3.flax.rope import apply_rope as apply_rope

__all__ = [
  "FlashAttentionFallbackWarning",
  "FlashMultiHeadAttention",
  "FlashMultiHeadDotProductAttention",
  "apply_rope",
  "make_attention_fn",
]
