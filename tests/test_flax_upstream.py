"""Flax's own attention tests, with make_attention_fn as Flax's attention.

Runs Flax's `tests/nnx/nn/attention_test.py` and
`tests/linen/linen_attention_test.py` in a subprocess under the
`flax_upstream` plugin (`tests/flax_upstream.py`), which makes
`make_attention_fn(on_unsupported="fallback")` the attention those tests
reach. Flax's tests are not installed with Flax: set `FLAX_TESTS_DIR` to the
`tests/` folder of the installed Flax version's source, e.g.

  pip download flax==$(python -c 'import flax; print(flax.__version__)') \
    --no-binary :all: --no-deps -d /tmp && tar xzf /tmp/flax-*.tar.gz -C /tmp
  FLAX_TESTS_DIR=/tmp/flax-<version>/tests pytest tests/test_flax_upstream.py

Without it the test is skipped, saying so. A few minutes on 2 cores.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

_FILES = ("nnx/nn/attention_test.py", "linen/linen_attention_test.py")
_TESTS_DIR = os.environ.get("FLAX_TESTS_DIR")


@pytest.mark.skipif(
  not _TESTS_DIR,
  reason="FLAX_TESTS_DIR does not name Flax's tests/ folder (see the"
  " module docstring)",
)
def test_flax_attention_suite_passes_with_make_attention_fn():
  root = pathlib.Path(_TESTS_DIR)
  files = [root / f for f in _FILES]
  missing = [str(f) for f in files if not f.is_file()]
  assert not missing, f"FLAX_TESTS_DIR={root} lacks {missing}"
  here = pathlib.Path(__file__).parent
  env = dict(os.environ, PYTHONPATH=str(here), JAX_PLATFORMS="cpu")
  run = subprocess.run(
    [sys.executable, "-m", "pytest", "-q", "-p", "flax_upstream"]
    + ["-p", "no:cacheprovider", "-n", "0", "-o", "addopts="]
    + [str(f) for f in files],
    cwd=root.parent,
    env=env,
    capture_output=True,
    text=True,
    timeout=1200,
  )
  tail = (run.stdout + run.stderr)[-4000:]
  assert run.returncode == 0, tail
  calls = re.search(r"make_attention_fn ran (\d+) calls", run.stdout)
  # Flax's tests really ran through our attention function.
  assert calls and int(calls.group(1)) > 100, tail
