"""The deviceless sm_90a compile of the decode kernel: one call's compile
(`compile_decode`) and the sweep of `pallas-fa3 aot --decode` (head dims,
contiguous and paged caches, GQA groups and seq_q, window and softcap)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pallas_fa3.kernels import aot_compile as aot

if TYPE_CHECKING:  # jax is imported only when a compile runs
  from jax.sharding import Mesh

  from pallas_fa3.kvcache_spec import DecodeSpec

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
  """The sweep's spec for one point (bf16, `DECODE_CAPACITY` tokens)."""
  import jax.numpy as jnp

  from pallas_fa3.kvcache_spec import DecodeSpec

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
    cache_dtype=jnp.dtype(jnp.bfloat16),
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
  spec: DecodeSpec, config: Any, mesh: Mesh | None = None
) -> aot.CompileReport:
  """Compiles the decode kernel (with its split merge) for sm_90a at the
  default number of splits for `spec`."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec

  from pallas_fa3.kernels.sm90 import config_decode, decode

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
    arr((rows, cache_len, hk, spec.head_dim)),
    arr((rows, cache_len, hk, spec.head_dim_v)),
    arr((b,), jnp.int32),
    arr((b,), jnp.int32),
    arr(pt, jnp.int32),
  ]
  layout = f"paged{spec.page_size}" if spec.paged else "contiguous"
  label = (
    f"d{spec.head_dim}/{spec.head_dim_v} {layout} g{spec.group_size}"
    f" q{spec.seq_q}{aot.modifier_label(spec)}"
    f" {config.block_kv}x{config.num_stages} s{splits}"
  )
  return aot.compile_report(
    f"decode {label} {config}",
    lambda q, kc, vc, lens, rows_, pt_: decode.sm90_decode(
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
    ),
    shapes,
    label,
  )


def decode_defaults() -> Iterator[aot.SweepItem]:
  """The default decode config at every head dim: GQA 4, one query,
  contiguous and paged (64-token pages)."""
  from pallas_fa3.kernels.sm90 import config_decode

  for d in (64, 128, 256):
    for ps in (None, 64):
      spec = decode_spec(d, d, 4, 1, ps)
      yield compile_decode, spec, config_decode.default_decode_config(spec)


def decode_sweep() -> Iterator[aot.SweepItem]:
  """`pallas-fa3 aot --decode`: the default config over head dims 64, 128,
  256, contiguous and paged caches, `DECODE_ROWS`; every block/stage
  config the kernel serves at d128 GQA 4; window and softcap."""
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
