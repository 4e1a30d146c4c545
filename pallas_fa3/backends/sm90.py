"""The Hopper kernels as backends, in every mode: `mosaic` (compiled for
sm90) and `interpret` (the same kernels in Pallas GPU interpret mode on a
CPU, race detection on). Where a kernel cannot take a call's segment ids
(ids whose keys are not contiguous), or the backward kernels its options,
the blockwise twin computes the same function, said or decided on the
device. The kernel modules are imported when a call is traced, so importing
the registry does not load Mosaic GPU. docs/kernels.md
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax

from pallas_fa3 import segments
from pallas_fa3.backends import blockwise, interpret_pool
from pallas_fa3.backends.base import Backend
from pallas_fa3.kernels.sm90 import (
  config as sm90_config,
  config_backward as sm90_bwd_config,
  config_decode,
  config_fp8 as sm90_fp8_config,
)
from pallas_fa3.kernels.sm90.config import (
  Sm90Config,
  Sm90ForwardConfig,
)
from pallas_fa3.kernels.sm90.config_decode import Sm90DecodeConfig
from pallas_fa3.kvcache import DecodeSpec
from pallas_fa3.spec import AttentionSpec


def _on_device(exact: Any, run: Any, twin: Any, operands: Any) -> Any:
  """`lax.cond(exact, run, twin, operands)`: the kernel where its segment
  bounds are exact, else the blockwise twin (the same function). Under
  vmap the kernel runs when every example's bounds are exact and the twin
  otherwise, rather than vmap's both-then-select (which interpret mode's
  effects cannot do at all)."""

  @jax.custom_batching.custom_vmap
  def choose(exact, operands):
    return jax.lax.cond(exact, run, twin, operands)

  @choose.def_vmap
  def rule(axis_size, in_batched, exact, operands):
    del axis_size
    exact_batched, batched = in_batched
    axes = (jax.tree.map(lambda b: 0 if b else None, batched),)
    every = jax.numpy.all(exact) if exact_batched else exact
    out = jax.lax.cond(
      every,
      jax.vmap(run, in_axes=axes),
      jax.vmap(twin, in_axes=axes),
      operands,
    )
    return out, jax.tree.map(lambda _: True, out)

  return choose(exact, operands)


# Race detection in interpret mode costs little at the small shapes the
# interpreter is for, and a race is exactly what it exists to find.
INTERPRET_DETECT_RACES = True


def hopper_reason() -> str | None:
  """None when the default JAX backend is an sm90 (Hopper) GPU."""
  device = jax.devices()[0]
  if device.platform != "gpu":
    return f"no GPU: the default JAX backend is {device.platform!r}"
  cc = getattr(device, "compute_capability", None)
  if cc is None or not str(cc).startswith("9."):
    return f"GPU {device.device_kind!r} has compute capability {cc}, not sm90"
  return None


def interpret_params() -> Any:
  """The interpret-mode parameters every interpreted kernel runs with (race
  detection on: a race raises); raises RuntimeError where the interpreter
  could deadlock (`interpret_pool.check`)."""
  from pallas_fa3.kernels.sm90 import compat  # pylint: disable=g-import-not-at-top

  interpret_pool.check()  # a pool too small for the interpreter: raise, not hang
  return compat.interpret_params(detect_races=INTERPRET_DETECT_RACES)


def _describe_read(read: Any) -> str:
  """`#i[b, kv_idx + 0]`: one captured-array read of a kernel tile."""
  axes = []
  for a in read.axes:
    if isinstance(a, tuple):
      axes.append(f"{a[0]}_idx{a[1]:+d}" if a[1] else f"{a[0]}_idx")
    else:
      axes.append({"s": "scalar", "b": "batch", "h": "head"}[a])
  return f"#{read.const}[{', '.join(axes)}]"


class Sm90Backend(Backend):
  """The Hopper kernels, compiled (`interpret=False`) or interpreted."""

  config_types = (Sm90Config, Sm90ForwardConfig)
  decode_config_types = (Sm90DecodeConfig,)

  def __init__(self, interpret: bool):
    self.interpret = interpret
    if interpret:
      self.name = "interpret"
      self.summary = (
        "the same kernels in Pallas GPU interpret mode (CPU, small shapes,"
        " tests)"
      )
      self.partitionable = False  # the interpreter's callbacks
    else:
      self.name = "mosaic"
      self.summary = "Pallas Mosaic GPU kernels on a Hopper (sm90) GPU"
      self.automatic = True
      self.device_hint = (
        "It needs an sm90 (Hopper) GPU; jax.export(..., platforms=['cuda'])"
        " lowers it on any machine, and implementation='interpret' runs the"
        " same kernel on a CPU"
      )

  def device_reason(self) -> str | None:
    return interpret_pool.shortfall() if self.interpret else hopper_reason()

  def _params(self) -> Any:
    return interpret_params() if self.interpret else None

  # -- flash_attention ---------------------------------------------------------
  def make_config(self, spec: AttentionSpec, config: Any) -> Sm90Config:
    config = Sm90Config.of(config)
    if config.forward is not None:
      return config
    if spec.fp8 is not None:
      if spec.head_dim not in sm90_fp8_config.FP8_HEAD_DIMS:
        return config  # `unsupported` says why
      forward = sm90_fp8_config.default_fp8_forward_config(spec.head_dim)
    else:
      forward = sm90_config.default_forward_config(spec)
    return Sm90Config(forward=forward, backward=config.backward)

  def unsupported(self, spec: AttentionSpec, config: Sm90Config) -> str | None:
    if spec.flex is not None:
      reason = self._flex_unsupported(spec, config)
      if reason:
        return f"{reason} (blockwise and reference serve it; docs/flex.md)"
    if spec.stable_max is not None:
      return "stable_max is implemented by the blockwise backend only"
    if spec.fp8 is not None:
      if config.backward is not None:
        return "fp8 has no backward, so Sm90Config.backward must be None"
      return sm90_fp8_config.fp8_forward_unsupported(spec, config.forward)
    reason = sm90_config.forward_unsupported(spec, config.forward)
    if reason is None and config.backward is not None:
      reason = sm90_bwd_config.backward_config_unsupported(
        config.backward, spec.head_dim, spec.dtype.itemsize, spec.deterministic
      )
    return reason

  def _flex_unsupported(
    self, spec: AttentionSpec, config: Sm90Config
  ) -> str | None:
    if spec.fp8 is not None:
      return f"fp8 together with {', '.join(spec.flex.names())}"
    if spec.stable_max is not None:
      return None  # (said below)
    from pallas_fa3.kernels.sm90 import flex_tile  # pylint: disable=g-import-not-at-top

    cfg = config.forward or sm90_config.default_forward_config(spec)
    return flex_tile.kernel_unsupported(spec, cfg.block_q, cfg.block_kv)

  def forward(
    self, spec, config, q, k, v, *, sinks=None, segment_ids=None, flex=None
  ):  # fmt: skip
    from pallas_fa3.kernels.sm90 import forward as kernel  # pylint: disable=g-import-not-at-top

    def run(operands):
      q, k, v, sinks, bounds, _, flex = operands
      return kernel.sm90_forward(
        spec, config.forward, q, k, v, interpret=self._params(),
        sinks=sinks, segment_ids=bounds, flex=flex,
      )  # fmt: skip

    def twin(operands):
      q, k, v, sinks, _, ids, flex = operands
      return blockwise.blockwise_forward(
        spec, blockwise.BlockwiseConfig(), q, k, v, sinks=sinks,
        segment_ids=ids, flex=flex,
      )  # fmt: skip

    if segment_ids is None:
      return run((q, k, v, sinks, None, None, flex))
    # The kernel masks by each row's key bounds: exact when every id's keys
    # are contiguous (packed documents). Otherwise the blockwise twin
    # computes the call (same function), decided on the device. (flex's
    # arrays are operands: a vmapped bias is no closure of the choice.)
    bounds, (keys_exact, _) = segments.kernel_bounds(spec, segment_ids)
    operands = (q, k, v, sinks, bounds[:2], segment_ids, flex)
    return _on_device(keys_exact, run, twin, operands)

  # -- forward mode ------------------------------------------------------------
  tangent_differentiable = False  # (a kernel)

  def _tangent_kernel(self, spec: AttentionSpec) -> tuple:
    """(the tangent kernel's tiling, why it cannot serve `spec` or None)."""
    from pallas_fa3.kernels.sm90 import forward_tangent as kernel  # pylint: disable=g-import-not-at-top

    config = kernel.tangent_config(spec)
    return config, kernel.tangent_unsupported(spec, config)

  def describe_tangent(self, spec, config) -> str | None:
    if isinstance(spec, DecodeSpec):
      return None
    cfg, reason = self._tangent_kernel(spec)
    if reason is not None:
      return None
    return (
      f"the forward-tangent kernel (fa3_fwd_tangent: {cfg.consumers} x"
      f" {cfg.block_q}"
      f" query rows per CTA, {cfg.block_kv}-key tiles of K, K', V, V' in"
      f" {cfg.num_stages} stages) from the forward kernel's out and lse"
    )

  def tangent_fallback(self, spec, config) -> str:
    _, reason = self._tangent_kernel(spec)
    return f"the forward-tangent kernel does not take {reason}"

  def forward_tangent(self, spec, config, primals, tangents):
    q, k, v, sinks, ids, flex = primals
    result = self.forward(
      spec, config, q, k, v, sinks=sinks, segment_ids=ids, flex=flex
    )
    return (
      *result,
      *self.tangent_of_result(spec, config, primals, result, tangents),
    )

  def tangent_of_result(self, spec, config, primals, result, tangents):
    from pallas_fa3.kernels.sm90 import (  # pylint: disable=g-import-not-at-top
      flex_tile,
      forward_tangent as kernel,
    )

    cfg, reason = self._tangent_kernel(spec)
    assert reason is None, reason
    q, k, v, sinks, ids, flex = primals
    fs = spec.flex
    positions = ()  # the score_mod's floating arrays
    if fs is not None and fs.score_mod is not None:
      positions = flex_tile.float_positions(fs.score_mod)

    def run(operands):  # (the tangents are operands: vmap batches them)
      q, k, v, sinks, bounds, _, flex, result, tangents = operands
      dsinks = None if sinks is None else tangents[3]
      bias_dot = tangents[5].bias if fs is not None and fs.bias_grad else None
      score_dots = None
      if positions:
        score_dots = tuple(tangents[5].score_consts[i] for i in positions)
      return kernel.sm90_forward_tangent(
        spec, cfg, (q, k, v, sinks), result, (*tangents[:3], dsinks),
        interpret=self._params(), segment_ids=bounds, flex=flex,
        dbias=bias_dot, score_tangents=score_dots,
      )  # fmt: skip

    def twin(operands):
      q, k, v, sinks, _, ids, flex, _, tangents = operands
      return blockwise.BACKEND.forward_tangent(
        spec, blockwise.BlockwiseConfig(), (q, k, v, sinks, ids, flex),
        tangents,
      )[2:]  # fmt: skip

    if ids is None:
      return run((q, k, v, sinks, None, None, flex, result, tangents))
    # As the forward: the kernel where each id's keys are contiguous.
    bounds, (keys_exact, _) = segments.kernel_bounds(spec, ids)
    operands = (q, k, v, sinks, bounds[:2], ids, flex, result, tangents)
    return _on_device(keys_exact, run, twin, operands)

  def plan_backward(self, spec: AttentionSpec, config: Sm90Config) -> Any:
    if spec.fp8 is not None:
      return None  # (no gradient)
    return sm90_bwd_config.backward_plan(spec, config.backward)

  def describe(self, spec, config) -> tuple[str, str]:
    if isinstance(spec, DecodeSpec):
      return self._describe_decode(spec, config), "none (decoding)"
    f = config.forward
    kernel = (
      "the sm90 FP8 forward kernel" if spec.fp8 else "the sm90 forward kernel"
    )
    forward = (
      f"{kernel} ({self.name}), tiles {f.block_q}x{f.block_kv},"
      f" {f.num_stages} stages"
    )
    if spec.fp8 is not None:
      return forward, "none (fp8 has no gradient)"
    return forward, self.plan_backward(spec, config).describe()

  def describe_flex(self, spec, config) -> list[str]:
    fs = spec.flex
    if fs is None:
      return []
    from pallas_fa3.backends.base import describe_arrays, describe_operands  # pylint: disable=g-import-not-at-top
    from pallas_fa3.kernels.sm90 import flex_tile  # pylint: disable=g-import-not-at-top

    seqs = (spec.seq_q, spec.seq_kv)
    if isinstance(spec, DecodeSpec):
      seqs = (spec.capacity, spec.capacity)
    lines = ["flex (compiled into the kernels' tile loops):"]
    for name, fn in (("score_mod", fs.score_mod), ("mask_mod", fs.mask_mod)):
      if fn is None:
        continue
      score = name == "score_mod"
      decode = isinstance(spec, DecodeSpec)
      try:
        reads = flex_tile.plan(fn, score, *seqs, relative=not decode)
        derived = flex_tile.derived_reads(fn, score, *seqs)
        at = {
          "rel": "kv_idx - q_idx (a tile of its relative-position operand;"
          " the backward kernels take it unless it is differentiated)",
          "q": "a function of q_idx (a vector of its per-query operand)",
          "kv": "a function of kv_idx (a vector of its per-key operand)",
        }
        where = "; ".join(
          [_describe_read(r) for r in reads]
          + [f"#{r.const} at {at[r.over]}" for r in derived]
        )
        how = (
          f"elementwise on the tile's registers, reads {where or 'no array'}"
        )
      except flex_tile.Refused as e:
        how = f"not in the kernels ({e})"
      lines.append(f"  {name} {fn!r}: {how}; {describe_arrays(fn, score)}")
      if (
        score
        and flex_tile.float_positions(fn)
        and not isinstance(spec, DecodeSpec)
      ):
        kernels = {
          "dq": "the dQ kernel (by batch, head or query)",
          "dkdv": "the dK/dV kernel (by key)",
        }
        sums = [
          f"#{flex_tile.float_positions(fn)[j]} in {kernels[k]}"
          for k in ("dq", "dkdv")
          for j in flex_tile.kernel_params(spec, k)
        ]
        if sums:
          lines.append(
            f"    learnable arrays' gradients summed: {', '.join(sums)}"
          )
    return lines + describe_operands(fs)

  def _describe_decode(self, spec: DecodeSpec, config: Any) -> str:
    splits = self.decode_splits(spec, config)
    kernel = config_decode.kernel_spec(spec)
    why = "as asked"
    if spec.batch_invariant:
      why = "fixed runs of keys: batch_invariant"
    elif not spec.num_splits:
      pick = config_decode.split_choices(kernel, config)[splits - 1]
      why = (
        f"{pick.ctas} CTAs in {pick.waves:.2f} waves, {pick.steps} tiles on"
        " the busiest SM: config_decode.split_table"
      )
    return (
      f"the sm90 decode kernel ({self.name}), {config}, {splits} split-KV"
      f" range(s) per sequence ({why})"
    )

  def backward(
    self, spec, config, q, k, v, out, lse, dout, dlse, *, sinks=None,
    segment_ids=None, flex=None, plan=None,
  ):  # fmt: skip
    """The gradients as `plan` (`plan_backward`'s, decided with the call)
    says: the fused kernel, the dK/dV and dQ pair, or the blockwise twin on
    the kernels' residuals (said once per trace by a warning, never
    silently). Segment ids mask beside them by their bounds where exact,
    else the blockwise twin, decided on the device."""
    del sinks  # in the lse
    plan = plan or self.plan_backward(spec, config)
    residuals = (q, k, v, out, lse, dout, dlse)
    twin_config = blockwise.BACKEND.make_config(spec, None)

    def twin(operands):
      residuals, _, ids, flex = operands
      return blockwise.blockwise_backward(
        spec, twin_config, *residuals, segment_ids=ids, flex=flex
      )

    if plan.form == "blockwise":
      warnings.warn(
        f"the sm90 backward kernels cannot differentiate this call"
        f" ({plan.why}); its gradients use the blockwise recomputation (the"
        " same function; pallas_fa3.explain says so before a call)",
        stacklevel=3,
      )
      return twin((residuals, None, segment_ids, flex))
    from pallas_fa3.kernels.sm90 import backward as kernel  # pylint: disable=g-import-not-at-top

    run_spec = spec
    if plan.form == "pair" and not spec.deterministic:
      run_spec = dataclasses.replace(spec, deterministic=True)

    def run(operands):
      residuals, bounds, _, flex = operands
      return kernel.sm90_backward(
        run_spec, plan.tiling, *residuals, interpret=self._params(),
        segment_ids=bounds, flex=flex, fused=plan.form == "fused",
      )  # fmt: skip

    if segment_ids is None:
      return run((residuals, None, None, flex))
    # The dQ kernel masks by each query row's key bounds, the dK/dV kernels
    # by each key's query bounds: exact when every id's keys and queries are
    # contiguous (packed documents); otherwise the blockwise twin, decided
    # on the device as in the forward.
    bounds, (keys_exact, queries_exact) = segments.kernel_bounds(
      spec, segment_ids
    )
    operands = (residuals, bounds, segment_ids, flex)
    return _on_device(keys_exact & queries_exact, run, twin, operands)

  def fp8_tiles(self, config: Sm90Config) -> tuple[int, int]:
    return config.forward.block_q, config.forward.block_kv

  def fp8_quantize(self, *args: Any, **kwargs: Any) -> Any:
    from pallas_fa3.kernels.sm90 import quantize as kernel  # pylint: disable=g-import-not-at-top

    return kernel.quantize_inputs_kernel(
      *args, **kwargs, interpret=self._params()
    )

  def fp8_forward(self, spec, config, x, *, sinks=None, segment_ids=None):
    from pallas_fa3.kernels.sm90 import forward_fp8 as kernel  # pylint: disable=g-import-not-at-top

    def run(operands):
      x, sinks, bounds, _ = operands
      return kernel.sm90_forward_fp8(
        spec, config.forward, *x, interpret=self._params(), sinks=sinks,
        segment_ids=bounds,
      )  # fmt: skip

    if segment_ids is None:
      return run((x, sinks, None, None))

    def twin(operands):  # ids whose keys are not contiguous: the same
      x, sinks, _, ids = operands  # function, the FP8 kernel's twin
      cfg = config.forward
      return blockwise.blockwise_forward_fp8(
        spec, cfg.block_q, cfg.block_kv, *x, sinks=sinks, segment_ids=ids
      )

    bounds, (keys_exact, _) = segments.kernel_bounds(spec, segment_ids)
    operands = (x, sinks, bounds[:2], segment_ids)
    return _on_device(keys_exact, run, twin, operands)

  # -- flash_attention_with_kvcache ----------------------------------------
  def make_decode_config(
    self, spec: DecodeSpec, config: Sm90DecodeConfig | None
  ) -> Sm90DecodeConfig:
    kernel = config_decode.kernel_spec(spec)
    return config or config_decode.default_decode_config(kernel)

  def decode_unsupported(
    self, spec: DecodeSpec, config: Sm90DecodeConfig
  ) -> str | None:
    return config_decode.decode_unsupported(spec, config)

  def decode_splits(self, spec: DecodeSpec, config: Sm90DecodeConfig) -> int:
    kernel = config_decode.kernel_spec(spec)
    return spec.num_splits or config_decode.default_splits(kernel, config)

  def decode(self, spec, config, splits, operands):
    from pallas_fa3.kernels.sm90 import decode, decode_mla  # pylint: disable=g-import-not-at-top

    # A layout the TMA boxes cannot tile: the sequences' slots gathered
    spec, operands = decode.repacked(spec, operands)
    # V in the K cache (v_cache=None): the MLA kernel, the same operands
    run = (
      decode_mla.sm90_mla_decode
      if config_decode.is_mla(spec)
      else decode.sm90_decode
    )
    return run(spec, config, splits, *operands, interpret=self._params())


MOSAIC = Sm90Backend(interpret=False)
INTERPRET = Sm90Backend(interpret=True)
