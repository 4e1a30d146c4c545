"""What the harness benchmarks: our backends and JAX's attention baselines.

Each `Impl` turns a `BenchSpec` into a function `(q, k, v) -> out` with our
conventions (layout `[batch, seq, heads, head_dim]`, scale `1/sqrt(d)`,
bottom-right causal, the spec's window, softcap, sinks and packed
documents as segment ids), or gives the reason it cannot serve the spec.
Baselines without segment ids skip --docs cases, and JAX's baselines skip
head_dim_v != head_dim, saying so. A backend that raises `NotImplementedError`
while being traced (e.g. for a window it does not implement yet) is reported
as skipped with that message by the runner, so a backend starts being
measured by itself as soon as it is implemented. Sinks are inputs of the
timed function but not differentiated (their gradient is O(n) work).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallas_fa3 import IMPLEMENTATIONS, backends, flash_attention
from pallas_fa3.tools.bench import options, specs

OURS: tuple[str, ...] = (
  IMPLEMENTATIONS  # mosaic, interpret, blockwise, reference
)
# `mosaic` with deterministic=True: its backward is the dK/dV and dQ kernels
# (bitwise reproducible) instead of the fused kernel's dQ reduce-add.
DETERMINISTIC = "mosaic-det"
BASELINES: tuple[str, ...] = ("cudnn", "xla", "mgpu")
ALL: tuple[str, ...] = OURS + (DETERMINISTIC,) + BASELINES
# The implementation every other one is compared with, per platform.
OURS_ON = {"gpu": "mosaic", "cpu": "blockwise"}

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
    build: `spec -> fn(q, k, v) -> out`.
    prepare: `(spec, q, k, v) -> (q, k, v)`, applied to the inputs outside
      the timed function (e.g. pre-scaling q).
  """

  name: str
  kind: str
  summary: str
  unsupported: Callable[[Any, str], str | None]
  build: Callable[[Any], Callable]
  prepare: Callable = lambda spec, q, k, v: (q, k, v)


def _ours_unsupported(name):
  def check(spec, platform):
    del platform
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


def _no_options(spec, who: str, has: tuple[str, ...] = ()) -> str | None:
  """The reason `who` cannot serve the spec's options beyond `has`."""
  missing = tuple(n for n in spec.modifiers if n not in has)
  if not missing:
    return None
  return f"{who} has no {options.join_names(missing)} option"


def _dpa_unsupported(implementation):
  def check(spec, platform):
    if implementation == "cudnn":
      if platform != "gpu":
        return f"cuDNN attention needs a GPU (default backend: {platform})"
      if spec.dtype not in _HALF_DTYPES:
        return f"cuDNN flash attention takes bf16/fp16, not {spec.dtype}"
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


def _dpa_build(implementation):
  def build(spec):
    return lambda q, k, v: jax.nn.dot_product_attention(
      q,
      k,
      v,
      is_causal=spec.causal,
      local_window_size=_dpa_window(spec),
      implementation=implementation,
    )

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


def _mgpu_prepare(spec, q, k, v):
  # attention_mgpu applies no softmax scale: fold 1/sqrt(d) into q, outside
  # the timed function. Its shared-memory tiles are float16 whatever the
  # input (JAX 0.11-0.12: bf16 inputs fail with a dtype mismatch), so bf16
  # cases run it on float16 copies: the same tensor-core rate on Hopper.
  scale = 1.0 / math.sqrt(spec.head_dim)
  q = (q * jnp.asarray(scale, q.dtype)).astype(q.dtype)
  return tuple(x.astype(jnp.float16) for x in (q, k, v))


_SUMMARIES = {
  "mosaic": "ours: Pallas Mosaic GPU kernels (Hopper)",
  "interpret": "ours: the kernels in Pallas interpret mode (correctness only)",
  "blockwise": "ours: pure-JAX blockwise FlashAttention",
  "reference": "materialized float32 reference (baseline)",
}

REGISTRY: dict[str, Impl] = {
  **{
    n: Impl(
      n,
      "baseline" if n == "reference" else "ours",
      _SUMMARIES[n],
      _ours_unsupported(n),
      _ours_build(n),
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
  "cudnn": Impl(
    "cudnn",
    "baseline",
    'jax.nn.dot_product_attention(implementation="cudnn")',
    _dpa_unsupported("cudnn"),
    _dpa_build("cudnn"),
  ),
  "xla": Impl(
    "xla",
    "baseline",
    'jax.nn.dot_product_attention(implementation="xla")',
    _dpa_unsupported("xla"),
    _dpa_build("xla"),
  ),
  "mgpu": Impl(
    "mgpu",
    "baseline",
    "jax.experimental.pallas.ops.gpu.attention_mgpu (float16"
    " inputs: its tiles are float16-only)",
    _mgpu_unsupported,
    _mgpu_build,
    _mgpu_prepare,
  ),
}
