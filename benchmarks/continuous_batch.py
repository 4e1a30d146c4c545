"""`models.generate` three ways on 16 prompts of long-tailed lengths: one
batch, a continuous batch of 4 cache rows (`slots=4`), one prompt at a
time; wall time after a compiling run, and whether the tokens agree.
docs/generation.md#the-two-paths

  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/continuous_batch.py
"""

from __future__ import annotations

import time

import numpy as np
from flax import nnx

from models.generate import generate
from models.gpt import GPT, GPTConfig

NEW_TOKENS = 16


def _timed(fn):
  fn()  # compiles
  start = time.perf_counter()
  out = fn()
  return time.perf_counter() - start, out


def main() -> None:
  cfg = GPTConfig(num_layers=2, d_model=128, num_heads=4, max_seq_len=256)
  model = GPT(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  lens = [int(x) for x in np.clip(rng.lognormal(3.0, 0.8, 16), 4, 120)]
  prompts = [bytes(rng.integers(32, 127, n).astype(np.uint8)) for n in lens]
  run = lambda **kw: generate(model, prompts, max_new_tokens=NEW_TOKENS, **kw)
  t_batch, batch = _timed(run)
  t_slots, slots = _timed(lambda: run(slots=4))
  t_alone, alone = _timed(
    lambda: [
      generate(model, [p], max_new_tokens=NEW_TOKENS).tokens[0] for p in prompts
    ]
  )
  print(f"prompt lengths {lens} ({sum(lens)} tokens), {NEW_TOKENS} new each")
  print(
    f"one batch of 16: {t_batch:.2f} s; continuous, 4 rows: {t_slots:.2f} s;"
    f" one at a time: {t_alone:.2f} s"
  )
  print(
    "tokens equal to one at a time: batch", batch.tokens == alone,
    "continuous", slots.tokens == alone,
  )  # fmt: skip


if __name__ == "__main__":
  main()
