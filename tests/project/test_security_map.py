"""docs/SECURITY.md's table of the hostile-sources cases names a regression test for each: every
test it names exists (a renamed or deleted test would leave a promise without its check), and
every item of the review (1 to 14) has a row."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Issue 36: every case and its regression test"


def _rows() -> list[tuple[int, list[tuple[str, str]]]]:
    text = (ROOT / "docs" / "SECURITY.md").read_text()
    assert SECTION in text, f"docs/SECURITY.md lost its section {SECTION!r}"
    rows = []
    for line in text.split(SECTION, 1)[1].splitlines():
        m = re.match(r"\| (\d+) \| [^|]+ \| (.+) \|$", line)
        if not m:
            continue
        tests, current = [], ""
        for ref in re.findall(r"`([^`]+)`", m.group(2)):
            path, _, name = ref.rpartition("::")
            current = path or current  # `::name` continues the file before it
            tests.append((current, name))
        rows.append((int(m.group(1)), tests))
    return rows


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_every_case_names_tests_that_exist():
    rows = _rows()
    assert {item for item, _ in rows} == set(range(1, 15))
    missing = []
    for item, tests in rows:
        assert tests, f"case {item}: no test named"
        for path, name in tests:
            file = ROOT / path
            if not file.is_file() or name not in _test_names(file):
                missing.append(f"{path}::{name} (case {item})")
    assert not missing, f"docs/SECURITY.md names tests that do not exist: {missing}"


def test_control_a_renamed_test_is_found_missing(tmp_path):
    fake = tmp_path / "test_x.py"
    fake.write_text("def test_renamed():\n    pass\n")
    assert "test_original" not in _test_names(fake) and "test_renamed" in _test_names(fake)
