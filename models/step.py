"""`TrainConfig` and the compiled training program of the byte-level GPT:
`build_program` gives the one jitted optimization step (AdamW, warmup +
cosine decay, global-norm clipping) over a plain pytree state, `evaluate`
the validation loss in bits per byte.
More: docs/training.md#the-step-the-loop-and-checkpoints
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models import packing
from models.gpt import GPT, GPTConfig, count_params

LN2 = math.log(2.0)  # nats per bit
_PROGRAM_CACHE_SIZE = 4  # compiled models kept per process (a few runs' worth)


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
    packed: train on packed batches (`models.packing`): stdlib files side by
      side in a row, attention and loss kept within each file.
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
  packed: bool = False

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
    if not isinstance(self.packed, bool):
      raise ValueError(
        f"TrainConfig.packed must be True or False; got {self.packed!r}"
      )
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


def packed_next_byte_loss(model: GPT, batch: packing.PackedBatch) -> jax.Array:
  """Mean next-token cross-entropy in nats over the targets that
  `packing.loss_mask` counts (within a document) of a packed batch."""
  logits = model(
    batch.tokens[:, :-1],
    segment_ids=batch.segment_ids[:, :-1],
    positions=batch.positions[:, :-1],
  )
  loss = optax.softmax_cross_entropy_with_integer_labels(
    logits, batch.tokens[:, 1:]
  )
  mask = packing.loss_mask(batch.segment_ids)
  count = jnp.maximum(jnp.sum(mask), 1)
  return jnp.sum(jnp.where(mask, loss, 0.0)) / count


@dataclasses.dataclass(frozen=True)
class Program:
  """The model's structure and the compiled functions of one run.

  Attributes:
    graphdef: the nnx graph of the model, without arrays.
    rest: non-parameter nnx state (held constant).
    num_params: scalar parameters.
    init_state: `() -> state`, the initialized state (deterministic).
    train_step: jitted `(state, batch) -> (state, metrics)`; donates state.
      The batch is tokens `[batch, seq + 1]`, or a `PackedBatch` if packed.
    eval_loss: jitted `(params, batch) -> mean loss in nats`.
    packed: whether the functions take packed batches.
    schedule: the learning-rate schedule (for logging).
  """

  graphdef: Any
  rest: Any
  num_params: int
  init_state: Callable[[], dict[str, Any]]
  train_step: Callable[..., Any]
  eval_loss: Callable[..., Any]
  schedule: optax.Schedule
  packed: bool = False


def check_seq_len(model_cfg: GPTConfig, train_cfg: TrainConfig) -> None:
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
  check_seq_len(model_cfg, train_cfg)
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

  batch_loss = packed_next_byte_loss if train_cfg.packed else next_byte_loss

  def loss_fn(p, tokens):
    return batch_loss(nnx.merge(graphdef, p, rest), tokens)

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
    packed=train_cfg.packed,
  )


def evaluate(program: Program, params: Any, batches: Any) -> float:
  """Mean validation loss in bits per byte over `batches` `[n, batch, seq + 1]`
  (a `PackedBatch` of such arrays if packed: the mean over its counted
  targets, each batch weighted by its count)."""
  if not program.packed:
    losses = [program.eval_loss(params, jnp.asarray(b)) for b in batches]
    return float(jnp.mean(jnp.stack(losses))) / LN2
  total, count = 0.0, 0
  for i in range(batches.tokens.shape[0]):
    batch = packing.PackedBatch(*(jnp.asarray(x[i]) for x in batches))
    n = int(np.sum(packing.loss_mask(np.asarray(batches.segment_ids[i]))))
    total += float(program.eval_loss(params, batch)) * n
    count += n
  return total / max(count, 1) / LN2
