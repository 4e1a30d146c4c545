"""The docs are kept true: every module's docstring examples (doctest) and
every ```python block of the README and of docs/*.md run, every relative
link in those pages points to a file (and heading) that exists, and the
README stays short. The one doctest runner of the suite.

Blocks that need hardware a CI machine lacks (a GPU, 8 devices) are fenced
as ```text, ```bash or ```python multidevice (tests/multidevice/ runs the
README's), so they are not run here. A block that needs an environment
(8 devices, the interpreter's CPU pool, the checkout's models/) says so in
the paragraph right before it; a block that runs the interpreter runs in a
fresh process on a 2-core machine's pool, as a newcomer would run it. The
windows' and segment ids' "not with `X`" claims are checked against the
code."""

from __future__ import annotations

import doctest
import importlib
import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

import pallas_fa3

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_README = _ROOT / "README.md"
_API = _ROOT / "docs" / "api.md"


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


def _python_blocks(path: pathlib.Path) -> list[str]:
  """The ```python blocks of a markdown file (not ```python multidevice)."""
  return re.findall(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M)


def test_readme_python_example_runs():
  blocks = _python_blocks(_README)
  assert blocks, "README has no python example"
  # The quick start comes first: it is what a newcomer runs.
  assert "flash_attention(q, k, v, causal=True)" in blocks[0], blocks[0]
  for block in blocks:
    exec(compile(block, str(_README), "exec"), {})  # pylint: disable=exec-used


_DOCS = sorted((_ROOT / "docs").glob("*.md"))
_DOC_BLOCKS = [
  pytest.param(path, block, id=f"{path.name}-{i}")
  for path in _DOCS
  for i, block in enumerate(_python_blocks(path))
]


def test_docs_have_python_examples():
  # The pages with runnable examples; a fence typo would silently drop them.
  named = {param.values[0].name for param in _DOC_BLOCKS}
  assert {"api.md", "fp8.md", "flax.md", "kernels.md"} <= named, named


def _runs_interpreter(code: str) -> bool:
  return '"interpret"' in code


def _run_fresh(path: pathlib.Path, block: str) -> None:
  """Runs `block` in a new Python, from the checkout's root, with XLA's CPU
  pool at a 2-core machine's default size whatever this machine has (the
  suite itself runs on a pool reserved for the interpreter)."""
  env = dict(os.environ, PJRT_NPROC="2", JAX_PLATFORMS="cpu")
  env.pop("NPROC", None)
  result = subprocess.run(
    [sys.executable, "-c", block],
    cwd=_ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert result.returncode == 0, f"{path.name}: {result.stderr[-4000:]}"


@pytest.mark.parametrize("path,block", _DOC_BLOCKS)
def test_docs_python_example_runs(path, block):
  if _runs_interpreter(block):  # a fresh process: its pool is not ours
    _run_fresh(path, block)
    return
  exec(compile(block, str(path), "exec"), {})  # pylint: disable=exec-used


_BLOCK = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)


def _blocks_in_context(path: pathlib.Path) -> list[tuple[str, str, str]]:
  """(info string, code, paragraph before) of every fenced block of a page:
  the paragraph is the last one of prose before the block (blocks between
  are skipped, so two blocks in a row share it)."""
  text = path.read_text()
  out = []
  for m in _BLOCK.finditer(text):
    prose = _FENCE.sub("", text[: m.start()])
    paragraphs = [p for p in re.split(r"\n\s*\n", prose) if p.strip()]
    out.append((m.group(1), m.group(2), paragraphs[-1] if paragraphs else ""))
  return out


# What a python block may need beyond the package on a CPU: how the block
# shows it, and what the paragraph right before it must then say.
_NEEDS = (
  (
    "8 devices",
    lambda info, code: "multidevice" in info,
    "XLA_FLAGS=--xla_force_host_platform_device_count=8",
  ),
  (
    "the interpreter's 6 CPU threads",
    lambda info, code: _runs_interpreter(code),
    "PJRT_NPROC=6",
  ),
  (
    "the checkout's models/ (not installed)",
    lambda info, code: re.search(r"^(from|import) models\b", code, re.M),
    "PYTHONPATH",
  ),
)


@pytest.mark.parametrize("page", [_README, *_DOCS], ids=lambda p: p.name)
def test_python_blocks_say_what_they_need(page):
  # kernels.md's interpret example raised on 2 cores without PJRT_NPROC=6,
  # generation.md's needed the checkout on the path and the README's
  # 8-device examples XLA_FLAGS on a CPU, and none of them said so.
  missing = [
    f"block {i} ({info}) needs {need}: the paragraph before it names no"
    f" {words!r}"
    for i, (info, code, before) in enumerate(_blocks_in_context(page))
    if info.startswith("python")
    for need, shows, words in _NEEDS
    if shows(info, code) and words not in before
  ]
  assert not missing, f"{page.name}: " + "; ".join(missing)


def _section(text: str, start: str) -> str:
  """The prose from `start` to the next heading or bold-led paragraph."""
  prose = _FENCE.sub("", text[text.index(start) + len(start) :])
  end = re.search(r"^(#|\*\*)", prose, re.M)
  return prose[: end.start() if end else None]


def _claimed_refusals(section: str) -> list[str]:
  """The names in a section's "not with `a`, `b` or `c`" phrases."""
  names = []
  for phrase in re.findall(
    r"[Nn]ot (?:combined )?with\s+((?:`[^`]+`(?:,\s*|\s+or\s+)?)+)", section
  ):
    names += [n.split("=")[0] for n in re.findall(r"`([^`]+)`", phrase)]
  return names


def _refusal_call(name: str, **feature):
  """A call of `name` (an option of flash_attention, or ring_attention)
  with the feature's arguments, on small inputs."""
  q = k = v = jax.numpy.ones((1, 64, 2, 32), "bfloat16")
  if name == "ring_attention":
    mesh = jax.make_mesh((1,), ("seq",))
    return lambda: pallas_fa3.ring_attention(
      q, k, v, mesh=mesh, seq_axis="seq", **feature
    )
  option = {"fp8": dict(fp8=True), "stable_max": dict(stable_max=True)}[name]
  return lambda: pallas_fa3.flash_attention(q, k, v, **option, **feature)


def _feature_arguments(feature: str) -> list[dict]:
  """The arguments of `_refusal_call`'s feature, one option at a time."""
  if feature == "windows":
    sinks = jax.numpy.zeros((2,), "float32")
    return [dict(window_size=(16, None)), dict(softcap=30.0), dict(sinks=sinks)]
  one_doc = jax.numpy.zeros((1, 64), "int32")
  return [dict(segment_ids=pallas_fa3.SegmentIds(one_doc, one_doc))]


# Where the README and api.md say what windows and segment ids combine with.
_CLAIMS = [
  (_README, "**Windows, softcap, sinks.**", "windows"),
  (_README, "**Packed sequences.**", "segment ids"),
  (_API, "## Sliding windows, softcap and sinks", "windows"),
  (_API, "## Packed sequences: segment ids", "segment ids"),
]


@pytest.mark.parametrize(
  "page,start,feature", _CLAIMS, ids=[f"{p.name}-{f}" for p, _, f in _CLAIMS]
)
def test_claimed_refusals_refuse(page, start, feature):
  # Both pages said windows, softcap, sinks and segment ids are refused
  # with fp8 and ring_attention after those had learnt them.
  names = _claimed_refusals(_section(page.read_text(), start))
  assert names, f"{page.name}: no 'not with' claim after {start!r}"
  ran = []
  for name in names:
    for arguments in _feature_arguments(feature):
      try:
        jax.block_until_ready(_refusal_call(name, **arguments)())
      except NotImplementedError:
        continue
      ran.append(f"{name} with {', '.join(arguments)}")
  assert not ran, f"{page.name} says these are refused, but they run: {ran}"


# The pages whose links are checked: the README and every page in docs/.
_PAGES = [_README, *_DOCS]
# [text](target) or ![alt](target), with an optional "title".
_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)


def _prose(text: str) -> str:
  """The text without fenced blocks and inline code (links there are code)."""
  return re.sub(r"`[^`\n]*`", "", _FENCE.sub("", text))


def github_slug(heading: str) -> str:
  """GitHub's anchor for a heading: the rendered text (inline code and link
  markup dropped) lowercased, every character other than a letter, digit,
  underscore, hyphen or space removed, spaces turned into hyphens."""
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
  text = re.sub(r"[^\w\- ]", "", text.strip().lower())
  return text.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
  """Every heading anchor of a markdown file (repeats get -1, -2, ...)."""
  seen: dict[str, int] = {}
  anchors = set()
  for heading in _HEADING.findall(_FENCE.sub("", path.read_text())):
    slug = github_slug(heading)
    anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
    seen[slug] = seen.get(slug, 0) + 1
  return anchors


def test_github_slug():
  assert github_slug("Packed sequences: segment ids") == (
    "packed-sequences-segment-ids"
  )
  assert github_slug("The first GPU run: `device_check.sh`") == (
    "the-first-gpu-run-device_checksh"
  )
  assert github_slug("6, 7. Named barriers") == "6-7-named-barriers"
  assert github_slug("Sliding windows, softcap and sinks") == (
    "sliding-windows-softcap-and-sinks"
  )


@pytest.mark.parametrize("page", _PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
  broken = []
  for target in _LINK.findall(_prose(page.read_text())):
    if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:
      continue
    file, _, anchor = target.partition("#")
    path = (page.parent / file).resolve() if file else page
    if not path.exists():
      broken.append(f"{target}: no file {path.relative_to(_ROOT)}")
    elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
      broken.append(f"{target}: no heading #{anchor} in {path.name}")
  assert not broken, f"{page.name}: " + "; ".join(broken)


def test_training_md_times_the_default_run_by_its_tokens():
  # It said "~3 min on 2 cores", measured at 7.5 min on another 2-core
  # CPU: the time is the run's tokens over a rate that depends on the CPU
  # and its load, so the page states the tokens, and they are the CLI's.
  from pallas_fa3.tools import cli  # pylint: disable=g-import-not-at-top

  args = cli.build_parser().parse_args(["train"])
  tokens = args.steps * args.batch * args.seq_len
  text = " ".join((_ROOT / "docs" / "training.md").read_text().split())
  assert f"{args.steps} steps of {args.batch * args.seq_len} tokens" in text
  rate = f"{tokens / 1e6:.2f}M training tokens over the machine's tokens/s"
  assert rate in text
  assert f"{args.steps // args.eval_interval + 1} evaluations" in text
  assert "tokens/s (3 min 08 s)" in text and "min on 2 cores" not in text


_README_MAX_LINES = 260  # issue 31: a README a newcomer reads in minutes


def test_readme_is_short():
  lines = len(_README.read_text().splitlines())
  assert lines <= _README_MAX_LINES, (
    f"README.md has {lines} lines (at most {_README_MAX_LINES}): move"
    " reference material to a page under docs/ and link it"
  )


def _tile_choice_rows() -> list[tuple[str, int, str]]:
  text = (_ROOT / "docs" / "kernels.md").read_text()
  section = text[text.index("### Tile choices") :]
  section = section[: section.index("\n## ")]
  rows = re.findall(r"^\| ([a-z0-9 ]+) \| (\d+) \| ([^|]+) \|", section, re.M)
  return [(p, int(d), tiles.strip()) for p, d, tiles in rows]


def test_tile_choice_table_matches_the_defaults():
  """docs/kernels.md#tile-choices names every default tiling the code picks,
  in `short_label`'s words, for every head dim and pass (a `causal` row
  where the causal default differs; flex: a mask_mod's forward)."""
  import dataclasses

  import jax.numpy as jnp

  from pallas_fa3 import flex, mods
  from pallas_fa3.kernels.sm90 import config, config_backward, config_fp8
  from pallas_fa3.spec import AttentionSpec
  from pallas_fa3.tools.aot.compiler import short_label

  flex_spec, _ = flex.prepare(
    score_mod=None, mask_mod=mods.causal_top_left, block_mask=None,
    bias=None, batch=4, heads=8, seq_q=4096, seq_kv=4096,
  )  # fmt: skip
  rows = _tile_choice_rows()
  documented = {(p, d): tiles for p, d, tiles in rows}
  assert len(documented) == len(rows), "a (pass, d) row is repeated"
  expected = {}
  for d in config.KERNEL_HEAD_DIMS:
    for causal in (False, True):  # a causal row only where causal differs
      spec = AttentionSpec(
        4, 4096, 4096, 8, 8, d, d, jnp.dtype(jnp.bfloat16), causal, d**-0.5
      )
      det = dataclasses.replace(spec, deterministic=True)
      picks = {
        "forward": (spec, config.default_forward_config(spec)),
        "backward": (spec, config_backward.default_backward_config(spec)),
        "deterministic backward": (
          det,
          config_backward.default_backward_config(det),
        ),
      }
      if d in config_fp8.FP8_HEAD_DIMS:
        picks["fp8 forward"] = (spec, config_fp8.default_fp8_forward_config(d))
      with_flex = dataclasses.replace(spec, flex=flex_spec)
      picks["flex forward"] = (
        with_flex,
        config.default_forward_config(with_flex),
      )
      for name, (s, cfg) in picks.items():
        label = short_label(s, cfg)  # "d128 causal 64x128x2 ..."
        tiles = label.split(" ", 2)[2]
        if expected.setdefault((name, d), tiles) != tiles:
          assert causal, (name, d)
          expected[(f"causal {name}", d)] = tiles
  assert documented == expected
