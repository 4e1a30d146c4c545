"""A user's score_mod / mask_mod traced into a Hopper kernel's tile loop.

The function's jaxpr (`flex.UserFunction`, traced on scalars) is walked once
per tile with every value classed by what it varies with: a literal, a
per-(batch, head) scalar, a vector along the tile's queries or its keys, or
the whole tile. Elementwise operations run on the kernel's registers in the
wgmma layouts, broadcast only as far as they need; an array the function
closes over is read by scalar loads where its indices depend on batch and
head alone, and as one row or column vector from global memory where one
index is `q_idx + c` or `kv_idx + c` (document ids, lengths per query); a
read at any other function of one position, or of `kv_idx - q_idx` (a
relative-position table), from an operand built outside the kernel
(`DerivedRead`). Anything else (a gather by both positions, a reduction,
a loop) is refused with the reason, and the automatic choice runs the
blockwise twin instead.
`plan` is the static check; `evaluate` the kernel side. docs/flex.md#in-the-kernels
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.extend import core as jex_core

from pallas_fa3.spec import LOG2E, cdiv

# What a value varies with (ordered: joining two takes the larger, except
# that a query vector and a key vector join to a tile).
LIT, SCALAR, QVEC, KVEC, TILE, CONST = range(6)
# A `Read`'s scalar axes: any scalar, the batch index, the head index.
SCALAR_AXES = ("s", "b", "h")

_ELEMENTWISE = frozenset(
  """add sub mul div rem max min neg abs sign floor ceil round exp exp2 log
  log1p expm1 tanh logistic sqrt rsqrt cbrt pow integer_pow square sin cos
  tan erf erfc is_finite not and or xor eq ne lt le gt ge select_n
  convert_element_type clamp shift_left shift_right_arithmetic
  shift_right_logical nextafter copy copy_p atan2 asin acos atan sinh cosh
  asinh acosh atanh reduce_precision bitcast_convert_type""".split()
)
_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}
_FLIP_PRIMS = {
  "lt": lax.lt_p, "le": lax.le_p, "gt": lax.gt_p, "ge": lax.ge_p,
  "eq": lax.eq_p, "ne": lax.ne_p,
}  # fmt: skip
_SHAPE_ONLY = frozenset(
  ["squeeze", "reshape", "broadcast_in_dim", "expand_dims"]
)
_CALLS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


class Refused(Exception):
  """The function cannot be compiled into the kernel (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Kind:
  """A value's class; `base`/`offset`: it is `q_idx + offset` or `kv_idx +
  offset` exactly (an index the kernel can load a vector at)."""

  kind: int
  base: str | None = None
  offset: int = 0
  const: int = -1  # CONST: which captured array
  scalar_of: str | None = None  # a SCALAR that is `b` or `h` exactly
  # A SCALAR that is a shard's first batch ("b") or head ("h") index (a
  # `flex.UserFunction.shifted`'s offsets): `b + it` is the global `b`.
  offset_of: str | None = None
  # The batch / head indices ("b", "h") the value depends on beside its
  # kind's position (q_idx for a QVEC, kv_idx for a KVEC, kv_idx - q_idx for
  # a `rel` TILE); None: not known (`_deps`).
  deps: frozenset | None = None
  # A TILE that is a function of `kv_idx - q_idx` (and `deps`) alone: a
  # relative position, or a table read at one (`DerivedRead`).
  rel: bool = False


@dataclasses.dataclass(frozen=True)
class Read:
  """One read of captured array `const`: per axis "s" (a scalar index;
  "b" / "h" where it is the batch / head index itself) or `("q" | "kv",
  offset)`."""

  const: int
  axes: tuple


@dataclasses.dataclass(frozen=True)
class DerivedRead:
  """A read of captured array `const` at an index computed from one
  position by anything but `+ c` (`over` "q": `ids[b, q_idx // 2]`, a
  GQA-packed decode row's `slopes[h * g + q_idx % g]`; "kv"), or from
  `kv_idx - q_idx` (`over` "rel": a relative-position table, T5's
  buckets): its value depends on that position and the batch / head
  indices in `deps` alone. The kernel reads it from an operand built
  outside (`derived_operands`: a vector per position, or a skewed tile
  operand for "rel"); `eqn` is the jaxpr equation that reads it."""

  const: int
  over: str
  deps: frozenset
  eqn: Any = dataclasses.field(compare=False, hash=False)


@dataclasses.dataclass
class Tile:
  """Where a kernel tile sits (None in `plan`'s static walk): its shape,
  the tile axis its queries run along, the first query and key positions,
  the batch and query head (scalars), and the captured arrays' refs."""

  ops: Any
  shape: tuple[int, int]
  q_axis: int
  q0: Any
  kv0: Any
  batch: Any
  head: Any
  refs: tuple
  derived: tuple = ()  # the `DerivedRead`s' operands, in walk order
  scalars: Loads | None = None  # its scalar reads: recorded or replayed
  vectors: Loads | None = None  # its vector and tile reads: likewise
  # A position difference converted to float from float vectors (no
  # conversion per score; `_Walk.float_difference`), else per score.
  float_differences: bool = False


class Loads:
  """A function's reads, in walk order: recorded by a walk ahead of time,
  then replayed by the step's walk instead of loads there. Its scalar
  reads (indices from batch, head and other scalars: the same at every
  step of a key loop) are loaded before the loop (`preload_scalars`), its
  vector and tile reads before the step's P V wgmma is issued
  (`prefetch`): a global load between that issue and its wait made ptxas
  wait before the softmax's exp2s (ALiBi's slope: 0 of 66 exp2 under the
  wgmma; RESULTS.md, issue 66)."""

  def __init__(self, values: list | None = None):
    self.values = [] if values is None else values
    self.replaying = values is not None
    self.next = 0

  def take(self) -> Any:
    x = self.values[self.next]
    self.next += 1
    return x


class _Val:
  __slots__ = ("kind", "value", "dtype", "parts")

  def __init__(self, kind: Kind, value: Any, dtype: Any, parts: Any = None):
    self.kind, self.value, self.dtype = kind, value, jnp.dtype(dtype)
    # A position difference's vectors (`_Walk.difference`): (a, its axis,
    # b, its axis, the integer abs / neg applied since), so a conversion
    # to float converts the vectors, not the tile.
    self.parts = parts


def _join(kinds: list[int]) -> int:
  ks = set(kinds)
  if QVEC in ks and KVEC in ks:
    return TILE
  return max(ks)


class _Walk:
  """One walk of a function's jaxpr: static (`tile` None: kinds and reads
  only) or in the kernel (values too)."""

  def __init__(
    self, name: str, consts: tuple, tile: Tile | None, seqs, offsets=None
  ):
    self.name = name
    self.consts = consts  # avals of the captured arrays
    self.tile = tile
    self.seq_q, self.seq_kv = seqs
    self.reads: list[Read] = []
    self.derived: list[DerivedRead] = []
    self.eqn = None  # the equation being applied (`DerivedRead.eqn`)
    # const index -> "b" / "h": a shifted function's shard offsets
    self.offsets = offsets or {}

  def refuse(self, why: str) -> None:
    raise Refused(f"{self.name} {why}")

  # -- values -----------------------------------------------------------------
  def literal(self, x: Any, dtype: Any) -> _Val:
    return _Val(Kind(LIT), np.asarray(x, dtype), dtype)

  def lift(self, v: _Val, kind: int) -> Any:
    """v's value as a `kind` value in registers."""
    t = self.tile
    if v.kind.kind == kind:
      return v.value
    x = v.value
    if v.kind.kind == LIT:
      x = jnp.asarray(x, v.dtype)
    if kind == SCALAR:
      return x
    n_q, n_kv = t.shape[t.q_axis], t.shape[1 - t.q_axis]
    if kind in (QVEC, KVEC):  # from a scalar
      n, axis = (n_q, t.q_axis) if kind == QVEC else (n_kv, 1 - t.q_axis)
      return _vector(t.ops, lax.broadcast_in_dim(x, (n,), ()), axis)
    assert kind == TILE
    if v.kind.kind in (LIT, SCALAR):
      return t.ops.tile(lax.broadcast_in_dim(x, t.shape, ()))
    axis = t.q_axis if v.kind.kind == QVEC else 1 - t.q_axis
    return lax.broadcast_in_dim(x, t.shape, [axis])

  # -- the walk -----------------------------------------------------------------
  def run(self, jaxpr: Any, args: list[_Val], consts=()) -> list[_Val]:
    env: dict = dict(zip(jaxpr.constvars, consts, strict=True))

    def read(a):
      if isinstance(a, jex_core.Literal):
        return self.literal(a.val, a.aval.dtype)
      return env[a]

    for var, arg in zip(jaxpr.invars, args, strict=True):
      env[var] = arg
    for eqn in jaxpr.eqns:
      outs = self.apply(eqn, [read(a) for a in eqn.invars])
      for var, out in zip(eqn.outvars, outs, strict=True):
        env[var] = out
    return [read(a) for a in jaxpr.outvars]

  def apply(self, eqn: Any, ins: list[_Val]) -> list[_Val]:
    name = eqn.primitive.name
    self.eqn = eqn
    dtype = eqn.outvars[0].aval.dtype if eqn.outvars else None
    sub = next((eqn.params[k] for k in _CALLS if k in eqn.params), None)
    if sub is not None:  # jit, custom_jvp / custom_vjp: their body
      closed = getattr(sub, "jaxpr", sub)
      if getattr(sub, "consts", ()):
        self.refuse(f"calls `{name}` with arrays of its own")
      return self.run(closed, ins)
    ins = [  # a 0-d captured array is a scalar read
      self.load(v, [], v.dtype)
      if v.kind.kind == CONST and not self.consts[v.kind.const].shape
      else v
      for v in ins
    ]
    if name == "bitcast_convert_type" and ins[0].kind.kind == CONST:
      # (a frozen function's array: its bits, read as `dtype`)
      return [_Val(ins[0].kind, None, dtype)]
    if any(v.kind.kind == CONST for v in ins):
      if name != "dynamic_slice" or ins[0].kind.kind != CONST:
        self.refuse(
          f"uses a captured array in `{name}`; the kernels read captured"
          " arrays only as `array[i, ...]` with scalar indices"
        )
      return [self.load(ins[0], ins[1:], dtype)]
    if name == "add_any":  # (jvp's sum of tangents)
      return [self.elementwise("add", lax.add_p, {}, ins, dtype)]
    if name == "one_minus_square":  # (jvp of tanh) as plain arithmetic
      x = ins[0]
      sq = self.elementwise("mul", lax.mul_p, {}, [x, x], dtype)
      one = self.literal(1, dtype)
      return [self.elementwise("sub", lax.sub_p, {}, [one, sq], dtype)]
    if name in _SHAPE_ONLY:
      if any(int(np.prod(v.aval.shape)) != 1 for v in eqn.outvars):
        self.refuse(f"builds an array (`{name}`); it must work on scalars")
      v = ins[0]
      return [_Val(v.kind, v.value, dtype)]
    if name not in _ELEMENTWISE:
      self.refuse(
        f"uses `{name}`, which the Hopper kernels cannot compile into a"
        " tile (elementwise operations and captured-array reads only)"
      )
    return [self.elementwise(name, eqn.primitive, eqn.params, ins, dtype)]

  def elementwise(
    self, name: str, prim: Any, params: dict, ins: list[_Val], dtype: Any
  ) -> _Val:
    """An elementwise primitive on `ins`: folded, compared or differenced
    on the layouts' local indices where it can, else bound on the inputs
    lifted to the widest kind among them."""
    folded = self.fold(name, ins, dtype)
    if folded is not None:
      return folded
    if self.tile is not None and len(ins) == 1 and ins[0].parts is not None:
      floated = self.float_difference(name, prim, params, ins[0], dtype)
      if floated is not None:
        return floated
    if name in _FLIP and self.tile is not None:
      compared = self.compare(name, ins)
      if compared is not None:
        return compared
    if name == "sub" and self.tile is not None:
      a, b = ins
      if a.kind.base and b.kind.base and a.kind.base != b.kind.base:
        return self.difference(a, b)
    kind = _join([v.kind.kind for v in ins])
    base = self.affine(name, ins, dtype) or _derived_kind(name, ins, kind)
    if kind == LIT or self.tile is None:
      value = None
      if kind == LIT:
        with jax.ensure_compile_time_eval():
          value = np.asarray(
            prim.bind(*(jnp.asarray(v.value) for v in ins), **params)
          )
      return _Val(base, value, dtype)
    out = prim.bind(*(self.lift(v, kind) for v in ins), **params)
    return _Val(base, out, dtype)

  def fold(self, name: str, ins: list[_Val], dtype: Any) -> _Val | None:
    """jnp indexing's wrap of negative indices, `select_n(i < 0, i, i +
    n)`, on an index known not to be negative: the index itself."""
    if name == "lt" and ins[1].kind.kind == LIT and ins[0].kind.base:
      if ins[0].kind.offset >= 0 and int(ins[1].value) <= 0:
        return self.literal(False, jnp.bool_)
    if name == "lt" and ins[1].kind.kind == LIT and ins[0].kind.scalar_of:
      if int(ins[1].value) <= 0:  # batch and head are not negative
        return self.literal(False, jnp.bool_)
    if name == "select_n" and ins[0].kind.kind == LIT:
      return ins[1 + int(ins[0].value)]
    return None

  def compare(self, name: str, ins: list[_Val]) -> _Val | None:
    """`q_idx + c` (or `kv_idx + c`) against a vector along the other axis,
    with the scalars moved to the vector: `local op y - start - c`, the
    local index a per-register constant of the layout, so no index tile is
    held in registers (the built-in masks' form, `masking.visible_tile_at`)."""
    a, b = ins
    for x, y, op in ((a, b, name), (b, a, _FLIP[name])):
      k = y.kind.kind
      if (
        x.kind.base is None
        or k not in (LIT, SCALAR, QVEC, KVEC)
        or k == x.kind.kind
        or not jnp.issubdtype(y.dtype, jnp.integer)
      ):
        continue
      t = self.tile
      start = t.q0 if x.kind.base == "q" else t.kv0
      shift = jnp.asarray(start + x.kind.offset, jnp.int32)
      local, axis = self._local(x.kind.base)
      if k in (LIT, SCALAR):  # a vector along x's axis: local op y - shift
        deps = _union(x.kind, y.kind)
        y = jnp.asarray(y.value, jnp.int32) - shift
        rhs = _vector(t.ops, lax.broadcast_in_dim(y, local.shape, ()), axis)
        return _Val(
          Kind(x.kind.kind, deps=deps),
          _FLIP_PRIMS[op].bind(local, rhs),
          jnp.bool_,
        )
      sv = _Val(Kind(SCALAR), shift, jnp.int32)
      rhs = lax.sub(self.lift(y, k).astype(jnp.int32), self.lift(sv, k))
      lhs = lax.broadcast_in_dim(local, t.shape, [axis])
      rhs = lax.broadcast_in_dim(rhs, t.shape, [1 - axis])
      return _Val(Kind(TILE), _FLIP_PRIMS[op].bind(lhs, rhs), jnp.bool_)
    return None

  def _local(self, base: str) -> tuple[Any, int]:
    """(the tile-local index along `base`'s axis, that axis)."""
    t = self.tile
    axis = t.q_axis if base == "q" else 1 - t.q_axis
    n = t.shape[axis]
    return (t.ops.row_index(n) if axis == 0 else t.ops.col_index(n)), axis

  def difference(self, a: _Val, b: _Val) -> _Val:
    """`(q_idx + c) - (kv_idx + c')` (or the reverse) as `(local_a +
    shift) - local_b`: the scalars on one vector, the other a per-register
    constant."""
    t = self.tile
    start = lambda v: (t.q0 if v.kind.base == "q" else t.kv0) + v.kind.offset
    la, axis_a = self._local(a.kind.base)
    lb, axis_b = self._local(b.kind.base)
    shifted = la + jnp.asarray(start(a) - start(b), jnp.int32)
    out = lax.broadcast_in_dim(shifted, t.shape, [axis_a]) - (
      lax.broadcast_in_dim(lb, t.shape, [axis_b])
    )
    kind = Kind(TILE, deps=frozenset(), rel=True)
    return _Val(kind, out, jnp.int32, (shifted, axis_a, lb, axis_b, ()))

  def float_difference(
    self, name: str, prim: Any, params: dict, x: _Val, dtype: Any
  ) -> _Val | None:
    """On a position difference (`x.parts`): an integer abs / neg kept
    pending, and where the tile asks (`Tile.float_differences`) a
    conversion to float done on the two vectors (exact below 2^24) and the
    tile formed in float (ALiBi's `|q - kv|`: no integer-to-float
    conversion per score, which shares the exp2's pipe; the key vector's
    floats stay in registers across the loop); None for anything else."""
    a, axis_a, b, axis_b, pending = x.parts
    if name in ("abs", "neg") and jnp.issubdtype(dtype, jnp.integer):
      out = prim.bind(x.value, **params)  # (dead code unless used as int)
      return _Val(x.kind, out, dtype, (a, axis_a, b, axis_b, pending + (name,)))
    if (
      name != "convert_element_type"
      or not jnp.issubdtype(dtype, jnp.floating)
      or not self.tile.float_differences
    ):
      return None
    f32 = lambda v: v.astype(jnp.float32)
    shape = self.tile.shape
    out = lax.broadcast_in_dim(f32(a), shape, [axis_a]) - (
      lax.broadcast_in_dim(f32(b), shape, [axis_b])
    )
    for op in pending:
      out = jnp.abs(out) if op == "abs" else -out
    return _Val(x.kind, out.astype(dtype), dtype)

  def affine(self, name: str, ins: list[_Val], dtype: Any) -> Kind | None:
    """The Kind of `index + c` kept exact (None: not such an index)."""
    if not jnp.issubdtype(dtype, jnp.integer):
      return None
    if name == "convert_element_type" and (
      ins[0].kind.base or ins[0].kind.scalar_of
    ):
      return ins[0].kind
    if name == "add" and len(ins) == 2:  # a shard's global batch / head
      a, b = ins
      for x, y in ((a, b), (b, a)):
        if x.kind.scalar_of and x.kind.scalar_of == y.kind.offset_of:
          return Kind(SCALAR, scalar_of=x.kind.scalar_of)
    if name in ("add", "sub") and len(ins) == 2:
      a, b = ins
      if a.kind.base and b.kind.kind == LIT:
        c = int(b.value) if name == "add" else -int(b.value)
        return dataclasses.replace(a.kind, offset=a.kind.offset + c)
      if name == "add" and b.kind.base and a.kind.kind == LIT:
        return dataclasses.replace(b.kind, offset=b.kind.offset + int(a.value))
    return None

  def load(self, array: _Val, index: list[_Val], dtype: Any) -> _Val:
    """`array[index]` (a dynamic_slice of size 1 in every axis)."""
    aval = self.consts[array.kind.const]
    if any(
      i.kind.rel or (i.kind.kind in (QVEC, KVEC) and i.kind.base is None)
      for i in index
    ):
      return self.load_derived(array, index, dtype)
    axes, vector = [], None
    for axis, i in enumerate(index):
      k = i.kind
      if k.kind in (LIT, SCALAR):
        axes.append(k.scalar_of or "s")
        continue
      if k.base is None or k.kind not in (QVEC, KVEC) or vector is not None:
        self.refuse(
          "reads a captured array at an index computed from q_idx/kv_idx"
          " (a gather the kernels cannot load; only `q_idx + c` or"
          " `kv_idx + c` in one axis, the others by batch/head)"
        )
      seq = self.seq_q if k.base == "q" else self.seq_kv
      if k.offset < 0 or seq - 1 + k.offset >= aval.shape[axis]:
        self.refuse(
          f"reads a captured array of shape {tuple(aval.shape)} at"
          f" {k.base}_idx + {k.offset} in axis {axis}, past its ends"
        )
      axes.append((k.base, k.offset))
      vector = (axis, k)
    offset = self.offsets.get(array.kind.const)
    if offset is None:
      self.reads.append(Read(array.kind.const, tuple(axes)))
    deps = _union(*(i.kind for i in index if i.kind.kind in (LIT, SCALAR)))
    kind = Kind(SCALAR, offset_of=offset, deps=deps)
    if vector is not None:
      kind = Kind(vector[1].kind, deps=deps)
    if self.tile is None:
      return _Val(kind, None, dtype)
    t = self.tile
    ref = t.refs[array.kind.const]
    at = []
    for axis, (i, how) in enumerate(zip(index, axes)):
      if how in SCALAR_AXES:
        j = jnp.asarray(i.value).astype(jnp.int32)
        at.append(jnp.clip(j, 0, aval.shape[axis] - 1))
      else:
        base, offset = how
        start = t.q0 if base == "q" else t.kv0
        n = t.shape[t.q_axis] if base == "q" else t.shape[1 - t.q_axis]
        at.append(pl.ds(start + offset, n))
    stream = t.scalars if vector is None else t.vectors
    if stream is not None and stream.replaying:
      return _Val(kind, stream.take(), dtype)  # (loaded ahead)
    if not aval.shape:  # (0-d arrays travel as [1])
      x = ref[0]
    elif vector is None:
      x = ref[tuple(at)]
    else:
      q_rows = vector[1].base == "q"
      along = t.q_axis if q_rows else 1 - t.q_axis
      x = t.ops.load_global(ref.at[tuple(at)], as_rows=along == 0)
    x = x.astype(aval.dtype)
    if array.dtype != aval.dtype:  # an array's bits, viewed as floats
      x = lax.bitcast_convert_type(x, array.dtype)
    if stream is not None:
      stream.values.append(x)
    return _Val(kind, x, dtype)

  def load_derived(self, array: _Val, index: list[_Val], dtype: Any) -> _Val:
    """`array[index]` with one index computed from one position (or from
    `kv_idx - q_idx`) by anything but `+ c`, the others scalars: a
    `DerivedRead`, in the kernel a vector (or for "rel" a tile) of its
    operand (`derived_operands`)."""
    over, deps = None, set()
    for i in index:
      k = i.kind
      here = "rel" if k.rel else {QVEC: "q", KVEC: "kv"}.get(k.kind)
      if k.kind in (LIT, SCALAR):
        pass
      elif here is None or over is not None:
        self.refuse(
          "reads a captured array at an index computed from q_idx and"
          " kv_idx together other than by kv_idx - q_idx (a gather the"
          " kernels cannot load)"
        )
      else:
        over = here
      d = _deps(k)
      deps |= {"b", "h"} if d is None else d
    if array.kind.const in self.offsets:
      self.refuse("reads a shard's offsets at a computed index")
    number = len(self.derived)
    self.derived.append(
      DerivedRead(array.kind.const, over, frozenset(deps), self.eqn)
    )
    if over == "rel":
      kind = Kind(TILE, deps=frozenset(deps), rel=True)
    else:
      kind = Kind(QVEC if over == "q" else KVEC, deps=frozenset(deps))
    if self.tile is None:
      return _Val(kind, None, dtype)
    t = self.tile
    if t.vectors is not None and t.vectors.replaying:
      return _Val(kind, t.vectors.take(), dtype)  # (loaded ahead)
    ref = t.derived[number]
    at = (
      t.batch if ref.shape[0] > 1 else 0,
      t.head if ref.shape[1] > 1 else 0,
    )
    if over == "rel":  # (keys as rows: the operand skewed the other way)
      start = t.kv0 - t.q0 if t.q_axis == 0 else t.q0 - t.kv0
      start = start + ref.shape[3] // 2
      x = t.ops.load_global_tile(
        ref.at[at + (pl.ds(0, t.shape[0]), pl.ds(start, t.shape[1]))]
      )
    else:
      along = t.q_axis if over == "q" else 1 - t.q_axis
      start = t.q0 if over == "q" else t.kv0
      x = t.ops.load_global(
        ref.at[at + (pl.ds(start, t.shape[along]),)], as_rows=along == 0
      )
    x = x.astype(array.dtype)  # (the value read)
    if t.vectors is not None:
      t.vectors.values.append(x)
    return _Val(kind, x, dtype)


def _deps(k: Kind) -> frozenset | None:
  """The batch / head indices a value of Kind `k` depends on beside its
  position (None: not known)."""
  if k.kind == LIT or (k.base is not None and k.deps is None):
    return frozenset()
  if k.scalar_of:
    return frozenset({k.scalar_of})
  return k.deps


def _union(*kinds: Kind) -> frozenset | None:
  out = set()
  for k in kinds:
    d = _deps(k)
    if d is None:
      return None
    out |= d
  return frozenset(out)


def _derived_kind(name: str, ins: list[_Val], kind: int) -> Kind:
  """The Kind of an elementwise result of `kind`: its `deps`, and for a
  TILE whether it is a function of `kv_idx - q_idx` (`rel`)."""
  kinds = [v.kind for v in ins]
  if kind != TILE:
    return Kind(kind, deps=_union(*kinds))
  if name == "sub" and len(ins) == 2:
    a, b = kinds
    if a.base and b.base and a.base != b.base:  # (q + c) - (kv + c')
      return Kind(TILE, deps=frozenset(), rel=True)
  if all(k.rel or k.kind in (LIT, SCALAR) for k in kinds):
    deps = _union(*kinds)
    return Kind(TILE, deps=deps, rel=deps is not None)
  return Kind(TILE)


def _vector(ops: Any, x: jax.Array, axis: int) -> jax.Array:
  """A 1-D vector laid out along tile axis `axis` (0: the rows)."""
  return ops.rows(x) if axis == 0 else ops.cols(x)


def captured(fn: Any, score: bool, grad: Any = False) -> tuple[Any, tuple]:
  """(jaxpr, arrays): `fn`'s jaxpr on scalars and the concrete arrays
  `jax.closure_convert` left in it (constants it did not lift into
  `fn.consts`). The kernel's operands are the call's `fn.consts`, then
  these. `grad` (a score_mod): the jaxpr gives the new score and its
  derivative in the score (`jax.jvp` with tangent 1), for the backward;
  `grad="params"`: also, per floating array of `fn.consts`, its derivative
  along a tangent array passed after `fn.consts` (ones like it: where a
  CTA reads one element, a batch/head scalar read, the derivative in that
  element).
  Cached: every kernel step and check walks the same jaxpr."""
  avals = tuple(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in fn.consts)
  return _captured(fn.converted, avals, score, grad)


def float_positions(fn: Any) -> tuple[int, ...]:
  """Which of `fn.consts` are floating (carry a gradient)."""
  return tuple(
    i
    for i, c in enumerate(fn.consts)
    if jnp.issubdtype(jnp.result_type(c), jnp.inexact)
  )


@functools.lru_cache(maxsize=128)
def _captured(converted: Any, avals: tuple, score: bool, grad: Any) -> tuple:
  from pallas_fa3 import flex  # (flex does not import the kernels)

  args = flex.scalar_args(4, jnp.float32 if score else None)
  f = converted
  extra = ()
  if grad == "params":
    n = len(avals)
    floats = [i for i, a in enumerate(avals) if jnp.issubdtype(a.dtype, jnp.inexact)]  # fmt: skip
    extra = tuple(avals[i] for i in floats)

    def f(s, b, h, q, k, *rest):
      consts, tans = rest[:n], rest[n:]
      g = lambda x: converted(x, b, h, q, k, *consts)
      out, d_s = jax.jvp(g, (s,), (jnp.ones_like(s),))
      d_c = []
      for i, t in zip(floats, tans):
        gc = lambda c, i=i: converted(
          s, b, h, q, k, *consts[:i], c, *consts[i + 1 :]
        )
        d_c.append(jax.jvp(gc, (consts[i],), (t,))[1])
      return (out, d_s, *d_c)

  elif grad:

    def f(s, *rest):
      return jax.jvp(lambda x: converted(x, *rest), (s,), (jnp.ones_like(s),))

  closed = jax.make_jaxpr(f)(*args, *avals, *extra)
  return closed.jaxpr, tuple(closed.consts)


def derived_operands(
  fn: Any, score: bool, grad: Any, arrays: tuple, seqs: tuple[int, int],
  batch: int, heads: int, *, q_pad: int, kv_pad: int, rows: int | None = None,
  keys_as_rows: bool = False,
) -> list[jax.Array]:  # fmt: skip
  """Per `DerivedRead` of `fn`'s jaxpr (`captured(fn, score, grad)`;
  `arrays` its `fn.consts`, then the params tangents; `seqs` the call's
  `(seq_q, seq_kv)`) its operand, 32-bit,
  `[batch|1, heads|1, ...]` by the batch / head indices it depends on:
  over "q" (or "kv") the read's value at every query (key) position of
  `q_pad` (`kv_pad`); over "rel" a skewed `[rows, M]` where row i, column
  m holds the value at `kv_idx - q_idx = m - i - M/2`, so a kernel tile of
  `rows` queries from `q0` and keys from `kv0` is the slice from column
  `kv0 - q0 + M/2` (M/2 a multiple of 128 covering both padded
  sequences); `keys_as_rows` (the dK/dV kernels' transposed tiles): row i,
  column m the value at `kv_idx - q_idx = i - m + M/2`, a tile of `rows`
  keys from `kv0` and queries from `q0` the slice from `q0 - kv0 + M/2`.
  The values come from the function's own equations, evaluated outside the
  kernel."""
  # The reads of a fresh walk, whose equations are those of this jaxpr
  # (`_plan`'s cached ones may be of an evicted `captured` entry).
  reads = _walk(fn, score, None, seqs, grad=grad)[0].derived
  if rows is None and any(r.over == "rel" for r in reads):
    raise ValueError(f"{fn.name}: relative-position reads need `rows`")
  jaxpr, left = captured(fn, score, grad)
  s0 = (jnp.zeros((), jnp.float32),) if score else ()
  ar = lambda n: jnp.arange(n, dtype=jnp.int32)
  out = []
  for r in reads:
    nb = batch if "b" in r.deps else 1
    nh = heads if "h" in r.deps else 1
    if r.over == "rel":
      m = relative_columns(q_pad, kv_pad)
      # v[k]: the value at relative position k - (m / 2 + rows - 1), or
      # with keys as rows k - (m / 2 - 1)
      first = m // 2 - 1 if keys_as_rows else m // 2 + rows - 1
      positions = ar(m + rows - 1) - first
    else:
      positions = ar(q_pad if r.over == "q" else kv_pad)

    def value(b, h, x, r=r):
      q, kv = (x, jnp.int32(0)) if r.over == "q" else (jnp.int32(0), x)
      found = {}
      args = (*s0, b, h, q, kv, *arrays)
      _values_at(jaxpr, left, args, {id(r.eqn): 0}, found)
      return found[0].reshape(())  # (a dynamic_slice's one element)

    over_x = jax.vmap(value, (None, None, 0))
    v = jax.vmap(jax.vmap(over_x, (None, 0, None)), (0, None, None))(
      ar(nb), ar(nh), positions
    )
    wide = jnp.float32 if jnp.issubdtype(v.dtype, jnp.floating) else jnp.int32
    v = v.astype(wide)
    if r.over == "rel":
      i, k = ar(rows)[:, None], ar(m)[None, :]
      v = v[:, :, i - k + (m - 1) if keys_as_rows else k - i + (rows - 1)]
    out.append(v)
  return out


def relative_columns(q_pad: int, kv_pad: int) -> int:
  """M, the columns of a relative-position operand (`derived_operands`):
  twice a multiple of 128 covering both padded sequences."""
  return 2 * cdiv(max(q_pad, kv_pad), 128) * 128


def _values_at(jaxpr: Any, consts: Any, args: Any, wanted: dict,
               out: dict) -> list:  # fmt: skip
  """`jaxpr` on `args` (its constants `consts`) with jax.numpy semantics,
  the first result of each equation whose id is a key of `wanted` stored
  in `out` under its value (inner jaxprs walked as `_Walk.run` does)."""
  env: dict = dict(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  read = lambda a: a.val if isinstance(a, jex_core.Literal) else env[a]
  for eqn in jaxpr.eqns:
    ins = [read(a) for a in eqn.invars]
    sub = next((eqn.params[k] for k in _CALLS if k in eqn.params), None)
    if sub is not None:
      outs = _values_at(getattr(sub, "jaxpr", sub), (), ins, wanted, out)
    else:
      outs = eqn.primitive.bind(*ins, **eqn.params)
      outs = outs if eqn.primitive.multiple_results else [outs]
    if id(eqn) in wanted:
      out[wanted[id(eqn)]] = outs[0]
    env.update(zip(eqn.outvars, outs, strict=True))
  return [read(a) for a in jaxpr.outvars]


def _n_tangents(fn: Any, grad: Any) -> int:
  """The tangent arrays between `fn.consts` and the jaxpr's constants."""
  return len(float_positions(fn)) if grad == "params" else 0


def _walk(fn: Any, score: bool, tile: Tile | None, seqs, s=None, grad=False):
  jaxpr, left = captured(fn, score, grad)
  tans = ()  # (only their shapes matter here)
  if grad == "params":
    tans = tuple(fn.consts[i] for i in float_positions(fn))
  arrays = tuple(fn.consts) + tans + left
  consts = tuple(
    jax.ShapeDtypeStruct(jnp.shape(c), jnp.result_type(c)) for c in arrays
  )
  offsets = {}
  if fn.shift is not None:  # its last two consts: the shard's offsets
    n = len(fn.consts)
    offsets = {n - 2 + i: a for i, a in enumerate("bh") if fn.shift[i]}
  walk = _Walk(fn.name, consts, tile, seqs, offsets)
  n_in = len(fn.consts) + _n_tangents(fn, grad)
  n_args = len(jaxpr.invars) - n_in
  vals = _inputs(walk, len(consts), score, tile, s)
  args = vals[: n_args + n_in]
  outs = walk.run(jaxpr, args, vals[n_args + n_in :])
  return walk, outs


def plan(
  fn: Any,
  score: bool,
  seq_q: int,
  seq_kv: int,
  grad: Any = False,
  relative: bool = False,
) -> tuple[Read, ...]:
  """The captured-array reads of `fn` (a `flex.UserFunction`) in a kernel
  tile (beside its `derived_reads`); raises `Refused` naming what cannot be
  compiled, including a read at a relative position unless `relative`
  (the forward kernel's tiles take them). Walked once per function and
  sizes (every check and kernel of a call asks again)."""
  reads, derived, refused = _plan(fn, score, seq_q, seq_kv, grad)
  if refused is not None:
    raise Refused(refused)
  if not relative and any(r.over == "rel" for r in derived):
    raise Refused(
      f"{fn.name} reads a captured array at a relative position (a"
      " function of kv_idx - q_idx: a relative-position table), which only"
      " the forward kernel's tiles load"
    )
  return reads


def derived_reads(
  fn: Any, score: bool, seq_q: int, seq_kv: int, grad: Any = False
) -> tuple[DerivedRead, ...]:
  """`fn`'s reads at a computed index (`DerivedRead`), in walk order: the
  kernels' operands built outside (`derived_operands`); () where `plan`
  refuses."""
  return _plan(fn, score, seq_q, seq_kv, grad)[1]


@functools.lru_cache(maxsize=256)
def _plan(fn: Any, score: bool, seq_q: int, seq_kv: int, grad: Any) -> tuple:
  try:
    walk, _ = _walk(fn, score, None, (seq_q, seq_kv), grad=grad)
  except Refused as e:
    return (), (), str(e)
  return tuple(walk.reads), tuple(walk.derived), None


def param_grad_axes(fn: Any, seq_q: int, seq_kv: int) -> tuple:
  """Per floating array of a score_mod's `fn.consts`: the axes of its one
  element per tile pair (`Read.axes`: "b", "h", or one `("q", c)` /
  `("kv", c)`: e.g. ALiBi's `slopes[h]`, a per-key bias `t[h, kv_idx]`),
  by which the backward kernels' per-row sums of its derivative are
  attributed (`param_kernel`: the dQ kernel's rows are queries, the dK/dV
  kernel's keys). Raises `Refused` naming a read it cannot attribute (a
  computed or literal index, two different reads of one array)."""
  reads = plan(fn, True, seq_q, seq_kv, grad="params", relative=True)
  derived = {r.const for r in derived_reads(fn, True, seq_q, seq_kv, "params")}
  out = []
  for i in float_positions(fn):
    if i in derived:
      raise Refused(
        f"score_mod reads floating captured array {i} (shape"
        f" {tuple(jnp.shape(fn.consts[i]))}) at a computed index (by a"
        " function of a position, or of kv_idx - q_idx): its gradient in"
        " the backward kernels"
      )
    axes = {r.axes for r in reads if r.const == i}
    ax = next(iter(axes)) if axes else ()
    named = [a for a in ax if a in ("b", "h")]
    if len(axes) > 1 or "s" in ax or len(set(named)) != len(named):
      raise Refused(
        f"score_mod reads floating captured array {i} (shape"
        f" {tuple(jnp.shape(fn.consts[i]))}) other than at one index per"
        " axis among batch, head and q_idx + c or kv_idx + c (`array[h]`,"
        " `array[b, h]`, `array[h, kv_idx]`): its gradient in the backward"
        " kernels"
      )
    out.append(ax)
  return tuple(out)


def param_kernel(axes: tuple) -> str:
  """Which backward kernel sums the gradient of an array read at `axes`
  (`param_grad_axes`): "dkdv" where it is read by key position (its
  rows), else "dq" (read by batch, head or query position)."""
  return (
    "dkdv" if any(a[0] == "kv" for a in axes if a not in SCALAR_AXES) else "dq"
  )


def kernel_params(spec: Any, kernel: str) -> tuple[int, ...]:
  """The indices (into `float_positions` of the score_mod) of the floating
  arrays whose gradients backward kernel `kernel` ("dq", "dkdv") sums;
  () without a score_mod or where `param_grad_axes` refuses."""
  fn = None if spec.flex is None else spec.flex.score_mod
  if fn is None or not float_positions(fn):
    return ()
  try:
    axes = param_grad_axes(fn, spec.seq_q, spec.seq_kv)
  except Refused:
    return ()
  return tuple(j for j, a in enumerate(axes) if param_kernel(a) == kernel)


def _inputs(walk: _Walk, n_consts: int, score: bool, tile: Tile | None,
            s: Any = None) -> list:  # fmt: skip
  i32 = jnp.int32
  q = k = b = h = None
  if tile is not None:
    ops = tile.ops
    n_q, n_kv = tile.shape[tile.q_axis], tile.shape[1 - tile.q_axis]
    q_iota = ops.row_index(n_q) if tile.q_axis == 0 else ops.col_index(n_q)
    kv_iota = ops.col_index(n_kv) if tile.q_axis == 0 else ops.row_index(n_kv)
    q, k, b, h = tile.q0 + q_iota, tile.kv0 + kv_iota, tile.batch, tile.head
  idx = [
    _Val(Kind(SCALAR, scalar_of="b"), b, i32),
    _Val(Kind(SCALAR, scalar_of="h"), h, i32),
    _Val(Kind(QVEC, "q"), q, i32),
    _Val(Kind(KVEC, "kv"), k, i32),
  ]
  if score:
    idx = [_Val(Kind(TILE), s, jnp.float32)] + idx
  return idx + [
    _Val(Kind(CONST, const=i), None, walk.consts[i].dtype)
    for i in range(n_consts)
  ]


def evaluate(fn: Any, tile: Tile, s: Any = None) -> jax.Array:
  """`fn` on the kernel tile `tile`: the new scores (score_mod, `s` the
  float32 scaled scores) or the boolean mask (mask_mod), in `tile.shape`."""
  # (the reads' bounds were `plan`'s check: one position passes here)
  walk, (out,) = _walk(fn, s is not None, tile, (1, 1), s)
  return walk.lift(out, TILE)


def evaluate_with_grad(
  fn: Any, tile: Tile, s: Any, params: bool = False
) -> tuple[Any, ...]:
  """A score_mod on the kernel tile and its derivative in the score; with
  `params`, also the list of its derivatives in its floating arrays."""
  walk, outs = _walk(
    fn, True, tile, (1, 1), s, grad="params" if params else True
  )
  lifted = [walk.lift(o, TILE) for o in outs]
  return tuple(lifted[:2]) + ((lifted[2:],) if params else ())


def pad_consts(consts: tuple, reads: tuple[Read, ...], q_pad: int,
               kv_pad: int) -> tuple:  # fmt: skip
  """The captured arrays as kernel operands: 32-bit (bools and narrow types
  widened; `evaluate` narrows them back) and padded along each vector-read
  axis so that a whole tile's read stays inside (padding is never a
  visible row's value)."""
  out = []
  for i, c in enumerate(consts):
    c = jnp.asarray(c)
    if not c.shape:
      c = c.reshape(1)
    if c.dtype.itemsize < 4 or c.dtype == jnp.bool_:
      c = c.astype(
        jnp.float32 if jnp.issubdtype(c.dtype, jnp.floating) else jnp.int32
      )
    for r in reads:
      if r.const != i:
        continue
      for axis, how in enumerate(r.axes):
        if how in SCALAR_AXES:
          continue
        base, offset = how
        need = (q_pad if base == "q" else kv_pad) + offset
        if c.shape[axis] < need:
          widths = [(0, 0)] * c.ndim
          widths[axis] = (0, need - c.shape[axis])
          c = jnp.pad(c, widths)
    out.append(c)
  return tuple(out)


# ---------------------------------------------------------------------------
# The forward kernel's side: what it refuses, its operands, one tile.


def kernel_unsupported(
  spec: Any, block_q: int, block_kv: int, relative: bool = True
) -> str | None:
  """Why the Hopper forward kernel cannot compile `spec.flex`, or None
  (`relative=False`: a read at a relative position refused, as the
  backward kernels do)."""
  fs = spec.flex
  if fs.block is not None:
    if fs.dense or fs.mask_mod is None:
      return (
        "block_mask from a dense mask: the Hopper kernels mask partial"
        " tiles with a mask_mod"
      )
    if spec.segmented:
      return "block_mask together with segment_ids in the Hopper kernels"
    bq, bkv = fs.block[2:]
    if bq % block_q or bkv % block_kv:
      return (
        f"block_mask tiles {bq} x {bkv} are not multiples of the kernel's"
        f" {block_q} x {block_kv} (create_block_mask(block_q=, block_kv=))"
      )
  for fn, score in ((fs.score_mod, True), (fs.mask_mod, False)):
    if fn is not None:
      try:
        plan(fn, score, spec.seq_q, spec.seq_kv, relative=relative)
      except Refused as e:
        return str(e)
      size = relative_operand_bytes(spec, fn, score, block_q)
      if size > RELATIVE_OPERAND_MAX_BYTES:
        return (
          f"{fn.name} reads a relative-position table whose skewed operand"
          f" would take {size / 2**20:.0f} MiB at seq_q={spec.seq_q},"
          f" seq_kv={spec.seq_kv} (more than"
          f" {RELATIVE_OPERAND_MAX_BYTES / 2**20:.0f} MiB)"
        )
  return None


# The most memory a call's relative-position operands may take (`rows x
# (q_pad + kv_pad)` words per batch / head they depend on): past it the
# forward kernel refuses them (the blockwise twin serves the call).
RELATIVE_OPERAND_MAX_BYTES = 512 * 2**20


def relative_operand_bytes(spec: Any, fn: Any, score: bool, rows: int) -> int:
  """Bytes of `fn`'s relative-position operands (`derived_operands`) for
  tiles of `rows` query rows (0 without such reads)."""
  total = 0
  m = relative_columns(spec.seq_q, spec.seq_kv)
  for r in derived_reads(fn, score, spec.seq_q, spec.seq_kv):
    if r.over == "rel":
      n = (spec.batch if "b" in r.deps else 1) * (
        spec.heads_q if "h" in r.deps else 1
      )
      total += n * rows * m * 4
  return total


def register_light(spec: Any) -> bool:
  """Whether `spec.flex` adds no tile or vector of registers to a forward
  step: a score_mod alone (no bias, mask_mod or block mask) reading
  captured arrays by batch and head only (ALiBi's slopes, a softcap's
  constant), or none. Such calls run the plain forward's wider key tiles
  without spills (`config._FLEX_LIGHT_DEFAULTS`); a mask_mod's mask there
  spilled 4-20 B (causal, sliding window, prefix-LM, chunked)."""
  fs = spec.flex
  if fs.bias is not None or fs.block is not None or fs.mask_mod is not None:
    return False
  for fn, score in ((fs.score_mod, True), (fs.mask_mod, False)):
    if fn is None:
      continue
    try:
      reads = plan(fn, score, spec.seq_q, spec.seq_kv)
    except Refused:
      return False
    if any(isinstance(a, tuple) for r in reads for a in r.axes):
      return False
    if derived_reads(fn, score, spec.seq_q, spec.seq_kv):
      return False
  return True


def _functions(spec: Any) -> list:
  """(operand name prefix, UserFunction, is score_mod) of the call's."""
  fs = spec.flex
  out = []
  if fs.score_mod is not None:
    out.append(("score", fs.score_mod, True))
  if fs.mask_mod is not None:
    out.append(("mask", fs.mask_mod, False))
  return out


def _tile(
  refs: dict, prefix: str, fn: Any, score: bool, grad: bool, ops: Any,
  shape: tuple, q_axis: int, q0: Any, kv0: Any, batch: Any, head: Any,
  scalars: Loads | None = None, vectors: Loads | None = None,
) -> Tile:  # fmt: skip
  """The `Tile` of a function whose arrays are the operands `prefix0`,
  ... (`kernel_operands`: the call's lifted consts, then the captured)."""
  n = len(fn.consts) + _n_tangents(fn, grad) + len(captured(fn, score, grad)[1])
  arrays = tuple(refs[f"{prefix}{i}"] for i in range(n))
  derived = []  # `derived_operands`'
  while f"{prefix}d{len(derived)}" in refs:
    derived.append(refs[f"{prefix}d{len(derived)}"])
  return Tile(
    ops, shape, q_axis, q0, kv0, batch, head, arrays, tuple(derived), scalars,
    vectors,
  )  # fmt: skip


def preload_scalars(
  spec: Any, refs: dict, ops: Any, shape: tuple, q0: Any, batch: Any,
  head: Any,
) -> dict[str, list]:  # fmt: skip
  """Per function of the forward's flex options (by operand prefix), its
  scalar reads loaded now, for `kernel_scores(..., scalars=)` to replay at
  every step of the key loop of the tile of `shape` from query `q0`."""
  return _walk_ahead(spec, refs, ops, shape, q0, jnp.int32(0), batch, head)


def prefetch(
  spec: Any, refs: dict, ops: Any, shape: tuple, q0: Any, kv0: Any,
  batch: Any, head: Any, scalars: dict[str, list],
) -> dict[str, Any]:  # fmt: skip
  """The forward tile's per-step loads (from query `q0`, key `kv0`), issued
  now for `kernel_scores(..., fetched=)`: the bias tile, the block mask's
  state, and per function its vector and tile reads (its scalar reads
  replayed from `scalars`, `preload_scalars`')."""
  out = {}
  if spec.flex.bias is not None:
    out["bias"] = kernel_bias(spec, refs, ops, shape, q0, kv0, batch, head)
  if spec.flex.block is not None:
    out["bm_state"] = _block_state(spec, refs, q0, kv0, batch, head)
  out.update(_walk_ahead(spec, refs, ops, shape, q0, kv0, batch, head, scalars))
  return out


def _walk_ahead(spec, refs, ops, shape, q0, kv0, batch, head, scalars=None):
  """Per function (by operand prefix), the loads of a walk on a zero tile
  (its arithmetic is dead code, only the loads stay): its scalar reads,
  or with `scalars` (replayed) its vector and tile reads."""
  out = {}
  for prefix, fn, score in _functions(spec):
    rec = Loads()
    streams = (rec, None) if scalars is None else (Loads(scalars[prefix]), rec)
    tile = _tile(
      refs, prefix, fn, score, False, ops, shape, 0, q0, kv0, batch, head,
      *streams,
    )  # fmt: skip
    s = ops.tile(jnp.zeros(shape, jnp.float32)) if score else None
    _walk(fn, score, tile, (1, 1), s)
    out[prefix] = rec.values
  return out


def natural_units(spec: Any, t: jax.Array) -> jax.Array:
  """The scaled (and softcapped) scores score_mod takes, from the kernels'
  raw or softcapped ones (`scores.softcapped`'s first result)."""
  natural = spec.softmax_scale if spec.softcap is None else spec.softcap
  return t * jnp.float32(natural)


def kernel_operands(
  spec: Any,
  ops: Any,
  *,
  q_pad: int,
  kv_pad: int,
  rows_per_cta: int | None = None,
  block_kv: int | None = None,
  kv_rows_per_cta: int | None = None,
  block_q: int | None = None,
  positions: tuple[jax.Array, jax.Array] | None = None,
  grad: bool = False,
  tile_rows: int | None = None,
  keys_as_rows: bool = False,
  param_tangents: tuple | None = None,
) -> dict[str, jax.Array]:
  """The forward kernel's flex operands by name: each function's arrays
  (`score0`, ... and `mask0`, ...), and with a block mask its tile states
  (`bm_state`, int32, padded with empty tiles to the padded sequences) and
  per CTA tile of `rows_per_cta` rows the span of non-empty `block_kv`-key
  tiles (`bm_spans`, `[2, batch, heads_q, q_tiles]`, what the producer
  streams), and per K/V CTA of `kv_rows_per_cta` keys the span of
  non-empty `block_q`-row query tiles of any query head of its KV head's
  group (`bm_qspans`, `[2, batch, heads_kv, kv_ctas]`: the dK/dV kernel's),
  and for queries at positions `positions = (first, last)` (int32
  `[batch]` each) the span of non-empty `block_kv`-key tiles of their
  block-mask rows (`bm_dspans`, `[2, batch, heads_q]`: the decode
  kernel's);
  with a bias, `bias` padded to the padded sequences; per read at a
  computed index its operand (`{prefix}d{k}`, `derived_operands`; for a
  relative position, skewed for tiles of `tile_rows` query rows, or with
  `keys_as_rows` of `tile_rows` keys). `grad`: the backward's score_mod
  operands (its jvp's arrays); with `grad="params"` the jvp along each
  floating array runs with tangent ones (its derivative), or with
  `param_tangents` (one per floating array, in order) along them (the
  tangent kernel's: the score_mod's tangent in each array)."""
  out = {}
  if ops.bias is not None:  # whole tiles: padded to the padded sequences
    b = ops.bias
    out["bias"] = jnp.pad(
      b, ((0, 0), (0, 0), (0, q_pad - b.shape[2]), (0, kv_pad - b.shape[3]))
    )
  for prefix, fn, score in _functions(spec):
    consts = ops.score_consts if score else ops.mask_consts
    g = grad if score else False  # the backward's: the jvp's arrays
    reads = plan(fn, score, spec.seq_q, spec.seq_kv, grad=g, relative=True)
    tans = ()  # the params jaxpr's tangents: ones, or those given
    if g == "params" and param_tangents is not None:
      tans = tuple(param_tangents)
    elif g == "params":
      tans = tuple(jnp.ones_like(consts[i]) for i in float_positions(fn))
    arrays = tuple(consts) + tans + captured(fn, score, g)[1]
    for i, c in enumerate(pad_consts(arrays, reads, q_pad, kv_pad)):
      out[f"{prefix}{i}"] = c
    built = derived_operands(
      fn, score, g, tuple(consts) + tans, (spec.seq_q, spec.seq_kv),
      spec.batch, spec.heads_q, q_pad=q_pad, kv_pad=kv_pad, rows=tile_rows,
      keys_as_rows=keys_as_rows,
    )  # fmt: skip
    for k, c in enumerate(built):
      out[f"{prefix}d{k}"] = c
  bm = ops.block_mask
  if bm is not None:
    from pallas_fa3 import flex  # (flex does not import the kernels)

    nq, nkv = cdiv(q_pad, bm.block_q), cdiv(kv_pad, bm.block_kv)
    state = bm.state.astype(jnp.int32)
    state = jnp.pad(
      state,
      ((0, 0), (0, 0), (0, nq - state.shape[2]), (0, nkv - state.shape[3])),
      constant_values=flex.EMPTY,
    )
    out["bm_state"] = state
    seen = state != flex.EMPTY  # [b|1, h|1, nq, nkv]
    if rows_per_cta is not None:  # per query tile: its K/V tiles' span
      first, end = _cta_spans(
        seen, rows_per_cta, bm.block_q, q_pad, block_kv, bm.block_kv, kv_pad
      )
      full = (2, spec.batch, spec.heads_q, q_pad // rows_per_cta)
      out["bm_spans"] = jnp.broadcast_to(jnp.stack([first, end]), full)
    if kv_rows_per_cta is not None:  # per K/V CTA: its query tiles' span
      first, end = _cta_spans(
        jnp.swapaxes(seen, 2, 3), kv_rows_per_cta, bm.block_kv, kv_pad,
        block_q, bm.block_q, q_pad,
      )  # fmt: skip
      if first.shape[1] > 1:  # one walk for the group's query heads: union
        g = spec.heads_q // spec.heads_kv
        grouped = lambda x: x.reshape(x.shape[0], -1, g, *x.shape[2:])
        nonempty = grouped(end > first)
        first = jnp.where(nonempty, grouped(first), q_pad).min(2)
        end = jnp.where(nonempty, grouped(end), 0).max(2)
        first = jnp.minimum(first, end)  # none: an empty span
      full = (2, spec.batch, spec.heads_kv, kv_pad // kv_rows_per_cta)
      out["bm_qspans"] = jnp.broadcast_to(jnp.stack([first, end]), full)
    if positions is not None:  # decoding: the queries' block-mask rows
      first_row, last_row = (
        lax.div(p.astype(jnp.int32), jnp.int32(bm.block_q)) for p in positions
      )
      r = jnp.arange(nq, dtype=jnp.int32)
      mine = (r >= first_row[:, None]) & (r <= last_row[:, None])  # [b, nq]
      row_seen = (seen & mine[:, None, :, None]).any(2)  # [b, h|1, nkv]
      first, end = _tile_span(row_seen, block_kv, bm.block_kv, kv_pad)
      full = (2, spec.batch, spec.heads_q)
      out["bm_dspans"] = jnp.broadcast_to(jnp.stack([first, end]), full)
  return out


def _cta_spans(
  seen: jax.Array, cta_rows: int, bm_rows: int, rows_pad: int, tile: int,
  bm_cols: int, cols_pad: int,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
  """(first, end) int32 `[b|1, h|1, ctas]`: per CTA of `cta_rows` rows (of
  `rows_pad`), the span of `tile`-wide column tiles (of `cols_pad`) that
  hold a non-empty block-mask tile in any of its rows. `seen`: `[b|1,
  h|1, rows, cols]` in block-mask tiles of `bm_rows` x `bm_cols`."""
  ctas = rows_pad // cta_rows
  member = np.zeros((ctas, seen.shape[2]), bool)  # CTA c's block-mask rows
  for c in range(ctas):
    lo, hi = c * cta_rows // bm_rows, ((c + 1) * cta_rows - 1) // bm_rows
    member[c, lo : hi + 1] = True
  seen = (seen[:, :, None] & member[None, None, :, :, None]).any(axis=3)
  return _tile_span(seen, tile, bm_cols, cols_pad)


def _tile_span(
  seen: jax.Array, tile: int, bm_cols: int, cols_pad: int
) -> tuple[jax.Array, jax.Array]:
  """(first, end) int32 over the last axis: the span of `tile`-wide
  column tiles (of `cols_pad`) over `seen`'s block-mask column tiles of
  `bm_cols` (`end = first = 0` where none is seen)."""
  n = cols_pad // tile
  cmap = np.minimum(np.arange(n) * tile // bm_cols, seen.shape[-1] - 1)
  seen = seen[..., cmap]
  anyk = seen.any(-1)
  first = jnp.where(anyk, jnp.argmax(seen, -1), 0).astype(jnp.int32)
  end = jnp.where(anyk, n - jnp.argmax(seen[..., ::-1], -1), 0)
  return first, end.astype(jnp.int32)


def kernel_bias(
  spec: Any, refs: dict, ops: Any, shape: tuple, q0: Any, kv0: Any,
  batch: Any, head: Any, q_axis: int = 0,
) -> jax.Array | None:  # fmt: skip
  """The dense bias's float32 tile of queries from `q0` and keys from
  `kv0` (None without a bias): one tile a step by plain loads
  (L2-resident), from `bias` `[b|1, h|1, sq, skv]`, or with `q_axis=1`
  (keys as rows) from its transpose `bias_t` `[b|1, h|1, skv, sq]`."""
  if spec.flex.bias is None:
    return None
  nb, nh = spec.flex.bias
  at = (batch if nb > 1 else 0, head if nh > 1 else 0)
  if q_axis == 0:
    ref = refs["bias"].at[at + (pl.ds(q0, shape[0]), pl.ds(kv0, shape[1]))]
  else:
    ref = refs["bias_t"].at[at + (pl.ds(kv0, shape[0]), pl.ds(q0, shape[1]))]
  return ops.load_global_tile(ref).astype(jnp.float32)


def backward_scores(
  spec: Any, refs: dict, ops: Any, t: jax.Array, scale_log2: Any, *,
  q0: Any, kv0: Any, batch: Any, head: Any, q_axis: int = 0,
  params: bool = False,
) -> tuple[jax.Array, Any, Any]:  # fmt: skip
  """The backward kernels' scores of a tile of raw (or softcapped) scores
  `t` with `scores.softcapped`'s `scale_log2`, through the bias and
  score_mod (their forward's order: bias, then score_mod): (scores, the
  factor to base 2 for `scores.scaled_once`, the score_mod's derivative or
  None; with `params`, `(derivative, derivatives in its floating
  arrays)`)."""
  fs = spec.flex
  if fs is None or (fs.score_mod is None and fs.bias is None):
    return t, scale_log2, None
  y = natural_units(spec, t)
  bias = kernel_bias(spec, refs, ops, t.shape, q0, kv0, batch, head, q_axis)
  if bias is not None:
    y = y + bias
  grad = None
  if fs.score_mod is not None:
    y, *grad = kernel_score_grad(
      spec, refs, ops, y, q0=q0, kv0=kv0, batch=batch, head=head,
      q_axis=q_axis, params=params,
    )  # fmt: skip
    grad = tuple(grad) if params else grad[0]
  return y, jnp.float32(LOG2E), grad


def kernel_scores(
  spec: Any,
  refs: dict,
  ops: Any,
  s: jax.Array,
  *,
  q0: Any,
  kv0: Any,
  batch: Any,
  head: Any,
  scalars: dict[str, list] | None = None,
  float_differences: bool = False,
  fetched: dict[str, Any] | None = None,
) -> tuple[jax.Array, jax.Array | None]:
  """One forward tile through the flex options: `s` the scaled (and
  softcapped) float32 scores in natural units, queries as rows from `q0`,
  keys as columns from `kv0`; returns the new scores and the mask (None:
  all visible). `scalars`: the functions' scalar reads, loaded before the
  key loop (`preload_scalars`); `float_differences`: `Tile`'s; `fetched`:
  this tile's loads, issued earlier (`prefetch`)."""
  replay = lambda loads, prefix: (
    Loads(loads[prefix]) if loads and prefix in loads else None
  )
  fetched = fetched or {}
  if "bias" in fetched:
    bias = fetched["bias"]
  else:
    bias = kernel_bias(spec, refs, ops, s.shape, q0, kv0, batch, head)
  if bias is not None:
    s = s + bias
  fs = spec.flex
  if fs.score_mod is not None:
    fn = fs.score_mod
    tile = _tile(
      refs, "score", fn, True, False, ops, s.shape, 0, q0, kv0, batch, head,
      replay(scalars, "score"), replay(fetched, "score"),
    )  # fmt: skip
    tile = dataclasses.replace(tile, float_differences=float_differences)
    s = evaluate(fn, tile, s)

  state = fetched.get("bm_state")
  mask_at = lambda shape: _mask(
    spec, refs, ops, shape, q0, kv0, batch, head, 0,
    replay(scalars, "mask"), replay(fetched, "mask"), state,
  )  # fmt: skip
  if not _skips_full_tiles(spec):
    return s, mask_at(s.shape)
  # The hidden scores leave the branch as -inf (no mask tile crosses it).
  hide = lambda s: jnp.where(mask_at(s.shape), s, -jnp.inf)
  return _unless_full(spec, refs, q0, kv0, batch, head, hide, s, state), None


def _mask(
  spec, refs, ops, shape, q0, kv0, batch, head, q_axis, scalars=None,
  vectors=None, state=None,
):  # fmt: skip
  """The tile's mask from mask_mod and the block mask's state (None:
  neither)."""
  mask = None
  if spec.flex.mask_mod is not None:
    fn = spec.flex.mask_mod
    tile = _tile(
      refs, "mask", fn, False, False, ops, shape, q_axis, q0, kv0, batch,
      head, scalars, vectors,
    )  # fmt: skip
    mask = evaluate(fn, tile)
  return _with_state(
    spec, refs, ops, mask, shape, q0, kv0, batch, head, q_axis, state
  )


def _skips_full_tiles(spec: Any, max_head_dim: int | None = None) -> bool:
  """Whether a block mask's full tiles branch past the mask code: a block
  mask with a mask_mod, rows aligned to its tiles (not decode's), and the
  head dim at most `max_head_dim`."""
  fs = spec.flex
  return (
    fs.block is not None
    and fs.mask_mod is not None
    and not getattr(spec, "unaligned_rows", False)
    and (
      max_head_dim is None
      or max(spec.head_dim, spec.head_dim_v) <= max_head_dim
    )
  )


def _unless_full(spec, refs, q0, kv0, batch, head, hide, x, state=None):
  """`x` as is on a full tile, else `hide(x)`: the tile's one state (block-
  mask tiles hold whole kernel tiles; `state` where loaded already) picks
  the branch."""
  from pallas_fa3 import flex  # (flex does not import the kernels)

  if state is None:
    state = _block_state(spec, refs, q0, kv0, batch, head)
  return lax.cond(state == flex.FULL, lambda x: x, hide, x)


# Largest head dim whose backward kernels branch past a block mask's full
# tiles (`kernel_hide`; aot --flex, issue 66).
BACKWARD_SKIP_MAX_HEAD_DIM = 64


def kernel_hide(
  spec: Any,
  refs: dict,
  ops: Any,
  p: jax.Array,
  *,
  q0: Any,
  kv0: Any,
  batch: Any,
  head: Any,
  q_axis: int = 0,
) -> jax.Array:
  """The backward kernels' side: the tile `p` (queries along `q_axis`;
  `head` the query head) with the pairs mask_mod and the block mask's
  state hide set to 0; as is without either. A block mask's full tiles
  run no mask code (a branch on the tile's state). (score_mod and a bias
  are `backward_unsupported`.)"""

  def hide(p):
    mask = _mask(spec, refs, ops, p.shape, q0, kv0, batch, head, q_axis)
    return p if mask is None else jnp.where(mask, p, 0.0)

  # The branch measured without spills in the fused d64 backward (1.13 ->
  # 1.00 of the plain one per visited block); the fused d96 (16/16 B) and
  # the d128 pair (4/4 B at 8 heads) spilled with it: they mask every tile.
  if not _skips_full_tiles(spec, BACKWARD_SKIP_MAX_HEAD_DIM):
    return hide(p)
  return _unless_full(spec, refs, q0, kv0, batch, head, hide, p)


# Largest head dim whose backward kernels take flex options beside segment
# ids: at d256 the dK/dV and dQ pair spilled 24-64 B with them (a window
# mask_mod, softcap, ALiBi), and with a bias needed 232,568 B of shared
# memory (benchmarks/RESULTS.md, "Flex options beside segment ids").
SEGMENTED_FLEX_MAX_HEAD_DIM = 192


def backward_unsupported(
  spec: Any, block_q: int, block_kv: int, tiling: Any = None
) -> str | None:
  """Why the backward kernels (dK/dV and dQ) cannot compile `spec.flex`
  with these tiles, or None: they take mask_mod, block masks, a score_mod
  (its derivative traced in) whose floating captured arrays are read at
  batch/head and at most one position (`param_grad_axes`: the dQ kernel
  sums the gradients of those read by batch, head or query; the dK/dV
  kernel those read by key, unless `tiling`, the `Sm90BackwardConfig`,
  has its consumers share a tile), and a bias (the dQ kernel writes
  dbias; not with softcap), beside segment ids up to
  `SEGMENTED_FLEX_MAX_HEAD_DIM`."""
  fs = spec.flex
  if fs.bias is not None and spec.softcap is not None:
    return "bias with softcap in the backward kernels (dbias is not dS there)"
  d = max(spec.head_dim, spec.head_dim_v)
  if spec.segmented and d > SEGMENTED_FLEX_MAX_HEAD_DIM:
    return (
      f"flex options beside segment_ids at head dim {d} in the backward"
      f" kernels (registers and shared memory: up to"
      f" {SEGMENTED_FLEX_MAX_HEAD_DIM})"
    )
  fn = fs.score_mod
  if fn is not None:
    try:
      plan(fn, True, spec.seq_q, spec.seq_kv, grad=True, relative=True)
    except Refused as e:
      return f"{e} (its derivative, in the backward kernels)"
    if float_positions(fn):  # their gradients: the kernels' row sums
      try:
        axes = param_grad_axes(fn, spec.seq_q, spec.seq_kv)
      except Refused as e:
        return str(e)
      where = {param_kernel(a) for a in axes}
      if (
        tiling is not None
        and "dkdv" in where
        and (tiling.dkdv_consumers == 2 and tiling.dkdv_head_splits == 2)
      ):
        return (
          "score_mod's floating captured arrays read by key position in the"
          " shared-tile dK/dV kernel (two consumers, dkdv_head_splits=2:"
          " their gradients)"
        )
  return kernel_unsupported(spec, block_q, block_kv)


def kernel_score_grad(
  spec: Any,
  refs: dict,
  ops: Any,
  s: jax.Array,
  *,
  q0: Any,
  kv0: Any,
  batch: Any,
  head: Any,
  q_axis: int = 0,
  params: bool = False,
) -> tuple[jax.Array, ...]:
  """The backward kernels' score_mod: (new scores, their derivative in `s`)
  on a tile of natural-unit scores `s` (operands `score{i}` from
  `kernel_operands(..., grad=True)`); with `params` (operands from
  `grad="params"`) also its derivatives in its floating arrays."""
  fn = spec.flex.score_mod
  g = "params" if params else True
  tile = _tile(
    refs, "score", fn, True, g, ops, s.shape, q_axis, q0, kv0, batch, head
  )
  d = max(spec.head_dim, spec.head_dim_v)
  tile = dataclasses.replace(
    tile, float_differences=d <= FLOAT_DIFFERENCE_MAX_HEAD_DIM
  )
  return evaluate_with_grad(fn, tile, s, params)


# The widest head dim whose kernels form a flex function's position
# difference converted to float from float vectors (`Tile.float_differences`,
# the forward's and the backward kernels'): ALiBi d64 causal 1.68 -> 1.42x
# the plain forward, 1.15 -> 1.07x the plain backward (model B: no
# conversion per score beside the exp2s); at d128 the key vector's floats
# spilled 32 B in the forward and took its exp2s out from under the wgmma
# (1.05 -> 1.14x).
FLOAT_DIFFERENCE_MAX_HEAD_DIM = 64


def _block_state(spec, refs, q0, kv0, batch, head):
  """The block mask's state (EMPTY, PARTIAL, FULL) of the block-mask tile
  holding the pair (`q0`, `kv0`)."""
  nb, nh, bq, bkv = spec.flex.block
  return refs["bm_state"][
    batch if nb > 1 else 0,
    head if nh > 1 else 0,
    lax.div(q0, jnp.int32(bq)),
    lax.div(kv0, jnp.int32(bkv)),
  ]


def _with_state(
  spec, refs, ops, mask, shape, q0, kv0, batch, head, q_axis, state=None
):  # fmt: skip
  """`mask` and-ed with the block mask's state of the tile (empty hides,
  full shows every pair, partial asks mask_mod; `state` where loaded
  already); as is without one."""
  from pallas_fa3 import flex  # (flex does not import the kernels)

  fs = spec.flex
  s_shape = shape
  if fs.block is not None:  # the tile's state: empty hides, full shows all
    st_ref = refs["bm_state"]
    nb, nh, bq, bkv = fs.block
    if state is None:
      state = _block_state(spec, refs, q0, kv0, batch, head)
    # One int per row (not a splat tile): 0 hides, 1 asks mask_mod, 2 shows.
    n_q = s_shape[q_axis]
    per_row = lambda x: _vector(
      ops, lax.broadcast_in_dim(x, (n_q,), ()), q_axis
    )
    rows = per_row(state)
    if getattr(spec, "unaligned_rows", False):  # decode: rows from any
      # position, so the tile's rows may reach into the next block-mask
      # row (one at most: `block_q` >= the tile's rows)
      r0 = lax.div(q0, jnp.int32(bq))
      nxt = st_ref[
        batch if nb > 1 else 0,
        head if nh > 1 else 0,
        jnp.minimum(r0 + 1, st_ref.shape[2] - 1),
        lax.div(kv0, jnp.int32(bkv)),
      ]
      local = ops.row_index(n_q) if q_axis == 0 else ops.col_index(n_q)
      switch = per_row((r0 + 1) * jnp.int32(bq) - q0)
      rows = jnp.where(local < switch, rows, per_row(nxt))
    rows = lax.broadcast_in_dim(rows, s_shape, [q_axis])
    if mask is None:
      mask = rows > flex.EMPTY
    else:
      mask = (rows == flex.FULL) | (mask & (rows == flex.PARTIAL))
  return mask
