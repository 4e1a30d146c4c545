"""Training loop of the byte-level GPT: `train()` runs the jitted step of
`models.step` over the batches of `models.data` (or `models.packing`), with
evaluation, checkpoints and bitwise-reproducible resume.
More: docs/training.md#the-step-the-loop-and-checkpoints

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

import json
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from models import data, packing
from models.checkpoint import Checkpointer
from models.gpt import GPTConfig
from models.report import RunLog
from models.step import (
  LN2,
  Program,
  TrainConfig,
  build_program,
  check_seq_len,
  evaluate,
)

# TrainConfig fields that may change when a run is resumed: they say how
# often to look at the run, not what it computes.
_RESUMABLE_FIELDS = frozenset({"eval_interval", "checkpoint_interval"})
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINT_DIR = "checkpoints"


def _check_resumable(
  meta: dict[str, Any],
  model_cfg: GPTConfig,
  train_cfg: TrainConfig,
  fingerprint: str,
) -> None:
  """Raises ValueError naming the first setting that differs from the checkpoint."""
  saved_model, saved_train = meta["model_config"], meta["train_config"]
  # A field newer than the checkpoint has its default there (e.g. the
  # attention variants, which older runs did not use).
  defaults = GPTConfig().to_dict()
  train_defaults = TrainConfig().to_dict()
  for name, value in model_cfg.to_dict().items():
    saved = saved_model.get(name, defaults[name])
    if saved != value:
      raise ValueError(
        f"cannot resume: GPTConfig.{name} is {value!r} but the"
        f" checkpoint has {saved!r}"
      )
  for name, value in train_cfg.to_dict().items():
    saved = saved_train.get(name, train_defaults[name])
    if name not in _RESUMABLE_FIELDS and saved != value:
      raise ValueError(
        f"cannot resume: TrainConfig.{name} is {value!r} but"
        f" the checkpoint has {saved!r}"
      )
  if meta["data"]["fingerprint"] != fingerprint:
    raise ValueError(
      f"cannot resume: the corpus changed (fingerprint"
      f" {fingerprint}, checkpoint {meta['data']['fingerprint']})"
    )


def _attention_choice(model_cfg: GPTConfig, train_cfg: TrainConfig) -> str:
  """The backend `flash_attention` runs for this model's attention calls
  (the distinct ones in block order, comma-separated, if blocks differ)."""
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
  names: list[str] = []
  for layer in range(model_cfg.num_layers):
    window = model_cfg.layer_window(layer)
    spec = make_spec(
      q,
      kv,
      kv,
      causal=True,
      window_size=None if window is None else (window, None),
      softcap=model_cfg.softcap,
      sinks=model_cfg.sinks,
      segmented=train_cfg.packed,
    )
    backend, _ = backends.resolve(
      spec, model_cfg.attention_implementation, None
    )
    backends.require_runnable_here(backend)
    if backend.name not in names:
      names.append(backend.name)
  return ", ".join(names)


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
  check_seq_len(model_cfg, train_cfg)
  backend = _attention_choice(model_cfg, train_cfg)
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  run_log = RunLog(out_dir / METRICS_FILE, progress=progress, log=log)
  corpus = data.load_stdlib_corpus(
    max_bytes=train_cfg.max_bytes, val_fraction=train_cfg.val_fraction
  )
  val = (packing.packed_val_batches if train_cfg.packed else data.val_batches)(
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
    run_log.record({"step": step, "run": {"packed": train_cfg.packed}})
    if not resume:
      init_val_bpb = evaluate(program, state["params"], val)
      run_log.eval(0, init_val_bpb)
    run_log.line(
      f"model: {program.num_params:,} params, attention {backend}, compute"
      f" {model_cfg.dtype}; data: {corpus.train.size:,} train /"
      f" {corpus.val.size:,} val bytes of {corpus.root}"
      + (", packed" if train_cfg.packed else "")
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
    "packed": train_cfg.packed,
    "final_step": final_step,
    "completed": final_step == train_cfg.steps,
    "init_val_bpb": init_val_bpb,
    "final_val_bpb": val_bpb,
    "final_train_bpb": losses[max(losses)] if losses else None,
    "wall_time_s": time.perf_counter() - start_time,  # this invocation
    **timing,
  }
  if train_cfg.packed:  # how full the rows were (train: this invocation)
    val_fraction = packing.packing_stats(val)["target_fraction"]
    summary["packing"]["val_target_fraction"] = val_fraction
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
  draw = packing.packed_train_batch if cfg.packed else data.train_batch
  batch_at = lambda s: draw(
    corpus,
    step=s,
    data_seed=cfg.data_seed,
    batch_size=cfg.batch_size,
    seq_len=cfg.seq_len,
  )
  stats: list[dict[str, float]] = []  # packed batches only
  batch = batch_at(step)
  run_log.start(total=cfg.steps, completed=step)
  while step < end:
    tic = time.perf_counter()
    state, metrics = program.train_step(state, jax.tree.map(jnp.asarray, batch))
    if cfg.packed:
      stats.append(packing.packing_stats(batch))
    # The next batch is drawn on the host while the device runs this step.
    batch = batch_at(step + 1)
    metrics = jax.device_get(metrics)
    if losses:
      step_time += time.perf_counter() - tic
      timed_steps += 1
    step += 1
    losses[step] = float(metrics["loss"]) / LN2
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
  if cfg.packed:
    timing["packing"] = {
      f"train_{name}": (
        sum(x[name] for x in stats) / len(stats) if stats else None
      )
      for name in ("segments_per_row", "target_fraction")
    }
  return state, losses, timing, val_bpb
