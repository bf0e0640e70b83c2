"""OpenCV and matplotlib are optional (the ``bench`` extra): the core never imports them,
and what needs them says, in one line, which extra to install.

Each check runs in a fresh interpreter where importing ``cv2`` / ``matplotlib`` fails,
as on a machine that installed only ``pip install fastdata``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python < 3.11: pytest itself depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
OPTIONAL = ("cv2", "matplotlib")
INSTALL_HINT = 'pip install "fastdata[bench]"'

# sys.modules[name] = None makes `import name` raise ImportError, like a missing package.
BLOCKER = "import sys\nfor _name in {names!r}:\n    sys.modules[_name] = None\n"


def _run_blocked(code: str, blocked=OPTIONAL, cwd: Path | None = None) -> subprocess.CompletedProcess:
    script = BLOCKER.format(names=tuple(blocked)) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180,
                          cwd=cwd or ROOT)


def _cli(args: list[str]) -> str:
    return f"from fastdata.cli.main import main\nsys.exit(main({args!r}))\n"


def test_control_the_blocker_makes_imports_fail():
    result = _run_blocked("import cv2\n")
    assert result.returncode != 0 and "ModuleNotFoundError: import of cv2 halted" in result.stderr, result.stderr


def test_core_imports_without_opencv_or_matplotlib():
    result = _run_blocked("""
        import fastdata
        fastdata.convert, fastdata.open_dataset
        import fastdata.transforms, fastdata.tools.verify, fastdata.cli.main
        leaked = sorted(name for name in sys.modules if name.split(".")[0] in ("cv2", "matplotlib")
                        and sys.modules[name] is not None)
        assert not leaked, leaked
        print("ok")
    """)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


@pytest.mark.parametrize("command", ["convert", "info", "verify"])
def test_core_commands_help_without_opencv_or_matplotlib(command):
    result = _run_blocked(_cli([command, "--help"]))
    assert result.returncode == 0, result.stderr
    assert "usage: fastdata " + command in result.stdout


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """A two-class LMDB store converted by the CLI with OpenCV and matplotlib blocked."""
    from PIL import Image

    root = tmp_path_factory.mktemp("optional")
    for cls in ("a", "b"):
        (root / "src" / cls).mkdir(parents=True)
        Image.new("RGB", (8, 8), (10, 20, 30)).save(root / "src" / cls / "x.jpg")
    dst = root / "out.lmdb"
    result = _run_blocked(_cli(["convert", str(root / "src"), str(dst), "--workers", "1"]))
    assert result.returncode == 0, result.stderr
    return dst


def test_core_convert_and_verify_run_without_opencv_or_matplotlib(store):
    check = _run_blocked(_cli(["verify", str(store)]))
    assert check.returncode == 0, check.stderr


def _one_line_hint(result: subprocess.CompletedProcess, package: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0
    assert len(lines) == 1, result.stderr  # no traceback
    assert INSTALL_HINT in lines[0] and package in lines[0], lines[0]
    return lines[0]


def test_demo_without_opencv_names_the_extra(tmp_path):
    result = _run_blocked(_cli(["demo", "--size", "tiny", "--out", str(tmp_path / "demo")]), blocked=("cv2",))
    line = _one_line_hint(result, "opencv-python-headless")
    assert line.startswith("fastdata: error: fastdata demo needs")
    assert not (tmp_path / "demo").exists(), "the demo started work before checking its dependencies"


def test_demo_without_matplotlib_names_the_extra(tmp_path):
    result = _run_blocked(_cli(["demo", "--size", "tiny", "--out", str(tmp_path / "demo")]),
                          blocked=("matplotlib",))
    _one_line_hint(result, "matplotlib")


def test_bench_plots_without_matplotlib_fail_before_measuring(store, tmp_path):
    result = _run_blocked(_cli(["bench", str(store), "--out", str(tmp_path / "b")]), blocked=("matplotlib",))
    line = _one_line_hint(result, "matplotlib")
    assert "--no-plots" in line
    assert not (tmp_path / "b").exists(), "the benchmark ran before checking for matplotlib"


def test_synth_without_opencv_raises_an_import_error_naming_the_extra():
    result = _run_blocked("""
        from fastdata.common.extras import MissingExtraError
        try:
            import fastdata.synth
        except ImportError as err:
            assert isinstance(err, MissingExtraError)
            print(err)
    """, blocked=("cv2",))
    assert result.returncode == 0, result.stderr
    assert INSTALL_HINT in result.stdout and "opencv-python-headless" in result.stdout


def test_pyproject_keeps_opencv_and_matplotlib_out_of_the_core():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(requirements):
        return {req.split(">")[0].split("=")[0].split("[")[0].strip() for req in requirements}

    extras = project["optional-dependencies"]
    assert not names(project["dependencies"]) & {"opencv-python-headless", "matplotlib"}
    assert {"opencv-python-headless", "matplotlib"} <= names(extras["bench"])
    assert {"opencv-python-headless", "matplotlib"} <= names(extras["test"])  # the tests use both
