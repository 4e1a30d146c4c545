"""`make_attention_fn`: `pallas_fa3.flash_attention` as the `attention_fn` of
Flax's attention modules, with Flax's semantics (scale, dtype promotion,
leading batch axes, GQA, top-left `is_causal`, what a row that sees no key
gives), a window and softcap for every call, and what happens to a call it
cannot serve (`on_unsupported`: raise, or Flax's own
`dot_product_attention`, bound when this module is imported, with a
`FlashAttentionFallbackWarning`); also Flax's top-left alignment on the
core's bottom-right masks (`flash_top_left`, exact when seq_q != seq_kv).
Every mask runs: the masks it recognises as segment ids live in
`adapter_masks`, the others run as a dense mask (`flash_dense`), and a
traced one is decided on the device (`flash_planned`):
docs/flax.md#inside-flaxs-own-layers.

Example:
  >>> import jax
  >>> from flax import nnx
  >>> from pallas_fa3.flax import make_attention_fn
  >>> layer = nnx.MultiHeadAttention(
  ...     num_heads=4, in_features=32, decode=False, rngs=nnx.Rngs(0),
  ...     attention_fn=make_attention_fn())
  >>> x = jax.random.normal(jax.random.key(1), (2, 16, 32))
  >>> layer(x, is_causal=True).shape
  (2, 16, 32)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import linen, nnx
from flax.nnx.nn import dtypes as nnx_dtypes

from pallas_fa3 import modifiers, segments
from pallas_fa3.attention import flash_attention
from pallas_fa3.backends import check_implementation
from pallas_fa3.flax import attend
from pallas_fa3.flax.adapter_masks import (
  MaskPlan,
  fill_empty_rows,
  flash_key_mask,
  plan_mask,
  poison,
  top_left_causal_mask,
  unsupported_feature,
)
from pallas_fa3.flax.attend import Window
from pallas_fa3.flex import BlockMask
from pallas_fa3.segments import SegmentIds
from pallas_fa3.spec import (
  check_bool,
  check_softmax_scale,
)

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


def flash_top_left(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  causal: bool,
  window: Window | None,
  options: dict[str, Any],
  implementation: str | None,
  segment_ids: SegmentIds | None = None,
) -> tuple[jax.Array, jax.Array]:
  """flash_attention on rank-4 inputs with Flax's top-left alignment.

  The core aligns causal masks bottom-right. Top-left, query i sees keys
  j <= i: with seq_q < seq_kv the keys past seq_q are never seen (slice them
  off, then the mask is square); with seq_q > seq_kv the first seq_kv queries
  see a square causal mask and the others see every key. A window is
  translated too (`_window_top_left`).

  Args:
    q, k, v: `[batch, seq, heads, head_dim]`.
    causal: Flax's top-left causal mask.
    window: None or a checked `(left, right)`, top-left aligned.
    options: other keywords of `flash_attention` (softmax_scale, config,
      softcap).
    implementation: `flash_attention`'s.
    segment_ids: None or int32 ids `[batch, seq_q]` / `[batch, seq_kv]`,
      sliced along with the queries and keys.

  Returns:
    `(out [batch, seq_q, heads_q, head_dim_v], lse [batch, heads_q, seq_q])`
    (float32, natural log; -inf for a row that sees no key).
  """

  def call(q, k, v, causal, window=None, q_from=0):
    ids = None
    if segment_ids is not None:  # queries from q_from on, the leading keys
      ids = SegmentIds(
        segment_ids.q[:, q_from : q_from + q.shape[1]],
        segment_ids.kv[:, : k.shape[1]],
      )
    return flash_attention(
      q,
      k,
      v,
      causal=causal,
      window_size=window,
      implementation=implementation,
      segment_ids=ids,
      return_lse=True,
      **options,
    )

  seq_q, seq_kv = q.shape[1], k.shape[1]
  if window is not None:
    return _window_top_left(q, k, v, causal, window, call)
  if not causal or seq_q == seq_kv:
    return call(q, k, v, causal)
  if seq_q < seq_kv:
    return call(q, k[:, :seq_q], v[:, :seq_q], True)
  head = call(q[:, :seq_kv], k, v, True)
  tail = call(q[:, seq_kv:], k, v, False, q_from=seq_kv)
  return _concat_rows(head, tail)


def _concat_rows(
  first: tuple[jax.Array, jax.Array], second: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, jax.Array]:
  """Two (out, lse) pairs of consecutive query rows as one."""
  return (
    jnp.concatenate([first[0], second[0]], axis=1),
    jnp.concatenate([first[1], second[1]], axis=2),
  )


def _window_top_left(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  causal: bool,
  window: Window,
  call: Callable[..., tuple[jax.Array, jax.Array]],
) -> tuple[jax.Array, jax.Array]:
  """A top-left window (query i sees `i - left <= j <= i + right`) as one
  bottom-right windowed call.

  Causal makes right 0. Bottom-right, query i sits at `i + d` with
  `d = seq_kv - seq_q`, so the same keys are the window `(left + d,
  right - d)`; a side that would be negative is made valid by slicing off
  what no query sees: keys past `seq_q - 1 + right`, queries from
  `seq_kv + left` on (they see no key: output 0, lse -inf).
  """
  left, right = window
  if causal:
    right = 0
  seq_q, seq_kv = q.shape[1], k.shape[1]
  if right is not None and seq_kv > seq_q + right:
    seq_kv = seq_q + right
    k, v = k[:, :seq_kv], v[:, :seq_kv]
  rows = seq_q
  if left is not None and seq_q > seq_kv + left:
    rows = seq_kv + left
  d = seq_kv - rows
  left = None if left is None else left + d
  right = None if right is None else right - d
  if right == 0:  # the causal mask: let the core use its causal path
    out = call(q[:, :rows], k, v, True, (left, None))
  else:
    out = call(q[:, :rows], k, v, False, (left, right))
  if rows == seq_q:
    return out
  out, lse = out
  empty = jnp.zeros((q.shape[0], seq_q - rows) + out.shape[2:], out.dtype)
  no_key = jnp.full(lse.shape[:2] + (seq_q - rows,), -jnp.inf, lse.dtype)
  return _concat_rows((out, lse), (empty, no_key))


def flash_dense(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: jax.Array,
  *,
  causal: bool,
  window: Window | None,
  options: dict[str, Any],
  implementation: str | None,
) -> tuple[jax.Array, jax.Array]:
  """flash_attention with a dense mask (a block mask read by partial
  tiles), Flax's top-left causal mask and window folded into it.

  Args:
    q, k, v: `[batch, seq, heads, head_dim]`.
    mask: bool `[batch, 1 | heads_q, seq_q, seq_kv]`.
    causal, window, options: as `flash_top_left`'s.
    implementation: a backend that takes dense masks
      (`segments.dense_mask_backend`).

  Returns:
    `(out, lse)` as `flash_top_left`'s.
  """
  i = jnp.arange(q.shape[1])[:, None]
  j = jnp.arange(k.shape[1])[None, :]
  left, right = (None, None) if window is None else window
  if causal:
    mask = mask & (j <= i)
  if left is not None:
    mask = mask & (j >= i - left)
  if right is not None:
    mask = mask & (j <= i + right)
  return flash_attention(
    q,
    k,
    v,
    block_mask=BlockMask.from_dense(mask),
    implementation=implementation,
    return_lse=True,
    **options,
  )


def flash_planned(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  plan: MaskPlan,
  *,
  window: Window | None,
  options: dict[str, Any],
  implementation: str | None,
  mask_shape: tuple[int, ...] | None,
) -> tuple[jax.Array, jax.Array]:
  """`(out, lse)` of a call whose mask is planned (`plan_mask`), on
  `[batch, seq, heads, head_dim]` operands: Flax's top-left masks as the
  core's options and segment ids (the kernels take them), a mask no ids give
  as a dense mask (`flash_dense`, in a backend that takes it), and a traced
  mask as whichever of the two it is, decided on the device
  (`segments.padding_or_dense`, as `dot_product_attention` decides)."""
  kw = dict(causal=plan.causal, window=window, options=options)
  if plan.dense is None:
    return flash_top_left(
      q,
      k,
      v,
      **kw,
      implementation=implementation,
      segment_ids=plan.segment_ids,
    )
  call = (
    f"make_attention_fn(implementation={implementation!r}) with a mask of"
    f" shape {mask_shape}"
  )
  if not plan.on_device:
    twin = segments.dense_mask_backend(implementation)
    if twin != implementation:
      warnings.warn(
        f"{call}: the kernels take padding and segment masks (as segment"
        f" ids), not this mask; it runs in {twin!r} (the same function)",
        stacklevel=3,
      )
    return flash_dense(q, k, v, plan.dense, **kw, implementation=twin)

  def padded(operands, q_valid, kv_valid):
    q, k, v, _ = operands
    ids = segments.ids_of_padding(q_valid, kv_valid)
    return flash_top_left(
      q, k, v, **kw, implementation=implementation, segment_ids=ids
    )

  def dense(operands, twin):
    return flash_dense(*operands, **kw, implementation=twin)

  return segments.padding_or_dense(
    plan.dense,
    (q, k, v, plan.dense),
    causal=plan.causal,
    implementation=implementation,
    padded=padded,
    dense=dense,
    call=call,
    vmap_hint=(
      "make_attention_fn(padding_mask=True) for padding masks, which needs"
      " no choice"
    ),
  )


OnUnsupported = Literal["raise", "fallback"]
ON_UNSUPPORTED: tuple[str, ...] = ("raise", "fallback")
# Options forwarded to flash_attention. `causal`, `return_lse` and
# `implementation` are not: the first is the adapter's own declaration, an
# attention_fn returns only the output, and the backend is the first argument.
# `window_size` and `softcap` are keywords of their own (checked up front; the
# window is aligned top-left, see `flash_top_left`).
_FORWARDED_OPTIONS: tuple[str, ...] = ("softmax_scale", "config")
_ONE_ROW_WINDOW = (
  "make_attention_fn(window_size=...) in a call with one query row and a"
  " mask (a decode step of Flax's layers): the window needs the query's"
  " position in the cache, which Flax's decode call does not pass;"
  " pallas_fa3.flax.FlashMultiHeadAttention(decode=True, window_size=...)"
  " decodes with a window"
)


# Default of the keywords only Linen's MultiHeadDotProductAttention passes: a
# call that passes any of them (even with Flax's default value) comes from
# Linen, and its fallback is Linen's dot_product_attention.
_LINEN_ONLY = object()


def _check_options(
  implementation: Any, causal: Any, on_unsupported: Any, options: dict[str, Any]
) -> tuple[str | None, bool]:
  implementation = check_implementation(implementation)
  causal = check_bool("causal", causal)
  if on_unsupported not in ON_UNSUPPORTED:
    raise ValueError(
      f"on_unsupported must be one of {ON_UNSUPPORTED}; got {on_unsupported!r}"
    )
  unknown = sorted(set(options) - set(_FORWARDED_OPTIONS))
  if unknown:
    hint = (
      "; sinks are a parameter, which Flax's attention modules do not"
      " have: use pallas_fa3.flax.FlashMultiHeadAttention(sinks=True)"
      if "sinks" in unknown
      else ""
    )
    raise TypeError(
      f"make_attention_fn got unknown option(s) {unknown}; options forwarded"
      f" to flash_attention are {_FORWARDED_OPTIONS}, window_size and"
      f" softcap{hint}"
    )
  if options.get("softmax_scale") is not None:
    # head_dim only matters for the default scale, which this is not.
    check_softmax_scale(options["softmax_scale"], head_dim=1)
  return implementation, causal


def make_attention_fn(
  implementation: str | None = None,
  *,
  causal: bool = False,
  padding_mask: bool = False,
  on_unsupported: OnUnsupported = "raise",
  window_size: tuple[int | None, int | None] | None = None,
  softcap: float | None = None,
  **options: Any,
) -> Callable[..., jax.Array]:
  """Returns an `attention_fn` for Flax's attention modules that runs flash_attention.

  Args:
    implementation: `flash_attention` backend (None: automatic).
    causal: declare every call causal (Flax's top-left `tril` mask); a mask
      handed to the function is then promised to be that causal mask (a
      traced one is checked on the device, not inspected).
    padding_mask: declare every mask a padding mask, `q_valid[..., i] &
      kv_valid[..., j]` (e.g. `nnx.make_attention_mask(q_valid, kv_valid)`),
      intersected with the causal mask on causal calls. Not needed for any
      result (an undeclared traced mask is decided on the device, padding
      ids or the dense mask): a traced mask then runs as padding ids with
      no choice (NaN if it is not one), and beside `causal=True` concrete
      masks may have entries above the diagonal.
    on_unsupported: `"raise"` (default) raises `NotImplementedError` naming
      the feature flash attention cannot compute; `"fallback"` runs Flax's
      `dot_product_attention` with a one-time `FlashAttentionFallbackWarning`
      (never with `window_size` or `softcap` set: such calls raise).
    window_size: None, or `(left, right)` (ints >= 0, or None for an
      unbounded side) for every call: query i sees key j iff
      `i - left <= j <= i + right` (top-left aligned, like Flax's
      `is_causal`; intersected with the causal mask of a causal call).
    softcap: None (off) or c > 0 for every call: the scaled scores s become
      `c * tanh(s / c)` (0.0 is also off).
    **options: forwarded to `flash_attention`: `softmax_scale` (default
      `1/sqrt(head_dim)`, Flax's; the fallback applies the same scale) and
      `config`.

  Returns:
    `attention_fn(query, key, value, bias=None, mask=None, ...)` with the
    signature of Flax's `dot_product_attention` (nnx and linen keywords);
    q `[batch..., seq_q, heads_q, head_dim]`, k/v `[batch..., seq_kv,
    heads_kv, head_dim]`, output `[batch..., seq_q, heads_q, head_dim]`.

  Raises:
    TypeError / ValueError: a bad argument, named.
  """
  implementation, declared_causal = _check_options(
    implementation, causal, on_unsupported, options
  )
  padding_mask = check_bool("padding_mask", padding_mask)
  window = attend.check_window(window_size)
  options = {k: v for k, v in options.items() if v is not None}
  softcap = modifiers.check_softcap(softcap)
  if softcap is not None:
    options["softcap"] = softcap
  # What Flax's attention cannot compute: no fallback with these.
  modified = tuple(
    f"{name}={value!r}"
    for name, value in (("window_size", window), ("softcap", softcap))
    if value is not None
  )
  warned: set[str] = set()

  def attention_fn(
    query,
    key,
    value,
    bias=None,
    mask=None,
    broadcast_dropout=True,
    dropout_rng=None,
    dropout_rate=0.0,
    deterministic=False,
    dtype=None,
    precision=None,
    module=None,
    *,
    promote_dtype=None,
    is_causal=False,
    force_fp32_for_softmax=_LINEN_ONLY,
    einsum_dot_general=_LINEN_ONLY,
    qk_attn_weights_einsum=_LINEN_ONLY,
    attn_weights_value_einsum=_LINEN_ONLY,
  ) -> jax.Array:
    linen_kwargs = {
      name: arg
      for name, arg in (
        ("force_fp32_for_softmax", force_fp32_for_softmax),
        ("einsum_dot_general", einsum_dot_general),
        ("qk_attn_weights_einsum", qk_attn_weights_einsum),
        ("attn_weights_value_einsum", attn_weights_value_einsum),
      )
      if arg is not _LINEN_ONLY
    }
    if not isinstance(dropout_rate, jax.core.Tracer) and not (
      0.0 <= dropout_rate < 1.0
    ):  # Flax's check, whether or not dropout is active
      raise ValueError(
        f"dropout_rate must be in the range [0, 1), got {dropout_rate!r}"
      )
    query, key, value = (promote_dtype or nnx_dtypes.promote_dtype)(
      (query, key, value), dtype=dtype
    )
    attend.check_qkv(query, key, value)
    seq_q, seq_kv = query.shape[-3], key.shape[-3]
    plan = plan_mask(
      mask,
      tuple(query.shape[:-3]) + (query.shape[-2], seq_q, seq_kv),
      is_causal=is_causal,
      declared_causal=declared_causal,
      padding_mask=padding_mask,
    )
    custom_einsums = [
      name
      for name, fn in linen_kwargs.items()
      if name != "force_fp32_for_softmax" and fn is not None
    ]
    unsupported = unsupported_feature(
      query, bias, dropout_rate, deterministic, module, custom_einsums
    )
    if unsupported is not None:
      if modified:
        refuse_modified_fallback(unsupported, modified)
      refuse_or_warn(unsupported, on_unsupported, warned)
      return flax_attention(
        query,
        key,
        value,
        bias=bias,
        mask=mask,
        broadcast_dropout=broadcast_dropout,
        dropout_rng=dropout_rng,
        dropout_rate=dropout_rate,
        deterministic=deterministic,
        dtype=dtype,
        precision=precision,
        module=module,
        is_causal=is_causal or declared_causal,
        softmax_scale=options.get("softmax_scale"),
        linen_kwargs=linen_kwargs,
      )
    q, k, v = (attend.fold_batch(x) for x in (query, key, value))
    if plan.key_valid is not None:
      if window is not None:
        raise NotImplementedError(_ONE_ROW_WINDOW)
      out, lse = flash_key_mask(
        q,
        k,
        v,
        plan.key_valid,
        options=options,
        implementation=implementation,
      )
    else:
      out, lse = flash_planned(
        q,
        k,
        v,
        plan,
        window=window,
        options=options,
        implementation=implementation,
        mask_shape=tuple(mask.shape) if mask is not None else None,
      )
    if plan.may_leave_rows_empty or window is not None:
      out = fill_empty_rows(out, lse, v)
    return poison(attend.unfold_batch(out, query), plan.ok)

  attention_fn.__doc__ = (
    "Flax-compatible attention_fn running pallas_fa3.flash_attention"
    f" (implementation={implementation!r}, causal={declared_causal},"
    f" padding_mask={padding_mask},"
    f" on_unsupported={on_unsupported!r}"
    + "".join(f", {m}" for m in modified)
    + "); see"
    " pallas_fa3.flax.make_attention_fn."
  )
  return attention_fn
