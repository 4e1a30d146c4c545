"""What `make_attention_fn` does with a call flash attention cannot compute:
raise, or run Flax's own `dot_product_attention` with a one-time warning.

Flax's functions are bound when this module is imported, so the fallback is
Flax's attention even where `flax.nnx.dot_product_attention` or
`flax.linen.dot_product_attention` has since been replaced (e.g. by a test
that runs Flax's own suite with our attention function as the default).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen, nnx

from pallas_fa3.flax.adapter_masks import top_left_causal_mask

# Flax's own attention functions, as imported (see the module docstring).
FLAX_NNX_ATTENTION = nnx.dot_product_attention
FLAX_LINEN_ATTENTION = linen.dot_product_attention


class FlashAttentionFallbackWarning(UserWarning):
  """A call ran Flax's dot_product_attention instead of flash attention."""


def refuse_or_warn(
  unsupported: tuple[str, str], on_unsupported: str, warned: set[str]
) -> None:
  """Raises for "raise"; else warns once per feature (recorded in `warned`)."""
  feature, description = unsupported
  if on_unsupported == "raise":
    raise NotImplementedError(
      f"pallas_fa3 flash attention does not support {description};"
      " make_attention_fn(on_unsupported='fallback') runs Flax's"
      " dot_product_attention for such calls instead"
    )
  if feature not in warned:
    warned.add(feature)
    warnings.warn(
      f"pallas_fa3 flash attention does not support {description}; running"
      " Flax's dot_product_attention instead (it materializes the attention"
      " scores). Warned once per attention_fn and feature.",
      FlashAttentionFallbackWarning,
      stacklevel=3,
    )


def refuse_modified_fallback(
  unsupported: tuple[str, str], modified: tuple[str, ...]
) -> None:
  """Raises: Flax's attention would drop the window / softcap."""
  raise NotImplementedError(
    f"pallas_fa3 flash attention does not support {unsupported[1]}, and"
    f" make_attention_fn({', '.join(modified)}) cannot fall back to Flax's"
    " dot_product_attention, which has no sliding window or softcap (it"
    " would compute another function)"
  )


def flax_attention(
  query,
  key,
  value,
  *,
  bias,
  mask,
  broadcast_dropout,
  dropout_rng,
  dropout_rate,
  deterministic,
  dtype,
  precision,
  module,
  is_causal,
  softmax_scale,
  linen_kwargs,
) -> jax.Array:
  """Flax's own dot_product_attention: linen's for linen callers, else nnx's."""
  if softmax_scale is not None:
    # Flax divides q by sqrt(head_dim); pre-scale so the product is the scale.
    query = query * jnp.asarray(
      softmax_scale * math.sqrt(query.shape[-1]), query.dtype
    )
  common: dict[str, Any] = dict(
    bias=bias,
    broadcast_dropout=broadcast_dropout,
    dropout_rng=dropout_rng,
    dropout_rate=dropout_rate,
    deterministic=deterministic,
    dtype=dtype,
    precision=precision,
    module=module,
  )
  if isinstance(module, linen.Module) or linen_kwargs:
    if is_causal:  # linen's function has no is_causal; fold it into the mask
      causal = jnp.asarray(top_left_causal_mask(query.shape[-3], key.shape[-3]))
      mask = causal if mask is None else jnp.logical_and(mask, causal)
    return FLAX_LINEN_ATTENTION(
      query, key, value, mask=mask, **common, **linen_kwargs
    )
  return FLAX_NNX_ATTENTION(
    query, key, value, mask=mask, is_causal=is_causal, **common
  )
