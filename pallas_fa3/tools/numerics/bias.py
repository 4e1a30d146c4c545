"""`pallas-fa3 numerics bias`: the repeated-max rounding bias and
`stable_max`, after Qiu and Yao 2025 (arXiv 2510.04212). Score rows with
`ties` entries equal to their maximum and V mostly negative, all exactly
representable; the signed error against float64 of one tile's P V, of
FlashAttention-2 with every intermediate in bf16 and of the blockwise
backend, and of `delta = rowsum(dO * O)`, without and with the fix, rows
without ties as the control: docs/numerics.md#bias.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3 import stable_max as stable_max_lib
from pallas_fa3.attention import flash_attention
from pallas_fa3.spec import check_int
from pallas_fa3.tools.numerics import inputs, lowprec, report

COMPUTATIONS = ("tile P V", "flash / all", "blockwise")
# The paper's mechanism: a row whose maximum repeats. The headline is taken
# at the first tie count > 1 of the sweep.
_F32 = np.float32


def _check_pair(name, pair, low=None):
  if (
    len(pair) != 2
    or not all(isinstance(x, numbers.Real) for x in pair)
    or (not pair[0] <= pair[1])
    or (low is not None and pair[0] < low)
  ):
    raise ValueError(
      f"BiasConfig.{name} must be (low, high) with low <= high"
      + (f" and low >= {low}" if low is not None else "")
      + f"; got {pair!r}"
    )


@dataclasses.dataclass(frozen=True)
class BiasConfig:
  """The bias experiment.

  Attributes:
    rows: independent score rows (each its own q, k, v).
    keys: entries per row (one kv tile at the blockwise default of 128).
    head_dim: features of V.
    ties: the sweep of how many entries share the row max (1 = control).
    max_range: r_m ~ U(max_range), in units of the scaled scores.
    gap: the other entries are r_m - U(gap).
    v_mean, v_std: V ~ N(v_mean, v_std) ("mostly negative" for v_mean < 0).
    beta, tie_tolerance: the fix's settings (`pallas_fa3.StableMax`).
    dtype: "bfloat16" (the paper's) or "float16".
    seed: input seed.
  """

  rows: int = 4096
  keys: int = 128
  head_dim: int = 64
  ties: tuple[int, ...] = (1, 2, 3, 4, 8)
  max_range: tuple[float, float] = (1.0, 4.0)
  gap: tuple[float, float] = (12.0, 20.0)
  v_mean: float = -1.0
  v_std: float = 0.5
  beta: float = stable_max_lib.DEFAULT_BETA
  tie_tolerance: float = stable_max_lib.DEFAULT_TIE_TOLERANCE
  dtype: str = "bfloat16"
  seed: int = 0

  def __post_init__(self):
    for name in ("ties", "max_range", "gap"):
      object.__setattr__(self, name, tuple(getattr(self, name)))
    for name in ("rows", "keys", "head_dim", "seed"):
      value = getattr(self, name)
      check_int(f"BiasConfig.{name}", value, minimum=0 if name == "seed" else 1)
    if not self.ties or any(
      isinstance(t, bool)
      or not isinstance(t, numbers.Integral)
      or not 1 <= t <= self.keys
      for t in self.ties
    ):
      raise ValueError(
        f"BiasConfig.ties must be ints in [1, keys ="
        f" {self.keys}]; got {self.ties!r}"
      )
    _check_pair("max_range", self.max_range)
    _check_pair("gap", self.gap, low=0.0)
    if not (isinstance(self.v_std, numbers.Real) and self.v_std > 0):
      raise ValueError(f"BiasConfig.v_std must be > 0; got {self.v_std!r}")
    if self.dtype not in ("bfloat16", "float16"):
      raise ValueError(
        f"BiasConfig.dtype must be 'bfloat16' or 'float16'; got {self.dtype!r}"
      )
    self.stable_max()  # validates beta and tie_tolerance

  def stable_max(self) -> stable_max_lib.StableMax:
    return stable_max_lib.StableMax(
      beta=self.beta, tie_tolerance=self.tie_tolerance
    )

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


# On a GPU: more rows (the experiment is small either way).
GPU_DEFAULT = BiasConfig(rows=16384)


def make_rows(cfg: BiasConfig, ties: int, rng: np.random.Generator):
  """Scores `[rows, keys]` with `ties` tied maxima and V `[rows, keys, d]`.

  Both are float64 holding values exactly representable in `cfg.dtype`.
  """
  r = lambda x: inputs.round_to(x, cfg.dtype)
  r_m = r(rng.uniform(*cfg.max_range, (cfg.rows, 1)))
  s = r(r_m - rng.uniform(*cfg.gap, (cfg.rows, cfg.keys)))
  # (With a gap reaching down to 0, an entry can round onto r_m: one more tie.)
  # Put the tied maxima at random places of each row.
  order = np.argsort(rng.random((cfg.rows, cfg.keys)), axis=1)
  tied = np.zeros((cfg.rows, cfg.keys), bool)
  np.put_along_axis(tied, order[:, :ties], True, axis=1)
  s = np.where(tied, r_m, s)
  v = r(rng.normal(cfg.v_mean, cfg.v_std, (cfg.rows, cfg.keys, cfg.head_dim)))
  return s, v


def _to_attention(s, v, dtype):
  """One-hot queries so that q . k = s: q `[R,1,1,d]`, k and v `[R,N,1,d]`."""
  rows, keys = s.shape
  d = v.shape[-1]
  q = np.zeros((rows, 1, 1, d))
  q[..., 0] = 1.0
  k = np.zeros((rows, keys, 1, d))
  k[:, :, 0, 0] = s
  cast = lambda x: jnp.asarray(x, jnp.float32).astype(dtype)
  return cast(q), cast(k), cast(v[:, :, None, :])


def _row_max(s, cfg: BiasConfig, fix: bool) -> np.ndarray:
  if not fix:
    return s.max(axis=-1)
  shift = stable_max_lib.max_shift_log2(cfg.dtype) * math.log(2.0)
  return np.asarray(
    stable_max_lib.tile_max(
      jnp.asarray(s, jnp.float32), cfg.stable_max(), unit=1.0, max_shift=shift
    ),
    np.float64,
  )


def tile_pv_error(s, v, cfg: BiasConfig, fix: bool) -> np.ndarray:
  """(bf16(P_bar V) - P V) / l per row and feature, in output units."""
  m = _row_max(s, cfg, fix)[:, None]
  p64 = np.exp(s - m)
  p_bar = inputs.round_to(p64.astype(_F32), cfg.dtype).astype(_F32)
  pv = np.einsum("rn,rnd->rd", p_bar, v.astype(_F32))  # float32 accumulate
  pv_bar = inputs.round_to(pv, cfg.dtype)
  l = p64.sum(axis=-1, keepdims=True)
  return (pv_bar - np.einsum("rn,rnd->rd", p64, v)) / l


def _stats(err: np.ndarray) -> dict[str, float]:
  """Bias (mean signed error), mean |error| and the bias in standard errors."""
  err = np.asarray(err, np.float64).ravel()
  sem = err.std() / math.sqrt(err.size)
  return {
    "bias": float(err.mean()),
    "mean_abs": float(np.abs(err).mean()),
    "t": float(err.mean() / sem) if sem > 0 else 0.0,
  }


def measure(cfg: BiasConfig, ties: int, rng: np.random.Generator) -> list[dict]:
  """Every computation, without and with the fix, at one tie count."""
  s, v = make_rows(cfg, ties, rng)
  q, k, vv = _to_attention(s, v, cfg.dtype)
  gold = lowprec.golden(q, k, vv, softmax_scale=1.0)[:, 0, 0]  # [R, d]
  gold_delta = gold.sum(axis=-1)
  out = []
  outs = {}
  for fix in (False, True):
    sm = cfg.stable_max() if fix else None
    full = {
      "flash / all": lowprec.flash_all(
        q, k, vv, block_q=1, block_kv=cfg.keys, softmax_scale=1.0, stable_max=sm
      ),
      "blockwise": flash_attention(
        q, k, vv, softmax_scale=1.0, implementation="blockwise", stable_max=sm
      ),
    }
    out.append(
      dict(
        ties=ties,
        computation="tile P V",
        fix=fix,
        **_stats(tile_pv_error(s, v, cfg, fix)),
      )
    )
    for name, o in full.items():
      o = np.asarray(jax.block_until_ready(o), np.float64)[:, 0, 0]
      outs[(name, fix)] = o
      delta = _stats(o.sum(axis=-1) - gold_delta)
      out.append(
        dict(
          ties=ties,
          computation=name,
          fix=fix,
          **_stats(o - gold),
          delta_bias=delta["bias"],
          delta_mean_abs=delta["mean_abs"],
          delta_t=delta["t"],
        )
      )
  for name in ("flash / all", "blockwise"):
    same = bool(np.array_equal(outs[(name, False)], outs[(name, True)]))
    for rec in out:
      if rec["computation"] == name:
        rec["fix_changed_nothing"] = same
  return out


def run(cfg: BiasConfig, *, progress: bool = True) -> dict:
  start = time.perf_counter()
  records = []
  with report.progress(len(cfg.ties), "bias", progress) as advance:
    for ties in cfg.ties:
      rng = np.random.default_rng((cfg.seed, ties))
      records += measure(cfg, ties, rng)
      advance(f"{ties} tied maxima")
  return {
    "records": records,
    "headline": headline(records, cfg),
    "wall_s": time.perf_counter() - start,
  }


def headline(records: list[dict], cfg: BiasConfig) -> dict:
  """Bias without / with the fix at the first tie count > 1, per computation."""
  tied = [t for t in cfg.ties if t > 1]
  if not tied:
    return {}
  at = {
    (r["computation"], r["fix"]): r for r in records if r["ties"] == tied[0]
  }
  out = {"ties": tied[0]}
  for name in COMPUTATIONS:
    off, on = at[(name, False)], at[(name, True)]
    out[name] = {
      "bias_without": off["bias"],
      "bias_with": on["bias"],
      "t_without": off["t"],
      "t_with": on["t"],
      "mean_abs_without": off["mean_abs"],
      "mean_abs_with": on["mean_abs"],
      "reduction": (abs(off["bias"]) / abs(on["bias"]) if on["bias"] else None),
    }
    if "delta_bias" in off:
      out[name].update(
        delta_bias_without=off["delta_bias"], delta_bias_with=on["delta_bias"]
      )
  return out


def markdown(result: dict) -> str:
  cfg, h = result["config"], result["headline"]
  lines = report.header_lines(
    "pallas-fa3 numerics bias (repeated row maxima)",
    result["environment"],
    [
      f"- {cfg['rows']} rows x {cfg['keys']} keys, V `[.., {cfg['head_dim']}]`"
      f" ~ N({cfg['v_mean']}, {cfg['v_std']}), {cfg['dtype']}; row max ~"
      f" U{tuple(cfg['max_range'])}, other scores max - U{tuple(cfg['gap'])}",
      f"- fix: stable_max beta {cfg['beta']}, tie tolerance"
      f" {cfg['tie_tolerance']}; bias = mean signed error against float64"
      " (output units); t = bias / standard error; delta = rowsum(dO * O)"
      " with dO = 1",
      f"- wall time {result['wall_s']:.0f} s",
    ],
  )
  if h:
    lines += [f"## Headline: {h['ties']} tied maxima per row", ""]
    lines += report.table(
      [
        "computation",
        "bias without",
        "t",
        "bias with",
        "t",
        "|bias| reduced",
        "mean |err| without / with",
        "delta bias without / with",
      ],
      [
        [
          name,
          h[name]["bias_without"],
          h[name]["t_without"],
          h[name]["bias_with"],
          h[name]["t_with"],
          None
          if h[name]["reduction"] is None
          else f"{h[name]['reduction']:.3g}x",
          f"{h[name]['mean_abs_without']:.3g} / {h[name]['mean_abs_with']:.3g}",
          (
            f"{h[name]['delta_bias_without']:.3g} /"
            f" {h[name]['delta_bias_with']:.3g}"
            if "delta_bias_without" in h[name]
            else None
          ),
        ]
        for name in COMPUTATIONS
      ],
    )
  lines += ["", "## Every tie count", ""]
  lines += report.table(
    [
      "ties",
      "computation",
      "fix",
      "bias",
      "mean |err|",
      "t",
      "delta bias",
      "fix changed nothing",
    ],
    [
      [
        r["ties"],
        r["computation"],
        "on" if r["fix"] else "off",
        r["bias"],
        r["mean_abs"],
        r["t"],
        r.get("delta_bias"),
        r.get("fix_changed_nothing"),
      ]
      for r in result["records"]
    ],
  )
  lines += [
    "",
    "Paper (Qiu and Yao 2025): with repeated maxima the"
    " unnormalized P holds exact ones; over mostly negative V,"
    " rounding P V to bf16 errs in one direction; the fix (beta *"
    " r_m, or 0, as the max of a tile with ties) removes the"
    " bias. No figure is published for this experiment.",
  ]
  return "\n".join(lines) + "\n"


def plot(result: dict, out_dir: str) -> list[str]:
  """bias.png: bias (with +-2 standard errors) vs tie count, fix off / on."""
  plt = report.pyplot()
  fig, axes = plt.subplots(1, len(COMPUTATIONS), figsize=(13, 3.8), sharey=True)
  for ax, name in zip(axes, COMPUTATIONS):
    for fix, style in ((False, "o-"), (True, "s--")):
      rs = sorted(
        (
          r
          for r in result["records"]
          if r["computation"] == name and r["fix"] == fix
        ),
        key=lambda r: r["ties"],
      )
      ties = [r["ties"] for r in rs]
      bias = np.array([r["bias"] for r in rs])
      sem = np.array([abs(r["bias"] / r["t"]) if r["t"] else 0.0 for r in rs])
      ax.errorbar(
        ties,
        bias,
        yerr=2 * sem,
        fmt=style,
        capsize=3,
        label="stable_max" if fix else "plain max",
      )
    ax.axhline(0.0, color="k", lw=0.5)
    ax.set(title=name, xlabel="tied maxima per row", xscale="log")
    ax.set_xticks(
      sorted({r["ties"] for r in result["records"]}),
      [str(t) for t in sorted({r["ties"] for r in result["records"]})],
    )
    ax.minorticks_off()
    ax.grid(True, alpha=0.3)
  axes[0].set_ylabel("mean signed error (bias)")
  axes[0].legend(fontsize="small")
  fig.suptitle("repeated-max rounding bias, without and with the fix")
  return [report.save_figure(fig, out_dir, "bias.png")]
