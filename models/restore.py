"""A trained GPT from a `pallas-fa3 train --out DIR` run, for inference:
`load_model(path)` takes the run folder, its checkpoint folder or one
checkpoint, and rebuilds the model from the configs stored there.
More: docs/generation.md#from-python

Example:
  >>> model, info = load_model("runs/train")  # doctest: +SKIP
  >>> info["step"], model.cfg.num_layers  # doctest: +SKIP
  (1000, 4)
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

from flax import nnx

from models.checkpoint import Checkpointer
from models.gpt import GPT, GPTConfig
from models.step import TrainConfig, build_program
from models.train import CHECKPOINT_DIR


def find_checkpoint(
  path: str | pathlib.Path,
) -> tuple[pathlib.Path, int | None]:
  """`(checkpoint folder, step or None for the newest)` named by `path`.

  Raises:
    FileNotFoundError: `path` is none of the three, saying what it holds.
  """
  path = pathlib.Path(path)
  if not path.is_dir():
    raise FileNotFoundError(f"--checkpoint {path}: no such folder")
  if (path / CHECKPOINT_DIR).is_dir():
    return path / CHECKPOINT_DIR, None
  if path.name.isdigit() and path.parent.is_dir():
    return path.parent, int(path.name)
  if any(p.name.isdigit() for p in path.iterdir() if p.is_dir()):
    return path, None
  raise FileNotFoundError(
    f"--checkpoint {path} is neither a run folder (with {CHECKPOINT_DIR}/),"
    " a checkpoint folder (with numbered steps) nor one step's checkpoint"
  )


def _config(cls: type, saved: dict[str, Any]) -> Any:
  """`cls(**saved)`, ignoring fields this version does not have."""
  names = {f.name for f in dataclasses.fields(cls)}
  return cls(**{k: v for k, v in saved.items() if k in names})


def load_model(
  path: str | pathlib.Path,
  *,
  dtype: str | None = None,
  max_seq_len: int | None = None,
  implementation: str | None = "auto",
) -> tuple[GPT, dict[str, Any]]:
  """The trained model of a run, and what was loaded.

  Args:
    path: the run folder, its checkpoint folder, or one step's folder.
    dtype: compute dtype ("float32" or "bfloat16"; None: the trained one).
      Parameters are stored in their own dtype either way.
    max_seq_len: a longer `max_seq_len` for a RoPE model (its parameters do
      not depend on it; positions past the trained length are the model's
      extrapolation); a learned position table cannot grow.
    implementation: the attention backend; "auto" keeps the trained one.

  Returns:
    `(model, info)`, info with `step`, `checkpoint` (the folder) and
    `model_config` (the config used).

  Raises:
    FileNotFoundError: no checkpoint at `path`.
    ValueError: a longer `max_seq_len` for a learned position table.
  """
  folder, step = find_checkpoint(path)
  ckpt = Checkpointer(folder)
  try:
    step = ckpt.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {folder}")
    meta = ckpt.read_meta(step)
    model_cfg = _config(GPTConfig, meta["model_config"])
    train_cfg = _config(TrainConfig, meta["train_config"])
    target = build_program(model_cfg, train_cfg).init_state()
    state, _ = ckpt.restore(step, target)
  finally:
    ckpt.close()
  changes: dict[str, Any] = {}
  if dtype is not None:
    changes["dtype"] = dtype
  if implementation != "auto":
    changes["attention_implementation"] = implementation
  if max_seq_len is not None and max_seq_len > model_cfg.max_seq_len:
    if model_cfg.position == "learned":
      raise ValueError(
        f"max_seq_len {max_seq_len}: the model's learned position table has"
        f" {model_cfg.max_seq_len} rows"
      )
    changes["max_seq_len"] = max_seq_len
  cfg = dataclasses.replace(model_cfg, **changes)
  model = GPT(cfg, rngs=nnx.Rngs(0))
  nnx.update(model, state["params"])
  return model, {"step": step, "checkpoint": folder, "model_config": cfg}
