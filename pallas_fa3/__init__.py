"""pallas-fa3: FlashAttention-3 for Hopper in JAX Pallas Mosaic GPU.

Public API (everything else is private or lives in a submodule):
  flash_attention      attention with a choice of backend and custom_vjp
  flash_attention_with_kvcache
                       attention over a KV cache (decoding: contiguous or
                       paged, appended tokens, split-KV, GQA-packed)
  quantize_kv_cache    a KV cache in e4m3 with its descales (FP8KVCache)
  Sm90DecodeConfig     tiling of the Hopper decode kernel
  reference_attention  materialized baseline attention (the oracle)
  BlockwiseConfig      tile sizes of the portable blockwise backend
  Sm90Config           the Hopper kernels' tilings (mosaic/interpret):
                       Sm90Config(forward=..., backward=...)
  Sm90ForwardConfig    tiling of the Hopper forward kernel
  Sm90BackwardConfig   tiling of the Hopper backward kernels
  AttentionSpec        the validated, canonical description of a call
  IMPLEMENTATIONS      the backend names; `Implementation` is their Literal
  StableMax            settings of flash_attention(stable_max=...)
  ring_attention       context parallelism: the sequence sharded over a mesh axis
  ulysses_attention    context parallelism by all-to-all (sequence <-> heads)
  zigzag_order         the token order of ring_attention's causal zig-zag layout
  FP8Config            FP8 quantization options of flash_attention(fp8=...)
  SegmentIds           packed sequences: flash_attention(segment_ids=...)
  segment_ids_from_lengths, segment_positions
                       segment ids of packed documents and their restarting
                       positions (for RoPE)
"""

from pallas_fa3.attention import (
  flash_attention as flash_attention,
  flash_attention_with_kvcache as flash_attention_with_kvcache,
)
from pallas_fa3.backends import (
  IMPLEMENTATIONS as IMPLEMENTATIONS,
  Implementation as Implementation,
)
from pallas_fa3.backends.blockwise import BlockwiseConfig as BlockwiseConfig
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
from pallas_fa3.parallel.ring.attention import ring_attention as ring_attention
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

__version__ = "0.1.0"
