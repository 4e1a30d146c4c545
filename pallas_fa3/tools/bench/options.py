"""The attention options a bench case may set beyond causal: a sliding
window, a logit softcap, per-head sinks and packed documents
(`flash_attention`'s `window_size=`, `softcap=`, `sinks=`,
`segment_ids=`): their checks, their text in names, records and titles,
and the sinks values and segment ids every implementation gets.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3 import SegmentIds, segment_ids_from_lengths
from pallas_fa3.tools.bench import flops

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
  window: Window | None,
  softcap: float | None,
  sinks: bool,
  where: str = "",
  docs: int | None = None,
) -> None:
  """Raises ValueError, naming the field and its value, unless `window` is
  None or a pair of non-negative ints or Nones, `softcap` None or a positive
  finite number, `sinks` a bool and `docs` None or an int >= 1; `where`
  prefixes the message."""
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
  if docs is not None and not (
    isinstance(docs, int) and not isinstance(docs, bool) and docs >= 1
  ):
    raise ValueError(f"{where}docs must be None or an int >= 1; got {docs!r}")


def modifier_names(
  window: Window | str | None,
  softcap: float | None,
  sinks: bool,
  docs: int | None = None,
) -> tuple[str, ...]:
  """Which of window, softcap, sinks and docs are set (a record holds its
  window as `format_window` text, a spec as a pair)."""
  return tuple(
    name
    for name, on in (
      ("window", window is not None),
      ("softcap", softcap is not None),
      ("sinks", bool(sinks)),
      ("docs", docs is not None),
    )
    if on
  )


def modifier_label(
  window: Window | str | None,
  softcap: float | None,
  sinks: bool,
  docs: int | None = None,
) -> str:
  """ "window 256,0, softcap 30, sinks, docs 4": the options that are set,
  or ""."""
  if not isinstance(window, str):
    window = format_window(window)
  text = dict(
    window=f"window {window}",
    softcap=f"softcap {softcap:g}" if softcap is not None else "",
    sinks="sinks",
    docs=f"docs {docs}",
  )
  names = modifier_names(window, softcap, sinks, docs)
  return ", ".join(text[n] for n in names)


def join_names(names: tuple[str, ...]) -> str:
  """("window", "softcap", "sinks") -> "window, softcap or sinks"."""
  *rest, last = names
  return f"{', '.join(rest)} or {last}" if rest else last


def sinks_for(heads_q: int) -> jax.Array:
  """float32 `[heads_q]` sinks, the same for every call with `heads_q`."""
  rng = np.random.default_rng(SINKS_SEED)
  return jnp.asarray(rng.standard_normal(heads_q), jnp.float32)


def segment_ids_for(spec) -> SegmentIds | None:
  """The segment ids of a `BenchSpec` with `docs` (None without): every
  row packs `flops.doc_lengths(docs, seq)` documents, the same ids for q
  and kv when seq_q == seq_kv, kv ids of the same proportions otherwise."""
  if spec.docs is None:
    return None

  def ids(seq):
    lengths = np.tile(flops.doc_lengths(spec.docs, seq), (spec.batch, 1))
    return segment_ids_from_lengths(lengths, seq)

  q_ids = ids(spec.seq_q)
  return SegmentIds(
    q_ids, q_ids if spec.seq_kv == spec.seq_q else ids(spec.seq_kv)
  )


def record_label(record: dict) -> str:
  """`modifier_label` of a sweep record (older records have no fields)."""
  return modifier_label(
    record.get("window"),
    record.get("softcap"),
    record.get("sinks", False),
    record.get("docs"),
  )
