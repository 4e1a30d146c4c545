"""One case of the property suite (test_property_golden.py) against the
float64 golden: the backend's out, lse and gradients, the naive attention of
FA3's rule, and the bound.

The bound is the rule of `pallas_fa3.testing`, max|got - golden| <= 2 x the
naive error + a floor, widened where a documented property of
FlashAttention makes it unattainable (each found by the suite; the cases
are tests/test_property_golden.py's FOUND):

* The residual out. The backward takes delta = rowsum(dO * O), and
  d/dsinks, from out in the input dtype (FA2/FA3, the blockwise twin, the
  kernels); the naive autodiff never rounds out there. Where one key takes
  most of a row, dP - delta cancels and out's rounding is the gradient's
  error (bf16, a window of a few keys: dK 0.050 from the golden, the naive
  0.016, the exact gradient of the call's own out 0.051). Gradients are
  bounded by 2 x the larger of the naive error and that *carried*
  gradient's (exact, given the call's out, rounded to the gradient's dtype).
* The floor's unit. `FLOOR_ULPS` float32 ulps of max(|golden|, 1) suits
  O(1) terms. The backward sums terms P (dP - delta) K scale whose float32
  rounding is relative to |dP| and |delta|, not to their difference (dQ and
  dK are exactly 0 where a row sees one key: docs/numerics.md#large-logits),
  and recomputes P from the lse through base 2, an exponent off by about
  eps (|s| + |lse|) (`pallas_fa3.lse`). A gradient's floor is also
  `TERM_ULPS` float32 ulps of the largest sum of such terms' magnitudes
  (`_golden_terms`): float32 inputs with large scores are judged at
  float32's resolution of what the backward adds up, low-precision ones
  still far below their own rounding.
* The roundings the kernels must make. P (for P V and dV) and dS (for dQ
  and dK) are rounded to the input dtype, as tensor-core GEMMs need, and
  each result to the output dtype. Where an entry sums one or a few terms
  (the one row that sees its one key, beside a sink), 2 x the naive error
  is a ratio of a few roundings and can be less than those (bf16 dV: 0.0115
  from the golden, the naive 0.0047; dQ: 0.00099, the naive 0.00045). Each
  entry may exceed the rest of the bound by its golden value's own rounding
  to the output dtype plus the dtype's unit roundoff times the root sum of
  squares of its P or dS terms (`_golden_terms`; bf16 and fp16 inputs:
  float32 ones round nothing): one rounding for one term, below the naive
  error for many.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import pallas_fa3
from pallas_fa3.reference import (
  _golden_parts,  # the golden's P and lse: the floor's unit, the spreads
  golden_attention,
  golden_attention_vjp,
  reference_attention,
)
from pallas_fa3.testing import FLOOR_ULPS, max_abs_err

_F32_EPS = float(np.finfo(np.float32).eps)
# Float32 ulps of `_term_scales` in the gradients' floor. The cases found
# exceed the rest of the bound by at most 0.43 of them (dQ of float32
# inputs with scores ~50; dK exactly 0 in bf16), the errors of 15 float32
# mixes (CI and slow pools) are within 1.1 of them in all; 4 keeps a margin
# and still fails dQ scaled by 1 + 1e-5 in 14 of those 15 mixes (the 15th
# has dQ = 0).
TERM_ULPS = 4
_NAMES = ("out", "lse", "dq", "dk", "dv", "dsinks")
_OPERANDS = ("q", "k", "v", "dout", "dlse", "sinks", "segment_ids")
# Compiled functions kept: the current mix's (both backends and the naive)
# and the previous one's. XLA:CPU maps ~120 memory regions per executable;
# keeping every mix's exhausted vm.max_map_count (65530) after ~190 mixes of
# the slow profile (an abort inside a compile).
_KEEP = 6


@functools.lru_cache(maxsize=_KEEP)
def _backend_fn(implementation, mix):
  """Jitted (out, lse or None, dq, dk, dv, dsinks or None) of one backend,
  compiled once per mix."""

  def run(q, k, v, dout, dlse, sinks, segment_ids):
    def f(q, k, v, sinks):
      return pallas_fa3.flash_attention(
        q,
        k,
        v,
        implementation=implementation,
        config=mix.config(implementation),
        return_lse=mix.return_lse,
        deterministic=mix.deterministic,
        sinks=sinks,
        segment_ids=segment_ids,
        **mix.options(),
      )

    outs, pullback = jax.vjp(f, q, k, v, sinks)
    if not mix.return_lse:
      return (outs, None) + pullback(dout)
    return outs + pullback((dout, dlse))

  return jax.jit(run)


@functools.lru_cache(maxsize=_KEEP)
def _naive_fn(mix):
  """The rule's naive attention (every intermediate in the input dtype,
  plain autodiff) as `pallas_fa3.testing.golden_and_naive` computes it,
  jitted once per mix: eager, it compiles every op anew for each shape
  (~3 s a mix). Excess precision is off so that each op rounds to the low
  dtype as it does eagerly (XLA otherwise drops bf16 round trips inside a
  fusion); bf16 results are then bit-identical to the eager ones."""

  def run(q, k, v, dout, dlse, sinks, segment_ids):
    def f(q, k, v, sinks):
      return reference_attention(
        q,
        k,
        v,
        return_lse=True,
        intermediate_dtype=q.dtype,
        sinks=sinks,
        segment_ids=segment_ids,
        **mix.options(),
      )

    outs, pullback = jax.vjp(f, q, k, v, sinks)
    return outs + pullback((dout, dlse))

  return jax.jit(run, compiler_options={"xla_allow_excess_precision": False})


def _f64(x):
  return np.asarray(x, np.float64)


def _golden(mix, x, out=None):
  """Float64 (out, lse, dq, dk, dv, dsinks or None); with `out`, the
  gradients are those carried from that out: delta = dO . out - dlse
  (the golden's dlse shifted by dO . (golden out - out))."""
  common = dict(sinks=x["sinks"], segment_ids=x["ids"], **mix.options())
  q, k, v, dout = x["q"], x["k"], x["v"], x["dout"]
  gold_out, lse = golden_attention(q, k, v, **common)
  dlse = _f64(x["dlse"])
  if out is not None:
    dlse = dlse + np.einsum("bqhd,bqhd->bhq", _f64(dout), gold_out - _f64(out))
  grads = golden_attention_vjp(q, k, v, dout, dlse, **common)
  return (gold_out, lse) + tuple(grads) + (None,) * (4 - len(grads))


def _golden_terms(mix, x):
  """What the golden says of the terms the backends add up.

  Returns (scales, spreads). `scales`, per gradient: the largest sum of the
  magnitudes of the float32 terms for one entry, P (|dP - delta| E + |dP| +
  |delta|) times |K| or |Q| and the scale (dq, dk), P E |dO| (dv), P_sink
  (|delta| E + |dO| . |O|) (dsinks), where E = 1 + |s| + |lse| is P's
  exponent error in ulps. `spreads`, per output entry: the root sum of
  squares of the terms formed from P or dS after their rounding to the
  input dtype, P V (out), P dO (dv), dS K and dS Q times the scale (dq,
  dk); the expected size of that rounding, in units of the dtype's
  rounding."""
  spec, qg, k64, v64, p, lse, t, sk = _golden_parts(
    x["q"],
    x["k"],
    x["v"],
    sinks=x["sinks"],
    segment_ids=x["ids"],
    **mix.options(),
  )
  b, sq, hk, g = spec.batch, spec.seq_q, spec.heads_kv, spec.group_size
  do = _f64(x["dout"]).reshape(b, sq, hk, g, spec.head_dim_v)
  o = np.einsum("bhgqk,bkhd->bqhgd", p, v64)
  dlse = _f64(x["dlse"]).reshape(b, hk, g, sq)
  delta = np.einsum("bqhgd,bqhgd->bhgq", do, o) - dlse
  dp = np.einsum("bqhgd,bkhd->bhgqk", do, v64)
  lse = np.where(np.isfinite(lse), lse, 0.0)[..., None]
  with np.errstate(divide="ignore"):
    s = np.where(p > 0, np.log(np.where(p > 0, p, 1.0)) + lse, 0.0)
  e = 1.0 + np.abs(s) + np.abs(lse)
  d = delta[..., None]
  terms = p * (np.abs(dp - d) * e + np.abs(dp) + np.abs(d))
  scale = spec.softmax_scale
  to_q = lambda a, kv: np.einsum("bhgqk,bkhd->bqhgd", a, kv)
  to_kv = lambda a, rows: np.einsum("bhgqk,bqhgd->bkhd", a, rows)
  scales = {
    "dq": scale * to_q(terms, np.abs(k64)).max(),
    "dk": scale * to_kv(terms, np.abs(qg)).max(),
    "dv": to_kv(p * e, np.abs(do)).max(),
  }
  if sk is not None:
    p_sink = np.exp(sk - lse)[..., 0]  # [b, hk, g, sq]
    e_sink = (1.0 + np.abs(sk) + np.abs(lse))[..., 0]
    mags = np.einsum("bqhgd,bqhgd->bhgq", np.abs(do), np.abs(o))
    sums = (p_sink * (np.abs(delta) * e_sink + mags)).sum(axis=(0, 3))
    scales["dsinks"] = sums.max()
  ds = p * (dp - d) * (1.0 if t is None else 1.0 - t * t)
  rows = lambda a: a.reshape(b, sq, spec.heads_q, a.shape[-1])
  spreads = {
    "out": rows(np.sqrt(to_q(p * p, v64 * v64))),
    "dv": np.sqrt(to_kv(p * p, do * do)),
    "dq": scale * rows(np.sqrt(to_q(ds * ds, k64 * k64))),
    "dk": scale * np.sqrt(to_kv(ds * ds, qg * qg)),
  }
  return scales, spreads


def _assert_rule(
  name, got, naive, golden, carried=None, term_scale=0.0, spread=None
):
  """The widened rule of the module docstring for one output."""
  golden = np.asarray(golden, np.float64)
  finite = np.isfinite(golden)
  g = golden[finite]
  slack = np.abs(g.astype(got.dtype).astype(np.float64) - g)
  if spread is not None and got.dtype.itemsize < 4:  # P, dS rounded
    slack = slack + float(jnp.finfo(got.dtype).eps) / 2 * spread[finite]
  excess = np.max(np.abs(_f64(got)[finite] - g) - slack, initial=0.0)
  naive_err = max_abs_err(naive, golden)
  carried_err = 0.0
  if carried is not None:
    carried_err = max_abs_err(np.asarray(carried).astype(got.dtype), golden)
  scale = float(np.max(np.abs(g), initial=1.0))
  floor = _F32_EPS * max(FLOOR_ULPS * scale, TERM_ULPS * term_scale)
  bound = 2.0 * max(naive_err, carried_err) + floor
  assert excess <= bound, (
    f"{name}: max(|got - golden| - own rounding - P/dS rounding) ="
    f" {excess:.3g} (max|got - golden| = {max_abs_err(got, golden):.3g})"
    f" exceeds 2 x max(naive error {naive_err:.3g}, error carried by out"
    f" {carried_err:.3g}) + floor {floor:.3g} = {bound:.3g}"
  )


def check(implementation, mix, ops):
  """`implementation` on one case: dtypes and shapes, exact empty rows,
  finite results, and the widened rule on every output."""
  x = ops.arrays(mix)
  args = [x[name] for name in _OPERANDS]
  got = jax.block_until_ready(_backend_fn(implementation, mix)(*args))
  naive = _naive_fn(mix)(*args)
  ids = x["segment_ids"]
  x["ids"] = (ids, ids) if mix.segments == "array" else ids
  gold = _golden(mix, x)
  carried = _golden(mix, x, out=got[0])
  s = mix.shape
  shapes = [
    (s.batch, s.seq_q, s.heads_q, s.dv),
    (s.batch, s.heads_q, s.seq_q),
    x["q"].shape,
    x["k"].shape,
    x["v"].shape,
    (s.heads_q,),
  ]
  dtypes = [mix.dtype, "float32"] + [mix.dtype] * 3 + [mix.sinks_dtype]
  for name, g, shape, dtype in zip(_NAMES, got, shapes, dtypes):
    if g is not None:
      assert (g.shape, g.dtype) == (shape, jnp.dtype(dtype)), name
  # A row that sees no key (and no sink): output exactly 0, lse exactly -inf.
  empty = np.isneginf(gold[1])  # [b, hq, sq]
  out = np.asarray(got[0], np.float32)
  assert np.all(out[np.moveaxis(empty, 1, 2)] == 0), "out of empty rows"
  if got[1] is not None:
    np.testing.assert_array_equal(np.isneginf(np.asarray(got[1])), empty)
  scales, spreads = _golden_terms(mix, x)
  for i, (name, g, n, gd) in enumerate(zip(_NAMES, got, naive, gold)):
    if g is None:
      continue
    finite = np.isfinite(np.asarray(g, np.float32))
    assert np.all(finite | np.isneginf(gd)), f"{name} is not finite"
    spread = spreads.get(name)
    if i < 2:
      _assert_rule(name, g, n, gd, spread=spread)
    else:
      _assert_rule(name, g, n, gd, carried[i], scales[name], spread)
