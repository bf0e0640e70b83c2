"""The package's metadata as the wheel carries it (issue 38): one version source, ``py.typed``, the
Pythons declared, a changelog.

The wheel itself is built, installed into a fresh venv and smoke-tested by ``.ci/run`` (and on
3.12, 3.13 and the oldest torch by ``.ci/nightly``) with ``scripts/wheel_smoke.py``; these checks
are the cheap part, read from the checkout.
"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import fastdata

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PROJECT = PYPROJECT["project"]
PYTHONS = ("3.11", "3.12", "3.13")


def test_the_version_has_one_source():
    assert "version" not in PROJECT, "pyproject.toml repeats the version: it is read from fastdata/_version.py"
    assert "version" in PROJECT.get("dynamic", [])
    setuptools = PYPROJECT["tool"]["setuptools"]
    assert setuptools["dynamic"]["version"] == {"attr": "fastdata._version.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|(a|b|rc)\d+)?", fastdata.__version__)
    # the installed metadata (built from the same source when the package was installed)
    assert importlib.metadata.version("fastdata") == fastdata.__version__


def test_py_typed_ships():
    assert (Path(fastdata.__file__).parent / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["fastdata"]


def test_the_pythons_tested_are_declared():
    classifiers = PROJECT["classifiers"]
    declared = sorted(c.rpartition(":: ")[2] for c in classifiers
                      if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c))
    assert declared == list(PYTHONS)
    assert PROJECT["requires-python"] == f">={PYTHONS[0]}"
    assert "Typing :: Typed" in classifiers
    assert PYPROJECT["tool"]["ruff"]["target-version"] == "py" + PYTHONS[0].replace(".", "")
    nightly = (ROOT / ".ci" / "nightly").read_text(encoding="utf-8")
    assert "${NIGHTLY_PYTHONS-" + " ".join(PYTHONS[1:]) + "}" in nightly, "the Pythons after the floor run nightly"


def test_ci_builds_and_smoke_tests_the_wheel():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "python -m build" in ci and "twine check" in ci
    assert "scripts/wheel_smoke.py" in ci and (ROOT / "scripts" / "wheel_smoke.py").is_file()
    extras = PROJECT["optional-dependencies"]["lint"]  # what .ci/run installs beside the tests
    assert {re.split(r"[<>=]", r)[0] for r in extras} >= {"build", "twine"}


def test_the_changelog_has_an_unreleased_section_and_the_current_version():
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## \[([^\]]+)\]", changelog, re.MULTILINE)
    assert headings and headings[0] == "Unreleased", "the first section is Unreleased"
    assert fastdata.__version__ in headings, f"CHANGELOG.md has no section for {fastdata.__version__}"
