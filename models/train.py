"""Training loop of the byte-level GPT: AdamW, schedule, eval, checkpoints.

The whole optimization step (forward, backward, global-norm clipping, AdamW
with linear warmup + cosine decay) is one `jax.jit`-compiled function of a
plain pytree state `{"params", "opt_state", "step"}` (parameters split off
the nnx module with `nnx.split`), so the state is exactly what a checkpoint
holds. Runs are bitwise reproducible: the model is initialized from
`TrainConfig.seed`, the batch of step n depends only on
`(TrainConfig.data_seed, n)` (see `models.data`), and nothing else is random
(no dropout). Resuming at step n therefore gives the same losses as an
uninterrupted run.

Losses are reported in bits per byte (nats / ln 2; one token is one byte),
so a uniform guess over 256 bytes scores 8.

Example:
  >>> from models.gpt import GPTConfig
  >>> from models.train import TrainConfig, train
  >>> import tempfile
  >>> summary = train(
  ...     GPTConfig(num_layers=1, d_model=32, num_heads=2, max_seq_len=32),
  ...     TrainConfig(steps=3, batch_size=2, seq_len=32, eval_interval=3,
  ...                 eval_batches=1, max_bytes=1 << 18),
  ...     tempfile.mkdtemp(), progress=False, log=lambda line: None)
  >>> summary["final_step"]
  3
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models import data
from models.checkpoint import Checkpointer
from models.gpt import GPT, GPTConfig, count_params
from models.report import RunLog

_LN2 = math.log(2.0)  # nats per bit
# TrainConfig fields that may change when a run is resumed: they say how
# often to look at the run, not what it computes.
_RESUMABLE_FIELDS = frozenset({"eval_interval", "checkpoint_interval"})
_PROGRAM_CACHE_SIZE = 4  # compiled models kept per process (a few runs' worth)
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINT_DIR = "checkpoints"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """How to train: optimization, data and bookkeeping.

  Attributes:
    steps: optimizer steps of the whole run (the schedule's length).
    batch_size: sequences per step.
    seq_len: tokens (bytes) per sequence; `<= GPTConfig.max_seq_len`.
    lr: peak learning rate.
    warmup_steps: linear warmup from 0 to `lr`.
    min_lr_ratio: the cosine decay ends at `lr * min_lr_ratio` at `steps`.
    weight_decay: AdamW decoupled decay, applied to matrices only (not to
      norm scales or biases).
    beta1: AdamW first-moment decay.
    beta2: AdamW second-moment decay.
    grad_clip: global gradient norm clip.
    seed: model initialization seed.
    data_seed: seed of the training batch order.
    max_bytes: cap on the corpus bytes read (None: the whole stdlib).
    val_fraction: share of files in the validation split.
    eval_interval: evaluate every this many steps (and at the start and end).
    eval_batches: validation batches (of `batch_size`) per evaluation.
    checkpoint_interval: save every this many steps (0: only at the end).
  """

  steps: int = 1000
  batch_size: int = 16
  seq_len: int = 128
  lr: float = 3e-3
  warmup_steps: int = 50
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  beta1: float = 0.9
  beta2: float = 0.95
  grad_clip: float = 1.0
  seed: int = 0
  data_seed: int = 0
  max_bytes: int | None = None
  val_fraction: float = 0.05
  eval_interval: int = 100
  eval_batches: int = 8
  checkpoint_interval: int = 200

  def __post_init__(self) -> None:
    positive = (
      "steps",
      "batch_size",
      "seq_len",
      "eval_interval",
      "eval_batches",
    )
    nonnegative = ("warmup_steps", "seed", "data_seed", "checkpoint_interval")
    for name in positive + nonnegative:
      value = getattr(self, name)
      low = 1 if name in positive else 0
      if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(
          f"TrainConfig.{name} must be an int >= {low}; got {value!r}"
        )
    if self.max_bytes is not None and (
      not isinstance(self.max_bytes, int) or self.max_bytes < 1
    ):
      raise ValueError(
        f"TrainConfig.max_bytes must be None or an int >= 1;"
        f" got {self.max_bytes!r}"
      )
    checks = {
      "lr": self.lr > 0,
      "min_lr_ratio": 0 <= self.min_lr_ratio <= 1,
      "weight_decay": self.weight_decay >= 0,
      "beta1": 0 <= self.beta1 < 1,
      "beta2": 0 <= self.beta2 < 1,
      "grad_clip": self.grad_clip > 0,
      "val_fraction": 0 < self.val_fraction < 1,
    }
    for name, ok in checks.items():
      if not ok:
        raise ValueError(
          f"TrainConfig.{name} is out of range; got {getattr(self, name)!r}"
        )

  @property
  def tokens_per_step(self) -> int:
    return self.batch_size * self.seq_len

  def to_dict(self) -> dict[str, Any]:
    """A JSON-ready dict; `TrainConfig(**d)` rebuilds the config."""
    return dataclasses.asdict(self)


_DEFAULTS = TrainConfig().to_dict()
# TrainConfig fields that `build_program` does not depend on (data and
# bookkeeping; the batch shape is a jit cache key of its own).
_NOT_IN_PROGRAM = (
  "batch_size",
  "seq_len",
  "data_seed",
  "max_bytes",
  "val_fraction",
  "eval_interval",
  "eval_batches",
  "checkpoint_interval",
)


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
  """Linear warmup to `lr`, cosine decay to `lr * min_lr_ratio` at `steps`."""
  warmup = min(cfg.warmup_steps, cfg.steps - 1)
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=cfg.lr,
    warmup_steps=warmup,
    decay_steps=max(cfg.steps, warmup + 1),
    end_value=cfg.lr * cfg.min_lr_ratio,
  )


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW on the schedule (decay on matrices only)."""
  decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
  return optax.chain(
    optax.clip_by_global_norm(cfg.grad_clip),
    optax.adamw(
      learning_rate_schedule(cfg),
      b1=cfg.beta1,
      b2=cfg.beta2,
      weight_decay=cfg.weight_decay,
      mask=decay_mask,
    ),
  )


def next_byte_loss(model: GPT, tokens: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy in nats of `tokens` `[batch, seq + 1]`."""
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, tokens[:, 1:]
  ).mean()


@dataclasses.dataclass(frozen=True)
class Program:
  """The model's structure and the compiled functions of one run.

  Attributes:
    graphdef: the nnx graph of the model, without arrays.
    rest: non-parameter nnx state (held constant).
    num_params: scalar parameters.
    init_state: `() -> state`, the initialized state (deterministic).
    train_step: jitted `(state, tokens) -> (state, metrics)`; donates state.
    eval_loss: jitted `(params, tokens) -> mean loss in nats`.
    schedule: the learning-rate schedule (for logging).
  """

  graphdef: Any
  rest: Any
  num_params: int
  init_state: Callable[[], dict[str, Any]]
  train_step: Callable[..., Any]
  eval_loss: Callable[..., Any]
  schedule: optax.Schedule


def _check_seq_len(model_cfg: GPTConfig, train_cfg: TrainConfig) -> None:
  if train_cfg.seq_len > model_cfg.max_seq_len:
    raise ValueError(
      f"TrainConfig.seq_len ({train_cfg.seq_len}) exceeds"
      f" GPTConfig.max_seq_len ({model_cfg.max_seq_len})"
    )


def build_program(model_cfg: GPTConfig, train_cfg: TrainConfig) -> Program:
  """Initializes the model and its jitted step functions (compiled on first call).

  Programs are cached by the settings they depend on, so that several runs
  of one model in a process (a resume, a sweep over seeds of the data) share
  their compilations; each run still gets fresh state from `init_state`.
  """
  _check_seq_len(model_cfg, train_cfg)
  return _cached_program(
    model_cfg,
    dataclasses.replace(
      train_cfg, **{f: _DEFAULTS[f] for f in _NOT_IN_PROGRAM}
    ),
  )


@functools.lru_cache(maxsize=_PROGRAM_CACHE_SIZE)
def _cached_program(model_cfg: GPTConfig, train_cfg: TrainConfig) -> Program:
  model = GPT(model_cfg, rngs=nnx.Rngs(train_cfg.seed))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = make_optimizer(train_cfg)

  def init_state():
    fresh = jax.tree.map(jnp.copy, params)  # the step donates its input
    return {
      "params": fresh,
      "opt_state": tx.init(fresh),
      "step": jnp.zeros((), jnp.int32),
    }

  def loss_fn(p, tokens):
    return next_byte_loss(nnx.merge(graphdef, p, rest), tokens)

  @functools.partial(jax.jit, donate_argnums=0)
  def train_step(state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], tokens)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    new_state = {
      "params": optax.apply_updates(state["params"], updates),
      "opt_state": opt_state,
      "step": state["step"] + 1,
    }
    return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

  return Program(
    graphdef=graphdef,
    rest=rest,
    num_params=count_params(model),
    init_state=init_state,
    train_step=train_step,
    eval_loss=jax.jit(loss_fn),
    schedule=learning_rate_schedule(train_cfg),
  )


def evaluate(program: Program, params: Any, batches: Any) -> float:
  """Mean validation loss in bits per byte over `batches` `[n, batch, seq + 1]`."""
  losses = [program.eval_loss(params, jnp.asarray(b)) for b in batches]
  return float(jnp.mean(jnp.stack(losses))) / _LN2


def _check_resumable(
  meta: dict[str, Any],
  model_cfg: GPTConfig,
  train_cfg: TrainConfig,
  fingerprint: str,
) -> None:
  """Raises ValueError naming the first setting that differs from the checkpoint."""
  saved_model, saved_train = meta["model_config"], meta["train_config"]
  for name, value in model_cfg.to_dict().items():
    if saved_model.get(name) != value:
      raise ValueError(
        f"cannot resume: GPTConfig.{name} is {value!r} but the"
        f" checkpoint has {saved_model.get(name)!r}"
      )
  for name, value in train_cfg.to_dict().items():
    if name not in _RESUMABLE_FIELDS and saved_train.get(name) != value:
      raise ValueError(
        f"cannot resume: TrainConfig.{name} is {value!r} but"
        f" the checkpoint has {saved_train.get(name)!r}"
      )
  if meta["data"]["fingerprint"] != fingerprint:
    raise ValueError(
      f"cannot resume: the corpus changed (fingerprint"
      f" {fingerprint}, checkpoint {meta['data']['fingerprint']})"
    )


def _attention_choice(model_cfg: GPTConfig, train_cfg: TrainConfig) -> str:
  """The backend `flash_attention` runs for this model's attention calls."""
  from pallas_fa3 import backends  # pylint: disable=g-import-not-at-top
  from pallas_fa3.spec import make_spec  # pylint: disable=g-import-not-at-top

  q = jax.ShapeDtypeStruct(
    (1, train_cfg.seq_len, model_cfg.num_heads, model_cfg.head_dim),
    model_cfg.dtype,
  )
  kv = jax.ShapeDtypeStruct(
    (1, train_cfg.seq_len, model_cfg.kv_heads, model_cfg.head_dim),
    model_cfg.dtype,
  )
  spec = make_spec(q, kv, kv, causal=True)
  backend, _ = backends.resolve(spec, model_cfg.attention_implementation, None)
  backends.require_runnable_here(backend)
  return backend.name


def _meta(
  model_cfg: GPTConfig,
  train_cfg: TrainConfig,
  corpus: data.ByteCorpus,
  step: int,
  init_val_bpb: float,
) -> dict[str, Any]:
  return {
    "model_config": model_cfg.to_dict(),
    "train_config": train_cfg.to_dict(),
    "data": corpus.describe(),
    "data_rng": {"data_seed": train_cfg.data_seed, "next_step": step},
    "init_val_bpb": init_val_bpb,
  }


def train(
  model_cfg: GPTConfig,
  train_cfg: TrainConfig,
  out_dir: str | pathlib.Path,
  *,
  resume: bool = False,
  stop_at_step: int | None = None,
  progress: bool = True,
  log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
  """Trains (or resumes) a run, writing checkpoints, metrics and a summary.

  Args:
    model_cfg: the model.
    train_cfg: optimization, data and bookkeeping.
    out_dir: the run folder: `checkpoints/`, `metrics.jsonl` (one JSON line
      per step and per evaluation, appended across resumes) and
      `summary.json`.
    resume: continue from the newest checkpoint in `out_dir` (its configs
      must match, except how often to evaluate and checkpoint).
    stop_at_step: end this invocation after this step (saving a checkpoint)
      as if interrupted; the schedule still spans `train_cfg.steps`.
    progress: show a rich progress bar (only on a terminal).
    log: where text lines go; default prints to the terminal.

  Returns:
    The summary (also written to `out_dir/summary.json`), including
    `"losses"`: the training loss (bits per byte) of each step run in this
    invocation, as `{step: bpb}`.

  Raises:
    FileExistsError: `out_dir` holds checkpoints and `resume` is False.
    FileNotFoundError: `resume` is True and there is no checkpoint.
    ValueError: the checkpoint's configs or data differ from these.
  """
  start_time = time.perf_counter()
  # Fail on a bad combination before touching the output folder.
  _check_seq_len(model_cfg, train_cfg)
  backend = _attention_choice(model_cfg, train_cfg)
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  run_log = RunLog(out_dir / METRICS_FILE, progress=progress, log=log)
  corpus = data.load_stdlib_corpus(
    max_bytes=train_cfg.max_bytes, val_fraction=train_cfg.val_fraction
  )
  val = data.val_batches(
    corpus,
    num_batches=train_cfg.eval_batches,
    batch_size=train_cfg.batch_size,
    seq_len=train_cfg.seq_len,
  )
  ckpt = Checkpointer(out_dir / CHECKPOINT_DIR)
  try:
    latest = ckpt.latest_step()
    if resume:
      if latest is None:
        raise FileNotFoundError(
          f"no checkpoint under {ckpt.directory} to resume from"
        )
      meta = ckpt.read_meta(latest)
      _check_resumable(meta, model_cfg, train_cfg, corpus.fingerprint)
    elif latest is not None:
      raise FileExistsError(
        f"{out_dir} already holds checkpoints (latest step {latest}); resume"
        " it (resume=True, `pallas-fa3 train --resume`) or choose another"
        " output folder"
      )
    program = build_program(model_cfg, train_cfg)
    state = program.init_state()
    if resume:
      state, _ = ckpt.restore(latest, state)
      init_val_bpb = meta["init_val_bpb"]
      step = int(state["step"])
      run_log.line(f"resumed from step {step} of {train_cfg.steps}")
    else:
      step = 0
      init_val_bpb = evaluate(program, state["params"], val)
      run_log.eval(0, init_val_bpb)
    run_log.line(
      f"model: {program.num_params:,} params, attention {backend}, compute"
      f" {model_cfg.dtype}; data: {corpus.train.size:,} train /"
      f" {corpus.val.size:,} val bytes of {corpus.root}"
    )
    end = (
      train_cfg.steps
      if stop_at_step is None
      else min(stop_at_step, train_cfg.steps)
    )
    state, losses, timing, val_bpb = _run_steps(
      program,
      state,
      corpus,
      val,
      train_cfg,
      step,
      end,
      ckpt,
      run_log,
      lambda s: _meta(model_cfg, train_cfg, corpus, s, init_val_bpb),
    )
    if val_bpb is None:  # resumed a finished run: nothing ran
      val_bpb = evaluate(program, state["params"], val)
  finally:
    ckpt.close()
    run_log.close()
  final_step = int(state["step"])
  summary = {
    "model_config": model_cfg.to_dict(),
    "train_config": train_cfg.to_dict(),
    "num_params": program.num_params,
    "attention_backend": backend,
    "data": corpus.describe(),
    "jax_version": jax.__version__,
    "device": str(jax.devices()[0].device_kind),
    "platform": jax.default_backend(),
    "resumed": resume,
    "final_step": final_step,
    "completed": final_step == train_cfg.steps,
    "init_val_bpb": init_val_bpb,
    "final_val_bpb": val_bpb,
    "final_train_bpb": losses[max(losses)] if losses else None,
    "wall_time_s": time.perf_counter() - start_time,  # this invocation
    **timing,
  }
  (out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
  return {**summary, "losses": losses}


def _run_steps(
  program: Program,
  state: dict[str, Any],
  corpus: data.ByteCorpus,
  val: Any,
  cfg: TrainConfig,
  step: int,
  end: int,
  ckpt: Checkpointer,
  run_log: RunLog,
  meta_at: Callable[[int], dict[str, Any]],
) -> tuple[dict[str, Any], dict[int, float], dict[str, Any], float | None]:
  """Steps `step + 1 .. end`, evaluating and checkpointing on schedule."""
  losses: dict[int, float] = {}
  step_time = 0.0  # seconds in train steps, excluding the first (compilation)
  timed_steps = 0
  val_bpb = None
  batch = data.train_batch(
    corpus,
    step=step,
    data_seed=cfg.data_seed,
    batch_size=cfg.batch_size,
    seq_len=cfg.seq_len,
  )
  run_log.start(total=cfg.steps, completed=step)
  while step < end:
    tic = time.perf_counter()
    state, metrics = program.train_step(state, jnp.asarray(batch))
    # The next batch is drawn on the host while the device runs this step.
    batch = data.train_batch(
      corpus,
      step=step + 1,
      data_seed=cfg.data_seed,
      batch_size=cfg.batch_size,
      seq_len=cfg.seq_len,
    )
    metrics = jax.device_get(metrics)
    if losses:
      step_time += time.perf_counter() - tic
      timed_steps += 1
    step += 1
    losses[step] = float(metrics["loss"]) / _LN2
    tokens_per_s = (
      timed_steps * cfg.tokens_per_step / step_time if step_time else None
    )
    run_log.step(
      step,
      losses[step],
      float(program.schedule(step - 1)),
      float(metrics["grad_norm"]),
      tokens_per_s,
    )
    if step % cfg.eval_interval == 0 or step == end:
      val_bpb = evaluate(program, state["params"], val)
      run_log.eval(step, val_bpb)
    if step == end or (
      cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0
    ):
      ckpt.save(step, state, meta_at(step))
  timing = {
    "train_steps_timed": timed_steps,
    "train_step_time_s": step_time,
    "tokens_per_s": (
      timed_steps * cfg.tokens_per_step / step_time if step_time else None
    ),
  }
  return state, losses, timing, val_bpb
