"""Every JAX-version difference the kernels touch, in one place.

The kernels are tested on JAX 0.11.2 (the H200's version, and CI's) and the
newest release (0.12.x). What the kernels pin or avoid, as far as the
versions differ:

- `plgpu.CompilerParams.lowering_semantics`: the default changed from Lane to
  Warpgroup in later versions; our kernels are written for Lane semantics,
  so it is always set explicitly.
- GPU interpret mode lives under a private path
  (`jax._src.pallas.mosaic_gpu.interpret`); its parameters class, the race
  report and the state reset are imported here only.
- `plgpu.load(ref, idx, layout=...)`: `idx` is deprecated in 0.11 (in
  favour of `ref.at[...]`) and gone in 0.12: `load_with_layout` passes none.
- `plgpu.copy_gmem_to_smem`'s `oob_mode` default is version-dependent; we
  pass only `(src, dst, barrier)`. Out-of-bounds rows never reach a TMA: the
  wrapper pads ragged sequences to whole tiles.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any, Iterator

from jax.experimental.mosaic import gpu as _mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu


def compiler_params(*, approx_math: bool) -> Any:
  """CompilerParams with the lowering semantics pinned (the default moved)."""
  return plgpu.CompilerParams(
      approx_math=approx_math,
      lowering_semantics=_mgpu.LoweringSemantics.Lane,
  )


def _interpret_module():
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
  """Whether the last interpret-mode call (with detect_races) found a race."""
  races = _interpret_module().get_races()
  return bool(races.races_found)


@contextlib.contextmanager
def capture_race_report() -> Iterator[io.StringIO]:
  """Captures what the interpreter prints (race details go to stdout)."""
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    yield buf


def load_with_layout(ref, layout) -> Any:
  """The whole of a shared-memory `ref` in registers, in `layout`."""
  return plgpu.load(ref, layout=layout)
