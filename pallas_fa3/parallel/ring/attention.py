"""Context parallelism: `ring_attention`, with q, k and v sharded along the
sequence over one mesh axis. K/V shards travel around the ring
(`jax.lax.ppermute` inside `jax.shard_map`) while each device attends its
query shard to the visiting block and merges the partial results by
log-sum-exp, the backward runs the ring in reverse (`ring.local`), both
through `pallas_fa3.vjp`, and nothing gathers the sequence; `layout`
(`"natural"` or `"zigzag"`) says which order the caller's tokens are in:
docs/scale_out.md#context-parallelism-ring_attention.

Example (8 devices; on a CPU set
`XLA_FLAGS=--xla_force_host_platform_device_count=8` before importing JAX):

  >>> mesh = jax.make_mesh((8,), ("seq",))                       # doctest: +SKIP
  >>> shard = NamedSharding(mesh, P(None, "seq"))                # doctest: +SKIP
  >>> q, k, v = (jax.device_put(x, shard) for x in (q, k, v))    # doctest: +SKIP
  >>> out = pallas_fa3.ring_attention(q, k, v, mesh=mesh,        # doctest: +SKIP
  ...                                 seq_axis="seq", causal=True)
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh

from pallas_fa3 import modifiers, segments, vjp
from pallas_fa3.backends import Implementation
from pallas_fa3.backends.base import Prefill
from pallas_fa3.parallel import sharding_checks
from pallas_fa3.parallel.ring import checks as ring_checks, plan as ring_plan
from pallas_fa3.parallel.ring.plan import RingPlan

Layout = Literal["natural", "zigzag"]


def ring_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  mesh: Mesh | AbstractMesh,
  seq_axis: str,
  causal: bool = False,
  softmax_scale: float | None = None,
  return_lse: bool = False,
  implementation: Implementation | None = None,
  config: Any = None,
  layout: Layout = "natural",
  batch_axes: str | tuple[str, ...] | None = None,
  head_axes: str | tuple[str, ...] | None = None,
  window_size: Any = None,
  softcap: float | None = None,
  sinks: jax.Array | None = None,
  segment_ids: segments.SegmentIds | tuple | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Context-parallel attention: the sequence sharded over one mesh axis.

  Computes `flash_attention(q, k, v, causal=..., softmax_scale=...,
  window_size=..., softcap=..., sinks=..., segment_ids=...)` (same
  conventions: GQA, bottom-right causal and windows, natural-log lse) with
  q, k and v sharded along the sequence (axis 1) over the mesh axis
  `seq_axis`, without ever gathering the sequence: K/V shards travel around
  the ring (see the module docstrings for the layouts and the algorithm).
  With a window, blocks the window hides do no work and K/V travel only as
  far as the window reaches (`pallas_fa3.parallel.ring.window`). Use it
  inside or outside `jax.jit`. Other mesh axes may shard the batch or the
  heads: name them in `batch_axes` / `head_axes` (the layout is fixed when
  the function is traced, and a split not named there is gathered).

  Args:
    q: `[batch, seq_q, heads_q, head_dim]`, sharded as
      `P(batch_axes, seq_axis, head_axes)`.
    k: `[batch, seq_kv, heads_kv, head_dim]`, sharded the same way.
    v: `[batch, seq_kv, heads_kv, head_dim_v]`, sharded the same way.
    mesh: the `jax.sharding.Mesh` (or `AbstractMesh`) holding `seq_axis`.
    seq_axis: name of the mesh axis of size n that shards the sequence.
      Sequence lengths must be multiples of n, or of 2n where the zig-zag
      chunks are used (causal without a window, or `layout="zigzag"` with
      causal or a window).
    causal: bottom-right causal mask; needs `seq_q == seq_kv`.
    softmax_scale: as in `flash_attention`.
    return_lse: also return the float32 lse `[batch, heads_q, seq_q]`.
    implementation: the backend of every ring step, as in `flash_attention`
      (None: automatic). A backend whose backward does not read the lse
      residual (`reference`) is refused: a ring step hands it the merged
      lse, which it would ignore.
    config: backend config of every ring step (e.g. `BlockwiseConfig`).
    layout: "natural" (tokens in order) or "zigzag" (already permuted with
      `zigzag_order`; only causal calls and windows look at positions).
      Outputs come back in the same layout.
    batch_axes: None, or the mesh axis (or tuple of axes) that shards the
      batch (axis 0) of q, k and v, e.g. "data" on a ("data", "seq") mesh.
    head_axes: None, or the mesh axes that shard the heads (axis 2); they
      must divide heads_kv (whole GQA groups per device). Mesh axes named
      nowhere replicate the work.
    window_size: `(left, right)` as in `flash_attention` (positions are the
      natural token positions, whatever the layout).
    softcap: as in `flash_attention`.
    sinks: float32 `[heads_q]` sink logits as in `flash_attention`
      (differentiable); added once to every row after the ring.
    segment_ids: None, or a `pallas_fa3.SegmentIds(q, kv)` (or a `(q_ids,
      kv_ids)` tuple, or for self-attention one int32 array) of int32
      `[batch, seq_q]` / `[batch, seq_kv]` in the same layout as q and k,
      as in `flash_attention`. The kv ids travel with their K/V shard; a
      ring step (a causal step's block) whose id ranges, min to max, cannot
      meet is skipped (`lax.cond`: no attention work, forward or backward).

  Returns:
    out `[batch, seq_q, heads_q, head_dim_v]` sharded like q, and with
    `return_lse` the lse `[batch, heads_q, seq_q]` sharded
    `P(batch_axes, head_axes, seq_axis)`.

  Raises:
    TypeError / ValueError: bad inputs or mesh; the message names the
      argument.
    NotImplementedError: the implementation cannot serve a ring step.
  """
  spec, sinks, segment_ids, implementation, return_lse, n = (
    ring_checks.check_call(
      q,
      k,
      v,
      mesh,
      seq_axis,
      causal=causal,
      softmax_scale=softmax_scale,
      window_size=window_size,
      softcap=softcap,
      sinks=sinks,
      segment_ids=segment_ids,
      implementation=implementation,
      return_lse=return_lse,
    )
  )
  layout = ring_checks.check_layout(layout)
  ring_checks.check_lengths(
    spec, n, seq_axis, ring_plan.needs_chunks(spec, layout, n)
  )
  batch_axes, head_axes = ring_checks.check_batch_head_axes(
    batch_axes, head_axes, mesh, seq_axis, spec
  )
  plan = ring_plan.make_plan(
    spec, mesh, seq_axis, batch_axes, head_axes, layout, implementation, config
  )
  ring_checks.check_known_layout(plan, q=q, k=k, v=v)
  out, lse = _ring_jit(
    plan,
    jnp.asarray(q),
    jnp.asarray(k),
    jnp.asarray(v),
    None if sinks is None else modifiers.batch_sinks(sinks, spec.batch),
    segment_ids,
  )
  return (out, lse) if return_lse else out


def run_plan(
  plan: RingPlan, q: jax.Array, k: jax.Array, v: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """(out, lse) of a plan made by `ring_plan.make_plan` (no sinks or ids),
  differentiable: for measurements that force the windowed ring's order
  (`benchmarks/ulysses_vs_ring.py`). `ring_attention` is the entry point."""
  return _ring_jit(
    plan, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), None, None
  )


def _ring(
  plan: RingPlan,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  sinks: jax.Array | None,
  segment_ids: Any,
) -> tuple[jax.Array, jax.Array]:
  operands = sharding_checks.vary_alike(Prefill(q, k, v, sinks, segment_ids))
  return vjp.call(plan.call, operands)


# Jitted once per static plan, as flash_attention's entry point: an eager
# call compiles once, and XLA (not shard_map) reshards inputs laid out
# differently under automatic mesh axes.
_ring_jit = jax.jit(_ring, static_argnums=0)
