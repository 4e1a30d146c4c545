"""The training example (`models/` of the repository) for the commands that
train it: `pallas-fa3 train` and `pallas-fa3 numerics divergence`.

`models/` is not installed with the package (a top-level package named
`models` does not belong in site-packages); it is taken from the checkout.
"""

from __future__ import annotations

import importlib
import os
import sys


def require_models(command: str) -> None:
  """Makes `models` (the training example) importable, or says what is missing.

  `models/` is not installed with the package: when `import models` fails, it
  is taken from the checkout that holds this `pallas_fa3` (an editable install
  or PYTHONPATH), the parent of the package directory.

  Raises:
    ImportError: no checkout with `models/`, or optax / orbax-checkpoint (the
      `train` extra) missing; the message says how to get them.
  """
  try:
    importlib.import_module("models")
  except ModuleNotFoundError as e:
    if e.name != "models":
      raise
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isfile(os.path.join(root, "models", "__init__.py")):
      raise ImportError(
        f"{command} needs a source checkout of pallas-fa3 with its"
        " models/ folder (the training example is not installed): clone"
        " the repository and run `pip install -e '.[train]'` in it; found"
        f" no models/ next to {os.path.join(root, 'pallas_fa3')}"
      ) from None
    sys.path.insert(0, root)
  try:
    importlib.import_module("models.train")  # imports optax and orbax
  except ModuleNotFoundError as e:
    top = (e.name or "").partition(".")[0]
    if top in ("optax", "orbax"):
      raise ImportError(
        f"{command} needs {top} (the train extra): pip install"
        " 'pallas-fa3[train]' (in a checkout: pip install -e"
        " '.[train]')"
      ) from e
    if top == "models":  # another project's `models` came first on sys.path
      raise ImportError(
        f"{command} needs the models/ folder of a pallas-fa3"
        f" checkout; the `models` found has no {e.name}"
      ) from e
    raise
