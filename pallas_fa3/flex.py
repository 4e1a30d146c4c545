"""Flex attention: a user's `score_mod(score, batch, head, q_idx, kv_idx)`
and `mask_mod(batch, head, q_idx, kv_idx)` (plain JAX functions on scalars,
closures over arrays allowed and differentiable), a dense additive `bias`,
and `BlockMask` (per query tile, the key tiles that are empty, partly or
fully visible) with `create_block_mask` and `BlockMask.from_dense`. This
module validates them, lifts the arrays a function closes over into call
operands (`UserFunction`), and evaluates them on a tile of scores for the
backends that serve them: docs/flex.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_fa3.kvcache import DecodeSpec, query_positions
from pallas_fa3.spec import cdiv, check_int

# A block mask's tile states.
EMPTY, PARTIAL, FULL = 0, 1, 2
DEFAULT_BLOCK = 128  # the kernels' 128-key tiles (and the blockwise default)
# Mask entries evaluated per step of `create_block_mask` (bounded memory).
_CHUNK_ELEMENTS = 1 << 22

_SCORE_ARGS = "score_mod(score, batch, head, q_idx, kv_idx) -> score"
_MASK_ARGS = "mask_mod(batch, head, q_idx, kv_idx) -> bool"


def scalar_args(n: int, score_dtype: Any = None) -> tuple:
  """Arguments to trace a mask_mod on (n int32 scalars), with a score of
  `score_dtype` first for a score_mod."""
  ints = (jnp.int32(0),) * n
  return ints if score_dtype is None else (jnp.zeros((), score_dtype),) + ints


class UserFunction:
  """A user's score_mod or mask_mod, closure-converted: `converted(*args,
  *consts)` computes `original(*args)` with the arrays it closes over
  lifted into `consts` (the call's operands, so their gradients reach the
  caller). Hashed by the converted function, which JAX caches per
  original function and argument types: reusing one function reuses one
  compilation."""

  def __init__(self, name: str, original: Callable, score_dtype: Any = None):
    self.name = name
    self.original = original
    self.score_dtype = score_dtype
    self._reads = None
    self.base = None  # `shifted`'s, `rebound`'s: the function it wraps
    # `shifted`'s (batch, head): which of its last two consts (the shard's
    # first batch and head index) it adds to its indices; None otherwise.
    self.shift = None
    args = scalar_args(4, score_dtype)
    try:
      self.converted, consts = _closure_convert(original, args)
    except TypeError as e:
      signature = _SCORE_ARGS if score_dtype is not None else _MASK_ARGS
      raise TypeError(
        f"{name} must be a function {signature} of scalars; calling it"
        f" failed: {e}"
      ) from e
    self.consts = tuple(consts)
    out = jax.eval_shape(self.converted, *args, *self.consts)
    _check_output(name, out, score_dtype)

  def __call__(self, consts: tuple, *args: Any) -> Any:
    return self.converted(*args, *consts)

  def shifted(self, batch: bool, head: bool) -> UserFunction:
    """The function of one shard of a call split over batch (`batch`) and
    / or heads (`head`): it takes the shard's first batch and head index
    as two more int32 0-d consts (after its own) and calls this one with
    the global indices (`local + first`), so a shard computes what the
    whole call computes for its rows. Cached: one per (function, split)."""
    shapes = tuple((jnp.shape(c), jnp.result_type(c)) for c in self.consts)
    key = (self.converted, shapes, batch, head)
    fn = _SHIFTED.get(key)
    if fn is None:
      base, n = self.converted, len(scalar_args(4, self.score_dtype)) - 4

      def converted(*args):
        *ins, b0, h0 = args
        ins[n] = ins[n] + b0 if batch else ins[n]
        ins[n + 1] = ins[n + 1] + h0 if head else ins[n + 1]
        return base(*ins)

      # (placeholder consts: only their shapes and dtypes are read here;
      # the call's own arrays travel in its FlexOperands)
      consts = tuple(
        np.broadcast_to(np.zeros((), dt), shape) for shape, dt in shapes
      ) + (np.int32(0), np.int32(0))
      fn = self._variant(converted, consts=consts, shift=(batch, head))
      if len(_SHIFTED) >= _LIFTED_MAX:
        _SHIFTED.pop(next(iter(_SHIFTED)))
      _SHIFTED[key] = fn
    return fn

  def packed(self, group: int) -> UserFunction:
    """The function of a decode tile whose rows pack a KV head's `group`
    query heads (GQA): it takes the KV head as `head` and the packed row
    `p = q_idx * group + h` as `q_idx`, and calls this one with head
    `head * group + p % group` and `q_idx = p // group`. Cached: one per
    (function, group)."""
    shapes = tuple((jnp.shape(c), jnp.result_type(c)) for c in self.consts)
    key = (self.converted, shapes, group)
    fn = _PACKED.get(key)
    if fn is None:
      base, n = self.converted, len(scalar_args(4, self.score_dtype)) - 4

      def converted(*args):
        ins = list(args)
        head, row = ins[n + 1], ins[n + 2]
        ins[n + 1] = head * group + row % group
        ins[n + 2] = row // group
        return base(*ins)

      fn = self._variant(converted)
      if len(_PACKED) >= _LIFTED_MAX:
        _PACKED.pop(next(iter(_PACKED)))
      _PACKED[key] = fn
    return fn

  def frozen(self) -> UserFunction:
    """This function taking its floating arrays as integers of the same
    width (`flex.frozen`'s operands: their bits), bitcast back before it reads
    them: it computes the same scores, and to JAX and the kernels its
    arrays carry no gradient, so a backward that needs none of theirs
    plans as for a function without learnable arrays (the fused kernel,
    no per-array sums). Itself where no array is floating. Cached: one
    per (function, its consts' types)."""
    floats = differentiable(self.consts)
    if not any(floats) or not _bits_only(self.consts):
      return self
    types = tuple((jnp.shape(c), jnp.result_type(c)) for c in self.consts)
    key = (self.converted, types)
    fn = _FROZEN.get(key)
    if fn is None:
      base, n = self.converted, len(scalar_args(4, self.score_dtype))

      def converted(*args):
        ins = list(args)
        for i, ((_, dtype), f) in enumerate(zip(types, floats)):
          if f:
            ins[n + i] = lax.bitcast_convert_type(ins[n + i], dtype)
        return base(*ins)

      # (placeholder consts: their shapes and integer types)
      consts = tuple(
        np.zeros(shape, _bits_type(dt) if f else dt)
        for (shape, dt), f in zip(types, floats)
      )
      fn = self._variant(converted, consts=consts, shift=self.shift)
      if len(_FROZEN) >= _LIFTED_MAX:
        _FROZEN.pop(next(iter(_FROZEN)))
      _FROZEN[key] = fn
    return fn

  def constants(self) -> tuple:
    """The arrays `converted` itself closes over (concrete ones JAX left
    in it), in the order `rebound` takes them."""
    return tuple(self._closed().consts)

  def rebound(self, constants: tuple) -> UserFunction:
    """This function with `constants` in place of `constants()` (the
    values a traced computation passes in: `jax.custom_partitioning`
    traces a body with no constants of its own)."""
    if not constants:
      return self
    n = len(scalar_args(4, self.score_dtype)) + len(self.consts)
    run = _evaluator(self._closed().jaxpr, n, lambda ins: list(constants))
    return self._variant(run, _reads=self._reads)

  def _variant(self, converted: Callable, **fields: Any) -> UserFunction:
    """A function derived from this one (`shifted`, `rebound`): its name
    and original, `converted` in place of this one's, `base` this one,
    and `fields` (consts, shift, ...) where they differ."""
    fn = object.__new__(UserFunction)
    fn.name, fn.original, fn.score_dtype = (
      self.name,
      self.original,
      self.score_dtype,
    )
    fn.consts, fn.shift, fn._reads = self.consts, None, None
    fn.converted, fn.base = converted, self
    fn.__dict__.update(fields)
    return fn

  def _closed(self) -> Any:
    """Its jaxpr on scalars (its consts abstract), traced once."""
    closed = self.__dict__.get("_closed_jaxpr")
    if closed is None:
      closed = self.__dict__["_closed_jaxpr"] = self._trace()
    return closed

  def _trace(self) -> Any:
    args = scalar_args(4, self.score_dtype)
    consts = [
      jax.ShapeDtypeStruct(jnp.shape(c), jnp.result_type(c))
      for c in self.consts
    ]
    return jax.make_jaxpr(self.converted)(*args, *consts)

  def reads(self, name: str) -> bool:
    """Whether its result depends on index argument `name` ("batch",
    "head", "q_idx" or "kv_idx"), from its jaxpr with dead code removed."""
    if self._reads is None:
      args = scalar_args(4, self.score_dtype)
      jaxpr = self._closed().jaxpr
      try:
        from jax._src.interpreters import partial_eval as pe  # pylint: disable=g-import-not-at-top

        used = pe.dce_jaxpr(jaxpr, [True])[1]
      except (ImportError, AttributeError):  # every argument some op takes
        seen = {id(v) for e in jaxpr.eqns for v in e.invars}
        seen |= {id(v) for v in jaxpr.outvars}
        used = [id(v) in seen for v in jaxpr.invars]
      names = ("batch", "head", "q_idx", "kv_idx")
      first = len(args) - 4  # (a score_mod's score comes first)
      self._reads = {n: bool(used[first + i]) for i, n in enumerate(names)}
    return self._reads[name]

  def __hash__(self) -> int:
    return hash(self.converted)

  def __eq__(self, other: Any) -> bool:
    return isinstance(other, UserFunction) and (
      self.converted is other.converted
    )

  def __repr__(self) -> str:
    name = getattr(self.original, "__name__", type(self.original).__name__)
    return f"<{self.name} {name}>"


# `UserFunction.shifted`'s, by (converted function, its consts' shapes,
# batch, head).
_SHIFTED: dict = {}
# `UserFunction.packed`'s, by (converted function, its consts' shapes,
# group).
_PACKED: dict = {}
# `UserFunction.frozen`'s, by (converted function, its consts' types).
_FROZEN: dict = {}
# The integer type of a floating array's bits, by its item size.
_BITS = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}

# Closure conversions that had to lift integer tracers, by (function, its
# arguments' types, the arrays left in it): one converted function (one
# hash, one compilation) per function reused within a trace.
_LIFTED: dict = {}
_LIFTED_MAX = 256


def _closure_convert(original: Callable, args: tuple) -> tuple:
  """`jax.closure_convert`, lifting every tracer the function closes over.

  JAX lifts only the tracers that may carry a tangent (floating ones): an
  integer array traced by an enclosing `jax.jit` (document ids passed to
  a jitted step) stays a constant of the converted function and leaks
  into every trace it is later called in (the backward's, a kernel's):
  "No constant handler for type: DynamicJaxprTracer". Those are lifted
  into the consts too (after JAX's), as call operands."""
  converted, consts = jax.closure_convert(original, *args)
  closed = jax.make_jaxpr(converted)(*args, *consts)
  leaked = [isinstance(c, jax.core.Tracer) for c in closed.consts]
  if not any(leaked):
    return converted, consts
  kept = tuple(c for c, t in zip(closed.consts, leaked) if not t)
  lifted = [c for c, t in zip(closed.consts, leaked) if t]
  key = (
    original,
    tuple(jax.typeof(a) for a in args + tuple(consts)),
    tuple(leaked),
    tuple(id(c) for c in kept),
  )
  fn = _LIFTED.get(key)
  if fn is None:
    n_in = len(args) + len(consts)

    def merged(ins):  # the lifted tracers from the inputs, the rest kept
      given, extra = iter(ins[n_in:]), iter(kept)
      return [next(given) if t else next(extra) for t in leaked]

    fn = _evaluator(closed.jaxpr, n_in, merged)
    if len(_LIFTED) >= _LIFTED_MAX:
      _LIFTED.pop(next(iter(_LIFTED)))
    _LIFTED[key] = fn
  return fn, list(consts) + lifted


def _evaluator(jaxpr: Any, n_in: int, constants: Callable) -> Callable:
  """A function evaluating `jaxpr` (one result) on its first `n_in`
  inputs, with `constants(inputs)` as its constants."""

  def run(*ins):
    closed = jax.extend.core.ClosedJaxpr(jaxpr, constants(ins))
    (out,) = jax.extend.core.jaxpr_as_fun(closed)(*ins[:n_in])
    return out

  return run


def _check_output(name: str, out: Any, score_dtype: Any) -> None:
  shape = getattr(out, "shape", None)
  dtype = getattr(out, "dtype", None)
  if score_dtype is None:
    if shape != () or dtype != jnp.bool_:
      raise TypeError(
        f"{name} must return one bool per (batch, head, q_idx, kv_idx);"
        f" called on scalars it returned {_describe(out)}"
      )
  elif shape != () or dtype != jnp.dtype(score_dtype):
    raise TypeError(
      f"{name} must return a score of the score's shape and dtype (a"
      f" {jnp.dtype(score_dtype)} scalar); called on scalars it returned"
      f" {_describe(out)}"
    )


def _describe(out: Any) -> str:
  if hasattr(out, "shape") and hasattr(out, "dtype"):
    return f"shape {tuple(out.shape)}, dtype {out.dtype}"
  return f"{type(out).__name__} {out!r}"


def check_function(name: str, fn: Any, score_dtype: Any = None) -> Any:
  """`fn` as a `UserFunction` (None stays None); TypeError naming `name`."""
  if fn is None:
    return None
  if not callable(fn):
    raise TypeError(
      f"{name} must be a callable or None; got {type(fn).__name__} {fn!r}"
    )
  return UserFunction(name, fn, score_dtype)


# ---------------------------------------------------------------------------
# Block masks.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockMask:
  """Which key tiles each query tile sees, per (batch or 1, head or 1).

  `state[b, h, i, j]` is EMPTY (0: no visible pair; never loaded), PARTIAL
  (1: the mask is applied) or FULL (2: every in-range pair visible; no mask
  applied) for query tile i (rows `i * block_q ..`) and key tile j. A
  pytree: build it once (under jit too) and pass it to every layer and
  step; `mask_mod` (from `create_block_mask`) or `dense` (from `from_dense`)
  decides the pairs of partial tiles.

  Attributes:
    state: int8 `[b|1, h|1, cdiv(seq_q, block_q), cdiv(seq_kv, block_kv)]`.
    dense: `from_dense`'s boolean mask `[b|1, h|1, seq_q, seq_kv]`, or None.
    seq_q, seq_kv, block_q, block_kv: the sizes it was built for.
    mask_mod: `create_block_mask`'s function, or None.
  """

  state: jax.Array
  dense: jax.Array | None
  seq_q: int = dataclasses.field(metadata=dict(static=True))
  seq_kv: int = dataclasses.field(metadata=dict(static=True))
  block_q: int = dataclasses.field(metadata=dict(static=True))
  block_kv: int = dataclasses.field(metadata=dict(static=True))
  mask_mod: Any = dataclasses.field(default=None, metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, int, int, int]:
    """(batch or 1, heads or 1, seq_q, seq_kv)."""
    return tuple(self.state.shape[:2]) + (self.seq_q, self.seq_kv)

  @property
  def kv_num_blocks(self) -> jax.Array:
    """Partial tiles per query tile (FlexAttention's `kv_num_blocks`)."""
    return (self.state == PARTIAL).sum(-1, dtype=jnp.int32)

  @property
  def full_kv_num_blocks(self) -> jax.Array:
    return (self.state == FULL).sum(-1, dtype=jnp.int32)

  @property
  def kv_indices(self) -> jax.Array:
    """Per query tile, the partial tiles' indices first (in order)."""
    return _compact(self.state == PARTIAL)

  @property
  def full_kv_indices(self) -> jax.Array:
    return _compact(self.state == FULL)

  def tiles_visited(self) -> jax.Array:
    """Non-empty tiles summed over (batch, head, query tile)."""
    return (self.state != EMPTY).sum(dtype=jnp.int32)

  def to_dense(self) -> jax.Array:
    """The boolean `[b|1, h|1, seq_q, seq_kv]` mask it stands for."""
    b, h, _, _ = self.state.shape
    q = jnp.arange(self.seq_q, dtype=jnp.int32)
    kv = jnp.arange(self.seq_kv, dtype=jnp.int32)
    fn = check_function("mask_mod", self.mask_mod)
    return visible(
      self,
      fn,
      () if fn is None else fn.consts,
      jnp.arange(b, dtype=jnp.int32)[:, None, None, None],
      jnp.arange(h, dtype=jnp.int32)[None, :, None, None],
      q[None, None, :, None],
      kv[None, None, None, :],
      (b, h, self.seq_q, self.seq_kv),
    )

  @classmethod
  def from_dense(
    cls,
    mask: Any,
    *,
    block_q: int | None = None,
    block_kv: int | None = None,
  ) -> BlockMask:
    """The block mask of a boolean `[b|1, h|1, seq_q, seq_kv]` mask (kept:
    partial tiles read it)."""
    mask = jnp.asarray(mask)
    if mask.ndim != 4 or mask.dtype != jnp.bool_:
      raise TypeError(
        "BlockMask.from_dense: mask must be a boolean [b|1, h|1, seq_q,"
        f" seq_kv] array; got shape {tuple(mask.shape)}, dtype {mask.dtype}"
      )
    b, h, sq, skv = mask.shape
    bq, bkv = _blocks(block_q, block_kv, sq, skv)
    nq, nkv = cdiv(sq, bq), cdiv(skv, bkv)
    pad = ((0, 0), (0, 0), (0, nq * bq - sq), (0, nkv * bkv - skv))
    tiles = lambda x, v: jnp.pad(x, pad, constant_values=v).reshape(
      b, h, nq, bq, nkv, bkv
    )
    any_ = tiles(mask, False).any(axis=(3, 5))
    all_ = tiles(mask, True).all(axis=(3, 5))
    return cls(_state(any_, all_), mask, sq, skv, bq, bkv)


def _compact(selected: jax.Array) -> jax.Array:
  """Per row of the last axis, the selected indices first (stable)."""
  return jnp.argsort(~selected, axis=-1, stable=True).astype(jnp.int32)


def _state(any_: jax.Array, all_: jax.Array) -> jax.Array:
  return jnp.where(all_, FULL, jnp.where(any_, PARTIAL, EMPTY)).astype(jnp.int8)


def _blocks(block_q: Any, block_kv: Any, seq_q: int, seq_kv: int) -> tuple:
  bq = DEFAULT_BLOCK if block_q is None else block_q
  bkv = DEFAULT_BLOCK if block_kv is None else block_kv
  bq = check_int("block_q", bq, minimum=1)
  bkv = check_int("block_kv", bkv, minimum=1)
  return min(bq, seq_q), min(bkv, seq_kv)


def create_block_mask(
  mask_mod: Callable,
  batch: int | None,
  heads: int | None,
  seq_q: int,
  seq_kv: int,
  *,
  block_q: int | None = None,
  block_kv: int | None = None,
) -> BlockMask:
  """The `BlockMask` of `mask_mod` over `[batch, heads, seq_q, seq_kv]`
  (batch or heads None: the same for every one, stored once). Evaluated on
  device one query tile and a bounded chunk of key tiles at a time, so
  memory stays bounded at any length; works under `jax.jit`. Tiles are
  `block_q x block_kv` (default 128 x 128, clamped to the sequences).

  Raises:
    TypeError / ValueError naming the argument.
  """
  from pallas_fa3.spec import check_int

  fn = check_function("mask_mod", mask_mod)
  if fn is None:
    raise TypeError("create_block_mask: mask_mod must be a callable")
  for arg, value, index, size in (
    ("batch", batch, "batch", "batch size"),
    ("heads", heads, "head", "number of query heads"),
  ):
    if value is None and fn.reads(index):
      raise ValueError(
        f"create_block_mask: {arg}=None builds one mask shared by every"
        f" {index}, but mask_mod reads its {index} index (every {index}"
        f" would get {index} 0's tiles); pass {arg}= the {size}"
      )
  b = 1 if batch is None else check_int("batch", batch, minimum=1)
  h = 1 if heads is None else check_int("heads", heads, minimum=1)
  sq = check_int("seq_q", seq_q, minimum=1)
  skv = check_int("seq_kv", seq_kv, minimum=1)
  bq, bkv = _blocks(block_q, block_kv, sq, skv)
  nq, nkv = cdiv(sq, bq), cdiv(skv, bkv)
  per_tile = b * h * bq * bkv
  chunk = max(1, min(nkv, _CHUNK_ELEMENTS // per_tile))
  n_chunks = cdiv(nkv, chunk)
  bi = jnp.arange(b, dtype=jnp.int32)[:, None, None, None]
  hi = jnp.arange(h, dtype=jnp.int32)[None, :, None, None]
  consts = fn.consts

  def q_tile(i):
    q = i * bq + jnp.arange(bq, dtype=jnp.int32)

    def kv_chunk(c):
      kv = (c * chunk + jnp.arange(chunk, dtype=jnp.int32))[
        :, None
      ] * bkv + jnp.arange(bkv, dtype=jnp.int32)
      in_range = (q < sq)[:, None, None] & (kv < skv)[None]
      vis = _grid(lambda *a: fn(consts, *a))(
        bi[..., None],
        hi[..., None],
        jnp.minimum(q, sq - 1)[None, None, :, None, None],
        jnp.minimum(kv, skv - 1)[None, None, None],
      )
      vis = jnp.broadcast_to(vis, (b, h, bq, chunk, bkv))
      any_ = (vis & in_range).any(axis=(2, 4))
      all_ = (vis | ~in_range).all(axis=(2, 4))
      return any_, all_

    any_, all_ = jax.lax.map(kv_chunk, jnp.arange(n_chunks, dtype=jnp.int32))
    # [n_chunks, b, h, chunk] -> [b, h, nkv]
    flat = lambda x: jnp.moveaxis(x, 0, 2).reshape(b, h, -1)[..., :nkv]
    return flat(any_), flat(all_)

  if n_chunks == 1 and nq * per_tile * chunk <= _CHUNK_ELEMENTS:
    any_, all_ = jax.vmap(q_tile)(jnp.arange(nq, dtype=jnp.int32))
  else:
    any_, all_ = jax.lax.map(q_tile, jnp.arange(nq, dtype=jnp.int32))
  any_, all_ = (jnp.moveaxis(x, 0, 2) for x in (any_, all_))
  return BlockMask(_state(any_, all_), None, sq, skv, bq, bkv, mask_mod)


def _grid(fn: Callable) -> Callable:
  """`fn` on scalars, mapped over arguments that broadcast to one
  `[B, H, Q, K]` grid; returns the grid of its results."""

  def mapped(*args):
    shape = jnp.broadcast_shapes(*(jnp.shape(a) for a in args))
    f = fn
    for _ in shape:
      f = jax.vmap(f)
    return f(*(jnp.broadcast_to(a, shape) for a in args))

  return mapped


# ---------------------------------------------------------------------------
# What a call carries.


@dataclasses.dataclass(frozen=True)
class FlexSpec:
  """The static half of a call's flex options (`AttentionSpec.flex`).

  Attributes:
    score_mod, mask_mod: `UserFunction`s or None.
    bias: the bias's leading dims `(b|1, h|1)`, or None.
    block: a block mask's `(b|1, h|1, block_q, block_kv)`, or None.
    dense: the block mask carries a dense mask (`from_dense`).
    bias_grad: whether the backward computes dbias (False where the bias
      was not differentiated: its cotangent is zeros, no dS is written).
  """

  score_mod: Any = None
  mask_mod: Any = None
  bias: tuple[int, int] | None = None
  block: tuple[int, int, int, int] | None = None
  dense: bool = False
  bias_grad: bool = True

  @property
  def masks(self) -> bool:
    """Whether it hides pairs (a mask_mod or a block mask)."""
    return self.mask_mod is not None or self.block is not None

  @property
  def block_tiles(self) -> tuple[int, int] | None:
    return None if self.block is None else self.block[2:]

  def names(self) -> tuple[str, ...]:
    """The argument names in use (for refusals)."""
    return tuple(
      name
      for name, on in (
        ("score_mod", self.score_mod is not None),
        ("mask_mod", self.mask_mod is not None),
        ("block_mask", self.block is not None),
        ("bias", self.bias is not None),
      )
      if on
    )


class FlexOperands(NamedTuple):
  """The array half: the bias, the arrays each function closes over, and
  the block mask (a `BlockMask` pytree)."""

  bias: jax.Array | None = None
  score_consts: tuple = ()
  mask_consts: tuple = ()
  block_mask: Any = None


def shard_local(
  fspec: FlexSpec,
  ops: FlexOperands,
  *,
  batch: int,
  heads: int,
  first: tuple[jax.Array, jax.Array],
  split: tuple[bool, bool],
) -> tuple[FlexSpec, FlexOperands]:
  """One shard's flex options, for a call split over batch and / or query
  heads (`split`) whose shard holds `batch` rows and `heads` query heads
  from global indices `first` (int32 scalars). `ops` holds the shard's
  part of the bias and the block mask (split where not broadcast) and the
  functions' arrays whole; a function that reads a split index is
  `shifted` (it sees global indices, its arrays read as in the whole
  call), so the shard computes the whole call's rows."""

  def dims(d):
    if d is None:
      return None
    nb, nh = d[:2]
    return (batch if nb > 1 else 1, heads if nh > 1 else 1) + tuple(d[2:])

  def local(fn, consts):
    reads = fn is not None and any(
      s and fn.reads(i) for s, i in zip(split, ("batch", "head"))
    )
    if not reads:
      return fn, consts
    return fn.shifted(*split), tuple(consts) + tuple(
      jnp.asarray(f, jnp.int32) for f in first
    )

  score, score_consts = local(fspec.score_mod, ops.score_consts)
  mask, mask_consts = local(fspec.mask_mod, ops.mask_consts)
  return (
    dataclasses.replace(
      fspec,
      score_mod=score,
      mask_mod=mask,
      bias=dims(fspec.bias),
      block=dims(fspec.block),
    ),
    FlexOperands(ops.bias, score_consts, mask_consts, ops.block_mask),
  )


def _or_one(n: int) -> str:
  """A broadcastable leading dim's allowed sizes: `n or 1` (`1` if n is)."""
  return "1" if n == 1 else f"{n} or 1"


def check_bias(
  bias: Any, batch: int, heads: int, seq_q: int, seq_kv: int
) -> jax.Array | None:
  """`bias` as an array `[b|1, h|1, seq_q, seq_kv]` of a float dtype."""
  if bias is None:
    return None
  if not (hasattr(bias, "shape") and hasattr(bias, "dtype")):
    raise TypeError(
      "bias must be an array [batch|1, heads_q|1, seq_q, seq_kv]; got"
      f" {type(bias).__name__}"
    )
  bias = jnp.asarray(bias)
  ok = (
    bias.ndim == 4
    and bias.shape[0] in (1, batch)
    and bias.shape[1] in (1, heads)
    and tuple(bias.shape[2:]) == (seq_q, seq_kv)
  )
  if not ok:
    raise ValueError(
      f"bias must have shape [{_or_one(batch)}, {_or_one(heads)}, {seq_q},"
      f" {seq_kv}] ([batch|1, heads_q|1, seq_q, seq_kv]); got shape"
      f" {tuple(bias.shape)}"
    )
  if not jnp.issubdtype(bias.dtype, jnp.floating):
    raise TypeError(
      f"bias must be a floating-point array; got dtype {bias.dtype}"
    )
  return bias


def check_block_mask(
  block_mask: Any, batch: int, heads: int, seq_q: int, seq_kv: int
) -> BlockMask | None:
  if block_mask is None:
    return None
  if not isinstance(block_mask, BlockMask):
    raise TypeError(
      "block_mask must be a pallas_fa3.BlockMask (create_block_mask or"
      f" BlockMask.from_dense) or None; got {type(block_mask).__name__}"
    )
  b, h, _, _ = block_mask.state.shape
  if (
    b not in (1, batch)
    or h not in (1, heads)
    or (block_mask.seq_q, block_mask.seq_kv) != (seq_q, seq_kv)
  ):
    raise ValueError(
      f"block_mask was built for [batch, heads, seq_q, seq_kv] = {list((b, h, block_mask.seq_q, block_mask.seq_kv))};"
      f" this call needs [{_or_one(batch)}, {_or_one(heads)}, {seq_q},"
      f" {seq_kv}]"
    )
  return block_mask


def prepare(
  *,
  score_mod: Any,
  mask_mod: Any,
  block_mask: Any,
  bias: Any,
  batch: int,
  heads: int,
  seq_q: int,
  seq_kv: int,
  score_dtype: Any = jnp.float32,
) -> tuple[FlexSpec | None, FlexOperands | None]:
  """The call's flex options validated: `(FlexSpec, FlexOperands)`, or
  `(None, None)` when it has none. A block mask from `create_block_mask`
  brings its mask_mod when `mask_mod` is None. `score_dtype`: the scores'
  dtype score_mod must keep (float32; the oracle's intermediate dtype)."""
  block_mask = check_block_mask(block_mask, batch, heads, seq_q, seq_kv)
  if mask_mod is None and block_mask is not None:
    mask_mod = block_mask.mask_mod
  score = check_function("score_mod", score_mod, score_dtype)
  mask = check_function("mask_mod", mask_mod)
  bias = check_bias(bias, batch, heads, seq_q, seq_kv)
  if score is None and mask is None and bias is None and block_mask is None:
    return None, None
  block = None
  if block_mask is not None:
    block = tuple(block_mask.state.shape[:2]) + (
      block_mask.block_q,
      block_mask.block_kv,
    )
  fspec = FlexSpec(
    score,
    mask,
    None if bias is None else tuple(bias.shape[:2]),
    block,
    block_mask is not None and block_mask.dense is not None,
  )
  ops = FlexOperands(
    bias,
    () if score is None else score.consts,
    () if mask is None else mask.consts,
    block_mask,
  )
  return fspec, ops


# ---------------------------------------------------------------------------
# One tile: what the backends call.


def modify_scores(
  fspec: FlexSpec,
  score_consts: tuple,
  bias_tile: jax.Array | None,
  s: jax.Array,
  b: jax.Array,
  h: jax.Array,
  q: jax.Array,
  kv: jax.Array,
) -> jax.Array:
  """Scores `[B, H, Q, K]` (scaled logits, after softcap) plus the bias
  tile, then through score_mod; b, h, q, kv broadcast against s."""
  if bias_tile is not None:
    s = s + bias_tile.astype(s.dtype)
  if fspec.score_mod is not None:
    fn = lambda *a: fspec.score_mod(score_consts, *a)
    s = _grid(fn)(s, b, h, q, kv).astype(s.dtype)
  return s


def visible(
  block_mask: BlockMask | None,
  mask_mod: UserFunction | None,
  mask_consts: tuple,
  b: jax.Array,
  h: jax.Array,
  q: jax.Array,
  kv: jax.Array,
  shape: tuple[int, int, int, int],
  dense_tile: jax.Array | None = None,
  block_index: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array | None:
  """Which pairs of a `[B, H, Q, K]` tile the flex options let through
  (None: all): a full tile of the block mask all, an empty one none, a
  partial one those mask_mod (or the dense mask) accepts. mask_mod sees
  `q`, `kv` as they are; the block mask is read at `block_index` (the
  positions clipped into it; default `q`, `kv`, which must be in range)."""
  vis = None
  if mask_mod is not None:
    vis = _grid(lambda *a: mask_mod(mask_consts, *a))(b, h, q, kv)
  if block_mask is not None:
    if block_index is not None:
      q, kv = block_index
    if dense_tile is None and block_mask.dense is not None:
      d = block_mask.dense
      dense_tile = d[
        jnp.minimum(b, d.shape[0] - 1),
        jnp.minimum(h, d.shape[1] - 1),
        q,
        kv,
      ]
    if dense_tile is not None:
      vis = dense_tile if vis is None else vis & dense_tile
    st = block_mask.state
    state = st[
      jnp.minimum(b, st.shape[0] - 1),
      jnp.minimum(h, st.shape[1] - 1),
      q // block_mask.block_q,
      kv // block_mask.block_kv,
    ]
    partial = state == PARTIAL
    vis = (state == FULL) | (partial if vis is None else partial & vis)
  return None if vis is None else jnp.broadcast_to(vis, shape)


def tile_visible(
  fspec: FlexSpec, ops: FlexOperands, b, h, q, kv, shape
) -> jax.Array | None:
  """`visible` with a call's spec and operands."""
  return visible(
    ops.block_mask, fspec.mask_mod, ops.mask_consts, b, h, q, kv, shape
  )


def live_tiles(state: jax.Array) -> jax.Array:
  """`[nq, nkv]`: the tiles any (batch, head) sees (the blockwise twin
  computes every batch and head of a tile together)."""
  return (state != EMPTY).any(axis=(0, 1))


def order_live(live_row: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(indices with the live ones first, how many are live)."""
  return _compact(live_row), live_row.sum(dtype=jnp.int32)


def differentiable(consts: tuple) -> tuple[bool, ...]:
  """Which closed-over arrays carry a gradient (the floating ones)."""
  return tuple(jnp.issubdtype(jnp.result_type(c), jnp.inexact) for c in consts)


def cotangents(ops: FlexOperands, dbias: Any, dscore: tuple) -> FlexOperands:
  """The operands' cotangent tree: `dbias`, the score_mod arrays' `dscore`
  (floating ones; float0 zeros for integer ones), zeros for the mask's."""
  if ops.bias is not None and dbias is None:  # (not differentiated)
    dbias = zero_cotangent(ops.bias)
  return FlexOperands(
    dbias if ops.bias is not None else None,
    tuple(
      d if d is not None else zero_cotangent(c)
      for c, d in zip(ops.score_consts, dscore)
    ),
    tuple(zero_cotangent(c) for c in ops.mask_consts),
    jax.tree.map(zero_cotangent, ops.block_mask),
  )


def frozen(fs: FlexSpec, ops: FlexOperands) -> tuple[FlexSpec, FlexOperands]:
  """The call's flex options for a backward that needs no gradient of the
  score_mod's arrays (none of them was differentiated): the function
  `UserFunction.frozen`, its floating arrays passed as their bits. The
  same scores; `cotangents` of the original operands gives those arrays
  zeros."""
  fn = fs.score_mod
  if fn is None or fn.frozen() is fn:
    return fs, ops
  floats = differentiable(ops.score_consts)
  consts = tuple(
    lax.bitcast_convert_type(c, _bits_type(c.dtype)) if f else c
    for c, f in zip(map(jnp.asarray, ops.score_consts), floats)
  )
  return dataclasses.replace(fs, score_mod=fn.frozen()), ops._replace(
    score_consts=consts
  )


def as_differentiated(
  fs: FlexSpec, ops: FlexOperands, *, score_consts: bool, bias: bool
) -> tuple[FlexSpec, FlexOperands]:
  """The call's flex options for a pass that differentiates (backward) or
  carries tangents of (forward mode) only what is said: without
  `score_consts` the score_mod over frozen arrays (`frozen`), without
  `bias` a bias with `bias_grad=False`. The same scores."""
  if not score_consts:
    fs, ops = frozen(fs, ops)
  if not bias and fs.bias is not None:
    fs = dataclasses.replace(fs, bias_grad=False)
  return fs, ops


def _bits_only(consts: tuple) -> bool:
  """Whether every floating array of `consts` is real (has an integer type
  of its width to pass its bits as)."""
  return all(
    jnp.issubdtype(jnp.result_type(c), jnp.floating)
    and jnp.dtype(jnp.result_type(c)).itemsize in _BITS
    for c, d in zip(consts, differentiable(consts))
    if d
  )


def _bits_type(dtype: Any) -> Any:
  """The integer type a floating `dtype`'s bits travel as."""
  return _BITS[jnp.dtype(dtype).itemsize]


def zero_cotangent(x: Any) -> Any:
  x = jnp.asarray(x) if not hasattr(x, "dtype") else x
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros(x.shape, x.dtype)
  return np.zeros(x.shape, dtype=jax.dtypes.float0)


def float_consts(ops: FlexOperands) -> tuple:
  """score_mod's floating closed-over arrays (those with a gradient)."""
  return tuple(
    c for c, d in zip(ops.score_consts, differentiable(ops.score_consts)) if d
  )


def with_float_consts(ops: FlexOperands, floats: tuple) -> FlexOperands:
  """`ops` with score_mod's floating arrays replaced by `floats`."""
  it = iter(floats)
  consts = tuple(
    next(it) if d else c
    for c, d in zip(ops.score_consts, differentiable(ops.score_consts))
  )
  return ops._replace(score_consts=consts)


def spread_float_grads(ops: FlexOperands, grads: tuple) -> tuple:
  """Per closed-over array: its gradient (the floating ones) or None."""
  it = iter(grads)
  return tuple(
    next(it) if d else None for d in differentiable(ops.score_consts)
  )


def head_index(heads_kv: int, group: int) -> jax.Array:
  """Query head indices in the `[hk, g]` grouped layout."""
  return jnp.arange(heads_kv, dtype=jnp.int32)[:, None] * group + jnp.arange(
    group, dtype=jnp.int32
  )


def grouped(x: jax.Array | None, heads_kv: int, group: int) -> Any:
  """`[b|1, hq|1, ...]` -> `[b|1, hk|1, g|1, ...]` (the grouped layout)."""
  if x is None:
    return None
  if x.shape[1] == 1:
    return x[:, :, None]
  return x.reshape((x.shape[0], heads_kv, group) + x.shape[2:])


def decode_scores(
  spec: DecodeSpec,
  ops: FlexOperands,
  s: jax.Array,
  batch: jax.Array,
  lengths: jax.Array,
  kv_pos: jax.Array,
) -> tuple[jax.Array, jax.Array | None]:
  """Decode scores `[B, hk, g, sq, K]` (scaled logits, after softcap) of
  sequences `batch` `[B]` with `lengths` `[B]` over key positions `kv_pos`
  `[K]` through score_mod, and the pairs mask_mod / the block mask let
  through (None: all): query i sits at position `lengths - seq_q + i`."""
  fs = spec.flex
  bi = batch[:, None, None, None, None]
  h = head_index(spec.heads_kv, spec.group_size)[None, :, :, None, None]
  qpos = query_positions(
    spec, lengths[:, None], jnp.arange(spec.seq_q, dtype=jnp.int32)
  )
  qi = qpos[:, None, None, :, None]
  ki = kv_pos[None, None, None, None, :]
  if fs.score_mod is not None:
    s = modify_scores(fs, ops.score_consts, None, s, bi, h, qi, ki)
  # mask_mod sees the true positions, negative ones included (a query of
  # a sequence shorter than seq_q), as score_mod and the decode kernel do;
  # only the block mask's reads are clipped into it (the kernel reads row
  # 0's state there too; keys past the capacity are hidden by length).
  top = spec.capacity - 1
  vis = visible(
    ops.block_mask,
    fs.mask_mod,
    ops.mask_consts,
    bi,
    h,
    qi,
    ki,
    s.shape,
    block_index=(jnp.clip(qi, 0, top), jnp.clip(ki, 0, top)),
  )
  return s, vis
