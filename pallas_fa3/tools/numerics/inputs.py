"""Input distributions of the numerics studies, drawn in float64 with numpy
(`normal`, and `outliers`: the FA3 paper's Table 3 inputs) and rounded to
the format under study, so that a study measures the error of the
attention computation, not of rounding its inputs:
docs/numerics.md#inputs-and-the-study-only-attention.

Example:
  >>> import numpy as np
  >>> from pallas_fa3.tools.numerics import inputs
  >>> q, k, v = inputs.draw(np.random.default_rng(0), "outliers", (1, 64, 2, 16))
  >>> q.shape, q.dtype
  ((1, 64, 2, 16), dtype('float64'))
"""

from __future__ import annotations

from typing import Literal, get_args

import jax.numpy as jnp
import numpy as np

Distribution = Literal["normal", "outliers"]
DISTRIBUTIONS: tuple[str, ...] = get_args(Distribution)

# FA3 paper (arXiv 2407.08608), section 4.3: N(0,1) + N(0,100) * Bernoulli(0.001).
OUTLIER_PROB = 1e-3
OUTLIER_STD = 10.0


def sample(rng: np.random.Generator, distribution: str, shape) -> np.ndarray:
  """One float64 array of `shape` from `distribution`."""
  if distribution not in DISTRIBUTIONS:
    raise ValueError(
      f"distribution must be one of {DISTRIBUTIONS}; got {distribution!r}"
    )
  x = rng.standard_normal(shape)
  if distribution == "outliers":
    x = x + OUTLIER_STD * rng.standard_normal(shape) * (
      rng.random(shape) < OUTLIER_PROB
    )
  return x


def draw(
  rng: np.random.Generator, distribution: str, shape
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Independent float64 (q, k, v) of one `[batch, seq, heads, head_dim]` shape."""
  return tuple(sample(rng, distribution, shape) for _ in range(3))


def round_to(x: np.ndarray, dtype) -> np.ndarray:
  """x rounded to `dtype` (via float32, nearest even), returned as float64."""
  x32 = jnp.asarray(np.asarray(x, np.float32))
  return np.asarray(x32.astype(dtype)).astype(np.float64)
