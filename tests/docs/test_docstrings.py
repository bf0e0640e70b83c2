"""Module docstrings say what a module is and why in a few lines; specifications, guides and
measurements live in docs/ (the site) and benchmarks/, where the docs tests keep them true.

The modules whose docstrings are still longer are listed with their current length: the list may
only shrink (a docstring that grows past it, or a new long one, fails here).
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers.docblocks import ROOT

#: the most lines a module docstring may have
MAX_LINES = 40
#: longer docstrings not yet moved into docs/, at most this many lines each
STILL_LONG = {
    "fastdata/writer/sources/volumes/__init__.py": 122,  # the NIfTI and TIFF conversion rules
    "fastdata/writer/sources/coco.py": 59,
    "fastdata/writer/sources/table/reader.py": 59,
    "fastdata/writer/remote_sink.py": 42,
}


def docstring_lines(source: str) -> int:
    doc = ast.get_docstring(ast.parse(source), clean=False)
    return doc.count("\n") + 1 if doc else 0


def too_long(root: Path) -> dict[str, int]:
    found = {}
    for module in sorted((root / "fastdata").rglob("*.py")):
        rel = module.relative_to(root).as_posix()
        lines = docstring_lines(module.read_text(encoding="utf-8"))
        if lines > STILL_LONG.get(rel, MAX_LINES):
            found[rel] = lines
    return found


def test_module_docstrings_are_short():
    assert too_long(ROOT) == {}, f"module docstrings over {MAX_LINES} lines: move the detail into docs/"


def test_the_long_ones_still_exist():
    """An entry for a module that is gone (or already short) is removed, so the list only shrinks."""
    for rel in STILL_LONG:
        assert (ROOT / rel).is_file(), rel
        assert docstring_lines((ROOT / rel).read_text(encoding="utf-8")) > MAX_LINES, f"{rel} is short now: drop it"


def test_control_a_long_docstring_is_found(tmp_path):
    module = tmp_path / "fastdata" / "reader" / "x.py"
    module.parent.mkdir(parents=True)
    module.write_text('"""' + "line\n" * (MAX_LINES + 1) + '"""\n')
    (tmp_path / "fastdata" / "short.py").write_text('"""One line."""\n')
    assert too_long(tmp_path) == {"fastdata/reader/x.py": MAX_LINES + 2}
