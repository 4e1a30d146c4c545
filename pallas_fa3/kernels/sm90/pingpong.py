"""The pingpong hand-off between the two consumer warpgroups of a CTA.

FA3's schedule: a consumer issues its wgmma for a step only in its turn and
passes the turn on as soon as they are issued, so one warpgroup's softmax
runs while the other's GEMMs hold the tensor cores. Compiled, the turns are
two hardware named barriers (one per consumer, 256 threads: the owner's
`bar.sync` and the other's `bar.arrive`), as in FA3; in interpret mode, where
inline PTX does not run, two one-warpgroup mbarriers with the same protocol,
so the interpreter checks the order the compiled kernel uses.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa3.kernels.sm90 import compat

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
  turns: Turns, ring: tuple, stages: int, base: Any, steps: Any, cta_steps: Any
) -> None:
  """A consumer's end of one query tile's K/V walk after its `steps` tiles:
  the K/V tiles the CTA loaded only for the other consumer (causal: `steps`
  to `cta_steps`, global step `base + j`) are waited for and released
  (every warpgroup waits on every phase of a barrier it uses) with one turn
  each, as the other consumer takes one per step."""
  k_full, v_full, k_empty, v_empty = ring

  @pl.loop(steps, cta_steps)
  def _drain(j):
    slot = lax.rem(base + j, stages)
    turns.wait()
    turns.pass_on()
    plgpu.barrier_wait(k_full.at[slot])
    plgpu.barrier_wait(v_full.at[slot])
    plgpu.barrier_arrive(k_empty.at[slot])
    plgpu.barrier_arrive(v_empty.at[slot])
