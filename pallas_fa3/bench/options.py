"""The attention options a bench case may set beyond causal: a sliding
window, a logit softcap and per-head sinks (`flash_attention`'s
`window_size=`, `softcap=`, `sinks=`): their checks, their text in names,
records and titles, and the sinks values every implementation gets.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

Window = tuple[int | None, int | None]
# The sinks of every case: standard-normal float32 logits from this seed, so
# that every implementation of a case gets the same ones.
SINKS_SEED = 0


def format_window(window: Window | None) -> str | None:
  """`(256, None)` -> "256,none" (the --window syntax); None -> None."""
  if window is None:
    return None
  return ",".join("none" if w is None else str(w) for w in window)


def check_modifiers(
  window: Window | None, softcap: float | None, sinks: bool, where: str = ""
) -> None:
  """Raises ValueError, naming the field and its value, unless `window` is
  None or a pair of non-negative ints or Nones, `softcap` None or a positive
  finite number and `sinks` a bool; `where` prefixes the message."""
  side_ok = lambda w: (
    w is None or (isinstance(w, int) and not isinstance(w, bool) and w >= 0)
  )
  if window is not None and not (
    isinstance(window, tuple) and len(window) == 2 and all(map(side_ok, window))
  ):
    raise ValueError(
      f"{where}window must be None or (left, right), each a non-negative"
      f" int or None; got {window!r}"
    )
  if softcap is not None and not (
    isinstance(softcap, (int, float))
    and not isinstance(softcap, bool)
    and 0 < softcap < math.inf
  ):
    raise ValueError(
      f"{where}softcap must be None or a positive finite number;"
      f" got {softcap!r}"
    )
  if not isinstance(sinks, bool):
    raise ValueError(f"{where}sinks must be a bool; got {sinks!r}")


def modifier_names(
  window: Window | str | None, softcap: float | None, sinks: bool
) -> tuple[str, ...]:
  """Which of window, softcap and sinks are set (a record holds its window
  as `format_window` text, a spec as a pair)."""
  return tuple(
    name
    for name, on in (
      ("window", window is not None),
      ("softcap", softcap is not None),
      ("sinks", bool(sinks)),
    )
    if on
  )


def modifier_label(
  window: Window | str | None, softcap: float | None, sinks: bool
) -> str:
  """ "window 256,0, softcap 30, sinks": the options that are set, or ""."""
  if not isinstance(window, str):
    window = format_window(window)
  text = dict(
    window=f"window {window}",
    softcap=f"softcap {softcap:g}" if softcap is not None else "",
    sinks="sinks",
  )
  return ", ".join(text[n] for n in modifier_names(window, softcap, sinks))


def join_names(names: tuple[str, ...]) -> str:
  """("window", "softcap", "sinks") -> "window, softcap or sinks"."""
  *rest, last = names
  return f"{', '.join(rest)} or {last}" if rest else last


def sinks_for(heads_q: int) -> jax.Array:
  """float32 `[heads_q]` sinks, the same for every call with `heads_q`."""
  rng = np.random.default_rng(SINKS_SEED)
  return jnp.asarray(rng.standard_normal(heads_q), jnp.float32)


def record_label(record: dict) -> str:
  """`modifier_label` of a sweep record (older records have no fields)."""
  return modifier_label(
    record.get("window"), record.get("softcap"), record.get("sinks", False)
  )
