"""What the blockwise twin's passes share: its config (the tile sizes), the
tiling, padding, one tile's scores (mask and softcap), and the walk over a
tile range that masks only its boundary tiles: docs/api.md#backends.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallas_fa3 import flex, masking
from pallas_fa3.spec import (
  HIGHEST,
  LOG2E,
  AttentionSpec,
  cdiv,
  check_int_fields,
)

_MAX_BLOCK = 8192  # a tile this large is no longer "blockwise" on any machine


@dataclasses.dataclass(frozen=True)
class BlockwiseConfig:
  """Tile sizes of the blockwise backend (hashable: a static argument).

  Attributes:
    block_q: query rows per tile (the kernels' Br).
    block_kv: key/value columns per tile (the kernels' Bc).

  A tile larger than its sequence is clamped to the sequence length, which
  computes the same values as padding it.
  """

  block_q: int = 128
  block_kv: int = 128

  def __post_init__(self) -> None:
    block = dict(minimum=1, maximum=_MAX_BLOCK)
    check_int_fields(self, block_q=block, block_kv=block)


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Effective tile sizes and counts for one spec (a tile larger than its
  sequence is clamped to it)."""

  block_q: int
  block_kv: int
  num_q: int
  num_kv: int

  @classmethod
  def of(cls, spec: AttentionSpec, block_q: int, block_kv: int) -> Tiling:
    bq = min(block_q, spec.seq_q)
    bkv = min(block_kv, spec.seq_kv)
    return cls(bq, bkv, cdiv(spec.seq_q, bq), cdiv(spec.seq_kv, bkv))


def dot_f32(subscripts: str, a: jax.Array, b: jax.Array) -> jax.Array:
  """`einsum(subscripts, a, b)` accumulated in float32 at full precision
  (the twin's GEMMs)."""
  return jnp.einsum(
    subscripts, a, b, preferred_element_type=jnp.float32, precision=HIGHEST
  )


def pad_seq(x: jax.Array, length: int, value: float = 0) -> jax.Array:
  """Pads axis 1 (sequence) up to `length`; a no-op when already that long."""
  pad = length - x.shape[1]
  if pad == 0:
    return x
  widths = [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
  return jnp.pad(x, widths, constant_values=value)


def varying_like(tree: Any, *operands: jax.Array) -> Any:
  """Gives fresh loop carries the manual-axis type of `operands` (shard_map).

  Inside `jax.shard_map` (`check_vma=True`) the operands vary over the
  manual axes while a fresh `jnp.zeros` does not, so a loop mixing the two
  would change its carry's type. Adding a zero that varies like every
  operand (from zero-size slices) fixes the type; values stay as they are.
  """
  empty = [x.reshape(-1)[:0].astype(jnp.float32) for x in operands]
  ref = functools.reduce(operator.add, empty)
  return jax.tree.map(
    lambda x: x + jnp.zeros_like(ref, shape=x.shape, dtype=x.dtype), tree
  )


def seq_tile(x: jax.Array, index: Any, size: int) -> jax.Array:
  return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=1)


def scaled_scores(
  spec: Any, s: jax.Array, *, base2: bool, descale: Any = None
) -> tuple[jax.Array, jax.Array | None]:
  """(scaled scores, the softcap's tanh or None): `s * scale`, or with
  softcap `c * tanh(s * scale / c)`, in base 2 (times log2 e) with
  `base2`, else natural units (what a score_mod takes); `descale` (an e4m3
  operand's scale) folded into the scale. The twin of the kernels'
  `kernels/sm90/scores.softcapped`."""
  unit = LOG2E if base2 else 1.0
  if spec.softcap is None:
    scale = jnp.float32(spec.softmax_scale * unit)
    return s * (scale if descale is None else scale * descale), None
  factor = jnp.float32(spec.softmax_scale / spec.softcap)
  t = jnp.tanh(s * (factor if descale is None else factor * descale))
  return t * jnp.float32(spec.softcap * unit), t


def scores_log2(
  spec: AttentionSpec,
  q_tile: jax.Array,
  k_tile: jax.Array,
  q_pos: jax.Array,
  kv_pos: jax.Array,
  *,
  masked: bool = True,
  ids: tuple[jax.Array, jax.Array] | None = None,
  flex_tile: FlexTile | None = None,
  pullback: bool = False,
) -> tuple[jax.Array, jax.Array | None, Any]:
  """Base-2 scores of one tile, float32 `[b, hk, g, block_q, block_kv]`
  (hidden entries -inf where `masked`; `ids`: the tile's query and key
  segment ids, `[b, block_q]` and `[b, block_kv]`; `flex_tile`: the bias,
  score_mod and mask_mod of the tile), the softcap's tanh (None without
  softcap: the backward's `1 - tanh^2`), and with `pullback` the flex
  modification's vjp (ds -> (ds before it, d bias tile, d arrays))."""
  s = jnp.einsum(
    "bqhgd,bkhd->bhgqk",
    q_tile,
    k_tile,
    preferred_element_type=jnp.float32,
    precision=HIGHEST,
  )
  pull = None
  # natural units through the user's functions, then base 2
  s, t = scaled_scores(spec, s, base2=flex_tile is None)
  if flex_tile is not None:
    if pullback:
      s, pull = jax.vjp(flex_tile.scores, s, flex_tile.bias, flex_tile.floats)
    else:
      s = flex_tile.scores(s, flex_tile.bias, flex_tile.floats)
    s = s * jnp.float32(LOG2E)
  # Scaled once, then used by both the max and exp2(s - max): without the
  # barrier XLA contracts the scaling into the subtraction (an FMA) in one
  # fusion only, and at large logits the max's own exponent is off by a
  # rounding of |s| (exp2(+-1000): lse inf or -inf). The kernels likewise
  # scale with a multiply of their own (docs/numerics.md#large-logits).
  s = jax.lax.optimization_barrier(s)
  if masked:
    mask = masking.visible(spec, q_pos, kv_pos)
    if ids is not None:
      mask = mask & (ids[0][:, :, None] == ids[1][:, None, :])[:, None, None]
    if flex_tile is not None:
      fmask = flex_tile.mask(s.shape)
      mask = mask if fmask is None else mask & fmask
    s = jnp.where(mask, s, -jnp.inf)
  return s, t, pull


@dataclasses.dataclass(frozen=True)
class FlexTile:
  """One tile's flex options: its bias tile and score_mod's floating
  arrays (differentiable arguments of `scores`), and its positions."""

  spec: AttentionSpec
  ops: flex.FlexOperands
  bias: jax.Array | None  # grouped `[b|1, hk|1, g|1, block_q, block_kv]`
  floats: tuple
  q_pos: jax.Array
  kv_pos: jax.Array

  def _index(self) -> tuple:
    sp = self.spec
    b = jnp.arange(sp.batch)[:, None, None, None, None]
    h = flex.head_index(sp.heads_kv, sp.group_size)[None, :, :, None, None]
    # padded positions: in range (their entries are hidden anyway)
    q = jnp.minimum(self.q_pos, sp.seq_q - 1)[:, None]
    kv = jnp.minimum(self.kv_pos, sp.seq_kv - 1)[None, :]
    return b, h, q, kv

  def scores(self, s: jax.Array, bias: Any, floats: tuple) -> jax.Array:
    consts = flex.with_float_consts(self.ops, floats).score_consts
    return flex.modify_scores(self.spec.flex, consts, bias, s, *self._index())

  def mask(self, shape: tuple[int, ...]) -> jax.Array | None:
    return flex.tile_visible(self.spec.flex, self.ops, *self._index(), shape)


def flex_tile(
  spec: AttentionSpec,
  ops: flex.FlexOperands | None,
  bias: jax.Array | None,
  q_pos: jax.Array,
  kv_pos: jax.Array,
  q0: Any,
  kv0: Any,
  block: tuple[int, int],
) -> FlexTile | None:
  """The `FlexTile` of the tile at rows `q0`, columns `kv0` (`bias`: the
  padded `[b|1, hq|1, ..]` bias, or None)."""
  if ops is None:
    return None
  tile = None
  if bias is not None:
    size = bias.shape[:2] + block
    tile = jax.lax.dynamic_slice(bias, (0, 0, q0, kv0), size)
    tile = flex.grouped(tile, spec.heads_kv, spec.group_size)
  return FlexTile(spec, ops, tile, flex.float_consts(ops), q_pos, kv_pos)


def pad_bias(ops: Any, t: Tiling) -> jax.Array | None:
  """The bias padded to whole tiles (zeros: padding is hidden anyway)."""
  if ops is None or ops.bias is None:
    return None
  b = ops.bias
  pads = ((0, 0), (0, 0), (0, t.num_q * t.block_q - b.shape[2]))
  return jnp.pad(b, pads + ((0, t.num_kv * t.block_kv - b.shape[3]),))


def live_tiles(spec: AttentionSpec, ops: Any, t: Tiling) -> jax.Array | None:
  """`[num_q, num_kv]`: the tiles a block mask lets through for some
  (batch, head), when its tiles are this tiling's (else None: every tile
  of the positional range is visited, masked)."""
  if ops is None or ops.block_mask is None:
    return None
  if spec.flex.block_tiles != (t.block_q, t.block_kv):
    return None
  return flex.live_tiles(ops.block_mask.state)


def walk_live(
  live_row: jax.Array,
  first: Any,
  end: Any,
  step: Callable[..., Any],
  carry: Any,
) -> Any:
  """`step(j, carry, masked=True)` for the live tiles j in `[first, end)`,
  in order: empty tiles are never computed."""
  j = jnp.arange(live_row.shape[0])
  order, count = flex.order_live(live_row & (j >= first) & (j < end))
  return jax.lax.fori_loop(
    0, count, lambda n, c: step(order[n], c, masked=True), carry
  )


def id_tiles(segment_ids: Any, t: Tiling) -> tuple[jax.Array, jax.Array]:
  """The ids padded to whole tiles (padding matches nothing: the positional
  mask hides it anyway)."""
  q_ids, kv_ids = segment_ids
  return (
    pad_seq(q_ids, t.num_q * t.block_q, value=-1),
    pad_seq(kv_ids, t.num_kv * t.block_kv, value=-2),
  )


def clip_range(
  bounds: tuple[Any, Any], spans: tuple[jax.Array, jax.Array] | None, i: Any
) -> tuple[Any, Any]:
  """A tile's positional range `bounds` intersected with its segment-id
  span (the union over the batch of `spans[.][b, i]`)."""
  if spans is None:
    return bounds
  first = jnp.maximum(bounds[0], spans[0][:, i].min())
  return first, jnp.minimum(bounds[1], spans[1][:, i].max())


def walk_tiles(
  bounds: tuple[Any, Any, Any, Any],
  step: Callable[..., Any],
  carry: Any,
  *,
  masked: bool,
) -> Any:
  """`step(j, carry, masked=...)` for j in `[first, end)`, where
  `bounds = (first, end, lo, hi)` and tiles in `[lo, hi)` need no mask:
  three loops (boundary tiles masked, interior ones not). `masked=False`
  (no mask at all): one unmasked loop."""
  first, end, lo, hi = bounds
  if not masked:
    return jax.lax.fori_loop(
      first, end, functools.partial(step, masked=False), carry
    )
  lo = jnp.clip(lo, first, end)
  hi = jnp.clip(hi, lo, end)
  carry = jax.lax.fori_loop(
    first, lo, functools.partial(step, masked=True), carry
  )
  carry = jax.lax.fori_loop(
    lo, hi, functools.partial(step, masked=False), carry
  )
  return jax.lax.fori_loop(hi, end, functools.partial(step, masked=True), carry)
