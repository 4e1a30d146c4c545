"""Text generation with the GPT of `models.gpt`: `generate` continues a batch
of prompts with a prefill, then cached decode steps (or, with
`use_cache=False`, by recomputing the whole sequence for every token; or,
with `slots=`, as a continuous batch: a prompt's prefill beside the other
sequences' decode steps, one ragged kvcache call per layer and step), and
returns a `Generation`.
More: docs/generation.md#the-two-paths

Example:
  >>> from flax import nnx
  >>> from models.gpt import GPT, GPTConfig
  >>> from models.generate import generate
  >>> model = GPT(GPTConfig(num_layers=1, d_model=32, max_seq_len=32),
  ...             rngs=nnx.Rngs(0))
  >>> out = generate(model, [b"def ", b"import o"], max_new_tokens=4)
  >>> [len(t) for t in out.tokens]
  [4, 4]
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.gpt import GPT
from models.sampling import Sampling, sample

# The no-cache path pads the sequence to a multiple of this many tokens:
# one compilation per bucket instead of one per length, at most this many
# tokens of padding computed per step.
NO_CACHE_BUCKET = 64
# A continuous batch's packed step is padded to a multiple of this many
# tokens, and its longest chunk bound (`max_seqlen_q`) to a power of two:
# a few compilations, not one per mix of chunks.
STEP_BUCKET = 16
GREEDY = Sampling()


@dataclasses.dataclass(frozen=True)
class Generation:
  """What `generate` returns.

  Attributes:
    tokens: each prompt's continuation, `max_new_tokens` ints.
    prompt_tokens: tokens in the prompts (all of them).
    prefill_s: seconds of the prefill: the prompts' forward pass, which
      also gives each sequence's first new token.
    decode_s: seconds of the other `max_new_tokens - 1` tokens per sequence.
    compile_s: seconds spent compiling (not in the two above).
  """

  tokens: list[list[int]]
  prompt_tokens: int
  prefill_s: float
  decode_s: float
  compile_s: float

  @property
  def prefill_tokens_per_s(self) -> float:
    return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

  @property
  def decode_tokens_per_s(self) -> float:
    steps = sum(len(t) - 1 for t in self.tokens)
    return steps / self.decode_s if self.decode_s else 0.0


def check_prompts(
  prompts: Any, vocab_size: int, max_new_tokens: int, max_seq_len: int
) -> list[list[int]]:
  """The prompts as lists of ints, checked.

  Raises:
    ValueError / TypeError naming `prompts` or `max_new_tokens`.
  """
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
    raise TypeError(f"max_new_tokens must be an int; got {max_new_tokens!r}")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
    raise TypeError(
      "prompts must be a sequence of prompts (each bytes or a sequence of"
      f" token ids); got {type(prompts).__name__}"
    )
  if not prompts:
    raise ValueError("prompts is empty: give at least one prompt")
  out = []
  for i, prompt in enumerate(prompts):
    tokens = [int(t) for t in prompt]
    if not tokens:
      raise ValueError(f"prompts[{i}] is empty: a prompt needs a token")
    if min(tokens) < 0 or max(tokens) >= vocab_size:
      raise ValueError(
        f"prompts[{i}] has a token outside [0, vocab_size = {vocab_size})"
      )
    if len(tokens) + max_new_tokens > max_seq_len:
      raise ValueError(
        f"prompts[{i}] has {len(tokens)} tokens; with max_new_tokens ="
        f" {max_new_tokens} that exceeds GPTConfig.max_seq_len"
        f" {max_seq_len} (a RoPE model can be built with a longer"
        " max_seq_len: models.restore.load_model(..., max_seq_len=N))"
      )
    out.append(tokens)
  return out


class _Compiled:
  """Jitted functions compiled ahead of their first call, by argument
  shapes, so that compilation is timed apart from the run."""

  def __init__(self, fn: Callable[..., Any], **jit_kwargs: Any) -> None:
    self._jitted = jax.jit(fn, **jit_kwargs)
    self._by_shape: dict[Any, Any] = {}
    self.seconds = 0.0

  def __call__(self, *args: Any) -> Any:
    key = tuple(
      (jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(args)
    )
    if key not in self._by_shape:
      start = time.perf_counter()
      self._by_shape[key] = self._jitted.lower(*args).compile()
      self.seconds += time.perf_counter() - start
    return self._by_shape[key](*args)


def _padded(prompts: list[list[int]], length: int) -> np.ndarray:
  tokens = np.zeros((len(prompts), length), np.int32)
  for b, prompt in enumerate(prompts):
    tokens[b, : len(prompt)] = prompt
  return tokens


def _last(logits: jax.Array, lengths: jax.Array) -> jax.Array:
  """Each sequence's logits at its last token, `[batch, vocab]`."""
  rows = jnp.arange(logits.shape[0])
  return logits[rows, lengths - 1]


def generate(
  model: GPT,
  prompts: Sequence[Sequence[int]],
  *,
  max_new_tokens: int,
  sampling: Sampling = GREEDY,
  use_cache: bool = True,
  slots: int | None = None,
) -> Generation:
  """Continues each prompt by `max_new_tokens` tokens.

  Args:
    model: the GPT (left unchanged: the caches live in a copy).
    prompts: token prompts (e.g. bytes), at least one token each; their
      lengths may differ.
    max_new_tokens: tokens to generate per prompt (>= 1); every prompt's
      length plus this must fit `max_seq_len`.
    sampling: greedy (temperature 0, the default), or temperature, top-k,
      top-p sampling with a seed (`models.sampling.Sampling`).
    use_cache: decode with the KV caches; False recomputes the whole
      sequence for every token.
    slots: None (every prompt in one batch), or serve the prompts as a
      continuous batch of this many cache rows: each step packs, per
      row, a newly admitted prompt whole (its prefill) or its sequence's
      last token (a decode step), one ragged `flash_attention_with_kvcache`
      call per layer (`cu_seqlens_q`); a finished sequence's row takes the
      next waiting prompt at the next step, beside the others' decoding.
      Each sequence's tokens are those of generating it alone (token i
      drawn with `fold_in(key(seed), i)`, as in every path).

  Returns:
    A `Generation`: the continuations and the timings (with `slots`,
    `prefill_s` counts the steps that admitted a prompt).
  """
  cfg = model.cfg
  prompts = check_prompts(
    prompts, cfg.vocab_size, max_new_tokens, cfg.max_seq_len
  )
  if not isinstance(sampling, Sampling):
    raise TypeError(f"sampling must be a Sampling; got {sampling!r}")
  if slots is not None:
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
      raise ValueError(f"slots must be None or an int >= 1; got {slots!r}")
    if not use_cache:
      raise ValueError("slots (a continuous batch) needs use_cache=True")
    return _generate_continuous(model, prompts, max_new_tokens, sampling, slots)
  run = _generate_cached if use_cache else _generate_uncached
  return run(model, prompts, max_new_tokens, sampling)


# Compiled programs kept per model structure and sampling, so that repeated
# generations of one model compile once (by argument shapes).
_PROGRAM_CACHE_SIZE = 8


@functools.lru_cache(maxsize=_PROGRAM_CACHE_SIZE)
def _cached_programs(graphdef: Any, sampling: Sampling):
  """(prefill, step) of the cached path; both donate the caches."""

  def prefill(params, cache, rest, tokens, lengths):
    m = nnx.merge(graphdef, params, cache, rest)
    logits = m(tokens, decode=True, prefill=True, chunk_lengths=lengths)
    key = jax.random.fold_in(jax.random.key(sampling.seed), 0)
    return sample(_last(logits, lengths), key, sampling), nnx.state(
      m, nnx.Cache
    )

  def step(params, cache, rest, token, i):
    m = nnx.merge(graphdef, params, cache, rest)
    logits = m(token[:, None], decode=True)[:, 0]
    key = jax.random.fold_in(jax.random.key(sampling.seed), i)
    return sample(logits, key, sampling), nnx.state(m, nnx.Cache)

  return (
    _Compiled(prefill, donate_argnums=1),
    _Compiled(step, donate_argnums=1),
  )


@functools.lru_cache(maxsize=_PROGRAM_CACHE_SIZE)
def _continuous_program(graphdef: Any, sampling: Sampling, bound: int):
  """A continuous batch's step (donates the caches): empties the rows in
  `restart`, runs the packed tokens (`cu_seqlens`; no chunk longer than
  `bound`), and samples each row's next token at its chunk's last row
  with its own token index `counts`."""

  def step(params, cache, rest, tokens, cu, restart, counts):
    m = nnx.merge(graphdef, params, cache, rest)
    m.restart(restart)
    logits = m(tokens, decode=True, cu_seqlens=cu, max_seqlen_q=bound)
    rows = logits[0, jnp.maximum(cu[1:] - 1, 0)]  # [slots, vocab]
    base = jax.random.key(sampling.seed)
    keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(counts)
    one = lambda row, key: sample(row[None], key, sampling)[0]
    return jax.vmap(one)(rows, keys), nnx.state(m, nnx.Cache)

  return _Compiled(step, donate_argnums=1)


@functools.lru_cache(maxsize=_PROGRAM_CACHE_SIZE)
def _uncached_program(graphdef: Any, sampling: Sampling):
  """The uncached path's step: the forward pass, then sampling."""

  def forward(params, rest, tokens, lengths, i):
    logits = nnx.merge(graphdef, params, rest)(tokens)
    key = jax.random.fold_in(jax.random.key(sampling.seed), i)
    return sample(_last(logits, lengths), key, sampling)

  return _Compiled(forward)


def _generate_cached(model, prompts, max_new_tokens, sampling) -> Generation:
  longest = max(len(p) for p in prompts)
  model = nnx.clone(model)
  model.init_cache(len(prompts), longest + max_new_tokens)
  graphdef, params, cache, rest = nnx.split(model, nnx.Param, nnx.Cache, ...)
  prefill, step = _cached_programs(graphdef, sampling)
  compiled = prefill.seconds + step.seconds
  lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
  tokens = jnp.asarray(_padded(prompts, longest))
  start = time.perf_counter()
  before = prefill.seconds
  token, cache = prefill(params, cache, rest, tokens, lengths)
  new = [jax.block_until_ready(token)]
  prefill_s = time.perf_counter() - start - (prefill.seconds - before)
  start = time.perf_counter()
  before = step.seconds
  for i in range(1, max_new_tokens):
    token, cache = step(params, cache, rest, token, jnp.int32(i))
    new.append(token)
  jax.block_until_ready(new[-1])
  decode_s = time.perf_counter() - start - (step.seconds - before)
  return Generation(
    tokens=np.stack([np.asarray(t) for t in new], axis=1).tolist(),
    prompt_tokens=sum(len(p) for p in prompts),
    prefill_s=prefill_s,
    decode_s=decode_s,
    compile_s=prefill.seconds + step.seconds - compiled,
  )


def _generate_uncached(model, prompts, max_new_tokens, sampling) -> Generation:
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  forward = _uncached_program(graphdef, sampling)
  compiled = forward.seconds
  lengths = np.array([len(p) for p in prompts], np.int32)
  total = int(lengths.max()) + max_new_tokens
  buffer = _padded(prompts, total)
  times, new = [], []
  for i in range(max_new_tokens):
    longest = int(lengths.max())
    width = -(-longest // NO_CACHE_BUCKET) * NO_CACHE_BUCKET
    width = min(width, total)
    args = (params, rest, jnp.asarray(buffer[:, :width]), jnp.asarray(lengths))
    before = forward.seconds
    start = time.perf_counter()
    token = np.asarray(forward(*args, jnp.int32(i)))
    times.append(time.perf_counter() - start - (forward.seconds - before))
    buffer[np.arange(len(prompts)), lengths] = token
    lengths = lengths + 1
    new.append(token)
  return Generation(
    tokens=np.stack(new, axis=1).tolist(),
    prompt_tokens=sum(len(p) for p in prompts),
    prefill_s=times[0],
    decode_s=sum(times[1:]),
    compile_s=forward.seconds - compiled,
  )


def _generate_continuous(
  model, prompts, max_new_tokens, sampling, slots
) -> Generation:
  rows = min(slots, len(prompts))
  model = nnx.clone(model)
  model.init_cache(rows, max(len(p) for p in prompts) + max_new_tokens)
  graphdef, params, cache, rest = nnx.split(model, nnx.Param, nnx.Cache, ...)
  programs = lambda bound: _continuous_program(graphdef, sampling, bound)
  compile_s = 0.0
  waiting = collections.deque(range(len(prompts)))
  owner: list[int | None] = [None] * rows  # the prompt each row serves
  out: list[list[int]] = [[] for _ in prompts]
  seconds = {True: 0.0, False: 0.0}  # steps with / without a prefill
  while waiting or any(o is not None for o in owner):
    restart = np.zeros(rows, bool)
    chunks = []
    for r in range(rows):
      if owner[r] is None and waiting:  # a free row takes the next prompt
        owner[r], restart[r] = waiting.popleft(), True
        chunks.append(prompts[owner[r]])
      elif owner[r] is not None:  # its last token, one decode step
        chunks.append(out[owner[r]][-1:])
      else:
        chunks.append([])
    sizes = [len(c) for c in chunks]
    cu = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    width = -(-int(cu[-1]) // STEP_BUCKET) * STEP_BUCKET
    tokens = np.zeros((1, width), np.int32)
    tokens[0, : cu[-1]] = np.concatenate([c for c in chunks if c])
    step = programs(1 << (max(sizes) - 1).bit_length())
    counts = np.array([len(out[o]) if o is not None else 0 for o in owner])
    start, before = time.perf_counter(), step.seconds
    new, cache = step(
      params, cache, rest, jnp.asarray(tokens), jnp.asarray(cu),
      jnp.asarray(restart), jnp.asarray(counts, jnp.int32),
    )  # fmt: skip
    new = np.asarray(new)  # (the host picks the next step's chunks)
    compile_s += step.seconds - before
    seconds[bool(restart.any())] += (
      time.perf_counter() - start - (step.seconds - before)
    )
    for r, o in enumerate(owner):
      if o is not None:
        out[o].append(int(new[r]))
        if len(out[o]) == max_new_tokens:
          owner[r] = None
  return Generation(
    tokens=out,
    prompt_tokens=sum(len(p) for p in prompts),
    prefill_s=seconds[True],
    decode_s=seconds[False],
    compile_s=compile_s,
  )
