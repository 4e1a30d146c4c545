"""A MeanFlow training step (Geng et al. 2025, arXiv 2505.13447) for the
GPT-style blocks of `models.gpt` on a toy continuous target: `FlowNet`
maps a noisy sequence `z_t` and two times `(r, t)` to the average velocity
`u(z_t, r, t)`, and the loss regresses it on
`v - (t - r) du/dt` with `du/dt = jvp(u, (z_t, r, t), (v, 0, 1))` under
`stop_gradient`: forward-mode differentiation through every attention
layer (`pallas_fa3.flash_attention`), then `jax.grad` of the whole.
One-step sampling is `x = e - u(e, 0, 1)`.
More: docs/training.md#meanflow-jvp-through-every-attention-layer

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from models.meanflow import FlowNet, MeanFlowConfig
  >>> cfg = MeanFlowConfig(seq_len=8, num_layers=1, d_model=16)
  >>> model = FlowNet(cfg, rngs=nnx.Rngs(0))
  >>> model(jnp.zeros((2, 8, 2)), jnp.zeros(2), jnp.ones(2)).shape
  (2, 8, 2)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models.gpt import Block, GPTConfig

# Sinusoidal features per time input, at frequencies 1 .. _MAX_FREQ: low,
# since du/dt (the jvp along t) scales with them.
_TIME_FREQS = 8
_MAX_FREQ = 8.0


@dataclasses.dataclass(frozen=True)
class MeanFlowConfig:
  """The toy run: model size, data and optimization.

  Attributes:
    steps: optimizer steps.
    batch_size: sequences per step.
    seq_len: positions per sequence.
    channels: values per position (the data's feature dimension).
    num_layers, d_model, num_heads: the transformer (`GPTConfig`'s).
    lr: AdamW learning rate.
    equal_times: share of the batch with r = t (plain flow matching), as
      the paper's 75 %.
    seed: initialization and data seed.
    implementation: `flash_attention`'s backend (None: automatic).
  """

  steps: int = 200
  batch_size: int = 16
  seq_len: int = 32
  channels: int = 2
  num_layers: int = 2
  d_model: int = 64
  num_heads: int = 4
  lr: float = 1e-3
  equal_times: float = 0.75
  seed: int = 0
  implementation: str | None = None

  def gpt_config(self) -> GPTConfig:
    return GPTConfig(
      num_layers=self.num_layers,
      d_model=self.d_model,
      num_heads=self.num_heads,
      max_seq_len=self.seq_len,
      dtype="float32",
      attention_implementation=self.implementation,
    )


def _time_features(x: jax.Array) -> jax.Array:
  """`[b]` times in [0, 1] -> `[b, 2 * _TIME_FREQS]` sin/cos features."""
  freqs = jnp.exp(jnp.linspace(0.0, math.log(_MAX_FREQ), _TIME_FREQS))
  angles = x[:, None] * freqs[None, :]
  return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class FlowNet(nnx.Module):
  """`u(z, r, t)`: `[b, seq, channels]`, `[b]`, `[b]` -> `[b, seq, channels]`,
  the GPT blocks (causal attention by `pallas_fa3.flax`) between an input
  and an output projection, the times added to every position."""

  def __init__(self, cfg: MeanFlowConfig, *, rngs: nnx.Rngs) -> None:
    gpt = cfg.gpt_config()
    self.embed = nnx.Linear(cfg.channels, cfg.d_model, rngs=rngs)
    self.pos = nnx.Param(
      nnx.initializers.normal(0.02)(rngs.params(), (cfg.seq_len, cfg.d_model))
    )
    self.times = nnx.Linear(4 * _TIME_FREQS, cfg.d_model, rngs=rngs)
    self.blocks = nnx.List(
      [Block(gpt, i, rngs=rngs) for i in range(cfg.num_layers)]
    )
    self.norm = nnx.LayerNorm(cfg.d_model, rngs=rngs)
    self.out = nnx.Linear(cfg.d_model, cfg.channels, rngs=rngs)

  def __call__(self, z: jax.Array, r: jax.Array, t: jax.Array) -> jax.Array:
    time = self.times(
      jnp.concatenate([_time_features(t), _time_features(t - r)], axis=-1)
    )
    x = self.embed(z) + self.pos[...][None] + time[:, None, :]
    for block in self.blocks:
      x = block(x)
    return self.out(self.norm(x))


def toy_batch(key: jax.Array, cfg: MeanFlowConfig) -> jax.Array:
  """`[batch, seq_len, channels]` smooth signals: sines of random
  frequency and phase per sequence and channel (the data distribution)."""
  kf, kp = jax.random.split(key)
  shape = (cfg.batch_size, 1, cfg.channels)
  freq = jax.random.uniform(kf, shape, minval=1.0, maxval=3.0)
  phase = jax.random.uniform(kp, shape, maxval=2 * math.pi)
  pos = jnp.linspace(0.0, 2 * math.pi, cfg.seq_len)[None, :, None]
  return jnp.sin(freq * pos + phase)


def meanflow_loss(
  model: FlowNet, x: jax.Array, key: jax.Array, equal_times: float
) -> jax.Array:
  """The MeanFlow loss of one batch `x` (the data): `z_t = (1 - t) x + t e`,
  `v = e - x`, target `v - (t - r) du/dt` under stop_gradient, where
  `du/dt` is the jvp of `u` along `(v, 0, 1)`."""
  ke, kt, kr, km = jax.random.split(key, 4)
  b = x.shape[0]
  e = jax.random.normal(ke, x.shape)
  t = jax.random.uniform(kt, (b,))
  r = jax.random.uniform(kr, (b,)) * t
  r = jnp.where(jax.random.uniform(km, (b,)) < equal_times, t, r)
  z = (1.0 - t)[:, None, None] * x + t[:, None, None] * e
  v = e - x
  u, du_dt = jax.jvp(model, (z, r, t), (v, jnp.zeros_like(r), jnp.ones_like(t)))
  target = jax.lax.stop_gradient(v - (t - r)[:, None, None] * du_dt)
  return jnp.mean((u - target) ** 2)


def make_step(cfg: MeanFlowConfig, optimizer: nnx.Optimizer):
  """The jitted optimization step `(model, optimizer, key) -> loss`."""

  @nnx.jit
  def step(model: FlowNet, optimizer: nnx.Optimizer, key: jax.Array):
    kx, kl = jax.random.split(key)
    x = toy_batch(kx, cfg)
    loss, grads = nnx.value_and_grad(meanflow_loss)(
      model, x, kl, cfg.equal_times
    )
    optimizer.update(model, grads)
    return loss

  return step


def train_meanflow(cfg: MeanFlowConfig) -> tuple[FlowNet, list[float]]:
  """Trains `FlowNet` on `toy_batch` data for `cfg.steps`; returns the
  model and the per-step losses."""
  model = FlowNet(cfg, rngs=nnx.Rngs(cfg.seed))
  optimizer = nnx.Optimizer(model, optax.adamw(cfg.lr), wrt=nnx.Param)
  step = make_step(cfg, optimizer)
  key = jax.random.key(cfg.seed + 1)
  losses = []
  for i in range(cfg.steps):
    losses.append(float(step(model, optimizer, jax.random.fold_in(key, i))))
  return model, losses


def one_step_samples(model: FlowNet, key: jax.Array, cfg: MeanFlowConfig):
  """Samples in one network evaluation: `e - u(e, 0, 1)`."""
  e = jax.random.normal(key, (cfg.batch_size, cfg.seq_len, cfg.channels))
  b = jnp.zeros((cfg.batch_size,))
  return e - model(e, b, b + 1.0)


def sample_error(model: FlowNet, cfg: MeanFlowConfig) -> float:
  """How far one-step samples are from the data's family: the mean
  squared distance of each sample to its nearest of 512 data draws."""
  samples = one_step_samples(model, jax.random.key(cfg.seed + 2), cfg)
  ref_cfg = dataclasses.replace(cfg, batch_size=512)
  data = toy_batch(jax.random.key(cfg.seed + 3), ref_cfg)
  d = ((samples[:, None] - data[None]) ** 2).mean(axis=(2, 3))
  return float(np.asarray(d.min(axis=1)).mean())
