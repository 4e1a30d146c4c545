"""Local attention and score modifiers: the options of
`flash_attention(window_size=, softcap=, sinks=)` checked and made canonical
(a window bottom-right aligned like `causal`, its mask in
`pallas_fa3.masking`; softcap `c * tanh(s / c)`), the sinks' layout, and
their gradient from out, lse and the cotangents (`sinks_gradient`), which
every backend shares, so no backward kernel sees the sinks:
docs/api.md#sliding-windows-softcap-and-sinks.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def window_bound(name: str, value: Any) -> int | None:
  """One side of `window_size` as an int >= 0, or None (unbounded): None,
  or -1 as in FA2/FA3 (`window_size=(-1, -1)` is no window, `(-1, 0)`
  causal).

  Raises:
    TypeError / ValueError naming `window_size` and the side.
  """
  if value is None:
    return None
  if isinstance(value, (bool, np.bool_)) or not isinstance(
    value, numbers.Integral
  ):
    raise TypeError(
      f"window_size {name} must be an int >= 0, -1 (unbounded) or None;"
      f" got {value!r} of type {type(value).__name__}"
    )
  if value == -1:
    return None
  if value < 0:
    raise ValueError(
      f"window_size {name} must be an int >= 0, -1 (unbounded) or None;"
      f" got {value}"
    )
  return int(value)


def check_window_size(
  window_size: Any, *, seq_q: int, seq_kv: int, causal: bool
) -> tuple[int | None, int | None] | None:
  """`window_size` validated and made canonical for these lengths.

  A side that covers every row anyway becomes None (left >= seq_kv - 1;
  right >= seq_q - 1, or any right with `causal`), and a window with no
  bound left becomes None, so a window that covers everything runs the
  plain call (bit for bit).

  Raises:
    TypeError / ValueError naming `window_size`: not None or a pair, or a
      side that is not an int >= 0, -1 or None (`window_bound`).
  """
  if window_size is None:
    return None
  if isinstance(window_size, (str, bytes)) or not isinstance(
    window_size, (tuple, list)
  ):
    raise TypeError(
      "window_size must be None or a pair (left, right) of ints >= 0, -1"
      f" or None; got {window_size!r} of type {type(window_size).__name__}"
    )
  if len(window_size) != 2:
    raise ValueError(
      "window_size must be a pair (left, right) of ints >= 0, -1 or None;"
      f" got {tuple(window_size)!r} ({len(window_size)} entries)"
    )
  left = window_bound("left", window_size[0])
  right = window_bound("right", window_size[1])
  if left is not None and left >= seq_kv - 1:
    left = None  # p - left <= 0 for every row (p <= seq_kv - 1)
  if right is not None and (causal or right >= seq_q - 1):
    right = None  # causal already bounds it; or p + right >= seq_kv - 1
  if left is None and right is None:
    return None
  return (left, right)


def check_softcap(softcap: Any) -> float | None:
  """`softcap` as a positive finite float, or None (None or 0.0: off).

  Raises:
    TypeError / ValueError naming `softcap`.
  """
  if softcap is None:
    return None
  if isinstance(softcap, jax.core.Tracer):
    raise TypeError(
      "softcap must be a concrete Python number, not a traced value"
      f" ({softcap}); pass it as a static argument"
    )
  if isinstance(softcap, (np.ndarray, jax.Array)) and softcap.size == 1:
    softcap = softcap.item()
  if isinstance(softcap, (bool, np.bool_)) or not isinstance(
    softcap, numbers.Real
  ):
    raise TypeError(
      "softcap must be None or a non-negative finite number; got"
      f" {softcap!r} of type {type(softcap).__name__}"
    )
  value = float(softcap)
  if not math.isfinite(value) or value < 0.0:
    raise ValueError(
      f"softcap must be None or a non-negative finite number; got {softcap!r}"
    )
  return None if value == 0.0 else value


def check_sinks(sinks: Any, heads_q: int) -> jax.Array | None:
  """`sinks` as an array `[heads_q]` of a float dtype, or None.

  Raises:
    TypeError / ValueError naming `sinks` and its shape or dtype.
  """
  if sinks is None:
    return None
  if not (hasattr(sinks, "shape") and hasattr(sinks, "dtype")):
    raise TypeError(
      f"sinks must be None or an array of shape [heads_q] = [{heads_q}];"
      f" got {type(sinks).__name__}"
    )
  shape = tuple(int(s) for s in sinks.shape)
  if shape != (heads_q,):
    raise ValueError(
      f"sinks must have shape [heads_q] = ({heads_q},) (one logit per query"
      f" head); got shape {shape} (rank {len(shape)})"
    )
  if not jnp.issubdtype(sinks.dtype, jnp.floating):
    raise TypeError(
      f"sinks must have a floating dtype; got {jnp.dtype(sinks.dtype)}"
    )
  return jnp.asarray(sinks)


def batch_sinks(sinks: jax.Array, batch: int) -> jax.Array:
  """float32 `[batch, heads_q]` from the user's `[heads_q]`: the layout the
  backends take (it folds a vmapped axis into batch and shards over batch
  and heads like the lse)."""
  s = sinks.astype(jnp.float32)
  return jnp.broadcast_to(s[None], (batch,) + s.shape)


def sinks_gradient(
  sinks: jax.Array,
  out: jax.Array,
  lse: jax.Array,
  dout: jax.Array,
  dlse: jax.Array,
) -> jax.Array:
  """d/dsinks, `[batch, heads_q]` float32, from the forward's residuals.

  `sum_i exp(sink - lse_i) * (dlse_i - dout_i . out_i)`: a sink is a key
  with no value, so its probability times (dP = 0) - (delta - dlse). Rows
  with lse = -inf cannot occur (the sink is in every denominator).
  """
  delta = jnp.einsum(
    "bqhd,bqhd->bhq",
    dout.astype(jnp.float32),
    out.astype(jnp.float32),
    precision=jax.lax.Precision.HIGHEST,
  )
  p_sink = jnp.exp(sinks[..., None] - lse)
  return jnp.sum(p_sink * (dlse.astype(jnp.float32) - delta), axis=-1)


def active(spec: Any) -> tuple[str, ...]:
  """The argument names of the modifiers a spec uses (for refusals)."""
  return tuple(
    name
    for name, on in (
      ("window_size", spec.window_size is not None),
      ("softcap", spec.softcap is not None),
      ("sinks", spec.sinks),
      ("segment_ids", spec.segmented),
    )
    if on
  ) + (() if getattr(spec, "flex", None) is None else spec.flex.names())


def refuse(where: str, **options: Any) -> None:
  """Raises NotImplementedError naming the options given (not None, not
  off) to an entry point that does not implement them."""
  given = [
    name
    for name, value in options.items()
    if value is not None and not (name == "softcap" and value == 0.0)
  ]
  if given:
    raise NotImplementedError(
      f"{where} does not implement {', '.join(given)}; flash_attention has"
      " them (batch/head sharding, no sequence sharding)"
    )
