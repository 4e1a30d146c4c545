"""The few kernel operations whose form depends on where the kernel runs.

The sm90 kernels are one body of code; only these leaf operations differ
between the variant compiled for sm90 (`COMPILED`) and the one run by JAX's
GPU interpreter on a CPU (`INTERPRETED`: no register wgmma operand, no
accumulator state, no register layouts). Both compute the same values
(exact products, float32 accumulation) and read shared memory through the
same proxy (`async_proxy_read`), so the interpreter's race detector judges
the compiled kernel's protocol.
Details: docs/design_notes.md#interpret-mode-and-memory-proxies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_fa3.kernels.sm90 import compat

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class KernelOps:
  """Leaf operations of the sm90 kernels; `interpreted` picks the variant."""

  interpreted: bool

  # -- register layouts ------------------------------------------------------
  def rows(self, x: jax.Array) -> jax.Array:
    """A per-row vector in the layout of a wgmma accumulator's row reduction."""
    if self.interpreted:
      return x
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1))

  def cols(self, x: jax.Array) -> jax.Array:
    """A per-column vector in the layout of a wgmma accumulator's column
    reduction."""
    if self.interpreted:
      return x
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(0))

  def tile(self, x: jax.Array) -> jax.Array:
    """A 2-D array in the wgmma accumulator layout."""
    if self.interpreted:
      return x
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA)

  def load_rows(self, ref: Any) -> jax.Array:
    """A 1-D float32 `ref` (one value per accumulator row) into registers."""
    if self.interpreted:
      return ref[...]
    return compat.load_with_layout(ref, plgpu.Layout.WGMMA.reduce(1))

  def load_cols(self, ref: Any) -> jax.Array:
    """A 1-D float32 `ref` (one value per accumulator column) into registers."""
    if self.interpreted:
      return ref[...]
    return compat.load_with_layout(ref, plgpu.Layout.WGMMA.reduce(0))

  def load_global(self, ref: Any, *, as_rows: bool) -> jax.Array:
    """A 1-D global-memory `ref` into registers as a per-row (`as_rows`) or
    per-column vector of an accumulator (plain loads)."""
    if self.interpreted:
      return ref[...]
    layout = plgpu.Layout.WGMMA.reduce(1 if as_rows else 0)
    return compat.load_global_with_layout(ref, layout)

  def load_global_tile(self, ref: Any) -> jax.Array:
    """A 2-D global-memory `ref` into registers in the wgmma accumulator
    layout (plain loads)."""
    if self.interpreted:
      return ref[...]
    return compat.load_global_with_layout(ref, plgpu.Layout.WGMMA)

  def row_index(self, n: int) -> jax.Array:
    """int32 0..n-1 laid out as the rows of a wgmma accumulator."""
    if self.interpreted:
      return lax.iota(jnp.int32, n)
    return plgpu.layout_cast(
      lax.iota(jnp.int32, n), plgpu.Layout.WGMMA.reduce(1)
    )

  def col_index(self, n: int) -> jax.Array:
    """int32 0..n-1 laid out as the columns of a wgmma accumulator."""
    if self.interpreted:
      return lax.iota(jnp.int32, n)
    return plgpu.layout_cast(
      lax.iota(jnp.int32, n), plgpu.Layout.WGMMA.reduce(0)
    )

  # -- matmuls -----------------------------------------------------------------
  def with_scores(
    self,
    q_smem: Any,
    k_smem: Any,
    body: Callable[[Callable[[], jax.Array]], Any],
  ) -> Any:
    """Starts S = Q K^T (float32) and runs `body(read_s)` while it computes.

    On the GPU the wgmma is issued asynchronously into a scoped accumulator;
    `body` overlaps its own work with it and calls `read_s()` (which waits)
    when it needs S. Returns what `body` returns. `q_smem` and `k_smem` may
    be equal-length sequences of head-dim chunks: S = sum_c Q_c K_c^T.
    """
    q_chunks, k_chunks = _chunks(q_smem), _chunks(k_smem)
    if self.interpreted:
      s = async_proxy_read(
        sum(self._dot_qk(q, k) for q, k in zip(q_chunks, k_chunks))
      )
      return body(lambda: s)

    def scoped(acc):
      for q, k in zip(q_chunks, k_chunks):
        plgpu.wgmma(acc, q, k.transpose((1, 0)))
      return body(lambda: acc[...])

    shape = (q_chunks[0].shape[0], k_chunks[0].shape[0])
    return pl.run_scoped(scoped, plgpu.ACC(shape, _F32))

  def scores(self, q_smem: Any, k_smem: Any) -> jax.Array:
    """S = Q K^T in float32, waited for (chunks as in `with_scores`)."""
    return self.with_scores(q_smem, k_smem, lambda read: read())

  def accumulate_pv(
    self,
    o: jax.Array,
    p: jax.Array,
    v_smem: Any,
    issued: Callable[[], None] = lambda: None,
  ) -> jax.Array:
    """o + P V with P in registers (the FP8 ops: P in shared memory and V
    transposed), float32 accumulation; calls `issued()` once the wgmma is
    issued, then waits for all wgmma."""
    if self.interpreted:
      out = async_proxy_read(o + self._dot_pv(p, v_smem))
      issued()
      return out

    def pv(acc):
      self._wgmma_pv(acc, p, v_smem)
      issued()

    return pl.run_state(pv)(plgpu.ACC.init(o))

  def accumulate_pv_then(
    self,
    o: jax.Array,
    p: jax.Array,
    v_smem: Any,
    then: Callable[[], tuple],
    like: tuple,
  ) -> tuple[jax.Array, tuple]:
    """Issues o + P V (`p` in registers), then runs `then()` while it
    computes (`then` may wait for older wgmma groups at depth 1, e.g. a
    `score_pair` read, leaving this one in flight) and returns arrays
    shaped as `like`. Returns (o + P V, what `then` returned) once every
    wgmma is done. `then` must not write the registers `p` occupies."""
    if self.interpreted:
      out = async_proxy_read(o + self._dot_pv(p, v_smem))
      return out, tuple(then())

    def body(refs):
      o_acc, out_refs = refs
      self._wgmma_pv(o_acc, p, v_smem)
      for ref, value in zip(out_refs, then()):
        ref[...] = value

    return pl.run_state(body)((plgpu.ACC.init(o), tuple(like)))

  def scores_then_pv(
    self,
    q_smem: Any,
    k_smem: Any,
    o: jax.Array,
    p: jax.Array,
    v_smem: Any,
    like: tuple,
    *,
    issued: Callable[[], None],
    with_s: Callable[[jax.Array], tuple],
    o_scale: jax.Array | None = None,
  ) -> tuple[jax.Array, tuple]:
    """FA3's intra-warpgroup order: issues S = Q K^T (chunks as in
    `with_scores`), then O + P V (`p` in registers; the FP8 ops take it in
    shared memory), calls `issued()`, waits for S alone (`wait_group 1`: P V,
    one `plgpu.wgmma` and so one group, stays in flight) and runs
    `with_s(s)`, which returns arrays shaped as `like`. Returns (O + P V,
    what `with_s` returned) once both wgmma are done. `o_scale` (rows):
    O is first multiplied by it, between the two issues, so the rescale
    runs while S computes instead of after the last wait. `with_s` must not
    write registers that the P V wgmma reads: convert its P for the next
    step only after this returns."""
    q_chunks, k_chunks = _chunks(q_smem), _chunks(k_smem)
    scaled = lambda o: (
      o if o_scale is None else o * lax.broadcast_in_dim(o_scale, o.shape, [0])
    )
    if self.interpreted:
      s = async_proxy_read(
        sum(self._dot_qk(q, k) for q, k in zip(q_chunks, k_chunks))
      )
      o_new = async_proxy_read(scaled(o) + self._dot_pv(p, v_smem))
      issued()
      return o_new, with_s(s)

    shape = (q_chunks[0].shape[0], k_chunks[0].shape[0])

    def scoped(s_acc):
      for q, k in zip(q_chunks, k_chunks):
        plgpu.wgmma(s_acc, q, k.transpose((1, 0)))

      def body(refs):  # O's accumulator from the (rescaled) registers
        o_acc, out_refs = refs
        self._wgmma_pv(o_acc, p, v_smem)
        issued()
        s = plgpu.wgmma_accumulator_load(s_acc, wait_n=1)
        for ref, value in zip(out_refs, with_s(s)):
          ref[...] = value

      return pl.run_state(body)((plgpu.ACC.init(scaled(o)), tuple(like)))

    return pl.run_scoped(scoped, plgpu.ACC(shape, _F32))

  # The products `scores_then_pv` and `accumulate_pv` take, in interpret
  # mode and as wgmma; the FP8 ops override them (e4m3 operands, V
  # transposed).
  def _dot_qk(self, q_smem: Any, k_smem: Any) -> jax.Array:
    return jnp.dot(q_smem[...], k_smem[...].T, preferred_element_type=_F32)

  def _dot_pv(self, p: Any, v_smem: Any) -> jax.Array:
    return jnp.dot(p, v_smem[...], preferred_element_type=_F32)

  def _wgmma_pv(self, acc: Any, p: Any, v_smem: Any) -> None:
    plgpu.wgmma(acc, p, v_smem)

  def score_pair(
    self,
    first: tuple[Any, Any],
    second: tuple[Any, Any],
    body: Callable[[Callable[[], jax.Array], Callable[[], jax.Array]], Any],
  ) -> Any:
    """Issues S1 = A1 B1^T, then S2 = A2 B2^T (each pair `(a, b)` as
    `with_scores` takes Q and K) and runs `body(read_1, read_2)` while they
    compute: `read_1` waits for S1 alone (`wait_group n`, n the wgmma
    groups of S2: one per chunk, each `plgpu.wgmma` commits its own),
    `read_2(wait_n=0)` for both and all later groups but `wait_n` (an
    `accumulate_pv_then` issued after them stays in flight with 1).
    Returns what `body` returns."""
    pairs = [(_chunks(a), _chunks(b)) for a, b in (first, second)]
    if self.interpreted:
      s1, s2 = (
        async_proxy_read(sum(self._dot_qk(x, y) for x, y in zip(a, b)))
        for a, b in pairs
      )
      return body(lambda: s1, lambda wait_n=0: s2)

    def scoped(acc1, acc2):
      for acc, (a, b) in zip((acc1, acc2), pairs):
        for x, y in zip(a, b):
          plgpu.wgmma(acc, x, y.transpose((1, 0)))
      second_groups = len(pairs[1][0])
      return body(
        lambda: plgpu.wgmma_accumulator_load(acc1, wait_n=second_groups),
        lambda wait_n=0: plgpu.wgmma_accumulator_load(acc2, wait_n=wait_n),
      )

    shapes = [(a[0].shape[0], b[0].shape[0]) for a, b in pairs]
    return pl.run_scoped(scoped, *(plgpu.ACC(s, _F32) for s in shapes))

  def accumulate(
    self,
    accs: tuple[Any, ...],
    terms: list[tuple[int, Any, Any]],
    *,
    first: int | None = None,
    between: Callable[[], None] = lambda: None,
  ) -> tuple[jax.Array, ...]:
    """`accs[i] += A B` for every term `(i, A, B)`: A in registers or an
    `SmemA`; B a shared-memory ref; an `accs` entry that is a shape is a
    fresh float32 zero accumulator (scoped: no zero tile is kept live
    before the wgmma). Issues `terms[:first]`, calls `between()`, issues
    the rest, and waits once for all of them. Returns the accumulators."""
    first = len(terms) if first is None else first
    fresh = [isinstance(a, tuple) for a in accs]
    if self.interpreted:
      out = [jnp.zeros(a, _F32) if f else a for a, f in zip(accs, fresh)]
      for n, (i, a, b) in enumerate(terms):
        if n == first:
          between()
        out[i] = out[i] + jnp.dot(
          _value(a), b[...], preferred_element_type=_F32
        )
      if first >= len(terms):
        between()
      plgpu.commit_smem()
      return tuple(out)

    def scoped(*scoped_refs):
      def body(state_refs):
        it_s, it_f = iter(state_refs), iter(scoped_refs)
        refs = [next(it_f) if f else next(it_s) for f in fresh]
        for n, (i, a, b) in enumerate(terms):
          if n == first:
            between()
          plgpu.wgmma(refs[i], _operand(a), b)
        if first >= len(terms):
          between()

      kept = pl.run_state(body)(
        tuple(plgpu.ACC.init(a) for a, f in zip(accs, fresh) if not f)
      )
      it_k, it_f = iter(kept), iter(scoped_refs)
      return tuple(next(it_f)[...] if f else next(it_k) for f in fresh)

    shapes = [plgpu.ACC(a, _F32) for a, f in zip(accs, fresh) if f]
    return pl.run_scoped(scoped, *shapes)

  def with_accumulators(
    self, inits: tuple[jax.Array, ...], body: Callable[[tuple], tuple]
  ) -> tuple[jax.Array, ...]:
    """Runs `accs = body(accs)` on float32 accumulators initialised to
    `inits` that live across `body`'s loops (`accumulating_loop`; wgmma
    into them with `mma`, waited for with `mma_wait`) and returns their
    values once every wgmma is done: a GEMM may stay in flight from one
    loop step into the next. Compiled, `accs` are wgmma accumulator refs;
    interpreted, values."""
    if self.interpreted:
      return tuple(body(tuple(inits)))

    def run(refs):
      body(refs)
      plgpu.wgmma_wait(0)

    return pl.run_state(run)(tuple(plgpu.ACC.init(x) for x in inits))

  def accumulating_loop(
    self, lower: Any, upper: Any, step: Callable[..., tuple],
    accs: tuple, carry: Any = (),
  ) -> tuple[tuple, Any]:  # fmt: skip
    """`lax.fori_loop` of `(accs, carry) = step(i, accs, carry)` over
    `with_accumulators`' `accs` (compiled, the refs are closed over, only
    `carry` is carried). Returns (accs, carry)."""
    if self.interpreted:
      return lax.fori_loop(
        lower, upper, lambda i, ac: step(i, *ac), (accs, carry)
      )

    def body(i, c):
      return step(i, accs, c)[1]

    return accs, lax.fori_loop(lower, upper, body, carry)

  def mma(self, acc: Any, a: Any, b_smem: Any) -> Any:
    """Issues `acc + A B` into a `with_accumulators` accumulator (A in
    registers, B in shared memory) as its own wgmma group, without
    waiting; returns the accumulator."""
    if self.interpreted:
      return async_proxy_read(acc + self._dot_pv(a, b_smem))
    self._wgmma_pv(acc, a, b_smem)
    return acc

  def mma_wait(self, n: int) -> None:
    """Waits for every wgmma group but the `n` newest."""
    if not self.interpreted:
      plgpu.wgmma_wait(n)

  def accumulate_ss(
    self, acc: jax.Array, a_smem: Any, b_smem: Any
  ) -> jax.Array:
    """acc + A B with A `[m, k]` and B `[k, n]` in shared memory, float32
    accumulation; waits for all wgmma."""
    if self.interpreted:
      return async_proxy_read(
        acc + jnp.dot(a_smem[...], b_smem[...], preferred_element_type=_F32)
      )

    def ss(ref):
      plgpu.wgmma(ref, a_smem, b_smem)

    return pl.run_state(ss)(plgpu.ACC.init(acc))

  def accumulate_tn(
    self, acc: jax.Array, a_smem: Any, b_smem: Any
  ) -> jax.Array:
    """acc + A^T B with A `[k, m]` and B `[k, n]` in shared memory (the
    wgmma reads A transposed), float32 accumulation; waits for all wgmma."""
    if self.interpreted:
      return async_proxy_read(
        acc + jnp.dot(a_smem[...].T, b_smem[...], preferred_element_type=_F32)
      )

    def tn(ref):
      plgpu.wgmma(ref, a_smem.transpose((1, 0)), b_smem)

    return pl.run_state(tn)(plgpu.ACC.init(acc))


def async_proxy_read(result: jax.Array) -> jax.Array:
  """`result`, computed from ordinary shared-memory reads that stand in for a
  wgmma's async-proxy reads, after the proxy fence that makes them so."""
  plgpu.commit_smem()
  return result


@dataclasses.dataclass(frozen=True)
class SmemA:
  """A wgmma A operand in shared memory: `ref` is `[m, k]`, or `[k, m]` read
  transposed."""

  ref: Any
  transposed: bool = False


def _value(a: Any) -> jax.Array:
  """An `accumulate` A operand's value (interpret mode)."""
  if isinstance(a, SmemA):
    return a.ref[...].T if a.transposed else a.ref[...]
  return a


def _operand(a: Any) -> Any:
  """An `accumulate` A operand as wgmma takes it."""
  if isinstance(a, SmemA):
    return a.ref.transpose((1, 0)) if a.transposed else a.ref
  return a


def _chunks(ref_or_refs: Any) -> tuple:
  if isinstance(ref_or_refs, (list, tuple)):
    return tuple(ref_or_refs)
  return (ref_or_refs,)


COMPILED = KernelOps(interpreted=False)
INTERPRETED = KernelOps(interpreted=True)
