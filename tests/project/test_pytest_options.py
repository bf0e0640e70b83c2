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
         str(tmp_path / "test_flakes.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_only_marked_tests_are_rerun_and_reruns_are_reported(tmp_path):
    result = _run_with_project_options(tmp_path)
    out = result.stdout
    assert result.returncode == 1, out
    assert "FAILED test_flakes.py::test_unmarked_flake" in out, out
    assert "1 failed, 1 passed, 1 rerun" in out, out
    # -rR: the rerun of the marked test is listed in the summary, so a flake stays visible.
    assert "RERUN test_flakes.py::test_marked_flake" in out, out


@pytest.mark.parametrize("path, name", [
    ("reader/test_reader_stress.py", "test_killed_workers_then_fresh_loader_works_and_nothing_accumulates"),
    ("writer/test_reliability_crash.py", "test_crash_loop_sigkill_and_ctrl_c_then_resume"),
    ("writer/test_reliability_crash.py", "test_dataloader_workers_sigkilled_repeatedly"),
])
def test_each_flaky_marker_says_why(path, name):
    source = (Path(__file__).parents[1] / path).read_text().splitlines()
    line = next(i for i, text in enumerate(source) if text.startswith(f"def {name}("))
    decorators = source[:line]
    start = max(i for i, text in enumerate(decorators) if not text.startswith("@")) + 1
    marks = decorators[start - 1 : line]
    assert any(text.startswith("@pytest.mark.flaky(reruns=1)") for text in marks), marks
    assert marks[0].startswith("# Rerun once: "), "the reason for the rerun belongs right above the marker"
