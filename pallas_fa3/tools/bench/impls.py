"""What the harness times, in one registry for every mode: our backends and
JAX's baselines (decode's Triton ops among them), each `Impl` saying which
modes it serves, why it cannot serve a case (the runner lists it as
skipped with that reason, as it does a `NotImplementedError` raised while
tracing), how it builds the timed function with our conventions and how it
moves the inputs into its own layout outside it: docs/benchmarks.md#the-code.
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
import numpy as np

from pallas_fa3 import (
  IMPLEMENTATIONS,
  backends,
  flash_attention,
  flash_attention_with_kvcache,
  flex,
  mods,
)
from pallas_fa3.kvcache import make_decode_spec
from pallas_fa3.tools.bench import options, specs

OURS: tuple[str, ...] = (
  IMPLEMENTATIONS  # mosaic, interpret, blockwise, reference
)
# `mosaic` with deterministic=True: its backward is the dK/dV and dQ kernels
# (bitwise reproducible) instead of the fused kernel's dQ reduce-add.
DETERMINISTIC = "mosaic-det"
BASELINES: tuple[str, ...] = (
  "cudnn",
  "xla",
  "mgpu",
  "triton-gqa",
  "triton-paged",
)
ALL: tuple[str, ...] = OURS + (DETERMINISTIC,) + BASELINES
# The implementation every other one is compared with, per platform.
OURS_ON = {"gpu": "mosaic", "cpu": "blockwise"}
EVERY_MODE: tuple[str, ...] = specs.MODES + (specs.DECODE,)

# jax.experimental.pallas.ops.gpu.attention_mgpu tiling: 64-row query tiles
# per consumer warpgroup (two of them, so q tiles of 128 rows), 128-row key
# tiles (64 at head dim 256 to fit 227 KiB of shared memory), two stages.
_MGPU_BLOCK_Q = 64
_MGPU_Q_MULTIPLE = 2 * _MGPU_BLOCK_Q
_MGPU_BLOCK_KV = {64: 128, 128: 128, 256: 64}
_MGPU_STAGES = 2
# Its backward (non-causal only) needs its tiles set explicitly: 64 x 64 for
# both of its kernels, one compute warpgroup (fits every head dim).
_MGPU_BWD_BLOCK = 64
# The Triton decode ops' own default split count (`k_splits=16` in both);
# "auto" takes it, or the largest count under it that their shape rules
# allow.
TRITON_SPLITS = 16
# decode_attention: keys per inner tile (its block_k default) and the
# fewest keys a split may hold (its assertion).
_GQA_BLOCK_K = 128
_GQA_MIN_SPLIT = 16
# paged_attention: pages per inner tile (its pages_per_compute_block).
_PAGED_BLOCK_PAGES = 8
_TRITON_OPS = "jax.experimental.pallas.ops.gpu"
_HALF_DTYPES = ("bf16", "fp16")
_TOP_LEFT = (
  "jax.nn.dot_product_attention's is_causal is top-left aligned;"
  " it equals our bottom-right mask only when seq_q == seq_kv"
)
# JAX 0.11.2's wrapper checks value against key's [B, S, K, H] for every
# implementation (cuDNN's own layout check would allow another v head dim).
_DPA_ONE_HEAD_DIM = (
  "jax.nn.dot_product_attention needs head_dim_v == head_dim: it requires"
  " value's shape to equal key's (ValueError), for xla and cudnn alike"
)


@dataclasses.dataclass(frozen=True)
class Impl:
  """One benchmarked implementation.

  Attributes:
    name: the `--impl` string.
    kind: "ours" or "baseline".
    summary: one line for reports.
    unsupported: `(spec, platform) -> reason or None`, checked before building.
    build: `spec -> fn`, the timed function of the prepared inputs (the
      attention modes: `fn(q, k, v) -> out`; decode: `fn(q, k_cache,
      v_cache, lengths, page_table, ...) -> out`, `[b, 1, hq, d]` or `[b,
      hq, d]`); the Triton baselines' also take `interpret=True`: Pallas
      interpret mode, on a CPU (the tests check the layouts, scale and
      splits there).
    prepare: `(spec, *inputs) -> inputs`, applied to a case's inputs
      (`timing.make_inputs`) outside the timed function (e.g. pre-scaling
      q, a cache in the implementation's own layout).
    modes: the modes it serves, of `EVERY_MODE`.
    splits: decode: `spec -> int | None`, the split-KV ranges it runs
      (None: it does not split).
    splits_kv: decode: it takes a split count (`num_splits`); one that
      does not is timed once per shape, at "auto", when the grid has that
      case.
  """

  name: str
  kind: str
  summary: str
  unsupported: Callable[[Any, str], str | None]
  build: Callable[..., Callable]
  prepare: Callable = lambda spec, *inputs: inputs
  modes: tuple[str, ...] = specs.MODES
  splits: Callable[[Any], int | None] = lambda spec: None
  splits_kv: bool = False


def serving(mode: str) -> tuple[str, ...]:
  """The names (of `ALL`, in its order) of the implementations serving
  `mode`."""
  return tuple(n for n in ALL if mode in REGISTRY[n].modes)


def decode_flex(spec) -> dict:
  """`flash_attention_with_kvcache`'s flex keywords of a decode case
  (`DecodeBenchSpec.flex`; {} without): "alibi_doc", ALiBi's score_mod
  over the query heads and a mask_mod of `DECODE_DOC_TOKENS`-token
  documents over the cache's positions."""
  if getattr(spec, "flex", None) is None:
    return {}
  capacity = spec.pages_per_seq * spec.page_size if spec.paged else 0
  ids = np.arange(capacity or spec.cache_len)[None] // specs.DECODE_DOC_TOKENS
  return dict(
    score_mod=mods.alibi(mods.alibi_slopes(spec.heads_q)),
    mask_mod=mods.document_mask(jnp.asarray(ids, jnp.int32)),
  )


def decode_spec(spec):
  """The library's `DecodeSpec` of a decode case (shapes only, no arrays;
  its flex functions' spec too)."""
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
  mla = getattr(spec, "mla", False)
  made = make_decode_spec(
    shape(spec.batch, spec.seq_q, spec.heads_q, spec.head_dim),
    cache,
    None if mla else cache,
    cache_seqlens=spec.cache_len,
    page_table=table,
    causal=spec.causal,
    num_splits=spec.num_splits,
    head_dim_v=spec.head_dim_v if mla else None,
    batch_invariant=getattr(spec, "batch_invariant", False),
  )
  fns = decode_flex(spec)
  if not fns:
    return made
  fs, _ = flex.prepare(
    **fns, block_mask=None, bias=None, batch=made.batch, heads=made.heads_q,
    seq_q=made.capacity, seq_kv=made.capacity,
  )  # fmt: skip
  return dataclasses.replace(made, flex=fs)


def _ours_unsupported(name):
  def check(spec, platform):
    del platform  # the backend knows its device
    if spec.mode == specs.DECODE:
      try:
        backend, _ = backends.resolve(decode_spec(spec), name, None)
      except NotImplementedError as e:
        return str(e)
      return backend.device_reason()
    if name == "interpret" and not spec.correctness_only:
      return (
        "interpret mode emulates the kernels on the CPU; it runs only"
        " the tiny correctness case, never a speed figure"
      )
    if (
      name == "interpret" and max(spec.seq_q, spec.seq_kv) > specs.TINY_MAX_SEQ
    ):
      return (
        f"interpret mode runs only a tiny correctness case, at seq <="
        f" {specs.TINY_MAX_SEQ}; the shortest --seq here is"
        f" {spec.seq_q} (add a short one, e.g. --seq 128)"
      )
    return backends.get(name).device_reason()

  return check


def _ours_build(name, deterministic=False):
  def build(spec):
    if spec.mode == specs.DECODE:
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
          head_dim_v=spec.head_dim_v if getattr(spec, "mla", False) else None,
          batch_invariant=spec.batch_invariant,
          **decode_flex(spec),
        )
      )
    sinks = options.sinks_for(spec.heads_q) if spec.sinks else None
    segment_ids = options.segment_ids_for(spec)
    return lambda q, k, v: flash_attention(
      q,
      k,
      v,
      causal=spec.causal,
      implementation=name,
      deterministic=deterministic,
      window_size=spec.window,
      softcap=spec.softcap,
      sinks=sinks,
      segment_ids=segment_ids,
    )

  return build


def _ours_splits(name):
  def splits(spec):
    if name == "reference":
      return None  # one materialized pass
    backend, config = backends.resolve(decode_spec(spec), name, None)
    return backend.decode_splits(decode_spec(spec), config)

  return splits


def _no_options(spec, who: str, has: tuple[str, ...] = ()) -> str | None:
  """The reason `who` cannot serve the spec's options beyond `has`."""
  missing = tuple(n for n in spec.modifiers if n not in has)
  if not missing:
    return None
  return f"{who} has no {options.join_names(missing)} option"


def _no_fp8_cache(spec) -> str | None:
  if spec.fp8_cache:
    return "takes no e4m3 cache (compare with the bf16 rows)"
  return None


def _no_mla(spec, who: str) -> str | None:
  if getattr(spec, "mla", False):
    return (
      f"{who} takes a K and a V cache of one head dim, not MLA's one"
      " 576-column cache with V its first 512 (reference is the XLA"
      " figure here)"
    )
  return None


# A decode baseline of one query per sequence (seq_q > 1: speculative).
_ONE_QUERY = (
  "{who} takes one query per sequence (its length mask is not causal"
  " among several new tokens)"
)


def _ours_only(spec) -> str | None:
  """Why a decode baseline skips a batch-invariant or flex case."""
  if getattr(spec, "batch_invariant", False):
    return "batch_invariant is flash_attention_with_kvcache's own mode"
  if getattr(spec, "flex", None):
    return f"the {spec.flex} flex case is flash_attention_with_kvcache's"
  return None


def _dpa_unsupported(implementation):
  def check(spec, platform):
    decode = spec.mode == specs.DECODE
    if decode and _no_fp8_cache(spec):
      return _no_fp8_cache(spec)
    if decode and _no_mla(spec, "jax.nn.dot_product_attention"):
      return _no_mla(spec, "jax.nn.dot_product_attention")
    if decode and spec.seq_q > 1:
      return _ONE_QUERY.format(who="jax.nn.dot_product_attention")
    if decode and _ours_only(spec):
      return _ours_only(spec)
    if implementation == "cudnn":
      if platform != "gpu":
        return f"cuDNN attention needs a GPU (default backend: {platform})"
      if spec.dtype not in _HALF_DTYPES:
        return f"cuDNN flash attention takes bf16/fp16, not {spec.dtype}"
    if decode:
      return None
    reason = _no_options(spec, "jax.nn.dot_product_attention", has=("window",))
    if reason:
      return reason
    if spec.head_dim_v != spec.head_dim:
      return _DPA_ONE_HEAD_DIM
    if spec.causal and spec.seq_q != spec.seq_kv:
      return _TOP_LEFT
    if spec.window is not None and spec.seq_q != spec.seq_kv:
      return _TOP_LEFT.replace("is_causal", "local_window_size")
    if (
      implementation == "cudnn"
      and spec.window is not None
      and not spec.causal
      and spec.window[1] != 0
    ):
      return "cuDNN's window has no right side unless causal (right must be 0)"
    return None

  return check


def _dpa_window(spec) -> tuple[int, int] | None:
  """The spec's window as `local_window_size` (top-left aligned, equal to
  ours at seq_q == seq_kv; an unbounded side becomes seq_kv)."""
  if spec.window is None:
    return None
  return tuple(spec.seq_kv if w is None else w for w in spec.window)


def _gather(cache, table):
  """A paged cache `[pages, page_size, hk, d]` as `[b, pages_per_seq *
  page_size, hk, d]`."""
  b, n = table.shape
  return cache[table].reshape(b, n * cache.shape[1], *cache.shape[2:])


def _dpa_build(implementation):
  def build(spec):
    if spec.mode != specs.DECODE:
      return lambda q, k, v: jax.nn.dot_product_attention(
        q,
        k,
        v,
        is_causal=spec.causal,
        local_window_size=_dpa_window(spec),
        implementation=implementation,
      )
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


def _import_mgpu():
  """The attention_mgpu module, or the reason it cannot be imported."""
  try:
    from jax.experimental.pallas.ops.gpu import attention_mgpu  # pylint: disable=g-import-not-at-top
  except Exception as e:  # pylint: disable=broad-except
    return None, f"cannot import attention_mgpu: {type(e).__name__}: {e}"
  return attention_mgpu, None


def _mgpu_unsupported(spec, platform):
  if platform != "gpu":
    return f"attention_mgpu needs a Hopper GPU (default backend: {platform})"
  _, reason = _import_mgpu()
  if reason:
    return reason
  reason = _no_options(spec, "attention_mgpu")
  if reason:
    return reason
  if spec.dtype not in _HALF_DTYPES:
    return f"attention_mgpu takes bf16/fp16, not {spec.dtype}"
  if spec.head_dim not in _MGPU_BLOCK_KV:
    return f"attention_mgpu needs head_dim in {tuple(_MGPU_BLOCK_KV)}"
  if spec.head_dim_v != spec.head_dim:
    return (
      "attention_mgpu needs head_dim_v == head_dim: its V tiles and"
      " output are head_dim wide"
    )
  if (
    spec.seq_q % _MGPU_Q_MULTIPLE or spec.seq_kv % _MGPU_BLOCK_KV[spec.head_dim]
  ):
    return (
      f"attention_mgpu needs seq_q % {_MGPU_Q_MULTIPLE} == 0 and seq_kv"
      f" % {_MGPU_BLOCK_KV[spec.head_dim]} == 0"
    )
  if spec.causal and spec.seq_q != spec.seq_kv:
    return (
      "attention_mgpu's causal mask is top-left aligned: needs seq_q == seq_kv"
    )
  if spec.causal and spec.mode != "fwd":
    return "attention_mgpu has no causal backward (NotImplementedError)"
  return None


def _mgpu_build(spec):
  mod, _ = _import_mgpu()
  b = _MGPU_BWD_BLOCK
  config = mod.TuningConfig(
    block_q=_MGPU_BLOCK_Q,
    block_kv=_MGPU_BLOCK_KV[spec.head_dim],
    max_concurrent_steps=_MGPU_STAGES,
    causal=spec.causal,
    block_q_dkv=b,
    block_kv_dkv=b,
    block_q_dq=b,
    block_kv_dq=b,
  )
  # Returns only the output: its lse (base 2, of pre-scaled scores) is unused.
  return lambda q, k, v: mod.attention(q, k, v, config)


def _mgpu_prepare(spec, q, k, v, *rest):
  # attention_mgpu applies no softmax scale: fold 1/sqrt(d) into q, outside
  # the timed function. Its shared-memory tiles are float16 whatever the
  # input (JAX 0.11-0.12: bf16 inputs fail with a dtype mismatch), so bf16
  # cases run it on float16 copies: the same tensor-core rate on Hopper.
  # The backward's dout (in `rest`) follows: a pullback takes a cotangent
  # of its output's dtype only.
  scale = 1.0 / math.sqrt(spec.head_dim)
  q = (q * jnp.asarray(scale, q.dtype)).astype(q.dtype)
  return tuple(x.astype(jnp.float16) for x in (q, k, v, *rest))


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
    if _no_mla(spec, name):
      return _no_mla(spec, name)
    if spec.seq_q > 1:
      return _ONE_QUERY.format(who=name)
    if _ours_only(spec):
      return _ours_only(spec)
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
  # [b, hk, L, d]: the op's layout; _gqa_build swaps it back inside the
  # timed function, where XLA folds the two transposes.
  swap = lambda x: jnp.swapaxes(x, 1, 2)
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
  "mosaic": "ours: Pallas Mosaic GPU kernels (Hopper; decode: the decode"
  " kernel)",
  "interpret": "ours: the kernels in Pallas interpret mode (correctness only)",
  "blockwise": "ours: pure-JAX blockwise FlashAttention, the kernels' twin",
  "reference": "materialized float32 reference (baseline, the oracle;"
  " decode: gathers the pages)",
}
# Ours with a decode path (`flash_attention_with_kvcache`).
_OURS_DECODING = ("mosaic", "blockwise", "reference")

REGISTRY: dict[str, Impl] = {
  **{
    n: Impl(
      n,
      "baseline" if n == "reference" else "ours",
      _SUMMARIES[n],
      _ours_unsupported(n),
      _ours_build(n),
      modes=EVERY_MODE if n in _OURS_DECODING else specs.MODES,
      splits=_ours_splits(n),
      splits_kv=n != "reference",  # one materialized pass
    )
    for n in OURS
  },
  DETERMINISTIC: Impl(
    DETERMINISTIC,
    "ours",
    "ours: mosaic with deterministic=True (dK/dV and dQ kernels)",
    _ours_unsupported("mosaic"),
    _ours_build("mosaic", deterministic=True),
  ),
  **{
    n: Impl(
      n,
      "baseline",
      f'jax.nn.dot_product_attention(implementation="{n}"); decode: with'
      " key_value_seq_lengths, a paged cache gathered in the timed call",
      _dpa_unsupported(n),
      _dpa_build(n),
      modes=EVERY_MODE,
    )
    for n in ("cudnn", "xla")
  },
  "mgpu": Impl(
    "mgpu",
    "baseline",
    "jax.experimental.pallas.ops.gpu.attention_mgpu (float16"
    " inputs: its tiles are float16-only)",
    _mgpu_unsupported,
    _mgpu_build,
    _mgpu_prepare,
  ),
  "triton-gqa": Impl(
    "triton-gqa",
    "baseline",
    "jax.experimental.pallas.ops.gpu.decode_attention.gqa (Triton),"
    " cache in its [b, hk, L, d] layout",
    _triton_unsupported("decode_attention", paged=False),
    _gqa_build,
    _gqa_prepare,
    (specs.DECODE,),
    _triton_splits(_gqa_split_ok),
    splits_kv=True,
  ),
  "triton-paged": Impl(
    "triton-paged",
    "baseline",
    "jax.experimental.pallas.ops.gpu.paged_attention (Triton), pages in"
    " its [hk, pages, page_size, d] layout",
    _triton_unsupported("paged_attention", paged=True),
    _paged_build,
    _paged_prepare,
    (specs.DECODE,),
    _triton_splits(_paged_split_ok),
    splits_kv=True,
  ),
}
assert set(REGISTRY) == set(ALL)
