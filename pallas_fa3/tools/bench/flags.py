"""The `argparse` types of `pallas-fa3 bench`: each turns a flag's text into
its value or raises `argparse.ArgumentTypeError`, which argparse reports as
a usage error naming the flag ("argument --runs: must be >= 1; got 0").
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

# The word that means "no value" in a list of ints: a contiguous cache
# (--page-size none), the backend's own choice (--num-splits auto).
NONE_WORD = "none"
AUTO_WORD = "auto"


def int_at_least(low: int) -> Callable[[str], int]:
  """An argparse `type`: an int >= `low`, else a usage error naming the flag."""

  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(
        f"expected an integer; got {text!r}"
      ) from None
    if value < low:
      raise argparse.ArgumentTypeError(f"must be >= {low}; got {value}")
    return value

  return parse


def int_or_word(low: int, word: str) -> Callable[[str], int | None]:
  """An argparse `type`: an int >= `low`, or `word` meaning None."""
  as_int = int_at_least(low)

  def parse(text: str) -> int | None:
    if text.strip().lower() == word:
      return None
    try:
      return as_int(text)
    except argparse.ArgumentTypeError as e:
      raise argparse.ArgumentTypeError(f"{e} (or {word!r})") from None

  return parse


def non_negative_float(text: str) -> float:
  """An argparse `type`: a float >= 0, else a usage error naming the flag."""
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(
      f"expected a number; got {text!r}"
    ) from None
  if not value >= 0:  # also rejects nan
    raise argparse.ArgumentTypeError(f"must be >= 0; got {text}")
  return value


def positive_float(text: str) -> float:
  """An argparse `type`: a finite float > 0, else a usage error."""
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(
      f"expected a number; got {text!r}"
    ) from None
  if not 0 < value < math.inf:  # also rejects nan
    raise argparse.ArgumentTypeError(f"must be a finite number > 0; got {text}")
  return value


def window(text: str) -> tuple[int | None, int | None]:
  """An argparse `type`: "LEFT,RIGHT", each an int >= 0 or "none"
  (unbounded), not both none; else a usage error."""
  usage = (
    "expected LEFT,RIGHT, each an integer >= 0 or 'none' (unbounded),"
    f" e.g. 256,0 or 256,none; got {text!r}"
  )
  parts = [part.strip().lower() for part in text.split(",")]
  if len(parts) != 2:
    raise argparse.ArgumentTypeError(usage)
  sides = []
  for part in parts:
    if part == NONE_WORD:
      sides.append(None)
      continue
    try:
      sides.append(int(part))
    except ValueError:
      raise argparse.ArgumentTypeError(usage) from None
    if sides[-1] < 0:
      raise argparse.ArgumentTypeError(usage)
  if sides == [None, None]:
    raise argparse.ArgumentTypeError(
      f"none,none is no window; leave --window out instead (got {text!r})"
    )
  return tuple(sides)


def show(value) -> str:
  """A default as help text: tuples space-separated, None as 'none'."""
  if isinstance(value, tuple):
    return " ".join(show(v) for v in value)
  return NONE_WORD if value is None else str(value)


def unset(gpu, cpu) -> str:
  """Help text: what an unset flag means on each platform."""
  return f"unset: {show(gpu)} on a GPU, {show(cpu)} on a CPU"
