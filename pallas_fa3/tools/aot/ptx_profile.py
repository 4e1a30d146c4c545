"""A static profile of one compiled kernel, read off its PTX and ptxas report:
what a schedule change moves, counted before any GPU (threads, registers,
the setmaxnreg split against the CTA's register pool, named barriers,
spills, shared memory, wgmma shapes, `wgmma.wait_group` depths, mbarrier
arrivals, TMA copies, and the instruction mix of the steady-state loop),
and the problems that fail `pallas-fa3 aot` (`register_problems`,
`named_barrier_problems`): docs/kernels.md#the-static-ptx-profile.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Iterable, Iterator, Sequence

from pallas_fa3.kernels.sm90 import hardware

_LABEL = re.compile(r"^(\$L__\w+):")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__\w+);")
_OPCODE = re.compile(r"^\s*(?:@!?%?\w+\s+)?([a-z][\w.:]*)")
_WGMMA = re.compile(
  r"wgmma\.mma_async[\w.]*?\.(m\d+n\d+k\d+)\.(\w+)\.(\w+)\.(\w+)"
)
_WAIT = re.compile(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);")
_MOV_IMM = re.compile(r"mov\.[bsu]32\s+(%r\d+),\s*(\d+);")
_MBAR_INIT = re.compile(
  r"mbarrier\.init\.shared(?:::cta)?\.b64\s+\[[^\]]+\],\s*(%r\d+|\d+);"
)
_THREADS = re.compile(r"\.(?:maxntid|reqntid)\s+(\d+),\s*(\d+),\s*(\d+)")
_SETMAXNREG = re.compile(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);")
# A named barrier with immediate operands: `bar.sync 8, 256;` (the id and
# the thread count; `bar.sync 0;` counts the whole CTA).
_NAMED_BARRIER = re.compile(
  r"\b(?:bar|barrier)(?:\.cta)?\.(?:sync|arrive)(?:\.aligned)?\s+(\d+)"
  r"(?:\s*,\s*(\d+))?\s*;"
)
# Hardware named barriers per CTA (ids 0-15).
_NAMED_BARRIERS = 16

# Loop-mix columns: a name and the opcode prefixes it counts.
LOOP_COLUMNS = {
  "wgmma": ("wgmma.mma_async",),
  "wait_group": ("wgmma.wait_group",),
  "ex2": ("ex2.",),
  "ffma": ("fma.rn.f32", "fma.rn.ftz.f32"),
  "fmul": ("mul.f32", "mul.rn.f32", "mul.ftz.f32"),
  "shfl": ("shfl.",),
  "mbarrier": ("mbarrier.",),
  "bar": ("bar.", "barrier."),
  "ldg": ("ld.global",),
}


@dataclasses.dataclass(frozen=True)
class KernelProfile:
  """The static profile of one compiled kernel."""

  name: str
  threads: int
  registers: int
  spill_store_bytes: int
  spill_load_bytes: int
  smem_bytes: int | None
  setmaxnreg: tuple[str, ...]
  wgmma: dict[str, int]  # "m64n128k16 f32.bf16.bf16" -> count
  wait_group: dict[int, int]  # depth -> static sites
  max_mbarrier_arrivals: int
  mbarrier_arrival_counts: tuple[int, ...]
  named_barrier_ops: dict[str, int]
  tma: dict[str, int]  # load / store / reduce -> static sites
  loop: dict[str, int]  # steady-state loop: column -> count
  instructions: int
  # ptxas C7513: it serialized the wgmma (waits after each), e.g. because
  # registers a wgmma in flight reads were rewritten before its wait.
  wgmma_serialized: bool = False
  # (id, thread count) of every named barrier with immediate operands.
  named_barriers: tuple[tuple[int, int], ...] = ()
  # ptxas's notes that it ignored the kernel's setmaxnreg (C7504, C7506,
  # C7508: "'setmaxnreg' ignored; ..."): the warpgroups then keep the
  # launch count, whatever the PTX asks for.
  setmaxnreg_ignored: tuple[str, ...] = ()


def register_split(p: KernelProfile) -> tuple[int | None, int | None, int]:
  """(consumer, producer, producers) of a profile's setmaxnreg sites: the
  largest increase for every consumer, the largest decrease for the one
  producer warpgroup that decreases (None: that role keeps the launch
  count)."""
  values = {"inc": [], "dec": []}
  for site in p.setmaxnreg:
    action, n = site.split()
    values[action].append(int(n))
  consumer = max(values["inc"], default=None)
  producer = max(values["dec"], default=None)
  return consumer, producer, int(producer is not None)


def register_budget(p: KernelProfile) -> tuple[int, int]:
  """(registers per thread slot the split asks of the CTA's pool, what the
  CTA owns at ptxas's launch count)."""
  warpgroups = max(p.threads // hardware.WARPGROUP_THREADS, 1)
  consumer, producer, producers = register_split(p)
  need = hardware.split_need(
    warpgroups, consumer, producer, producers, p.registers
  )
  return need, hardware.register_pool(warpgroups, p.registers)


def register_problems(p: KernelProfile) -> list[str]:
  """Why the kernel's setmaxnreg split cannot complete on a GPU (empty: it
  can): ptxas ignored it, or `hardware.split_problems` on its compiled
  figures."""
  ignored = [f"ptxas ignored its setmaxnreg: {n}" for n in p.setmaxnreg_ignored]
  if not p.setmaxnreg:
    return ignored
  consumer, producer, producers = register_split(p)
  return ignored + hardware.split_problems(
    max(p.threads // hardware.WARPGROUP_THREADS, 1),
    consumer,
    producer,
    producers=producers,
    launch=p.registers,
  )


def named_barrier_problems(p: KernelProfile) -> list[str]:
  """Named barriers that cannot work as written: an id past the 16 an SM
  has, a thread count that is not whole warps or exceeds the CTA, or one id
  used with two thread counts (its arrivals never add up)."""
  problems, counts = [], collections.defaultdict(set)
  for bar_id, threads in p.named_barriers:
    counts[bar_id].add(threads)
    if bar_id >= _NAMED_BARRIERS:
      problems.append(f"named barrier {bar_id}: ids are 0-15")
    if threads % 32 or (p.threads and threads > p.threads):
      problems.append(
        f"named barrier {bar_id} counts {threads} threads (whole warps,"
        f" at most the CTA's {p.threads})"
      )
  for bar_id, threads in sorted(counts.items()):
    if len(threads) > 1:
      problems.append(
        f"named barrier {bar_id} is used with thread counts {sorted(threads)}"
      )
  return problems


def _named_barriers(ptx: str, threads: int) -> tuple[tuple[int, int], ...]:
  found = set()
  for m in _NAMED_BARRIER.finditer(ptx):
    found.add((int(m.group(1)), int(m.group(2)) if m.group(2) else threads))
  return tuple(sorted(found))


def _instructions(lines: Sequence[str]) -> Iterator[tuple[int, str]]:
  """(line index, opcode) of every PTX instruction; inline-assembly lines
  (`{ .reg .pred p; setp...; wgmma...; }`) hold several."""
  for i, line in enumerate(lines):
    code = line.split("//", 1)[0]
    for stmt in code.replace("{", ";").replace("}", ";").split(";"):
      stmt = stmt.strip()
      if stmt.split(" ", 1)[0].endswith(":"):  # a label before the instruction
        stmt = stmt.split(" ", 1)[1] if " " in stmt else ""
      match = _OPCODE.match(stmt)
      if match and not stmt.startswith("."):
        yield i, match.group(1)


def _loops(lines: Sequence[str]) -> list[tuple[int, int]]:
  """(first, last) line of every natural loop: a label and a later branch
  back to it."""
  where = {}
  loops = []
  for i, line in enumerate(lines):
    label = _LABEL.match(line.strip())
    if label:
      where[label.group(1)] = i
    branch = _BRANCH.search(line)
    if branch and branch.group(1) in where:
      loops.append((where[branch.group(1)], i))
  return loops


def _innermost(loops: list[tuple[int, int]]) -> list[tuple[int, int]]:
  return [
    (a, b)
    for a, b in loops
    if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)
  ]


def loop_mix(ops: Sequence[str]) -> dict[str, int]:
  """Counts of `LOOP_COLUMNS` (and all instructions) among opcodes `ops`."""
  mix = {
    name: sum(op.startswith(prefixes) for op in ops)
    for name, prefixes in LOOP_COLUMNS.items()
  }
  mix["total"] = len(ops)
  return mix


def steady_state_loop(ptx: str) -> dict[str, int]:
  """The instruction mix of the innermost loop with the most wgmma (empty
  counts if the kernel has no loop), and `ldg_exposed`: its global loads
  that the softmax waits for (`_exposed_loads`)."""
  lines = ptx.splitlines()
  instrs = list(_instructions(lines))
  best = []
  for first, last in _innermost(_loops(lines)):
    ops = [op for i, op in instrs if first <= i <= last]
    if sum(op.startswith("wgmma.mma_async") for op in ops) > sum(
      op.startswith("wgmma.mma_async") for op in best
    ):
      best = ops
  mix = loop_mix(best)
  mix["ldg_exposed"] = _exposed_loads(best)
  return mix


def _exposed_loads(ops: Sequence[str]) -> int:
  """Global loads between a wgmma wait and the next exp2 with no wgmma
  issued after them (a load issued before a wgmma overlaps it), reading
  the loop body cyclically (LLVM rotates loops: it may start mid-step)."""
  waits = [i for i, op in enumerate(ops) if op.startswith("wgmma.wait_group")]
  if not waits:
    return 0
  cyc = list(ops[waits[0] :]) + list(ops[: waits[0]])
  count, pending, active = 0, 0, False
  for op in cyc:
    if op.startswith("wgmma.wait_group"):
      active = True
    elif not active:
      continue
    elif op.startswith("ld.global"):
      pending += 1
    elif op.startswith("wgmma.mma_async"):
      pending = 0
    elif op.startswith("ex2."):
      count, pending, active = count + pending, 0, False
  return count


def _arrival_counts(ptx: str) -> tuple[int, ...]:
  consts: dict[str, int] = {}
  counts = []
  for line in ptx.splitlines():
    mov = _MOV_IMM.search(line)
    if mov:
      consts[mov.group(1)] = int(mov.group(2))
    init = _MBAR_INIT.search(line)
    if init:
      arg = init.group(1)
      counts.append(int(arg) if arg.isdigit() else consts.get(arg, -1))
  return tuple(sorted(set(counts)))


def _tma(op: str) -> str | None:
  """ "load" (to shared memory), "store", "reduce" or None (not a bulk copy)."""
  if op.startswith("cp.reduce.async.bulk"):
    return "reduce"
  if not op.startswith(
    ("cp.async.bulk.tensor", "cp.async.bulk.global", "cp.async.bulk.shared")
  ):
    return None
  to_smem = ".shared::cluster.global" in op or ".shared::cta.global" in op
  return "load" if to_smem else "store"


def profile_ptx(
  name: str,
  ptx: str,
  *,
  registers: int,
  spill_store_bytes: int,
  spill_load_bytes: int,
  smem_bytes: int | None,
  wgmma_serialized: bool = False,
  setmaxnreg_ignored: tuple[str, ...] = (),
) -> KernelProfile:
  """The profile of one kernel from its PTX text and ptxas's figures."""
  lines = ptx.splitlines()
  ops = [op for _, op in _instructions(lines)]
  wgmma = collections.Counter(
    f"{m.group(1)} {m.group(2)}.{m.group(3)}.{m.group(4)}"
    for m in _WGMMA.finditer(ptx)
  )
  waits = collections.Counter(int(d) for d in _WAIT.findall(ptx))
  threads = _THREADS.search(ptx)
  named = collections.Counter(
    op for op in ops if op.startswith(("bar.", "barrier."))
  )
  tma = collections.Counter(kind for kind in map(_tma, ops) if kind)
  arrivals = _arrival_counts(ptx)
  cta_threads = int(threads.group(1)) if threads else 0
  return KernelProfile(
    name=name,
    threads=cta_threads,
    registers=registers,
    spill_store_bytes=spill_store_bytes,
    spill_load_bytes=spill_load_bytes,
    smem_bytes=smem_bytes,
    setmaxnreg=tuple(f"{a} {n}" for a, n in _SETMAXNREG.findall(ptx)),
    wgmma=dict(sorted(wgmma.items())),
    wait_group=dict(sorted(waits.items())),
    max_mbarrier_arrivals=max(arrivals, default=0),
    mbarrier_arrival_counts=arrivals,
    named_barrier_ops=dict(sorted(named.items())),
    tma={k: tma.get(k, 0) for k in ("load", "store", "reduce")},
    loop=steady_state_loop(ptx),
    instructions=len(ops),
    wgmma_serialized=wgmma_serialized,
    named_barriers=_named_barriers(ptx, cta_threads),
    setmaxnreg_ignored=tuple(setmaxnreg_ignored),
  )


def table(profiles: Iterable[KernelProfile]) -> str:
  """A Markdown table of profiles, one row per kernel."""
  loop_cols = (*LOOP_COLUMNS, "ldg_exposed", "total")
  head = (
    "| kernel | threads | regs | setmaxnreg | reg pool need/have |"
    " spill st/ld B | smem KiB | wgmma |"
    " wait_group depth:sites | max arrivals | named bar | TMA ld/st/red |"
    " loop " + " ".join(loop_cols) + " |"
  )
  rows = [head, "|" + "---|" * (head.count("|") - 1)]
  for p in profiles:
    shapes = ", ".join(f"{n}x {s}" for s, n in p.wgmma.items())
    waits = " ".join(f"{d}:{n}" for d, n in p.wait_group.items()) or "-"
    smem = "?" if p.smem_bytes is None else f"{p.smem_bytes / 1024:.1f}"
    loop = " ".join(str(p.loop[c]) for c in loop_cols)
    need, have = register_budget(p)
    budget = f"{need}/{have}" + (" OVER" if register_problems(p) else "")
    rows.append(
      f"| {p.name} | {p.threads} | {p.registers} | {' '.join(p.setmaxnreg)}"
      f"{' (ignored by ptxas)' if p.setmaxnreg_ignored else ''} |"
      f" {budget} | {p.spill_store_bytes}/"
      f"{p.spill_load_bytes} | {smem} | {shapes}"
      f"{' (serialized)' if p.wgmma_serialized else ''} | {waits} |"
      f" {p.max_mbarrier_arrivals} | {sum(p.named_barrier_ops.values())} |"
      f" {p.tma['load']}/{p.tma['store']}/{p.tma['reduce']} | {loop} |"
    )
  return "\n".join(rows)
