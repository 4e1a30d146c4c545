"""What a window lets through of one ring block, decided before tracing: by
the distance `D` of its chunks, each (query chunk, key chunk) block is
skipped, fully visible, or cropped to its visible rectangle (an ordinary
windowed backend call, one static call per distinct `D`), and
`block_plan` works out how far K/V must travel (its hops forward and
backward): docs/design_notes.md#ring-attention.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3 import backends, modifiers
from pallas_fa3.backends.base import StaticCall
from pallas_fa3.spec import AttentionSpec

ORDERS: tuple[str, ...] = ("natural", "zigzag")
SKIP, FULL = 0, 1  # branch indices of every block's lax.switch


def chunk_ids(order: str, n: int, device: Any) -> tuple[Any, ...]:
  """The global chunk indices device `device` holds, in local order."""
  if order == "natural":
    return (device,)
  return (device, 2 * n - 1 - device)


@dataclasses.dataclass(frozen=True)
class Crop:
  """The visible rectangle of a block and the backend call that runs it.

  Attributes:
    rows: `(r0, r1)`: query rows of the chunk that see some key.
    keys: `(k0, k1)`: keys of the chunk that some row sees.
    call: the backend call on the `(r1 - r0) x (k1 - k0)` rectangle (its
      window, if any, re-aligned to the rectangle).
  """

  rows: tuple[int, int]
  keys: tuple[int, int]
  call: StaticCall


@dataclasses.dataclass(frozen=True)
class BlockPlan:
  """The static half of the windowed ring (hashable).

  Attributes:
    order: "natural" or "zigzag": which chunks a device holds.
    chunk_q, chunk_kv: tokens per query / key chunk.
    hops: (forward, backward) ring steps K/V travel.
    full: the call of a fully visible block, or None if none occurs.
    full_range: `(lo, hi)`: the D values of fully visible blocks.
    partial: `((D, Crop), ...)`: every partly visible block that occurs.
  """

  order: str
  chunk_q: int
  chunk_kv: int
  hops: tuple[int, int]
  full: Crop | None
  full_range: tuple[int, int]
  partial: tuple[tuple[int, Crop], ...]

  def branch(self, distance: jax.Array) -> jax.Array:
    """The `lax.switch` index of a block at (traced) distance D: `SKIP`,
    `FULL`, or 2 + the index of its partial crop."""
    lo, hi = self.full_range
    index = jnp.where((distance >= lo) & (distance <= hi), FULL, SKIP)
    for i, (d, _) in enumerate(self.partial):
      index = jnp.where(distance == d, 2 + i, index)
    return index.astype(jnp.int32)

  def crops(self) -> tuple[Crop | None, ...]:
    """The calls by branch index (None: skip)."""
    return (None, self.full) + tuple(c for _, c in self.partial)


def _bounds(spec: AttentionSpec) -> tuple[int | None, int | None, int]:
  return spec.window_left, spec.window_right, spec.causal_offset


def visible_rectangle(
  spec: AttentionSpec, distance: int, chunk_q: int, chunk_kv: int
) -> tuple[int, int, int, int, bool] | None:
  """(r0, r1, k0, k1, full) of a block at distance D, or None if no pair of
  it is visible. `spec`: the global call (its window, causal, offset)."""
  left, right, offset = _bounds(spec)
  base = distance + offset  # row x's own key position is x + base
  r0 = 0 if right is None else max(0, -(base + right))
  r1 = chunk_q if left is None else min(chunk_q, chunk_kv - (base - left))
  if r1 <= r0:
    return None
  k0 = 0 if left is None else max(0, r0 + base - left)
  k1 = chunk_kv if right is None else min(chunk_kv, r1 - 1 + base + right + 1)
  if k1 <= k0:
    return None
  full = (
    (r0, r1, k0, k1) == (0, chunk_q, 0, chunk_kv)
    and (left is None or chunk_q - 1 + base - left <= 0)
    and (right is None or base + right >= chunk_kv - 1)
  )
  return r0, r1, k0, k1, full


def resolve_call(
  step: AttentionSpec, implementation: str | None, config: Any
) -> StaticCall:
  """The backend call of one ring block, resolved as flash_attention would.

  Raises:
    NotImplementedError: the backend cannot serve it, or its backward does
      not read the lse (a ring step hands it the merged lse).
  """
  backend, config = backends.resolve(step, implementation, config)
  if not backend.backward_uses_lse:
    raise NotImplementedError(
      f"implementation={backend.name!r} cannot run ring attention: its"
      " backward differentiates each block's own softmax and ignores the"
      " merged lse every ring step passes; use 'blockwise' (or None)"
    )
  return StaticCall(step, backend, config)


def _call(
  local: AttentionSpec,
  window: Any,
  seq_q: int,
  seq_kv: int,
  implementation: str | None,
  config: Any,
) -> StaticCall:
  step = dataclasses.replace(
    local,
    seq_q=seq_q,
    seq_kv=seq_kv,
    causal=False,
    window_size=modifiers.check_window_size(
      window, seq_q=seq_q, seq_kv=seq_kv, causal=False
    ),
  )
  return resolve_call(step, implementation, config)


def _crop(
  spec: AttentionSpec,
  local: AttentionSpec,
  distance: int,
  rect: tuple[int, int, int, int],
  implementation: str | None,
  config: Any,
) -> Crop:
  """The call of a partly visible block: its window re-aligned to the
  rectangle (whose last row's own key is its last key)."""
  left, right, offset = _bounds(spec)
  r0, r1, k0, k1 = rect
  rows, keys = r1 - r0, k1 - k0
  shift = r0 - k0 + distance + offset - (keys - rows)
  window = (
    None if left is None else left - shift,
    None if right is None else right + shift,
  )
  return Crop(
    (r0, r1), (k0, k1), _call(local, window, rows, keys, implementation, config)
  )


def _hops(needed: set[int], n: int) -> tuple[int, int]:
  """Fewest (forward, backward) steps covering the ring offsets `needed`:
  forward step s brings offset s, backward step s offset n - s."""
  best = (n - 1, 0) if needed else (0, 0)
  for forward in range(n):
    rest = [r for r in needed if r > forward]
    backward = n - min(rest) if rest else 0
    if forward + backward < sum(best):
      best = (forward, backward)
  return best


def block_plan(
  spec: AttentionSpec,
  local: AttentionSpec,
  order: str,
  n: int,
  implementation: str | None,
  config: Any,
) -> BlockPlan:
  """Classifies every block the ring can meet and resolves each call.

  Args:
    spec: the global call (lengths, window, causal).
    local: the same call on one device's batch/head shard.
    order: "natural" or "zigzag", the chunks a device holds.
    n: the ring size.
    implementation, config: as in `flash_attention`, for every call.
  """
  per_device = 1 if order == "natural" else 2
  cq = spec.seq_q // (n * per_device)
  ck = spec.seq_kv // (n * per_device)
  devices = np.arange(n)
  q_chunks = np.stack(chunk_ids(order, n, devices), axis=-1)  # [n, m]
  rects: dict[int, Any] = {}
  needed: set[int] = set()
  for r in range(n):
    owners = (devices - r) % n
    kv_chunks = np.stack(chunk_ids(order, n, owners), axis=-1)
    d = q_chunks[:, :, None] * cq - kv_chunks[:, None, :] * ck  # [n, m, m]
    for distance in np.unique(d).tolist():
      if distance not in rects:
        rects[distance] = visible_rectangle(spec, distance, cq, ck)
      if r and rects[distance] is not None:
        needed.add(r)
  full = [d for d, rect in rects.items() if rect is not None and rect[4]]
  partial = sorted(d for d, rect in rects.items() if rect and not rect[4])
  full_call = None
  if full:
    full_call = Crop(
      (0, cq), (0, ck), _call(local, None, cq, ck, implementation, config)
    )
  return BlockPlan(
    order=order,
    chunk_q=cq,
    chunk_kv=ck,
    hops=_hops(needed, n),
    full=full_call,
    full_range=(min(full), max(full)) if full else (1, 0),
    partial=tuple(
      (d, _crop(spec, local, d, rects[d][:4], implementation, config))
      for d in partial
    ),
  )
