"""`pallas-fa3 numerics <study>`: settings -> study -> report folder. Each
study module provides a frozen config class (its CPU default) and a
`GPU_DEFAULT`, `run(config, progress=...) -> dict`, `markdown(result)` and
`plot(result, out_dir)` (these two in the report module `REPORTS` names, if
any); this module picks the platform default, applies the flags, adds the
environment header, writes `results.json`, `summary.md` and `plots/*.png`
under `<out>/<study>`, and prints the summary: docs/numerics.md#the-studies.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import time
from typing import Any

from pallas_fa3.tools.numerics import report

# study -> (module, config class)
STUDIES = {
  "deviation": ("pallas_fa3.tools.numerics.deviation", "DeviationConfig"),
  "fp8": ("pallas_fa3.tools.numerics.fp8", "FP8StudyConfig"),
  "divergence": ("pallas_fa3.tools.numerics.divergence", "DivergenceConfig"),
  "bias": ("pallas_fa3.tools.numerics.bias", "BiasConfig"),
}
# study -> module of its markdown() and plot(), where not the study's own
REPORTS = {
  "deviation": "pallas_fa3.tools.numerics.deviation_report",
  "divergence": "pallas_fa3.tools.numerics.divergence_report",
}


def on_gpu() -> bool:
  from pallas_fa3.tools.bench import runner  # pylint: disable=g-import-not-at-top

  return runner.platform_name() == "gpu"


def _module(study: str):
  return importlib.import_module(STUDIES[study][0])


def default_config(
  study: str, overrides: dict[str, Any] | None = None, gpu: bool | None = None
):
  """The study's platform default with the fields in `overrides` (not None) replaced.

  Raises:
    ValueError / TypeError: from the config's validation, naming the field.
  """
  module = _module(study)
  gpu = on_gpu() if gpu is None else gpu
  base = module.GPU_DEFAULT if gpu else getattr(module, STUDIES[study][1])()
  return dataclasses.replace(
    base, **{k: v for k, v in (overrides or {}).items() if v is not None}
  )


def _deviation_extras(result: dict) -> None:
  from pallas_fa3.tools.numerics import (  # pylint: disable=g-import-not-at-top
    deviation_checks,
    deviation_report,
  )

  result["checks"] = deviation_checks.checks(result["records"])
  result["headline"] = deviation_report.summary_numbers(result)


def run(
  study: str,
  cfg,
  out_root: str,
  *,
  progress: bool = True,
  plots: bool = True,
  argv=None,
  quiet: bool = False,
  invoked_as: str | None = None,
) -> dict:
  """Runs one study into `out_root/<study>`; returns its result (as written).

  `invoked_as` names the subcommand in the report's command line when it
  is not `study` (`pallas-fa3 numerics all`).
  """
  start = time.perf_counter()
  module = _module(study)
  out_dir = os.path.join(out_root, study)
  result = module.run(cfg, progress=progress)
  if study == "deviation":
    _deviation_extras(result)
  shown = (
    importlib.import_module(REPORTS[study]) if study in REPORTS else module
  )
  markdown, plot = shown.markdown, shown.plot
  result = {
    "study": study,
    "environment": report.environment(invoked_as or study, argv),
    "config": cfg.to_dict(),
    **result,
  }
  text = markdown(result)
  paths = [report.write_markdown(out_dir, text)]
  if plots:
    try:
      result["plots"] = plot(result, out_dir)
      paths += result["plots"]
    except ImportError as e:  # a bare GPU image may lack matplotlib
      print(f"no plots: {e} (pip install matplotlib)")
  result["total_wall_s"] = time.perf_counter() - start
  paths.insert(0, report.write_json(out_dir, result))
  if not quiet:
    con = report.console()
    report.print_markdown(text, con)
    con.print(f"wrote {', '.join(paths)}", highlight=False)
  return result
