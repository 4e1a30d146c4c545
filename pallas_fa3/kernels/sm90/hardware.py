"""Hardware facts of an sm90 SM that both the kernels and the static
checks of their compiled code rely on, and the register-pool rule.

`setmaxnreg` moves registers between the warpgroups of one CTA through a
per-CTA pool: the CTA owns `warpgroups x 128 x launch registers` (ptxas's
per-thread count, allocated in units of 8), `setmaxnreg.dec` returns
registers to the pool and `setmaxnreg.inc` blocks until the pool can give
them. A split that asks for more than the CTA owns never completes: the
consumers wait forever. ptxas does not check this; `split_problems` does
(docs/hardware_hazards.md).
"""

from __future__ import annotations

from pallas_fa3.spec import cdiv

REGISTER_FILE = 65_536  # 32-bit registers per SM
WARPGROUP_THREADS = 128
MAX_THREAD_REGISTERS = 255  # the ISA's per-thread limit (ptxas reports it)
REGISTER_GRANULE = 8  # per-thread allocation unit (256 per warp)
SETMAXNREG_RANGE = (24, 256)  # PTX: setmaxnreg takes multiples of 8 in it


def _allocated(registers: int) -> int:
  """Registers a thread really holds for a per-thread count (rounded up to
  the allocation unit)."""
  g = REGISTER_GRANULE
  return cdiv(registers, g) * g


def launch_registers(warpgroups: int) -> int:
  """The most registers per thread a CTA of `warpgroups` warpgroups can
  launch with (what ptxas gives a kernel with setmaxnreg): 168 for three,
  255 for two."""
  per_thread = REGISTER_FILE // (WARPGROUP_THREADS * warpgroups)
  per_thread -= per_thread % REGISTER_GRANULE
  return min(per_thread, MAX_THREAD_REGISTERS)


def register_pool(warpgroups: int, launch: int | None = None) -> int:
  """Registers per thread slot the CTA owns: `warpgroups` x the launch
  count (`launch`: ptxas's figure; default the most it can be)."""
  launch = launch_registers(warpgroups) if launch is None else launch
  return warpgroups * _allocated(launch)


def split_need(
  warpgroups: int,
  consumer: int | None,
  producer: int | None,
  producers: int,
  launch: int,
) -> int:
  """Registers per thread slot a split asks of the pool: the consumers at
  `consumer` (None: the launch count), `producers` warpgroups at
  `producer`."""
  producers = producers if producer is not None else 0
  consumers = warpgroups - producers
  if isinstance(consumer, tuple):  # one value per consumer warpgroup
    own = [_allocated(c) for c in consumer[:consumers]]
    need = sum(own) + (consumers - len(own)) * _allocated(launch)
  else:
    need = consumers * _allocated(launch if consumer is None else consumer)
  return need + producers * _allocated(producer or 0)


def split_problems(
  warpgroups: int,
  consumer: int | None,
  producer: int | None,
  *,
  producers: int = 1,
  launch: int | None = None,
) -> list[str]:
  """What is wrong with a setmaxnreg split (empty: nothing): each value a
  multiple of 8 in [24, 256], and `(warpgroups - producers) x consumer +
  producers x producer` within the pool. A None value leaves that role at
  the launch count."""
  launch = launch_registers(warpgroups) if launch is None else launch
  problems = []
  low, high = SETMAXNREG_RANGE
  values = [("producer", producer)]
  if isinstance(consumer, tuple):
    values += [("consumer", c) for c in consumer]
  else:
    values += [("consumer", consumer)]
  for role, value in values:
    if value is not None and (value % 8 or not low <= value <= high):
      problems.append(
        f"{role} setmaxnreg {value} is not a multiple of 8 in [{low}, {high}]"
      )
  producers = producers if producer is not None else 0
  consumers = warpgroups - producers
  need = split_need(warpgroups, consumer, producer, producers, launch)
  pool = register_pool(warpgroups, launch)
  if need > pool:
    asked = (
      " + ".join(map(str, consumer))
      if isinstance(consumer, tuple)
      else f"{consumers} x {consumer or launch}"
    )
    problems.append(
      f"setmaxnreg asks for {need} registers per thread slot"
      f" ({asked} + {producers} x {producer}) and"
      f" the CTA owns {pool} ({warpgroups} warpgroups x {launch}): the"
      " increase never completes"
    )
  return problems


def check_split(warpgroups: int, consumer: int, producer: int) -> None:
  """Raises ValueError if the split oversubscribes the CTA's pool (at the
  most registers it can launch with) or takes an invalid value."""
  problems = split_problems(warpgroups, consumer, producer)
  if problems:
    raise ValueError("; ".join(problems))
