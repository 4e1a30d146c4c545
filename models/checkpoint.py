"""Orbax checkpoints of the training state: `Checkpointer` saves, by step and
synchronously, the arrays (`state`) and a JSON `meta` item, and restores
them into the structure of a freshly initialized run.
More: docs/training.md#the-step-the-loop-and-checkpoints

Example:
  >>> import jax.numpy as jnp, tempfile
  >>> from models.checkpoint import Checkpointer
  >>> ckpt = Checkpointer(tempfile.mkdtemp() + "/ckpt")
  >>> ckpt.save(2, {"w": jnp.ones(3)}, {"note": "hi"})
  >>> state, meta = ckpt.restore_latest({"w": jnp.zeros(3)})
  >>> float(state["w"].sum()), meta["note"]
  (3.0, 'hi')
  >>> ckpt.close()
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp

_MAX_TO_KEEP = 2  # the latest checkpoint plus one in case the last save breaks


class Checkpointer:
  """Saves and restores `(state, meta)` pairs under one folder, by step."""

  def __init__(
    self, directory: str | pathlib.Path, *, max_to_keep: int = _MAX_TO_KEEP
  ) -> None:
    """Opens (creating if needed) a checkpoint folder.

    Args:
      directory: the folder; each step becomes a subfolder.
      max_to_keep: older checkpoints beyond this many are deleted.
    """
    self.directory = pathlib.Path(directory).absolute()
    options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, enable_async_checkpointing=False, create=True
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    """The newest saved step, or None when the folder holds none."""
    return self._manager.latest_step()

  def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
    """Writes the checkpoint of `step` (blocking until it is on disk)."""
    self._manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
      ),
      force=True,
    )
    self._manager.wait_until_finished()

  def restore(self, step: int, target: Any) -> tuple[Any, dict[str, Any]]:
    """Reads the checkpoint of `step`.

    Args:
      step: a saved step.
      target: a state of the same structure (arrays or
        `jax.ShapeDtypeStruct`s), e.g. a freshly initialized one.

    Returns:
      `(state, meta)`, state with `target`'s tree structure.
    """
    abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=getattr(x, "sharding", None)
      ),
      target,
    )
    restored = self._manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
      ),
    )
    return restored["state"], restored["meta"]

  def read_meta(self, step: int) -> dict[str, Any]:
    """The JSON item of the checkpoint of `step` (no arrays are read)."""
    restored = self._manager.restore(
      step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
    )
    return restored["meta"]

  def restore_latest(self, target: Any) -> tuple[Any, dict[str, Any]]:
    """`restore` of the newest step; FileNotFoundError when there is none."""
    step = self.latest_step()
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {self.directory}")
    return self.restore(step, target)

  def close(self) -> None:
    """Waits for pending work and releases the checkpoint manager."""
    self._manager.close()
