"""Error metrics of the numerics studies: deviation statistics, Wasserstein-1
and slopes, all taking array-likes, computing in float64 numpy and
returning Python floats, so results go straight into JSON:
docs/numerics.md#inputs-and-the-study-only-attention.

Example:
  >>> from pallas_fa3.tools.numerics import metrics
  >>> s = metrics.deviation_stats([1.0, 2.0, 4.0], [1.0, 1.0, 1.0])
  >>> s["max_abs"], s["mean_abs"], round(s["rmse"], 4)
  (3.0, 1.3333333333333333, 1.8257)
  >>> metrics.wasserstein_1([0.0, 1.0, 3.0], [5.0, 6.0, 8.0])
  5.0
"""

from __future__ import annotations

import numpy as np

# The keys of `deviation_stats`, in report order.
DEVIATION_KEYS = ("max_abs", "mean_abs", "std_abs", "rmse", "mean_signed")


def _f64(x) -> np.ndarray:
  return np.asarray(x).astype(np.float64)


def deviation_stats(got, golden) -> dict[str, float]:
  """Statistics of `diff = got - golden` over all entries.

  Returns:
    max_abs (max |diff|), mean_abs (mean |diff|), std_abs (standard
    deviation of |diff|), rmse (sqrt(mean(diff^2))) and mean_signed (mean
    diff: the bias). Non-finite entries of `got` make every figure inf.

  Raises:
    ValueError: the shapes differ or are empty.
  """
  got, golden = _f64(got), _f64(golden)
  if got.shape != golden.shape or got.size == 0:
    raise ValueError(
      f"got and golden must have one non-empty shape; got"
      f" {got.shape} and {golden.shape}"
    )
  if not np.all(np.isfinite(got)):
    return dict.fromkeys(DEVIATION_KEYS, float("inf"))
  diff = got - golden
  absd = np.abs(diff)
  return {
    "max_abs": float(absd.max()),
    "mean_abs": float(absd.mean()),
    "std_abs": float(absd.std()),
    "rmse": float(np.sqrt(np.mean(diff * diff))),
    "mean_signed": float(diff.mean()),
  }


def rmse(got, golden) -> float:
  """Root mean square of `got - golden`."""
  return deviation_stats(got, golden)["rmse"]


def max_abs_diff(a, b) -> float:
  """max |a - b| over all entries (same shapes)."""
  a, b = _f64(a), _f64(b)
  if a.shape != b.shape:
    raise ValueError(
      f"a and b must have one shape; got {a.shape} and {b.shape}"
    )
  return float(np.max(np.abs(a - b), initial=0.0))


def wasserstein_1(a, b) -> float:
  """1-D Wasserstein-1 distance between the empirical distributions of a and b.

  Both are flattened. `W1 = integral |F_a(x) - F_b(x)| dx` over the two
  empirical CDFs; for equal sizes this is exactly `mean |sort(a) - sort(b)|`
  (the optimal transport pairs the i-th smallest values). Equals
  `scipy.stats.wasserstein_distance(a, b)`.

  Raises:
    ValueError: either sample is empty or not finite.
  """
  a, b = np.sort(_f64(a).ravel()), np.sort(_f64(b).ravel())
  if a.size == 0 or b.size == 0:
    raise ValueError(
      f"wasserstein_1 needs non-empty samples; got sizes {a.size} and {b.size}"
    )
  if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
    raise ValueError("wasserstein_1 needs finite samples")
  if a.size == b.size:
    return float(np.mean(np.abs(a - b)))
  # General sizes: integrate |F_a - F_b| between consecutive support points.
  points = np.sort(np.concatenate([a, b]))
  widths = np.diff(points)
  cdf_a = np.searchsorted(a, points[:-1], side="right") / a.size
  cdf_b = np.searchsorted(b, points[:-1], side="right") / b.size
  return float(np.sum(np.abs(cdf_a - cdf_b) * widths))


def fit_line(x, y) -> tuple[float, float]:
  """Least-squares `y = intercept + slope * x`; returns (slope, intercept).

  Raises:
    ValueError: fewer than two points, or all x equal.
  """
  x, y = _f64(x), _f64(y)
  if x.shape != y.shape or x.size < 2 or np.ptp(x) == 0:
    raise ValueError(
      f"fit_line needs >= 2 points with distinct x; got x of"
      f" shape {x.shape}, y of shape {y.shape}"
    )
  slope, intercept = np.polyfit(x, y, 1)
  return float(slope), float(intercept)


def loglog_slope(x, y) -> float:
  """Slope of log(y) against log(x) (the growth exponent); positive x, y."""
  x, y = _f64(x), _f64(y)
  if np.any(x <= 0) or np.any(y <= 0):
    raise ValueError("loglog_slope needs positive x and y")
  return fit_line(np.log(x), np.log(y))[0]


def ratio(a: float, b: float) -> float | None:
  """a / b, or None when b is 0 or either is not finite (JSON-friendly)."""
  if b == 0 or not (np.isfinite(a) and np.isfinite(b)):
    return None
  return float(a / b)
