"""`dot_product_attention`: `jax.nn.dot_product_attention`'s signature and
semantics (rank-3 or rank-4 `BTNH` operands, a broadcastable additive bias
and boolean mask, top-left `is_causal`, sequence lengths, `local_window_size`,
`return_residual`, and what it returns for a row with no visible key),
computed by `flash_attention` without materializing the scores. The
options map onto the built-in ones where the alignment agrees (causal and
windows at seq_q == seq_kv; lengths and padding masks as segment ids, a
dense mask that is padding after all decided on the device) and onto a
mask_mod or block mask otherwise: docs/flex.md#migrating.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3 import flex, mods, segments
from pallas_fa3.attention import flash_attention
from pallas_fa3.backends import Implementation
from pallas_fa3.spec import check_int

_JAX_NN = ("xla", "cudnn")


def _ensure_4d(x: Any) -> jax.Array:
  x = jnp.asarray(x)
  return x.reshape((1,) * (4 - x.ndim) + x.shape) if x.ndim < 4 else x


def _check(x: Any, shape: list[int], dtype: Any, name: str) -> None:
  """jax.nn's own checks, with its messages."""
  if x is None:
    return
  if x.ndim != len(shape):
    raise ValueError(f"{name} ndim should be {len(shape)}, but got {x.ndim}")
  if dtype is not None and x.dtype != dtype:
    raise ValueError(f"{name} dtype should be {dtype}, but got {x.dtype}")
  for i, n in enumerate(shape):
    if n != -1 and x.shape[i] != n:
      raise ValueError(f"{name} shape should be {shape}: but got {x.shape}")


def _broadcastable(x: jax.Array, shape: tuple[int, ...], name: str) -> None:
  if any(d not in (1, n) for d, n in zip(x.shape, shape)):
    raise ValueError(
      f"{name} of shape {tuple(x.shape)} must be broadcastable to (B, N, T,"
      f" S) = {shape}"
    )


def dot_product_attention(
  query: Any,
  key: Any,
  value: Any,
  bias: Any = None,
  mask: Any = None,
  *,
  scale: float | None = None,
  is_causal: bool = False,
  query_seq_lengths: Any = None,
  key_value_seq_lengths: Any = None,
  local_window_size: int | tuple[int, int] | None = None,
  implementation: Implementation | None = None,
  return_residual: bool = False,
) -> Any:
  """`jax.nn.dot_product_attention`, computed by `flash_attention`.

  Same arguments, shapes, broadcasting and results as jax.nn's: query
  `(B, T, N, H)` or `(T, N, H)`, key `(B, S, K, H)` and value `(B, S, K,
  Hv)` with N a multiple of K (Hv may differ from H, which jax.nn refuses;
  the output is `(B, T, N, Hv)`); `bias` and boolean `mask` broadcastable
  to `(B, N, T, S)`; `is_causal` top-left (query i sees keys j <= i);
  `query_seq_lengths` / `key_value_seq_lengths` int32 `(B,)` (padded query
  rows give 0); `local_window_size` `(left, right)` or one int for both
  (ints >= 0), top-left; a row that sees no key gives the mean of all
  values, as jax.nn's large-negative masking does. `return_residual`: also
  the logsumexp `(B, T, N)` in the input dtype.

  Args:
    implementation: None (the automatic choice of `flash_attention`), one
      of our backends ("mosaic", "interpret", "blockwise", "reference"), or
      "xla" / "cudnn" (jax.nn's own, called as is).

  Raises:
    ValueError: jax.nn's checks (ranks, dtypes, shapes, head counts).
    TypeError / ValueError: a `local_window_size` that is not an int >= 0
      or a pair of them, named.
  """
  if implementation in _JAX_NN:
    return jax.nn.dot_product_attention(
      query, key, value, bias, mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, implementation=implementation,
      return_residual=return_residual,
    )  # fmt: skip
  output_shape = jnp.shape(query)[:-1] + jnp.shape(value)[-1:]
  q, k, v = (_ensure_4d(x) for x in (query, key, value))
  bias = None if bias is None else _ensure_4d(bias)
  mask = None if mask is None else _ensure_4d(mask)
  qlen = None if query_seq_lengths is None else jnp.asarray(query_seq_lengths)
  kvlen = key_value_seq_lengths
  kvlen = None if kvlen is None else jnp.asarray(kvlen)
  local_window_size = _local_window(local_window_size)
  B, S, K, H = k.shape
  # The value head dim may differ from the query's (jax.nn's may not):
  # flash_attention serves it, and the output has the value's.
  _check(v, [B, S, K, -1], k.dtype, "value")
  _check(q, [B, -1, -1, H], k.dtype, "query")
  _check(mask, [-1] * 4, np.dtype(bool), "mask")
  _check(bias, [-1] * 4, None, "bias")
  _check(qlen, [B], np.dtype("int32"), "query_seq_lengths")
  _check(kvlen, [B], np.dtype("int32"), "key_value_seq_lengths")
  if q.shape[-2] % K != 0:
    raise ValueError(
      "The number of query heads must be a multiple of key/value heads, but"
      f" got {q.shape[-2]} vs {K}"
    )
  T, N = q.shape[1], q.shape[2]
  full = (B, N, T, S)
  scale = (1.0 / np.sqrt(H)) if scale is None else scale

  options: dict[str, Any] = {}
  mask_mods = []
  if is_causal or local_window_size is not None:
    if T == S:  # top-left is bottom-right: the built-in options
      options["causal"] = bool(is_causal)
      if local_window_size is not None:
        options["window_size"] = local_window_size
    else:
      if is_causal:
        mask_mods.append(mods.causal_top_left)
      if local_window_size is not None:
        mask_mods.append(mods.sliding_window(*local_window_size))
  # Which queries and keys are valid, per batch row: the lengths, and a
  # mask that varies along the keys alone or the queries alone (a padding
  # mask, `(B|1, 1, 1, S)` or `(B|1, 1, T, 1)`). Both become segment ids,
  # which the Hopper kernels take.
  valid = [
    None if n is None else jnp.arange(size)[None] < n[:, None]
    for n, size in ((qlen, T), (kvlen, S))
  ]
  if mask is not None:
    _broadcastable(mask, full, "mask")
    axis = _padding_axis(mask.shape)
    if axis is not None:
      along = jnp.broadcast_to(
        mask[:, 0, :, 0] if axis == 0 else mask[:, 0, 0, :], (B, (T, S)[axis])
      )
      valid[axis] = along if valid[axis] is None else valid[axis] & along
      mask = None
  if bias is not None:
    _broadcastable(bias, full, "bias")
    bias = jnp.broadcast_to(bias, (bias.shape[0], bias.shape[1], T, S))
  dense = None
  if mask is not None:
    dense = jnp.broadcast_to(mask, (mask.shape[0], mask.shape[1], T, S))

  def attend(operands, dense_mask, impl):
    """flash_attention with the static options, the valid queries and keys
    as segment ids, the bias, and with `dense_mask` the dense mask as one
    block mask (the causal and window mask_mods folded into it)."""
    q, k, v, q_ok, kv_ok, bias, dense = operands
    opts, fns = dict(options), list(mask_mods)
    if q_ok is not None or kv_ok is not None:
      opts["segment_ids"] = segments.ids_of_padding(
        *(
          jnp.ones((B, n), bool) if ok is None else ok
          for ok, n in ((q_ok, T), (kv_ok, S))
        )
      )
    if bias is not None:
      opts["bias"] = bias
    if dense_mask:  # one block mask, with the static masks folded in
      i, j = jnp.arange(T)[:, None], jnp.arange(S)[None]
      for fn in fns:
        dense = dense & fn(0, 0, i, j)
      opts["block_mask"] = flex.BlockMask.from_dense(dense)
      fns = []
    if fns:
      opts["mask_mod"] = mods.and_masks(*fns)
    return flash_attention(
      q, k, v, softmax_scale=float(scale), return_lse=True,
      implementation=impl, **opts,
    )  # fmt: skip

  operands = (q, k, v, *valid, bias, dense)
  if dense is None:
    out, lse = attend(operands, False, implementation)
  else:
    # A dense mask that is a padding mask after all (`q_valid & kv_valid`,
    # `& tril` beside is_causal: `nnx.make_attention_mask`'s): the same
    # segment ids, decided on the device; any other: the dense mask, which
    # blockwise and reference serve.
    def padded(operands, q_pad, kv_pad):
      q, k, v, q_ok, kv_ok, bias, _ = operands
      ids = tuple(
        p if ok is None else ok & p
        for ok, p in zip((q_ok, kv_ok), (q_pad, kv_pad))
      )
      return attend((q, k, v, *ids, bias, None), False, implementation)

    out, lse = segments.padding_or_dense(
      jnp.broadcast_to(dense, (B,) + dense.shape[1:]),
      operands,
      causal=bool(is_causal),
      implementation=implementation,
      padded=padded,
      dense=lambda operands, twin: attend(operands, True, twin),
      call=(
        f"dot_product_attention(implementation={implementation!r}) with a"
        f" mask of shape {tuple(mask.shape)}"
      ),
      vmap_hint=(
        "a padding mask of shape (B, 1, 1, S) / (B, 1, T, 1), which needs no"
        " choice"
      ),
    )
  # A row that sees no key: jax.nn's masked logits are all one large
  # negative number, so its softmax is uniform: the mean of every value
  # (a padded query row stays 0).
  empty = jnp.swapaxes(lse, 1, 2) == -jnp.inf  # [B, T, N]
  uniform = jnp.asarray(1.0 / S, jnp.float32).astype(k.dtype)
  mean_v = jnp.einsum(
    "bskh,s->bkh",
    v,
    jnp.full((S,), uniform),
    preferred_element_type=jnp.float32,
  ).astype(v.dtype)
  mean_v = jnp.repeat(mean_v, N // K, axis=1)[:, None]  # [B, 1, N, Hv]
  fill = (
    empty
    if qlen is None
    else empty & (jnp.arange(T) < qlen[:, None])[..., None]
  )
  out = jnp.where(fill[..., None], mean_v, out)
  if not return_residual:
    return jnp.reshape(out, output_shape)
  large = -0.7 * float(np.finfo(np.float32).max)
  residual = jnp.where(lse == -jnp.inf, jnp.float32(large) + np.log(S), lse)
  residual = jax.lax.stop_gradient(jnp.swapaxes(residual, 1, 2)).astype(k.dtype)
  return jnp.reshape(out, output_shape), jnp.reshape(
    residual, output_shape[:-1]
  )


def _local_window(size: Any) -> tuple[int, int] | None:
  """jax.nn's `local_window_size` (one int for both sides, or `(left,
  right)`) as a pair of ints >= 0; errors name `local_window_size`."""
  if size is None:
    return None
  if isinstance(size, numbers.Integral) and not isinstance(
    size, (bool, np.bool_)
  ):
    size = (size, size)
  if isinstance(size, (str, bytes)) or not isinstance(size, (tuple, list)):
    raise TypeError(
      "local_window_size must be None, an int >= 0 or a pair (left, right)"
      f" of ints >= 0; got {size!r} of type {type(size).__name__}"
    )
  if len(size) != 2:
    raise ValueError(
      "local_window_size must be None, an int >= 0 or a pair (left, right)"
      f" of ints >= 0; got {tuple(size)!r} ({len(size)} entries)"
    )
  return tuple(
    check_int(f"local_window_size {side}", n, minimum=0)
    for side, n in zip(("left", "right"), size)
  )


def _padding_axis(shape: tuple[int, ...]) -> int | None:
  """0 for a 4-d mask shape that varies along the queries alone (per batch
  row), 1 along the keys alone (or along neither), else None."""
  _, heads, t, s = shape
  if heads != 1 or (t != 1 and s != 1):
    return None
  return 0 if s == 1 and t != 1 else 1
