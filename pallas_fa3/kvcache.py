"""The KV cache of `flash_attention_with_kvcache`: the decode spec (one
frozen description of a call, its validation, and the visibility rule every
decode backend shares), the cache layouts (contiguous `k_cache[row_b, t]`,
paged `k_cache[page_table[b, t // page_size], t % page_size]`, or MLA's one
cache whose first `head_dim_v` columns are V), appending new tokens in place
and gathering a sequence's logical K/V, and the e4m3 cache (FA3's descales,
`quantize_kv_cache`, the optional rotation of K). Sequence b holds
`L_b = cache_seqlens[b] + seq_new` keys; its query i sits at position
`L_b - seq_q + i` (bottom-right); with `cache_leftpad` its keys are the
slots `[cache_leftpad[b], L_b)` (FA3's convention). docs/decoding.md
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_fa3 import modifiers, rotary
from pallas_fa3.parallel import sharding_checks
from pallas_fa3.quant import hadamard
from pallas_fa3.quant.config import FP8Config
from pallas_fa3.quant.e4m3 import E4M3_MAX, FP8_DTYPE, scale_of
from pallas_fa3.spec import (
  SUPPORTED_DTYPES,
  cdiv,
  check_bool,
  check_int,
  check_softmax_scale,
  options_on,
)

_Q = "[batch, seq_q, heads_q, head_dim]"
FP8_CACHE_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
_CONTIGUOUS = "[batch_cache, cache_len, heads_kv, head_dim]"
_PAGED = "[num_pages, page_size, heads_kv, head_dim]"
# Decoding takes head dims past flash_attention's 256: DeepSeek MLA's
# latent cache is 512 value columns + 64 RoPE columns (FlashMLA's layout).
MAX_DECODE_HEAD_DIM = 576


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
  """Canonical, hashable description of one attention call over a KV cache.

  q `[b, sq, hq, d]`; cache `[batch_cache, cache_len, hk, d|dv]`
  (contiguous) or `[num_pages, page_size, hk, d|dv]` (paged, with a
  `[b, pages_per_seq]` page table); appended k/v `[b, seq_new, hk, d|dv]`.
  `v_in_k`: no V cache: V is the K cache's first `head_dim_v` columns.
  """

  batch: int
  seq_q: int
  heads_q: int
  heads_kv: int
  head_dim: int
  head_dim_v: int
  dtype: Any  # q's (and the output's) jnp.dtype
  cache_dtype: Any  # k_cache's and v_cache's: q's, or float8_e4m3fn
  causal: bool
  softmax_scale: float
  paged: bool
  # Contiguous: `cache_len`; paged: `pages_per_seq * page_size`.
  capacity: int
  page_size: int = 0  # paged only
  pages_per_seq: int = 0  # paged only
  cache_rows: int = 0  # batch_cache (contiguous) or num_pages (paged)
  seq_new: int = 0  # appended tokens per sequence (k, v given)
  batch_idx: bool = False  # cache_batch_idx given (contiguous only)
  window_size: tuple[int | None, int | None] | None = None
  softcap: float | None = None
  sinks: bool = False
  num_splits: int | None = None  # None: the backend chooses
  v_in_k: bool = False  # v_cache=None: V = k_cache[..., :head_dim_v]
  flex: Any = None  # flex.FlexSpec: score_mod / mask_mod / block_mask
  leftpad: bool = False  # cache_leftpad given: keys start at it
  rotary_dim: int = 0  # rotary_cos/sin given: features rotated (0: none)
  rotary_interleaved: bool = True  # with rotary_dim: GPT-J pairs
  # Split-KV ranges at fixed key positions (`invariant_split_tiles`), a
  # fixed merge order: each sequence's output independent of the batch.
  batch_invariant: bool = False

  @property
  def fp8_cache(self) -> bool:
    """An e4m3 cache (with float32 descales `[batch, heads_kv]`)."""
    return self.cache_dtype == FP8_CACHE_DTYPE

  @property
  def group_size(self) -> int:
    return self.heads_q // self.heads_kv

  @property
  def window_left(self) -> int | None:
    return None if self.window_size is None else self.window_size[0]

  @property
  def window_right(self) -> int | None:
    if self.causal:
      return 0
    return None if self.window_size is None else self.window_size[1]

  def describe(self) -> str:
    """One line: the decode call's shapes, cache and options."""
    cache = (
      f"paged cache ({self.pages_per_seq} pages of {self.page_size})"
      if self.paged
      else f"contiguous cache of {self.capacity}"
    )
    opts = options_on(
      self.flex,
      causal=self.causal,
      window_size=self.window_size,
      softcap=self.softcap,
      sinks=self.sinks,
      seq_new=self.seq_new,
      batch_invariant=self.batch_invariant,
    )
    return (
      f"decode: batch {self.batch}, seq_q {self.seq_q}, heads"
      f" {self.heads_q}/{self.heads_kv} (q/kv), head_dim {self.head_dim},"
      f" {jnp.dtype(self.dtype).name}, {cache}"
      f" ({jnp.dtype(self.cache_dtype).name})"
      + (f"; {', '.join(opts)}" if opts else "")
    )

  @property
  def out_shape(self) -> tuple[int, int, int, int]:
    return (self.batch, self.seq_q, self.heads_q, self.head_dim_v)

  @property
  def lse_shape(self) -> tuple[int, int, int]:
    return (self.batch, self.heads_q, self.seq_q)


def query_positions(spec: DecodeSpec, length: Any, q_idx: Any) -> Any:
  """The sequence position of query `q_idx` of a sequence of `length`
  keys: `length - seq_q + q_idx` (the last query is the last key)."""
  return length - spec.seq_q + q_idx


def visible_in_cache(
  spec: DecodeSpec, length: Any, q_idx: Any, kv_pos: Any, start: Any = 0
) -> jax.Array:
  """Whether query `q_idx` (0..seq_q-1) of a sequence of `length` keys sees
  key position `kv_pos` (arrays that broadcast against each other);
  `start`: its first key (`cache_leftpad`)."""
  pos = query_positions(spec, length, q_idx)
  mask = (kv_pos < length) & (kv_pos >= start)
  if spec.window_right is not None:
    mask = mask & (kv_pos <= pos + spec.window_right)
  if spec.window_left is not None:
    mask = mask & (kv_pos >= pos - spec.window_left)
  return mask


def key_range(
  spec: DecodeSpec, length: Any, start: Any = 0, queries: Any = None
) -> tuple[Any, Any]:
  """[first, end) of the key positions any query of a sequence of `length`
  keys (from `start`, its `cache_leftpad`) sees (end <= first when none
  does); `queries`: only those of query indices `[q0, q1]` (default: all,
  0 .. seq_q - 1)."""
  q0, q1 = (0, spec.seq_q - 1) if queries is None else queries
  end = length  # the last query sits at length - 1: any right bound holds
  if queries is not None and spec.window_right is not None:
    end = jnp.minimum(
      length, query_positions(spec, length, q1) + spec.window_right + 1
    )
  first = start
  if spec.window_left is not None:  # the first query's left bound
    left = query_positions(spec, length, q0) - spec.window_left
    first = jnp.maximum(left, start)
  return first, end


# batch_invariant=True: split-KV ranges are fixed runs of this many keys
# from key 0 ("fixed split-size" decoding), so a sequence's ranges, and
# hence its bits, follow its own length only, never the batch size or the
# SM count. 2048: whole tiles of every decode tile (64..256 keys) and of
# 64-key pages; one float32 partial per 2048 keys adds ~3% to the bytes
# written at d128 (docs/decoding.md#batch-invariant-decoding).
INVARIANT_SPLIT_KEYS = 2048


def invariant_split_tiles(spec: DecodeSpec, tile: int) -> int:
  """Tiles per split-KV range of a `batch_invariant` call with `tile`-key
  tiles: `INVARIANT_SPLIT_KEYS` keys (at least one tile), or with
  `num_splits` the capacity cut into that many equal runs. Split s covers
  tiles `[s * per, (s + 1) * per)`, counted from key 0."""
  if spec.num_splits:
    return cdiv(cdiv(spec.capacity, tile), spec.num_splits)
  return max(1, INVARIANT_SPLIT_KEYS // tile)


def invariant_splits(
  spec: DecodeSpec, tile: int, max_splits: int | None = None
) -> int:
  """Split-KV ranges of a `batch_invariant` call: `num_splits`, or those
  covering the capacity at `invariant_split_tiles` each, at most
  `max_splits` (longer runs then: `split_span` widens them)."""
  if spec.num_splits:
    return spec.num_splits
  n = cdiv(cdiv(spec.capacity, tile), invariant_split_tiles(spec, tile))
  return min(n, max_splits) if max_splits else n


def split_span(
  spec: DecodeSpec, t0: Any, t1: Any, split: Any, splits: int, tile: int
) -> tuple[Any, Any]:
  """(first tile, tiles) of split `split` (of `splits`) of a sequence whose
  visible keys lie in tiles `[t0, t1)` (t1 >= t0, int32): `[t0, t1)` cut
  into `splits` equal runs, or with `spec.batch_invariant` the fixed runs
  of `invariant_split_tiles` (longer when `splits` is capped), clipped to
  `[t0, t1)`; 0 tiles: an empty range. Every decode backend cuts its
  ranges here (traced int32 arithmetic the kernels lower too)."""
  if spec.batch_invariant:
    tiles = cdiv(spec.capacity, tile)
    per = max(invariant_split_tiles(spec, tile), cdiv(tiles, splits))
    origin = split * per
    lo = jnp.maximum(origin, t0)
    return lo, jnp.clip(jnp.minimum(origin + per, t1) - lo, 0, per)
  per = lax.div(t1 - t0 + splits - 1, jnp.int32(splits))
  lo = t0 + split * per
  return lo, jnp.clip(t1 - lo, 0, per)


def _array(
  name: str, x: Any, layout: str, fp8: bool = False
) -> tuple[tuple[int, ...], Any]:
  if not (hasattr(x, "shape") and hasattr(x, "dtype")):
    raise TypeError(
      f"{name} must be an array of shape {layout}; got {type(x).__name__}"
    )
  shape = tuple(int(s) for s in x.shape)
  if len(shape) != 4:
    raise ValueError(
      f"{name} must have rank 4 with layout {layout}; got shape {shape}"
    )
  if any(s == 0 for s in shape):
    raise ValueError(f"{name} has an empty axis: shape {shape}")
  dtype = jnp.dtype(x.dtype)
  allowed = SUPPORTED_DTYPES + ((FP8_CACHE_DTYPE,) if fp8 else ())
  if dtype not in allowed:
    names = ", ".join(str(d) for d in allowed)
    raise TypeError(f"{name} has dtype {dtype}; supported dtypes are {names}")
  if shape[3] > MAX_DECODE_HEAD_DIM:
    raise ValueError(
      f"{name} head_dim {shape[3]} exceeds the maximum {MAX_DECODE_HEAD_DIM};"
      f" shape {shape}"
    )
  return shape, dtype


def _v_layout(
  v_cache: Any, head_dim_v: Any, kc_shape: tuple, kc_dtype: Any, layout: str
) -> tuple[tuple[int, ...], Any]:
  """(shape, dtype) V has: v_cache's, or with v_cache=None the K cache's
  first `head_dim_v` columns."""
  dv = head_dim_v
  if dv is not None:
    dv = check_int("head_dim_v", head_dim_v, minimum=1)
  if v_cache is None:
    if dv is None:
      raise ValueError(
        "head_dim_v is required when v_cache is None (V is read as the"
        " first head_dim_v columns of k_cache, DeepSeek MLA's layout); got"
        " head_dim_v=None"
      )
    if dv > kc_shape[3]:
      raise ValueError(
        f"head_dim_v ({dv}) must be <= k_cache's head_dim ({kc_shape[3]})"
        f" when v_cache is None: V is k_cache[..., :head_dim_v]; k_cache"
        f" shape {kc_shape}"
      )
    return kc_shape[:3] + (dv,), kc_dtype
  v_layout = layout.replace("]", "_v]")
  shape, dtype = _array("v_cache", v_cache, v_layout, fp8=True)
  if dv is not None and dv != shape[3]:
    raise ValueError(
      f"head_dim_v ({dv}) must be None or equal v_cache's last"
      f" dim ({shape[3]}); v_cache shape {shape}"
    )
  return shape, dtype


def _new_tokens(
  k: Any, v: Any, v_in_k: bool, want: tuple, dv: int, q_dtype: Any
) -> int:
  """Validates appended k (and v); returns seq_new (0 without them).
  `want`: (batch, heads_kv, head_dim)."""
  b, hk, d = want
  if v_in_k and v is not None:
    raise ValueError(
      "v must be None when v_cache is None: the appended tokens' values are"
      f" the first head_dim_v={dv} columns of k; got v.shape="
      f"{tuple(getattr(v, 'shape', ()))}"
    )
  if not v_in_k and (k is None) != (v is None):
    raise ValueError(
      "k and v must be given together (new tokens) or not at all"
    )
  if k is None:
    return 0
  k_shape, k_dtype = _array("k", k, "[batch, seq_new, heads_kv, head_dim]")
  want_k = (b, k_shape[1], hk, d)
  if v_in_k:
    if k_shape != want_k:
      raise ValueError(
        f"k must have shape {want_k} (batch, seq_new, the cache's heads and"
        f" head_dim); got k.shape={k_shape}"
      )
    v_dtype = k_dtype
  else:
    v_shape, v_dtype = _array("v", v, "[batch, seq_new, heads_kv, head_dim_v]")
    want_v = (b, k_shape[1], hk, dv)
    if k_shape != want_k or v_shape != want_v:
      raise ValueError(
        f"k and v must have shapes {want_k} and {want_v} (batch, seq_new,"
        f" the cache's heads and head dims); got k.shape={k_shape},"
        f" v.shape={v_shape}"
      )
  if v_in_k and k_dtype != q_dtype:
    raise TypeError(f"k must have q's dtype {q_dtype}; got {k_dtype}")
  if k_dtype != q_dtype or v_dtype != q_dtype:
    raise TypeError(
      f"k and v must have q's dtype {q_dtype}; got {k_dtype}, {v_dtype}"
    )
  return k_shape[1]


def _int_vector(name: str, x: Any, batch: int) -> None:
  if not (hasattr(x, "shape") and hasattr(x, "dtype")):
    raise TypeError(
      f"{name} must be an int32 array [batch] = [{batch}]; got"
      f" {type(x).__name__}"
    )
  if tuple(x.shape) != (batch,):
    raise ValueError(
      f"{name} must have shape [batch] = ({batch},); got {tuple(x.shape)}"
    )
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be int32; got {jnp.dtype(x.dtype)}")


def _check_cache_indices(
  index: Any, rows: int, page_size: int, lengths: list[int] | None
) -> None:
  """A concrete `page_table` (`page_size` > 0) or `cache_batch_idx` names
  only pages (rows) of k_cache's `rows`: ValueError naming the entry and the
  bound. A page table is checked where the sequences' tokens (`lengths`
  with the appended ones, when concrete) lie; the entries past them are
  never read (padding, e.g. -1, is fine there). Traced indices are checked
  on the device (`invalid_sequences`: NaN rows)."""
  concrete = isinstance(index, (jax.Array, np.ndarray, list, tuple))
  if not concrete or isinstance(index, jax.core.Tracer):
    return  # None, traced, or a shape (jax.ShapeDtypeStruct)
  values = np.asarray(jax.device_get(index))
  bad = (values < 0) | (values >= rows)
  if page_size:
    name, what = "page_table", f"a page of k_cache, which has {rows} pages"
    if lengths is None:
      return  # which entries are read is known on the device only
    used = cdiv(np.asarray(lengths), page_size)
    bad &= np.arange(values.shape[1])[None, :] < used[:, None]
  else:
    name, what = "cache_batch_idx", f"a row of k_cache, which has {rows} rows"
  if bad.any():
    at = tuple(int(i) for i in np.argwhere(bad)[0])
    where = ", ".join(map(str, at))
    raise ValueError(
      f"{name}[{where}] = {int(values[at])} is not {what} (0..{rows - 1});"
      f" {name} entries out of range: {int(bad.sum())}"
      + (
        f" (sequence {at[0]} holds {lengths[at[0]]} tokens)"
        if page_size
        else ""
      )
    )


def make_decode_spec(
  q: Any,
  k_cache: Any,
  v_cache: Any,
  k: Any = None,
  v: Any = None,
  *,
  cache_seqlens: Any,
  page_table: Any = None,
  cache_batch_idx: Any = None,
  causal: Any = False,
  softmax_scale: Any = None,
  window_size: Any = None,
  softcap: Any = None,
  sinks: bool = False,
  num_splits: Any = None,
  head_dim_v: Any = None,
  cache_leftpad: Any = None,
  rotary_cos: Any = None,
  rotary_sin: Any = None,
  rotary_interleaved: Any = True,
  batch_invariant: Any = False,
) -> DecodeSpec:
  """Validates a `flash_attention_with_kvcache` call; returns its spec
  (`v_cache=None` with `head_dim_v`: V is `k_cache[..., :head_dim_v]`).

  Raises:
    TypeError / ValueError naming the argument and its shape or value;
    a static `cache_seqlens` that (with the appended tokens) overflows
    the cache is a ValueError.
  """
  q_shape, q_dtype = _array("q", q, _Q)
  paged = page_table is not None
  layout = _PAGED if paged else _CONTIGUOUS
  kc_shape, kc_dtype = _array("k_cache", k_cache, layout, fp8=True)
  vc_shape, vc_dtype = _v_layout(
    v_cache, head_dim_v, kc_shape, kc_dtype, layout
  )
  b, sq, hq, d = q_shape
  v_text = f"v_cache.shape={vc_shape}" if v_cache is not None else (
    f"v_cache=None (V: k_cache[..., :{vc_shape[3]}])"
  )  # fmt: skip
  shapes = f"q.shape={q_shape}, k_cache.shape={kc_shape}, {v_text}"
  if kc_dtype != vc_dtype:
    raise TypeError(
      f"k_cache and v_cache must have the same dtype; got {kc_dtype} and"
      f" {vc_dtype}"
    )
  if kc_dtype != q_dtype and kc_dtype != FP8_CACHE_DTYPE:
    raise TypeError(
      f"k_cache must have q's dtype {q_dtype} (or be an e4m3 cache,"
      f" float8_e4m3fn); got {kc_dtype}"
    )
  if kc_shape[:3] != vc_shape[:3]:
    raise ValueError(
      f"k_cache and v_cache must agree on every axis but head_dim; got {shapes}"
    )
  hk = kc_shape[2]
  if kc_shape[3] != d:
    raise ValueError(f"k_cache's head_dim must equal q's; got {shapes}")
  if hq % hk:
    # A cache with heads and length swapped (PyTorch's [batch, heads,
    # seq, head_dim]) shows its length where the heads belong.
    names = layout[1:-1].split(", ")
    swapped = ", ".join([names[0], names[2], names[1], names[3]])
    hint = ""
    if hq % kc_shape[1] == 0 and kc_shape[1] < hk:
      hint = (
        f"; the cache's layout is {layout}, and this one looks like"
        f" [{swapped}] (swap axes 1 and 2)"
      )
    raise ValueError(
      f"q heads ({hq}) must be a multiple of the cache's kv heads ({hk});"
      f" got {shapes}{hint}"
    )
  if paged and cache_batch_idx is not None:
    raise ValueError(
      "page_table and cache_batch_idx cannot be combined: a paged cache"
      " maps sequences to pages through page_table alone"
    )
  pages_per_seq = page_size = 0
  if paged:
    if not (hasattr(page_table, "shape") and hasattr(page_table, "dtype")):
      raise TypeError(
        "page_table must be an int32 array [batch, pages_per_seq]; got"
        f" {type(page_table).__name__}"
      )
    pt = tuple(page_table.shape)
    if len(pt) != 2 or pt[0] != b:
      raise ValueError(
        f"page_table must have shape [batch, pages_per_seq] with batch {b};"
        f" got {pt}"
      )
    if not jnp.issubdtype(page_table.dtype, jnp.integer):
      raise TypeError(
        f"page_table must be int32; got {jnp.dtype(page_table.dtype)}"
      )
    pages_per_seq, page_size = pt[1], kc_shape[1]
    capacity = pages_per_seq * page_size
  else:
    if cache_batch_idx is None and kc_shape[0] != b:
      raise ValueError(
        f"k_cache's batch ({kc_shape[0]}) must equal q's ({b}) unless"
        f" cache_batch_idx maps each sequence to a cache row; got {shapes}"
      )
    if cache_batch_idx is not None:
      _int_vector("cache_batch_idx", cache_batch_idx, b)
    capacity = kc_shape[1]
  v_in_k = v_cache is None
  seq_new = _new_tokens(k, v, v_in_k, (b, hk, d), vc_shape[3], q_dtype)
  if seq_new > capacity:
    raise ValueError(
      f"k has {seq_new} new tokens per sequence, more than the cache holds"
      f" ({capacity}); {shapes}"
    )
  if isinstance(cache_seqlens, jax.core.Tracer) or hasattr(
    cache_seqlens, "shape"
  ):
    if getattr(cache_seqlens, "ndim", 1) == 0:
      raise ValueError(
        "cache_seqlens must be a Python int or an int32 array [batch]; got a"
        " 0-d array"
      )
    _int_vector("cache_seqlens", cache_seqlens, b)
    concrete = not isinstance(cache_seqlens, jax.core.Tracer)
    lengths = jax.device_get(cache_seqlens) if concrete else None
  else:
    if isinstance(cache_seqlens, (bool, np.bool_)) or not isinstance(
      cache_seqlens, numbers.Integral
    ):
      raise TypeError(
        "cache_seqlens must be a Python int or an int32 array of shape"
        f" [batch] = ({b},); got {cache_seqlens!r} of type"
        f" {type(cache_seqlens).__name__}"
      )
    lengths = [check_int("cache_seqlens", cache_seqlens, minimum=0)] * b
  if lengths is not None:
    longest = int(max(lengths)) + seq_new
    if min(lengths) < 0:
      raise ValueError(f"cache_seqlens must be >= 0; got {list(lengths)}")
    if longest > capacity:
      raise ValueError(
        f"cache_seqlens + seq_new = {longest} overflows the cache, which"
        f" holds {capacity} tokens per sequence (cache_seqlens="
        f"{[int(x) for x in lengths]}, seq_new={seq_new})"
      )
  _check_leftpad(cache_leftpad, b, lengths)
  rotary_dim = rotary.check_rotary(
    rotary_cos, rotary_sin, head_dim=d, capacity=capacity
  )
  if rotary_dim and not seq_new:
    raise ValueError(
      "rotary_cos / rotary_sin rotate q and the appended k at their"
      " positions: new tokens k (and v) must be given with them (FA3's"
      " rule; the cache already holds rotated keys)"
    )
  if rotary_dim and v_in_k:
    raise ValueError(
      "rotary_cos / rotary_sin cannot be combined with v_cache=None: V is"
      f" k's first {vc_shape[3]} columns, and rotary rotates k's first"
      f" {rotary_dim}; apply RoPE to the key's rope columns before the call"
    )
  _check_cache_indices(
    page_table if paged else cache_batch_idx,
    kc_shape[0],
    page_size,
    None if lengths is None else [int(n) + seq_new for n in lengths],
  )
  if num_splits is not None:
    num_splits = check_int("num_splits", num_splits, minimum=1)
  causal = check_bool("causal", causal)
  return DecodeSpec(
    batch=b,
    seq_q=sq,
    heads_q=hq,
    heads_kv=hk,
    head_dim=d,
    head_dim_v=vc_shape[3],
    dtype=q_dtype,
    cache_dtype=kc_dtype,
    causal=causal,
    softmax_scale=check_softmax_scale(softmax_scale, d),
    paged=paged,
    capacity=capacity,
    page_size=page_size,
    pages_per_seq=pages_per_seq,
    cache_rows=kc_shape[0],
    seq_new=seq_new,
    batch_idx=cache_batch_idx is not None,
    window_size=modifiers.check_window_size(
      window_size, seq_q=sq, seq_kv=capacity, causal=causal
    ),
    softcap=modifiers.check_softcap(softcap),
    sinks=bool(sinks),
    num_splits=num_splits,
    v_in_k=v_in_k,
    leftpad=cache_leftpad is not None,
    rotary_dim=rotary_dim,
    rotary_interleaved=check_bool("rotary_interleaved", rotary_interleaved),
    batch_invariant=check_bool("batch_invariant", batch_invariant),
  )


def _check_leftpad(leftpad: Any, batch: int, lengths: Any) -> None:
  """`cache_leftpad`: None or int32 `[batch]`, each entry in `0 ..
  cache_seqlens[b]` when both are concrete (traced values out of range
  give NaN rows)."""
  if leftpad is None:
    return
  _int_vector("cache_leftpad", leftpad, batch)
  if isinstance(leftpad, jax.core.Tracer) or lengths is None:
    return
  pad = np.asarray(jax.device_get(leftpad))
  bad = (pad < 0) | (pad > np.asarray(lengths))
  if bad.any():
    i = int(np.argwhere(bad)[0, 0])
    raise ValueError(
      f"cache_leftpad[{i}] = {int(pad[i])} must be in 0..cache_seqlens[{i}]"
      f" = {int(lengths[i])}: sequence {i}'s cached tokens are the slots"
      f" [cache_leftpad, cache_seqlens); cache_leftpad={pad.tolist()}"
    )


def cache_rows(spec: DecodeSpec, cache_batch_idx: Any) -> jax.Array:
  """int32 `[b]`: the contiguous cache row of each sequence."""
  if cache_batch_idx is None:
    return jnp.arange(spec.batch, dtype=jnp.int32)
  return jnp.asarray(cache_batch_idx, jnp.int32)


def token_slots(
  spec: DecodeSpec,
  positions: jax.Array,
  rows: Any,
  page_table: Any,
  seq: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """(cache row or page, slot) of token `positions[b, ...]` of every
  sequence (with `seq`, same shape: of sequence `seq[...]`, a packed
  layout's); positions past the capacity get row `cache_rows` (out of
  bounds: a scatter with mode="drop" skips them)."""
  past = positions >= spec.capacity
  if spec.paged:
    index = jnp.clip(positions // spec.page_size, 0, spec.pages_per_seq - 1)
    if seq is None:
      target = jnp.take_along_axis(
        page_table.astype(jnp.int32),
        index.reshape(spec.batch, -1),
        axis=1,
      ).reshape(positions.shape)
    else:
      target = page_table.astype(jnp.int32)[seq, index]
    slot = positions % spec.page_size
  elif seq is not None:
    target, slot = jnp.asarray(rows, jnp.int32)[seq], positions
  else:
    target = jnp.broadcast_to(
      rows.reshape((spec.batch,) + (1,) * (positions.ndim - 1)),
      positions.shape,
    )
    slot = positions
  # A page or row that is not one of the cache's (a traced index) is out of
  # bounds too, negative ones included: never another sequence's slot.
  past |= (target < 0) | (target >= spec.cache_rows)
  return jnp.where(past, spec.cache_rows, target), slot


def invalid_sequences(
  spec: DecodeSpec, lengths: jax.Array, rows: Any, page_table: Any
) -> jax.Array:
  """bool `[b]`: sequence b reads a page (of its first `lengths[b]` tokens)
  or a row that is not one of the cache's (traced indices; concrete ones
  raise in `make_decode_spec`)."""
  if spec.paged:
    pages = page_table.astype(jnp.int32)
    used = jnp.arange(spec.pages_per_seq)[None, :] < (
      (lengths[:, None] + spec.page_size - 1) // spec.page_size
    )
    bad = (pages < 0) | (pages >= spec.cache_rows)
    return jnp.any(bad & used, axis=1)
  rows = jnp.asarray(rows, jnp.int32)
  return (rows < 0) | (rows >= spec.cache_rows)


def append(
  spec: DecodeSpec,
  cache: jax.Array,
  new: jax.Array,
  start: jax.Array,
  rows: Any,
  page_table: Any,
) -> jax.Array:
  """`cache` with `new[b, i]` written at token `start[b] + i` of sequence b
  (one scatter: in place when the cache is donated)."""
  positions = start[:, None] + jnp.arange(spec.seq_new, dtype=jnp.int32)
  where, slot = token_slots(spec, positions, rows, page_table)
  # On `Explicit` mesh axes the scatter must be told: the cache's own layout.
  layout = sharding_checks.explicit_sharding(cache)
  extra = {} if layout is None else {"out_sharding": layout}
  return cache.at[where, slot].set(
    new.astype(cache.dtype), mode="drop", **extra
  )


def gather(
  spec: DecodeSpec, cache: jax.Array, rows: Any, page_table: Any
) -> jax.Array:
  """Every sequence's `capacity` cache slots in order, `[b, capacity, hk, x]`
  (a copy: the reference's view)."""
  if spec.paged:
    pages = cache[page_table.astype(jnp.int32)]  # [b, pps, ps, hk, x]
    return pages.reshape((spec.batch, spec.capacity) + cache.shape[2:])
  return cache[rows]


# Columns per descale of an e4m3 cache quantized by column groups
# (`quantize_kv_cache(column_groups=True)`; FlashMLA's 128).
DESCALE_GROUP_COLUMNS = 128


class FP8KVCache(NamedTuple):
  """`quantize_kv_cache`'s result: the e4m3 caches and their descales."""

  k_cache: jax.Array  # float8_e4m3fn, the input's layout (K rotated if asked)
  v_cache: jax.Array | None  # float8_e4m3fn (None: MLA's one cache)
  k_descale: jax.Array  # float32 [batch, heads_kv(, column groups)]
  v_descale: jax.Array | None  # float32 [batch, heads_kv(, column groups)]


def descale_groups(head_dim: int) -> int:
  """Column groups of a `head_dim`-wide cache's grouped descales (the last
  group holds the remaining columns)."""
  return cdiv(head_dim, DESCALE_GROUP_COLUMNS)


def column_descales(descale: jax.Array, head_dim: int) -> jax.Array:
  """float32 `[batch, heads_kv, head_dim]`: each column's descale, from
  `[batch, heads_kv]` or grouped `[batch, heads_kv, groups]` descales."""
  if descale.ndim == 2:
    return jnp.broadcast_to(descale[..., None], descale.shape + (head_dim,))
  cols = jnp.repeat(descale, DESCALE_GROUP_COLUMNS, axis=-1)
  return cols[..., :head_dim]


def is_fp8(dtype: Any) -> bool:
  return jnp.dtype(dtype) == FP8_DTYPE


def rotation_signs(rotation: Any, head_dim: int) -> jax.Array | None:
  """The +-1 diagonal of the cache's rotation (float32 `[head_dim]`), or None.

  `rotation`: None/False (none), True (the FP8 forward's default key 0), an
  int seed or a concrete JAX PRNG key (as `FP8Config.key`).
  """
  if rotation is None or rotation is False:
    return None
  key = FP8Config(key=0 if rotation is True else rotation).prng_key()
  return hadamard.rotation_signs(key, head_dim)


def rotate(x: jax.Array, signs: jax.Array | None) -> jax.Array:
  """`x @ D H / sqrt(d)` along the last axis in float32 (x itself without
  signs)."""
  return x if signs is None else hadamard.rotate(x, signs)


def check_descale(
  name: str, x: Any, fp8: bool, batch: int, heads_kv: int, head_dim: int
) -> jax.Array | None:
  """A descale as float32 `[batch, heads_kv]`, or grouped `[batch,
  heads_kv, descale_groups(head_dim)]` as given (ones when an e4m3 cache
  has none; None for a 16-bit cache, which takes none).

  Raises:
    ValueError / TypeError naming the argument: a descale for a 16-bit
    cache, a shape other than a scalar, `[batch, heads_kv]` or `[batch,
    heads_kv, ceil(head_dim / 128)]`, a non-float dtype, or a concrete
    value that is not positive and finite.
  """
  if x is None:
    return jnp.ones((batch, heads_kv), jnp.float32) if fp8 else None
  if not fp8:
    raise ValueError(
      f"{name} applies to an e4m3 (float8_e4m3fn) cache only; this cache"
      " is 16-bit: pass None"
    )
  shape = tuple(getattr(x, "shape", ()))
  grouped = (batch, heads_kv, descale_groups(head_dim))
  if shape not in ((), (batch, heads_kv), grouped):
    raise ValueError(
      f"{name} must be a scalar or float32 [batch, heads_kv] ="
      f" ({batch}, {heads_kv}), or one per {DESCALE_GROUP_COLUMNS}-column"
      f" group [batch, heads_kv, ceil(head_dim / {DESCALE_GROUP_COLUMNS})]"
      f" = {grouped}; got shape {shape}"
    )
  dtype = jnp.result_type(x)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{name} must be float32; got {dtype}")
  if not isinstance(x, jax.core.Tracer):  # (numpy: also inside a trace)
    value = np.asarray(x, np.float32)
    if not np.all(np.isfinite(value) & (value > 0)):
      raise ValueError(f"{name} must be positive and finite; got {value}")
  x = jnp.asarray(x, jnp.float32)
  return x if x.ndim == 3 else jnp.broadcast_to(x, (batch, heads_kv))


def quantize_tokens(x: jax.Array, descale: jax.Array) -> jax.Array:
  """`x / descale` in e4m3 (saturated at +-448, rounded to nearest):
  x `[batch, n, heads_kv, d]`, descale float32 `[batch, heads_kv]` or
  grouped `[batch, heads_kv, groups]`."""
  y = x.astype(jnp.float32) / column_descales(descale, x.shape[-1])[:, None]
  return jnp.clip(y, -E4M3_MAX, E4M3_MAX).astype(FP8_DTYPE)


def dequantize(x8: jax.Array, descale: jax.Array) -> jax.Array:
  """float32 `x8 * descale` for per-sequence `[batch, n, heads_kv, d]`
  (descale `[batch, heads_kv]` or grouped)."""
  cols = column_descales(descale, x8.shape[-1])
  return x8.astype(jnp.float32) * cols[:, None]


def _amax(
  x: jax.Array,
  n: jax.Array | None,
  lo: jax.Array | None = None,
  groups: bool = False,
) -> jax.Array:
  """`[rows, heads]` amax of `[rows, tokens, heads, d]` over the tokens
  `lo <= t < n` (`groups`: `[rows, heads, descale_groups(d)]`, one per
  128-column group)."""
  x = jnp.abs(x.astype(jnp.float32))
  if n is not None or lo is not None:
    t = jnp.arange(x.shape[1])[None, :]
    live = jnp.ones((x.shape[0], x.shape[1]), bool)
    if n is not None:
      live &= t < n[:, None]
    if lo is not None:
      live &= t >= lo[:, None]
    x = jnp.where(live[:, :, None, None], x, 0.0)
  if not groups:
    return jnp.max(x, axis=(1, 3))
  d, g = x.shape[-1], descale_groups(x.shape[-1])
  x = jnp.pad(x, [(0, 0)] * 3 + [(0, g * DESCALE_GROUP_COLUMNS - d)])
  return jnp.max(x.reshape(x.shape[:3] + (g, -1)), axis=(1, 4))


def quantize_kv_cache(
  k_cache: jax.Array,
  v_cache: jax.Array | None,
  *,
  page_table: jax.Array | None = None,
  cache_seqlens: Any = None,
  rotation: Any = None,
  cache_leftpad: Any = None,
  column_groups: bool = False,
) -> FP8KVCache:
  """A bf16/fp16/fp32 KV cache in e4m3 with FA3's per-(sequence, KV head)
  descales: `amax / 448` of the sequence's tokens, so nothing saturates.

  Args:
    k_cache, v_cache: contiguous `[batch, cache_len, heads_kv, d(_v)]` or,
      with `page_table`, paged `[num_pages, page_size, heads_kv, d(_v)]`.
      v_cache None: DeepSeek MLA's one cache (V its first columns, read
      with `k_descale`); v_cache and v_descale come back None.
    page_table: int32 `[batch, pages_per_seq]` for a paged cache. Pages
      may be shared between sequences, so a paged cache gets one descale
      per KV head (the amax over every sequence), repeated over the batch.
    cache_seqlens: None (every slot counts) or int32 `[batch]`: only each
      sequence's first `cache_seqlens[b]` tokens set its descale (the rest
      may be garbage, NaN included; it is quantized all the same).
    cache_leftpad: None or int32 `[batch]`: the slots before it are
      padding too (as `flash_attention_with_kvcache`'s): left out of the
      descales.
    rotation: None, True, an int seed or a PRNG key: store K rotated (see
      the module docstring); pass the same value as `cache_rotation=` to
      `flash_attention_with_kvcache`.
    column_groups: True: one descale per 128-column group as well
      (FlashMLA's column granularity; DeepSeek MLA's 576 columns are 5
      groups, the RoPE columns the last): descales `[batch, heads_kv,
      ceil(d / 128)]`, which `flash_attention_with_kvcache` takes as they
      are.

  Returns:
    `FP8KVCache(k_cache, v_cache, k_descale, v_descale)` (v_cache and
    v_descale None without a v_cache). With a contiguous
    cache read through `cache_batch_idx`, the descales are per cache row:
    pass `k_descale[cache_batch_idx]`.
  """
  named = (("k_cache", k_cache),) + (
    () if v_cache is None else (("v_cache", v_cache),)
  )
  for name, x in named:
    if getattr(x, "ndim", None) != 4:
      raise ValueError(
        f"{name} must be a rank-4 cache array; got shape"
        f" {tuple(getattr(x, 'shape', ()))}"
      )
    if not jnp.issubdtype(x.dtype, jnp.floating) or is_fp8(x.dtype):
      raise TypeError(f"{name} must be float16/bfloat16/float32; got {x.dtype}")
  if v_cache is not None and k_cache.shape[:3] != v_cache.shape[:3]:
    raise ValueError(
      "k_cache and v_cache must agree on every axis but head_dim; got"
      f" {k_cache.shape} and {v_cache.shape}"
    )
  if v_cache is None and rotation is not None and rotation is not False:
    raise ValueError(
      "rotation cannot be combined with v_cache=None: V is the K cache's"
      " columns, and a rotated K cache holds rotated values"
    )
  column_groups = check_bool("column_groups", column_groups)
  signs = rotation_signs(rotation, k_cache.shape[3])
  caches = [rotate(k_cache, signs)] + ([] if v_cache is None else [v_cache])
  n = None if cache_seqlens is None else jnp.asarray(cache_seqlens, jnp.int32)
  lo = None if cache_leftpad is None else jnp.asarray(cache_leftpad, jnp.int32)
  batch = caches[0].shape[0] if page_table is None else len(page_table)
  for name, x in (("cache_seqlens", n), ("cache_leftpad", lo)):
    if x is not None and x.shape != (batch,):
      raise ValueError(
        f"{name} must have shape [batch] = ({batch},); got {x.shape}"
      )
  if page_table is None:
    descales = [scale_of(_amax(c, n, lo, column_groups)) for c in caches]
    rows = jnp.arange(batch)
  else:
    pt = jnp.asarray(page_table, jnp.int32)
    if pt.ndim != 2:
      raise ValueError(
        f"page_table must be [batch, pages_per_seq]; got shape {pt.shape}"
      )
    seq = lambda c: c[pt].reshape((pt.shape[0], -1) + c.shape[2:])
    per_head = lambda a: jnp.broadcast_to(a.max(0), a.shape)
    descales = [
      scale_of(per_head(_amax(seq(c), n, lo, column_groups))) for c in caches
    ]
    rows = jnp.zeros((caches[0].shape[0],), jnp.int32)  # every page: the head's
  for (name, _), d in zip(named, descales):
    if not isinstance(d, jax.core.Tracer) and not np.all(np.isfinite(d)):
      raise ValueError(
        f"{name} holds non-finite values among the tokens that set the"
        " descales; pass cache_seqlens to leave out the slots past each"
        " sequence's tokens"
      )
  out = [quantize_tokens(c, d[rows]) for c, d in zip(caches, descales)]
  if v_cache is None:
    return FP8KVCache(out[0], None, descales[0], None)
  return FP8KVCache(out[0], out[1], descales[0], descales[1])
