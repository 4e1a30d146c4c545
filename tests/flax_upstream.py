"""A pytest plugin: Flax's own attention tests with `make_attention_fn` as Flax's attention.

Loaded with `-p flax_upstream` (with `tests/` on `PYTHONPATH`), it replaces,
for the whole run, what Flax's tests reach when they attend:
`flax.nnx.dot_product_attention`, `flax.linen.dot_product_attention`, and
the default `attention_fn` of `nnx.MultiHeadAttention` and
`linen.MultiHeadDotProductAttention`, by
`make_attention_fn(on_unsupported="fallback")` (what flash attention cannot
compute -- sown weights, dropout, a bias -- runs Flax's own function, which
the adapter bound at import). Flax's tests then check our attention against
their own expectations, references included:

  PYTHONPATH=tests pytest -p flax_upstream -p no:cacheprovider \
    <flax source>/tests/nnx/nn/attention_test.py \
    <flax source>/tests/linen/linen_attention_test.py

Flax's tests are not installed with Flax; its source distribution holds
them (`pip download flax==<version> --no-binary :all: --no-deps`).
`tests/test_flax_upstream.py` runs this when `FLAX_TESTS_DIR` names them.
"""

from __future__ import annotations

import functools

from flax import linen, nnx

from pallas_fa3.flax import FlashAttentionFallbackWarning, make_attention_fn

_ADAPTER = make_attention_fn(on_unsupported="fallback")
CALLS = [0]  # calls of our attention_fn in this run (reported at the end)


@functools.wraps(_ADAPTER)
def ATTENTION_FN(*args, **kwargs):  # noqa: N802 (a constant of the run)
  CALLS[0] += 1
  return _ADAPTER(*args, **kwargs)


# Re-exported so that the warning filter can name it from this module.
FallbackWarning = FlashAttentionFallbackWarning
_saved: list[tuple[object, str, object]] = []


def _set(owner: object, name: str, value: object) -> None:
  _saved.append((owner, name, getattr(owner, name)))
  setattr(owner, name, value)


def _default_attention_fn(cls: type) -> None:
  """`cls(...)` without `attention_fn` gets ours (linen's dataclass fields
  and nnx's keyword default alike)."""
  init = cls.__init__

  @functools.wraps(init)
  def patched(self, *args, **kwargs):
    kwargs.setdefault("attention_fn", ATTENTION_FN)
    init(self, *args, **kwargs)

  _set(cls, "__init__", patched)


def pytest_configure(config) -> None:
  # Fallbacks are the point of on_unsupported="fallback" here.
  name = f"{__name__}.FallbackWarning"
  config.addinivalue_line("filterwarnings", f"ignore::{name}")
  _set(nnx, "dot_product_attention", ATTENTION_FN)
  _set(linen, "dot_product_attention", ATTENTION_FN)
  _default_attention_fn(nnx.MultiHeadAttention)
  # Linen's aliases (MultiHeadAttention, SelfAttention) are subclasses with
  # __init__s of their own.
  for cls in (linen.MultiHeadDotProductAttention,) + tuple(
    linen.MultiHeadDotProductAttention.__subclasses__()
  ):
    _default_attention_fn(cls)


def pytest_terminal_summary(terminalreporter) -> None:
  # Under xdist the workers count; the controller's count is then 0.
  terminalreporter.write_line(
    f"flax_upstream: make_attention_fn ran {CALLS[0]} calls"
  )


def pytest_unconfigure(config) -> None:
  del config
  while _saved:
    owner, name, value = _saved.pop()
    setattr(owner, name, value)
