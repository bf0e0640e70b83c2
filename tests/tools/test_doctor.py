"""``fastdata doctor module:attribute``: loading the object, the report, exit codes."""

from __future__ import annotations

import sys
import textwrap

import pytest

import fastdata
from fastdata.bench.doctor import load_object
from fastdata.cli.main import main
from fastdata.errors import FastdataError

MODULE = textwrap.dedent('''
    import numpy as np
    import torch


    class Clean(torch.utils.data.Dataset):
        """Per-sample data in numpy arrays: nothing for doctor to report."""

        def __init__(self):
            self.labels = np.arange(5000, dtype=np.int64)

        def __len__(self):
            return len(self.labels)

        def __getitem__(self, i):
            return np.zeros(3, dtype=np.float32), int(self.labels[i])


    class Leaky(Clean):
        """A list of per-sample tuples (copy-on-write growth) and an open file (fork hazard)."""

        def __init__(self):
            super().__init__()
            self.samples = [(f"/data/img_{i}.jpg", i % 10) for i in range(5000)]
            self.log = open(__file__)


    def make_leaky():
        return Leaky()


    class NeedsArgs(Clean):
        def __init__(self, root):
            super().__init__()


    def broken_factory():
        raise RuntimeError("no data here")


    clean_instance = Clean()
    STORE = None


    def store_dataset():
        return __import__("fastdata").open_dataset(STORE, output="numpy")
''')


@pytest.fixture
def userpkg(tmp_path, monkeypatch):
    """A user module ``userdata`` importable from the working directory, as doctor expects."""
    (tmp_path / "userdata.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    yield "userdata"
    sys.modules.pop("userdata", None)


def test_clean_dataset_exits_0(userpkg, capsys):
    assert main(["doctor", f"{userpkg}:Clean"]) == 0
    assert "no hazards found" in capsys.readouterr().out
    assert main(["doctor", f"{userpkg}:clean_instance"]) == 0


def test_hazards_exit_1_with_fixes(userpkg, capsys):
    assert main(["doctor", f"{userpkg}:Leaky"]) == 1
    out = capsys.readouterr().out
    assert "[python_container] dataset.samples" in out
    assert "[open_handle] dataset.log" in out
    assert out.count("fix:") >= 2
    assert main(["doctor", f"{userpkg}:make_leaky"]) == 1  # a factory is called
    capsys.readouterr()
    # control: raising the container threshold above its size leaves only the file handle
    assert main(["doctor", f"{userpkg}:Leaky", "--threshold", "10000"]) == 1
    out = capsys.readouterr().out
    assert "python_container" not in out and "open_handle" in out


def test_fastdata_dataset_is_clean(userpkg, tmp_path, jpeg_tree, capsys):
    src = jpeg_tree(tmp_path / "src", {"a": 3, "b": 3})
    store = tmp_path / "s.lmdb"
    fastdata.convert(src, str(store), workers=1, progress=False)
    load_object(f"{userpkg}:Clean")  # imports the module
    sys.modules[userpkg].STORE = str(store)
    assert main(["doctor", f"{userpkg}:store_dataset"]) == 0, capsys.readouterr().out


@pytest.mark.parametrize("spec, words", [
    ("userdata:NeedsArgs", "needs arguments (root)"),
    ("userdata:broken_factory", "no data here"),
    ("userdata:missing", "no attribute"),
    ("nosuchmodule_xyz:thing", "cannot import nosuchmodule_xyz"),
    ("userdata", "expected module:attribute"),
])
def test_cannot_load_exits_2_with_one_line(userpkg, capsys, spec, words):
    assert main(["doctor", spec]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err
    with pytest.raises(FastdataError):
        load_object(spec)


@pytest.fixture
def user_file(tmp_path, monkeypatch):
    """``proj/code/filedata.py`` (importing its sibling ``filehelper.py``), run from elsewhere."""
    code = tmp_path / "proj" / "code"
    code.mkdir(parents=True)
    (code / "filehelper.py").write_text("SIZE = 5000\n")
    (code / "filedata.py").write_text("from filehelper import SIZE  # a sibling import\n" + MODULE)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the loader adds the file's folder
    yield code / "filedata.py"
    for name in ("filedata", "filehelper"):
        sys.modules.pop(name, None)


def test_file_path_spec_is_accepted(user_file, capsys):
    relative = "../proj/code/filedata.py"
    assert main(["doctor", f"{relative}:Clean"]) == 0, capsys.readouterr().err
    assert "no hazards found" in capsys.readouterr().out
    assert main(["doctor", f"{user_file}:Leaky"]) == 1  # absolute path, same module
    assert "[open_handle] dataset.log" in capsys.readouterr().out
    assert type(load_object(f"{relative}:make_leaky")).__name__ == "Leaky"
    # control: the same file as a module name is not importable from here
    with pytest.raises(FastdataError, match="cannot import filedata_not_on_path"):
        load_object("filedata_not_on_path:Clean")


@pytest.mark.parametrize("spec, words", [
    ("missing_dir/nothere.py:Clean", "does not exist"),
    ("{file}:nothing", "no attribute"),
    ("{folder}:Clean", "expected a Python file"),
])
def test_bad_file_spec_exits_2_with_one_line(user_file, capsys, spec, words):
    spec = spec.format(file=user_file, folder=user_file.parent)
    assert main(["doctor", spec]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
