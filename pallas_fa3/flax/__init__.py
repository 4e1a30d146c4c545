"""Flax integration: flash attention inside Flax's own attention layers
(`make_attention_fn`, the `attention_fn` of `flax.nnx.MultiHeadAttention` and
`flax.linen.MultiHeadDotProductAttention`, warning
`FlashAttentionFallbackWarning` once when an unsupported call falls back to
Flax's attention), and native layers with Flax's parameters plus GQA, RoPE,
windows, softcap, sinks, segment ids and decoding with a KV cache:
`FlashMultiHeadAttention` (nnx), `FlashMultiHeadDotProductAttention` (linen)
and their `apply_rope` (half-split, float32): docs/flax.md.

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
