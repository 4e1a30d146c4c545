"""A static profile of one compiled kernel, read off its PTX, its SASS (when
nvdisasm is installed) and ptxas report: what a schedule change moves,
counted before any GPU (threads, registers, the setmaxnreg split against
the CTA's register pool, named barriers, spills, shared memory, wgmma
shapes, `wgmma.wait_group` depths, mbarrier arrivals, TMA copies, the instruction mix of the steady-state loop,
and how many of its exp2 issue under an in-flight wgmma in the PTX and
after ptxas), and the problems that fail `pallas-fa3 aot`
(`register_problems`, `named_barrier_problems`):
docs/kernels.md#the-static-ptx-profile.
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
# `[@%p] mbarrier.arrive.expect_tx... state, [barrier], tx`: the bytes a
# barrier phase waits for from the TMA.
_EXPECT_TX = re.compile(
  r"^(@!?%p\w+\s+)?mbarrier\.arrive\.expect_tx[\w.:]*\s+[^,]+,\s*"
  r"\[([^\]]+)\],\s*(%r\d+|\d+)$"
)
# Mosaic's warpgroup lowering arrives uniformly from every lane of the
# warpgroup with 1/128 of a copy's bytes each (a predicated arrival carries
# them all).
_UNIFORM_LANES = 128
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
# Mosaic's `*.sass_ctrl` lines: `WAIT:RD:WR:Y:STALL  /*addr*/  [@P] OP args`.
_SASS_INSTR = re.compile(
  r"^\s*[-0-9a-fx&]+:[-0-9]+:[-0-9]+:[-Y]:\d+\s+/\*[0-9a-f]+\*/\s+"
  r"(?:@!?U?P[T\d]+\s+)?([A-Z][\w.]*)\s*(.*?)\s*;?\s*$"
)
_SASS_LABEL = re.compile(r"^(\.L_x_\d+):")
_SASS_TARGET = re.compile(r"`\((\.L_x_\d+)\)")

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
  # (exp2 issued while a wgmma group is in flight, all exp2) over the
  # innermost loops that issue wgmma: in the PTX, and in the SASS ptxas
  # made of it (None: no SASS was dumped, nvdisasm missing).
  ex2_in_flight: tuple[int, int] = (0, 0)
  sass_ex2_in_flight: tuple[int, int] | None = None
  # Bytes the TMA loads per iteration of the producer's steady-state loop
  # (the innermost loop expecting the most), and each barrier's share of
  # them: a forward step's K and V tiles, a backward step's Q, dO, lse and
  # delta (unrolled stages are separate barriers). None: no loop loads.
  tma_loop_bytes: tuple[int, tuple[int, ...]] | None = None


def register_split(p: KernelProfile) -> tuple[int | None, int | None, int]:
  """(consumer, producer, producers) of a profile's setmaxnreg sites: the
  largest increase for every consumer (a tuple, one per consumer, when
  each consumer has its own uneven site), the largest decrease for the one
  producer warpgroup that decreases (None: that role keeps the launch
  count)."""
  values = {"inc": [], "dec": []}
  for site in p.setmaxnreg:
    action, n = site.split()
    values[action].append(int(n))
  consumer = max(values["inc"], default=None)
  producer = max(values["dec"], default=None)
  producers = int(producer is not None)
  consumers = max(p.threads // hardware.WARPGROUP_THREADS, 1) - producers
  if len(set(values["inc"])) > 1 and len(values["inc"]) == consumers:
    consumer = tuple(values["inc"])  # one site per consumer, uneven
  return consumer, producer, producers


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


def _statements(lines: Sequence[str]) -> Iterator[tuple[int, str, str]]:
  """(line index, opcode, statement) of every PTX instruction;
  inline-assembly lines (`{ .reg .pred p; setp...; wgmma...; }`) hold
  several."""
  for i, line in enumerate(lines):
    code = line.split("//", 1)[0]
    for stmt in code.replace("{", ";").replace("}", ";").split(";"):
      stmt = stmt.strip()
      if stmt.split(" ", 1)[0].endswith(":"):  # a label before the instruction
        stmt = stmt.split(" ", 1)[1] if " " in stmt else ""
      match = _OPCODE.match(stmt)
      if match and not stmt.startswith("."):
        yield i, match.group(1), stmt


def _instructions(lines: Sequence[str]) -> Iterator[tuple[int, str]]:
  """(line index, opcode) of every PTX instruction."""
  for i, op, _ in _statements(lines):
    yield i, op


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


def ex2_under_wgmma(events: Sequence[str]) -> tuple[int, int]:
  """(exp2 under an in-flight wgmma, all exp2) of one loop body, given as
  events: "mma" (a wgmma issued), "wait0" (a wait that retires every
  group), "wait" (one that leaves groups in flight) and "ex2". Read
  cyclically from the first full wait (compilers rotate loops); a loop with
  no full wait always has a group in flight once one issued."""
  ex2 = sum(e == "ex2" for e in events)
  if "mma" not in events:
    return 0, ex2
  if "wait0" not in events:
    return ex2, ex2
  start = events.index("wait0")
  flying, count = False, 0
  for e in list(events[start:]) + list(events[:start]):
    if e == "mma":
      flying = True
    elif e == "wait0":
      flying = False
    elif e == "ex2" and flying:
      count += 1
  return count, ex2


def _ptx_event(op: str, stmt: str) -> str | None:
  if op.startswith("wgmma.mma_async"):
    return "mma"
  if op.startswith("wgmma.wait_group"):
    wait = _WAIT.search(stmt + ";")
    return "wait0" if wait and wait.group(1) == "0" else "wait"
  return "ex2" if op.startswith("ex2.") else None


def ptx_ex2_in_flight(ptx: str) -> tuple[int, int]:
  """`ex2_under_wgmma` summed over the PTX's innermost loops that issue wgmma."""
  lines = ptx.splitlines()
  stmts = list(_statements(lines))
  found, total = 0, 0
  for first, last in _innermost(_loops(lines)):
    events = [
      e
      for i, op, stmt in stmts
      if first <= i <= last and (e := _ptx_event(op, stmt))
    ]
    if "mma" in events:
      a, b = ex2_under_wgmma(events)
      found, total = found + a, total + b
  return found, total


def _sass_event(op: str, args: str) -> str | None:
  if op.startswith("HGMMA."):
    return "mma"
  if op.startswith("WARPGROUP.DEPBAR"):
    depth = args.rsplit(",", 1)[-1].strip()
    return "wait0" if int(depth, 0) == 0 else "wait"
  return "ex2" if op.startswith("MUFU.EX2") else None


def sass_ex2_in_flight(sass: str) -> tuple[int, int]:
  """`ex2_under_wgmma` summed over the SASS's innermost loops (a backward branch
  whose region holds no EXIT) that issue HGMMA: what ptxas kept of the
  PTX's overlap (it may hoist a wait above the softmax)."""
  ops, labels = [], {}
  for line in sass.splitlines():
    label = _SASS_LABEL.match(line.strip())
    if label:
      labels[label.group(1)] = len(ops)
      continue
    m = _SASS_INSTR.match(line)
    if m:
      ops.append((m.group(1), m.group(2)))
  exits = [i for i, (op, _) in enumerate(ops) if op == "EXIT"]
  loops = []
  for i, (op, args) in enumerate(ops):
    target = _SASS_TARGET.search(args) if op == "BRA" else None
    first = labels.get(target.group(1), i + 1) if target else i + 1
    if first <= i and not any(first <= e <= i for e in exits):
      loops.append((first, i))
  found, total = 0, 0
  for first, last in _innermost(sorted(set(loops))):
    events = [
      e for op, args in ops[first : last + 1] if (e := _sass_event(op, args))
    ]
    if "mma" in events:
      a, b = ex2_under_wgmma(events)
      found, total = found + a, total + b
  return found, total


def _constants(ptx: str) -> dict[str, int]:
  """Registers set from an immediate (`mov.b32 %r1, 128;`): their value."""
  return {m.group(1): int(m.group(2)) for m in _MOV_IMM.finditer(ptx)}


def tma_loop_bytes(ptx: str) -> tuple[int, tuple[int, ...]] | None:
  """(bytes, per-barrier bytes) the TMA loads per iteration of the innermost
  loop whose `mbarrier.arrive.expect_tx` expect the most: the producer's
  steady state. An unpredicated arrival counts its operand once per lane
  of the warpgroup (`_UNIFORM_LANES`); a predicated one once. None if no
  loop expects TMA bytes or an operand is not a constant."""
  lines = ptx.splitlines()
  consts = _constants(ptx)
  stmts = list(_statements(lines))
  best = None
  for first, last in _innermost(_loops(lines)):
    per_barrier: dict[str, int] = collections.Counter()
    for i, op, stmt in stmts:
      if not (
        first <= i <= last and op.startswith("mbarrier.arrive.expect_tx")
      ):
        continue
      m = _EXPECT_TX.match(stmt)
      tx = None if m is None else m.group(3)
      count = int(tx) if tx and tx.isdigit() else consts.get(tx or "")
      if count is None:
        return None
      per_barrier[m.group(2)] += count * (1 if m.group(1) else _UNIFORM_LANES)
    total = sum(per_barrier.values())
    if total and (best is None or total > best[0]):
      best = (total, tuple(sorted(per_barrier.values())))
  return best


def _arrival_counts(ptx: str) -> tuple[int, ...]:
  consts = _constants(ptx)
  counts = [
    int(arg) if arg.isdigit() else consts.get(arg, -1)
    for arg in _MBAR_INIT.findall(ptx)
  ]
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
  sass: str | None = None,
) -> KernelProfile:
  """The profile of one kernel from its PTX text, ptxas's figures and (if
  dumped) its SASS with control codes."""
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
    ex2_in_flight=ptx_ex2_in_flight(ptx),
    sass_ex2_in_flight=None if sass is None else sass_ex2_in_flight(sass),
    tma_loop_bytes=tma_loop_bytes(ptx),
  )


def table(profiles: Iterable[KernelProfile]) -> str:
  """A Markdown table of profiles, one row per kernel."""
  loop_cols = (*LOOP_COLUMNS, "ldg_exposed", "total")
  head = (
    "| kernel | threads | regs | setmaxnreg | reg pool need/have |"
    " spill st/ld B | smem KiB | wgmma |"
    " wait_group depth:sites | max arrivals | named bar | TMA ld/st/red |"
    " ex2 under wgmma PTX SASS | TMA B per loop step |"
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
      f" {p.tma['load']}/{p.tma['store']}/{p.tma['reduce']} |"
      f" {_overlap_cell(p)} | {_tma_cell(p)} | {loop} |"
    )
  return "\n".join(rows)


def _overlap_cell(p: KernelProfile) -> str:
  ptx = "{}/{}".format(*p.ex2_in_flight)
  sass = (
    "?"
    if p.sass_ex2_in_flight is None
    else "{}/{}".format(*p.sass_ex2_in_flight)
  )
  return f"{ptx} {sass}"


def _tma_cell(p: KernelProfile) -> str:
  if p.tma_loop_bytes is None:
    return "-"
  total, parts = p.tma_loop_bytes
  return f"{total} ({'+'.join(map(str, parts))})"
