"""`GPTConfig`: the frozen, validated, hashable description of the byte-level
GPT, which round-trips through JSON.
More: docs/training.md#the-model
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Literal, get_args

from pallas_fa3 import IMPLEMENTATIONS
from pallas_fa3.spec import check_int

Norm = Literal["layernorm", "rmsnorm"]
Position = Literal["rope", "learned"]
ComputeDtype = Literal["float32", "bfloat16"]
ParamDtype = Literal["float32", "bfloat16"]

_MAX_HEAD_DIM = 256  # the largest head dim flash_attention accepts


def _check_int(name: str, value: Any, minimum: int = 1) -> None:
  check_int(f"GPTConfig.{name}", value, minimum=minimum)


def _check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
  if value not in choices:
    raise ValueError(
      f"GPTConfig.{name} must be one of {choices}; got {value!r}"
    )


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Everything that defines the model (hashable: usable as a static argument).

  Attributes:
    vocab_size: tokens; 256 for the byte-level language model.
    num_layers: transformer blocks.
    d_model: width of the residual stream.
    num_heads: query heads; `d_model % num_heads == 0`.
    num_kv_heads: key/value heads (GQA/MQA); None means `num_heads`.
    mlp_ratio: MLP hidden width as a multiple of `d_model`.
    max_seq_len: longest sequence (size of the learned position table).
    position: "rope" (rotary, in the attention module) or "learned".
    rope_base: rotary frequency base.
    norm: "layernorm" or "rmsnorm", applied before attention and MLP.
    tie_embeddings: logits use the token embedding transposed.
    use_bias: biases in the linear layers.
    dtype: compute dtype, "bfloat16" (default: mixed precision, float32
      parameters and softmax statistics) or "float32".
    param_dtype: storage dtype of the parameters (float32 by default).
    attention_implementation: `flash_attention(implementation=...)`: None
      (automatic) or one of `pallas_fa3.IMPLEMENTATIONS`.
    window_pattern: left windows of the blocks, repeated: block i attends
      causally to the `window_pattern[i % len]` previous tokens and itself
      (`window_size=(w, None)`), or to every previous token for None; empty
      (the default): every block is global. E.g. `(64, None)` alternates
      local and global blocks. A list (from JSON) becomes a tuple.
    softcap: attention logit softcap c (scores become `c * tanh(s / c)`),
      a positive number, or None (off).
    sinks: each attention layer learns one sink logit per query head
      (`FlashMultiHeadAttention(sinks=True)`).
    varlen: with `segment_ids` (packed documents), attention runs as one
      `pallas_fa3.flash_attention_varlen` call over the batch's documents
      (rows flattened, `cu_seqlens` from the ids) instead of
      `flash_attention(segment_ids=)`: the same function.
  """

  vocab_size: int = 256
  num_layers: int = 4
  d_model: int = 128
  num_heads: int = 2
  num_kv_heads: int | None = None
  mlp_ratio: int = 4
  max_seq_len: int = 256
  position: Position = "rope"
  rope_base: float = 10000.0
  norm: Norm = "rmsnorm"
  tie_embeddings: bool = True
  use_bias: bool = False
  dtype: ComputeDtype = "bfloat16"
  param_dtype: ParamDtype = "float32"
  attention_implementation: str | None = None
  window_pattern: tuple[int | None, ...] = ()
  softcap: float | None = None
  sinks: bool = False
  varlen: bool = False

  def __post_init__(self) -> None:
    for name in (
      "vocab_size",
      "num_layers",
      "d_model",
      "num_heads",
      "mlp_ratio",
      "max_seq_len",
    ):
      _check_int(name, getattr(self, name))
    if self.num_kv_heads is not None:
      _check_int("num_kv_heads", self.num_kv_heads)
    if self.d_model % self.num_heads:
      raise ValueError(
        f"GPTConfig.d_model ({self.d_model}) must be a multiple"
        f" of num_heads ({self.num_heads})"
      )
    if self.num_heads % self.kv_heads:
      raise ValueError(
        f"GPTConfig.num_heads ({self.num_heads}) must be a"
        f" multiple of num_kv_heads ({self.kv_heads})"
      )
    if self.head_dim > _MAX_HEAD_DIM:
      raise ValueError(
        f"GPTConfig head dim d_model / num_heads = {self.head_dim}"
        f" exceeds {_MAX_HEAD_DIM}"
      )
    _check_choice("position", self.position, get_args(Position))
    if self.position == "rope" and self.head_dim % 2:
      raise ValueError(
        f"GPTConfig.position='rope' needs an even head dim;"
        f" got d_model / num_heads = {self.head_dim}"
      )
    if not (isinstance(self.rope_base, numbers.Real) and self.rope_base > 1):
      raise ValueError(
        f"GPTConfig.rope_base must be a number > 1; got {self.rope_base!r}"
      )
    _check_choice("norm", self.norm, get_args(Norm))
    _check_choice("tie_embeddings", self.tie_embeddings, (True, False))
    _check_choice("use_bias", self.use_bias, (True, False))
    _check_choice("dtype", self.dtype, get_args(ComputeDtype))
    _check_choice("param_dtype", self.param_dtype, get_args(ParamDtype))
    _check_choice(
      "attention_implementation",
      self.attention_implementation,
      (None,) + IMPLEMENTATIONS,
    )
    # Made canonical (frozen: through object.__setattr__) so that a config
    # rebuilt from JSON equals, and hashes like, the one it was saved from.
    object.__setattr__(
      self, "window_pattern", _check_window_pattern(self.window_pattern)
    )
    object.__setattr__(self, "softcap", _check_softcap(self.softcap))
    _check_choice("sinks", self.sinks, (True, False))
    _check_choice("varlen", self.varlen, (True, False))

  def layer_window(self, layer: int) -> int | None:
    """The left window of block `layer` (None: global causal attention)."""
    if not self.window_pattern:
      return None
    return self.window_pattern[layer % len(self.window_pattern)]

  @property
  def kv_heads(self) -> int:
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  def to_dict(self) -> dict[str, Any]:
    """A JSON-ready dict; `GPTConfig(**d)` rebuilds the config.

    `window_pattern` is a list, as JSON gives it back, so a dict read from a
    checkpoint compares equal to a fresh one.
    """
    d = dataclasses.asdict(self)
    d["window_pattern"] = list(self.window_pattern)
    return d


def _check_window_pattern(pattern: Any) -> tuple[int | None, ...]:
  if isinstance(pattern, (str, bytes)) or not isinstance(
    pattern, (tuple, list)
  ):
    raise TypeError(
      "GPTConfig.window_pattern must be a tuple of left windows (ints >= 0,"
      f" or None for a global block); got {pattern!r}"
    )
  for i, w in enumerate(pattern):
    if w is not None and (
      isinstance(w, bool) or not isinstance(w, numbers.Integral) or w < 0
    ):
      raise ValueError(
        f"GPTConfig.window_pattern[{i}] must be an int >= 0 or None (a"
        f" global block); got {w!r} in {tuple(pattern)!r}"
      )
  return tuple(None if w is None else int(w) for w in pattern)


def _check_softcap(softcap: Any) -> float | None:
  if softcap is None:
    return None
  if (
    isinstance(softcap, bool)
    or not isinstance(softcap, numbers.Real)
    or not math.isfinite(softcap)
    or softcap <= 0
  ):
    raise ValueError(
      "GPTConfig.softcap must be None (off) or a positive finite number;"
      f" got {softcap!r}"
    )
  return float(softcap)
