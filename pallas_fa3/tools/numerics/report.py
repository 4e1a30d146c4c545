"""What every numerics study writes: the environment header, `results.json`
(the study's settings and every measured figure), `summary.md` (tables with
our numbers next to the published ones), `plots/*.png`, and the progress
bar: docs/numerics.md#the-studies.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from pallas_fa3.tools.bench import (
  report as bench_report,
  runner as bench_runner,
)

JSON_FILE = "results.json"
MARKDOWN_FILE = "summary.md"
PLOTS_DIR = "plots"


def environment(study: str, argv: Sequence[str] | None = None) -> dict:
  """Device, versions, date, git commit and the command of this run."""
  env = bench_runner.environment([])
  args = list(sys.argv[3:] if argv is None else argv)
  env["command"] = shlex.join(["pallas-fa3", "numerics", study] + args)
  return env


def _jsonable(x: Any) -> Any:
  """Non-finite floats become strings ("inf", "nan"): strict JSON."""
  if isinstance(x, float) and not math.isfinite(x):
    return str(x)
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  return x


def write_json(out_dir: str, result: dict) -> str:
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, JSON_FILE)
  with open(path, "w") as f:
    json.dump(_jsonable(result), f, indent=1, allow_nan=False)
    f.write("\n")
  return path


def write_markdown(out_dir: str, text: str) -> str:
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, MARKDOWN_FILE)
  with open(path, "w") as f:
    f.write(text)
  return path


def fmt(x: Any, digits: int = 3) -> str:
  """A compact cell: floats in %g, None as an em dash."""
  if x is None:
    return "—"
  if isinstance(x, float):
    return f"{x:.{digits}g}"
  return str(x)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
  """Markdown table lines."""
  cell = lambda c: fmt(c).replace("|", "\\|")  # a literal | inside a cell
  lines = [
    "| " + " | ".join(cell(h) for h in header) + " |",
    "|" + "|".join("---" for _ in header) + "|",
  ]
  lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
  return lines


def header_lines(title: str, env: dict, extra: Sequence[str] = ()) -> list[str]:
  return [
    f"# {title}",
    "",
    f"- date: {env['date']}; device: {env['device']}; JAX {env['jax']}"
    f" / jaxlib {env['jaxlib']}; commit {env['git_commit']}",
    f"- command: `{env['command']}`",
    *extra,
    "",
  ]


@contextlib.contextmanager
def progress(
  total: int, label: str, enabled: bool = True
) -> Iterator[Callable[[str], None]]:
  """Yields `advance(description)`: a rich progress bar, or nothing if disabled."""
  if not enabled:
    yield lambda description: None
    return
  from rich.progress import Progress  # pylint: disable=g-import-not-at-top

  with Progress(transient=False) as bar:
    task = bar.add_task(label, total=total)

    def advance(description: str) -> None:
      bar.update(task, description=f"{label}: {description}")
      bar.advance(task)

    yield advance


def console():
  return bench_report.make_console()


def print_markdown(text: str, con=None) -> None:
  """Prints a markdown summary (rich renders it on a terminal)."""
  con = con or console()
  try:
    from rich.markdown import Markdown  # pylint: disable=g-import-not-at-top

    con.print(Markdown(text))
  except ImportError:
    print(text)


def save_figure(fig, out_dir: str, name: str) -> str:
  path = os.path.join(out_dir, PLOTS_DIR, name)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  plt.close(fig)
  return path


def pyplot():
  """matplotlib.pyplot with the Agg backend (no display needed)."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  return plt
