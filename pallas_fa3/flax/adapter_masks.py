"""The Flax adapter's call checks: which dense masks it recognises (none,
Flax's top-left causal mask, traced), the on-device check of a declared
causal mask, and the first feature flash attention cannot compute.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3.spec import MAX_HEAD_DIM, SUPPORTED_DTYPES


def top_left_causal_mask(seq_q: int, seq_kv: int) -> np.ndarray:
  """Flax's causal mask (`is_causal`, `make_causal_mask`): key j <= query i."""
  return np.tril(np.ones((seq_q, seq_kv), dtype=bool))


def mask_kind(mask: Any, weights_shape: tuple[int, ...]) -> str:
  """'none', 'causal', 'other' for a concrete mask; 'traced' for a tracer.

  Raises:
    ValueError: the mask does not broadcast to the attention weights' shape.
  """
  if mask is None:
    return "none"
  try:
    broadcast_ok = (
      np.broadcast_shapes(tuple(mask.shape), weights_shape) == weights_shape
    )
  except ValueError:
    broadcast_ok = False
  if not broadcast_ok:
    raise ValueError(
      f"mask of shape {tuple(mask.shape)} does not broadcast to the attention"
      f" weights [batch..., heads, seq_q, seq_kv] = {weights_shape}"
    )
  if isinstance(mask, jax.core.Tracer):
    return "traced"
  visible = np.asarray(mask).astype(bool)
  # Causal first: with seq_kv = 1 the causal mask is all True as well.
  if np.all(visible == top_left_causal_mask(*weights_shape[-2:])):
    return "causal"
  return "none" if visible.all() else "other"


def poison_unless_causal(
  out: jax.Array, mask: jax.Array, seq_q: int, seq_kv: int
) -> jax.Array:
  """NaN output unless the traced mask is the causal mask it was declared to be."""
  causal = jnp.asarray(top_left_causal_mask(seq_q, seq_kv))
  ok = jnp.all(mask.astype(bool) == causal)
  return jnp.where(ok, out, jnp.asarray(jnp.nan, out.dtype))


def unsupported_feature(
  query,
  bias,
  dropout_rate,
  deterministic,
  module,
  custom_einsums,
  kind: str,
  declared_causal: bool,
) -> tuple[str, str] | None:
  """(feature key, description) of the first unsupported feature, else None."""
  if bias is not None:
    return "bias", "an attention bias (bias=...)"
  if dropout_rate > 0.0 and not deterministic:
    return "dropout", (
      f"attention dropout (dropout_rate={dropout_rate} with"
      " deterministic=False)"
    )
  if module is not None:
    return "sow", (
      "sowing the attention weights (sow_weights=True, i.e. a"
      " module passed as module=...)"
    )
  if custom_einsums:
    return "einsum", f"custom einsums ({', '.join(custom_einsums)})"
  if jnp.dtype(query.dtype) not in SUPPORTED_DTYPES:
    return "dtype", (
      f"dtype {jnp.dtype(query.dtype)} (flash attention takes"
      f" {', '.join(str(d) for d in SUPPORTED_DTYPES)})"
    )
  if query.shape[-1] > MAX_HEAD_DIM:
    return "head_dim", (
      f"head_dim {query.shape[-1]} (flash attention takes at"
      f" most {MAX_HEAD_DIM})"
    )
  if kind == "other":
    return "mask", (
      "a dense attention mask that is neither all True nor the"
      " causal mask tril(ones(seq_q, seq_kv))"
    )
  if kind == "traced" and not declared_causal:
    return "traced_mask", (
      "an attention mask under a JAX transformation (a traced mask cannot be"
      " inspected; for the causal mask pass is_causal=True and no mask, or"
      " declare make_attention_fn(causal=True))"
    )
  return None
