"""The deviceless sm_90a compile's machinery: compile one call of the sm90
kernels for an H200 from a compile-only target description, read ptxas's
report (registers, spills) and each Mosaic kernel's static profile
(`ptx_profile`), and judge it (spills, `budget_problems`). The sweeps of
what is compiled are in `sweeps.py`; the command is `aot`.
More: docs/design_notes.md#deviceless-compile.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import re
import shutil
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pallas_fa3.tools.aot import ptx_profile
from pallas_fa3.tools.aot.ptx_profile import KernelProfile

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
# ptxas's notes when it drops every setmaxnreg of a kernel, e.g. "(C7508)
# Potential Performance Loss: 'setmaxnreg' ignored; unable to determine
# register count at entry." (C7504 and C7506 word the reason otherwise).
_SETMAXNREG_IGNORED = re.compile(r"^.*'?setmaxnreg'? ignored.*$", re.I | re.M)


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


def parse_ptxas(text: str) -> tuple[int, int, int]:
  spills = _SPILL.findall(text)
  regs = _REGS.findall(text)
  if not spills or not regs:
    raise RuntimeError(f"no ptxas report found in:\n{text[-2000:]}")
  return (
    max(int(r) for r in regs),
    sum(int(s) for s, _ in spills),
    sum(int(l) for _, l in spills),
  )


def setmaxnreg_notes(ptxas_report: str) -> tuple[str, ...]:
  """ptxas's notes that it ignored a setmaxnreg, each stripped."""
  return tuple(m.strip() for m in _SETMAXNREG_IGNORED.findall(ptxas_report))


def _cuda_bin() -> str:
  """The folder of the pip CUDA tools (ptxas, nvdisasm) beside this jax."""
  for package in ("nvidia.cu13", "nvidia.cuda_nvcc"):
    try:
      spec = importlib.util.find_spec(package)
    except ModuleNotFoundError:
      continue
    if spec and spec.submodule_search_locations:
      return os.path.join(list(spec.submodule_search_locations)[0], "bin")
  return os.environ.get("PATH", "")


def h200_mesh() -> Mesh:
  """A one-device mesh of the H200 compile-only target."""
  import jax
  from jax.experimental import topologies

  topo = topologies.get_topology_desc(
    platform="cuda", target_config=_TARGET.read_text(), topology="1x1x1"
  )
  return jax.sharding.Mesh(topo.devices, ("x",))


def kernel_profiles(dump: pathlib.Path, label: str) -> list[KernelProfile]:
  """One profile per kernel Mosaic dumped (`<kernel>_<n>.ptx/.ptxas/...`,
  `.sass_ctrl` where nvdisasm is installed)."""
  profiles = []
  for ptxas in sorted(dump.glob("*.ptxas")):
    stem = ptxas.name[: -len(".ptxas")]
    report = ptxas.read_text()
    regs, stores, loads = parse_ptxas(report)
    resources = dump / f"{stem}.resources.txt"
    smem = _SMEM.search(resources.read_text()) if resources.exists() else None
    ptx = dump / f"{stem}.ptx"
    sass = dump / f"{stem}.sass_ctrl"
    kernel = stem.rsplit("_", 1)[0]
    profiles.append(
      ptx_profile.profile_ptx(
        f"{kernel} {label}",
        ptx.read_text() if ptx.exists() else "",
        registers=regs,
        spill_store_bytes=stores,
        spill_load_bytes=loads,
        smem_bytes=int(smem.group(1)) if smem else None,
        wgmma_serialized=_SERIALIZED in report,
        setmaxnreg_ignored=setmaxnreg_notes(report),
        sass=sass.read_text() if sass.exists() else None,
      )
    )
  if not profiles:
    raise RuntimeError(f"Mosaic dumped no ptxas report for {label}")
  return profiles


def short_label(
  spec: AttentionSpec, config: sm90.Sm90ForwardConfig | sm90.Sm90BackwardConfig
) -> str:
  """`d128 causal 64x128x2` (block_q x block_kv x stages; the forward may
  add "per-tile grid" and "no overlap" (`Sm90ForwardConfig`); the backward adds
  dK/dV consumers/head splits, then "fused" or the dQ kernel's): the
  profile table's row label."""
  from pallas_fa3.kernels.sm90.config_backward import fused_backward

  tiles = f"{config.block_q}x{config.block_kv}x{config.num_stages}"
  if not getattr(config, "persistent", True):
    tiles += " per-tile grid"
  if not getattr(config, "overlap", True):
    tiles += " no overlap"
  if hasattr(config, "dkdv_consumers"):
    tiles += f" kv{config.dkdv_consumers}/{config.dkdv_head_splits}"
    if fused_backward(spec, config):
      tiles += " fused"
    else:
      tiles += f" q{config.dq_consumers}/{config.dq_head_splits}"
  mask = "causal" if spec.causal else "full"
  dims = f"d{spec.head_dim}"
  if spec.head_dim_v != spec.head_dim:
    dims += f"/{spec.head_dim_v}"
  heads = ""
  if spec.heads_q != spec.heads_kv:  # GQA: the group loop is compiled in
    heads = f" h{spec.heads_q}/{spec.heads_kv}"
  return f"{dims} {mask}{modifier_label(spec)}{heads} {tiles}"


def compile_report(
  name: str,
  fn: Callable[..., Any],
  shapes: list,
  label: str | None = None,
) -> CompileReport:
  """Compiles `jax.jit(fn)` on `shapes` for sm_90a; ptxas's report and each
  Mosaic kernel's profile (`kernel_profiles`)."""
  import jax

  with tempfile.TemporaryDirectory() as dump:
    # Read by Mosaic at compile time: one fresh folder per compile.
    flags = dict(
      MOSAIC_GPU_DUMP_PTXAS="1",
      MOSAIC_GPU_DUMP_PTX="1",
      MOSAIC_GPU_DUMP_RESOURCES="1",
      MOSAIC_GPU_DUMP_TO=dump,
    )
    if shutil.which("nvdisasm", path=_cuda_bin()):  # the SASS, for overlap
      flags["MOSAIC_GPU_DUMP_SASS_CTRL"] = "1"
    os.environ.update(flags)
    try:
      jax.jit(fn).lower(*shapes).compile()
    finally:
      for flag in flags:
        os.environ.pop(flag)
    kernels = kernel_profiles(pathlib.Path(dump), label or name)
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
  k = arr((spec.batch, spec.seq_kv, spec.heads_kv, spec.head_dim))
  v = arr((spec.batch, spec.seq_kv, spec.heads_kv, spec.head_dim_v))
  if not backward:
    return [q, k, v]
  o = arr((spec.batch, spec.seq_q, spec.heads_q, spec.head_dim_v))
  stats = arr((spec.batch, spec.heads_q, spec.seq_q), jnp.float32)
  return [q, k, v, o, stats, o, stats]


def compile_forward(
  spec: AttentionSpec,
  config: sm90.Sm90ForwardConfig,
  mesh: Mesh | None = None,
  flex: Any = None,
  label: str = "",
) -> CompileReport:
  """Compiles the forward kernel for `spec`/`config` for sm_90a; ptxas's
  report. `flex`: `spec.flex`'s operands (`label` names them)."""
  import jax.numpy as jnp

  from pallas_fa3.kernels.sm90 import forward as sm90_fwd

  mesh = h200_mesh() if mesh is None else mesh
  sinks = ids = None  # constant stand-ins: the kernel still reads them
  if spec.sinks:
    sinks = jnp.zeros((spec.batch, spec.heads_q), "float32")
  if getattr(spec, "segmented", False):  # (a DecodeSpec has no ids)
    ids = packed_bounds(spec)[:2]
  return compile_report(
    f"fwd d={spec.head_dim}{_dv_label(spec)} {spec.dtype} causal={spec.causal}"
    f"{modifier_label(spec)}{label} {config}",
    lambda q, k, v: sm90_fwd.sm90_forward(
      spec, config, q, k, v, sinks=sinks, segment_ids=ids, flex=flex
    ),
    bf16_operands(spec, mesh, backward=False),
    short_label(spec, config),
  )


def compile_tangent(
  spec: AttentionSpec,
  config: Any,
  mesh: Mesh | None = None,
  flex: Any = None,
  label: str = "",
) -> CompileReport:
  """Compiles the forward-tangent kernel (jax.jvp's tangents of out and
  lse from the forward's) for `spec`/`config` for sm_90a. `flex`:
  `spec.flex`'s operands (`label` names them)."""
  import jax.numpy as jnp

  from pallas_fa3.kernels.sm90 import forward_tangent

  mesh = h200_mesh() if mesh is None else mesh
  sinks = dsinks = ids = None  # constant stand-ins: the kernel reads them
  if spec.sinks:
    sinks = dsinks = jnp.zeros((spec.batch, spec.heads_q), "float32")
  if spec.segmented:
    ids = packed_bounds(spec)[:2]
  dbias = score_tangents = None  # tangents of a bias, a score_mod's arrays
  fs = spec.flex
  if fs is not None and fs.bias is not None and fs.bias_grad:
    dbias = jnp.zeros_like(flex.bias)
  if fs is not None and fs.score_mod is not None:
    from pallas_fa3.kernels.sm90 import flex_tile

    positions = flex_tile.float_positions(fs.score_mod)
    if positions:
      score_tangents = tuple(
        jnp.zeros_like(flex.score_consts[i]) for i in positions
      )
  q, k, v, o, lse, _, _ = bf16_operands(spec, mesh, backward=True)
  return compile_report(
    f"tangent d={spec.head_dim}{_dv_label(spec)} {spec.dtype}"
    f" causal={spec.causal}{modifier_label(spec)}{label} {config}",
    lambda q, k, v, o, lse, dq, dk, dv: forward_tangent.sm90_forward_tangent(
      spec,
      config,
      (q, k, v, sinks),
      (o, lse),
      (dq, dk, dv, dsinks),
      segment_ids=ids,
      flex=flex,
      dbias=dbias,
      score_tangents=score_tangents,
    ),
    [q, k, v, o, lse, q, k, v],
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


def _dv_label(spec: AttentionSpec) -> str:
  return "" if spec.head_dim_v == spec.head_dim else f" dv={spec.head_dim_v}"


def modifier_label(spec: AttentionSpec) -> str:
  """ " window=(l, r) softcap=c sinks" for the modifiers a spec uses."""
  parts = []
  if spec.window_size is not None:
    parts.append(f"window={spec.window_size}")
  if spec.softcap is not None:
    parts.append(f"softcap={spec.softcap:g}")
  if spec.sinks:
    parts.append("sinks")
  if getattr(spec, "segmented", False):  # (a DecodeSpec has no ids)
    parts.append("segment_ids")
  return "".join(" " + p for p in parts)


def compile_backward(
  spec: AttentionSpec,
  config: sm90.Sm90BackwardConfig,
  mesh: Mesh | None = None,
  flex: Any = None,
  label: str = "",
  learnable: tuple | None = None,
  fused: bool | None = None,
) -> CompileReport:
  """Compiles the backward for sm_90a (the fused kernel, or with
  `spec.deterministic` the dK/dV and dQ kernels; `fused` as a
  `config_backward.BackwardPlan` says, when given); ptxas's report. `flex`:
  `spec.flex`'s operands (`label` names them). `learnable = (make_score_mod,
  arrays)`: the score_mod `make_score_mod(*arrays)` over arrays that are
  operands of the compiled call (traced, so they carry gradients: the dQ
  kernel's sums), in place of `flex`."""
  import dataclasses

  import jax

  from pallas_fa3 import flex as flex_lib
  from pallas_fa3.kernels.sm90 import backward as sm90_bwd

  mesh = h200_mesh() if mesh is None else mesh
  shapes = bf16_operands(spec, mesh, backward=True)
  arrays = () if learnable is None else tuple(learnable[1])

  def run(*a):
    call_spec, ops = spec, flex
    if learnable is not None:  # the arrays first
      fs, ops = flex_lib.prepare(
        score_mod=learnable[0](*a[: len(arrays)]), mask_mod=None,
        block_mask=None, bias=None, batch=spec.batch, heads=spec.heads_q,
        seq_q=spec.seq_q, seq_kv=spec.seq_kv,
      )  # fmt: skip
      call_spec, a = dataclasses.replace(spec, flex=fs), a[len(arrays) :]
    return sm90_bwd.sm90_backward(
      call_spec,
      config,
      *a,
      segment_ids=packed_bounds(spec) if spec.segmented else None,
      flex=ops,
      fused=fused,
    )

  if arrays:
    sharding = shapes[0].sharding
    shapes = [
      jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for x in arrays
    ] + shapes
  pair = fused is False and not spec.deterministic
  label += " (the pair)" if pair else ""
  return compile_report(
    f"bwd{'-det' if spec.deterministic else ''} d={spec.head_dim}{_dv_label(spec)}"
    f" {spec.dtype} causal={spec.causal}{modifier_label(spec)}{label}"
    f" q{spec.seq_q}/kv{spec.seq_kv} h{spec.heads_q}/{spec.heads_kv} {config}",
    run,
    shapes,
    short_label(spec, config),
  )
