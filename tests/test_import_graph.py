"""The library's modules import each other without circles (what two modules
both need goes one floor down), and the library never imports its tools
(`pallas_fa3.tools`: the CLI, bench, numerics, aot), `models/` or the test
suite.

Edges are every import between the modules of `pallas_fa3`: module level,
`TYPE_CHECKING` blocks (circles in waiting) and late imports inside
functions alike; package `__init__` modules (re-exports) are left out.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_PACKAGE = _ROOT / "pallas_fa3"


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in _PACKAGE.rglob("*.py"):
    parts = path.relative_to(_ROOT).with_suffix("").parts
    out[".".join(parts)] = path
  return out


def _imports(tree: ast.Module) -> list[ast.stmt]:
  """Every import statement of a module, wherever it sits (module level,
  `if TYPE_CHECKING:`, inside functions)."""
  return [
    n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
  ]


def _edges(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
  packages = {n for n, p in modules.items() if p.name == "__init__.py"}
  graph = {}
  for name, path in modules.items():
    if name in packages:
      continue
    targets = set()
    for node in _imports(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      else:
        if node.level:  # relative imports are not used here
          raise AssertionError(f"{name}: relative import")
        base = node.module or ""
        names = [f"{base}.{a.name}" for a in node.names] + [base]
      for n in names:
        n = n.replace(".__init__", "")
        if n.startswith("pallas_fa3") and n in modules and n not in packages:
          targets.add(n)
    graph[name] = targets - {name}
  return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  state: dict[str, int] = {}
  path: list[str] = []

  def visit(n: str) -> list[str] | None:
    state[n] = 1
    path.append(n)
    for m in sorted(graph.get(n, ())):
      if state.get(m) == 1:
        return path[path.index(m) :] + [m]
      if m not in state:
        found = visit(m)
        if found:
          return found
    state[n] = 2
    path.pop()
    return None

  for n in sorted(graph):
    if n not in state:
      found = visit(n)
      if found:
        return found
  return None


def test_no_import_circles():
  graph = _edges(_modules())
  assert "pallas_fa3.tools.aot.compiler" in graph["pallas_fa3.tools.aot.fp8"]
  assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_one():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b"}, "b": set()}) is None


# The tools (`pallas_fa3.tools`: the CLI, bench, numerics, aot and the PTX
# profile) import the library (and `models/`), never the reverse.
_TOOLS = "pallas_fa3.tools"


def test_the_library_imports_no_tool():
  modules = _modules()
  assert any(n.startswith(_TOOLS + ".") for n in modules)
  for name, path in modules.items():
    if name == _TOOLS or name.startswith(_TOOLS + "."):
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      names = []
      if isinstance(node, ast.ImportFrom) and node.module:
        names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
      elif isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      for n in names:
        assert not n.startswith(("models", "tests", _TOOLS)), (name, n)


# `pallas_fa3/__init__.py` imports its public names on first use (so that
# `import pallas_fa3` and `pallas-fa3 --help` do not import JAX): its
# `_EXPORTS` table and its TYPE_CHECKING re-exports must name the same things.
def test_lazy_exports_match_the_type_checking_reexports():
  init = ast.parse((_PACKAGE / "__init__.py").read_text())
  (block,) = [
    n
    for n in init.body
    if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
  ]
  reexports = {}
  for node in block.body:
    assert isinstance(node, ast.ImportFrom), ast.unparse(node)
    for alias in node.names:
      assert alias.asname == alias.name, ast.unparse(node)  # `x as x`
      reexports[alias.name] = node.module
  import pallas_fa3  # pylint: disable=g-import-not-at-top

  exports = dict(pallas_fa3._EXPORTS)  # pylint: disable=protected-access
  assert reexports.pop("mods") == "pallas_fa3"  # a submodule, imported too
  assert exports == reexports
  for name, module in exports.items():
    assert getattr(pallas_fa3, name) is getattr(
      importlib.import_module(module), name
    ), name
  assert set(exports) | {"mods", "__version__"} <= set(dir(pallas_fa3))
  assert sorted(pallas_fa3.__all__) == sorted([*exports, "mods"])
  namespace = {}
  exec("from pallas_fa3 import *", namespace)  # pylint: disable=exec-used
  assert set(namespace) - {"__builtins__"} == set(pallas_fa3.__all__)
  assert pallas_fa3.mods is importlib.import_module("pallas_fa3.mods")
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    _ = pallas_fa3.nope
