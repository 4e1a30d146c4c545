"""pallas-fa3: FlashAttention-3 for Hopper in JAX Pallas Mosaic GPU.

Public API (everything else is private or lives in a submodule):
  flash_attention      attention with a choice of backend and custom_vjp
  reference_attention  materialized baseline attention (the oracle)
  BlockwiseConfig      tile sizes of the portable blockwise backend
  Sm90ForwardConfig    tiling of the Hopper forward kernel (mosaic/interpret)
  AttentionSpec        the validated, canonical description of a call
  FP8Config            FP8 quantization options of flash_attention(fp8=...)
"""

from pallas_fa3.attention import flash_attention as flash_attention
from pallas_fa3.blockwise import BlockwiseConfig as BlockwiseConfig
from pallas_fa3.config import Sm90ForwardConfig as Sm90ForwardConfig
from pallas_fa3.fp8 import FP8Config as FP8Config
from pallas_fa3.reference import reference_attention as reference_attention
from pallas_fa3.spec import AttentionSpec as AttentionSpec
from pallas_fa3.spec import IMPLEMENTATIONS as IMPLEMENTATIONS

__version__ = "0.1.0"
