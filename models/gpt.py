"""A GPT-style decoder-only transformer on pallas-fa3 attention (Flax nnx).

One frozen dataclass, `GPTConfig`, describes the model; `GPT` builds it.
Blocks are pre-norm (LayerNorm or RMSNorm), causal self-attention through
`pallas_fa3.flax.FlashMultiHeadAttention` (so the attention backend is a
config field: the numerics study trains the same model with `"blockwise"`
and `"reference"`), and a GELU MLP. Positions are either rotary (inside the
attention module) or a learned table; the output projection is either tied
to the token embedding or a separate matrix. Optional attention variants:
per-layer causal sliding windows (`window_pattern`, e.g. Gemma's alternation
of local and global layers), an attention logit softcap and learnable
attention sinks (one logit per head in every softmax denominator).

Parameters live in `param_dtype` (float32 by default); the forward computes
in `dtype` (float32 or bfloat16) and returns float32 logits.

Example:
  >>> from flax import nnx
  >>> from models.gpt import GPT, GPTConfig
  >>> import jax.numpy as jnp
  >>> cfg = GPTConfig(num_layers=1, d_model=32, max_seq_len=16)
  >>> model = GPT(cfg, rngs=nnx.Rngs(0))
  >>> model(jnp.zeros((2, 16), jnp.int32)).shape
  (2, 16, 256)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_fa3 import IMPLEMENTATIONS
from pallas_fa3.flax import FlashMultiHeadAttention
from pallas_fa3.spec import check_int

Norm = Literal["layernorm", "rmsnorm"]
Position = Literal["rope", "learned"]
ComputeDtype = Literal["float32", "bfloat16"]
ParamDtype = Literal["float32", "bfloat16"]

# GPT-2 initialization: weights ~ N(0, 0.02^2); the projections that write
# into the residual stream are scaled down by 1/sqrt(2 * num_layers) so the
# residual variance does not grow with depth (Radford et al. 2019, sec. 2.3).
_INIT_STD = 0.02
_NORM_EPS = 1e-5  # LayerNorm/RMSNorm epsilon used by GPT-2 and LLaMA
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


def _dtype(cfg: GPTConfig) -> jnp.dtype:
  return jnp.dtype(cfg.dtype)


def _pdtype(cfg: GPTConfig) -> jnp.dtype:
  return jnp.dtype(cfg.param_dtype)


def _normal(std: float) -> nnx.Initializer:
  return nnx.initializers.normal(stddev=std)


def _residual_std(cfg: GPTConfig) -> float:
  return _INIT_STD / math.sqrt(2 * cfg.num_layers)


def _make_norm(cfg: GPTConfig, rngs: nnx.Rngs) -> nnx.Module:
  kw = dict(
    epsilon=_NORM_EPS, dtype=_dtype(cfg), param_dtype=_pdtype(cfg), rngs=rngs
  )
  if cfg.norm == "layernorm":
    return nnx.LayerNorm(cfg.d_model, use_bias=cfg.use_bias, **kw)
  return nnx.RMSNorm(cfg.d_model, **kw)


class MLP(nnx.Module):
  """`Linear(d_model -> mlp_ratio * d_model) -> GELU -> Linear(-> d_model)`."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs) -> None:
    hidden = cfg.mlp_ratio * cfg.d_model
    kw = dict(
      use_bias=cfg.use_bias,
      dtype=_dtype(cfg),
      param_dtype=_pdtype(cfg),
      rngs=rngs,
    )
    self.fc_in = nnx.Linear(
      cfg.d_model, hidden, kernel_init=_normal(_INIT_STD), **kw
    )
    self.fc_out = nnx.Linear(
      hidden, cfg.d_model, kernel_init=_normal(_residual_std(cfg)), **kw
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc_out(jax.nn.gelu(self.fc_in(x)))


class Block(nnx.Module):
  """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`.

  Block number `layer` attends within `cfg.layer_window(layer)`.
  """

  def __init__(self, cfg: GPTConfig, layer: int = 0, *, rngs: nnx.Rngs) -> None:
    window = cfg.layer_window(layer)
    self.norm_attn = _make_norm(cfg, rngs)
    self.attn = FlashMultiHeadAttention(
      cfg.num_heads,
      cfg.d_model,
      num_kv_heads=cfg.kv_heads,
      causal=True,
      rope=cfg.position == "rope",
      rope_base=cfg.rope_base,
      window_size=None if window is None else (window, None),
      softcap=cfg.softcap,
      sinks=cfg.sinks,
      dtype=_dtype(cfg),
      param_dtype=_pdtype(cfg),
      use_bias=cfg.use_bias,
      implementation=cfg.attention_implementation,
      kernel_init=_normal(_INIT_STD),
      out_kernel_init=_normal(_residual_std(cfg)),
      rngs=rngs,
    )
    self.norm_mlp = _make_norm(cfg, rngs)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.norm_attn(x))
    return x + self.mlp(self.norm_mlp(x))


class GPT(nnx.Module):
  """Decoder-only transformer: tokens `[batch, seq]` -> logits `[batch, seq, vocab]`."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs) -> None:
    self.cfg = cfg
    self.embed = nnx.Param(
      _normal(_INIT_STD)(
        rngs.params(), (cfg.vocab_size, cfg.d_model), _pdtype(cfg)
      )
    )
    if cfg.position == "learned":
      self.pos_embed = nnx.Param(
        _normal(_INIT_STD)(
          rngs.params(), (cfg.max_seq_len, cfg.d_model), _pdtype(cfg)
        )
      )
    self.blocks = nnx.List(
      [Block(cfg, i, rngs=rngs) for i in range(cfg.num_layers)]
    )
    self.norm_out = _make_norm(cfg, rngs)
    if not cfg.tie_embeddings:
      self.unembed = nnx.Linear(
        cfg.d_model,
        cfg.vocab_size,
        use_bias=False,
        dtype=_dtype(cfg),
        param_dtype=_pdtype(cfg),
        kernel_init=_normal(_INIT_STD),
        rngs=rngs,
      )

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Next-token logits.

    Args:
      tokens: int `[batch, seq]` with `seq <= max_seq_len`, values in
        `[0, vocab_size)`.

    Returns:
      float32 logits `[batch, seq, vocab_size]`; position i sees tokens <= i.
    """
    cfg = self.cfg
    dtype = _dtype(cfg)
    seq = tokens.shape[1]
    if seq > cfg.max_seq_len:
      raise ValueError(
        f"tokens has seq {seq} > GPTConfig.max_seq_len {cfg.max_seq_len}"
      )
    table = self.embed[...].astype(dtype)
    # A one-hot matmul instead of a gather: for a 256-token vocabulary it is
    # cheap, and its gradient is a matmul rather than a scatter-add, which is
    # not deterministic on GPUs (bitwise-reproducible training).
    one_hot = jax.nn.one_hot(tokens, cfg.vocab_size, dtype=dtype)
    x = jnp.einsum(
      "bsv,vd->bsd", one_hot, table, precision=jax.lax.Precision.HIGHEST
    )
    if cfg.position == "learned":
      x = x + self.pos_embed[:seq].astype(dtype)
    for block in self.blocks:
      x = block(x)
    x = self.norm_out(x)
    if cfg.tie_embeddings:
      logits = jnp.einsum("bsd,vd->bsv", x, table)
    else:
      logits = self.unembed(x)
    return logits.astype(jnp.float32)


def count_params(model: nnx.Module) -> int:
  """Number of scalar parameters (`nnx.Param` leaves) in `model`."""
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
