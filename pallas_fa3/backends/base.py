"""What a backend is: one way to compute attention, in every mode a call can
have (the forward and backward of `flash_attention`, its FP8 forward, and
decoding over a KV cache), and the static half of a call. A backend that
cannot serve a call says why; see `pallas_fa3.backends` for the registry.
docs/api.md#backends
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple

import jax

from pallas_fa3.kvcache import DecodeSpec
from pallas_fa3.quant import e4m3
from pallas_fa3.spec import AttentionSpec

NO_FP8_GRADIENT = (
  "gradients through FP8 attention are not implemented; differentiate the"
  " bf16/fp16 path (fp8=False) or wrap the FP8 call in"
  " jax.lax.stop_gradient"
)
NO_DECODE_GRADIENT = (
  "flash_attention_with_kvcache is forward only (decoding): it has no"
  " gradient. Differentiate pallas_fa3.flash_attention instead, or wrap"
  " the call in jax.lax.stop_gradient"
)

Spec = AttentionSpec | DecodeSpec


class Backend:
  """One way to compute attention (compared and hashed by identity).

  A subclass overrides the modes it serves; the others raise
  `NotImplementedError` saying so, and `unsupported` / `decode_unsupported`
  say why before any call is made.

  Attributes:
    name: the `implementation=` string.
    summary: one line for `pallas-fa3 info` and the README table.
    automatic: a candidate of the automatic choice (computes the kernels'
      function, with P rounded to the input dtype).
    partitionable: may run as a `custom_partitioning` op (a backend whose
      calls have side effects, like the Pallas interpreter's, may not).
    backward_uses_lse: the backward reads the residual lse rather than
      recomputing its own softmax (ring attention needs it).
    device_hint: what to do instead when `device_reason` refuses.
    config_types: the `config=` classes of `flash_attention` calls.
    decode_config_types: those of `flash_attention_with_kvcache` calls.
  """

  name: str = ""
  summary: str = ""
  automatic: bool = False
  partitionable: bool = True
  backward_uses_lse: bool = True
  device_hint: str = ""
  config_types: tuple[type, ...] = ()
  decode_config_types: tuple[type, ...] = ()

  def __repr__(self) -> str:
    return f"<backend {self.name}>"

  def device_reason(self) -> str | None:
    """Whether the devices present can run it (None: yes). Only the
    automatic choice and eager calls consult it, so an explicit backend
    still lowers for another platform."""
    return None

  # -- flash_attention: forward, backward, FP8 ------------------------------
  def make_config(self, spec: AttentionSpec, config: Any) -> Any:
    """`config` with the defaults of `spec` filled in."""
    return config

  def unsupported(self, spec: AttentionSpec, config: Any) -> str | None:
    """Why it cannot serve `spec` with `config` (as `make_config` returns
    it), or None; covers `spec.fp8`, `spec.stable_max` and the modifiers."""
    return None

  def forward(
    self,
    spec: AttentionSpec,
    config: Any,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    sinks: jax.Array | None = None,
    segment_ids: Any = None,
    flex: Any = None,
  ) -> tuple[jax.Array, jax.Array]:
    """(out, lse); `sinks` `[b, heads_q]` float32 with `spec.sinks`,
    `segment_ids` a `segments.SegmentIds` with `spec.segmented`, `flex` a
    `flex.FlexOperands` with `spec.flex`."""
    raise NotImplementedError(f"implementation={self.name!r} has no forward")

  def backward(
    self,
    spec: AttentionSpec,
    config: Any,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    dout: jax.Array,
    dlse: jax.Array,
    *,
    sinks: jax.Array | None = None,
    segment_ids: Any = None,
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv) from the residuals; `sinks` reach only a backend with
    `backward_uses_lse=False` (elsewhere they are in the lse)."""
    raise NotImplementedError(f"implementation={self.name!r} has no backward")

  def plan_backward(self, spec: AttentionSpec, config: Any) -> Any:
    """How `spec`'s gradients run here, decided once at resolve time and
    carried to the backward (`StaticCall.backward_plan`, handed to
    `backward` as `plan=`); None where there is one way. Its `describe()`
    is `pallas_fa3.explain`'s line."""
    return None

  def describe(self, spec: Spec, config: Any) -> tuple[str, str]:
    """(what runs the forward or decode, what runs the gradients) of
    `spec` with `config` (defaults filled in), for `pallas_fa3.explain`."""
    return f"{self.name}: {self.summary}", f"{self.name}'s backward"

  def describe_flex(self, spec: Spec, config: Any) -> list[str]:
    """Lines on how `spec`'s flex options run here (none without)."""
    fs = getattr(spec, "flex", None)
    if fs is None:
      return []
    lines = []
    for name, fn in (("score_mod", fs.score_mod), ("mask_mod", fs.mask_mod)):
      if fn is not None:
        lines.append(
          f"  {name} {fn!r}: traced as JAX on each tile's [batch, heads,"
          f" q, kv] grid; {describe_arrays(fn, name == 'score_mod')}"
        )
    lines += describe_operands(fs)
    return ["flex:"] + lines

  def describe_tangent(self, spec: AttentionSpec, config: Any) -> str | None:
    """What computes `spec`'s tangents here (`pallas_fa3.explain`'s
    "jvp:" line), or None: no tangent pass of its own (`pallas_fa3.tangent`
    falls back to the blockwise twin's and the plan says so)."""
    return None

  def forward_tangent(
    self, spec: AttentionSpec, config: Any, primals: Prefill, tangents: Any
  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(out, lse, out's tangent, lse's tangent) at `primals` along
    `tangents` (a `Prefill` of arrays: zeros where there is none, float0
    for integers); served where `describe_tangent` is not None."""
    raise NotImplementedError(
      f"implementation={self.name!r} has no forward+tangent pass"
    )

  # Whether JAX can differentiate this backend's tangent pass (pure JAX):
  # a gradient through a kernel's tangent differentiates the blockwise
  # twin's pass instead (`pallas_fa3.tangent.tangents`).
  tangent_differentiable = True

  def tangent_fallback(self, spec: AttentionSpec, config: Any) -> str:
    """Why `describe_tangent` is None for `spec`: the plan's words."""
    del spec, config
    return f"{self.name} has no fused forward+tangent kernel"

  def tangent_of_result(
    self,
    spec: AttentionSpec,
    config: Any,
    primals: Prefill,
    result: tuple[jax.Array, jax.Array],
    tangents: Any,
  ) -> tuple[jax.Array, jax.Array]:
    """(out's tangent, lse's tangent) given the call's own (out, lse)
    `result`; a pass that recomputes them (`forward_tangent`) ignores it."""
    del result
    return self.forward_tangent(spec, config, primals, tangents)[2:]

  def fp8_tiles(self, config: Any) -> tuple[int, int]:
    """(block_q, block_kv): the quantization tiles of an FP8 call."""
    raise NotImplementedError(f"implementation={self.name!r} has no FP8 path")

  def fp8_quantize(self, *args: Any, **kwargs: Any) -> Any:
    """The quantization pass, with `e4m3.quantize_inputs`'s signature and
    bits (that pure-JAX pass unless a kernel serves it)."""
    return e4m3.quantize_inputs(*args, **kwargs)

  def fp8_forward(
    self,
    spec: AttentionSpec,
    config: Any,
    x: Any,
    *,
    sinks: jax.Array | None = None,
    segment_ids: Any = None,
  ) -> tuple[jax.Array, jax.Array]:
    """(out, lse) of pre-quantized `FP8Inputs` `x`."""
    raise NotImplementedError(f"implementation={self.name!r} has no FP8 path")

  # -- flash_attention_with_kvcache -----------------------------------------
  def make_decode_config(self, spec: DecodeSpec, config: Any) -> Any:
    return config

  def decode_unsupported(self, spec: DecodeSpec, config: Any) -> str | None:
    return None

  def decode_splits(self, spec: DecodeSpec, config: Any) -> int:
    """Split-KV ranges per sequence (every count computes the function)."""
    return spec.num_splits or 1

  def decode(
    self, spec: DecodeSpec, config: Any, splits: int, operands: Decode
  ) -> tuple[jax.Array, jax.Array]:
    """(out, lse) over each sequence's keys `[starts[b], lengths[b])` (the
    appended tokens already written): `operands` a `Decode` (its fields
    say what each is)."""
    raise NotImplementedError(f"implementation={self.name!r} has no decode")

  # -- one mode or the other: what the registry asks ------------------------
  def takes(self, spec: Spec) -> tuple[type, ...]:
    """The config classes it takes for `spec`'s mode."""
    if isinstance(spec, DecodeSpec):
      return self.decode_config_types
    return self.config_types

  def config_for(self, spec: Spec, config: Any) -> Any:
    if isinstance(spec, DecodeSpec):
      return self.make_decode_config(spec, config)
    return self.make_config(spec, config)

  def reason(self, spec: Spec, config: Any) -> str | None:
    """Why it cannot serve `spec` with `config` (defaults filled in)."""
    if isinstance(spec, DecodeSpec):
      return self.decode_unsupported(spec, config)
    return self.unsupported(spec, config)

  def config_mismatch(
    self, config: Any, spec: Spec | None = None
  ) -> str | None:
    """Why `config` does not belong to this backend (for `spec`'s mode),
    or None."""
    types = self.config_types if spec is None else self.takes(spec)
    if config is None or isinstance(config, types):
      return None
    if not types:
      return f"implementation={self.name!r} takes no config"
    names = " or ".join(c.__name__ for c in types)
    return f"implementation={self.name!r} takes a {names}"

  # -- flash_attention's passes, FP8 included --------------------------------
  def run_forward(
    self,
    spec: AttentionSpec,
    config: Any,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    **extras: Any,
  ) -> tuple[jax.Array, jax.Array]:
    """`forward`, or with `spec.fp8` the quantization pass and
    `fp8_forward`. `extras`: `sinks=` and `segment_ids=`."""
    if spec.fp8 is None:
      return self.forward(spec, config, q, k, v, **extras)
    block_q, block_kv = self.fp8_tiles(config)
    x = self.fp8_quantize(
      q,
      k,
      v,
      spec.fp8.prng_key(),
      block_q=block_q,
      block_kv=block_kv,
      block_quantization=spec.fp8.block_quantization,
      rotation=spec.fp8.rotation,
      q_residual=spec.fp8.q_residual,
    )
    return self.fp8_forward(spec, config, x, **extras)

  def run_backward(
    self,
    spec: AttentionSpec,
    config: Any,
    *residuals_and_cts: jax.Array,
    sinks: jax.Array | None = None,
    segment_ids: Any = None,
    flex: Any = None,
    plan: Any = None,
  ) -> Grads:
    """`backward` on `(q, k, v, out, lse, dout, dlse)`; the sinks only where
    the lse does not carry them. With `flex` (`spec.flex`'s operands) the
    backend's `backward` returns `(dq, dk, dv, (dbias, dscore))`, here
    `Grads.dflex`.
    `plan`: `plan_backward`'s decision for the call (None: decided here).

    Raises:
      NotImplementedError: an FP8 call (FP8 has no backward).
    """
    if spec.fp8 is not None:
      raise NotImplementedError(NO_FP8_GRADIENT)
    extras = {} if segment_ids is None else {"segment_ids": segment_ids}
    if flex is not None:
      extras["flex"] = flex
    if plan is not None:
      extras["plan"] = plan
    if sinks is not None and not self.backward_uses_lse:
      extras["sinks"] = sinks
    dq, dk, dv, *dflex = self.backward(
      spec, config, *residuals_and_cts, **extras
    )
    return Grads(dq, dk, dv, FlexGrads(*dflex[0]) if dflex else None)


def describe_arrays(fn: Any, score: bool) -> str:
  """A user function's arrays in words, numbered as the kernels' reads
  are: those lifted into the call's operands (traced ones: a floating one
  of a score_mod gets a gradient), then the concrete ones it holds."""
  consts = fn.consts[:-2] if fn.shift is not None else fn.consts
  held = fn.constants()
  if not consts and not held:
    return "it captures no array"
  parts = []
  for i, c in enumerate(tuple(consts) + tuple(held)):
    dtype = jax.numpy.result_type(c)
    learnable = (
      i < len(consts)
      and score
      and jax.numpy.issubdtype(dtype, jax.numpy.inexact)
    )
    kind = "traced" if i < len(consts) else "constant"
    parts.append(
      f"#{i} {list(jax.numpy.shape(c))} {jax.numpy.dtype(dtype).name}"
      f" ({kind}{', learnable: gets a gradient' if learnable else ''})"
    )
  return "its arrays, operands of the call: " + ", ".join(parts)


def describe_operands(fs: Any) -> list[str]:
  """The bias's and block mask's lines."""
  lines = []
  if fs.bias is not None:
    b, h = fs.bias
    lines.append(
      f"  bias [{b}, {h}, seq_q, seq_kv]: added to each tile's scores;"
      " dbias is dS (summed over its broadcast dims)"
    )
  if fs.block is not None:
    b, h, bq, bkv = fs.block
    kind = "a dense mask" if fs.dense else "the mask_mod"
    lines.append(
      f"  block_mask [{b}, {h}] of {bq}x{bkv} tiles: empty tiles skipped,"
      f" full ones unmasked, partial ones masked by {kind}"
    )
  return lines


# What a call computes (`StaticCall.op`): flash_attention's forward (FP8
# included: `spec.fp8`, quantizing inside) and backward, the FP8 forward of
# pre-quantized operands, and decoding over a KV cache.
Op = Literal["forward", "backward", "fp8", "decode"]


@dataclasses.dataclass(frozen=True)
class StaticCall:
  """The static (hashable) half of a call: what to compute and with what
  (the custom_vjp's and the partitioner's non-differentiable argument).

  Attributes:
    spec: the call.
    backend: what computes it.
    config: the backend's config, defaults filled in.
    op: which computation (`Op`); its operands are the matching tuple below.
    splits: a decode call's split-KV ranges.
    ring: with a sequence split named by `ring_attention`, its
      `parallel.ring_plan.RingPlan` (the partitioner runs the ring).
    backward_plan: how its gradients run (`Backend.plan_backward`).
  """

  spec: Spec
  backend: Backend
  config: Any = None
  op: Op = "forward"
  splits: int = 1
  ring: Any = None
  # `Backend.plan_backward`'s decision, made with the call's plan
  # (`backends.plan`) and read by the backward: None where the backend
  # has one way, or for a call planned elsewhere (a ring step).
  backward_plan: Any = None


class FlexGrads(NamedTuple):
  """The cotangents of a call's flex operands a backend computes: dbias
  (None without a bias), and per score_mod array its gradient (None for
  an integer one). `flex.cotangents` makes the operands' tree of them."""

  dbias: jax.Array | None
  dscore: tuple


class Grads(NamedTuple):
  """What `Backend.run_backward` returns: dq, dk, dv shaped like q, k, v,
  and with flex operands their `FlexGrads` (else None)."""

  dq: jax.Array
  dk: jax.Array
  dv: jax.Array
  dflex: FlexGrads | None = None


class Prefill(NamedTuple):
  """The operands of a forward call: q, k, v, and `[b, heads_q]` float32
  sinks and a `segments.SegmentIds` where the spec has them (else None)."""

  q: jax.Array
  k: jax.Array
  v: jax.Array
  sinks: jax.Array | None = None
  segment_ids: Any = None
  flex: Any = None  # a `flex.FlexOperands` with `spec.flex`


class Backward(NamedTuple):
  """The operands of a backward call: the forward's and its residuals and
  cotangents."""

  forward: Prefill
  out: jax.Array
  lse: jax.Array
  dout: jax.Array
  dlse: jax.Array


class Quantized(NamedTuple):
  """The operands of an FP8 call on pre-quantized inputs (`FP8Inputs`)."""

  x: Any
  sinks: jax.Array | None = None
  segment_ids: Any = None


class Decode(NamedTuple):
  """The operands of a decode call (`Backend.decode`'s)."""

  q: jax.Array
  k_cache: jax.Array
  v_cache: jax.Array | None
  lengths: jax.Array
  rows: jax.Array
  page_table: jax.Array | None
  sinks: jax.Array | None
  descale: tuple[jax.Array, jax.Array] | None
  flex: Any = None  # flex.FlexOperands (score_mod / mask_mod consts, mask)
  starts: jax.Array | None = None  # int32 [b]: cache_leftpad (spec.leftpad)
