"""Decode benchmark cases as data (`pallas-fa3 bench --mode decode`): one
frozen spec per case, the default grids, and the inputs of a case.

A decode case is one generation step: every sequence of the batch has one
new query (seq_q 1, causal: it sits at the end of its cache and sees every
cached key) and a cache filled to `cache_len` (`ragged`: lengths spread from
`cache_len` down to about half of it). The cache is contiguous
`[batch, cache_len, heads_kv, d]` or paged `[num_pages, page_size,
heads_kv, d]` with a shuffled page table. A grid is a union of groups, each
a product of axes; a flag replaces its axis in every group and duplicates
are dropped, so the default GPU grid can hold points that are no product
(batch 64 x 8k and batch 1 x 128k).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3.kvcache import quantize_kv_cache
from pallas_fa3.spec import cdiv
from pallas_fa3.tools.bench import flops, specs

MODE = "decode"
# fp8: bf16 queries over an e4m3 cache with FA3's per-(sequence, KV head)
# descales (`pallas_fa3.quantize_kv_cache`); the others: q and the cache in
# that dtype.
DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32", "fp8")
# The points the issue sets targets for (issue 29); `--tags headline`
# selects them (benchmarks/device_check.sh does).
HEADLINE_TAG = "headline"


@dataclasses.dataclass(frozen=True)
class DecodeBenchSpec:
  """One decode case.

  Attributes:
    name: unique, human-readable identifier.
    batch, cache_len, heads_q, heads_kv, head_dim: q `[batch, 1, heads_q,
      head_dim]`; each sequence's cache holds `cache_len` tokens of
      `heads_kv` heads (head_dim for K and V).
    dtype: a key of `specs.DTYPES`; "fp8" is bf16 queries over an e4m3
      cache.
    page_size: tokens per page of a paged cache; None: contiguous.
    num_splits: split-KV ranges per sequence; None: each backend's choice.
    ragged: sequence b holds `cache_len - (cache_len // 2) * b // batch`
      tokens (cache_len down to about half of it); else all `cache_len`.
    tags: free labels for selection (`--tags`) and reports.
  """

  name: str
  batch: int
  cache_len: int
  heads_q: int
  heads_kv: int
  head_dim: int
  dtype: str
  page_size: int | None = None
  num_splits: int | None = None
  ragged: bool = False
  tags: tuple[str, ...] = ()
  # One new token per sequence, at the end of its cache: seeing all of it.
  seq_q: int = dataclasses.field(default=1, init=False)
  causal: bool = dataclasses.field(default=True, init=False)
  mode: str = dataclasses.field(default=MODE, init=False)

  def __post_init__(self):
    where = f"DecodeBenchSpec {self.name!r}: "
    fields = ("batch", "cache_len", "heads_q", "heads_kv", "head_dim")
    optional = ("page_size", "num_splits")
    for field in fields + optional:
      value = getattr(self, field)
      if value is None and field in optional:
        continue
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
          f"{where}{field} must be a positive int; got {value!r}"
        )
    if self.heads_q % self.heads_kv:
      raise ValueError(
        f"{where}heads_q ({self.heads_q}) must be a multiple of heads_kv"
        f" ({self.heads_kv})"
      )
    if self.head_dim > specs.MAX_HEAD_DIM:
      raise ValueError(
        f"{where}head_dim {self.head_dim} is over {specs.MAX_HEAD_DIM}"
      )
    if self.dtype not in DTYPES:
      raise ValueError(f"{where}dtype {self.dtype!r} not in {DTYPES}")

  @property
  def gqa(self) -> int:
    """Query heads per key/value head."""
    return self.heads_q // self.heads_kv

  @property
  def head_dim_v(self) -> int:
    return self.head_dim

  @property
  def jax_dtype(self) -> str:
    return specs.DTYPES[self.dtype]

  @property
  def itemsize(self) -> int:
    return jnp.dtype(self.jax_dtype).itemsize

  @property
  def fp8_cache(self) -> bool:
    return self.dtype == "fp8"

  @property
  def cache_itemsize(self) -> int:
    """Bytes per cached value (1 for the e4m3 cache)."""
    return 1 if self.fp8_cache else self.itemsize

  @property
  def paged(self) -> bool:
    return self.page_size is not None

  @property
  def pages_per_seq(self) -> int:
    """Pages of each sequence's table (0: contiguous)."""
    return cdiv(self.cache_len, self.page_size) if self.paged else 0

  @property
  def lengths(self) -> tuple[int, ...]:
    """Tokens in each sequence's cache."""
    if not self.ragged:
      return (self.cache_len,) * self.batch
    half = self.cache_len // 2
    return tuple(
      self.cache_len - half * b // self.batch for b in range(self.batch)
    )

  @property
  def kv_bytes(self) -> int:
    return flops.decode_kv_bytes(self)

  @property
  def flops(self) -> int:
    return flops.decode_flops(self)

  @property
  def shape_key(self) -> tuple:
    """Everything but the split count: cases an implementation that does
    not split computes alike."""
    return (
      self.dtype,
      self.batch,
      self.cache_len,
      self.heads_q,
      self.heads_kv,
      self.head_dim,
      self.page_size,
      self.ragged,
    )

  @property
  def splits_label(self) -> str:
    """ "auto" or the requested count."""
    return "auto" if self.num_splits is None else str(self.num_splits)


@dataclasses.dataclass(frozen=True)
class DecodeAxes:
  """One group of a decode grid: every combination is a `DecodeBenchSpec`.

  `hidden // head_dim` gives the query heads (as `--hidden` does for the
  other modes), `gqa` ratios divide them; None in `page_sizes` is a
  contiguous cache, in `num_splits` the backend's own choice.
  """

  batches: tuple[int, ...]
  cache_lens: tuple[int, ...]
  hidden: int
  head_dims: tuple[int, ...]
  gqa: tuple[int, ...] = (4,)
  page_sizes: tuple[int | None, ...] = (None,)
  num_splits: tuple[int | None, ...] = (None,)
  dtypes: tuple[str, ...] = ("bf16",)
  ragged: bool = False
  tags: tuple[str, ...] = ()


# The GPU grid (issue 29): 32 query / 8 KV heads at d128 (hidden 4096, GQA
# group 4): the targets' points (batch 64 x 8k, contiguous and page 64;
# batch 1 x 128k, split-KV by each backend's choice), page 256, fixed
# split counts at 128k, batch 8 x 32k with GQA groups 1/4/8 and paged.
_GPU = dict(hidden=4096, head_dims=(128,))
GPU_GRID: tuple[DecodeAxes, ...] = (
  DecodeAxes(
    (64,), (8192,), page_sizes=(None, 64), tags=(HEADLINE_TAG,), **_GPU
  ),
  DecodeAxes((64,), (8192,), page_sizes=(256,), **_GPU),
  DecodeAxes((1,), (131072,), tags=(HEADLINE_TAG,), **_GPU),
  DecodeAxes((1,), (131072,), num_splits=(1, 8, 32, 128), **_GPU),
  DecodeAxes((8,), (32768,), gqa=(1, 4, 8), **_GPU),
  DecodeAxes((8,), (32768,), page_sizes=(256,), **_GPU),
)
# The CPU grid: about a minute on two cores for blockwise, reference and
# XLA: 8 query / 2 KV heads at d64, batch 4 at 1k/4k/16k contiguous and
# page 64, and batch 1 x 16k by the backend's choice and in 4 splits.
_CPU = dict(hidden=512, head_dims=(64,))
CPU_GRID: tuple[DecodeAxes, ...] = (
  DecodeAxes((4,), (1024, 4096, 16384), page_sizes=(None, 64), **_CPU),
  DecodeAxes((1,), (16384,), num_splits=(None, 4), **_CPU),
)


def spec_name(dtype, batch, cache_len, heads_q, heads_kv, head_dim,
              page_size, num_splits, ragged) -> str:  # fmt: skip
  """E.g. "decode-bf16-b64-L8192-h32x8-d128-page64-splits_auto-ragged"."""
  layout = "contiguous" if page_size is None else f"page{page_size}"
  splits = "auto" if num_splits is None else num_splits
  return (
    f"{MODE}-{dtype}-b{batch}-L{cache_len}-h{heads_q}x{heads_kv}-d{head_dim}"
    f"-{layout}-splits_{splits}{'-ragged' if ragged else ''}"
  )


def _group_specs(axes: DecodeAxes) -> list[DecodeBenchSpec]:
  specs.check_head_dims(axes.head_dims, axes.hidden)
  for dtype in axes.dtypes:
    if dtype not in DTYPES:
      raise ValueError(
        f"--dtype {dtype} has no decode path (--mode decode takes"
        f" {', '.join(DTYPES)})"
      )
  out = []
  for dtype, d, gqa, b, n, ps, splits in itertools.product(
    axes.dtypes,
    axes.head_dims,
    axes.gqa,
    axes.batches,
    axes.cache_lens,
    axes.page_sizes,
    axes.num_splits,
  ):
    heads_q = axes.hidden // d
    if heads_q % gqa:
      raise ValueError(
        f"--gqa {gqa} does not divide {heads_q} query heads (head dim {d},"
        f" --hidden {axes.hidden})"
      )
    tags = axes.tags + (
      MODE,
      dtype,
      f"d{d}",
      f"gqa{gqa}",
      "contiguous" if ps is None else "paged",
      "split-auto" if splits is None else "split-fixed",
    )
    args = (dtype, b, n, heads_q, heads_q // gqa, d, ps, splits, axes.ragged)
    out.append(
      DecodeBenchSpec(
        spec_name(*args),
        b,
        n,
        heads_q,
        heads_q // gqa,
        d,
        dtype,
        ps,
        splits,
        axes.ragged,
        tags + (("ragged",) if axes.ragged else ()),
      )
    )
  return out


def make_grid(
  groups: Sequence[DecodeAxes], tags: Iterable[str] = (), **overrides
) -> list[DecodeBenchSpec]:
  """Every group with `overrides` (DecodeAxes fields: a flag replaces its
  axis in every group), expanded; duplicates dropped (the first one's tags
  kept); only the specs carrying every one of `tags`.

  Raises:
    ValueError: naming the flag: a head dim over the limit or not dividing
      --hidden, a --gqa not dividing the query heads.
  """
  by_name: dict[str, DecodeBenchSpec] = {}
  for axes in groups:
    for s in _group_specs(dataclasses.replace(axes, **overrides)):
      by_name.setdefault(s.name, s)
  wanted = set(tags)
  return [s for s in by_name.values() if wanted <= set(s.tags)]


def all_tags(groups: Sequence[DecodeAxes], **overrides) -> list[str]:
  """The tags the specs of `groups` carry (for an error message)."""
  return sorted({t for s in make_grid(groups, **overrides) for t in s.tags})


def make_inputs(spec: DecodeBenchSpec, num_sets: int, seed: int) -> list[tuple]:
  """`num_sets` independent `(q, k_cache, v_cache, lengths, page_table)`,
  and for fp8 `k_descale, v_descale` after them.

  q and the caches standard-normal (never zeros; the whole cache, also past
  a ragged length; fp8: quantized by `quantize_kv_cache`); lengths int32
  `[batch]`; page_table int32 `[batch, pages_per_seq]`, a random
  permutation of the pages (the pages of a sequence are scattered, as a
  serving system recycles them), None for a contiguous cache.
  """
  q_shape = (spec.batch, spec.seq_q, spec.heads_q, spec.head_dim)
  if spec.paged:
    pages = spec.batch * spec.pages_per_seq
    kv_shape = (pages, spec.page_size, spec.heads_kv, spec.head_dim)
  else:
    kv_shape = (spec.batch, spec.cache_len, spec.heads_kv, spec.head_dim)
  lengths = jnp.asarray(spec.lengths, jnp.int32)
  sets = []
  for i in range(num_sets):
    key = jax.random.fold_in(jax.random.key(seed), i)
    keys = jax.random.split(key, 3)
    q, k, v = (
      jax.random.normal(k, shape, spec.jax_dtype)
      for k, shape in zip(keys, (q_shape, kv_shape, kv_shape))
    )
    table = None
    if spec.paged:
      order = np.random.default_rng([seed, i]).permutation(pages)
      table = jnp.asarray(order.reshape(spec.batch, -1), jnp.int32)
    if spec.fp8_cache:
      x = quantize_kv_cache(k, v, page_table=table)
      sets.append((q, x.k_cache, x.v_cache, lengths, table) + x[2:])
      continue
    sets.append((q, k, v, lengths, table))
  return jax.block_until_ready(sets)
