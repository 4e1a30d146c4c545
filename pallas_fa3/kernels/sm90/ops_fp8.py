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
      s = async_proxy_read(self._dot_qk(q_smem, k_smem))
      return body(lambda: s)
    return super().with_scores(q_smem, k_smem, body)

  def accumulate_pv_t(
    self,
    o: jax.Array,
    p_smem: Any,
    vt_smem: Any,
    issued: Callable[[], None] = lambda: None,
  ) -> jax.Array:
    """o + P V with P `[bq, bkv]` and V^T `[d, bkv]` in shared memory (FP8);
    calls `issued()` once the wgmma is issued, then waits for all wgmma.

    Both operands are k-major (the contraction runs over their minor,
    sequence axis), which FP8 wgmma requires.
    """
    if self.interpreted:
      out = async_proxy_read(o + self._dot_pv(p_smem, vt_smem))
      issued()
      return out

    def pv(acc):
      self._wgmma_pv(acc, p_smem, vt_smem)
      issued()

    return pl.run_state(pv)(plgpu.ACC.init(o))

  # `scores_then_pv`'s products: e4m3 Q, K; P in shared memory, V^T.
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
