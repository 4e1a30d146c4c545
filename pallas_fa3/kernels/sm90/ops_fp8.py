"""The FP8 forward kernel's leaf ops: `KernelOps` with e4m3 matmuls."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa3.kernels.sm90.ops import KernelOps

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Fp8Ops(KernelOps):
  """The FP8 kernel's products (everything else is inherited).

  Interpreted: e4m3 operands are upcast to float32 before the dot (exact:
  a product of two e4m3 values is exact in float32), float32 accumulation,
  as the wgmma does.
  """

  # The products of `scores_then_pv` and `accumulate_pv`: e4m3 Q, K; P in
  # shared memory and V^T, both k-major as FP8 wgmma requires.
  def _dot_qk(self, q_smem: Any, k_smem: Any) -> jax.Array:
    return jnp.dot(
      q_smem[...].astype(_F32),
      k_smem[...].astype(_F32).T,
      preferred_element_type=_F32,
    )

  def _dot_pv(self, p_smem: Any, vt_smem: Any) -> jax.Array:
    return jnp.dot(
      p_smem[...].astype(_F32),
      vt_smem[...].astype(_F32).T,
      preferred_element_type=_F32,
    )

  def _wgmma_pv(self, acc: Any, p_smem: Any, vt_smem: Any) -> None:
    plgpu.wgmma(acc, p_smem, vt_smem.transpose((1, 0)))


COMPILED_FP8 = Fp8Ops(interpreted=False)
INTERPRETED_FP8 = Fp8Ops(interpreted=True)
