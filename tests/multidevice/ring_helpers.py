"""Shared by the ring-with-modifiers and Ulysses suites: inputs with every
option, one jitted forward + backward, and the golden comparison."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import mesh_helpers as mh
import numpy as np

from pallas_fa3.testing import Shape, assert_within_tolerance, golden_and_naive

NAMES = mh.NAMES + ("dsinks",)


@dataclasses.dataclass(frozen=True)
class Options:
  """The attention options of one case."""

  causal: bool = False
  window_size: Any = None
  softcap: float | None = None
  sinks: bool = False
  documents: int = 0  # > 0: segment ids of that many packed documents

  def golden_kwargs(self) -> dict[str, Any]:
    return dict(
      causal=self.causal, window_size=self.window_size, softcap=self.softcap
    )


def doc_ids(rng: np.random.Generator, batch: int, seq: int, docs: int):
  """Sorted int32 ids of `docs` random-length documents per batch row."""
  rows = []
  for _ in range(batch):
    cuts = np.sort(rng.choice(np.arange(1, seq), docs - 1, replace=False))
    rows.append(np.searchsorted(cuts, np.arange(seq), side="right"))
  return jnp.asarray(np.asarray(rows, np.int32))


def inputs(key, shape: Shape, options: Options, rng, dtype=jnp.bfloat16):
  """(q, k, v, sinks, ids, dout, dlse): fresh, never zeros; sinks and ids
  None unless the case has them."""
  kq, kk, kv, kd, kl, ks = jax.random.split(key, 6)
  b, sq, skv = shape.batch, shape.seq_q, shape.seq_kv
  q = jax.random.normal(kq, (b, sq, shape.heads_q, shape.head_dim), dtype)
  k = jax.random.normal(kk, (b, skv, shape.heads_kv, shape.head_dim), dtype)
  v = jax.random.normal(kv, (b, skv, shape.heads_kv, shape.dv), dtype)
  dout = jax.random.normal(kd, (b, sq, shape.heads_q, shape.dv), dtype)
  dlse = jax.random.normal(kl, (b, shape.heads_q, sq))
  sinks = None
  if options.sinks:
    sinks = jax.random.normal(ks, (shape.heads_q,), jnp.float32)
  ids = None
  if options.documents:
    assert sq == skv, "self-attention ids"
    ids = doc_ids(rng, b, sq, options.documents)
  return q, k, v, sinks, ids, dout, dlse


def vjp_run(attend: Callable[..., Any]) -> Callable[..., tuple]:
  """(q, k, v, sinks, ids, dout, dlse) -> (out, lse, dq, dk, dv[, dsinks])
  of `attend(q, k, v, sinks, ids)` returning (out, lse)."""

  def run(q, k, v, sinks, ids, dout, dlse):
    f = lambda q, k, v, s: attend(q, k, v, s, ids)
    (out, lse), pullback = jax.vjp(f, q, k, v, sinks)
    grads = pullback((dout, dlse))
    return (out, lse) + tuple(g for g in grads if g is not None)

  return run


def seq_parallel_run(
  fn: Callable[..., Any], mesh, options: Options, **kwargs
) -> Callable[..., tuple]:
  """`vjp_run`, jitted, of `fn` (`pallas_fa3.ring_attention` or
  `ulysses_attention`) over mesh axis "seq" with `options` and `kwargs`."""

  def attend(q, k, v, sinks, ids):
    return fn(
      q,
      k,
      v,
      mesh=mesh,
      seq_axis="seq",
      causal=options.causal,
      window_size=options.window_size,
      softcap=options.softcap,
      sinks=sinks,
      segment_ids=ids,
      return_lse=True,
      **kwargs,
    )

  return jax.jit(vjp_run(attend))


def assert_matches_golden(
  got: tuple, plain: tuple, options: Options, perm: Callable | None = None
) -> None:
  """out, lse and every gradient within the tolerance rule of the float64
  golden. `perm(x, axis)`: the caller's order of a natural-order tensor."""
  q, k, v, sinks, ids, dout, dlse = plain
  golden, naive = golden_and_naive(
    q,
    k,
    v,
    dout,
    dlse=dlse,
    sinks=sinks,
    segment_ids=None if ids is None else (ids, ids),
    **options.golden_kwargs(),
  )
  assert len(got) == len(golden), (len(got), len(golden))
  for name, x, n, g in zip(NAMES, got, naive, golden):
    if perm is not None and name != "dsinks":
      axis = 2 if name == "lse" else 1
      n, g = perm(np.asarray(n), axis), perm(np.asarray(g), axis)
    assert x.shape == np.shape(g), (name, x.shape, np.shape(g))
    assert_within_tolerance(name, x, n, g)


def assert_collectives(hlo: str, allowed: tuple[str, ...]) -> dict[str, int]:
  """Only `allowed` collective kinds in a compiled program; their counts."""
  counts = mh.collectives(hlo)
  for kind, count in counts.items():
    if kind not in allowed:
      assert count == 0, f"{kind} in the compiled program: {counts}"
  return counts
