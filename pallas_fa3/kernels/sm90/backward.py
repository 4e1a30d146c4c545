"""FlashAttention-3 backward for Hopper (sm90): gradients by recomputation
from the residuals (out, lse), parallel over K/V tiles and kv heads, either
one fused kernel with FA3's five GEMMs per tile pair and dQ TMA
reduce-added in float32 (`deterministic=False`, the default;
`backward_dkdv.fused_consumer`) or the dK/dV kernel plus the dQ kernel
(`backward_dq`), seven GEMMs and bitwise reproducible (`deterministic=True`
and configs the fused kernel cannot run); this module prepares `delta`
and the base-2 lse in plain JAX, picks the form and converts dQ.
More: docs/design_notes.md#backward-kernels.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pallas_fa3.kernels.sm90 import flex_tile
from pallas_fa3.kernels.sm90.backward_dkdv import (
  DkdvPlan,
  dkdv_kernel,
  sum_slab,
)
from pallas_fa3.kernels.sm90.backward_dq import (
  dq_kernel,
  dq_query_plan,
  param_count,
)
from pallas_fa3.kernels.sm90.common import (
  pad_axis,
  query_tile_spans,
  round_up,
  tma_extent,
)
from pallas_fa3.kernels.sm90.config import Sm90BackwardConfig
from pallas_fa3.kernels.sm90.config_backward import (
  fused_backward,
  fused_flex_unsupported,
)
from pallas_fa3.kernels.sm90.ops import COMPILED, INTERPRETED
from pallas_fa3.lse import log2_of
from pallas_fa3.spec import AttentionSpec


def sm90_backward(
  spec: AttentionSpec,
  config: Sm90BackwardConfig,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  out: jax.Array,
  lse: jax.Array,
  dout: jax.Array,
  dlse: jax.Array,
  *,
  interpret: Any = None,
  segment_ids: Any = None,
  flex: Any = None,
  fused: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Runs the fused kernel, or with `spec.deterministic` the dK/dV and dQ
  kernels (`fused`: the call's `config_backward.BackwardPlan` says which;
  None: `config_backward.fused_backward` here).

  Args:
    spec: the call (as the forward's).
    config: the tiling of both kernels.
    q, k, v: the forward's inputs, `[b, s, h, d]`.
    out: the forward's output `[b, sq, hq, d]`.
    lse: the forward's float32 natural-log lse `[b, hq, sq]`.
    dout: the output cotangent, like `out`.
    dlse: the lse cotangent, like `lse`.
    interpret: None compiles for sm90; interpret-mode parameters run the
      same kernels on a CPU.
    segment_ids: with `spec.segmented`, `(lo, hi, q_lo, q_hi)`: each query
      row's key bounds (`segments.key_bounds`) and each key's query bounds
      (`segments.query_bounds`), exact for contiguous ids. Every kernel
      walks only the tiles that can meet and masks by the bounds.
    flex: `spec.flex`'s operands (what `flex_tile.backward_unsupported`
      allows), with `spec.deterministic`: both kernels recompute P with
      them and skip a block mask's empty tiles; the dQ kernel writes dS
      (dbias).

  Returns:
    (dq, dk, dv), shaped like q, k, v, in `spec.dtype`; with flex options
    also `(dbias or None, per score_mod array its gradient or None)`,
    each shaped like its operand and in its dtype.
  """
  args = (q, k, v, out, lse, dout, dlse)
  args += () if segment_ids is None else tuple(segment_ids)
  if fused is None:
    fused = fused_backward(spec, config)
  if spec.flex is not None:
    if fused:  # mask_mod, block masks, a score_mod without floating arrays
      reason = fused_flex_unsupported(spec, config)
      assert reason is None, f"the fused kernel takes no {reason}"
    if fused and interpret is None:
      return _fused_compiled(spec, config, *args, flex=flex)
    return _kernels(
      spec, config, *args, interpret=interpret, flex=flex, fused=fused
    )
  if fused and interpret is None:
    return _fused_compiled(spec, config, *args)
  return _kernels(spec, config, *args, interpret=interpret, fused=fused)


def _kernels(
  spec: AttentionSpec,
  config: Sm90BackwardConfig,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  out: jax.Array,
  lse: jax.Array,
  dout: jax.Array,
  dlse: jax.Array,
  *bounds: jax.Array,
  interpret: Any,
  flex: Any = None,
  fused: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The kernels (`fused`: the fused one or the pair, as `sm90_backward`
  was told); `bounds`: with segment ids, (lo, hi, q_lo, q_hi)."""
  if fused is None:
    fused = fused_backward(spec, config)
  if interpret is not None:  # the bounds are ready before any kernel starts
    (q, k, v, out, lse, dout, dlse), bounds = _after(
      bounds, (q, k, v, out, lse, dout, dlse)
    )[::-1]
  rows_ids = None
  if bounds:  # the dQ kernel masks by query rows' key bounds
    rows_ids = bounds[:2]
  ops = COMPILED if interpret is None else INTERPRETED
  sq_pad = round_up(spec.seq_q, 2 * config.block_q)
  skv_pad = round_up(spec.seq_kv, DkdvPlan(spec, config, 0, 0).kv_rows_per_cta)
  delta = jnp.einsum(
    "bqhd,bqhd->bhq", dout.astype(jnp.float32), out.astype(jnp.float32)
  ) - dlse.astype(jnp.float32)
  # Rows that see no key (lse = -inf) and padded rows: lse2 = +inf, P = 0.
  lse2 = jnp.where(lse == -jnp.inf, jnp.inf, log2_of(lse))
  lse2 = pad_axis(lse2, 2, sq_pad, jnp.inf)
  delta = pad_axis(delta, 2, sq_pad)
  # Ragged edges by TMA, as in the forward: Q, dO, K and V unpadded unless
  # shorter than a tile or not a multiple of 8; dQ, dK, dV rows past the end
  # are dropped by their (swizzled, tensor-map) stores. lse2 and delta are
  # padded: their tiles are plain bulk copies, and padded rows need lse2 =
  # +inf.
  qp, dop = (
    tma_extent(q, 1, config.block_q),
    tma_extent(dout, 1, config.block_q),
  )
  kp, vp = tma_extent(k, 1, config.block_kv), tma_extent(v, 1, config.block_kv)
  dkdv_plan = DkdvPlan(spec, config, sq_pad, skv_pad, fused=fused)
  fx = {}
  if spec.flex is not None:  # mask_mod's arrays, a block mask's states
    by_spans = dkdv_plan.walks_block_mask_spans
    fx = flex_tile.kernel_operands(  # and query tile spans
      spec, flex, q_pad=sq_pad, kv_pad=skv_pad,
      kv_rows_per_cta=dkdv_plan.kv_rows_per_cta if by_spans else None,
      block_q=config.block_q,
      grad="params" if flex_tile.kernel_params(spec, "dkdv") else True,
      tile_rows=config.block_q if dkdv_plan.shared else config.block_kv,
      keys_as_rows=not dkdv_plan.shared,  # (as the bias below)
    )  # fmt: skip
    if "bias" in fx and not dkdv_plan.shared:  # keys as the tiles' rows:
      # the bias transposed (the shared-tile consumers' rows are queries)
      fx = {
        ("bias_t" if n == "bias" else n): (
          jnp.swapaxes(x, 2, 3) if n == "bias" else x
        )
        for n, x in fx.items()
      }
  kernel = functools.partial(
    dkdv_kernel(dkdv_plan, ops, interpret, kp.shape[1], tuple(fx)),
    segment_ids=bounds or None,
    flex=tuple(fx.values()),
  )
  if fused:
    scale = jnp.float32(spec.softmax_scale)
    if interpret is None:
      acc = jax.new_ref(jnp.zeros(qp.shape, jnp.float32))
      dk, dv = kernel(qp, kp, vp, dop, lse2, delta, acc)
      dq = jax.freeze(acc) * scale
    else:
      slab, dk, dv = kernel(qp, kp, vp, dop, lse2, delta)
      # Interpreted, nothing runs beside a kernel (`_after`).
      slab, bounds = _after(slab, bounds)
      spans = None
      if bounds:  # the query tiles each CTA walked
        spans = jnp.stack(query_tile_spans(dkdv_plan, *bounds[2:]))
      elif "bm_qspans" in fx:  # a block mask's, per KV head
        spans = fx["bm_qspans"]
      dq = sum_slab(dkdv_plan, slab, spans) * scale
    dq = dq.astype(spec.dtype)
    grads = (dq[:, : spec.seq_q], dk[:, : spec.seq_kv], dv[:, : spec.seq_kv])
    if spec.flex is None:
      return grads
    return grads + ((None, (None,) * len(flex.score_consts)),)

  dk, dv, *dkdv_sums = kernel(qp, kp, vp, dop, lse2, delta)
  if interpret is not None:
    # Interpret mode: the dQ kernel, and its operands' preparation, wait
    # for the dK/dV kernel (`_after`;
    # docs/design_notes.md#interpret-mode-and-memory-proxies).
    (dk, dv), (qp, kp, vp, dop, lse2, delta, rows_ids) = _after(
      (dk, dv), (qp, kp, vp, dop, lse2, delta, rows_ids)
    )
  dq_fx = {}
  if spec.flex is not None:  # its K/V walk skips empty tiles too
    dq_plan = dq_query_plan(spec, config, sq_pad, skv_pad)
    dq_fx = flex_tile.kernel_operands(
      spec, flex, q_pad=sq_pad, kv_pad=skv_pad,
      rows_per_cta=dq_plan.rows_per_cta, block_kv=dq_plan.config.block_kv,
      grad="params" if param_count(spec) else True,
      tile_rows=dq_plan.config.block_q,
    )  # fmt: skip
  ds_dtype, sum_axes = jnp.float32, ()
  fs = spec.flex
  if fs is not None and fs.bias is not None and fs.bias_grad:
    sum_axes = dbias_sum_axes(spec)
    if not sum_axes:  # dS is dbias: written in the bias's dtype
      ds_dtype = flex.bias.dtype
  dq = dq_kernel(
    spec,
    config,
    sq_pad,
    skv_pad,
    ops,
    interpret,
    qp.shape[1],
    tuple(dq_fx),
    ds_dtype,
  )(
    qp,
    kp,
    vp,
    dop,
    lse2,
    delta,
    segment_ids=rows_ids,
    flex=tuple(dq_fx.values()),
  )
  dq, *rest = dq  # (dq, [dS], [the floating arrays' row sums])
  grads = (dq[:, : spec.seq_q], dk[:, : spec.seq_kv], dv[:, : spec.seq_kv])
  if spec.flex is None:
    return grads
  dbias = None
  if spec.flex.bias is not None and spec.flex.bias_grad:  # dS per query
    ds = rest.pop(0)[:, :, : spec.seq_q, : spec.seq_kv]  # head: summed
    if sum_axes:  # (float32) over the bias's broadcast axes
      ds = ds.sum(sum_axes, keepdims=True)
    dbias = ds.astype(flex.bias.dtype)
  dscore = [None] * len(flex.score_consts)
  fn = spec.flex.score_mod
  if rest or dkdv_sums:  # per row sums of each floating array's derivative
    axes = flex_tile.param_grad_axes(fn, spec.seq_q, spec.seq_kv)
    floats = flex_tile.float_positions(fn)
    for kernel_name, out, n in (
      ("dq", rest, spec.seq_q),
      ("dkdv", dkdv_sums, spec.seq_kv),
    ):
      first = (0, 0)  # a shard's first batch and head (`shifted`)
      if fn.shift is not None:
        first = tuple(
          c if on else 0 for c, on in zip(flex.score_consts[-2:], fn.shift)
        )
      for r, j in enumerate(flex_tile.kernel_params(spec, kernel_name)):
        i = floats[j]
        rows = out[0].sum(0)[r, ..., :n]  # over the parts: [b, hq, rows]
        dscore[i] = _attributed(rows, axes[j], flex.score_consts[i], first)
  return grads + ((dbias, tuple(dscore)),)


def dbias_sum_axes(spec: AttentionSpec) -> tuple[int, ...]:
  """The axes (batch 0, query head 1) over which dS is summed into dbias:
  those the bias broadcasts over where the call has more than one."""
  nb, nh = spec.flex.bias
  return tuple(
    a for a, n, m in ((0, nb, spec.batch), (1, nh, spec.heads_q)) if n == 1 < m
  )


def _attributed(
  rows: jax.Array, axes: tuple, array: jax.Array, first: tuple = (0, 0)
) -> jax.Array:
  """`array`'s gradient from per (batch, query head, kernel row) sums
  `[b, hq, n]` of the derivative in the one element that row reads, at
  `array[axes]` (`flex_tile.param_grad_axes`: "b", "h" clipped to the
  array as the kernels read them, or the row's position plus an offset;
  without a position the rows are summed first). `first`: a shard's
  first batch and head index (its functions read global ones)."""
  if not any(a not in ("b", "h") for a in axes):
    rows = rows.sum(-1, keepdims=True)
  if not axes:
    return rows.sum().astype(array.dtype)
  grid = lambda k: lax.broadcasted_iota(jnp.int32, rows.shape, k)
  index = []
  for dim, a in enumerate(axes):
    if a in ("b", "h"):
      k = "bh".index(a)
      at = grid(k) + jnp.asarray(first[k], jnp.int32)
      index.append(jnp.clip(at, 0, array.shape[dim] - 1))
    else:  # (q | kv, offset): inside the array (`flex_tile.plan`)
      index.append(grid(2) + a[1])
  out = jnp.zeros(array.shape, jnp.float32).at[tuple(index)].add(rows)
  return out.astype(array.dtype)


def _after(done: Any, rest: Any) -> tuple[Any, Any]:
  """`rest`, made to wait for `done` (an optimization barrier). Interpret
  mode runs a kernel in host threads that block XLA's CPU threads while
  they wait at barriers; other work scheduled beside it can starve them
  (a hang on a 2-core CPU), so what follows a kernel waits for it."""
  return lax.optimization_barrier((done, rest))


def _fused_compiled(
  spec: AttentionSpec, config: Sm90BackwardConfig, *args, flex: Any = None
):
  """The compiled fused backward with a vmap rule: its kernel updates a
  `jax.new_ref` in place, which has none, so a vmapped axis is folded into
  the batch; with flex operands (whose functions see the batch index) the
  vmapped calls run one after another instead."""
  leaves, tree = jax.tree.flatten(flex)
  n = len(args)

  @jax.custom_batching.custom_vmap
  def run(*args):
    flex = jax.tree.unflatten(tree, args[n:])
    return _kernels(
      spec, config, *args[:n], interpret=None, flex=flex, fused=True
    )

  @run.def_vmap
  def _rule(axis_size, in_batched, *args):
    args = [
      a if batched else jnp.broadcast_to(a, (axis_size,) + a.shape)
      for a, batched in zip(args, in_batched)
    ]
    if flex is not None:  # one call per vmapped element
      outs = lax.map(lambda xs: run(*xs), tuple(args))
      return outs, jax.tree.map(lambda _: True, outs)
    flat = [a.reshape((axis_size * a.shape[1],) + a.shape[2:]) for a in args]
    wide = dataclasses.replace(spec, batch=axis_size * spec.batch)
    outs = _fused_compiled(wide, config, *flat)
    outs = [o.reshape((axis_size, spec.batch) + o.shape[1:]) for o in outs]
    return tuple(outs), (True, True, True)

  return run(*args, *leaves)
