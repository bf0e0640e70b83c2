"""The files the README, docs/ and the package's docstrings name (tests, benchmarks, examples, modules) exist.

Tests moved into subfolders once and the docs kept pointing at the old paths for weeks; a
reader following ``tests/test_lock.py`` found nothing. This reads every backquoted or linked
path under ``tests/``, ``benchmarks/``, ``examples/``, ``fastdata/``, ``scripts/`` and ``docs/``
in the documents (README.md, every page of the documentation site, benchmarks/*.md) and in every
docstring of the package, and checks it is in the checkout.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "benchmarks").glob("*.md")), *sorted((ROOT / "docs").rglob("*.md"))]
#: a repository path with a file suffix, e.g. ``tests/writer/test_lock.py`` or ``docs/FORMAT.md``
PATH = re.compile(r"(?<![\w./-])((?:tests|benchmarks|examples|fastdata|scripts|docs)/[\w./-]*\w\.(?:py|md|sh))\b")


#: files the benchmarks write (named as their output, not kept in the repository)
GENERATED = ("benchmarks/results/",)


def named_paths(text: str) -> set[str]:
    """Repository paths named in ``text`` (outputs under :data:`GENERATED` left out)."""
    return {p for p in PATH.findall(text) if not p.startswith(GENERATED)}


def test_every_path_the_documents_name_exists():
    missing = {}
    for doc in DOCUMENTS:
        absent = sorted(p for p in named_paths(doc.read_text(encoding="utf-8")) if not (ROOT / p).exists())
        if absent:
            missing[doc.relative_to(ROOT).as_posix()] = absent
    assert not missing, f"documents name files that are not in the repository: {missing}"


def docstrings(path: Path) -> list[tuple[int, str]]:
    """Every docstring of a module (its own, its classes' and functions'), with its line."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                found.append((getattr(node, "lineno", 1), doc))
    return found


def test_every_path_a_docstring_names_exists():
    missing = []
    for module in sorted((ROOT / "fastdata").rglob("*.py")):
        for line, doc in docstrings(module):
            missing += [f"{module.relative_to(ROOT).as_posix()}:{line}: {p}" for p in sorted(named_paths(doc))
                        if not (ROOT / p).exists()]
    assert not missing, f"docstrings name files that are not in the repository: {missing}"


def test_the_site_pages_and_benchmark_history_are_read():
    names = {d.relative_to(ROOT).as_posix() for d in DOCUMENTS}
    assert {"docs/guides/sources.md", "benchmarks/HISTORY.md", "docs/FORMAT.md", "README.md"} <= names


def test_control_a_stale_path_is_found_and_a_real_one_passes():
    text = "see `tests/test_lock.py` and [the lock test](tests/writer/test_lock.py), run benchmarks/run_all.sh"
    found = named_paths(text)
    assert found == {"tests/test_lock.py", "tests/writer/test_lock.py", "benchmarks/run_all.sh"}
    assert [p for p in sorted(found) if not (ROOT / p).exists()] == ["tests/test_lock.py"]
    assert named_paths("the fastdata/ package, python -m fastdata.cli, benchmarks/results/x.md") == set()
