"""What a training run shows and records: `RunLog`, a rich progress bar and a
JSONL metrics log.
More: docs/training.md#outputs
"""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import (
  BarColumn,
  MofNCompleteColumn,
  Progress,
  TextColumn,
  TimeElapsedColumn,
  TimeRemainingColumn,
)


class RunLog:
  """Progress bar, printed lines and the metrics file of one invocation."""

  def __init__(
    self,
    metrics_path: pathlib.Path,
    *,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
  ) -> None:
    """Opens the metrics file for appending.

    Args:
      metrics_path: the JSONL file.
      progress: draw a progress bar when stdout is a terminal.
      log: where text lines go; default the rich console.
    """
    self._console = Console()
    self._log = log or (
      lambda text: self._console.print(text, soft_wrap=True, highlight=False)
    )
    self._file = open(metrics_path, "a", encoding="utf-8")  # pylint: disable=consider-using-with
    self._progress = None
    self._task = None
    if progress and log is None and self._console.is_terminal:
      self._progress = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=self._console,
      )

  def _write(self, record: dict) -> None:
    self._file.write(json.dumps({**record, "time": time.time()}) + "\n")

  def record(self, record: dict) -> None:
    """Appends one record of its own (e.g. how this invocation runs)."""
    self._write(record)

  def line(self, text: str) -> None:
    """Prints one line (above the progress bar when there is one)."""
    self._log(text)

  def start(self, total: int, completed: int) -> None:
    """Shows the bar at `completed` of `total` steps."""
    if self._progress is not None:
      self._progress.start()
      self._task = self._progress.add_task(
        "train", total=total, completed=completed, status=""
      )

  def step(
    self,
    step: int,
    train_bpb: float,
    lr: float,
    grad_norm: float,
    tokens_per_s: float | None,
  ) -> None:
    """Records one training step (loss in bits per byte, the lr it used)."""
    self._write(
      {
        "step": step,
        "train_bpb": train_bpb,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_per_s": tokens_per_s,
      }
    )
    if self._task is not None:
      speed = f"{tokens_per_s:,.0f} tok/s" if tokens_per_s else "compiling"
      self._progress.update(
        self._task,
        completed=step,
        status=f"loss {train_bpb:.3f} bpb  lr {lr:.2e}  {speed}",
      )

  def eval(self, step: int, val_bpb: float) -> None:
    """Records and prints a validation loss (bits per byte)."""
    self._write({"step": step, "val_bpb": val_bpb})
    self._file.flush()
    self.line(f"step {step:>6}: val {val_bpb:.4f} bits/byte")

  def close(self) -> None:
    """Stops the progress bar and closes the metrics file."""
    if self._progress is not None:
      self._progress.stop()
    self._file.close()
