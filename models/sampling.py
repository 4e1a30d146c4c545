"""Choosing the next token from logits: `Sampling` (greedy, temperature,
top-k, top-p) and `sample`, one token per row.
More: docs/generation.md#sampling

Example:
  >>> import jax, jax.numpy as jnp
  >>> from models.sampling import Sampling, sample
  >>> logits = jnp.log(jnp.array([[0.1, 0.6, 0.3]]))
  >>> int(sample(logits, jax.random.key(0), Sampling())[0])
  1
  >>> int(sample(logits, jax.random.key(0), Sampling(1.0, top_k=1))[0])
  1
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next token is chosen.

  Attributes:
    temperature: 0 (greedy) or > 0: logits are divided by it.
    top_k: None, or keep the k most likely tokens (k >= 1).
    top_p: None, or keep the most likely tokens up to probability p, in
      (0, 1] (always at least the most likely one).
    seed: the draws' seed: token i of a generation uses
      `fold_in(key(seed), i)`.
  """

  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None
  seed: int = 0

  def __post_init__(self) -> None:
    t = self.temperature
    if (
      isinstance(t, bool)
      or not isinstance(t, numbers.Real)
      or not math.isfinite(t)
      or t < 0
    ):
      raise ValueError(
        f"Sampling.temperature must be a finite number >= 0; got {t!r}"
      )
    k = self.top_k
    if k is not None and (
      isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1
    ):
      raise ValueError(f"Sampling.top_k must be None or an int >= 1; got {k!r}")
    p = self.top_p
    if p is not None and (
      isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 < p <= 1
    ):
      raise ValueError(f"Sampling.top_p must be None or in (0, 1]; got {p!r}")
    if isinstance(self.seed, bool) or not isinstance(
      self.seed, numbers.Integral
    ):
      raise ValueError(f"Sampling.seed must be an int; got {self.seed!r}")
    if t == 0 and (k is not None or p is not None):
      raise ValueError(
        "Sampling.top_k and top_p need a temperature > 0 (temperature 0 is"
        " greedy)"
      )


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
  """One token per row of float `logits [batch, vocab]`: int32 `[batch]`."""
  if sampling.temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / sampling.temperature
  if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, sampling.top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if sampling.top_p is not None and sampling.top_p < 1:
    ordered = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    # A token is kept if the tokens more likely than it hold < top_p.
    kept = jnp.cumsum(probs, axis=-1) - probs < sampling.top_p
    cutoff = jnp.min(jnp.where(kept, ordered, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
