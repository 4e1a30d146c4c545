"""The examples in the docs run: every module's docstring examples (doctest)
and the README's Python block. The one doctest runner of the suite."""

from __future__ import annotations

import doctest
import importlib
import pathlib
import re

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_README = _ROOT / "README.md"


def _modules_with_examples() -> list[str]:
  """Dotted names of the library's and the training example's modules whose
  source holds a `>>>` example."""
  names = []
  for package in ("pallas_fa3", "models"):
    for path in sorted((_ROOT / package).rglob("*.py")):
      if ">>>" in path.read_text():
        parts = path.relative_to(_ROOT).with_suffix("").parts
        names.append(".".join(p for p in parts if p != "__init__"))
  return names


_MODULES = _modules_with_examples()


def test_examples_are_found():
  assert {"pallas_fa3.attention", "pallas_fa3.fp8", "models.gpt"} <= set(
    _MODULES
  ), _MODULES


@pytest.mark.parametrize("name", _MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
  # Examples that need hardware this machine lacks are marked +SKIP.
  skipped_only = "doctest: +SKIP" in pathlib.Path(module.__file__).read_text()
  assert result.attempted > 0 or skipped_only, f"{name}: no example ran"
  assert result.failed == 0


def test_readme_python_example_runs():
  blocks = re.findall(r"```python\n(.*?)```", _README.read_text(), re.S)
  assert blocks, "README has no python example"
  for block in blocks:
    exec(compile(block, str(_README), "exec"), {})  # pylint: disable=exec-used
