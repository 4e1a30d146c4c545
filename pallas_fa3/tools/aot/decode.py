"""The deviceless sm_90a compile of the decode kernel: one call's compile
(`compile_decode`) and the sweep of `pallas-fa3 aot --decode` (head dims,
contiguous and paged caches, GQA groups and seq_q, window and softcap,
cache_leftpad; bf16 and e4m3 caches; the MLA kernel): docs/kernels.md#verification-without-a-gpu.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from pallas_fa3.tools.aot import compiler as aot

if TYPE_CHECKING:  # jax is imported only when a compile runs
  from jax.sharding import Mesh

  from pallas_fa3.kvcache import DecodeSpec

# Cache tokens per sequence of the sweep (a long decode: many tiles per
# split), and its batch x kv heads.
DECODE_CAPACITY = 8192
DECODE_BATCH, DECODE_HEADS_KV = 4, 8
# (group size, seq_q): plain decoding with MHA to 16 query heads per KV head,
# speculative decoding, a prefill chunk.
DECODE_ROWS = (
  (1, 1),
  (4, 1),
  (8, 1),
  (16, 1),
  (4, 4),
  (8, 8),
  (4, 16),
  (1, 16),
)
PAGE_SIZES = (None, 64, 128, 256)  # None: contiguous


def decode_spec(
  d: int,
  dv: int,
  group: int,
  seq_q: int,
  page_size: int | None,
  **options: Any,
) -> DecodeSpec:
  """The sweep's spec for one point (bf16 queries, `DECODE_CAPACITY`
  tokens; `cache_dtype=` an e4m3 cache, default bf16)."""
  import jax.numpy as jnp

  from pallas_fa3.kvcache import DecodeSpec

  cache_dtype = jnp.dtype(options.pop("cache_dtype", jnp.bfloat16))
  paged = page_size is not None
  pps = DECODE_CAPACITY // page_size if paged else 0
  return DecodeSpec(
    batch=DECODE_BATCH,
    seq_q=seq_q,
    heads_q=DECODE_HEADS_KV * group,
    heads_kv=DECODE_HEADS_KV,
    head_dim=d,
    head_dim_v=dv,
    dtype=jnp.dtype(jnp.bfloat16),
    cache_dtype=cache_dtype,
    causal=options.pop("causal", True),
    softmax_scale=d**-0.5,
    paged=paged,
    capacity=DECODE_CAPACITY,
    page_size=page_size or 0,
    pages_per_seq=pps,
    cache_rows=DECODE_BATCH * pps if paged else DECODE_BATCH,
    **options,
  )


def compile_decode(
  spec: DecodeSpec,
  config: Any,
  mesh: Mesh | None = None,
  flex: Any = None,
  label: str = "",
) -> aot.CompileReport:
  """Compiles the decode kernel (with its split merge) for sm_90a at the
  default number of splits for `spec`; `flex`: `spec.flex`'s operands
  (`flex.prepare`'s), `label` appended to the kernel's."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec

  from pallas_fa3.kernels.sm90 import config_decode, decode as decode_kernel

  mesh = aot.h200_mesh() if mesh is None else mesh
  sharding = NamedSharding(mesh, PartitionSpec())
  arr = lambda shape, dtype=spec.dtype: jax.ShapeDtypeStruct(
    shape, dtype, sharding=sharding
  )
  b, hk = spec.batch, spec.heads_kv
  rows = spec.cache_rows
  cache_len = spec.page_size if spec.paged else spec.capacity
  splits = spec.num_splits or config_decode.default_splits(spec, config)
  pt = (spec.batch, max(spec.pages_per_seq, 1))
  shapes = [
    arr((b, spec.seq_q, spec.heads_q, spec.head_dim)),
    arr((rows, cache_len, hk, spec.head_dim), spec.cache_dtype),
    arr((rows, cache_len, hk, spec.head_dim_v), spec.cache_dtype),
    arr((b,), jnp.int32),
    arr((b,), jnp.int32),
    arr(pt, jnp.int32),
  ]
  if spec.fp8_cache:  # k_descale, v_descale
    shapes += [arr((b, hk), jnp.float32)] * 2
  if spec.leftpad:  # cache_leftpad
    shapes += [arr((b,), jnp.int32)]
  layout = f"paged{spec.page_size}" if spec.paged else "contiguous"
  if spec.fp8_cache:
    layout = f"e4m3 {layout}"
  label = (
    f"d{spec.head_dim}/{spec.head_dim_v} {layout} g{spec.group_size}"
    f" q{spec.seq_q}{aot.modifier_label(spec)}{' leftpad' * spec.leftpad}"
    f"{label} {config.block_kv}x{config.num_stages} s{splits}"
  )
  if spec.v_in_k:  # the MLA kernel: V in the K cache (no v_cache)
    from pallas_fa3.kernels.sm90 import decode_mla

    del shapes[2]
    return aot.compile_report(
      f"decode mla {label} {config}",
      lambda q, kc, lens, rows_, pt_, *rest: decode_mla.sm90_mla_decode(
        spec,
        config,
        splits,
        q,
        kc,
        None,
        lens,
        rows_,
        pt_ if spec.paged else None,
        None,
        tuple(rest[:2]) if spec.fp8_cache else None,
        starts=rest[-1] if spec.leftpad else None,
      ),  # fmt: skip
      shapes,
      f"mla {label}",
    )
  return aot.compile_report(
    f"decode {label} {config}",
    lambda q, kc, vc, lens, rows_, pt_, *rest: decode_kernel.sm90_decode(
      spec,
      config,
      splits,
      q,
      kc,
      vc,
      lens,
      rows_,
      pt_ if spec.paged else None,
      None,
      tuple(rest[:2]) if spec.fp8_cache else None,
      flex,
      rest[-1] if spec.leftpad else None,
    ),
    shapes,
    label,
  )


def decode_defaults(
  head_dims: Sequence[int] | None = None,
) -> Iterator[aot.SweepItem]:
  """The default decode config at every head dim (those of `head_dims`
  when given): GQA 4, one query, contiguous and paged (64-token pages); an
  e4m3 cache at d128, paged (`decode_sweep` has the rest)."""
  from pallas_fa3.kernels.sm90 import config_decode

  keep = lambda d: head_dims is None or d in head_dims
  for d in filter(keep, (64, 128, 256)):
    for ps in (None, 64):
      spec = decode_spec(d, d, 4, 1, ps)
      yield compile_decode, spec, config_decode.default_decode_config(spec)
  if keep(128):
    spec = decode_spec(128, 128, 4, 1, 64, cache_dtype="float8_e4m3fn")
    yield compile_decode, spec, config_decode.default_decode_config(spec)
  if head_dims is None:  # DeepSeek MLA: the MLA kernel, 16 query heads,
    for cache in ({}, dict(cache_dtype="float8_e4m3fn")):  # bf16 and e4m3
      spec = decode_spec(576, 512, 16, 1, 64, v_in_k=True, **cache)
      yield compile_decode, spec, config_decode.default_decode_config(spec)


# (head_dim, head_dim_v) of the e4m3-cache decode sweep.
E4M3_HEAD_DIMS = (
  (64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128),
  (128, 192),
)  # fmt: skip


def decode_sweep() -> Iterator[aot.SweepItem]:
  """`pallas-fa3 aot --decode`: the default config over head dims 64, 128,
  256, contiguous and paged caches, `DECODE_ROWS`; every block/stage
  config the kernel serves at d128 GQA 4; window and softcap; an e4m3
  cache at `E4M3_HEAD_DIMS`."""
  from pallas_fa3.kernels.sm90 import config_decode

  for d in (64, 128, 256):
    for ps in PAGE_SIZES:
      for group, seq_q in DECODE_ROWS:
        spec = decode_spec(d, d, group, seq_q, ps)
        if config_decode.decode_unsupported(spec) is None:
          yield compile_decode, spec, config_decode.default_decode_config(spec)
  spec = decode_spec(128, 128, 4, 1, None)
  for block in config_decode.BLOCK_KV_CHOICES:
    for stages in config_decode.STAGE_CHOICES:
      config = config_decode.Sm90DecodeConfig(block, stages)
      if config_decode.decode_unsupported(spec, config) is None:
        yield compile_decode, spec, config
  for options in (dict(window_size=(1024, None)), dict(softcap=30.0)):
    spec = decode_spec(128, 128, 4, 4, 64, **options)
    yield compile_decode, spec, config_decode.default_decode_config(spec)
  # An e4m3 cache: every head dim (and the 192/128 pairs, whose rows are
  # not whole 128-byte spans) and layout at GQA 8, every block/stage
  # config at d128, and softcap.
  e4m3 = dict(cache_dtype="float8_e4m3fn")
  for d, dv in E4M3_HEAD_DIMS:
    for ps in PAGE_SIZES:
      spec = decode_spec(d, dv, 8, 1, ps, **e4m3)
      yield compile_decode, spec, config_decode.default_decode_config(spec)
  spec = decode_spec(128, 128, 4, 1, None, **e4m3)
  for block in config_decode.BLOCK_KV_CHOICES:
    for stages in config_decode.STAGE_CHOICES:
      config = config_decode.Sm90DecodeConfig(block, stages)
      if config_decode.decode_unsupported(spec, config) is None:
        yield compile_decode, spec, config
  spec = decode_spec(128, 128, 4, 1, 64, softcap=30.0, **e4m3)
  yield compile_decode, spec, config_decode.default_decode_config(spec)
  # Prefill chunks past one 64-row tile (FA3's kvcache grid: seq_q to 512
  # at GQA 6): a CTA per query tile.
  for d, ps, seq_q in ((128, 64, 128), (64, None, 512)):
    spec = decode_spec(d, d, 6, seq_q, ps)
    yield compile_decode, spec, config_decode.default_decode_config(spec)
  # The MLA kernel (v_cache=None): 576 / 512 at 16, 64 and 128 query heads
  # (one and two query tiles), seq_q 1 and 2, contiguous and paged, window
  # and softcap, cache_leftpad; the 320 / 256 split.
  for group, seq_q, ps in ((16, 1, 64), (64, 2, None), (128, 1, 64)):
    for options in ({}, dict(window_size=(1024, None), softcap=30.0)):
      spec = decode_spec(576, 512, group, seq_q, ps, v_in_k=True, **options)
      yield compile_decode, spec, config_decode.default_decode_config(spec)
  for d, dv, options in ((576, 512, dict(leftpad=True)), (320, 256, {})):
    spec = decode_spec(d, dv, 16, 1, 64, v_in_k=True, **options)
    yield compile_decode, spec, config_decode.default_decode_config(spec)
  # An e4m3 MLA cache (the producer converts): 16 and 128 heads, paged and
  # contiguous, window and softcap, cache_leftpad.
  for group, seq_q, ps, options in (
    (16, 1, 64, {}),
    (128, 1, 64, dict(window_size=(1024, None), softcap=30.0)),
    (64, 2, None, dict(leftpad=True)),
  ):
    spec = decode_spec(
      576, 512, group, seq_q, ps, v_in_k=True, **options, **e4m3
    )
    yield compile_decode, spec, config_decode.default_decode_config(spec)
  yield from decode_flex_sweep()
  # cache_leftpad (its mask, and V zeroed before it), bf16 and e4m3.
  for options in (dict(causal=True), e4m3):
    spec = decode_spec(128, 128, 4, 1, 64, leftpad=True, **options)
    yield compile_decode, spec, config_decode.default_decode_config(spec)


def decode_flex_sweep() -> Iterator[aot.SweepItem]:
  """The decode kernel with flex options: ALiBi as a score_mod with a
  document mask_mod and a document block mask (one query head per CTA),
  softcap as a score_mod (on the GQA-packed rows), at d128 GQA 4, one
  query and a 4-query chunk, paged (64-token pages)."""
  import functools

  import jax.numpy as jnp
  import numpy as np

  import pallas_fa3
  from pallas_fa3 import flex, mods
  from pallas_fa3.kernels.sm90 import config_decode

  hq = DECODE_HEADS_KV * 4
  cap = DECODE_CAPACITY
  ids = jnp.asarray(np.arange(cap)[None] // 512, jnp.int32)
  cases = {
    "alibi+document": dict(
      score_mod=mods.alibi(mods.alibi_slopes(hq)),
      mask_mod=mods.document_mask(ids),
    ),
    "softcap": dict(score_mod=mods.softcap(30.0)),
    # the producer walks the span of the queries' block-mask rows
    "document block_mask": dict(
      block_mask=pallas_fa3.create_block_mask(
        mods.document_mask(ids), DECODE_BATCH, None, cap, cap
      ),
    ),
  }
  for seq_q in (1, 4):
    for name, kw in cases.items():
      fspec, ops = flex.prepare(
        score_mod=kw.get("score_mod"), mask_mod=kw.get("mask_mod"),
        block_mask=kw.get("block_mask"), bias=None, batch=DECODE_BATCH,
        heads=hq, seq_q=cap, seq_kv=cap,
      )  # fmt: skip
      spec = dataclasses.replace(
        decode_spec(128, 128, 4, seq_q, 64), flex=fspec
      )
      yield (
        functools.partial(compile_decode, flex=ops, label=f" flex={name}"),
        spec,
        config_decode.default_decode_config(spec),
      )
