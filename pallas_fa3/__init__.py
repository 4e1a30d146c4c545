"""pallas-fa3: FlashAttention-3 for Hopper in JAX Pallas Mosaic GPU. The public
API at a glance (everything else is private or lives in a submodule); its
arguments and conventions are in docs/api.md.

  flash_attention               attention, any backend; jax.grad and jax.jvp
  explain                       what a flash_attention call would run, and why
  flash_attention_with_kvcache  attention over a KV cache (docs/decoding.md)
  flash_attention_varlen        FA3's varlen call on packed sequences
                                (cu_seqlens; docs/varlen.md)
  reference_attention           materialized baseline attention (the oracle)
  dot_product_attention         jax.nn.dot_product_attention, flash-computed
  create_block_mask, BlockMask  flex attention's block masks (docs/flex.md);
                                ready-made score/mask functions: `mods`
  ring_attention, ulysses_attention, zigzag_order
                                context parallelism (docs/scale_out.md)
  quantize_kv_cache, FP8KVCache an e4m3 KV cache and its descales
  SegmentIds, segment_ids_from_lengths, segment_positions
                                packed sequences, their RoPE positions
  FP8Config, StableMax          flash_attention(fp8=...), (stable_max=...)
  BlockwiseConfig, Sm90Config (forward=Sm90ForwardConfig, backward=
  Sm90BackwardConfig), Sm90DecodeConfig   the backends' tilings
  AttentionSpec                 the validated description of a call
  IMPLEMENTATIONS, Implementation   the backend names, their Literal

The names are imported on first use (PEP 562), so `import pallas_fa3`, and
the tools' `pallas-fa3 --help`, do not import JAX.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Each public name and the module that defines it, imported on first use by
# `__getattr__` below, which imports submodules (`mods`, `spec`, ...) on first
# attribute access too. The TYPE_CHECKING block says the same to type checkers
# and readers; tests/test_import_graph.py checks that the two agree.
_EXPORTS = {
  "flash_attention": "pallas_fa3.attention",
  "explain": "pallas_fa3.attention",
  "flash_attention_with_kvcache": "pallas_fa3.attention",
  "IMPLEMENTATIONS": "pallas_fa3.backends",
  "Implementation": "pallas_fa3.backends",
  "BlockwiseConfig": "pallas_fa3.backends.blockwise",
  "dot_product_attention": "pallas_fa3.dot_product",
  "BlockMask": "pallas_fa3.flex",
  "create_block_mask": "pallas_fa3.flex",
  "FP8Config": "pallas_fa3.fp8",
  "Sm90BackwardConfig": "pallas_fa3.kernels.sm90.config",
  "Sm90Config": "pallas_fa3.kernels.sm90.config",
  "Sm90ForwardConfig": "pallas_fa3.kernels.sm90.config",
  "Sm90DecodeConfig": "pallas_fa3.kernels.sm90.config_decode",
  "FP8KVCache": "pallas_fa3.kvcache",
  "quantize_kv_cache": "pallas_fa3.kvcache",
  "ring_attention": "pallas_fa3.parallel.ring.attention",
  "zigzag_order": "pallas_fa3.parallel.ring.steps",
  "ulysses_attention": "pallas_fa3.parallel.ulysses",
  "reference_attention": "pallas_fa3.reference",
  "SegmentIds": "pallas_fa3.segments",
  "segment_ids_from_lengths": "pallas_fa3.segments",
  "segment_positions": "pallas_fa3.segments",
  "AttentionSpec": "pallas_fa3.spec",
  "StableMax": "pallas_fa3.stable_max",
  "flash_attention_varlen": "pallas_fa3.varlen",
}

# `from pallas_fa3 import *`: the public names (imported by `__getattr__`).
__all__ = sorted([*_EXPORTS, "mods"])

if TYPE_CHECKING:
  from pallas_fa3 import mods as mods
  from pallas_fa3.attention import (
    explain as explain,
    flash_attention as flash_attention,
    flash_attention_with_kvcache as flash_attention_with_kvcache,
  )
  from pallas_fa3.backends import (
    IMPLEMENTATIONS as IMPLEMENTATIONS,
    Implementation as Implementation,
  )
  from pallas_fa3.backends.blockwise import BlockwiseConfig as BlockwiseConfig
  from pallas_fa3.dot_product import (
    dot_product_attention as dot_product_attention,
  )
  from pallas_fa3.flex import (
    BlockMask as BlockMask,
    create_block_mask as create_block_mask,
  )
  from pallas_fa3.fp8 import FP8Config as FP8Config
  from pallas_fa3.kernels.sm90.config import (
    Sm90BackwardConfig as Sm90BackwardConfig,
    Sm90Config as Sm90Config,
    Sm90ForwardConfig as Sm90ForwardConfig,
  )
  from pallas_fa3.kernels.sm90.config_decode import (
    Sm90DecodeConfig as Sm90DecodeConfig,
  )
  from pallas_fa3.kvcache import (
    FP8KVCache as FP8KVCache,
    quantize_kv_cache as quantize_kv_cache,
  )
  from pallas_fa3.parallel.ring.attention import (
    ring_attention as ring_attention,
  )
  from pallas_fa3.parallel.ring.steps import zigzag_order as zigzag_order
  from pallas_fa3.parallel.ulysses import ulysses_attention as ulysses_attention
  from pallas_fa3.reference import reference_attention as reference_attention
  from pallas_fa3.segments import (
    SegmentIds as SegmentIds,
    segment_ids_from_lengths as segment_ids_from_lengths,
    segment_positions as segment_positions,
  )
  from pallas_fa3.spec import AttentionSpec as AttentionSpec
  from pallas_fa3.stable_max import StableMax as StableMax
  from pallas_fa3.varlen import flash_attention_varlen as flash_attention_varlen


def __getattr__(name: str):
  if name in _EXPORTS:
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
  elif not name.startswith("_") and importlib.util.find_spec(
    f"{__name__}.{name}"
  ):
    value = importlib.import_module(f"{__name__}.{name}")
  else:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  globals()[name] = value  # later lookups skip __getattr__
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_EXPORTS) | {"mods"})
