"""A GPT-style decoder-only transformer on pallas-fa3 attention (Flax nnx):
`GPT` builds the byte-level model a `GPTConfig` describes (pre-norm blocks
of `FlashMultiHeadAttention` and a GELU MLP, RoPE or learned positions;
optionally packed sequences (segment ids, or `flash_attention_varlen`),
sliding windows, softcap and sinks; KV-cache
decoding after `init_cache`).
More: docs/training.md#the-model

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

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_fa3
from models.gpt_config import GPTConfig as GPTConfig
from pallas_fa3 import varlen
from pallas_fa3.flax import FlashMultiHeadAttention, rope
from pallas_fa3.flax.decode import packed_positions
from pallas_fa3.segments import segment_positions

# GPT-2 initialization: weights ~ N(0, 0.02^2); the projections that write
# into the residual stream are scaled down by 1/sqrt(2 * num_layers) so the
# residual variance does not grow with depth (Radford et al. 2019, sec. 2.3).
_INIT_STD = 0.02
_NORM_EPS = 1e-5  # LayerNorm/RMSNorm epsilon used by GPT-2 and LLaMA


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
    self.varlen = cfg.varlen

  def __call__(
    self,
    x: jax.Array,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    decode: dict[str, Any] | None = None,
  ) -> jax.Array:
    h = self.norm_attn(x)
    if decode is not None and "cu_seqlens" in decode:  # a packed batch
      x = x + self.attn(h[0], decode=True, **decode)[None]
    elif decode is not None:  # the attention's cache: prefill or a step
      x = x + self.attn(h, decode=True, **decode)
    elif segment_ids is None:  # the unpacked call, exactly as before packing
      x = x + self.attn(h)
    elif self.varlen:  # segment_ids holds the batch's cu_seqlens
      x = x + _varlen_attention(self.attn, h, segment_ids, positions)
    else:
      rope = positions if self.attn.rope else None
      x = x + self.attn(h, segment_ids=segment_ids, positions=rope)
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

  def init_cache(self, batch: int, max_length: int) -> None:
    """Creates every attention layer's KV cache for decoding (`decode=True`
    calls; `models.generate` uses them), in the compute dtype.

    Raises:
      ValueError: `max_length` exceeds `max_seq_len` (a learned position
        table has no row for later positions; a RoPE model can be built
        with a longer `max_seq_len`, which its parameters do not depend on).
    """
    if max_length > self.cfg.max_seq_len:
      raise ValueError(
        f"init_cache: max_length {max_length} exceeds GPTConfig.max_seq_len"
        f" {self.cfg.max_seq_len}"
      )
    for block in self.blocks:
      block.attn.init_cache(
        (batch, max_length, self.cfg.d_model), _dtype(self.cfg)
      )

  def __call__(
    self,
    tokens: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    decode: bool = False,
    prefill: bool = False,
    chunk_lengths: jax.Array | None = None,
    cu_seqlens: jax.Array | None = None,
    max_seqlen_q: int | None = None,
  ) -> jax.Array:
    """Next-token logits.

    Args:
      tokens: int `[batch, seq]` with `seq <= max_seq_len`, values in
        `[0, vocab_size)`.
      segment_ids: packed sequences: int `[batch, seq]` document ids; a
        token attends only to earlier tokens of its own id (the same array
        for queries and keys, so padding with one id attends to itself).
      positions: int `[batch, seq]` positions in `[0, max_seq_len)` for RoPE
        or the learned table (checked unless traced: under `jit` a learned
        table's one-hot gives 0 outside), only with `segment_ids`; default
        `pallas_fa3.segment_positions(segment_ids)` (restarting at 0 in each
        document).
      decode: attend with the KV caches (`init_cache` first): `tokens` is a
        chunk of each sequence, at positions from the cached lengths
        (`pallas_fa3.flax.FlashMultiHeadAttention`'s decode mode).
      prefill: with `decode`: the chunk starts every sequence afresh.
      chunk_lengths: with `decode`: int32 `[batch]`, the tokens of a
        right-padded ragged chunk each sequence keeps.
      cu_seqlens: with `decode`: int32 `[cache batch + 1]`: `tokens` is one
        packed row `[1, total]`, cache sequence i's new tokens at
        `cu_seqlens[i]:cu_seqlens[i+1]` (0 allowed): a continuous batch
        (prompts' prefill beside other sequences' decode steps) through
        the ragged kvcache call (`models.generate(..., slots=)`).
      max_seqlen_q: with `cu_seqlens`: a static bound on any sequence's
        new tokens.

    Returns:
      float32 logits `[batch, seq, vocab_size]`; position i sees tokens <= i
      (of its own segment).
    """
    cfg = self.cfg
    dtype = _dtype(cfg)
    seq = tokens.shape[1]
    if seq > cfg.max_seq_len:
      raise ValueError(
        f"tokens has seq {seq} > GPTConfig.max_seq_len {cfg.max_seq_len}"
      )
    decoding = None
    if decode:
      decoding = dict(prefill=prefill, chunk_lengths=chunk_lengths)
      if segment_ids is not None or positions is not None:
        raise ValueError(
          "decode=True takes no segment_ids or positions: positions come"
          " from the cached lengths"
        )
      if cu_seqlens is not None:
        if tokens.shape[0] != 1 or prefill or chunk_lengths is not None:
          raise ValueError(
            "cu_seqlens takes one packed row of tokens [1, total] (got"
            f" {tuple(tokens.shape)}) and no prefill or chunk_lengths"
          )
        decoding = dict(cu_seqlens=cu_seqlens, max_seqlen_q=max_seqlen_q)
      positions = self._decode_positions(seq, prefill, cu_seqlens)
    elif prefill or chunk_lengths is not None or cu_seqlens is not None:
      raise ValueError("prefill, chunk_lengths and cu_seqlens need decode=True")
    else:
      segment_ids, positions = _packing_inputs(
        tokens, segment_ids, positions, cfg.max_seq_len
      )
    table = self.embed[...].astype(dtype)
    # A one-hot matmul instead of a gather: for a 256-token vocabulary it is
    # cheap, and its gradient is a matmul rather than a scatter-add, which is
    # not deterministic on GPUs (bitwise-reproducible training).
    one_hot = jax.nn.one_hot(tokens, cfg.vocab_size, dtype=dtype)
    x = jnp.einsum(
      "bsv,vd->bsd", one_hot, table, precision=jax.lax.Precision.HIGHEST
    )
    if cfg.position == "learned" and positions is None:
      x = x + self.pos_embed[:seq].astype(dtype)
    elif cfg.position == "learned":  # one-hot, like the tokens
      x = x + jnp.einsum(
        "bsp,pd->bsd",
        jax.nn.one_hot(positions, cfg.max_seq_len, dtype=dtype),
        self.pos_embed[...].astype(dtype),
        precision=jax.lax.Precision.HIGHEST,
      )
    if cfg.varlen and segment_ids is not None:  # the documents, flattened
      segment_ids = varlen.cu_seqlens_of_rows(segment_ids)
    for block in self.blocks:
      x = block(x, segment_ids, positions, decoding)
    x = self.norm_out(x)
    if cfg.tie_embeddings:
      logits = jnp.einsum("bsd,vd->bsv", x, table)
    else:
      logits = self.unembed(x)
    return logits.astype(jnp.float32)

  def _decode_positions(
    self, seq: int, prefill: bool, cu_seqlens: Any = None
  ) -> jax.Array | None:
    """The learned table's positions of a decode chunk (RoPE models: None,
    the attention layers take theirs from the cache)."""
    if self.cfg.position != "learned":
      return None
    lengths = self.blocks[0].attn.cache_lengths
    if lengths is None:
      raise ValueError("decode=True needs the KV caches: call init_cache")
    if cu_seqlens is not None:  # one packed row
      return packed_positions(cu_seqlens, lengths[...], seq)[None]
    start = jnp.zeros_like(lengths[...]) if prefill else lengths[...]
    return start[:, None] + jnp.arange(seq, dtype=jnp.int32)

  def restart(self, sequences: jax.Array) -> None:
    """Empties the caches of the sequences where bool `[batch]`
    `sequences` is set (their rows take a new prompt: a continuous
    batch's slot)."""
    for block in self.blocks:
      lengths = block.attn.cache_lengths
      if lengths is None:
        raise ValueError("restart needs the KV caches: call init_cache")
      lengths[...] = jnp.where(sequences, 0, lengths[...])


def _varlen_attention(
  attn: FlashMultiHeadAttention,
  h: jax.Array,
  cu_seqlens: jax.Array,
  positions: jax.Array,
) -> jax.Array:
  """`attn(h, segment_ids=...)` as one `flash_attention_varlen` call: the
  layer's projections and RoPE, rows `[batch, seq]` flattened to tokens,
  each document a sequence of `cu_seqlens` (the same array for queries
  and keys: each document's own causal diagonal, at no extra cost)."""
  q, k, v = attn.query(h), attn.key(h), attn.value(h)  # [b, s, heads, d]
  if attn.rope:
    q = rope.apply_rope(q, positions, attn.rope_base)
    k = rope.apply_rope(k, positions, attn.rope_base)
  tokens = lambda x: x.reshape((-1,) + x.shape[2:])
  out = pallas_fa3.flash_attention_varlen(
    tokens(q),
    tokens(k),
    tokens(v),
    cu_seqlens,
    cu_seqlens,
    causal=attn.causal,
    window_size=attn.window_size,
    softcap=attn.softcap,
    sinks=None if attn.sinks is None else attn.sinks[...],
    implementation=attn.implementation,
    config=attn.config,
  )
  return attn.out(out.reshape(q.shape[:2] + out.shape[1:]))


def _packing_inputs(
  tokens: jax.Array, segment_ids: Any, positions: Any, max_seq_len: int
) -> tuple[jax.Array | None, jax.Array | None]:
  """Checked `(segment_ids, positions)` of a call (both None: unpacked)."""
  if segment_ids is None:
    if positions is not None:
      raise ValueError(
        "positions are only taken with segment_ids (packed sequences);"
        " got segment_ids=None"
      )
    return None, None
  arrays = {"segment_ids": segment_ids}
  if positions is not None:
    arrays["positions"] = positions
  for name, value in arrays.items():
    if tuple(value.shape) != tuple(tokens.shape):
      raise ValueError(
        f"{name} must have the shape of tokens {tuple(tokens.shape)};"
        f" got {tuple(value.shape)}"
      )
    if not jnp.issubdtype(value.dtype, jnp.integer):
      raise TypeError(f"{name} must be integers; got dtype {value.dtype}")
  if positions is None:
    positions = segment_positions(segment_ids)
  elif not isinstance(positions, jax.core.Tracer):
    bad = (np.asarray(positions) < 0) | (np.asarray(positions) >= max_seq_len)
    if bad.any():  # a traced one cannot be checked: the docstring says so
      raise ValueError(
        f"positions must be in [0, max_seq_len = {max_seq_len}); got"
        f" {np.asarray(positions)[bad][0]}"
      )
  return jnp.asarray(segment_ids, jnp.int32), jnp.asarray(positions, jnp.int32)


def count_params(model: nnx.Module) -> int:
  """Number of scalar parameters (`nnx.Param` leaves) in `model`."""
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
