"""Test helpers shared by every backend's tests: inputs, the tolerance rule of
the FlashAttention-3 test suite (an error against the float64 golden of at
most twice the naive low-precision attention's, plus a small floor),
lowering checks, and decode cases (caches with garbage past the lengths,
their golden): docs/testing.md#the-shared-suite-and-the-tolerance-rule.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3.kvcache import DecodeSpec, cache_rows, gather
from pallas_fa3.reference import (
  golden_attention,
  golden_attention_vjp,
  golden_decode,
  reference_attention,
)

# Floor of the rule in float32 ulps of the tensor's largest golden entry (at
# least 1). A float32 blockwise pass accumulates a few ulps more than the
# materialized softmax (the online rescaling); 64 ulps is ~7.6e-6 relative,
# far below any bf16/fp16 error, so the floor never hides a low-precision bug.
FLOOR_ULPS = 64
_F32_EPS = float(np.finfo(np.float32).eps)


@dataclasses.dataclass(frozen=True)
class Shape:
  """An attention problem size: q `[b, sq, hq, d]`, k/v `[b, skv, hk, d|dv]`."""

  batch: int
  seq_q: int
  seq_kv: int
  heads_q: int
  heads_kv: int
  head_dim: int
  head_dim_v: int | None = None

  @property
  def dv(self) -> int:
    return self.head_dim if self.head_dim_v is None else self.head_dim_v

  def __str__(self) -> str:
    dv = "" if self.head_dim_v is None else f"v{self.head_dim_v}"
    return (
      f"b{self.batch}_q{self.seq_q}_kv{self.seq_kv}_h{self.heads_q}"
      f"/{self.heads_kv}_d{self.head_dim}{dv}"
    )


def random_inputs(
  key: jax.Array, shape: Shape, dtype: Any
) -> tuple[jax.Array, ...]:
  """Fresh standard-normal (q, k, v, dout) for `shape` (never zeros), drawn
  by NumPy from a seed taken from `key`: the same key gives the same
  inputs, and no XLA program is compiled per shape (`jax.random.normal`
  compiles one per shape and dtype, a tenth of a second each on a CPU)."""
  seed = np.asarray(jax.random.key_data(key)).ravel().tolist()
  rng = np.random.default_rng(seed)
  b, sq, skv = shape.batch, shape.seq_q, shape.seq_kv
  shapes = (
    (b, sq, shape.heads_q, shape.head_dim),
    (b, skv, shape.heads_kv, shape.head_dim),
    (b, skv, shape.heads_kv, shape.dv),
    (b, sq, shape.heads_q, shape.dv),
  )
  dtype = np.dtype(dtype)
  return tuple(
    jnp.asarray(rng.standard_normal(s, np.float32).astype(dtype))
    for s in shapes
  )


def max_abs_err(got: Any, golden: Any) -> float:
  """max |got - golden| over finite golden entries; inf if `got` is not finite there."""
  got = np.asarray(got).astype(np.float64)
  golden = np.asarray(golden, np.float64)
  finite = np.isfinite(golden)
  if not np.all(np.isfinite(got[finite])):
    return float("inf")
  return float(np.max(np.abs(got[finite] - golden[finite]), initial=0.0))


def tolerance(naive: Any, golden: Any, floor_ulps: int = FLOOR_ULPS) -> float:
  """The rule's bound for one tensor: 2 x naive error + floor."""
  golden = np.asarray(golden, np.float64)
  scale = float(np.max(np.abs(golden[np.isfinite(golden)]), initial=1.0))
  return 2.0 * max_abs_err(naive, golden) + floor_ulps * _F32_EPS * scale


def assert_within_tolerance(
  name: str, got: Any, naive: Any, golden: Any, floor_ulps: int = FLOOR_ULPS
) -> None:
  """Asserts the tolerance rule for one tensor, with a readable message."""
  err = max_abs_err(got, golden)
  bound = tolerance(naive, golden, floor_ulps)
  assert err <= bound, (
    f"{name}: max|got - golden| = {err:.3g} exceeds 2 x naive error"
    f" ({max_abs_err(naive, golden):.3g}) + floor = {bound:.3g}"
  )


def golden_and_naive(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  dout: jax.Array,
  *,
  causal: bool = False,
  softmax_scale: float | None = None,
  dlse: Any = None,
  window_size: Any = None,
  softcap: float | None = None,
  sinks: Any = None,
  segment_ids: Any = None,
) -> tuple[tuple, tuple]:
  """Float64 golden and naive low-dtype (out, lse, dq, dk, dv) for one problem,
  with d/dsinks last when `sinks` is given.

  The naive attention keeps every intermediate in the inputs' dtype (float32
  for float32 inputs) and is differentiated by plain JAX autodiff. In
  bfloat16 it runs jitted with XLA's excess precision off, which gives the
  op-by-op results bit for bit at a fifth of the time; float16 and float32
  run op by op (fused, XLA rounds them differently).
  """
  # Pending interpreted kernels (host callbacks on XLA's CPU pool) finish
  # before the golden compiles: XLA's CPU compiler segfaulted beside them.
  jax.effects_barrier()
  options = dict(
    causal=causal,
    softmax_scale=softmax_scale,
    window_size=window_size,
    softcap=softcap,
  )
  g_out, g_lse = golden_attention(
    q, k, v, sinks=sinks, segment_ids=segment_ids, **options
  )
  g_grads = golden_attention_vjp(
    q, k, v, dout, dlse, sinks=sinks, segment_ids=segment_ids, **options
  )
  args = (q, k, v, dout, dlse, sinks, segment_ids)
  naive = None
  if jnp.dtype(q.dtype) == jnp.bfloat16:
    if isinstance(window_size, list):
      options["window_size"] = tuple(window_size)
    try:
      naive = _naive_bf16(*args, **options)
    except TypeError:  # an argument jit cannot take: op by op below
      naive = None
  if naive is None:
    naive = _naive(*args, **options)
  return (g_out, g_lse) + tuple(g_grads), naive


def _naive(q, k, v, dout, dlse, sinks, segment_ids, **options) -> tuple:
  f = lambda q, k, v, sinks: reference_attention(
    q,
    k,
    v,
    sinks=sinks,
    segment_ids=segment_ids,
    return_lse=True,
    intermediate_dtype=q.dtype,
    **options,
  )
  (n_out, n_lse), pullback = jax.vjp(f, q, k, v, sinks)
  n_dlse = jnp.zeros_like(n_lse) if dlse is None else dlse
  n_grads = [g for g in pullback((dout, n_dlse)) if g is not None]
  return (n_out, n_lse) + tuple(n_grads)


_naive_bf16 = jax.jit(
  _naive,
  static_argnames=("causal", "softmax_scale", "window_size", "softcap"),
  compiler_options={"xla_allow_excess_precision": False},
)


def gpu_tier() -> str:
  """How much of each kernel's config space the GPU tests cover, from
  `PALLAS_FA3_GPU_TIER`: "full" (the default: every config) or "quick" (the
  default config of each head dim; `device_check.sh --quick`)."""
  tier = os.environ.get("PALLAS_FA3_GPU_TIER", "full")
  if tier not in ("full", "quick"):
    raise ValueError(
      f"PALLAS_FA3_GPU_TIER must be 'full' or 'quick'; got {tier!r}"
    )
  return tier


def run_interpreted(fn: Any, *args: Any, **kwargs: Any) -> Any:
  """`fn(*args, **kwargs)` until ready, with the Pallas GPU interpreter's
  race report captured: an AssertionError carrying the report if it found
  a race (its state reset after any error). Run interpreted calls through
  it before dispatching anything else: an eager `jax.vjp`'s pullback can
  return with its kernel still running, and work dispatched beside it on
  XLA's CPU pool hung CI (docs/design_notes.md#the-interpreters-thread-pool)."""
  from pallas_fa3.kernels.sm90 import compat  # (imports Mosaic GPU)

  try:
    with compat.capture_race_report() as report:
      result = jax.block_until_ready(fn(*args, **kwargs))
  except Exception:
    compat.reset_interpret_state()
    raise
  assert not compat.races_found(), report.getvalue()[-3000:]
  return result


def lowered_kernel_count(module_text: str) -> int:
  """Pallas Mosaic GPU kernels (custom calls) in a lowered StableHLO module."""
  return len(
    re.findall(r"stablehlo\.custom_call @mosaic_gpu\w*\(", module_text)
  )


def assert_lowered_attention(
  module_text: str, *, kernels: int, seq_q: int, seq_kv: int
) -> None:
  """A lowered attention holds exactly `kernels` Mosaic GPU kernels and no
  `[seq_q, seq_kv]` tensor (the score matrix never exists in HBM)."""
  found = lowered_kernel_count(module_text)
  assert found == kernels, f"{found} Mosaic GPU kernels, expected {kernels}"
  scores = re.findall(rf"tensor<(?:\d+x)*{seq_q}x{seq_kv}x", module_text)
  assert not scores, f"a [{seq_q}, {seq_kv}] tensor is materialized: {scores}"


@dataclasses.dataclass
class DecodeCase:
  """One decode problem: q, the caches (NaN and Inf past every sequence's
  tokens and in unused pages), the lengths already cached, optional new
  tokens, the page table or cache rows. `v_cache` None: DeepSeek MLA's
  layout, V the first `head_dim_v` columns of the K cache."""

  q: Any
  k_cache: Any
  v_cache: Any
  cache_seqlens: np.ndarray
  k: Any = None
  v: Any = None
  page_table: Any = None
  cache_batch_idx: Any = None
  head_dim_v: int | None = None  # with v_cache None

  def call_args(self) -> tuple[tuple, dict]:
    kwargs = dict(
      cache_seqlens=jnp.asarray(self.cache_seqlens, jnp.int32),
      page_table=self.page_table,
      cache_batch_idx=self.cache_batch_idx,
    )
    if self.v_cache is None:
      kwargs["head_dim_v"] = self.head_dim_v
    return (self.q, self.k_cache, self.v_cache, self.k, self.v), kwargs


def decode_case(
  rng: np.random.Generator,
  *,
  batch: int,
  seq_q: int,
  heads_q: int,
  heads_kv: int,
  head_dim: int,
  capacity: int,
  lengths: Any,
  head_dim_v: int | None = None,
  dtype: Any = jnp.bfloat16,
  page_size: int | None = None,
  seq_new: int = 0,
  batch_idx: bool = False,
  v_in_k: bool = False,
) -> DecodeCase:
  """A random case; `lengths` are the tokens cached before `seq_new` new
  ones. Paged: pages shuffled, one spare page; `batch_idx`: the cache has
  one spare row and the sequences use a permutation of the rows;
  `v_in_k`: no V cache and no new v (V: the K cache's first `head_dim_v`
  columns)."""
  dv = head_dim_v or head_dim
  normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
  lengths = np.asarray(lengths, np.int32)
  total = lengths + seq_new
  pt = rows = None
  if page_size:
    pps = capacity // page_size
    pages = batch * pps + 1
    kc, vc = (
      normal(pages, page_size, heads_kv, head_dim),
      normal(pages, page_size, heads_kv, dv),
    )
    pt = rng.permutation(pages)[: batch * pps].reshape(batch, pps)
    kc[...] = np.where(
      _unused_pages(pages, pt)[:, None, None, None], np.nan, kc
    )
    for b in range(batch):
      for t in range(total[b], capacity):
        kc[pt[b, t // page_size], t % page_size] = np.nan
        vc[pt[b, t // page_size], t % page_size] = np.inf
    pt = jnp.asarray(pt, jnp.int32)
  else:
    n = batch + (1 if batch_idx else 0)
    kc, vc = (
      normal(n, capacity, heads_kv, head_dim),
      normal(n, capacity, heads_kv, dv),
    )
    rows = rng.permutation(n)[:batch] if batch_idx else np.arange(batch)
    for b in range(batch):
      kc[rows[b], total[b] :] = np.nan
      vc[rows[b], total[b] :] = -np.inf
    rows = jnp.asarray(rows, jnp.int32) if batch_idx else None
  k = v = None
  if seq_new:
    k = jnp.asarray(normal(batch, seq_new, heads_kv, head_dim), dtype)
    v = jnp.asarray(normal(batch, seq_new, heads_kv, dv), dtype)
  return DecodeCase(
    jnp.asarray(normal(batch, seq_q, heads_q, head_dim), dtype),
    jnp.asarray(kc, dtype),
    None if v_in_k else jnp.asarray(vc, dtype),
    lengths,
    k,
    None if v_in_k else v,
    pt,
    rows,
    dv if v_in_k else None,
  )


def _unused_pages(pages: int, pt: np.ndarray) -> np.ndarray:
  used = np.zeros(pages, bool)
  used[np.asarray(pt).ravel()] = True
  return ~used


def decode_golden_and_naive(
  spec: DecodeSpec,
  case: DecodeCase,
  k_cache: Any,
  v_cache: Any,
  sinks: Any = None,
  starts: Any = None,
) -> tuple[tuple, tuple]:
  """((golden out, lse), (naive out, lse)) of every sequence of `case`
  against the (updated) caches: float64, and every intermediate in q's
  dtype. `v_cache` None with `spec.v_in_k`; `starts`: cache_leftpad (a
  sequence's keys are the slots `[starts[b], length)`)."""
  lengths = np.asarray(case.cache_seqlens) + spec.seq_new
  golden = golden_decode(
    spec,
    case.q,
    k_cache,
    v_cache,
    lengths,
    case.cache_batch_idx,
    case.page_table,
    sinks,
    starts=starts,
  )
  ids = cache_rows(spec, case.cache_batch_idx)
  k = gather(spec, jnp.asarray(k_cache), ids, case.page_table)
  if spec.v_in_k:
    v = k[..., : spec.head_dim_v]
  else:
    v = gather(spec, jnp.asarray(v_cache), ids, case.page_table)
  outs, lses = [], []
  for b in range(spec.batch):
    n = int(lengths[b])
    first = 0 if starts is None else int(starts[b])
    qb = case.q[b : b + 1]
    if n <= first:
      outs.append(np.zeros(qb.shape[:3] + (spec.head_dim_v,)))
      lse = np.full((1, spec.heads_q, spec.seq_q), -np.inf)
      if sinks is not None:
        lse = lse * 0 + np.asarray(sinks, np.float64)[None, :, None]
      lses.append(lse)
      continue
    out, lse = reference_attention(
      qb,
      k[b : b + 1, first:n],
      v[b : b + 1, first:n],
      causal=spec.causal,
      softmax_scale=spec.softmax_scale,
      window_size=spec.window_size,
      softcap=spec.softcap,
      sinks=sinks,
      return_lse=True,
      intermediate_dtype=spec.dtype,
    )
    outs.append(np.asarray(out, np.float64))
    lses.append(np.asarray(lse, np.float64))
  return golden, (np.concatenate(outs), np.concatenate(lses))


def flex_golden_and_naive(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  dout: jax.Array,
  params: Any,
  options: Any,
) -> tuple[tuple, tuple]:
  """The flex options' golden and naive `(out, dq, dk, dv, dparams)`.

  `options(params)` gives `flash_attention`'s keywords (score_mod,
  mask_mod, block_mask, bias, causal, ...) from a pytree of differentiable
  arrays (slopes, a bias, a table). The golden is `reference_attention`
  with float64 intermediates under `jax.enable_x64` (the user's functions
  called on float64 scores; outputs rounded once to float32); the naive
  one keeps every intermediate in the inputs' dtype. Integer params
  (ids, tables) keep their dtype; their cotangents are float0.
  """

  def run(dtype, q, k, v, params):
    return reference_attention(
      q, k, v, intermediate_dtype=dtype, **options(params)
    )

  with jax.enable_x64(True):
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    # floating params in float64; integer ones (ids, tables) as they are
    p64 = jax.tree.map(
      lambda x: (
        jnp.asarray(x, jnp.float64)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
        else x
      ),
      params,
    )
    out, pull = jax.vjp(
      lambda *a: run(jnp.float64, *a), f32(q), f32(k), f32(v), p64
    )
    grads = pull(f32(dout))
    golden = jax.tree.map(
      lambda x: (
        x if x.dtype == jax.dtypes.float0 else np.asarray(x, np.float64)
      ),
      (out,) + tuple(grads),
    )
  out, pull = jax.vjp(lambda *a: run(q.dtype, *a), q, k, v, params)
  return golden, (out,) + tuple(pull(dout))
