"""The `blockwise` backend: the pure-JAX twin of the kernels' algorithm on
any device (the CPU default), for every mode: `forward.py`, `backward.py`,
`fp8.py` (the FP8 kernel's twin) and `decode.py` (the decode kernel's):
docs/api.md#backends.
"""

from __future__ import annotations

from typing import Any

import jax

from pallas_fa3 import modifiers
from pallas_fa3.backends.base import Backend
from pallas_fa3.backends.blockwise.backward import blockwise_backward
from pallas_fa3.backends.blockwise.decode import blockwise_decode, decode_tile
from pallas_fa3.backends.blockwise.forward import blockwise_forward
from pallas_fa3.backends.blockwise.fp8 import blockwise_forward_fp8
from pallas_fa3.backends.blockwise.tangent import blockwise_forward_tangent
from pallas_fa3.backends.blockwise.tiles import BlockwiseConfig
from pallas_fa3.kvcache import DecodeSpec, invariant_splits
from pallas_fa3.quant.config import default_tiles
from pallas_fa3.spec import AttentionSpec


class BlockwiseBackend(Backend):
  name = "blockwise"
  summary = (
    "pure-JAX FlashAttention (tiled online softmax), any device;"
    " the kernels' numerics twin"
  )
  automatic = True
  config_types = (BlockwiseConfig,)
  decode_config_types = (BlockwiseConfig,)

  def make_config(
    self, spec: AttentionSpec, config: BlockwiseConfig | None
  ) -> BlockwiseConfig:
    if config is not None:
      return config
    if spec.flex is not None and spec.flex.block is not None:
      return BlockwiseConfig(*spec.flex.block_tiles)  # its skipping
    if spec.fp8 is None:
      return BlockwiseConfig()
    # The FP8 kernel's tiles: the twin quantizes and rounds P as it would.
    return BlockwiseConfig(*default_tiles(spec.head_dim))

  def describe(self, spec, config) -> tuple[str, str]:
    tiles = f"tiles {config.block_q}x{config.block_kv}"
    if isinstance(spec, DecodeSpec):
      splits = self.decode_splits(spec, config)
      return (
        f"the blockwise twin of the decode kernel, {tiles}, {splits}"
        " split-KV range(s)",
        "none (decoding)",
      )
    what = "the FP8 kernel's twin" if spec.fp8 else "online softmax"
    forward = f"the blockwise twin (pure JAX, {what}), {tiles}"
    if spec.fp8 is not None:
      return forward, "none (fp8 has no gradient)"
    return forward, f"the blockwise recomputation (FlashAttention-2), {tiles}"

  def unsupported(self, spec: AttentionSpec, config: Any) -> str | None:
    if spec.fp8 is not None and spec.flex is not None:
      names = ", ".join(spec.flex.names())
      return f"fp8 is not implemented together with {names}"
    if spec.fp8 is not None and spec.stable_max is not None:
      return "stable_max is not implemented for fp8 attention"
    if spec.stable_max is not None and modifiers.active(spec):
      names = ", ".join(modifiers.active(spec))
      return f"stable_max is not implemented together with {names}"
    return None

  def forward(
    self, spec, config, q, k, v, *, sinks=None, segment_ids=None, flex=None
  ):  # fmt: skip
    return blockwise_forward(
      spec, config, q, k, v, sinks=sinks, segment_ids=segment_ids, flex=flex
    )

  def backward(
    self, spec, config, q, k, v, out, lse, dout, dlse, *, sinks=None,
    segment_ids=None, flex=None,
  ):  # fmt: skip
    del sinks  # in the lse
    return blockwise_backward(
      spec, config, q, k, v, out, lse, dout, dlse, segment_ids=segment_ids,
      flex=flex,
    )  # fmt: skip

  def describe_tangent(self, spec, config) -> str | None:
    return (
      "the blockwise forward+tangent pass (one walk, out, lse and their"
      f" tangents), tiles {config.block_q}x{config.block_kv}"
    )

  def forward_tangent(self, spec, config, primals, tangents):
    return blockwise_forward_tangent(spec, config, primals, tangents)

  def fp8_tiles(self, config: BlockwiseConfig) -> tuple[int, int]:
    return config.block_q, config.block_kv

  def fp8_forward(
    self, spec, config, x, *, sinks=None, segment_ids=None
  ) -> tuple[jax.Array, jax.Array]:
    return blockwise_forward_fp8(
      spec, config.block_q, config.block_kv, *x, sinks=sinks,
      segment_ids=segment_ids,
    )  # fmt: skip

  def make_decode_config(
    self, spec: DecodeSpec, config: BlockwiseConfig | None
  ) -> BlockwiseConfig:
    return BlockwiseConfig() if config is None else config

  def decode_splits(self, spec: DecodeSpec, config: BlockwiseConfig) -> int:
    if spec.batch_invariant:  # fixed runs of keys (kvcache.split_span)
      return invariant_splits(spec, decode_tile(spec, config.block_kv))
    return spec.num_splits or 1

  def decode(self, spec, config, splits, operands):
    return blockwise_decode(spec, config.block_kv, splits, *operands)


BACKEND = BlockwiseBackend()
