"""The FP8 forward kernel's leaf ops: `KernelOps` with e4m3 matmuls."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa3.kernels.sm90.ops import KernelOps, async_proxy_read

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Fp8Ops(KernelOps):
  """The FP8 kernel's leaf matmuls (the register-layout ops are inherited).

  Interpreted: e4m3 operands are upcast to float32 before the dot (exact:
  a product of two e4m3 values is exact in float32), float32 accumulation,
  as the wgmma does.
  """

  def with_scores(
    self,
    q_smem: Any,
    k_smem: Any,
    body: Callable[[Callable[[], jax.Array]], Any],
  ) -> Any:
    """`KernelOps.with_scores` on e4m3 tiles (one Q and one K tile)."""
    if self.interpreted:
      s = async_proxy_read(
        jnp.dot(
          q_smem[...].astype(_F32),
          k_smem[...].astype(_F32).T,
          preferred_element_type=_F32,
        )
      )
      return body(lambda: s)
    return super().with_scores(q_smem, k_smem, body)

  def accumulate_pv_t(
    self, o: jax.Array, p_smem: Any, vt_smem: Any
  ) -> jax.Array:
    """o + P V with P `[bq, bkv]` and V^T `[d, bkv]` in shared memory (FP8).

    Both operands are k-major (the contraction runs over their minor,
    sequence axis), which FP8 wgmma requires; waits for all wgmma.
    """
    if self.interpreted:
      return async_proxy_read(
        o
        + jnp.dot(
          p_smem[...].astype(_F32),
          vt_smem[...].astype(_F32).T,
          preferred_element_type=_F32,
        )
      )

    def pv(acc):
      plgpu.wgmma(acc, p_smem, vt_smem.transpose((1, 0)))

    return pl.run_state(pv)(plgpu.ACC.init(o))


COMPILED_FP8 = Fp8Ops(interpreted=False)
INTERPRETED_FP8 = Fp8Ops(interpreted=True)
