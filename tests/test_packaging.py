"""Packaging: the built wheel, and `pallas-fa3 train` without `models` installed.

The wheel is built once per run (about a second) from a copy of the sources,
offline, with the installed setuptools (the test extra) and a `jax` that fails
on import: the build must read the version without importing the package.
"""

from __future__ import annotations

import email.parser
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from typing import NamedTuple

import pytest

import pallas_fa3
from pallas_fa3.tools import cli, example_models

REPO = pathlib.Path(__file__).resolve().parents[1]
VERSION = "0.1.0"
DIST_INFO = f"pallas_fa3-{VERSION}.dist-info"
# What the build reads (models/ too: the wheel must leave it out). A copy keeps
# the build's build/ and egg-info folders, and stale modules in them, out of
# the checkout.
_SOURCES = ("pyproject.toml", "README.md", "LICENSE", "pallas_fa3", "models")
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
# A few fast flags: the train command must fail before any training.
_TRAIN = ["train", "--steps", "1", "--no-deterministic", "--no-progress"]


class Wheel(NamedTuple):
  zip: zipfile.ZipFile
  log: str  # pip's verbose output, the build backend's included


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Iterator[Wheel]:
  """The wheel built from this checkout."""
  pytest.importorskip(
    "setuptools",
    minversion="77",
    reason="the wheel build needs setuptools>=77 (the test extra)",
  )
  tmp = tmp_path_factory.mktemp("packaging")
  src = tmp / "src"
  for name in _SOURCES:
    path = REPO / name
    if path.is_dir():
      shutil.copytree(path, src / name, ignore=_IGNORE)
    else:
      src.mkdir(exist_ok=True)
      shutil.copy2(path, src / name)
  no_jax = tmp / "no_jax" / "jax"
  no_jax.mkdir(parents=True)
  (no_jax / "__init__.py").write_text(
    'raise ImportError("the wheel build imported jax")\n'
  )
  env = dict(
    os.environ,
    PYTHONPATH=str(no_jax.parent),
    PIP_NO_INDEX="1",
    PIP_DISABLE_PIP_VERSION_CHECK="1",
  )
  out = tmp / "dist"
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "pip",
      "wheel",
      "-v",
      "--no-deps",
      "--no-build-isolation",
      "-w",
      str(out),
      str(src),
    ],
    cwd=tmp,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  log = proc.stdout + proc.stderr
  if proc.returncode:
    pytest.fail(f"pip wheel failed ({proc.returncode}):\n{log[-4000:]}")
  (path,) = out.glob("*.whl")
  with zipfile.ZipFile(path) as whl:
    yield Wheel(whl, log)


def _metadata(wheel: Wheel):
  return email.parser.Parser().parsestr(
    wheel.zip.read(f"{DIST_INFO}/METADATA").decode()
  )


def test_wheel_is_named_after_the_one_version(wheel):
  assert pallas_fa3.__version__ == VERSION
  assert _metadata(wheel)["Version"] == VERSION
  assert pathlib.Path(wheel.zip.filename).name == (
    f"pallas_fa3-{VERSION}-py3-none-any.whl"
  )


def test_wheel_holds_every_module_and_the_sm90a_target(wheel):
  names = set(wheel.zip.namelist())
  assert "pallas_fa3/tools/aot/data/h200_target_config.txtpb" in names
  modules = {
    p.relative_to(REPO).as_posix()
    for p in (REPO / "pallas_fa3").rglob("*.py")
    if "__pycache__" not in p.parts
  }
  assert modules == {n for n in names if n.endswith(".py")}


def test_wheel_installs_no_models_package(wheel):
  tops = {n.split("/")[0] for n in wheel.zip.namelist()}
  assert tops == {"pallas_fa3", DIST_INFO}
  assert wheel.zip.read(f"{DIST_INFO}/top_level.txt").decode().split() == [
    "pallas_fa3"
  ]


def test_wheel_carries_the_license(wheel):
  meta = _metadata(wheel)
  assert meta["License-Expression"] == "Apache-2.0"
  assert meta.get_all("License-File") == ["LICENSE"]
  text = wheel.zip.read(f"{DIST_INFO}/licenses/LICENSE")
  assert text == (REPO / "LICENSE").read_bytes()
  assert b"Apache License\n                           Version 2.0" in text
  assert b"Copyright 2026 The pallas-fa3 authors" in text
  assert not [
    line
    for line in wheel.log.splitlines()
    if "warning" in line.lower() and "licen" in line.lower()
  ]


def test_training_dependencies_are_the_train_extra(wheel):
  requires = _metadata(wheel).get_all("Requires-Dist")
  base = [r for r in requires if "extra ==" not in r]
  assert not [r for r in base if r.startswith(("optax", "orbax"))]
  train = sorted(r.split(";")[0] for r in requires if 'extra == "train"' in r)
  assert train == ["optax", "orbax-checkpoint"]


def test_export_serialization_is_a_base_dependency(wheel):
  # The README calls flash_attention export friendly; Exported.serialize()
  # imports flatbuffers, which jax does not require and only the test extra
  # installed.
  requires = _metadata(wheel).get_all("Requires-Dist")
  assert "flatbuffers" in [r for r in requires if "extra ==" not in r]


def _forget_models(monkeypatch):
  """Drops `models` and its submodules from sys.modules (restored after)."""
  for name in [
    n for n in sys.modules if n == "models" or n.startswith("models.")
  ]:
    monkeypatch.delitem(sys.modules, name)


@pytest.mark.parametrize("missing", ["optax", "orbax.checkpoint"])
def test_train_without_the_train_extra_names_it(
  missing, monkeypatch, capsys, tmp_path
):
  # flax.nnx imports optax itself: imported here first, as it always is in
  # a real environment without the extra, so its failed half-import does
  # not stay behind in sys.modules for later tests.
  pytest.importorskip("flax.nnx")
  _forget_models(monkeypatch)
  monkeypatch.setitem(sys.modules, missing, None)  # import raises
  assert cli.main([*_TRAIN, "--out", str(tmp_path / "run")]) == 1
  err = capsys.readouterr().err
  assert f"needs {missing.split('.')[0]}" in err
  assert "pip install 'pallas-fa3[train]'" in err
  assert not (tmp_path / "run").exists()


def test_train_outside_a_checkout_says_it_needs_one(
  monkeypatch, capsys, tmp_path
):
  monkeypatch.setitem(sys.modules, "models", None)  # `import models` fails
  monkeypatch.setattr(
    example_models,
    "__file__",
    str(tmp_path / "pallas_fa3" / "tools" / "example_models.py"),
  )
  assert cli.main([*_TRAIN, "--out", str(tmp_path / "run")]) == 1
  err = capsys.readouterr().err
  assert "needs a source checkout of pallas-fa3 with its models/ folder" in err


def test_train_finds_models_next_to_the_package(monkeypatch):
  """An editable install puts only `pallas_fa3` on the path: the tools load
  the checkout's `models` by file location, with sys.path unchanged."""
  pytest.importorskip("optax")
  pytest.importorskip("orbax.checkpoint")
  _forget_models(monkeypatch)
  root = str(REPO)
  monkeypatch.setattr(
    sys,
    "path",
    [p for p in sys.path if os.path.abspath(p or os.curdir) != root],
  )
  # Editable installs made before models/ left the package may still map it.
  monkeypatch.setattr(
    sys,
    "meta_path",
    [
      f
      for f in sys.meta_path
      if not getattr(f, "__module__", "").startswith("__editable__")
    ],
  )
  assert importlib.util.find_spec("models") is None
  path_before = list(sys.path)
  example_models.load("pallas-fa3 train")
  assert sys.path == path_before
  import models.train  # pylint: disable=g-import-not-at-top

  assert pathlib.Path(models.train.__file__).is_relative_to(REPO / "models")
