"""benchmarks/sass_fingerprints.py tells identical SASS from SASS that
differs only in register names and from other code (what the issue-66
refactors were checked with)."""

from __future__ import annotations

import json

from benchmarks import sass_fingerprints as fp

A = "/*0010*/  FMUL R4, R2, R3 ;\n/*0020*/  @P0 BRA `(.L_1) ;\n"
RENAMED = "/*0090*/  FMUL R7, R5, R6 ;\n/*00a0*/  @P1 BRA `(.L_1) ;\n"
OTHER = "/*0010*/  FFMA R4, R2, R3, R4 ;\n/*0020*/  @P0 BRA `(.L_1) ;\n"


def _record(path, texts):
  with path.open("w") as f:
    for i, t in enumerate(texts):
      sass = [("k.sass_ctrl", fp._digest(t, True), fp._digest(t, False))]
      kernel = dict(name="k", regs=168, spill=(0, 0), loop=len(t))
      f.write(json.dumps(dict(item=f"x:{i}", kernels=[kernel], sass=sass)))
      f.write("\n")


def test_compare_classifies_identical_renamed_and_changed(tmp_path, capsys):
  before, after = tmp_path / "b.jsonl", tmp_path / "a.jsonl"
  _record(before, [A, A, A])
  _record(after, [A, RENAMED, OTHER])
  counts = fp.compare(before, after)
  assert counts == dict(identical=1, registers_only=1, changed=1, errors=0)
  assert "x:2 k" in capsys.readouterr().out


def test_item_lists_expand_ranges():
  assert fp._items("flex:3-5,9") == ["flex:3", "flex:4", "flex:5", "flex:9"]
