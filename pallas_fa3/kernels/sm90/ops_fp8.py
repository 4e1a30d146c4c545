"""The FP8 forward kernel's leaf ops: `KernelOps` with e4m3 matmuls, the
running statistics' seed (sinks) and V^T's tile."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa3.kernels.sm90.ops import KernelOps
from pallas_fa3.quant.e4m3 import P_LOG2_OFFSET
from pallas_fa3.spec import LOG2E

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


def sink_seed(
  ops: Fp8Ops, sinks_ref: Any, batch: Any, head: Any, rows: int
) -> tuple[jax.Array, jax.Array]:
  """(m, l) a row starts from: -inf and 0, or the sink in base 2 and its
  term in l (P's units: the 2^8 offset)."""
  if sinks_ref is None:
    return (
      ops.rows(jnp.full((rows,), -jnp.inf, _F32)),
      ops.rows(jnp.zeros((rows,), _F32)),
    )
  sink2 = sinks_ref[batch, head] * jnp.float32(LOG2E)
  return (
    ops.rows(jnp.broadcast_to(sink2, (rows,))),
    ops.rows(jnp.full((rows,), 2.0**P_LOG2_OFFSET, _F32)),
  )


def vt_cols(vt_ref: Any, batch: Any, kv_head: Any, cols: Any) -> Any:
  """One V^T tile: `[d, block_kv]` columns of the transposed `[b, h, d, s]` V."""
  return vt_ref.at[batch, kv_head, :, cols]


COMPILED_FP8 = Fp8Ops(interpreted=False)
INTERPRETED_FP8 = Fp8Ops(interpreted=True)
