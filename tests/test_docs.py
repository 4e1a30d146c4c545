"""The examples in the docs run: module docstrings (doctest) and the README's Python block."""

from __future__ import annotations

import doctest
import pathlib
import re

import pytest

import pallas_fa3.attention
import pallas_fa3.backends.blockwise
import pallas_fa3.reference

_README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.parametrize("module", [pallas_fa3.attention, pallas_fa3.backends.blockwise,
                                    pallas_fa3.reference],
                         ids=lambda m: m.__name__)
def test_docstring_examples(module):
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0, f"{module.__name__} has no example"
  assert result.failed == 0


def test_readme_python_example_runs():
  blocks = re.findall(r"```python\n(.*?)```", _README.read_text(), re.S)
  assert blocks, "README has no python example"
  for block in blocks:
    exec(compile(block, str(_README), "exec"), {})  # pylint: disable=exec-used
