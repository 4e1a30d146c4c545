"""The score pipeline of the Hopper kernels: how a tile of Q K^T becomes the
logits and probabilities a kernel's softmax reads, written once for the
forward, FP8 forward, tangent, dQ, dK/dV, fused backward, decode and MLA
kernels. In order: the softmax scale (with an e4m3 operand's descale),
softcap, a dense bias, a score_mod (and its derivative in the backward),
then what hides a score: the built-in positional rule (causal, window,
padded keys), segment ids' bounds, a decode row's cache length and
left padding, a mask_mod and a block mask's partial tiles. A kernel says
where its tile sits (`At`) and takes `logits` (forward kernels: base-2
logits, hidden ones at -inf, for `online_softmax`) or `probabilities`
(backward kernels: `P = exp2(x - lse)`, hidden ones 0).
docs/kernels.md#the-score-pipeline
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pallas_fa3 import masking
from pallas_fa3.kernels.sm90 import flex_tile
from pallas_fa3.spec import LOG2E


@dataclasses.dataclass(frozen=True)
class At:
  """Where a score tile sits and what may hide its entries.

  Queries along `q_axis` from position `q0`, keys along the other axis
  from `kv0` (`q_axis=1`: a transposed tile, S^T, keys as rows).
  `masked`: the tile needs the built-in rule (a partial tile of causal or a
  window; segment ids' `bounds` replace it: `(lo, hi, dim)`, per row along
  tile dim `dim`, positions folded in, `segments.kernel_bounds`).
  `check_seq_kv=False` skips the padded-key test where no row reaches a
  padded key. `decode = (pos, length, start)`: decode rows, each query at
  its own position `pos` (a vector along the rows), keys below the cache
  `length` and from `start` (cache_leftpad; None without). `flex = (refs,
  batch, query head)` with `spec.flex`: its bias, score_mod and masks.
  """

  q0: Any
  kv0: Any
  q_axis: int = 0
  masked: bool = False
  bounds: tuple | None = None
  check_seq_kv: bool = True
  decode: tuple | None = None
  flex: tuple | None = None


def query_tile_at(
  spec: Any, row0: Any, kv0: Any, *, masked: bool, bounds: tuple | None,
  flex: tuple | None = None,
) -> At:  # fmt: skip
  """A forward kernel's step: queries as rows from `row0`, keys from `kv0`;
  `bounds` the rows' key bounds `(lo, hi)` (segment ids) or None. Padded
  keys are tested only where rows see keys after their own position
  (bottom-right causal rows never reach one)."""
  return At(
    row0, kv0, masked=masked,
    bounds=None if bounds is None else (*bounds, 0),
    check_seq_kv=spec.window_right != 0, flex=flex,
  )  # fmt: skip


def softcapped(
  spec: Any, s: jax.Array, descale: Any = None
) -> tuple[jax.Array, Any]:
  """(scores, their base-2 scale): raw scores and `scale * log2(e)`, or
  with softcap `tanh(s * scale / c)` and `c * log2(e)` (the tanh is also
  the backward's `1 - tanh^2`). `descale`: an e4m3 operand's scale, folded
  into the base-2 scale or, with softcap, into the tanh's argument."""
  if spec.softcap is None:
    scale_log2 = jnp.float32(spec.softmax_scale * LOG2E)
    return s, scale_log2 if descale is None else scale_log2 * descale
  factor = jnp.float32(spec.softmax_scale / spec.softcap)
  if descale is not None:
    factor = factor * descale
  return jnp.tanh(s * factor), jnp.float32(spec.softcap * LOG2E)


def scaled_once(s: jax.Array, scale: Any) -> jax.Array:
  """`s * scale`, rounded once: an optimization barrier keeps LLVM from
  contracting the multiply into a later `x - max` (an FFMA). With the FFMA
  the row max's own exponent is the product's rounding error, which at
  large logits (|s * scale| ~ 1e10, one ulp ~ 1000) sends exp2 to 0 or
  inf; with one rounding it is exactly 0. Costs an FMUL and an FADD per
  score where FA3 spends one FFMA (docs/numerics.md#large-logits)."""
  return lax.optimization_barrier(s * scale)


def builtin_mask(
  ops: Any, spec: Any, shape: tuple[int, int], at: At
) -> jax.Array | None:
  """Which entries the built-in options leave visible (None: all): decode
  rows' lengths and windows (`at.decode`), segment ids' bounds, or the
  positional rule of a `masked` tile; 1-D index vectors only before the
  broadcast compares, so no index tile lives in registers."""
  rows, cols = ops.row_index(shape[0]), ops.col_index(shape[1])
  if at.decode is not None:  # queries as rows, each at its own position
    pos, length, start = at.decode
    keys = at.kv0 + cols
    ok = lambda a, dim: lax.broadcast_in_dim(a, shape, [dim])
    mask = ok(keys < length, 1)
    if start is not None:  # cache_leftpad
      mask = mask & ok(keys >= start, 1)
    if spec.window_right is not None:
      mask = mask & (ok(keys, 1) <= ok(pos + spec.window_right, 0))
    if spec.window_left is not None:
      mask = mask & (ok(keys, 1) >= ok(pos - spec.window_left, 0))
    return mask
  if not at.masked:
    return None
  if at.bounds is not None:  # positions folded into the bounds
    lo, hi, dim = at.bounds
    index = rows if dim == 1 else cols  # along the other dim
    base = at.kv0 if dim == at.q_axis else at.q0  # per query row: keys
    return masking.within_bounds(index, lo, hi, base, shape, dim)
  q_idx, kv_idx = (rows, cols) if at.q_axis == 0 else (cols, rows)
  return masking.visible_tile_at(
    spec, at.q0, at.kv0, q_idx, kv_idx, shape, at.q_axis,
    check_seq_kv=at.check_seq_kv,
  )  # fmt: skip


def logits(
  ops: Any,
  spec: Any,
  s: jax.Array,
  at: At,
  *,
  descale: Any = None,
  flex_spec: Any = None,
  scalars: dict | None = None,
  fetched: dict | None = None,
  float_differences: bool = False,
) -> jax.Array:
  """The forward kernels' side: the tile's base-2 logits `x` (`scaled_once`
  of the modified scores), every hidden entry -inf. A score_mod and a bias
  act on natural units (then base 2); without them the raw scores are
  scaled once. `flex_spec`: what `flex_tile` reads of the call where it is
  not `spec` (decode's packed view); `scalars` / `fetched` /
  `float_differences`: `flex_tile.kernel_scores`' (loads issued earlier)."""
  t, scale_log2 = softcapped(spec, s, descale)
  mask = None
  if at.flex is not None and spec.flex is not None:
    fs = spec.flex
    if fs.score_mod is not None or fs.bias is not None:
      t = flex_tile.natural_units(spec, t)
      scale_log2 = jnp.float32(LOG2E)
    refs, batch, head = at.flex
    view = spec if flex_spec is None else flex_spec
    t, mask = flex_tile.kernel_scores(
      view, refs, ops, t, q0=at.q0, kv0=at.kv0,
      batch=batch, head=head, scalars=scalars, fetched=fetched,
      float_differences=float_differences,
    )  # fmt: skip
  builtin = builtin_mask(ops, spec, s.shape, at)
  if builtin is not None:
    mask = builtin if mask is None else mask & builtin
  x = scaled_once(t, scale_log2)
  return x if mask is None else jnp.where(mask, x, -jnp.inf)


def online_softmax(
  x: jax.Array, m: jax.Array, l: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """One online-softmax step in base 2 over `logits`' `x` (queries as
  rows; `m` the running max of earlier logits, `l` the running sum):
  (p, alpha, m_new, l_new). A row with no visible key yet (max -inf)
  exponentiates against 0: no NaN."""
  m_new = jnp.maximum(m, x.max(axis=1))
  m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.exp2(m - m_ref)
  p = jnp.exp2(x - lax.broadcast_in_dim(m_ref, x.shape, [0]))
  return p, alpha, m_new, l * alpha + p.sum(axis=1)


def probabilities(
  ops: Any,
  spec: Any,
  s: jax.Array,
  lse2: jax.Array,
  at: At,
  *,
  params: bool = False,
) -> tuple[jax.Array, ...]:
  """The backward kernels' side: `P = exp2(x - lse2)` of the tile's
  logits (`lse2` a vector along `at.q_axis`, or a function loading it
  where it is first used), hidden entries 0. The
  exponent is clamped at 0: exact for every key a row sees (lse >= each of
  its scores); it keeps P finite for keys past seq_kv (zero K rows: P =
  exp2(-lse2) would overflow where lse < -88) without masking them, and at
  large logits, where lse's own rounding (one ulp of |s| ~ 1e10 is ~1000)
  can put a score above it. Returns (P, ctx): ctx the softcap's tanh or
  None, with a score_mod `(tanh or None, its derivative)`, for
  `times_derivative`; with `params` a third result, the score_mod's
  derivatives in its floating arrays (tiles)."""
  shape = s.shape
  t, scale_log2 = softcapped(spec, s)
  fx = at.flex is not None and spec.flex is not None
  grad = d_params = None
  y = t
  if fx:  # a bias, then a score_mod (with its derivative)
    refs, batch, head = at.flex
    y, scale_log2, grad = flex_tile.backward_scores(
      spec, refs, ops, t, scale_log2, q0=at.q0, kv0=at.kv0, batch=batch,
      head=head, q_axis=at.q_axis, params=params,
    )  # fmt: skip
    if params:
      grad, d_params = grad
  x = scaled_once(y, scale_log2)
  lse2 = lse2() if callable(lse2) else lse2
  x = x - lax.broadcast_in_dim(lse2, shape, [at.q_axis])
  p = jnp.exp2(jnp.minimum(x, 0.0))
  if fx:  # every tile: the flex mask is not positional
    p = flex_tile.kernel_hide(
      spec, refs, ops, p, q0=at.q0, kv0=at.kv0, batch=batch, head=head,
      q_axis=at.q_axis,
    )  # fmt: skip
  builtin = builtin_mask(ops, spec, shape, at)
  if builtin is not None:
    p = jnp.where(builtin, p, 0.0)
  t = None if spec.softcap is None else t
  ctx = t if grad is None else (t, grad)
  return (p, ctx, d_params) if params else (p, ctx)


def times_derivative(ds: jax.Array, ctx: Any) -> jax.Array:
  """dS times the score's derivative, from `probabilities`' ctx: the
  softcap's `1 - tanh^2` (ctx the tanh; as is with None), and with `(t,
  g)` a score_mod's `g` too."""
  if isinstance(ctx, tuple):
    ctx, g = ctx
    ds = ds * g
  return ds if ctx is None else ds * (1.0 - ctx * ctx)
