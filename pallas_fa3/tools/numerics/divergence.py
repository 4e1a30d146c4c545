"""`pallas-fa3 numerics divergence`: how far training runs drift apart, after
the training study of Golden et al. 2024 (arXiv 2405.02803). The GPT of
`models/` trained four times from one data order (reference bf16, flash,
another initialization, float32), each run's parameters compared with the
reference's every `interval` steps (max |dW|, Wasserstein-1) and the
growth fitted; the markdown and plots are in `divergence_report`:
docs/numerics.md#divergence.
"""

from __future__ import annotations

import dataclasses
import numbers
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_fa3.spec import check_int
from pallas_fa3.tools import example_models
from pallas_fa3.tools.numerics import metrics, report

RUNS = {
  "R0": "reference attention, bf16 compute (float32 inside attention):"
  " the baseline",
  "R1": "flash attention, otherwise R0",
  "R2": "R0 with a different initialization seed",
  "R3": "R0 in float32 compute (R0 - R3: low-precision compute)",
}
COMPARED = ("R1", "R2", "R3")
METRICS = ("max_abs", "w1")  # aggregated: max over tensors, size-weighted mean
# Golden et al.: flash's weight deviation grows 2-5x slower than FP16 vs
# FP32 training's.
PAPER_LOWPREC_RANGE = (2.0, 5.0)
_IMPLS = ("auto", "blockwise", "mosaic", "interpret")


@dataclasses.dataclass(frozen=True)
class DivergenceConfig:
  """The four runs' model and schedule (CPU default: a few minutes).

  Attributes:
    steps: optimizer steps of every run.
    interval: compare the runs every this many steps (and at step 0).
    layers, d_model, heads, seq_len, batch: the GPT and its batches.
    lr, warmup_steps: peak learning rate and warmup (cosine decay after).
    seed: initialization seed of R0, R1, R3 (R2 uses seed + 1).
    data_seed: the shared batch order.
    max_bytes: corpus bytes read (None: the whole stdlib).
    flash_implementation: R1's backend ("auto": the automatic choice).
  """

  steps: int = 1000
  interval: int = 20
  layers: int = 2
  d_model: int = 64
  heads: int = 2
  seq_len: int = 128
  batch: int = 8
  lr: float = 3e-3
  warmup_steps: int = 50
  seed: int = 0
  data_seed: int = 0
  max_bytes: int | None = 1 << 22
  flash_implementation: str = "auto"

  def __post_init__(self):
    for name in (
      "steps",
      "interval",
      "layers",
      "d_model",
      "heads",
      "seq_len",
      "batch",
      "warmup_steps",
      "seed",
      "data_seed",
    ):
      value = getattr(self, name)
      low = 0 if name in ("warmup_steps", "seed", "data_seed") else 1
      check_int(f"DivergenceConfig.{name}", value, minimum=low)
    if self.interval > self.steps:
      raise ValueError(
        f"DivergenceConfig.interval ({self.interval}) must be"
        f" <= steps ({self.steps})"
      )
    if not (isinstance(self.lr, numbers.Real) and self.lr > 0):
      raise ValueError(f"DivergenceConfig.lr must be > 0; got {self.lr!r}")
    if self.flash_implementation not in _IMPLS:
      raise ValueError(
        f"DivergenceConfig.flash_implementation must be one of"
        f" {_IMPLS}; got {self.flash_implementation!r}"
      )
    self.model_configs()  # GPTConfig validates the model's shape

  def model_configs(self):
    """{run: (GPTConfig, TrainConfig)} of the four runs."""
    example_models.load("pallas-fa3 numerics divergence")
    from models.gpt import GPTConfig  # pylint: disable=g-import-not-at-top
    from models.step import TrainConfig  # pylint: disable=g-import-not-at-top

    flash = (
      None if self.flash_implementation == "auto" else self.flash_implementation
    )
    model = GPTConfig(
      num_layers=self.layers,
      d_model=self.d_model,
      num_heads=self.heads,
      max_seq_len=self.seq_len,
      dtype="bfloat16",
      attention_implementation="reference",
    )
    train = TrainConfig(
      steps=self.steps,
      batch_size=self.batch,
      seq_len=self.seq_len,
      lr=self.lr,
      warmup_steps=self.warmup_steps,
      seed=self.seed,
      data_seed=self.data_seed,
      max_bytes=self.max_bytes,
      eval_interval=self.steps,
      checkpoint_interval=0,
    )
    return {
      "R0": (model, train),
      "R1": (dataclasses.replace(model, attention_implementation=flash), train),
      "R2": (model, dataclasses.replace(train, seed=self.seed + 1)),
      "R3": (dataclasses.replace(model, dtype="float32"), train),
    }

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


GPU_DEFAULT = DivergenceConfig(
  steps=3000,
  interval=50,
  layers=4,
  d_model=256,
  heads=4,
  seq_len=512,
  batch=32,
  max_bytes=None,
)


def _attention_backend(model_cfg, seq_len: int) -> str:
  """The backend flash_attention runs for this model (as models.train does)."""
  from pallas_fa3 import backends  # pylint: disable=g-import-not-at-top
  from pallas_fa3.spec import make_spec  # pylint: disable=g-import-not-at-top

  q = jax.ShapeDtypeStruct(
    (1, seq_len, model_cfg.num_heads, model_cfg.head_dim), model_cfg.dtype
  )
  spec = make_spec(q, q, q, causal=True)
  return backends.resolve(spec, model_cfg.attention_implementation, None)[
    0
  ].name


def _path_name(path) -> str:
  """`blocks.0.attn.query.kernel` from a pytree key path."""
  parts = []
  for key in path:
    for attr in ("key", "idx", "name"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
  return ".".join(p for p in parts if p != "value")


def _named_leaves(params) -> list[tuple[str, np.ndarray]]:
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  return [(_path_name(path), np.asarray(x, np.float64)) for path, x in leaves]


def compare(params_a, params_b) -> dict[str, Any]:
  """Per-tensor max |a - b| and W1(a, b), and their aggregates."""
  a, b = _named_leaves(params_a), _named_leaves(params_b)
  tensors = {}
  for (name, x), (name_b, y) in zip(a, b):
    assert name == name_b, (name, name_b)
    tensors[name] = {
      "size": int(x.size),
      "max_abs": metrics.max_abs_diff(x, y),
      "w1": metrics.wasserstein_1(x, y),
    }
  sizes = np.array([t["size"] for t in tensors.values()], np.float64)
  return {
    "max_abs": max(t["max_abs"] for t in tensors.values()),
    "w1": float(
      np.dot(sizes, [t["w1"] for t in tensors.values()]) / sizes.sum()
    ),
    "tensors": tensors,
  }


def run(cfg: DivergenceConfig, *, progress: bool = True) -> dict:
  """Trains the four runs in lockstep, comparing them every `interval` steps."""
  example_models.load("pallas-fa3 numerics divergence")
  example_models.require_train_extra("pallas-fa3 numerics divergence")
  from models import data  # pylint: disable=g-import-not-at-top
  from models.step import build_program  # pylint: disable=g-import-not-at-top

  start = time.perf_counter()
  configs = cfg.model_configs()
  corpus = data.load_stdlib_corpus(max_bytes=cfg.max_bytes)
  programs = {r: build_program(*mc) for r, mc in configs.items()}
  states = {r: p.init_state() for r, p in programs.items()}
  backends_used = {
    r: _attention_backend(mc[0], cfg.seq_len) for r, mc in configs.items()
  }
  samples, losses = [], {r: [] for r in configs}

  def sample(step):
    samples.append(
      {
        "step": step,
        **{
          r: compare(states[r]["params"], states["R0"]["params"])
          for r in COMPARED
        },
      }
    )

  sample(0)
  with report.progress(cfg.steps, "divergence", progress) as advance:
    for step in range(cfg.steps):
      batch = jnp.asarray(
        data.train_batch(
          corpus,
          step=step,
          data_seed=cfg.data_seed,
          batch_size=cfg.batch,
          seq_len=cfg.seq_len,
        )
      )
      for r, program in programs.items():
        states[r], m = program.train_step(states[r], batch)
        losses[r].append(m["loss"])
      if (step + 1) % cfg.interval == 0 or step + 1 == cfg.steps:
        sample(step + 1)
      advance(f"step {step + 1}")
  # Losses in bits per byte, one per step (fetched once at the end).
  losses = {
    r: (np.asarray(jax.device_get(v)) / np.log(2.0)).tolist()
    for r, v in losses.items()
  }
  result = {
    "runs": RUNS,
    "backends": backends_used,
    "num_params": programs["R0"].num_params,
    "samples": samples,
    "train_bpb": losses,
    "wall_s": time.perf_counter() - start,
  }
  result["slopes"] = slopes(samples)
  result["ratios"] = ratios(result["slopes"], samples)
  result["verdicts"] = verdicts(result["ratios"])
  return result


def slopes(samples: list[dict]) -> dict[str, Any]:
  """Least-squares slope per step of each aggregated and per-tensor curve."""
  steps = [s["step"] for s in samples]
  out = {}
  for r in COMPARED:
    agg = {
      m: metrics.fit_line(steps, [s[r][m] for s in samples])[0] for m in METRICS
    }
    names = samples[0][r]["tensors"]
    per = {
      name: {
        m: metrics.fit_line(steps, [s[r]["tensors"][name][m] for s in samples])[
          0
        ]
        for m in METRICS
      }
      for name in names
    }
    out[r] = {**agg, "tensors": per}
  return out


def ratios(sl: dict[str, Any], samples: list[dict]) -> dict[str, Any]:
  """R3 and R2 against R1, per metric.

  aggregate: slope ratio of the aggregated curves (the paper's comparison);
  tensor_median: median over tensors of the per-tensor slope ratios;
  mean: ratio of the curves' means over all comparisons; first: ratio at
  the first comparison after step 0 (the early, exponential phase).
  """
  out = {}
  later = [s for s in samples if s["step"] > 0]
  for other in ("R3", "R2"):
    for m in METRICS:
      per = [
        metrics.ratio(sl[other]["tensors"][n][m], sl["R1"]["tensors"][n][m])
        for n in sl["R1"]["tensors"]
      ]
      per = [x for x in per if x is not None]
      out[f"{other}/R1 {m}"] = {
        "aggregate": metrics.ratio(sl[other][m], sl["R1"][m]),
        "tensor_median": statistics.median(per) if per else None,
        "mean": metrics.ratio(
          np.mean([s[other][m] for s in later]),
          np.mean([s["R1"][m] for s in later]),
        ),
        "first": metrics.ratio(later[0][other][m], later[0]["R1"][m]),
      }
  return out


def verdicts(rat: dict[str, Any]) -> list[dict]:
  """The paper's two claims, judged on the aggregated W1 and max |dW| slopes."""
  lo, hi = PAPER_LOWPREC_RANGE
  out = []
  for m in METRICS:
    x = rat[f"R3/R1 {m}"]["aggregate"]
    if x is None:
      v = "not measured"
    elif lo <= x <= hi:
      v = "reproduced"
    elif x > 1:
      v = "partly reproduced (flash deviates less, by a different factor)"
    else:
      v = "not reproduced"
    out.append(
      dict(claim=f"slope(R3) / slope(R1), {m}", paper="2-5x", ours=x, verdict=v)
    )
    y = rat[f"R2/R1 {m}"]["aggregate"]
    out.append(
      dict(
        claim=f"flash at or below the different-init bound"
        f" (slope(R2) / slope(R1) >= 1), {m}",
        paper="yes",
        ours=y,
        verdict="not measured"
        if y is None
        else "reproduced"
        if y >= 1
        else "not reproduced",
      )
    )
  return out
