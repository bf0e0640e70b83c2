"""The command line: exit codes, one-line errors, info/verify (text and --json),
and verify catching a single flipped byte."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.backends import NAME_SUFFIXES, NAMES
from helpers.images import make_jpeg, make_tree
from helpers.stores import store_records

from fastdata.cli.main import build_parser, main
from fastdata.format.manifest import read_manifest, write_manifest

CLASSES = {"cat": 5, "dog": 3, "eel": 4}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """One converted store per backend (module-scoped: read-only tests share them)."""
    base = tmp_path_factory.mktemp("cli")
    root = make_tree(base / "src", CLASSES, size=(48, 40), seed=11)
    make_jpeg(Path(root) / "dog" / "zz_bad.jpg", size=(8, 8))
    Path(root, "dog", "zz_bad.jpg").write_bytes(b"")  # one rejected input
    out = {"src": root}
    for backend, suffix in NAME_SUFFIXES:
        name = "s" + suffix
        assert main(["convert", root, str(base / name), "--workers", "2", "--shard-size", "10KB", "--quiet"]) == 0
        out[backend] = str(base / name)
    return out


def _copy(store: str, tmp_path: Path) -> str:
    dst = tmp_path / os.path.basename(store)
    shutil.copytree(store, dst)
    return str(dst)


def _one_line_error(err: str) -> str:
    err = err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err and err.startswith("fastdata: error: ")
    return err


# --- help and usage ---

def _subcommands() -> list[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return sorted(action.choices)


def test_every_subcommand_has_help(capsys):
    names = _subcommands()
    assert {"convert", "info", "verify", "demo"} <= set(names)
    for name in [None] + names:
        with pytest.raises(SystemExit) as exit_:
            main(([name] if name else []) + ["--help"])
        assert exit_.value.code == 0, name
        assert "usage:" in capsys.readouterr().out


def test_module_entry_point_and_console_script():
    run = subprocess.run([sys.executable, "-m", "fastdata", "--version"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.startswith("fastdata ")
    script = shutil.which("fastdata")
    if script:  # installed console script (editable install)
        run = subprocess.run([script, "convert", "--help"], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0 and "--shard-size" in run.stdout


# --- convert errors are one line, exit 2 ---

def test_errors_from_the_real_entry_point_are_one_line(tmp_path):
    run = subprocess.run([sys.executable, "-m", "fastdata", "convert", str(tmp_path / "missing"),
                          str(tmp_path / "o.lmdb")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "does not exist" in _one_line_error(run.stderr)


@pytest.mark.parametrize("args, expect", [
    (["{missing}", "{tmp}/o.lmdb"], "does not exist"),
    (["{src}", "{tmp}/o.zip"], "cannot tell the backend"),
    (["{src}", "{tmp}/o.lmdb", "--shard-size", "lots"], "not a size"),
    (["{src}", "{tmp}/o.lmdb", "--raw", "12xx"], "HxW"),
    (["{src}", "{tmp}/o.lmdb", "--quality", "80"], "--quality 80 only applies with --max-side"),
    (["{src}", "{tmp}/o.lmdb", "--max-side", "0"], "--max-side"),
])
def test_convert_errors_exit_2_with_one_line(tmp_path, capsys, args, expect):
    src = make_tree(tmp_path / "src", {"a": 1}, size=(8, 8))
    (Path(src) / "list.csv").write_text("a/a_000.jpg,a,oops\n")
    fill = {"missing": str(tmp_path / "missing"), "tmp": str(tmp_path), "src": src}
    assert main(["convert"] + [a.format(**fill) for a in args]) == 2
    assert expect in _one_line_error(capsys.readouterr().err)
    assert not list(tmp_path.glob("o.*"))  # nothing created on a usage error


def test_bad_list_rows_exit_2_without_a_traceback(tmp_path, capsys):
    """A list file's bad rows: one error headline naming the file (the rows may follow, one a line)."""
    src = make_tree(tmp_path / "src", {"a": 1}, size=(8, 8))
    (Path(src) / "list.csv").write_text("a/a_000.jpg,a,oops\n")
    assert main(["convert", f"{src}/list.csv", str(tmp_path / "o.lmdb")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastdata: error: ") and "list.csv" in err.splitlines()[0]
    assert "expected 2 columns" in err and "Traceback" not in err
    assert not list(tmp_path.glob("o.*"))


def test_usage_errors_exit_2(capsys):
    for argv in (["convert", "a"], ["convert", "a", "b.lmdb", "--resume", "--overwrite"], ["nonsense"],
                 ["convert", "a", "b.lmdb", "--raw", "8x8", "--max-side", "4"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert "usage:" in capsys.readouterr().err


# --- convert output ---

def test_convert_summary_and_quiet(tmp_path):
    src = make_tree(tmp_path / "src", {"a": 3, "b": 2}, size=(16, 16))
    cmd = [sys.executable, "-m", "fastdata", "convert", src, str(tmp_path / "o.h5"), "--workers", "1"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""  # no progress bar when stderr is not a terminal
    out = run.stdout
    assert "wrote 5 images" in out and "rejected 0 input(s)" in out
    assert "images/s" in out and "input " in out and "output " in out
    run = subprocess.run(cmd[:-3] + [str(tmp_path / "q.lmdb"), "--quiet", "--workers", "1"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout == "" and run.stderr == ""


def test_format_flag_overrides_suffix(stores, tmp_path):
    dst = tmp_path / "plain_dir"
    assert main(["convert", stores["src"], str(dst), "--format", "hdf5", "--quiet", "--workers", "1"]) == 0
    assert read_manifest(str(dst))["backend"] == "hdf5"
    assert list(dst.glob("shard-*.h5"))


# --- info ---

@pytest.mark.parametrize("backend", NAMES)
def test_info_json_and_text(stores, backend, capsys):
    store = stores[backend]
    assert main(["info", store, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    manifest = read_manifest(store)
    assert data["backend"] == backend and data["version"] == manifest["version"]
    assert data["storage"]["mode"] == "original"
    assert data["num_samples"] == sum(CLASSES.values())
    assert data["classes"] == [{"name": c, "index": i, "count": n} for i, (c, n) in enumerate(CLASSES.items())]
    assert data["rejected"] == 1 and data["rejected_items"][0]["path"] == "dog/zz_bad.jpg"
    assert [s["name"] for s in data["shards"]] == [s["name"] for s in manifest["shards"]]
    assert len(data["shards"]) > 1
    assert all(s["bytes"] == os.path.getsize(os.path.join(store, s["name"])) for s in data["shards"])
    assert data["total_bytes"] == sum(s["bytes"] for s in data["shards"])

    assert main(["info", store]) == 0
    text = capsys.readouterr().out
    assert f"backend:  {backend}" in text and "storage:  original" in text
    assert "12 in 3 classes; 1 input(s) rejected" in text
    for name, count in CLASSES.items():
        assert f"{name}: {count}" in text
    for s in data["shards"]:
        assert f"{s['name']}: {s['count']} records" in text


def test_info_on_a_non_store_is_one_line_exit_2(tmp_path, capsys):
    assert main(["info", str(tmp_path / "nope.lmdb")]) == 2
    _one_line_error(capsys.readouterr().err)
    (tmp_path / "half.lmdb" / ".fastdata-staging").mkdir(parents=True)
    assert main(["info", str(tmp_path / "half.lmdb")]) == 2
    assert "--resume" in _one_line_error(capsys.readouterr().err)


# --- verify ---

@pytest.mark.parametrize("backend", NAMES)
def test_verify_sound_store(stores, backend, capsys):
    assert main(["verify", stores[backend]]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["verify", stores[backend], "--decode", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["problems"] == []
    assert report["records_checked"] == report["decoded"] == sum(CLASSES.values())
    assert report["shards_checked"] == len(read_manifest(stores[backend])["shards"])


def _flip_image_byte(store: str, record_no: int) -> tuple[str, int]:
    """Flip one byte in the middle of the stored image of record ``record_no``
    (global index) by locating its bytes in the shard file. Returns (shard, local index)."""
    _, records = store_records(store)
    rec = records[record_no]
    path = os.path.join(store, rec["shard"])
    data = bytearray(Path(path).read_bytes())
    # LMDB is copy-on-write: a stale copy of a leaf page may survive in a free
    # page, so flip the byte in every copy (one of them is the live record).
    pos = data.find(rec["image"])
    assert pos >= 0
    while pos >= 0:
        data[pos + len(rec["image"]) // 2] ^= 0x10
        pos = data.find(rec["image"], pos + 1)
    Path(path).write_bytes(bytes(data))
    return rec["shard"], rec["local"]


@pytest.mark.parametrize("backend", NAMES)
@pytest.mark.parametrize("record_no", [0, 7, 11])
def test_verify_names_the_shard_and_record_of_a_flipped_byte(stores, backend, record_no, tmp_path, capsys):
    store = _copy(stores[backend], tmp_path)
    shard, local = _flip_image_byte(store, record_no)
    assert main(["verify", store]) == 1
    err = capsys.readouterr().err
    assert "DAMAGED" in err
    assert f"{shard} record {local}:" in err and "checksum mismatch" in err
    assert main(["verify", store, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert any(p.startswith(f"{shard} record {local}:") for p in report["problems"])
    # exactly that record is reported, no other one
    assert not any(" record " in p and not p.startswith(f"{shard} record {local}:") for p in report["problems"])


def test_verify_catches_a_flipped_label_byte_in_an_lmdb_record(stores, tmp_path, capsys):
    store = _copy(stores["lmdb"], tmp_path)
    shard = read_manifest(store)["shards"][0]["name"]
    path = Path(store) / shard
    data = bytes(path.read_bytes())
    needle = b"\xa5label\x00"  # msgpack: fixstr "label", positive fixint 0 (class "cat")
    assert needle in data
    path.write_bytes(data.replace(needle, b"\xa5label\x01"))  # relabel as "dog", image untouched
    assert main(["verify", store]) == 1
    assert shard in capsys.readouterr().err


def test_verify_catches_manifest_damage_and_count_mismatch(stores, tmp_path, capsys):
    store = _copy(stores["hdf5"], tmp_path)
    manifest_path = Path(store) / "manifest.json"
    original = manifest_path.read_bytes()
    manifest_path.write_bytes(original.replace(b'"cat"', b'"cot"'))
    assert main(["verify", store]) == 1
    assert "checksum mismatch" in capsys.readouterr().err
    # a consistent, correctly checksummed manifest whose per-class counts lie
    body = json.loads(original)
    body["class_counts"][0] -= 1
    body["class_counts"][1] += 1
    write_manifest(store, body)
    assert main(["verify", store]) == 1
    assert "per-class counts" in capsys.readouterr().err


def test_verify_reports_a_missing_or_truncated_shard(stores, tmp_path, capsys):
    store = _copy(stores["lmdb"], tmp_path)
    shards = [s["name"] for s in read_manifest(store)["shards"]]
    os.unlink(os.path.join(store, shards[0]))
    with open(os.path.join(store, shards[1]), "r+b") as fh:
        fh.truncate(4096)
    assert main(["verify", store]) == 1
    err = capsys.readouterr().err
    assert f"{shards[0]}: shard file missing" in err and f"{shards[1]}: file is 4096 bytes" in err


def test_verify_of_a_non_store_fails(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "nope.h5")]) != 0
    assert "nope.h5" in capsys.readouterr().err
