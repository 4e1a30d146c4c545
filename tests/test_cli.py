"""The `pallas-fa3` command line: `info`, `--help`, and running it as a module."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import pytest

from pallas_fa3.tools import cli

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
ON_CPU = jax.default_backend() == "cpu"
cpu_only = pytest.mark.skipif(not ON_CPU, reason="checks the CPU-only choice")

# A sample call small enough to compile and run in well under a second.
SMALL = [
  "--batch",
  "1",
  "--seq-q",
  "32",
  "--seq-kv",
  "48",
  "--heads-q",
  "2",
  "--heads-kv",
  "1",
  "--head-dim",
  "16",
  "--dtype",
  "float32",
]


def _env() -> dict[str, str]:
  """The current environment with the repo root first on PYTHONPATH."""
  env = dict(os.environ)
  parts = [str(REPO_ROOT)] + [
    p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p
  ]
  env["PYTHONPATH"] = os.pathsep.join(parts)
  return env


def _check_environment_report(out: str) -> None:
  assert re.search(r"^pallas-fa3 \S+ +\(Python ", out, re.M), out
  assert f"JAX {jax.__version__}, jaxlib " in out, out
  assert f"default backend: {jax.default_backend()}" in out, out
  for d in jax.devices():
    assert f"  device {d.id}: {d.platform} {d.device_kind}" in out, out
  assert re.search(r"^Hopper \(sm90\) GPU: (yes|no \(.+\))$", out, re.M), out
  if ON_CPU:
    assert (
      "Hopper (sm90) GPU: no (no GPU: the default JAX backend is 'cpu')" in out
    ), out


def _check_cpu_choice(out: str) -> None:
  lines = out.splitlines()
  mosaic = [l for l in lines if re.match(r"^\s+(-> )?mosaic:", l)]
  blockwise = [l for l in lines if re.match(r"^\s+(-> )?blockwise:", l)]
  assert len(mosaic) == 1 and len(blockwise) == 1, out
  assert re.match(
    r"^\s+mosaic: skipped: no GPU: the default JAX backend is"
    r" 'cpu'(; and .+)?$",
    mosaic[0],
  ), out
  assert re.match(
    r"^\s+-> blockwise: supported; picked \(.+\)$", blockwise[0]
  ), out
  # mosaic is listed first (fastest first) and is not the one picked.
  assert lines.index(mosaic[0]) < lines.index(blockwise[0]), out
  assert "reference" not in "\n".join(mosaic + blockwise), out


def test_info_no_run(capsys):
  assert cli.main(["info", "--no-run"]) == 0
  out, err = capsys.readouterr()
  _check_environment_report(out)
  assert (
    "Sample call: q (1, 256, 4, 64), k/v (1, 256, 2, 64), bfloat16,"
    " causal=True (bottom-right aligned)"
  ) in out, out
  assert "Automatic choice (fastest first):" in out, out
  if ON_CPU:
    _check_cpu_choice(out)
  assert "Ran it with" not in out and "golden" not in out, out
  assert err == ""


def test_info_no_run_reflects_sample_options(capsys):
  assert cli.main(["info", "--no-run", "--no-causal", *SMALL]) == 0
  out = capsys.readouterr().out
  assert (
    "Sample call: q (1, 32, 2, 16), k/v (1, 48, 1, 16), float32, causal=False"
  ) in out, out


def test_info_runs_sample_call_and_compares_with_golden(capsys):
  assert cli.main(["info", *SMALL]) == 0
  out = capsys.readouterr().out
  _check_environment_report(out)
  if ON_CPU:
    _check_cpu_choice(out)
  ran = re.search(
    r"^Ran it with (\w+): output \(1, 32, 2, 16\) float32;"
    r" first call [\d.]+ s \(includes compilation\),"
    r" second [\d.]+ ms$",
    out,
    re.M,
  )
  assert ran, out
  if ON_CPU:
    assert ran.group(1) == "blockwise", out
  golden = re.search(
    r"^max \|out - float64 golden\| = (\S+)  \((\S+) x"
    r" float32 eps; a few eps is rounding, not error\)$",
    out,
    re.M,
  )
  assert golden, out
  err, eps_multiple = float(golden.group(1)), float(golden.group(2))
  assert 0 <= err < 1e-5, out
  assert 0 <= eps_multiple < 64, out


@pytest.mark.parametrize("argv", [["--help"], ["-h"]])
def test_top_level_help(argv, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(argv)
  assert e.value.code == 0
  out = capsys.readouterr().out
  assert out.startswith("usage: pallas-fa3 "), out
  assert re.search(
    r"^\s+info\s+environment, devices and the automatic"
    r" backend choice",
    out,
    re.M,
  ), out
  assert "pallas-fa3 <command> --help" in out, out


def test_info_help(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["info", "--help"])
  assert e.value.code == 0
  out = capsys.readouterr().out
  assert out.startswith("usage: pallas-fa3 info "), out
  for flag in (
    "--batch",
    "--seq-q",
    "--seq-kv",
    "--heads-q",
    "--heads-kv",
    "--head-dim",
    "--dtype",
    "--causal",
    "--no-causal",
    "--no-run",
  ):
    assert flag in out, flag
  # argparse wraps the description to the terminal width.
  assert "compare it with a float64 golden" in " ".join(out.split()), out


@pytest.mark.parametrize(
  "argv",
  [
    pytest.param([], id="no-command"),
    pytest.param(["bogus"], id="unknown-command"),
    pytest.param(["info", "--dtype", "float64"], id="bad-dtype"),
    pytest.param(["info", "--seq-q", "many"], id="non-int"),
    pytest.param(["info", "--frobnicate"], id="unknown-flag"),
  ],
)
def test_usage_errors_exit_2(argv, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("usage: pallas-fa3"), err
  assert "error:" in err, err


@pytest.mark.parametrize(
  "argv",
  [
    ["--seq-q", "0"],
    ["--batch", "-1"],
    ["--head-dim", "300"],
    ["--heads-q", "3", "--heads-kv", "2"],
  ],
  ids=lambda a: " ".join(a),
)
def test_info_invalid_sample_shape_is_a_usage_error(argv, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["info", "--no-run"] + argv)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "usage: pallas-fa3 info" in err and "error:" in err, err
  assert argv[0] in err or "head_dim" in err, err


def test_module_entry_point_subprocess():
  proc = subprocess.run(
    [sys.executable, "-m", "pallas_fa3.tools.cli", "info", "--no-run"],
    capture_output=True,
    text=True,
    env=_env(),
    cwd=REPO_ROOT,
    timeout=300,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr
  _check_environment_report(proc.stdout)
  if ON_CPU:
    _check_cpu_choice(proc.stdout)


def test_module_entry_point_usage_error_exit_code():
  proc = subprocess.run(
    [sys.executable, "-m", "pallas_fa3.tools.cli"],
    capture_output=True,
    text=True,
    env=_env(),
    cwd=REPO_ROOT,
    timeout=300,
    check=False,
  )
  assert proc.returncode == 2, (proc.stdout, proc.stderr)
  assert "usage: pallas-fa3" in proc.stderr


def test_installed_console_script():
  script = shutil.which(
    "pallas-fa3", path=str(pathlib.Path(sys.executable).parent)
  )
  if script is None:
    pytest.skip(
      "the pallas-fa3 console script is not installed (pip install -e .)"
    )
  proc = subprocess.run(
    [script, "info", "--no-run"],
    capture_output=True,
    text=True,
    env=_env(),
    timeout=300,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr
  _check_environment_report(proc.stdout)


@pytest.mark.parametrize(
  "command",
  [[], ["info"], ["train"], ["generate"], ["bench"], ["numerics"], ["aot"]]
  + [
    ["numerics", s] for s in ("deviation", "fp8", "divergence", "bias", "all")
  ],
  ids=" ".join,
)
def test_help_has_no_formatting_artifacts(command, capsys):
  # argparse %-formats option help but not descriptions, and the defaults
  # formatter appends "(default: X)" itself: a literal "%%" or a second,
  # "(default: None)", default note is a help-string bug.
  with pytest.raises(SystemExit) as e:
    cli.main(command + ["--help"])
  assert e.value.code == 0
  out = capsys.readouterr().out
  assert "%%" not in out, out
  assert "(default: None)" not in out, out
  flat = " ".join(out.split())
  assert not re.search(r"\((default|unset): [^)]*\) \(default: ", flat), out
  if command == ["bench"]:
    assert "bf16 matmul rate for % of peak" in flat, out
    assert (
      "timed calls per case (unset: 20 on a GPU, 3 on a CPU, or up to 5x that"
      " while a case's calls add up to under 0.25 s)"
    ) in flat, out
  if command == ["numerics", "bias"]:
    # Every setting showed "(default: None)": unset keeps the config's value.
    rows = "independent score rows (default: 4096 on a CPU, 16384 on a GPU)"
    assert rows in flat, out
    assert "tied maxima per row (1: control) (default: 1 2 3 4 8)" in flat, out
  if command == ["numerics", "deviation"]:
    assert "e.g. 64x64 (default: 64x64)" in flat, out


# Each help screen, then the heavy modules imported so far: `--help` and the
# help of `info`, `train`, `generate` and `numerics` import no JAX, nor numpy
# or matplotlib (`bench`'s and `aot`'s flags read registries that import JAX;
# a numerics study's help shows its config's defaults, read off its module).
# Failed while the package imported its whole API at once (2.3 s on an idle
# 2-core machine, ~10 s on a loaded one, before a line of help).
_HELP_IMPORTS = """
import sys
from pallas_fa3.tools import cli
for command in {commands!r}:
  try:
    cli.main(command + ["--help"])
  except SystemExit:
    pass
  heavy = sorted(m for m in ("jax", "numpy", "matplotlib") if m in sys.modules)
  print(" ".join(command) or "-", ",".join(heavy) or "none", file=sys.stderr)
"""


def test_help_imports_no_jax():
  commands = [[], ["info"], ["train"], ["generate"], ["numerics"]]
  proc = subprocess.run(
    [sys.executable, "-c", _HELP_IMPORTS.format(commands=commands)],
    capture_output=True,
    text=True,
    env=_env(),
    cwd=REPO_ROOT,
    timeout=300,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr
  report = proc.stderr.splitlines()
  assert len(report) == len(commands), proc.stderr
  for line in report:
    assert line.endswith(" none"), f"--help imported: {proc.stderr}"


def test_train_help_gives_the_measured_time_range(capsys):
  # It said "about 3 minutes on an idle 2-core CPU": one CPU model's time
  # (an idle 2-core AMD EPYC takes 7.5-8.5 min). Both are docs/training.md's.
  with pytest.raises(SystemExit):
    cli.main(["train", "--help"])
  flat = " ".join(capsys.readouterr().out.split())
  assert "3 minutes on an idle 2-core Intel Xeon with AMX" in flat, flat
  assert "7.5-8.5 on an idle 2-core AMD EPYC" in flat, flat
  docs = " ".join((REPO_ROOT / "docs" / "training.md").read_text().split())
  assert "(3 min 08 s) on an idle Intel Xeon with AMX" in docs
  assert "(7.5-8.5 min) on an idle AMD EPYC" in docs
