"""Deviceless ahead-of-time compile of the sm90 kernels: Mosaic + ptxas on a CPU.

Compiles every supported kernel config for an H200 (sm_90a) from a
compile-only target description and reads ptxas's report, so register
spills are caught without a GPU. Needs the package's `aot` extra (the CUDA
plugin and PJRT at the installed JAX's version, and ptxas). The command
fails on any spill and on any setmaxnreg split the CTA's register pool
cannot satisfy (`ptx_profile.register_problems`); `--profile` adds each kernel's static profile
(`ptx_profile`). The sweeps (what is compiled) are in `aot_sweeps`:

    pallas-fa3 aot            # or: JAX_PLATFORMS=cpu python -m pallas_fa3.kernels.aot

More: docs/design_notes.md#deviceless-compile.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import pathlib
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from pallas_fa3.kernels import ptx_profile
from pallas_fa3.kernels.ptx_profile import KernelProfile

if TYPE_CHECKING:  # jax is imported only when a compile runs
  from jax.sharding import Mesh

  from pallas_fa3.kernels.sm90 import config as sm90
  from pallas_fa3.spec import AttentionSpec

# (compile function, spec, config): one item of a sweep.
SweepItem = tuple[Callable[..., "CompileReport"], "AttentionSpec", Any]

_TARGET = pathlib.Path(__file__).parent / "data" / "h200_target_config.txtpb"
# Either CUDA major's plugin, PJRT and ptxas (the H200 runs CUDA 13).
_REQUIRED = {
  13: ("jax_cuda13_plugin", "jax_plugins.xla_cuda13", "nvidia.cu13"),
  12: ("jax_cuda12_plugin", "jax_plugins.xla_cuda12", "nvidia.cuda_nvcc"),
}
# The properties line only: ptxas repeats the figures in a warning line.
_SPILL = re.compile(
  r"stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"smem_scratch_bytes=(\d+)")
# ptxas's note when it serializes wgmma (it then waits after each one).
_SERIALIZED = "wgmma.mma_async instructions are serialized"


def _found(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:
    return False


def missing_packages() -> str | None:
  """Why this tier cannot run here (a missing package), or None."""
  for modules in _REQUIRED.values():
    if all(_found(m) for m in modules):
      return None
  return (
    "the deviceless sm_90a compile needs the CUDA plugin, PJRT and"
    " ptxas at the installed jax version: pip install -e '.[aot]'"
    " (jax[cuda13-local] and nvidia-cuda-nvcc)"
  )


@dataclasses.dataclass(frozen=True)
class CompileReport:
  """What ptxas said about one call's kernels, and each kernel's profile."""

  name: str
  registers: int  # the most of any kernel of the call
  spill_store_bytes: int  # summed over the call's kernels
  spill_load_bytes: int
  kernels: tuple[KernelProfile, ...] = ()


def budget_problems(report: CompileReport) -> list[str]:
  """Each kernel's setmaxnreg split that the CTA's register pool cannot
  satisfy (`ptx_profile.register_problems`) and named barriers that cannot
  work as written (`named_barrier_problems`), named by kernel."""
  return [
    f"{k.name}: {problem}"
    for k in report.kernels
    for problem in ptx_profile.register_problems(k)
    + ptx_profile.named_barrier_problems(k)
  ]


def _parse_ptxas(text: str) -> tuple[int, int, int]:
  spills = _SPILL.findall(text)
  regs = _REGS.findall(text)
  if not spills or not regs:
    raise RuntimeError(f"no ptxas report found in:\n{text[-2000:]}")
  return (
    max(int(r) for r in regs),
    sum(int(s) for s, _ in spills),
    sum(int(l) for _, l in spills),
  )


def h200_mesh() -> Mesh:
  """A one-device mesh of the H200 compile-only target."""
  import jax
  from jax.experimental import topologies

  topo = topologies.get_topology_desc(
    platform="cuda", target_config=_TARGET.read_text(), topology="1x1x1"
  )
  return jax.sharding.Mesh(topo.devices, ("x",))


def _kernel_profiles(dump: pathlib.Path, label: str) -> list[KernelProfile]:
  """One profile per kernel Mosaic dumped (`<kernel>_<n>.ptx/.ptxas/...`)."""
  profiles = []
  for ptxas in sorted(dump.glob("*.ptxas")):
    stem = ptxas.name[: -len(".ptxas")]
    report = ptxas.read_text()
    regs, stores, loads = _parse_ptxas(report)
    resources = dump / f"{stem}.resources.txt"
    smem = _SMEM.search(resources.read_text()) if resources.exists() else None
    ptx = dump / f"{stem}.ptx"
    profiles.append(
      ptx_profile.profile_ptx(
        f"{stem.rsplit('_', 1)[0]} {label}",
        ptx.read_text() if ptx.exists() else "",
        registers=regs,
        spill_store_bytes=stores,
        spill_load_bytes=loads,
        smem_bytes=int(smem.group(1)) if smem else None,
        wgmma_serialized=_SERIALIZED in report,
      )
    )
  if not profiles:
    raise RuntimeError(f"Mosaic dumped no ptxas report for {label}")
  return profiles


def short_label(
  spec: AttentionSpec, config: sm90.Sm90ForwardConfig | sm90.Sm90BackwardConfig
) -> str:
  """`d128 causal 64x128x2` (block_q x block_kv x stages; the backward adds
  dK/dV consumers/head splits, then "fused" or the dQ kernel's): the
  profile table's row label."""
  from pallas_fa3.kernels.sm90.config_backward import fused_backward

  tiles = f"{config.block_q}x{config.block_kv}x{config.num_stages}"
  if not getattr(config, "persistent", True):
    tiles += " per-tile grid"
  if hasattr(config, "dkdv_consumers"):
    tiles += f" kv{config.dkdv_consumers}/{config.dkdv_head_splits}"
    if fused_backward(spec, config):
      tiles += " fused"
    else:
      tiles += f" q{config.dq_consumers}/{config.dq_head_splits}"
  mask = "causal" if spec.causal else "full"
  return f"d{spec.head_dim} {mask}{modifier_label(spec)} {tiles}"


def compile_report(
  name: str, fn: Callable[..., Any], shapes: list, label: str | None = None
) -> CompileReport:
  """Compiles `jax.jit(fn)` on `shapes` for sm_90a; ptxas's report and each
  Mosaic kernel's profile."""
  import jax

  with tempfile.TemporaryDirectory() as dump:
    # Read by Mosaic at compile time: one fresh folder per compile.
    flags = dict(
      MOSAIC_GPU_DUMP_PTXAS="1",
      MOSAIC_GPU_DUMP_PTX="1",
      MOSAIC_GPU_DUMP_RESOURCES="1",
      MOSAIC_GPU_DUMP_TO=dump,
    )
    os.environ.update(flags)
    try:
      jax.jit(fn).lower(*shapes).compile()
    finally:
      for flag in flags:
        os.environ.pop(flag)
    kernels = _kernel_profiles(pathlib.Path(dump), label or name)
  return CompileReport(
    name,
    max(k.registers for k in kernels),
    sum(k.spill_store_bytes for k in kernels),
    sum(k.spill_load_bytes for k in kernels),
    tuple(kernels),
  )


def bf16_operands(spec: AttentionSpec, mesh: Mesh, backward: bool) -> list:
  """Shapes of q, k, v (and out, lse, dout, dlse with `backward`)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec

  sharding = NamedSharding(mesh, PartitionSpec())
  arr = lambda shape, dtype=spec.dtype: jax.ShapeDtypeStruct(
    shape, dtype, sharding=sharding
  )
  q = arr((spec.batch, spec.seq_q, spec.heads_q, spec.head_dim))
  kv = arr((spec.batch, spec.seq_kv, spec.heads_kv, spec.head_dim))
  if not backward:
    return [q, kv, kv]
  stats = arr((spec.batch, spec.heads_q, spec.seq_q), jnp.float32)
  return [q, kv, kv, q, stats, q, stats]


def compile_forward(
  spec: AttentionSpec, config: sm90.Sm90ForwardConfig, mesh: Mesh | None = None
) -> CompileReport:
  """Compiles the forward kernel for `spec`/`config` for sm_90a; ptxas's report."""
  import jax.numpy as jnp

  from pallas_fa3.kernels.sm90 import forward as sm90_fwd

  mesh = h200_mesh() if mesh is None else mesh
  sinks = ids = None  # constant stand-ins: the kernel still reads them
  if spec.sinks:
    sinks = jnp.zeros((spec.batch, spec.heads_q), "float32")
  if spec.segmented:
    ids = packed_bounds(spec)[:2]
  return compile_report(
    f"fwd d={spec.head_dim} {spec.dtype} causal={spec.causal}"
    f"{modifier_label(spec)} {config}",
    lambda q, k, v: sm90_fwd.sm90_forward(
      spec, config, q, k, v, sinks=sinks, segment_ids=ids
    ),
    bf16_operands(spec, mesh, backward=False),
    short_label(spec, config),
  )


def packed_bounds(spec: AttentionSpec) -> tuple:
  """(lo, hi, q_lo, q_hi): the key bounds of each query row and the query
  bounds of each key for documents of 512 tokens (the segmented kernels'
  stand-in operands)."""
  import jax.numpy as jnp

  from pallas_fa3 import segments

  ids = tuple(
    jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) // 512, (spec.batch, n))
    for n in (spec.seq_q, spec.seq_kv)
  )
  return segments.kernel_bounds(spec, ids)[0]


def modifier_label(spec: AttentionSpec) -> str:
  """ " window=(l, r) softcap=c sinks" for the modifiers a spec uses."""
  parts = []
  if spec.window_size is not None:
    parts.append(f"window={spec.window_size}")
  if spec.softcap is not None:
    parts.append(f"softcap={spec.softcap:g}")
  if spec.sinks:
    parts.append("sinks")
  if spec.segmented:
    parts.append("segment_ids")
  return "".join(" " + p for p in parts)


def compile_backward(
  spec: AttentionSpec, config: sm90.Sm90BackwardConfig, mesh: Mesh | None = None
) -> CompileReport:
  """Compiles the backward for sm_90a (the fused kernel, or with
  `spec.deterministic` the dK/dV and dQ kernels); ptxas's report."""
  from pallas_fa3.kernels.sm90 import backward as sm90_bwd

  mesh = h200_mesh() if mesh is None else mesh
  return compile_report(
    f"bwd{'-det' if spec.deterministic else ''} d={spec.head_dim}"
    f" {spec.dtype} causal={spec.causal}{modifier_label(spec)}"
    f" q{spec.seq_q}/kv{spec.seq_kv} h{spec.heads_q}/{spec.heads_kv} {config}",
    lambda *a: sm90_bwd.sm90_backward(
      spec,
      config,
      *a,
      segment_ids=packed_bounds(spec) if spec.segmented else None,
    ),
    bf16_operands(spec, mesh, backward=True),
    short_label(spec, config),
  )


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The flags of `pallas-fa3 aot` / `python -m pallas_fa3.kernels.aot`."""
  from pallas_fa3.kernels.aot_sweeps import PROFILE_SHAPE

  parser.add_argument(
    "--max-configs", type=int, default=None, help="stop after this many configs"
  )
  parser.add_argument(
    "--json",
    default=None,
    metavar="PATH",
    help="also write every report (and profile) to PATH",
  )
  parser.add_argument(
    "--profile",
    action="store_true",
    help="print each kernel's static profile (a Markdown"
    " table: threads, registers, spills, shared memory,"
    " wgmma shapes, wait_group depths, barriers, TMA, the"
    " steady-state loop's instruction mix)",
  )
  sweeps = parser.add_mutually_exclusive_group()
  sweeps.add_argument(
    "--defaults",
    action="store_true",
    help="only the default config of each kernel at every"
    f" head dim, bf16 at {PROFILE_SHAPE} (b, s, hq, hk),"
    " causal and not",
  )
  sweeps.add_argument(
    "--fp8",
    action="store_true",
    help="sweep the FP8 forward kernel (with and without Q's residual) and"
    " the quantization kernel instead",
  )
  sweeps.add_argument(
    "--modifiers",
    action="store_true",
    help="the default forward and backward kernels of every head dim with"
    " windows, softcap and sinks (MODIFIER_CASES) instead",
  )
  sweeps.add_argument(
    "--backward-shapes",
    action="store_true",
    help="sweep every backward config over more shapes"
    " (BACKWARD_SHAPES, causal and not, bf16) instead",
  )


def _items(args: argparse.Namespace) -> Iterator[SweepItem]:
  from pallas_fa3.kernels import aot_sweeps as sweeps

  if args.fp8:
    return sweeps.fp8_forward_sweep()
  if args.defaults:
    return sweeps.defaults_sweep()
  if args.backward_shapes:
    return sweeps.backward_shapes_sweep()
  if args.modifiers:
    return sweeps.modifiers_sweep()
  return sweeps.sweep()


def run(args: argparse.Namespace) -> int:
  """Compiles the selected sweep; 0 without spills, 1 with, 2 if the CUDA
  packages are missing."""
  reason = missing_packages()
  if reason:
    print(f"skipped: {reason}")
    return 2
  mesh, reports = h200_mesh(), []
  for i, (compile_fn, spec, config) in enumerate(_items(args)):
    if args.max_configs is not None and i >= args.max_configs:
      break
    report = compile_fn(spec, config, mesh)
    reports.append(report)
    bad = report.spill_store_bytes or report.spill_load_bytes
    over = budget_problems(report)
    status = "SPILL" if bad else "REGS" if over else "ok"
    print(
      f"{status:5} regs={report.registers:3d}"
      f" spill_st={report.spill_store_bytes} spill_ld="
      f"{report.spill_load_bytes}  {report.name}",
      flush=True,
    )
    for problem in over:
      print(f"      {problem}", flush=True)
  failures = sum(
    bool(r.spill_store_bytes or r.spill_load_bytes or budget_problems(r))
    for r in reports
  )
  if args.profile:
    print(ptx_profile.table([k for r in reports for k in r.kernels]))
  if args.json:
    import json

    pathlib.Path(args.json).write_text(
      json.dumps([dataclasses.asdict(r) for r in reports], indent=1)
    )
  print(f"{failures} config(s) spill or oversubscribe the register pool")
  return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  add_arguments(parser)
  return run(parser.parse_args(argv))


if __name__ == "__main__":
  sys.exit(main())
