"""The training example (`models/` of the checkout) for the tools that run it,
the `pallas-fa3 train|generate` aliases of `python -m models` and
`pallas-fa3 numerics divergence`: `models/` is not installed with the
package, so an importable `models` is used, else the one beside this
`pallas_fa3` in its checkout, imported by file location: docs/training.md.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys
from types import ModuleType


def _checkout() -> pathlib.Path:
  """The folder holding this `pallas_fa3` (a checkout's root, if it is one)."""
  return pathlib.Path(__file__).resolve().parents[2]


def checkout_models() -> pathlib.Path | None:
  """The checkout's `models/` folder, if this `pallas_fa3` sits in one."""
  init = _checkout() / "models" / "__init__.py"
  return init.parent if init.is_file() else None


def load(command: str) -> ModuleType:
  """The `models` package: importable, or the checkout's (imported by file
  location under the name `models`, so its `from models import ...` work).

  Raises:
    ImportError: no `models` and no checkout with `models/`; or a `models`
      that is not the example's (it lacks `models.cli`). The message says
      what to do.
  """
  # None in sys.modules (an import that was blocked) imports nothing either.
  if sys.modules.get("models") is None:
    try:
      importlib.import_module("models")
    except ModuleNotFoundError as e:
      if e.name != "models":
        raise
      folder = checkout_models()
      if folder is None:
        raise ImportError(
          f"{command} needs a source checkout of pallas-fa3 with its models/"
          " folder (the training example is not installed): clone the"
          " repository and run `python -m models ...` (or `pip install -e"
          f" '.[train]'` and {command}) in it; found no models/ next to"
          f" {_checkout() / 'pallas_fa3'}"
        ) from None
      spec = importlib.util.spec_from_file_location(
        "models",
        folder / "__init__.py",
        submodule_search_locations=[str(folder)],
      )
      module = importlib.util.module_from_spec(spec)
      sys.modules["models"] = module
      spec.loader.exec_module(module)
  try:
    importlib.import_module("models.cli")
  except ModuleNotFoundError as e:
    if (e.name or "").startswith("models"):
      raise ImportError(
        f"{command} needs the models/ folder of a pallas-fa3 checkout; the"
        f" `models` found ({sys.modules['models'].__file__}) has no {e.name}"
      ) from e
    raise
  return sys.modules["models"]


def require_train_extra(command: str) -> None:
  """Raises ImportError, saying how to install it, unless optax and orbax
  (the `train` extra, which `models.train` imports) are present."""
  for top in ("optax", "orbax.checkpoint"):
    if importlib.util.find_spec(top.partition(".")[0]) is None:
      raise ImportError(
        f"{command} needs {top.partition('.')[0]} (the train extra): pip"
        " install 'pallas-fa3[train]' (in a checkout: pip install -e"
        " '.[train]')"
      )
