"""FlashAttention-3 backward kernels for Hopper (sm90) in Pallas Mosaic GPU.

Gradients by recomputation from the residuals (out, lse), after FA2/FA3:
`delta = rowsum(dO * O) - dlse`, `P = exp2(S * scale * log2(e) - lse2)`,
`dV = P^T dO`, `dP = dO V^T`, `dS = P * (dP - delta)`, `dK = scale dS^T Q`,
`dQ = scale dS K`. Two kernels, each warp specialized like the forward (one
producer warpgroup streaming tiles by TMA through a `num_stages` ring, two
consumer warpgroups computing with wgmma):

- **dK/dV kernel**, parallel over K/V tiles and kv heads: each consumer
  holds its own `block_kv` rows of K and V and float32 dK, dV accumulators;
  the producer streams Q, dO, lse and delta tiles of every query head of the
  GQA group and every query tile that sees the keys (causal: earlier query
  tiles are never loaded). dK/dV of the group are summed in registers: no
  repeated K/V, no atomics.
- **dQ kernel**, parallel over query tiles: the forward's structure (its
  producer streams K and V), accumulating dQ in float32 registers.

Registers decide the form (`Sm90BackwardConfig`). A lone consumer
warpgroup gets 256 registers a thread (setmaxnreg; ptxas allocates 255),
two get 240 each. At d = 192, 256 the float32 dK, dV of one 64-row tile
alone take 192-256 registers a thread, so (FA3's layout for large head
dims) **two consumers share each K/V tile**, each accumulating half of
dK/dV's head-dim columns: each computes half of the key columns of S and
dP, writes that half of P and dS to shared memory, meets the other, and
both read all of P and dS (transposed by the wgmma) for their halves of dV
and dK. The dQ kernel does the same with two consumers sharing each query
tile (dS exchanged, dQ_w += dS K[:, half w]). No GEMM is repeated.
Alternatives kept selectable (outside the config space): the dK/dV head
dim split across two CTAs per K/V tile, which recompute S^T and dP^T (two
more GEMMs per tile), and one dQ consumer taking K/V tiles in halves of
`block_kv / 2` keys. Column halves and halves of tiles need
64-byte-swizzled buffers (a wgmma K step is 32 rows there, 64 with the
128-byte swizzle). Masks are built from 1-D index vectors compared after
broadcasting (`masking.visible_tile_at`), and the dK/dV kernel masks causal
tiles in the same loop as the others: two index tiles, or a one-step masked
loop that the compiler straightens, cost up to 336 B of spills at d = 256.

Why a separate dQ kernel rather than FA3's float32 atomic adds of dQ from
the dK/dV kernel: it costs two more GEMMs per tile (S and dP are recomputed:
7 instead of 5), but dQ is then summed in a fixed order, so every gradient is
bitwise reproducible on every run (`deterministic=True` costs nothing
extra), it needs no dQ accumulator in HBM and no conversion pass, and it
runs in JAX's GPU interpreter without atomics. FA3 itself
pays a similar price for its deterministic mode (ordered semaphores). To be
measured against an atomic variant when a GPU is available.

`delta` and the base-2 lse (`+inf` for rows that see no key, so their P is
exactly 0) are prepared in plain JAX (one fused elementwise pass over O and
dO, memory-bound and small next to the kernels).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_fa3.kernels.sm90.common import pad_axis, round_up
from pallas_fa3.kernels.sm90.config import Sm90BackwardConfig
from pallas_fa3.kernels.sm90.ops import COMPILED, INTERPRETED
from pallas_fa3.kernels.sm90.backward_dkdv import dkdv_kernel, DkdvPlan
from pallas_fa3.kernels.sm90.backward_dq import dq_kernel
from pallas_fa3.spec import LOG2E, AttentionSpec


def sm90_backward(spec: AttentionSpec, config: Sm90BackwardConfig,
                  q, k, v, out, lse, dout, dlse, *, interpret=None):
  """(dq, dk, dv) by the two backward kernels; `dlse` is the lse cotangent.

  `interpret`: None compiles for sm90; interpret-mode parameters run the
  same kernels on a CPU.
  """
  ops = COMPILED if interpret is None else INTERPRETED
  sq_pad = round_up(spec.seq_q, 2 * config.block_q)
  skv_pad = round_up(spec.seq_kv, DkdvPlan(spec, config, 0, 0).kv_rows_per_cta)
  delta = jnp.einsum("bqhd,bqhd->bhq", dout.astype(jnp.float32),
                     out.astype(jnp.float32)) - dlse.astype(jnp.float32)
  # Rows that see no key (lse = -inf) and padded rows: lse2 = +inf, P = 0.
  lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * jnp.float32(LOG2E))
  lse2 = pad_axis(lse2, 2, sq_pad, jnp.inf)
  delta = pad_axis(delta, 2, sq_pad)
  qp, dop = pad_axis(q, 1, sq_pad), pad_axis(dout, 1, sq_pad)
  kp, vp = pad_axis(k, 1, skv_pad), pad_axis(v, 1, skv_pad)
  dkdv_plan = DkdvPlan(spec, config, sq_pad, skv_pad)
  dk, dv = dkdv_kernel(dkdv_plan, ops, interpret)(qp, kp, vp, dop, lse2, delta)
  if interpret is not None:
    # The interpreter runs each kernel's warpgroups as threads that block on
    # each other inside a host callback; two independent kernels running at
    # once on a 2-core CPU stalled the test suite. Make the dQ kernel wait.
    (dk, dv), qp = lax.optimization_barrier(((dk, dv), qp))
  dq = dq_kernel(spec, config, sq_pad, skv_pad, ops, interpret)(
      qp, kp, vp, dop, lse2, delta)
  return (dq[:, :spec.seq_q], dk[:, :spec.seq_kv], dv[:, :spec.seq_kv])
