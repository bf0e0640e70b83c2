"""The project's pytest options: a failure anywhere fails the run; only tests marked
``flaky`` (each with its reason) are rerun, and a rerun shows in the summary."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"

# Each test fails on its first run and passes on its second: a timing flake.
FLAKES = textwrap.dedent('''
    import os
    import pytest


    def _first_run_fails(name):
        marker = os.path.join(os.environ["FLAKE_DIR"], name)
        if not os.path.exists(marker):
            open(marker, "w").close()
            raise AssertionError("first run fails")


    def test_unmarked_flake():
        _first_run_fails("unmarked")


    # Rerun once: stands for a multiprocessing test with a known timing race.
    @pytest.mark.flaky(reruns=1)
    def test_marked_flake():
        _first_run_fails("marked")
''')


def _run_with_project_options(tmp_path: Path) -> subprocess.CompletedProcess:
    (tmp_path / "test_flakes.py").write_text(FLAKES)
    env = {**os.environ, "FLAKE_DIR": str(tmp_path)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(PYPROJECT), "--rootdir", str(tmp_path), "-p", "no:cacheprovider",
         # one process: the reruns and the summary are the same under xdist, its two workers only cost start-up
         "-n", "0", str(tmp_path / "test_flakes.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_only_marked_tests_are_rerun_and_reruns_are_reported(tmp_path):
    result = _run_with_project_options(tmp_path)
    out = result.stdout
    assert result.returncode == 1, out
    assert "FAILED test_flakes.py::test_unmarked_flake" in out, out
    assert "1 failed, 1 passed, 1 rerun" in out, out
    # -rR: the rerun of the marked test is listed in the summary, so a flake stays visible.
    assert "RERUN test_flakes.py::test_marked_flake" in out, out


TESTS_DIR = Path(__file__).resolve().parents[1]
#: every rerun marker of the suite (the ones whose kill races process start-up on a loaded machine)
FLAKY = sorted(
    (str(path.relative_to(TESTS_DIR)), lineno)
    for path in TESTS_DIR.rglob("test_*.py") if path.name != Path(__file__).name
    for lineno, text in enumerate(path.read_text().splitlines()) if text.startswith("@pytest.mark.flaky(")
)


def test_the_suite_has_rerun_markers_to_check():
    assert len(FLAKY) >= 3, FLAKY  # (if they were all removed, drop this check and the one below)


@pytest.mark.parametrize("path, lineno", FLAKY)
def test_each_flaky_marker_reruns_once_and_says_why(path, lineno):
    source = (TESTS_DIR / path).read_text().splitlines()
    assert source[lineno].startswith("@pytest.mark.flaky(reruns=1)"), source[lineno]
    start = lineno
    while start > 0 and source[start - 1].startswith("@"):
        start -= 1
    assert start > 0 and source[start - 1].startswith("# Rerun once: "), (
        f"{path}:{lineno + 1}: the reason for the rerun belongs on a '# Rerun once: ...' line right above the "
        "decorators")
