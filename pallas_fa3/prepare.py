"""The one check of a prefill call's arguments: q, k, v and every option
`flash_attention` takes validated into its `AttentionSpec` and canonical
operands (the sinks, segment ids and flex options), each error naming the
argument. `flash_attention` (and so `dot_product_attention`, the Flax
adapter and Ulysses, which call it), `pallas_fa3.explain`,
`ring_attention` and the oracle `reference_attention` call it; decoding's own arguments are
`kvcache.make_decode_spec`'s. docs/api.md#conventions
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp

from pallas_fa3 import flex, modifiers, segments
from pallas_fa3.spec import (
  MAX_HEAD_DIM,
  AttentionSpec,
  check_arrays,
  make_spec,
)


class Prepared(NamedTuple):
  """A checked prefill call: its spec, and its `[heads_q]` sinks, its
  `SegmentIds` and its `flex.FlexOperands` (None where absent)."""

  spec: AttentionSpec
  sinks: Any
  segment_ids: Any
  flex: Any


def prepare(
  q: Any,
  k: Any,
  v: Any,
  *,
  causal: Any = False,
  softmax_scale: Any = None,
  fp8: Any = None,
  stable_max: Any = None,
  deterministic: Any = False,
  window_size: Any = None,
  softcap: Any = None,
  sinks: Any = None,
  segment_ids: Any = None,
  score_mod: Any = None,
  mask_mod: Any = None,
  block_mask: Any = None,
  bias: Any = None,
  max_head_dim: int | None = MAX_HEAD_DIM,
  score_dtype: Any = jnp.float32,
) -> Prepared:
  """`Prepared` of these arguments (`fp8` and `stable_max` already
  checked: `fp8.check_fp8`, `stable_max.check_stable_max`).
  `max_head_dim`: None for the oracle (`reference_attention`, past the
  kernels' head dims); `score_dtype`: the scores score_mod must keep.

  Raises:
    TypeError / ValueError naming the argument and its value or shape.
  """
  check_arrays(q=q, k=k, v=v)
  spec = make_spec(
    q,
    k,
    v,
    causal=causal,
    softmax_scale=softmax_scale,
    fp8=fp8,
    stable_max=stable_max,
    deterministic=deterministic,
    window_size=window_size,
    softcap=softcap,
    sinks=sinks is not None,
    segmented=segment_ids is not None,
    max_head_dim=max_head_dim,
  )
  sinks = modifiers.check_sinks(sinks, spec.heads_q)
  segment_ids = segments.check_segment_ids(
    segment_ids, spec.batch, spec.seq_q, spec.seq_kv
  )
  flex_spec, flex_ops = flex.prepare(
    score_mod=score_mod,
    mask_mod=mask_mod,
    block_mask=block_mask,
    bias=bias,
    batch=spec.batch,
    heads=spec.heads_q,
    seq_q=spec.seq_q,
    seq_kv=spec.seq_kv,
    score_dtype=score_dtype,
  )
  if flex_spec is not None:
    spec = dataclasses.replace(spec, flex=flex_spec)
  if spec.fp8 is not None and spec.head_dim != spec.head_dim_v:
    raise ValueError(
      f"fp8 needs v's head_dim equal to q's; got q.shape="
      f"{tuple(q.shape)}, v.shape={tuple(v.shape)}"
    )
  return Prepared(spec, sinks, segment_ids, flex_ops)
