"""How far `pallas_fa3.dot_product_attention` is from
`jax.nn.dot_product_attention(implementation="xla")` in float32: the largest
absolute difference of the output and of each gradient over the cases of
tests/test_dot_product.py (jax.nn's argument grid, every bias and mask
broadcast shape, the slow ones too, and the mask + bias + causal + lengths
case), per backend. The test asserts `atol=2e-5`; this prints what is
measured, for docs/flex.md#migrating.

    JAX_PLATFORMS=cpu python benchmarks/dot_product_vs_jax_nn.py
"""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from tests import test_dot_product as t  # noqa: E402

NAMES = ("out", "dq", "dk", "dv", "dbias")


def _cases():
  """(name, kwargs of `_both`, t, k) per case of the test module."""
  for case, kw in sorted(t.GRID.items()):
    kw = dict(kw)
    yield f"grid {case}", kw, kw.pop("_t", t.T), kw.pop("_k", t.K)
  for shape in t.SHAPES:
    shape = getattr(shape, "values", (shape,))[0]  # a pytest.param or not
    yield f"bias {shape}", dict(_bias=shape), t.T, t.K
    yield f"mask {shape}", dict(_mask=shape), t.T, t.K
  yield "mask+bias+causal+lengths", dict(_together=True), t.T, t.K


def _differences(impl: str, kw: dict, tq: int, k: int) -> dict[str, float]:
  q, kk, v, do, kb, km = t._inputs(t=tq, k=k)
  if "_bias" in kw:
    kw = dict(bias=jax.random.normal(kb, kw["_bias"], jnp.float32))
  elif "_mask" in kw:
    kw = dict(mask=jax.random.bernoulli(km, 0.7, kw["_mask"]))
  elif "_together" in kw:
    kw = dict(
      bias=jax.random.normal(kb, (1, t.N, t.T, t.S), jnp.float32),
      mask=jax.random.bernoulli(km, 0.8, (t.B, 1, t.T, t.S)),
      is_causal=True,
      key_value_seq_lengths=jnp.array([70, 40], jnp.int32),
    )
  ours, theirs = t._both(q, kk, v, do, impl=impl, **kw)
  return {
    name: float(np.abs(np.asarray(a) - np.asarray(b)).max())
    for name, a, b in zip(NAMES, ours, theirs)
    if a is not None
  }


def main() -> None:
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
  for impl in ("blockwise", "reference"):
    worst = dict.fromkeys(NAMES, (0.0, ""))
    for name, kw, tq, k in _cases():
      diffs = _differences(impl, kw, tq, k)
      print(impl, name, " ".join(f"{n} {d:.2e}" for n, d in diffs.items()))
      for n, d in diffs.items():
        worst[n] = max(worst[n], (d, name))
    print(
      f"{impl} worst:",
      "; ".join(f"{n} {d:.1e} ({c})" for n, (d, c) in worst.items() if c),
    )


if __name__ == "__main__":
  main()
