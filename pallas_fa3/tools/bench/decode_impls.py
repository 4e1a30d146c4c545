"""What `--mode decode` benchmarks: our decode backends and JAX's baselines.

Every implementation gets the case's `(q, k_cache, v_cache, lengths,
page_table)` (`timing.make_inputs`: our layouts, page_table None for
a contiguous cache), may move them into its own native layout outside the
timed function (`prepare`), and returns the attention of each sequence's
one query over its first `lengths[b]` keys, scale `1/sqrt(d)`. One that
cannot serve a case says why (`unsupported`), and the runner lists it as
skipped; a `NotImplementedError` raised while tracing is a skip too.

  mosaic, blockwise, reference  `flash_attention_with_kvcache` (ours); the
                 fp8 cases pass the e4m3 cache and its descales (the
                 baselines have no e4m3 cache: skipped).
  xla, cudnn     `jax.nn.dot_product_attention` with `key_value_seq_lengths`
                 over the cache; a paged cache is gathered into a contiguous
                 one inside the timed function (its cost is part of theirs).
  triton-gqa     `jax.experimental.pallas.ops.gpu.decode_attention.gqa`
                 (Triton): contiguous caches; it wants `[b, hk, L, d]`, so
                 the cache is transposed outside the timed function and
                 back inside it, where XLA folds the two transposes.
  triton-paged   `jax.experimental.pallas.ops.gpu.paged_attention` (Triton):
                 paged caches, in its `[hk, pages, page_size, d]` layout
                 (moved outside the timed function); q pre-scaled (it takes
                 no softmax scale).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallas_fa3 import flash_attention_with_kvcache
from pallas_fa3.backends import resolve
from pallas_fa3.kvcache import make_decode_spec

OURS: tuple[str, ...] = ("mosaic", "blockwise", "reference")
BASELINES: tuple[str, ...] = ("xla", "cudnn", "triton-gqa", "triton-paged")
# Implementations only --mode decode has (the others share --impl names).
DECODE_ONLY: tuple[str, ...] = ("triton-gqa", "triton-paged")
ALL: tuple[str, ...] = OURS + BASELINES
OURS_ON = {"gpu": "mosaic", "cpu": "blockwise"}
DEFAULT_IMPLS = {
  "gpu": ("mosaic", "blockwise", "reference") + BASELINES,
  "cpu": ("blockwise", "reference", "xla"),
}
# The Triton ops' own default split count (`k_splits=16` in both); "auto"
# takes it, or the largest count under it that their shape rules allow.
TRITON_SPLITS = 16
# decode_attention: keys per inner tile (its block_k default) and the
# fewest keys a split may hold (its assertion).
_GQA_BLOCK_K = 128
_GQA_MIN_SPLIT = 16
# paged_attention: pages per inner tile (its pages_per_compute_block).
_PAGED_BLOCK_PAGES = 8
_HALF_DTYPES = ("bf16", "fp16")
_TRITON_OPS = "jax.experimental.pallas.ops.gpu"


@dataclasses.dataclass(frozen=True)
class DecodeImpl:
  """One benchmarked decode implementation.

  Attributes:
    name: the `--impl` string.
    kind: "ours" or "baseline".
    summary: one line for reports.
    unsupported: `(spec, platform) -> reason or None`.
    build: `spec -> fn(q, k_cache, v_cache, lengths, page_table) -> out`
      (`[b, 1, hq, d]` or `[b, hq, d]`); the Triton baselines' also take
      `interpret=True`: Pallas interpret mode, on a CPU (the tests check
      the layouts, scale and splits there).
    prepare: `(spec, q, k_cache, v_cache, lengths, page_table) -> args`
      of the built function, outside the timed call.
    splits: `spec -> int | None`: the split-KV ranges it runs (None: it
      does not split).
    splits_kv: it takes a split count (`num_splits`): one that does not is
      timed once per shape, at "auto", when the grid has that case.
  """

  name: str
  kind: str
  summary: str
  unsupported: Callable[[Any, str], str | None]
  build: Callable[[Any], Callable]
  prepare: Callable = lambda spec, *args: args
  splits: Callable[[Any], int | None] = lambda spec: None
  splits_kv: bool = False


def decode_spec(spec):
  """The library's `DecodeSpec` of a bench case (shapes only, no arrays)."""
  shape = lambda *s: jax.ShapeDtypeStruct(s, spec.jax_dtype)
  cache_dtype = jnp.float8_e4m3fn if spec.fp8_cache else spec.jax_dtype
  if spec.paged:
    rows = (spec.batch * spec.pages_per_seq, spec.page_size)
    table = jax.ShapeDtypeStruct((spec.batch, spec.pages_per_seq), jnp.int32)
  else:
    rows, table = (spec.batch, spec.cache_len), None
  cache = jax.ShapeDtypeStruct(
    (*rows, spec.heads_kv, spec.head_dim), cache_dtype
  )
  return make_decode_spec(
    shape(spec.batch, spec.seq_q, spec.heads_q, spec.head_dim),
    cache,
    cache,
    cache_seqlens=spec.cache_len,
    page_table=table,
    causal=spec.causal,
    num_splits=spec.num_splits,
  )


def _ours_unsupported(name):
  def check(spec, platform):
    del platform  # the backend knows its device
    try:
      backend, _ = resolve(decode_spec(spec), name, None)
    except NotImplementedError as e:
      return str(e)
    return backend.device_reason()

  return check


def _ours_build(name):
  def build(spec):
    return lambda q, k_cache, v_cache, lengths, table, *descale: (
      flash_attention_with_kvcache(
        q,
        k_cache,
        v_cache,
        cache_seqlens=lengths,
        page_table=table,
        causal=spec.causal,
        num_splits=spec.num_splits,
        implementation=name,
        k_descale=descale[0] if descale else None,
        v_descale=descale[1] if descale else None,
      )
    )

  return build


def _ours_splits(name):
  def splits(spec):
    if name == "reference":
      return None  # one materialized pass
    backend, config = resolve(decode_spec(spec), name, None)
    return backend.decode_splits(decode_spec(spec), config)

  return splits


def _gather(cache, table):
  """A paged cache `[pages, page_size, hk, d]` as `[b, pages_per_seq *
  page_size, hk, d]`."""
  b, n = table.shape
  return cache[table].reshape(b, n * cache.shape[1], *cache.shape[2:])


def _no_fp8_cache(spec) -> str | None:
  if spec.fp8_cache:
    return "takes no e4m3 cache (compare with the bf16 rows)"
  return None


def _dpa_unsupported(implementation):
  def check(spec, platform):
    if _no_fp8_cache(spec):
      return _no_fp8_cache(spec)
    if implementation == "cudnn":
      if platform != "gpu":
        return f"cuDNN attention needs a GPU (default backend: {platform})"
      if spec.dtype not in _HALF_DTYPES:
        return f"cuDNN flash attention takes bf16/fp16, not {spec.dtype}"
    return None

  return check


def _dpa_build(implementation):
  def build(spec):
    # One query at the end of its sequence sees every key below the length:
    # the length mask is the whole causal mask (is_causal would be top-left).
    assert spec.seq_q == 1, spec

    def fn(q, k_cache, v_cache, lengths, table):
      if table is not None:
        k_cache, v_cache = _gather(k_cache, table), _gather(v_cache, table)
      return jax.nn.dot_product_attention(
        q,
        k_cache,
        v_cache,
        key_value_seq_lengths=lengths,
        implementation=implementation,
      )

    return fn

  return build


def _import_triton(module: str):
  """`jax.experimental.pallas.ops.gpu.<module>`, or the reason it cannot
  be imported."""
  try:
    # Deprecated since JAX 0.11 (still JAX's only Triton decode ops): the
    # warning would print on every run.
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      return importlib.import_module(f"{_TRITON_OPS}.{module}"), None
  except Exception as e:  # pylint: disable=broad-except
    return None, f"cannot import {module}: {type(e).__name__}: {e}"


def _gqa_split_ok(spec, k: int) -> bool:
  """decode_attention's rules: splits of equal length, at least 16 keys,
  a whole number of its key tiles."""
  n = spec.cache_len
  if n % k or n // k < _GQA_MIN_SPLIT:
    return False
  return (n // k) % min(_GQA_BLOCK_K, n // k) == 0


def _paged_split_ok(spec, k: int) -> bool:
  """paged_attention's rules: equal page ranges, each a whole number of
  its page tiles."""
  pages = spec.pages_per_seq
  if pages % k:
    return False
  per = pages // k
  return per % min(per, _PAGED_BLOCK_PAGES) == 0


def _triton_splits(ok):
  def splits(spec):
    if spec.num_splits is not None:
      return spec.num_splits if ok(spec, spec.num_splits) else None
    return next((k for k in range(TRITON_SPLITS, 0, -1) if ok(spec, k)), None)

  return splits


def _triton_unsupported(module, paged):
  name = "paged_attention" if paged else "decode_attention.gqa"
  ok = _paged_split_ok if paged else _gqa_split_ok

  def check(spec, platform):
    if _no_fp8_cache(spec):
      return _no_fp8_cache(spec)
    if platform != "gpu":
      return f"{name} is a Triton GPU kernel (default backend: {platform})"
    if spec.paged != paged:
      return (
        f"{name} takes a {'paged' if paged else 'contiguous'} cache"
        f" (the {'contiguous' if paged else 'paged'} one:"
        f" {'triton-gqa' if paged else 'triton-paged'})"
      )
    _, reason = _import_triton(module)
    if reason:
      return reason
    if _triton_splits(ok)(spec) is None:
      rule = (
        f"pages_per_seq {spec.pages_per_seq} in equal ranges of whole"
        f" {_PAGED_BLOCK_PAGES}-page tiles"
        if paged
        else f"cache_len {spec.cache_len} in equal ranges of at least"
        f" {_GQA_MIN_SPLIT} keys, whole {_GQA_BLOCK_K}-key tiles"
      )
      return f"{name} cannot split {rule} into num_splits={spec.splits_label}"
    return None

  return check


def _gqa_prepare(spec, q, k_cache, v_cache, lengths, table):
  del spec, table
  swap = lambda x: jnp.swapaxes(x, 1, 2)  # [b, hk, L, d]: the op's layout
  return q[:, 0], swap(k_cache), swap(v_cache), lengths, None


def _gqa_build(spec, interpret: bool = False):
  mod, _ = _import_triton("decode_attention")
  splits = _triton_splits(_gqa_split_ok)(spec)
  swap = lambda x: jnp.swapaxes(x, 1, 2)
  return lambda q, k, v, lengths, table: mod.gqa(
    q,
    swap(k),
    swap(v),
    kv_seq_len=lengths,
    k_splits=splits,
    interpret=interpret,
  )


def _paged_prepare(spec, q, k_cache, v_cache, lengths, table):
  scale = 1.0 / math.sqrt(spec.head_dim)  # it applies none
  q = (q[:, 0] * jnp.asarray(scale, q.dtype)).astype(q.dtype)
  heads_first = lambda x: jnp.moveaxis(x, 2, 0)  # [hk, pages, ps, d]
  return q, heads_first(k_cache), heads_first(v_cache), lengths, table


def _paged_build(spec, interpret: bool = False):
  mod, _ = _import_triton("paged_attention")
  splits = _triton_splits(_paged_split_ok)(spec)
  return lambda q, k, v, lengths, table: mod.paged_attention(
    q, k, v, table, lengths, k_splits=splits, interpret=interpret
  )


_SUMMARIES = {
  "mosaic": "ours: the Hopper decode kernel (Pallas Mosaic GPU)",
  "blockwise": "ours: the kernel's pure-JAX blockwise twin",
  "reference": "ours: gather and materialize (the oracle)",
}

REGISTRY: dict[str, DecodeImpl] = {
  **{
    n: DecodeImpl(
      n,
      "baseline" if n == "reference" else "ours",
      _SUMMARIES[n],
      _ours_unsupported(n),
      _ours_build(n),
      splits=_ours_splits(n),
      splits_kv=n != "reference",  # one materialized pass
    )
    for n in OURS
  },
  **{
    n: DecodeImpl(
      n,
      "baseline",
      f'jax.nn.dot_product_attention(implementation="{n}") with'
      " key_value_seq_lengths; a paged cache gathered in the timed call",
      _dpa_unsupported(n),
      _dpa_build(n),
    )
    for n in ("xla", "cudnn")
  },
  "triton-gqa": DecodeImpl(
    "triton-gqa",
    "baseline",
    "jax.experimental.pallas.ops.gpu.decode_attention.gqa (Triton),"
    " cache in its [b, hk, L, d] layout",
    _triton_unsupported("decode_attention", paged=False),
    _gqa_build,
    _gqa_prepare,
    _triton_splits(_gqa_split_ok),
    splits_kv=True,
  ),
  "triton-paged": DecodeImpl(
    "triton-paged",
    "baseline",
    "jax.experimental.pallas.ops.gpu.paged_attention (Triton), pages in"
    " its [hk, pages, page_size, d] layout",
    _triton_unsupported("paged_attention", paged=True),
    _paged_build,
    _paged_prepare,
    _triton_splits(_paged_split_ok),
    splits_kv=True,
  ),
}
assert set(REGISTRY) == set(ALL)
