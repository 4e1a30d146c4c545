"""Random mixes of every `flash_attention` option against the float64 golden
(issue 31), with hypothesis.

Each mix draws a shape (batch, ragged and unequal seq_q/seq_kv,
MHA/GQA/MQA, head dims 8..256, head_dim_v != head_dim), a dtype (float32,
bfloat16, float16) and options (causal, window_size, softcap, softmax_scale,
sinks in any float dtype, segment ids as packed documents, arbitrary ids or
one array, with padding ids; return_lse, with or without an lse cotangent;
deterministic; the blockwise tiling); each case checks out, lse, dq, dk, dv
and d/dsinks against the float64 golden with FA3's rule
(`pallas_fa3.testing`): `reference` and `blockwise` on every mix,
`interpret` (the Hopper kernels) on kernel-shaped mixes only: bf16/fp16,
head dims 64..256 (pairs whose backward fits), batch 1, seq <= 256.

A mix's static part compiles (a second or two per backend on a CPU), so a
profile runs a fixed pool of mixes (`property_mixes.make_mix(index)`, one
test item each) and hypothesis draws the traced part of every case
(inputs, sink logits, segment ids, the lse cotangent). Profiles, all
derandomized (the same cases every run):

  fa3-mixes        CI: 12 mixes x 2 backends x 10 cases;
                   interpret: 3 mixes x 2 cases
  fa3-mixes-slow   `pytest -m slow`: 200 mixes x 2 backends x 8 cases;
                   interpret: 12 mixes x 4 cases
"""

from __future__ import annotations

import warnings

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from property_check import check
from property_mixes import (
  DTYPES,
  SEGMENT_KINDS,
  Mix,
  Operands,
  make_mix,
  operands,
)

import pallas_fa3
from pallas_fa3 import backends
from pallas_fa3.kernels.sm90 import compat, config_backward as sm90_backward
from pallas_fa3.spec import make_spec
from pallas_fa3.testing import Shape

_BASE = dict(
  deadline=None,  # a mix's first case compiles it
  derandomize=True,  # reproducible: the same cases every run
  database=None,
  suppress_health_check=[hypothesis.HealthCheck.too_slow],
  print_blob=True,
)
hypothesis.settings.register_profile("fa3-mixes", max_examples=10, **_BASE)
hypothesis.settings.register_profile("fa3-mixes-slow", max_examples=8, **_BASE)
hypothesis.settings.register_profile(
  "fa3-kernel-mixes", max_examples=2, **_BASE
)
hypothesis.settings.register_profile(
  "fa3-kernel-mixes-slow", max_examples=4, **_BASE
)
_profile = hypothesis.settings.get_profile

CI_MIXES = range(0, 12)  # covers every option (test_ci_pool_covers_...)
SLOW_MIXES = range(1000, 1200)
# Interpret mode takes seconds a case: three chosen mixes run every kernel
# path in CI, each with sinks, a window and softcap. 42: fused backward,
# GQA, head dims 96/64, causal; 310: dK/dV + dQ (deterministic), head dim
# 256 (the backward splits it), float16; 221: packed segment ids (the
# forward kernel; gradients by the documented blockwise recomputation), GQA,
# head dims 64/96, causal with seq_q > seq_kv.
KERNEL_CI_MIXES = (42, 310, 221)
KERNEL_SLOW_MIXES = range(1000, 1012)

PURE_JAX = ("reference", "blockwise")


def _mixes(indices, *, kernel=False):
  return [
    pytest.param(make_mix(i, kernel=kernel), id=f"mix{i}") for i in indices
  ]


def _check_pure(implementation, mix, data):
  hypothesis.note(f"{implementation}: {mix}")
  check(implementation, mix, data.draw(operands(mix), label="operands"))


@pytest.mark.parametrize("implementation", PURE_JAX)
@pytest.mark.parametrize("mix", _mixes(CI_MIXES))
@hypothesis.settings(_profile("fa3-mixes"))
@hypothesis.given(data=st.data())
def test_mixes_against_golden(implementation, mix, data):
  _check_pure(implementation, mix, data)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", PURE_JAX)
@pytest.mark.parametrize("mix", _mixes(SLOW_MIXES))
@hypothesis.settings(_profile("fa3-mixes-slow"))
@hypothesis.given(data=st.data())
def test_slow_mixes_against_golden(implementation, mix, data):
  _check_pure(implementation, mix, data)


def _check_interpret(mix, data):
  hypothesis.note(f"interpret: {mix}")
  ops = data.draw(operands(mix), label="operands")
  with warnings.catch_warnings():
    # No silent fallback: a warning fails the case, except the documented
    # one (docs/api.md#packed-sequences-segment-ids): gradients with
    # segment ids run the blockwise recomputation in interpret mode.
    warnings.simplefilter("error")
    warnings.filterwarnings(
      "ignore", message="interpret: segment_ids gradients use the blockwise"
    )
    try:
      with compat.capture_race_report() as report:
        check("interpret", mix, ops)
    except Exception:
      compat.reset_interpret_state()
      raise
  assert not compat.races_found(), report.getvalue()[-3000:]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mix", _mixes(KERNEL_CI_MIXES, kernel=True))
@hypothesis.settings(_profile("fa3-kernel-mixes"))
@hypothesis.given(data=st.data())
def test_kernel_mixes_against_golden(mix, data):
  _check_interpret(mix, data)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mix", _mixes(KERNEL_SLOW_MIXES, kernel=True))
@hypothesis.settings(_profile("fa3-kernel-mixes-slow"))
@hypothesis.given(data=st.data())
def test_slow_kernel_mixes_against_golden(mix, data):
  _check_interpret(mix, data)


def _spec(mix):
  s = mix.shape
  operand = lambda *dims: jax.ShapeDtypeStruct(dims, mix.dtype)
  return make_spec(
    operand(s.batch, s.seq_q, s.heads_q, s.head_dim),
    operand(s.batch, s.seq_kv, s.heads_kv, s.head_dim),
    operand(s.batch, s.seq_kv, s.heads_kv, s.dv),
    deterministic=mix.deterministic,
    sinks=mix.sinks_dtype is not None,
    segmented=mix.segments is not None,
    **mix.options(),
  )


def test_ci_pool_covers_every_option():
  """The CI pool holds every dtype, segment-id form and option, both
  alignments and head layouts (a smaller pool must not drop one)."""
  seen = set()
  for mix in (make_mix(i, kernel=False) for i in CI_MIXES):
    s, spec = mix.shape, _spec(mix)
    seen |= {
      mix.dtype,
      mix.segments,
      ("causal", mix.causal),
      ("return_lse", mix.return_lse),
      ("deterministic", mix.deterministic),
      ("window", spec.window_size is not None),
      ("softcap", spec.softcap is not None),
      ("scale", mix.softmax_scale is not None),
      ("sinks", mix.sinks_dtype is not None),
      ("dv != d", s.dv != s.head_dim),
      ("gqa", 1 < s.heads_q // s.heads_kv < s.heads_q),
      ("mqa", s.heads_kv == 1 < s.heads_q),
      ("sq vs skv", (s.seq_q > s.seq_kv) - (s.seq_q < s.seq_kv)),
      ("batch > 1", s.batch > 1),
      ("tiles", mix.block is not None),
    }
  wanted = set(DTYPES) | set(SEGMENT_KINDS)
  for name in ("causal", "return_lse", "deterministic", "window", "softcap"):
    wanted |= {(name, True), (name, False)}
  wanted |= {("scale", True), ("sinks", True), ("dv != d", True)}
  wanted |= {("gqa", True), ("mqa", True), ("batch > 1", True)}
  wanted |= {("sq vs skv", -1), ("sq vs skv", 0), ("sq vs skv", 1)}
  wanted |= {("tiles", True), ("tiles", False)}
  assert not wanted - seen, sorted(map(str, wanted - seen))


@pytest.mark.parametrize(
  "indices", [KERNEL_CI_MIXES, KERNEL_SLOW_MIXES], ids=["ci", "slow"]
)
def test_kernel_mixes_are_what_interpret_serves(indices):
  for mix in (make_mix(i, kernel=True) for i in indices):
    assert backends.unsupported_reason("interpret", _spec(mix)) is None, mix
    assert sm90_backward.backward_unsupported(_spec(mix)) is None, mix
    assert mix.shape.batch == 1, mix
    assert max(mix.shape.seq_q, mix.shape.seq_kv) <= 256, mix


def test_interpret_refuses_the_other_mixes():
  """The CI mixes the kernels do not serve raise NotImplementedError in
  `interpret` (before anything runs), never run another way."""
  refused = 0
  for mix in (make_mix(i, kernel=False) for i in CI_MIXES):
    if backends.unsupported_reason("interpret", _spec(mix)) is None:
      continue
    refused += 1
    x = Operands(seed=0).arrays(mix)
    with pytest.raises(NotImplementedError, match="interpret"):
      pallas_fa3.flash_attention(
        x["q"],
        x["k"],
        x["v"],
        implementation="interpret",
        sinks=x["sinks"],
        **mix.options(),
      )
  assert refused >= len(CI_MIXES) // 2, refused


def _runs(*rows):
  """int32 ids `[len(rows), n]` from rows of (id, run length) pairs."""
  return np.array([[i for i, n in row for _ in range(n)] for row in rows], "i4")


def _one_head_q_ids():
  q = "-2 0 0 0 -2 0 0 0 -2 -2 -2 -1 -2 0 -2 0 0 -2 -1 -1 -1 -1 0 0 0 0 -2"
  q += " -1 0 0 -1 -2 0 -1 -2 -2 -1 -2 -1 0 0 -2 0 -1 -1 -1 -2 0 -2 -2 0 0"
  q += " -2 0 -2 -1 0 -1 0 -1 -2 -1 -2 -2 -2 -1 0 -1 0 -1 0 -2 -1 -2 -1 -2"
  return np.array([(q + " 0 -1 0").split()], "i4")


def _sinks(*logits):
  return np.array(logits, np.float32)


# Cases the suite found, each a documented property of FlashAttention's
# backward that the plain rule cannot allow (property_check.py), with the
# backend that failed it.
FOUND = {
  # d/dsinks of rows of one key and a sink: out's rounding, 3.6x the naive.
  "dsinks-one-key-a-row": (
    "reference",
    Mix(
      Shape(2, 48, 48, 6, 3, 128),
      "float16",
      causal=True,
      window_size=(0, None),
      softcap=0.5,
      softmax_scale=0.02,
      sinks_dtype="float32",
      segments="array",
      deterministic=True,
      block=(128, 32),
    ),
    Operands(
      5866,
      _sinks(6, 4, 5, 3, 0, 5),
      ids=2 * (_runs([(-1, 28), (-2, 20)], [(-1, 25), (0, 16), (-1, 7)]),),
    ),
  ),
  # d/dsinks of one head, one float16 number: ours and the naive adjacent.
  "dsinks-one-head": (
    "reference",
    Mix(
      Shape(1, 79, 16, 1, 1, 80),
      "float16",
      window_size=(2, 5),
      softcap=0.5,
      softmax_scale=3.0,
      sinks_dtype="float16",
      segments="ids",
      return_lse=True,
      block=(64, 16),
    ),
    Operands(1, _sinks(0), ids=(_one_head_q_ids(), _runs([(-1, 5), (-2, 11)]))),
  ),
  # dK of two rows whose windows' few keys one takes: out's rounding, 3x.
  "dk-carried-by-out": (
    "blockwise",
    Mix(
      Shape(1, 55, 128, 3, 3, 16),
      "bfloat16",
      window_size=(28, 1),
      softmax_scale=1.0,
      sinks_dtype="float32",
      segments="packed",
      return_lse=True,
      block=(8, 8),
    ),
    Operands(
      2960,
      _sinks(10, 0, 7),
      ids=(_runs([(0, 53), (-1, 2)]), _runs([(-1, 128)])),
    ),
  ),
  # dK exactly 0 (one key, 321 rows): float32 rounding of dP - delta.
  "dk-exactly-zero": (
    "blockwise",
    Mix(
      Shape(1, 107, 1, 6, 2, 80),
      "bfloat16",
      softcap=30.0,
      softmax_scale=0.3,
      segments="packed",
      block=(32, 48),
    ),
    Operands(0, ids=(_runs([(-1, 107)]), _runs([(-1, 1)]))),
  ),
  # dV of one row that sees its one key (bf16, P near 1 beside its sink):
  # P rounded for dV, then dV itself; the naive only rounds once, 2.4x.
  "dv-one-row-of-one-key": (
    "blockwise",
    Mix(
      Shape(3, 149, 1, 3, 3, 80),
      "bfloat16",
      causal=True,
      softcap=3.0,
      softmax_scale=0.02,
      sinks_dtype="bfloat16",
      segments="packed",
      block=(32, 48),
    ),
    Operands(
      0,
      _sinks(-6.5, -6.5, -6.5),
      ids=(_runs(*3 * ([(-1, 149)],)), _runs(*3 * ([(-1, 1)],))),
    ),
  ),
  # dQ of that row (an exploration with another seed): dS rounded for dQ,
  # then dQ itself, 2.2x the naive.
  "dq-one-row-of-one-key": (
    "blockwise",
    Mix(
      Shape(3, 149, 1, 3, 3, 80),
      "bfloat16",
      causal=True,
      softcap=3.0,
      softmax_scale=0.02,
      sinks_dtype="bfloat16",
      segments="packed",
      block=(32, 48),
    ),
    Operands(
      140,
      _sinks(1e-3, 2, 2),
      ids=(_runs(*3 * ([(-1, 149)],)), _runs([(-1, 1)], [(-1, 1)], [(0, 1)])),
    ),
  ),
  # float32, scores ~ 50 and sinks 9: P recomputed from the lse, 36x.
  "dq-float32-large-scores": (
    "blockwise",
    Mix(
      Shape(3, 1, 151, 6, 3, 80),
      "float32",
      window_size=(2, 1),
      softmax_scale=3.0,
      sinks_dtype="float16",
      segments="ids",
      block=(16, 16),
    ),
    Operands(
      0,
      _sinks(9, 9, 9, 9, 9, 9),
      ids=(
        _runs([(-2, 1)], [(-2, 1)], [(-2, 1)]),
        _runs(
          [(-2, 124), (0, 10), (-1, 17)],
          [(-2, 111), (0, 23), (-2, 17)],
          [(0, 11), (-2, 15), (0, 26), (-1, 14), (0, 85)],
        ),
      ),
    ),
  ),
}


@pytest.mark.parametrize("name", FOUND)
def test_found_cases(name):
  implementation, mix, ops = FOUND[name]
  check(implementation, mix, ops)
