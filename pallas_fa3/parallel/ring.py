"""Context parallelism: `ring_attention`, the sequence sharded over a mesh axis.

q, k and v are sharded along the sequence over one mesh axis, the ring of
`n` devices. K/V shards travel around the ring (`jax.lax.ppermute` inside
`jax.shard_map`) while each device attends its query shard to the visiting
block with the backend `flash_attention` would use, and merges the partial
results by log-sum-exp; the backward pass runs the ring in reverse through
a custom_vjp. Nothing gathers the full sequence, so memory per device falls
as 1/n. The per-device algorithm and the causal zig-zag load balancing are
described in `pallas_fa3.parallel.ring_steps`.

`layout` says which order the caller's sequence is in:

  * `"natural"` (default): tokens in their natural order, device `i` holding
    the i-th contiguous slice (`NamedSharding(mesh, P(None, seq_axis))`).
    For causal attention the shards are permuted to the zig-zag layout
    inside (two `ppermute`s of half a shard per tensor, in and out) and the
    outputs come back in natural order.
  * `"zigzag"`: the caller already holds the sequence in zig-zag order,
    `x[:, zigzag_order(seq, n)]` (e.g. permuted once at the model's input,
    position ids included), so nothing is permuted and the outputs stay in
    that order. This saves every layer the permutation traffic.

Example (8 devices; on a CPU set
`XLA_FLAGS=--xla_force_host_platform_device_count=8` before importing JAX):

  >>> mesh = jax.make_mesh((8,), ("seq",))                       # doctest: +SKIP
  >>> shard = NamedSharding(mesh, P(None, "seq"))                # doctest: +SKIP
  >>> q, k, v = (jax.device_put(x, shard) for x in (q, k, v))    # doctest: +SKIP
  >>> out = pallas_fa3.ring_attention(q, k, v, mesh=mesh,        # doctest: +SKIP
  ...                                 seq_axis="seq", causal=True)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from pallas_fa3 import backends, modifiers
from pallas_fa3.parallel import ring_steps, sharding_checks
from pallas_fa3.parallel.ring_steps import RingPlan
from pallas_fa3.spec import AttentionSpec, check_arrays, check_bool, make_spec
from pallas_fa3.vjp import StaticCall

Layout = Literal["natural", "zigzag"]
LAYOUTS: tuple[str, ...] = ("natural", "zigzag")


# ---------------------------------------------------------------------------
# Validation.


def _check_mesh(mesh: Any, seq_axis: Any) -> int:
  if not isinstance(mesh, (Mesh, AbstractMesh)):
    raise TypeError(
      f"mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh((8,),"
      f" ('seq',))); got {type(mesh).__name__}"
    )
  if seq_axis not in mesh.axis_names:
    raise ValueError(
      f"seq_axis={seq_axis!r} is not an axis of the mesh; its axes are"
      f" {tuple(mesh.axis_names)}"
    )
  return int(dict(mesh.shape)[seq_axis])


def _check_axes(
  name: str,
  axes: Any,
  mesh: Mesh | AbstractMesh,
  taken: tuple[str, ...],
  dim: int,
  what: str,
) -> tuple[str, ...]:
  """Validates `batch_axes`/`head_axes`: mesh axes, unused, dividing `dim`."""
  if axes is None:
    return ()
  axes = (axes,) if isinstance(axes, str) else axes
  if not (
    isinstance(axes, (tuple, list)) and all(isinstance(a, str) for a in axes)
  ):
    raise TypeError(
      f"{name} must be None, a mesh axis name or a tuple of them; got {axes!r}"
    )
  axes = tuple(axes)
  for axis in axes:
    if axis not in mesh.axis_names:
      raise ValueError(
        f"{name}={axes!r}: {axis!r} is not an axis of the mesh; its axes"
        f" are {tuple(mesh.axis_names)}"
      )
    if axis in taken or axes.count(axis) > 1:
      raise ValueError(
        f"{name}={axes!r}: mesh axis {axis!r} is used twice (seq_axis and"
        f" the batch/head axes must be distinct)"
      )
  ways = math.prod(dict(mesh.shape)[a] for a in axes)
  if dim % ways:
    raise ValueError(
      f"{name}={axes!r} splits {what} {ways} ways, but {what} is {dim}"
    )
  return axes


def _check_known_layout(plan: RingPlan, **arrays: Any) -> None:
  """Refuses a batch/head split (known at trace time) that `plan` would gather."""
  declared = {
    0: ("batch_axes", plan.batch_axes),
    2: ("head_axes", plan.head_axes),
  }
  for name, x in arrays.items():
    sharding = sharding_checks.known_sharding(x)
    if sharding is None:
      continue
    entries = sharding_checks.spec_entries(sharding)
    for axis, (arg, axes) in declared.items():
      split = sharding_checks.mesh_axes(entries[axis])
      if split and split != axes:
        raise ValueError(
          f"{name} is sharded along {'batch' if axis == 0 else 'heads'}"
          f" over mesh axes {split}, but {arg}={axes or None}: pass"
          f" {arg}={split!r} (otherwise every device would gather it)"
        )
    if sharding_checks.mesh_axes(entries[3]):
      raise ValueError(
        f"{name} is sharded along head_dim (axis 3) over mesh axes"
        f" {sharding_checks.mesh_axes(entries[3])}; ring_attention splits"
        " batch, sequence and heads only"
      )


def _check_lengths(
  spec: AttentionSpec, n: int, seq_axis: str, causal: bool
) -> None:
  multiple, why = (
    (2 * n, "zig-zag chunks: 2 per device")
    if causal
    else (n, "one shard per device")
  )
  for name, length in (("q", spec.seq_q), ("k", spec.seq_kv)):
    if length % multiple:
      raise ValueError(
        f"{name} has sequence length {length}, not a multiple of {multiple}"
        f" ({why} over mesh axis {seq_axis!r} of size {n})"
      )
  if causal and spec.seq_q != spec.seq_kv:
    raise ValueError(
      f"causal ring attention needs q and k of the same sequence length;"
      f" got q: {spec.seq_q}, k: {spec.seq_kv}"
    )


def _check_layout(layout: Any) -> str:
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
  return layout


def _step_call(
  spec: AttentionSpec,
  seq_q: int,
  seq_kv: int,
  causal: bool,
  implementation: str | None,
  config: Any,
) -> StaticCall:
  """The backend call of one ring step, resolved as flash_attention would."""
  step = dataclasses.replace(spec, seq_q=seq_q, seq_kv=seq_kv, causal=causal)
  backend, config = backends.resolve(step, implementation, config)
  if not backend.backward_uses_lse:
    raise NotImplementedError(
      f"implementation={backend.name!r} cannot run ring attention: its"
      " backward differentiates each block's own softmax and ignores the"
      " merged lse every ring step passes; use 'blockwise' (or None)"
    )
  return StaticCall(step, backend, config)


def _step_calls(
  spec: AttentionSpec,
  mesh: Mesh | AbstractMesh,
  n: int,
  batch_axes: tuple[str, ...],
  head_axes: tuple[str, ...],
  implementation: str | None,
  config: Any,
) -> tuple[StaticCall, ...]:
  """The per-device calls: causal (own block, c x c block), else (block,)."""
  ways = lambda axes: math.prod(dict(mesh.shape)[a] for a in axes)
  nh = ways(head_axes)
  local = dataclasses.replace(
    spec,
    batch=spec.batch // ways(batch_axes),
    heads_q=spec.heads_q // nh,
    heads_kv=spec.heads_kv // nh,
  )
  if spec.causal:
    c = spec.seq_q // (2 * n)
    return (
      _step_call(local, 2 * c, 2 * c, True, implementation, config),
      _step_call(local, c, c, False, implementation, config),
    )
  return (
    _step_call(
      local, spec.seq_q // n, spec.seq_kv // n, False, implementation, config
    ),
  )


# ---------------------------------------------------------------------------
# custom_vjp over shard_map.


def _shard_map(
  plan: RingPlan, body: Callable[..., Any], in_specs: tuple, out_specs: Any
) -> Callable[..., Any]:
  # Every mesh axis is manual: the body sees one device's batch/head/sequence
  # shard, and each step's backend call runs on it as is. (An axis left
  # automatic would not do: XLA does not partition a custom_partitioning op
  # inside a partially manual shard_map, it gathers its operands instead.)
  return jax.shard_map(
    body,
    mesh=plan.mesh,
    in_specs=in_specs,
    out_specs=out_specs,
    check_vma=False,
  )


def _permute(
  plan: RingPlan, to_internal: bool, *xs: jax.Array
) -> tuple[jax.Array, ...]:
  """Natural <-> zig-zag for the local shards (seq axis 1, or 2 for lse)."""
  if not plan.reorder:
    return xs
  fn = ring_steps.to_zigzag if to_internal else ring_steps.from_zigzag
  return tuple(
    fn(x, 2 if x.ndim == 3 else 1, plan.seq_axis, plan.ring_size) for x in xs
  )


def _forward_global(
  plan: RingPlan, q: jax.Array, k: jax.Array, v: jax.Array
) -> tuple[jax.Array, jax.Array]:
  def body(q, k, v):
    q, k, v = _permute(plan, True, q, k, v)
    out, lse = ring_steps.ring_forward(plan, q, k, v)
    return _permute(plan, False, out.astype(plan.spec.dtype), lse)

  seq, lse = plan.seq_spec(), plan.lse_spec()
  args = [
    sharding_checks.fit_explicit(x, NamedSharding(plan.mesh, seq))
    for x in (q, k, v)
  ]
  return _shard_map(plan, body, (seq, seq, seq), (seq, lse))(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(
  plan: RingPlan, q: jax.Array, k: jax.Array, v: jax.Array
) -> tuple[jax.Array, jax.Array]:
  return _forward_global(plan, q, k, v)


def _ring_fwd(
  plan: RingPlan, q: jax.Array, k: jax.Array, v: jax.Array
) -> tuple[tuple[jax.Array, jax.Array], tuple]:
  out, lse = _forward_global(plan, q, k, v)
  # Residuals in the caller's layout (the primal inputs and outputs, no
  # copies); a natural-layout causal backward permutes them again.
  return (out, lse), (q, k, v, out, lse)


def _ring_bwd(
  plan: RingPlan, residuals: tuple, cotangents: tuple
) -> tuple[jax.Array, jax.Array, jax.Array]:
  dout, dlse = cotangents

  def body(q, k, v, out, lse, dout, dlse):
    args = _permute(plan, True, q, k, v, out, lse, dout, dlse)
    grads = ring_steps.ring_backward(plan, *args)
    grads = tuple(g.astype(plan.spec.dtype) for g in grads)
    return _permute(plan, False, *grads)

  seq, lse = plan.seq_spec(), plan.lse_spec()
  specs = (seq,) * 3 + (seq, lse, seq, lse)
  args = [
    sharding_checks.fit_explicit(x, NamedSharding(plan.mesh, spec))
    for x, spec in zip((*residuals, dout, dlse), specs)
  ]
  return _shard_map(plan, body, specs, (seq,) * 3)(*args)


_ring.defvjp(_ring_fwd, _ring_bwd)
# Jitted once per static plan, as flash_attention's entry point: an eager
# call compiles once, and XLA (not shard_map) reshards inputs laid out
# differently under automatic mesh axes.
_ring_jit = jax.jit(_ring, static_argnums=0)


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
  implementation: str | None = None,
  config: Any = None,
  layout: Layout = "natural",
  batch_axes: str | tuple[str, ...] | None = None,
  head_axes: str | tuple[str, ...] | None = None,
  window_size: Any = None,
  softcap: float | None = None,
  sinks: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Context-parallel attention: the sequence sharded over one mesh axis.

  Computes `flash_attention(q, k, v, causal=..., softmax_scale=...)` (same
  conventions: GQA, bottom-right causal, natural-log lse) with q, k and v
  sharded along the sequence (axis 1) over the mesh axis `seq_axis`, without
  ever gathering the sequence: K/V shards travel around the ring (see the
  module docstrings for the layouts and the algorithm). Use it
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
      Sequence lengths must be multiples of n (non-causal) or 2n (causal).
    causal: bottom-right causal mask; needs `seq_q == seq_kv`.
    softmax_scale: as in `flash_attention`.
    return_lse: also return the float32 lse `[batch, heads_q, seq_q]`.
    implementation: the backend of every ring step, as in `flash_attention`
      (None: automatic). A backend whose backward does not read the lse
      residual (`reference`) is refused: a ring step hands it the merged
      lse, which it would ignore.
    config: backend config of every ring step (e.g. `BlockwiseConfig`).
    layout: "natural" (tokens in order) or "zigzag" (already permuted with
      `zigzag_order`; causal only changes anything). Outputs come back in the
      same layout.
    batch_axes: None, or the mesh axis (or tuple of axes) that shards the
      batch (axis 0) of q, k and v, e.g. "data" on a ("data", "seq") mesh.
    head_axes: None, or the mesh axes that shard the heads (axis 2); they
      must divide heads_kv (whole GQA groups per device). Mesh axes named
      nowhere replicate the work.
    window_size, softcap, sinks: not implemented here (NotImplementedError
      when set; `flash_attention` has them).

  Returns:
    out `[batch, seq_q, heads_q, head_dim_v]` sharded like q, and with
    `return_lse` the lse `[batch, heads_q, seq_q]` sharded
    `P(batch_axes, head_axes, seq_axis)`.

  Raises:
    TypeError / ValueError: bad inputs or mesh; the message names the
      argument.
    NotImplementedError: the implementation cannot serve a ring step.
  """
  check_arrays(q=q, k=k, v=v)
  spec = make_spec(q, k, v, causal=causal, softmax_scale=softmax_scale)
  modifiers.refuse(
    "ring_attention", window_size=window_size, softcap=softcap, sinks=sinks
  )
  implementation = backends.check_implementation(implementation)
  return_lse = check_bool("return_lse", return_lse)
  n = _check_mesh(mesh, seq_axis)
  _check_lengths(spec, n, seq_axis, spec.causal)
  layout = _check_layout(layout)
  batch_axes = _check_axes(
    "batch_axes", batch_axes, mesh, (seq_axis,), spec.batch, "the batch"
  )
  head_axes = _check_axes(
    "head_axes",
    head_axes,
    mesh,
    (seq_axis,) + batch_axes,
    spec.heads_kv,
    "heads_kv (whole GQA groups per device)",
  )
  plan = RingPlan(
    spec,
    mesh,
    seq_axis,
    batch_axes,
    head_axes,
    spec.causal and layout == "natural",
    _step_calls(spec, mesh, n, batch_axes, head_axes, implementation, config),
  )
  _check_known_layout(plan, q=q, k=k, v=v)
  out, lse = _ring_jit(plan, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
  return (out, lse) if return_lse else out
