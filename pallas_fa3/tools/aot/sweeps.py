"""The sweeps of the deviceless compile (`aot`): which kernel configs and
call shapes `pallas-fa3 aot` compiles, as (compile function, spec, config):
docs/kernels.md#verification-without-a-gpu.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from pallas_fa3.tools.aot.compiler import (
  SweepItem,
  compile_backward,
  compile_forward,
  compile_tangent,
)
from pallas_fa3.tools.aot.decode import decode_defaults
from pallas_fa3.tools.aot.fp8 import compile_forward_fp8, compile_quantize

if TYPE_CHECKING:
  from pallas_fa3.spec import AttentionSpec

# `--modifiers`: (window_size, softcap, sinks, causal) at `PROFILE_SHAPE`.
MODIFIER_CASES = (
  ((256, None), None, False, True),  # sliding window, causal (FA3's (256, 0))
  ((128, 128), None, False, False),  # both sides, not causal
  ((128, None), None, False, False),  # left only, not causal
  ((None, 128), None, False, False),  # right only, not causal
  (None, 30.0, False, True),  # softcap (Gemma 2)
  (None, None, True, True),  # sinks (gpt-oss)
  ((256, None), 30.0, True, True),  # all three
)


def sweep() -> Iterator[SweepItem]:
  """(compile function, spec, config) for every supported config of every
  kernel: both dtypes, causal with GQA and ragged lengths."""
  import jax
  import jax.numpy as jnp

  from pallas_fa3.kernels.sm90 import (
    config as sm90_config,
    config_backward as sm90_bwd_config,
  )
  from pallas_fa3.spec import make_spec

  for dtype in (jnp.bfloat16, jnp.float16):
    size = jnp.dtype(dtype).itemsize
    for d in sm90_config.KERNEL_HEAD_DIMS:
      q = jax.ShapeDtypeStruct((1, 1000, 4, d), dtype)
      kv = jax.ShapeDtypeStruct((1, 1100, 2, d), dtype)
      spec = make_spec(q, kv, kv, causal=True)
      for config in sm90_config.forward_config_space(d, size):
        yield compile_forward, spec, config
      for det in (False, True):  # the fused kernel, and dK/dV + dQ
        spec = make_spec(q, kv, kv, causal=True, deterministic=det)
        for config in sm90_bwd_config.backward_config_space(d, size, det):
          yield compile_backward, spec, config


# (seq_q, seq_kv, heads_q, heads_kv): ragged GQA, aligned self, long, short
# MQA with sq < skv, sq > skv, and aligned GQA of 4 (Llama's 32/8). Spills
# depend on the shape (the lengths, the causal offset and the GQA group
# are compiled in).
BACKWARD_SHAPES = (
  (1000, 1100, 4, 2),
  (1024, 1024, 2, 2),
  (4096, 4096, 1, 1),
  (100, 300, 2, 1),
  (2048, 1024, 2, 2),
  (1024, 1024, 32, 8),
)


def backward_shapes_sweep() -> Iterator[SweepItem]:
  """Every backward config of both spaces (fused and deterministic) at
  every head dim over `BACKWARD_SHAPES`, causal and not, bf16."""
  import jax
  import jax.numpy as jnp

  from pallas_fa3.kernels.sm90 import (
    config as sm90_config,
    config_backward as sm90_bwd_config,
  )
  from pallas_fa3.spec import make_spec

  for d in sm90_config.KERNEL_HEAD_DIMS:
    for sq, skv, hq, hk in BACKWARD_SHAPES:
      for causal, det in itertools.product((True, False), (False, True)):
        q = jax.ShapeDtypeStruct((1, sq, hq, d), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((1, skv, hk, d), jnp.bfloat16)
        spec = make_spec(q, kv, kv, causal=causal, deterministic=det)
        for config in sm90_bwd_config.backward_config_space(d, 2, det):
          yield compile_backward, spec, config


def fp8_forward_sweep() -> Iterator[SweepItem]:
  """Every supported FP8 forward config, both output dtypes, with and
  without Q's residual; and the quantization kernel at each config's tiles.

  GQA with a ragged K/V length, causal (masked diagonal tiles with a
  successor) and non-causal (one masked edge tile, the last).
  """
  import jax.numpy as jnp

  from pallas_fa3 import fp8
  from pallas_fa3.kernels.sm90 import config_fp8 as sm90_fp8_config
  from pallas_fa3.spec import AttentionSpec

  tiles = set()
  for dtype in sm90_fp8_config.FP8_OUT_DTYPES:
    for d in sm90_fp8_config.FP8_HEAD_DIMS:
      for terms in (1, 2):
        fp8_config = fp8.FP8Config(q_residual=terms == 2)
        for config in sm90_fp8_config.fp8_forward_config_space(
          d, q_terms=terms
        ):
          for causal, sq, skv in ((True, 1000, 1100), (False, 1024, 1100)):
            spec = AttentionSpec(
              1, sq, skv, 4, 2, d, d, jnp.dtype(dtype), causal, d**-0.5,
              fp8=fp8_config,
            )  # fmt: skip
            yield compile_forward_fp8, spec, config
            if (d, config.block_q, config.block_kv, terms) not in tiles:
              tiles.add((d, config.block_q, config.block_kv, terms))
              yield compile_quantize, spec, config


# (head_dim, head_dim_v) unlike each other: DeepSeek's MLA training shapes
# (192, 128) and the others issue 32 names.
HEAD_DIM_PAIRS = ((192, 128), (128, 64), (64, 128), (256, 128))

# The review shape of the static-profile table: bf16, 4096 tokens, 8 heads.
PROFILE_SHAPE = (1, 4096, 8, 8)  # batch, seq, heads_q, heads_kv
# ... and of the fused backward with GQA (Llama's 32 query heads over 8):
# the group loop around the steps changes what the compiler keeps live.
GQA_SHAPE = (1, 4096, 32, 8)


def defaults_sweep(
  causal_only: bool = False, head_dims: Sequence[int] | None = None
) -> Iterator[SweepItem]:
  """(compile function, spec, config): the default config of every kernel at
  every head dim, at `PROFILE_SHAPE`, causal and not (causal only with
  `causal_only`: the causal kernels hold the unmasked steps' code too);
  the forward and both backwards at `HEAD_DIM_PAIRS` (causal); and the
  decode kernel's defaults (`aot_decode.decode_defaults`). `head_dims`
  keeps the query head dims among them (all when None)."""
  import jax.numpy as jnp

  from pallas_fa3.kernels.sm90 import (
    config as sm90_config,
    config_backward as sm90_bwd_config,
    config_fp8 as sm90_fp8_config,
  )
  from pallas_fa3.spec import AttentionSpec

  keep = lambda d: head_dims is None or d in head_dims
  b, s, hq, hk = PROFILE_SHAPE
  for d in filter(keep, sm90_config.KERNEL_HEAD_DIMS):
    for causal in (True,) if causal_only else (True, False):
      spec = AttentionSpec(
        b, s, s, hq, hk, d, d, jnp.dtype(jnp.bfloat16), causal, d**-0.5
      )
      yield compile_forward, spec, sm90_config.default_forward_config(spec)
      yield from tangent_items(spec)
      for det in (False, True):  # the fused backward, and dK/dV + dQ
        bwd = dataclasses.replace(spec, deterministic=det)
        config = sm90_bwd_config.default_backward_config(bwd)
        yield compile_backward, bwd, config
      # The fused backward with GQA where its consumers own K/V tiles (a
      # group loop around their steps; d64-d128): the one whose spills
      # depended on the group (issue 43).
      gb, gs, ghq, ghk = GQA_SHAPE
      gqa = dataclasses.replace(
        spec, batch=gb, seq_q=gs, seq_kv=gs, heads_q=ghq, heads_kv=ghk
      )
      config = sm90_bwd_config.default_backward_config(gqa)
      if config.dkdv_head_splits == 1:
        yield compile_backward, gqa, config
      if d in sm90_fp8_config.FP8_HEAD_DIMS:
        config = sm90_fp8_config.default_fp8_forward_config(d)
        yield compile_forward_fp8, spec, config
        if causal:  # the quantization pass does not depend on it
          yield compile_quantize, spec, config
  for d, dv in HEAD_DIM_PAIRS:  # value head dims unlike the query's, causal
    if not keep(d):
      continue
    spec = AttentionSpec(
      b, s, s, hq, hk, d, dv, jnp.dtype(jnp.bfloat16), True, d**-0.5
    )
    yield compile_forward, spec, sm90_config.default_forward_config(spec)
    yield from tangent_items(spec)
    for det in (False, True):
      bwd = dataclasses.replace(spec, deterministic=det)
      yield compile_backward, bwd, sm90_bwd_config.default_backward_config(bwd)
  yield from decode_defaults(head_dims)


def tangent_items(spec: AttentionSpec) -> Iterator[SweepItem]:
  """The forward-tangent kernel of `spec` (jax.jvp's tangents), where it
  serves the call (none where the blockwise pass does; `flex_sweep` adds
  its flex operands)."""
  from pallas_fa3.kernels.sm90 import forward_tangent

  config = forward_tangent.tangent_config(spec)
  if forward_tangent.tangent_unsupported(spec, config) is None:
    yield compile_tangent, spec, config


def modifiers_sweep() -> Iterator[SweepItem]:
  """The default forward and both backwards (what a call runs, fused or
  the pair, `backward_items`; deterministic) of every head dim with each
  of `MODIFIER_CASES` (windows, softcap, sinks), and the same of the
  causal cases with segment ids, bf16 at `PROFILE_SHAPE`; then the FP8
  forward with the same options."""
  import jax

  from pallas_fa3.kernels.sm90 import (
    config as sm90_config,
  )
  from pallas_fa3.spec import make_spec

  b, s, hq, hk = PROFILE_SHAPE
  for d in sm90_config.KERNEL_HEAD_DIMS:
    q = jax.ShapeDtypeStruct((b, s, hq, d), "bfloat16")
    kv = jax.ShapeDtypeStruct((b, s, hk, d), "bfloat16")
    for window, cap, sinks, causal in MODIFIER_CASES:
      spec = make_spec(
        q, kv, kv, causal=causal, window_size=window, softcap=cap, sinks=sinks
      )
      yield compile_forward, spec, sm90_config.default_forward_config(spec)
      yield from tangent_items(spec)
      # With causal, packed documents too (segment ids).
      for packed in (False, True) if causal else (False,):
        one = dataclasses.replace(spec, segmented=packed)
        if packed:
          yield compile_forward, one, sm90_config.default_forward_config(one)
          yield from tangent_items(one)
        for det in (False, True):
          yield from backward_items(dataclasses.replace(one, deterministic=det))
  yield from _fp8_modifiers()


def backward_items(spec: AttentionSpec) -> Iterator[SweepItem]:
  """The backward kernels a call of `spec` without a tiling runs (its
  `config_backward.backward_plan`: the fused kernel, or the pair where
  the fused one spills or `deterministic`); none where the blockwise twin
  runs."""
  from pallas_fa3.kernels.sm90 import config_backward as sm90_bwd_config

  plan = sm90_bwd_config.backward_plan(spec)
  if plan.form != "blockwise":
    fused = plan.form == "fused"
    yield (
      functools.partial(compile_backward, fused=fused),
      plan.spec,
      plan.tiling,
    )


def _fp8_modifiers() -> Iterator[SweepItem]:
  """The FP8 forward's default config of every FP8 head dim with each of
  `MODIFIER_CASES`, and with segment ids on the causal ones."""
  import jax

  from pallas_fa3 import fp8
  from pallas_fa3.kernels.sm90 import config_fp8 as sm90_fp8_config
  from pallas_fa3.spec import make_spec

  b, s, hq, hk = PROFILE_SHAPE
  for d in sm90_fp8_config.FP8_HEAD_DIMS:
    q = jax.ShapeDtypeStruct((b, s, hq, d), "bfloat16")
    kv = jax.ShapeDtypeStruct((b, s, hk, d), "bfloat16")
    config = sm90_fp8_config.default_fp8_forward_config(d)
    for window, cap, sinks, causal in MODIFIER_CASES:
      for packed in (False, True) if causal else (False,):
        spec = make_spec(
          q,
          kv,
          kv,
          causal=causal,
          window_size=window,
          softcap=cap,
          sinks=sinks,
          segmented=packed,
          fp8=fp8.FP8Config(),
        )
        yield compile_forward_fp8, spec, config


def flex_cases(seq: int, heads: int) -> dict:
  """name -> flash_attention keywords: each ready-made function of
  `pallas_fa3.mods` the kernels compile, a user closure, a dense bias and a
  block mask, at `seq` x `seq` with `heads` query heads (the --flex sweep;
  T5's relative-position table: the forward only, the backward kernels
  refuse it)."""
  import jax.numpy as jnp
  import numpy as np

  import pallas_fa3
  from pallas_fa3 import mods

  ids = jnp.asarray(np.arange(seq)[None] // (seq // 16), jnp.int32)
  slopes = mods.alibi_slopes(heads)
  doc = mods.and_masks(mods.causal_top_left, mods.document_mask(ids))
  return {
    "causal_mask_mod": dict(mask_mod=mods.causal_top_left),
    "sliding_window": dict(mask_mod=mods.sliding_window(256)),
    "document": dict(mask_mod=mods.document_mask(ids)),
    "prefix_lm": dict(mask_mod=mods.prefix_lm(jnp.array([512], jnp.int32))),
    "chunked": dict(mask_mod=mods.chunked(1024)),
    "softcap": dict(score_mod=mods.softcap(30.0), causal=True),
    "alibi": dict(score_mod=mods.alibi(slopes), causal=True),
    "t5_bias": dict(
      score_mod=mods.t5_relative_position_bias(jnp.zeros((heads, 32)))
    ),
    "closure": dict(
      score_mod=lambda s, b, h, qi, ki: s * (1 + slopes[h]),
      mask_mod=lambda b, h, qi, ki: ids[b, qi] >= ids[b, ki],
    ),
    "bias": dict(bias=jnp.zeros((1, heads, seq, seq), jnp.bfloat16)),
    "block_mask": dict(
      block_mask=pallas_fa3.create_block_mask(doc, 1, None, seq, seq)
    ),
  }


# The flex cases the sweep also compiles with segment ids (a padding mask
# beside a bias, ALiBi or softcap: `dot_product_attention`'s common calls),
# forward and the backward the backend runs.
SEGMENTED_FLEX_CASES = ("sliding_window", "softcap", "alibi", "bias")


def flex_sweep() -> Iterator[SweepItem]:
  """The default forward of every head dim with each of `flex_cases`, bf16
  at `PROFILE_SHAPE`, the tangent kernel where it takes the case (the
  score_mod's arrays without tangents, a bias with one), the deterministic
  dK/dV and dQ kernels of the
  cases they differentiate (`flex_tile.backward_unsupported`), the fused
  kernel of those it takes (masks, a score_mod without floating arrays:
  the default backward where the tiling fuses), ALiBi
  with learnable slopes (their gradient summed by the dQ kernel), and a
  learnable per-key bias (summed by the dK/dV kernel) where its
  default tiling takes one; `SEGMENTED_FLEX_CASES` again with segment ids
  (forward and backward)."""
  import functools

  import jax

  from pallas_fa3 import flex, mods
  from pallas_fa3.kernels.sm90 import (
    config as sm90_config,
    config_backward as sm90_bwd_config,
    flex_tile,
  )
  from pallas_fa3.spec import make_spec

  b, s, hq, hk = PROFILE_SHAPE
  for d in sm90_config.KERNEL_HEAD_DIMS:
    q = jax.ShapeDtypeStruct((b, s, hq, d), "bfloat16")
    kv = jax.ShapeDtypeStruct((b, s, hk, d), "bfloat16")
    for name, kw in flex_cases(s, hq).items():
      causal = kw.pop("causal", False)
      spec = make_spec(q, kv, kv, causal=causal)
      fspec, ops = flex.prepare(
        **{k: kw.get(k) for k in ("score_mod", "mask_mod", "block_mask", "bias")},
        batch=b, heads=hq, seq_q=s, seq_kv=s,
      )  # fmt: skip
      spec = dataclasses.replace(spec, flex=fspec)
      config = sm90_config.default_forward_config(spec)
      label = f" flex={name}"
      yield (
        functools.partial(compile_forward, flex=ops, label=label),
        spec,
        config,
      )
      # jax.jvp's tangent kernel: the score_mod's arrays without tangents,
      # a bias with one (a tile a step); `benchmarks/tangent_model.py`
      # compiles the arrays' tangents (traced arrays)
      tfs, tops = flex.frozen(fspec, ops)
      for fn, tspec, tconfig in tangent_items(
        dataclasses.replace(spec, flex=tfs)
      ):
        yield functools.partial(fn, flex=tops, label=label), tspec, tconfig
      det = dataclasses.replace(spec, deterministic=True)
      tiling = sm90_bwd_config.default_backward_config(det)
      if tiling is not None and not any(
        flex_tile.backward_unsupported(det, c.block_q, c.block_kv, tiling)
        for c in (tiling, tiling.dq_config)
      ):
        yield (
          functools.partial(compile_backward, flex=ops, label=label),
          det,
          tiling,
        )
      plan = sm90_bwd_config.backward_plan(spec)  # the call's own backward
      if plan.form == "fused":
        yield (
          functools.partial(compile_backward, flex=ops, label=label),
          plan.spec,
          plan.tiling,
        )
      if name in SEGMENTED_FLEX_CASES:  # beside packed documents' ids
        seg = dataclasses.replace(spec, segmented=True)
        seg_label = label + " segment_ids"
        yield (
          functools.partial(compile_forward, flex=ops, label=seg_label),
          seg,
          sm90_config.default_forward_config(seg),
        )
        plan = sm90_bwd_config.backward_plan(seg)
        if plan.form != "blockwise":  # (else: the twin, said by the plan)
          yield (
            functools.partial(compile_backward, flex=ops, label=seg_label),
            plan.spec,
            plan.tiling,
          )
      if name == "alibi":
        # learnable slopes: traced, so the dQ kernel sums their gradient
        slopes = mods.alibi_slopes(hq)
        yield (
          functools.partial(
            compile_backward,
            label=" flex=alibi learnable",
            learnable=(mods.alibi, (slopes,)),
          ),  # fmt: skip
          det,
          tiling,
        )
      if name == "alibi":  # a learnable per-(head, key) bias: per-key sums
        learnable = (_per_key_bias, (jax.numpy.zeros((hq, s), "float32"),))
        key_tiling, reason = _learnable_tiling(det, *learnable)
        if reason is None:
          yield (
            functools.partial(
              compile_backward,
              label=" flex=per-key bias learnable",
              learnable=learnable,
            ),  # fmt: skip
            det,
            key_tiling,
          )


def _per_key_bias(table):
  """A learnable bias per (head, key): its gradient is the dK/dV kernel's."""
  return lambda s, b, h, qi, ki: s + table[h, ki]


def _learnable_tiling(spec, make_score_mod, arrays):
  """(default deterministic backward tiling, the kernels' refusal or None)
  of `spec` with the score_mod `make_score_mod(*arrays)` over traced
  arrays (so that they carry gradients, as in `compile_backward`)."""
  import jax

  from pallas_fa3 import flex
  from pallas_fa3.kernels.sm90 import config_backward, flex_tile

  found = []

  def trace(*a):
    fs, _ = flex.prepare(
      score_mod=make_score_mod(*a), mask_mod=None, block_mask=None,
      bias=None, batch=spec.batch, heads=spec.heads_q, seq_q=spec.seq_q,
      seq_kv=spec.seq_kv,
    )  # fmt: skip
    with_fn = dataclasses.replace(spec, flex=fs)
    tiling = config_backward.default_backward_config(with_fn)
    reasons = [
      flex_tile.backward_unsupported(with_fn, c.block_q, c.block_kv, tiling)
      for c in (tiling, tiling.dq_config)
    ]
    found.append((tiling, next((r for r in reasons if r), None)))
    return a

  jax.make_jaxpr(trace)(*arrays)
  return found[0]
