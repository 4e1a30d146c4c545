"""Every JAX-version difference the kernels touch, in one place.

The kernels are tested on JAX 0.11.2 and the newest release (0.12.x). Here:
the pinned lowering semantics, the private interpret-mode imports and
`plgpu.load` without an index. What each pin is for:
docs/design_notes.md#jax-versions.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator
from typing import Any

from jax.experimental import io_callback
from jax.experimental.mosaic import gpu as _mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu


def compiler_params(
  *, approx_math: bool, reduction_scratch_bytes: int | None = None
) -> Any:
  """CompilerParams with the lowering semantics pinned (the default moved);
  `reduction_scratch_bytes` None keeps Mosaic's reserve for cross-warp
  reductions."""
  extra = {}
  if reduction_scratch_bytes is not None:
    extra["reduction_scratch_bytes"] = reduction_scratch_bytes
  return plgpu.CompilerParams(
    approx_math=approx_math,
    lowering_semantics=_mgpu.LoweringSemantics.Lane,
    **extra,
  )


# TMA reads past an array fill zeros (the default of `copy_gmem_to_smem` in
# 0.11.2 and 0.12, passed explicitly: the forward kernels rely on it at the
# ragged edge of a sequence).
ZERO_FILL = plgpu.OOBFillMode.ZEROS


def _interpret_module() -> Any:
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

  return interpret_pallas_call


def interpret_params(*, detect_races: bool) -> Any:
  """Parameters that make `plgpu.kernel` run in GPU interpret mode on a CPU."""
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

  return InterpretGPUParams(detect_races=detect_races)


def reset_interpret_state() -> None:
  """Clears the interpreter's global state (required after an exception)."""
  _interpret_module().reset_gpu_interpret_mode_state()


def races_found() -> bool:
  """Whether the last interpret-mode call (with detect_races) found a race;
  False where none has run in this process (the interpreter asserts that
  its state exists: a call whose kernels all took the blockwise twin)."""
  try:
    races = _interpret_module().get_races()
  except AssertionError:
    return False
  return bool(races.races_found)


def fail_on_race(
  kernel: Callable[..., Any], interpret: Any
) -> Callable[..., Any]:
  """`kernel`, which in interpret mode with race detection raises once it
  has run if the interpreter found a race: every interpreted call checks
  itself (an ordered callback after the kernel's own), so no caller can
  forget to. The race's details are on stdout (`capture_race_report`)."""
  if interpret is None or not getattr(interpret, "detect_races", False):
    return kernel

  def checked(*args: Any) -> Any:
    out = kernel(*args)
    io_callback(_raise_if_race, None, ordered=True)
    return out

  return checked


def _raise_if_race() -> None:
  if races_found():
    raise RaceDetected(
      "the Pallas GPU interpreter found a race in the kernel that just ran"
      " (its report, printed to stdout, names both accesses)"
    )


class RaceDetected(RuntimeError):
  """An interpreted kernel raced: hardware could compute wrong numbers where
  the interpreter computed right ones."""


@contextlib.contextmanager
def capture_race_report() -> Iterator[io.StringIO]:
  """Captures what the interpreter prints (race details go to stdout)."""
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    yield buf


def load_with_layout(ref: Any, layout: Any) -> Any:
  """The whole of a shared-memory `ref` in registers, in `layout`."""
  return plgpu.load(ref, layout=layout)


def load_global_with_layout(ref: Any, layout: Any) -> Any:
  """A global-memory `ref` in registers, in `layout` (plain loads: Mosaic
  has no optimized transfer from global memory)."""
  return plgpu.load(ref, layout=layout, optimized=False)


def named_barrier(bar_id: int, threads: int, *, sync: bool) -> None:
  """`bar.sync` (waits) or `bar.arrive` (does not) on hardware barrier
  `bar_id` for `threads` threads; Pallas exposes no named barrier, so this
  is inline PTX. Mosaic itself uses ids 0 (the CTA) and 1-4 (warpgroups).

  Convergent: the barrier involves other threads, so LLVM may not move it
  across the (warpgroup-uniform) branches of `pl.when` it sits under
  (`has_side_effects` alone does not forbid that)."""

  @plgpu.inline_mgpu()
  def _emit(ctx):
    del ctx
    op = "sync" if sync else "arrive"
    _mgpu.utils.inline_ptx(
      f"bar.{op} {bar_id}, {threads};",
      has_side_effects=True,
      convergent=True,
    )

  _emit()
