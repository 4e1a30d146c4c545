"""Context parallelism by all-to-all (DeepSpeed-Ulysses): `ulysses_attention`
trades the sequence split of q, k and v for a head split (one all-to-all
per tensor), runs `flash_attention` on whole sequences of `heads_q / n`
heads with any backend and every option, in up to `PIPELINE_CHUNKS` chunks
so that one chunk's all-to-alls overlap another's attention (kv heads
repeated where GQA groups would straddle devices), and trades out and the
lse back: docs/scale_out.md#context-parallelism-ulysses_attention.

Example (8 devices; on a CPU set
`XLA_FLAGS=--xla_force_host_platform_device_count=8` before importing JAX):

  >>> mesh = jax.make_mesh((8,), ("seq",))                       # doctest: +SKIP
  >>> shard = NamedSharding(mesh, P(None, "seq"))                # doctest: +SKIP
  >>> q, k, v = (jax.device_put(x, shard) for x in (q, k, v))    # doctest: +SKIP
  >>> out = pallas_fa3.ulysses_attention(q, k, v, mesh=mesh,     # doctest: +SKIP
  ...                                    seq_axis="seq", causal=True)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

from pallas_fa3 import segments
from pallas_fa3.attention import flash_attention
from pallas_fa3.backends import Implementation
from pallas_fa3.parallel import sharding_checks
from pallas_fa3.parallel.ring import checks as ring_checks
from pallas_fa3.spec import AttentionSpec

# Head chunks a device's attention is cut into, so that all-to-alls overlap
# attention: chunk t computes while chunk t+1's inputs and chunk t-1's
# output travel; only the first chunk's inputs and the last one's output
# are exposed (2 / PIPELINE_CHUNKS of the traffic). More chunks add
# per-call overhead for little more overlap.
PIPELINE_CHUNKS = 4


@dataclasses.dataclass(frozen=True)
class UlyssesPlan:
  """The static half of a call (hashable: a jit static argument).

  Attributes:
    spec: the global call (sinks and ids as flags).
    mesh, seq_axis, batch_axes, head_axes: the layout.
    kv_repeat: times every kv head is repeated before the all-to-all.
    implementation, config: flash_attention's, for the per-device call.
  """

  spec: AttentionSpec
  mesh: Any
  seq_axis: str
  batch_axes: tuple[str, ...]
  head_axes: tuple[str, ...]
  kv_repeat: int
  implementation: str | None
  config: Any

  def seq_spec(self) -> P:
    b, h = (sharding_checks.axes_entry(a) for a in self.axes())
    return P(b, self.seq_axis, h)

  def lse_spec(self) -> P:
    b, h = (sharding_checks.axes_entry(a) for a in self.axes())
    return P(b, h, self.seq_axis)

  def ids_spec(self) -> P:
    return P(sharding_checks.axes_entry(self.batch_axes), self.seq_axis)

  def sinks_spec(self) -> P:
    """`[heads_q]`: after the head split, each device's query heads."""
    return P(self.head_axes + (self.seq_axis,))

  def axes(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return self.batch_axes, self.head_axes


def kv_repeat(heads_q: int, heads_kv: int, n: int) -> int:
  """How often to repeat each kv head so that `n` devices each get whole
  GQA groups (see the module docstring)."""
  group = heads_q // heads_kv
  return next(
    r for r in range(1, group + 1) if group % r == 0 and heads_kv * r % n == 0
  )


def _check_heads(spec: AttentionSpec, nh: int, n: int, seq_axis: str) -> int:
  """The kv repetition; raises naming heads_q if they cannot split n ways."""
  heads_q = spec.heads_q // nh
  if heads_q % n:
    local = f" ({heads_q} per head_axes shard)" if nh > 1 else ""
    raise ValueError(
      f"ulysses_attention splits the query heads over mesh axis"
      f" {seq_axis!r} of size {n}, but q has heads_q={spec.heads_q}{local},"
      f" not a multiple of {n}; use ring_attention, or a smaller axis"
    )
  return kv_repeat(heads_q, spec.heads_kv // nh, n)


def _to_heads(x: jax.Array, axis: str) -> jax.Array:
  """[b, s/n, h, d] -> [b, s, h/n, d]."""
  return jax.lax.all_to_all(x, axis, 2, 1, tiled=True)


def _to_seq(x: jax.Array, axis: str, seq_dim: int, head_dim: int) -> jax.Array:
  """The inverse trade: heads gathered, sequence split."""
  return jax.lax.all_to_all(x, axis, seq_dim, head_dim, tiled=True)


def head_chunks(heads_q: int, heads_kv: int) -> int:
  """Chunks of a device's heads (after the all-to-all) that the call is cut
  into: at most `PIPELINE_CHUNKS`, dividing its kv heads (whole groups) when
  it has more than one, else its query heads (K/V then go whole)."""
  base = heads_kv if heads_kv > 1 else heads_q
  return max(c for c in range(1, PIPELINE_CHUNKS + 1) if base % c == 0)


def _chunk(x: jax.Array, n: int, chunks: int, t: int) -> jax.Array:
  """Chunk t of every device's head block: `[b, s, h, d] -> [b, s, h/c, d]`
  with heads `j h/n + t h/(n c) + i` (j: the device the all-to-all sends
  them to)."""
  b, s, h, d = x.shape
  per = h // (n * chunks)
  return x.reshape(b, s, n, chunks, per, d)[:, :, :, t].reshape(b, s, -1, d)


def repeat_heads(x: jax.Array, r: int) -> jax.Array:
  """`x` `[b, s, h, d]` with every head repeated `r` times (axis 2). The
  repeat runs in float32 (exact: a copy), so that its transpose sums the
  `r` copies' cotangents in float32, rounded once to x's dtype."""
  return jnp.repeat(x.astype(jnp.float32), r, axis=2).astype(x.dtype)


def _unchunk(parts: list[jax.Array], n: int, axis: int) -> jax.Array:
  """Inverse of `_chunk` on the head axis `axis` of the traded-back parts."""
  shape = parts[0].shape
  split = shape[:axis] + (n, shape[axis] // n) + shape[axis + 1 :]
  stacked = jnp.stack([p.reshape(split) for p in parts], axis=axis + 1)
  return stacked.reshape(shape[:axis] + (-1,) + shape[axis + 1 :])


def _body(plan: UlyssesPlan, q, k, v, *rest) -> tuple[jax.Array, jax.Array]:
  spec, axis = plan.spec, plan.seq_axis
  n = int(dict(plan.mesh.shape)[axis])
  rest = list(rest)
  sinks = rest.pop(0) if spec.sinks else None
  ids = None
  if spec.segmented:  # [b, s/n] int32 -> whole sequence (small)
    ids = tuple(jax.lax.all_gather(x, axis, axis=1, tiled=True) for x in rest)
  if plan.kv_repeat > 1:
    k, v = (repeat_heads(x, plan.kv_repeat) for x in (k, v))
  heads_kv = k.shape[2] // n
  chunks = head_chunks(q.shape[2] // n, heads_kv)
  if heads_kv == 1:  # K/V whole: every chunk's query heads share them
    k, v = _to_heads(k, axis), _to_heads(v, axis)
  outs, lses = [], []
  # One call per head chunk: XLA runs chunk t's attention while chunk t+1's
  # inputs and chunk t-1's outputs are in flight (async all-to-alls on GPUs).
  for t in range(chunks):
    kv = (k, v)
    if heads_kv > 1:
      kv = tuple(_to_heads(_chunk(x, n, chunks, t), axis) for x in (k, v))
    per = None if sinks is None else sinks.shape[0] // chunks
    out, lse = flash_attention(
      _to_heads(_chunk(q, n, chunks, t), axis),
      *kv,
      causal=spec.causal,
      softmax_scale=spec.softmax_scale,
      window_size=spec.window_size,
      softcap=spec.softcap,
      sinks=None if sinks is None else sinks[t * per : (t + 1) * per],
      segment_ids=ids,
      return_lse=True,
      implementation=plan.implementation,
      config=plan.config,
      deterministic=spec.deterministic,
    )
    outs.append(_to_seq(out, axis, 1, 2))
    lses.append(_to_seq(lse, axis, 2, 1))
  return _unchunk(outs, n, 2), _unchunk(lses, n, 1)


@functools.partial(jax.jit, static_argnums=0)
def _ulysses(plan: UlyssesPlan, q, k, v, sinks, ids) -> tuple:
  seq = plan.seq_spec()
  args, specs = [q, k, v], [seq, seq, seq]
  if sinks is not None:
    args.append(sinks)
    specs.append(plan.sinks_spec())
  for x in ids:
    args.append(x)
    specs.append(plan.ids_spec())
  args = [
    sharding_checks.fit_explicit(x, NamedSharding(plan.mesh, s))
    for x, s in zip(args, specs)
  ]
  return jax.shard_map(
    functools.partial(_body, plan),
    mesh=plan.mesh,
    in_specs=tuple(specs),
    out_specs=(seq, plan.lse_spec()),
    check_vma=False,
  )(*args)


def ulysses_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  mesh: Mesh | AbstractMesh,
  seq_axis: str,
  causal: bool = False,
  softmax_scale: float | None = None,
  window_size: Any = None,
  softcap: float | None = None,
  sinks: jax.Array | None = None,
  segment_ids: segments.SegmentIds | tuple | None = None,
  return_lse: bool = False,
  implementation: Implementation | None = None,
  config: Any = None,
  batch_axes: str | tuple[str, ...] | None = None,
  head_axes: str | tuple[str, ...] | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Context-parallel attention by all-to-all (DeepSpeed-Ulysses).

  Computes `flash_attention(q, k, v, ...)` with the same options and
  conventions for q, k, v sharded along the sequence (axis 1) over the mesh
  axis `seq_axis`: all-to-all to a head split, the whole-sequence attention
  on each device's heads, all-to-all back (see the module docstring).
  Differentiable (q, k, v and sinks). Use it inside or outside `jax.jit`.

  Args:
    q: `[batch, seq_q, heads_q, head_dim]`, sharded as
      `P(batch_axes, seq_axis, head_axes)`.
    k: `[batch, seq_kv, heads_kv, head_dim]`, sharded the same way.
    v: `[batch, seq_kv, heads_kv, head_dim_v]`, sharded the same way.
    mesh: the `jax.sharding.Mesh` (or `AbstractMesh`) holding `seq_axis`.
    seq_axis: the mesh axis (size n) that shards the sequence; seq_q and
      seq_kv must be multiples of n, and heads_q (per `head_axes` shard) a
      multiple of n.
    causal, softmax_scale, window_size, softcap, sinks, segment_ids,
      return_lse, implementation, config: as in `flash_attention` (every
      backend; segment ids in natural order, like the tokens).
    batch_axes: None, or the mesh axes that shard the batch.
    head_axes: None, or the mesh axes that shard the heads before the
      all-to-all; they must divide heads_kv (whole GQA groups).

  Returns:
    out `[batch, seq_q, heads_q, head_dim_v]` sharded like q, and with
    `return_lse` the float32 lse `[batch, heads_q, seq_q]` sharded
    `P(batch_axes, head_axes, seq_axis)`.

  Raises:
    TypeError / ValueError naming the argument: bad inputs or mesh, lengths
      not multiples of n, heads_q not a multiple of n.
    NotImplementedError: the implementation cannot serve the call.
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
  for name, length in (("q", spec.seq_q), ("k", spec.seq_kv)):
    if length % n:
      raise ValueError(
        f"{name} has sequence length {length}, not a multiple of {n} (one"
        f" shard per device over mesh axis {seq_axis!r} of size {n})"
      )
  batch_axes, head_axes = ring_checks.check_batch_head_axes(
    batch_axes, head_axes, mesh, seq_axis, spec
  )
  nh = sharding_checks.mesh_ways(mesh, head_axes)
  plan = UlyssesPlan(
    spec,
    mesh,
    seq_axis,
    batch_axes,
    head_axes,
    _check_heads(spec, nh, n, seq_axis),
    implementation,
    config,
  )
  out, lse = _ulysses(
    plan,
    jnp.asarray(q),
    jnp.asarray(k),
    jnp.asarray(v),
    None if sinks is None else sinks.astype(jnp.float32),
    () if segment_ids is None else tuple(segment_ids),
  )
  return (out, lse) if return_lse else out
