"""One frozen description of an attention call (`AttentionSpec`), and the one
validation helper: every public entry point turns its arguments into a spec
through `make_spec`, backends receive the spec and never re-validate, and
errors name the offending argument and its shape or value:
docs/api.md#conventions.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3 import modifiers

# Input dtypes every backend must accept. A float64 JAX array (x64 enabled)
# is refused: it is the golden's precision. numpy float64 arrays are taken
# as jnp.asarray takes them (float32 unless x64 is enabled).
SUPPORTED_DTYPES: tuple[jnp.dtype, ...] = (
  jnp.dtype(jnp.float16),
  jnp.dtype(jnp.bfloat16),
  jnp.dtype(jnp.float32),
)

# FlashAttention-3 (and Hopper's wgmma tiling with 227 KiB of shared memory)
# supports head dims up to 256; we hold every backend to the same limit so that
# the automatic choice never changes which calls are accepted.
MAX_HEAD_DIM = 256

# exp(x) = exp2(x * log2(e)): the kernels and the blockwise twin use exp2.
LOG2E = math.log2(math.e)
# The precision of every float32 product the oracles and twins take.
HIGHEST = jax.lax.Precision.HIGHEST
_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32

_LAYOUT = "[batch, seq, heads, head_dim]"


def cdiv(a: Any, b: Any) -> Any:
  """ceil(a / b) of ints (or integer arrays, traced ones too)."""
  return -(-a // b)


def options_on(flex: Any, **options: Any) -> list[str]:
  """The options that are on, as `describe` lines say them (`name` for
  True, `name=value` otherwise), then the flex options' names."""
  on = [
    name if value is True else f"{name}={value}"
    for name, value in options.items()
    if value not in (None, False, 0)
  ]
  return on + ([] if flex is None else list(flex.names()))


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """Canonical, hashable description of one attention call.

  Shapes use fixed letters: q `[b, sq, hq, d]`, k `[b, skv, hk, d]`,
  v `[b, skv, hk, dv]`, output `[b, sq, hq, dv]`, lse `[b, hq, sq]`.
  """

  batch: int
  seq_q: int
  seq_kv: int
  heads_q: int
  heads_kv: int
  head_dim: int
  head_dim_v: int
  dtype: Any  # a jnp.dtype
  causal: bool
  softmax_scale: float
  # Call options that change the function computed; backends that cannot
  # serve them say so (`Backend.unsupported`).
  fp8: Any = None  # a pallas_fa3.FP8Config: quantize Q, K, V to e4m3
  stable_max: Any = None  # a pallas_fa3.StableMax: the repeated-max fix
  # Gradients bitwise reproducible run to run (same function either way; the
  # Hopper backward then sums dQ in a fixed order instead of by reduce-add).
  deterministic: bool = False
  # Local attention: (left, right) keys around query i's position
  # `i + causal_offset`, each an int or None (unbounded); None: no window.
  # Canonical: a side that every row's bound already covers (or causal
  # makes moot) is None, and a window with no bound left is None.
  window_size: tuple[int | None, int | None] | None = None
  # Logit softcap: scores become softcap * tanh(score / softcap); None: off.
  softcap: float | None = None
  # Learnable sinks: one logit per query head in every row's denominator
  # (the [heads_q] array is an operand of the call, not part of the spec).
  sinks: bool = False
  # Packed sequences: the call has segment ids (`pallas_fa3.segments`);
  # the arrays are operands, not part of the spec.
  segmented: bool = False
  # score_mod / mask_mod / bias / block_mask: a `pallas_fa3.flex.FlexSpec`
  # (the arrays are operands); None: none of them.
  flex: Any = None

  @property
  def group_size(self) -> int:
    """Query heads per key/value head (1: MHA, hq: MQA, else GQA)."""
    return self.heads_q // self.heads_kv

  def describe(self) -> str:
    """One line: the shapes and the options that are on."""
    opts = options_on(
      self.flex,
      causal=self.causal,
      window_size=self.window_size,
      softcap=self.softcap,
      sinks=self.sinks,
      segment_ids=self.segmented,
      deterministic=self.deterministic,
      fp8=self.fp8 is not None,
      stable_max=self.stable_max is not None,
    )
    dv = f", dv {self.head_dim_v}" if self.head_dim_v != self.head_dim else ""
    return (
      f"batch {self.batch}, seq_q {self.seq_q}, seq_kv {self.seq_kv}, heads"
      f" {self.heads_q}/{self.heads_kv} (q/kv), head_dim {self.head_dim}{dv},"
      f" {jnp.dtype(self.dtype).name}"
      + (f"; {', '.join(opts)}" if opts else "")
    )

  @property
  def causal_offset(self) -> int:
    """Bottom-right causal alignment: query i sees keys j <= i + offset."""
    return self.seq_kv - self.seq_q

  @property
  def window_left(self) -> int | None:
    """Keys before the query's position it sees (None: unbounded)."""
    return None if self.window_size is None else self.window_size[0]

  @property
  def window_right(self) -> int | None:
    """Keys after the query's position it sees (None: unbounded; 0 when
    causal)."""
    if self.causal:
      return 0
    return None if self.window_size is None else self.window_size[1]

  @property
  def masked(self) -> bool:
    """Whether any (query, key) pair of the unpadded sequences may be
    hidden (causal, a window or segment ids)."""
    flex_masks = self.flex is not None and self.flex.masks
    return (
      self.causal or self.window_size is not None or self.segmented
      or flex_masks
    )  # fmt: skip

  @property
  def out_shape(self) -> tuple[int, int, int, int]:
    return (self.batch, self.seq_q, self.heads_q, self.head_dim_v)

  @property
  def lse_shape(self) -> tuple[int, int, int]:
    return (self.batch, self.heads_q, self.seq_q)


def group_heads(x: jax.Array, heads_kv: int) -> jax.Array:
  """[b, s, hq, d] -> [b, s, hk, g, d]: query heads grouped by their kv head.

  A free reshape: GQA/MQA never repeat K/V, they broadcast over the group axis.
  """
  b, s, h, d = x.shape
  return x.reshape(b, s, heads_kv, h // heads_kv, d)


def _check_tensor(
  name: str, x: Any, max_head_dim: int | None = MAX_HEAD_DIM
) -> tuple[tuple[int, ...], jnp.dtype]:
  """Checks one attention operand: shape and dtype (an array, or a shape
  descriptor such as `jax.ShapeDtypeStruct`), rank 4, supported dtype,
  head_dim at most `max_head_dim` (None: any)."""
  if not (hasattr(x, "shape") and hasattr(x, "dtype")):
    raise TypeError(
      f"{name} must be an array of shape {_LAYOUT}; got {type(x).__name__}"
    )
  shape = tuple(int(s) for s in x.shape)
  dtype = jnp.dtype(x.dtype)
  if isinstance(x, np.ndarray):
    # As jnp.asarray takes it: float64 becomes float32 unless x64 is on.
    dtype = jnp.dtype(jax.dtypes.canonicalize_dtype(dtype))
  if len(shape) != 4:
    raise ValueError(
      f"{name} must have rank 4 with layout {_LAYOUT}; got shape {shape}"
      f" (rank {len(shape)})"
    )
  if dtype not in SUPPORTED_DTYPES:
    names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
    raise TypeError(f"{name} has dtype {dtype}; supported dtypes are {names}")
  for axis, (dim, what) in enumerate(
    zip(shape, ("batch", "seq", "heads", "head_dim"))
  ):
    if dim == 0:
      raise ValueError(
        f"{name} has an empty {what} axis (axis {axis}): shape {shape};"
        " every axis must be non-empty"
      )
  if max_head_dim is not None and shape[3] > max_head_dim:
    raise ValueError(
      f"{name} head_dim {shape[3]} exceeds the maximum {max_head_dim};"
      f" shape {shape}"
    )
  return shape, dtype


def check_softmax_scale(softmax_scale: Any, head_dim: int) -> float:
  """Returns the softmax scale as a float, defaulting to 1/sqrt(head_dim)."""
  if softmax_scale is None:
    return 1.0 / math.sqrt(head_dim)
  if isinstance(softmax_scale, jax.core.Tracer):
    raise TypeError(
      "softmax_scale must be a concrete Python number, not a traced value"
      f" ({softmax_scale}); pass it as a static argument"
    )
  if isinstance(softmax_scale, (np.ndarray, jax.Array)):
    if softmax_scale.size != 1:
      raise TypeError(
        "softmax_scale must be a scalar; got an array of shape"
        f" {tuple(softmax_scale.shape)}"
      )
    softmax_scale = softmax_scale.item()
  if isinstance(softmax_scale, bool) or not isinstance(
    softmax_scale, numbers.Real
  ):
    raise TypeError(
      "softmax_scale must be a real number or None; got"
      f" {softmax_scale!r} of type {type(softmax_scale).__name__}"
    )
  value = float(softmax_scale)
  if not math.isfinite(value) or value <= 0.0:
    raise ValueError(
      f"softmax_scale must be finite and positive; got {softmax_scale!r}"
    )
  # Scores are scaled in float32 (times log2(e) in the kernels): a scale that
  # overflows or underflows there would silently give NaN or a zero scale.
  if not _F32_TINY <= value * LOG2E <= _F32_MAX:
    raise ValueError(
      f"softmax_scale must be representable in float32 after folding in"
      f" log2(e) (between {_F32_TINY / LOG2E:.3g} and"
      f" {_F32_MAX / LOG2E:.3g}); got {softmax_scale!r}"
    )
  return value


def check_bool(name: str, value: Any) -> bool:
  """Accepts a Python or numpy bool; raises TypeError naming `name` otherwise."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(
      f"{name} must be a bool; got {value!r} of type {type(value).__name__}"
    )
  return bool(value)


def check_int(
  name: str,
  value: Any,
  *,
  choices: Any = None,
  minimum: int | None = None,
  maximum: int | None = None,
) -> int:
  """An int argument or config field (numpy ints too, bools refused) -> int.

  Raises TypeError / ValueError naming `name` and the value: not an int, not
  one of `choices`, or outside `[minimum, maximum]`.
  """
  if isinstance(value, (bool, np.bool_)) or not isinstance(
    value, numbers.Integral
  ):
    raise TypeError(
      f"{name} must be an int; got {value!r} of type {type(value).__name__}"
    )
  value = int(value)
  if choices is not None and value not in choices:
    raise ValueError(f"{name} must be one of {tuple(choices)}; got {value}")
  low = minimum is not None and value < minimum
  high = maximum is not None and value > maximum
  if (low or high) and minimum is not None and maximum is not None:
    raise ValueError(f"{name} must be in [{minimum}, {maximum}]; got {value}")
  if low:
    raise ValueError(f"{name} must be >= {minimum}; got {value}")
  if high:
    raise ValueError(f"{name} must be <= {maximum}; got {value}")
  return value


def check_int_fields(config: Any, **rules: dict) -> None:
  """`check_int` on fields of a frozen dataclass, storing plain ints back.

  `rules` maps a field name to `check_int`'s keywords; errors name
  `Class.field`.
  """
  cls = type(config).__name__
  for field, rule in rules.items():
    value = check_int(f"{cls}.{field}", getattr(config, field), **rule)
    object.__setattr__(config, field, value)


def check_arrays(**operands: Any) -> None:
  """Refuses shape descriptors where values are needed (`flash_attention`)."""
  for name, x in operands.items():
    if isinstance(x, jax.ShapeDtypeStruct):
      raise TypeError(
        f"{name} must be an array of shape {_LAYOUT}; got ShapeDtypeStruct"
        f" {x} (a shape descriptor: use jax.eval_shape or jax.jit(...).lower"
        " to work with shapes only)"
      )


def make_spec(
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
  sinks: bool = False,
  segmented: bool = False,
  max_head_dim: int | None = MAX_HEAD_DIM,
) -> AttentionSpec:
  """Validates q, k, v and the call options; returns the canonical spec.

  q, k and v may be arrays or shape descriptors (`jax.ShapeDtypeStruct`):
  only their shapes and dtypes are read; numpy arrays count with the dtype
  `jnp.asarray` gives them. `fp8` and `stable_max` are stored as given (a
  validated `FP8Config` / `StableMax`, or None); `window_size` and
  `softcap` are checked and made canonical (`pallas_fa3.modifiers`);
  `sinks` / `segmented` say whether the call has a sinks / segment ids
  operand. `max_head_dim`: the largest head dim accepted (None: any; the
  oracles take any, the backends `MAX_HEAD_DIM`).

  Raises:
    TypeError: a non-array operand, an unsupported or mixed dtype, a non-bool
      `causal`, or a non-numeric `softmax_scale`.
    ValueError: wrong rank, mismatched batch/sequence/head_dim/heads, an empty
      axis, head_dim over `max_head_dim`, or a non-finite/non-positive scale.
  """
  q_shape, q_dtype = _check_tensor("q", q, max_head_dim)
  k_shape, k_dtype = _check_tensor("k", k, max_head_dim)
  v_shape, v_dtype = _check_tensor("v", v, max_head_dim)
  if not (q_dtype == k_dtype == v_dtype):
    raise TypeError(
      "q, k and v must have the same dtype; got q.dtype="
      f"{q_dtype}, k.dtype={k_dtype}, v.dtype={v_dtype}"
    )
  shapes = f"q.shape={q_shape}, k.shape={k_shape}, v.shape={v_shape}"
  if not q_shape[0] == k_shape[0] == v_shape[0]:
    raise ValueError(f"q, k and v must have the same batch size; got {shapes}")
  if k_shape[1] != v_shape[1]:
    raise ValueError(
      f"k and v must have the same sequence length (axis 1); got {shapes}"
    )
  if k_shape[2] != v_shape[2]:
    raise ValueError(
      f"k and v must have the same number of heads (axis 2); got {shapes}"
    )
  if q_shape[3] != k_shape[3]:
    raise ValueError(
      f"q and k must have the same head_dim (axis 3); got {shapes}"
    )
  if q_shape[2] % k_shape[2]:
    raise ValueError(
      f"q heads ({q_shape[2]}) must be a multiple of k/v heads"
      f" ({k_shape[2]}) for grouped-query attention; got {shapes}"
    )
  causal = check_bool("causal", causal)
  scale = check_softmax_scale(softmax_scale, q_shape[3])
  return AttentionSpec(
    batch=q_shape[0],
    seq_q=q_shape[1],
    seq_kv=k_shape[1],
    heads_q=q_shape[2],
    heads_kv=k_shape[2],
    head_dim=q_shape[3],
    head_dim_v=v_shape[3],
    dtype=q_dtype,
    causal=causal,
    softmax_scale=scale,
    fp8=fp8,
    stable_max=stable_max,
    deterministic=check_bool("deterministic", deterministic),
    window_size=modifiers.check_window_size(
      window_size, seq_q=q_shape[1], seq_kv=k_shape[1], causal=causal
    ),
    softcap=modifiers.check_softcap(softcap),
    sinks=bool(sinks),
    segmented=bool(segmented),
  )
