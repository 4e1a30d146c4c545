"""The forward kernels' pipeline: the persistent grid (one CTA per SM walks
its query tiles, causal ones longest first), the K/V producer warpgroup
whose `num_stages` ring runs on across tiles, the consumer loop, and the
pingpong turns between the two consumer warpgroups (named barriers
compiled, mbarriers in interpret mode). docs/design_notes.md#forward-kernel
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa3.kernels.sm90 import compat
from pallas_fa3.kernels.sm90.common import (
  QueryPlan,
  SegmentRefs,
  cta_kv_range,
  tile_span,
)
from pallas_fa3.kernels.sm90.config import HOPPER_SMS

# -- The pingpong turns --------------------------------------------------
# FA3's schedule: a consumer issues a step's wgmma only in its turn and
# passes the turn on once they are issued, so one warpgroup's softmax runs
# while the other's GEMMs hold the tensor cores. Compiled: two named
# barriers (256 threads: the owner's bar.sync, the other's bar.arrive);
# interpreted (no inline PTX): two mbarriers with the same protocol.

# Hardware barrier ids of the turns (Mosaic uses 0 and 1-4, FA3 starts its
# own after the ones the CTA reserves).
_FIRST_TURN_BARRIER = 8
_TURN_THREADS = 2 * 128  # the waiting consumer and the passing one


def turn_barriers(interpreted: bool) -> tuple:
  """Scratch the turns need: two mbarriers in interpret mode, else none."""
  if interpreted:
    return (plgpu.Barrier(num_barriers=2),)
  return ()


@dataclasses.dataclass(frozen=True)
class Turns:
  """Whose turn it is to issue wgmma. `barriers` is the scratch from
  `turn_barriers` (None compiled). Every consumer alternates `wait` and
  `pass_on`, the same number of times; consumer 1 passes first (`start`) and
  consumer 0 waits last (`finish`), so every arrival is consumed."""

  barriers: Any
  wg: Any

  def _on(self, consumer: int, *, wait: bool) -> None:
    if self.barriers is not None:
      if wait:
        plgpu.barrier_wait(self.barriers.at[consumer])
      else:
        plgpu.barrier_arrive(self.barriers.at[consumer])
      return
    compat.named_barrier(
      _FIRST_TURN_BARRIER + consumer, _TURN_THREADS, sync=wait
    )

  def _mine(self, *, wait: bool) -> None:
    # Barrier ids are static: one branch per consumer.
    pl.when(self.wg == 0)(lambda: self._on(0, wait=wait))
    pl.when(self.wg == 1)(lambda: self._on(1, wait=wait))

  def _others(self) -> None:
    pl.when(self.wg == 0)(lambda: self._on(1, wait=False))
    pl.when(self.wg == 1)(lambda: self._on(0, wait=False))

  def wait(self) -> None:
    """Blocks until it is this consumer's turn."""
    self._mine(wait=True)

  def pass_on(self) -> None:
    """Gives the turn to the other consumer."""
    self._others()

  def start(self) -> None:
    """Consumer 0 goes first: consumer 1 passes it the turn."""
    pl.when(self.wg == 1)(lambda: self._on(0, wait=False))

  def finish(self) -> None:
    """Consumer 0 takes consumer 1's last hand-off."""
    pl.when(self.wg == 0)(lambda: self._on(0, wait=True))


def release_rest(
  turns: Turns | None,
  ring: tuple,
  stages: int,
  base: Any,
  steps: Any,
  cta_steps: Any,
) -> None:
  """A consumer's end of one query tile's K/V walk after its `steps` tiles:
  the K/V tiles the CTA loaded only for the other consumer (causal: `steps`
  to `cta_steps`, global step `base + j`) are waited for and released
  (every warpgroup waits on every phase of a barrier it uses) with one turn
  each, as the other consumer takes one per step (`turns` None: no
  pingpong, the dQ and tangent kernels)."""
  k_full, v_full, k_empty, v_empty = ring

  @pl.loop(steps, cta_steps)
  def _drain(j):
    slot = lax.rem(base + j, stages)
    if turns is not None:
      turns.wait()
      turns.pass_on()
    plgpu.barrier_wait(k_full.at[slot])
    plgpu.barrier_wait(v_full.at[slot])
    plgpu.barrier_arrive(k_empty.at[slot])
    plgpu.barrier_arrive(v_empty.at[slot])


# -- The persistent grid and the K/V producer --------------------------------
# Tile t goes to CTA t % num_ctas, taken in order t = cta, cta + num_ctas,
# ...; causal calls number the tiles longest first (FA3's LPT order),
# others head by head (CTAs working at once share K/V heads in L2). The ring
# runs on across tiles: a global step counter `base + j` picks the slot.

# CTAs in interpret mode: few, so that every CTA walks several tiles.
INTERPRET_CTAS = 2


def num_ctas(num_tiles: int, interpreted: bool, persistent: bool = True) -> int:
  """CTAs of the grid for `num_tiles` query tiles: one per tile unless
  `persistent`."""
  if not persistent:
    return num_tiles
  if interpreted:
    return min(num_tiles, INTERPRET_CTAS)
  sms = HOPPER_SMS
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:  # no GPU backend here: compiling deviceless
    gpus = []
  if gpus and getattr(gpus[0], "core_count", None):
    sms = int(gpus[0].core_count)
  return min(num_tiles, sms)


def tile_coords(plan: QueryPlan, t: Any) -> tuple[Any, Any, Any]:
  """(batch, query head, query tile) of tile number `t` (an int or an int32
  array, 0 <= t < plan.num_tiles): causal longest first, else head by head."""
  spec, n_q = plan.spec, plan.num_q_tiles
  heads = spec.batch * spec.heads_q
  if spec.causal:
    q_tile, bh = n_q - 1 - t // heads, t % heads
  else:
    q_tile, bh = t % n_q, t // n_q
  return bh // spec.heads_q, bh % spec.heads_q, q_tile


@dataclasses.dataclass(frozen=True)
class Tile:
  """One query tile: its (batch, query head, K/V head) and first row."""

  batch: Any
  head: Any
  kv_head: Any
  row0: Any


@dataclasses.dataclass(frozen=True)
class TileWalk:
  """The query tiles of this CTA (inside the kernel) for `plan`."""

  plan: QueryPlan
  num_ctas: int
  # With segment ids: the `[2, b, q_tiles]` int32 K/V tile spans operand
  # (set inside the kernel, `dataclasses.replace`).
  spans: Any = None

  @property
  def one_tile_each(self) -> bool:
    return self.num_ctas == self.plan.num_tiles

  @property
  def grid(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(grid, grid names) of the kernel. One tile per CTA: a 3-D grid, the
    query tile slowest, and the tile's coordinates are the CTA's own
    indices, in ascending order (all such tiles fit in one wave unless
    `persistent=False`). Reversing them for causal calls (longest first)
    made the d256 kernel spill 12-28 B (the sm_90a compile)."""
    if self.one_tile_each:
      spec = self.plan.spec
      return (
        (spec.heads_q, spec.batch, self.plan.num_q_tiles),
        ("heads", "batch", "q_tiles"),
      )
    return (self.num_ctas,), ("cta",)

  def tile(self, i: Any) -> Tile:
    """This CTA's i-th tile."""
    if self.one_tile_each:
      batch, head = lax.axis_index("batch"), lax.axis_index("heads")
      q_tile = lax.axis_index("q_tiles")
    else:
      t = lax.axis_index("cta") + i * self.num_ctas
      batch, head, q_tile = tile_coords(self.plan, t)
    return Tile(
      batch=batch,
      head=head,
      kv_head=lax.div(head, jnp.int32(self.plan.spec.group_size)),
      row0=q_tile * self.plan.rows_per_cta,
    )

  def span(self, tile: Tile) -> tuple[Any, Any] | None:
    """The tile's K/V span from its segment ids (None without)."""
    q_tile = lax.div(tile.row0, jnp.int32(self.plan.rows_per_cta))
    return tile_span(self.spans, tile.batch, q_tile, tile.head)

  def steps(self, tile: Tile) -> jax.Array:
    """K/V steps the CTA streams for `tile` (its slowest consumer's)."""
    return cta_kv_range(self.plan, tile.row0, self.span(tile))[1]

  def first(self, tile: Tile) -> Any:
    """The first K/V tile the CTA streams for `tile` (0 unless a window
    has a left bound or the call has segment ids)."""
    return cta_kv_range(self.plan, tile.row0, self.span(tile))[0]

  def for_each(self, body: Callable[[Tile, Any], None]) -> jax.Array:
    """Runs `body(tile, base)` over this CTA's tiles, `base` the global K/V
    step of the tile's first step; returns the steps streamed in all."""

    def one(i, base):
      tile = self.tile(i)
      body(tile, base)
      return base + self.steps(tile)

    if self.one_tile_each:  # no loop
      return one(0, jnp.int32(0))
    cta = lax.axis_index("cta")
    count = lax.div(self.plan.num_tiles - 1 - cta, self.num_ctas) + 1
    return lax.fori_loop(0, count, one, jnp.int32(0))


def run_consumer(
  walk: TileWalk,
  turn_barriers: tuple,
  registers: int,
  query_tile: Callable[[Turns, Tile, Any], None],
) -> None:
  """A consumer warpgroup of a forward kernel: `query_tile(turns, tile,
  base)` for each of the CTA's tiles. `turn_barriers` is the scratch of
  `turn_barriers` (empty compiled). The turns run on across tiles
  (both consumers take the same number per tile); a tile's O and lse leave
  by TMA while the next starts, waited for (read-only) before the next Q
  load reuses their buffers, and fully at the end."""
  turns = Turns(
    turn_barriers[0] if turn_barriers else None, lax.axis_index("wg")
  )
  plgpu.set_max_registers(registers, action="increase")
  turns.start()

  def one_tile(tile: Tile, base: jax.Array) -> None:
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    query_tile(turns, tile, base)

  walk.for_each(one_tile)
  turns.finish()
  plgpu.wait_smem_to_gmem(0)


def v_rows(v_ref: Any, batch: Any, kv_head: Any, cols: Any) -> Any:
  """One V tile as stored, `[block_kv, d]` rows of `[b, s, h, d]`."""
  return v_ref.at[batch, cols, kv_head]


def kv_producer(
  refs: tuple,
  walk: TileWalk,
  *,
  registers: int,
  v_tile: Callable[..., Any] = v_rows,
) -> None:
  """The producer warpgroup: streams every tile's K and V into the ring.

  `v_tile(v_ref, batch, kv_head, cols)` is the global-memory slice of one V
  tile (the FP8 kernel reads V transposed); `registers` its setmaxnreg.
  `k_ref` / `v_ref` may be tuples of arrays streamed side by side (the
  tangent kernel's K and its tangent): slot `s` of the ring is then
  `k_smem.at[s, i]` for the i-th, all on the slot's one barrier (one
  arrival each).
  """
  (k_ref, v_ref, k_smem, v_smem, k_full, v_full, k_empty, v_empty) = refs
  cfg = walk.plan.config
  stages = cfg.num_stages
  plgpu.set_max_registers(registers, action="decrease")

  def tile_loads(tile: Tile, base: Any) -> None:
    first = walk.first(tile)  # K/V tiles outside every row's window: never

    @pl.loop(0, walk.steps(tile))
    def _load(j):
      g = base + j
      slot = lax.rem(g, stages)
      cols = pl.ds((first + j) * cfg.block_kv, cfg.block_kv)

      @pl.when(g >= stages)
      def _wait_k():  # the slot's previous tile has been read by both
        plgpu.barrier_wait(k_empty.at[slot])

      for src, dst in _side_by_side(k_ref, k_smem, slot):
        plgpu.copy_gmem_to_smem(
          src.at[tile.batch, cols, tile.kv_head],
          dst,
          k_full.at[slot],
          oob_mode=compat.ZERO_FILL,
        )

      @pl.when(g >= stages)
      def _wait_v():
        plgpu.barrier_wait(v_empty.at[slot])

      for src, dst in _side_by_side(v_ref, v_smem, slot):
        plgpu.copy_gmem_to_smem(
          v_tile(src, tile.batch, tile.kv_head, cols),
          dst,
          v_full.at[slot],
          oob_mode=compat.ZERO_FILL,
        )

  total = walk.for_each(tile_loads)

  @pl.loop(jnp.maximum(total - stages, 0), total)
  def _drain(g):
    # Wait until the last tiles are consumed: the CTA must not retire (and
    # its shared memory be reused) under a TMA or a read in flight.
    slot = lax.rem(g, stages)
    plgpu.barrier_wait(k_empty.at[slot])
    plgpu.barrier_wait(v_empty.at[slot])


def _side_by_side(ref: Any, ring: Any, slot: Any) -> list[tuple[Any, Any]]:
  """(source, ring tile) pairs of one slot: one array, or a tuple of them
  (`kv_producer`)."""
  if not isinstance(ref, tuple):
    return [(ref, ring.at[slot])]
  return [(r, ring.at[slot, i]) for i, r in enumerate(ref)]


def query_walk(spec: Any, refs: dict[str, Any], walk: TileWalk) -> tuple:
  """(segment refs or None, the walk) of a kernel with query tiles as CTA
  tiles (forward, FP8 forward, dQ, tangent): with segment ids their refs
  and the walk over their spans; with a block mask the walk over its
  spans (the producer skips its empty tiles too); else `walk`."""
  if spec.segmented:  # the rows' key bounds, their shared tile, the spans
    seg = SegmentRefs(*(refs[n] for n in ("lo", "hi", "bounds_smem", "spans")))
    return seg, dataclasses.replace(walk, spans=refs["spans"])
  if refs.get("bm_spans") is not None:
    return None, dataclasses.replace(walk, spans=refs["bm_spans"])
  return None, walk


def query_span(
  refs: dict[str, Any], seg: Any, batch: Any, q_tile: Any, head: Any
) -> tuple[Any, Any] | None:
  """The (first, end) K/V tiles query tile `q_tile`'s consumers walk, from
  `query_walk`'s spans: its segment ids' (`seg`), a block mask's (per
  head), or None."""
  if seg is not None:
    return tile_span(seg.spans, batch, q_tile)
  return tile_span(refs.get("bm_spans"), batch, q_tile, head)
