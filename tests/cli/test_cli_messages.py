"""What the CLI and API say about bad input: missing paths, remote URLs, size units
(decimal vs binary, printed back as written), shard-size and --workers limits, and
verify on something that is not a (finished) store, each with its own exit code."""

from __future__ import annotations

import importlib
import json
import os
import sys
import subprocess
from pathlib import Path

import pytest
from helpers.images import make_tree

import fastdata
from fastdata.bench.grid import target_kind
from fastdata.cli.main import EXIT_NOT_A_STORE, EXIT_UNFINISHED, main
from fastdata.common import portable
from fastdata.common.units import Size, describe_size, parse_size, parse_size_spec
from fastdata.errors import FastdataError, PathNotFoundError
from fastdata.reader.dataset import HDF5ImageDataset, LMDBImageDataset
from fastdata.tools.verify import verify

options_module = importlib.import_module("fastdata.writer.options")
session_module = importlib.import_module("fastdata.writer.session")


@pytest.fixture
def src(tmp_path) -> str:
    return make_tree(tmp_path / "src", {"a": 3, "b": 3}, size=(32, 24))


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("fastdata: error: "), err
    return err


# --- size units ---

@pytest.mark.parametrize("text, expected, shown", [
    ("2g", 2_000_000_000, "2 GB (2,000,000,000 bytes)"),
    ("2GB", 2_000_000_000, "2 GB (2,000,000,000 bytes)"),
    ("2 gb", 2_000_000_000, "2 GB (2,000,000,000 bytes)"),
    ("2GiB", 2 * 1024**3, "2 GiB (2,147,483,648 bytes)"),
    ("512MiB", 512 * 1024**2, "512 MiB (536,870,912 bytes)"),
    ("1.5GiB", 1536 * 1024**2, "1.5 GiB (1,610,612,736 bytes)"),
    ("40k", 40_000, "40 kB (40,000 bytes)"),
    ("250000000", 250_000_000, "250,000,000 bytes"),
])
def test_size_units_decimal_and_binary_printed_back_as_written(text, expected, shown):
    size = parse_size_spec(text)
    assert size.bytes == parse_size(text) == expected
    assert str(size) == shown


def test_describe_size_picks_an_exact_unit():
    assert describe_size(4 * 1024**2) == "4 MiB (4,194,304 bytes)"
    assert describe_size(3_000_000) == "3 MB (3,000,000 bytes)"
    assert describe_size(4001) == "4,001 bytes"
    assert str(Size(2_000_000_000, "GB")) == "2 GB (2,000,000,000 bytes)"


@pytest.mark.parametrize("bad", ["lots", "2XB", "-1G", "0", ""])
def test_bad_sizes_say_what_a_size_looks_like(bad):
    with pytest.raises(ValueError, match="not a size|must be positive"):
        parse_size(bad)


def test_convert_summary_prints_the_shard_size_as_written(src, tmp_path, capsys):
    assert main(["convert", src, str(tmp_path / "o.lmdb"), "--shard-size", "2m", "--workers", "1"]) == 0
    assert "shard size 2 MB (2,000,000 bytes)" in capsys.readouterr().out
    assert main(["convert", src, str(tmp_path / "p.lmdb"), "--shard-size", "2MiB", "--workers", "1"]) == 0
    assert "shard size 2 MiB (2,097,152 bytes)" in capsys.readouterr().out


# --- shard-size limits ---

def test_shard_size_below_1_MiB_is_refused_saying_what_to_pick(src, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("FASTDATA_MIN_SHARD_SIZE", raising=False)  # the test suite lowers the floor
    assert main(["convert", src, str(tmp_path / "o.lmdb"), "--shard-size", "40KB"]) == 2
    err = one_line_error(capsys)
    assert "shard size 40 kB (40,000 bytes) is below the 1 MiB (1,048,576 bytes) minimum" in err
    assert "--shard-size 256MiB" in err
    assert not (tmp_path / "o.lmdb").exists()
    assert main(["convert", src, str(tmp_path / "o.lmdb"), "--shard-size", "1MiB", "--quiet"]) == 0  # control


def test_more_than_10k_shards_is_refused_with_a_size_that_fits(src, tmp_path, capsys, monkeypatch):
    # a real 10,001-shard conversion needs over 10 GB; the limit is lowered to 2 shards here
    monkeypatch.setattr(options_module, "MAX_SHARDS", 2)
    assert main(["convert", src, str(tmp_path / "o.lmdb"), "--shard-size", "2kB"]) == 2
    err = one_line_error(capsys)
    assert "shard size 2 kB (2,000 bytes) would split" in err and "more than 2)" in err
    assert "pick at least --shard-size 1MiB" in err
    assert not (tmp_path / "o.lmdb").exists()
    assert main(["convert", src, str(tmp_path / "o.lmdb"), "--shard-size", "1MiB", "--quiet"]) == 0  # control


# --- --workers ---

def test_negative_workers_is_an_error(src, tmp_path, capsys):
    assert main(["convert", src, str(tmp_path / "o.lmdb"), "--workers", "-2"]) == 2
    assert "workers must be 0 (no worker processes: everything runs in this process) or a positive number" in \
        one_line_error(capsys)
    assert not (tmp_path / "o.lmdb").exists()


def test_workers_far_above_the_core_count_is_warned_about(src, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(portable, "available_cores", lambda: 1)
    assert main(["convert", src, str(tmp_path / "o.lmdb"), "--workers", "5", "--quiet"]) == 0
    assert "warning: --workers 5 is more than 4x the 1 core(s)" in capsys.readouterr().err
    assert main(["convert", src, str(tmp_path / "p.lmdb"), "--workers", "4", "--quiet"]) == 0  # control: 4x is fine
    assert capsys.readouterr().err == ""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2,
                    reason="needs CPU affinity (Linux) and 2 cores")
def test_default_workers_are_the_cores_this_process_may_run_on(src, tmp_path):
    """Under a CPU affinity of one core (taskset, a container's cpuset) a conversion's default is one
    worker process, not one per core of the machine. Control: without the affinity, os.cpu_count()."""
    code = ("import os, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}) if sys.argv[1] == 'pinned' "
            "else None; from fastdata.writer.options import resolve_workers; print(resolve_workers(None)[0])")
    pinned = subprocess.run([sys.executable, "-c", code, "pinned"], capture_output=True, text=True, check=True)
    free = subprocess.run([sys.executable, "-c", code, "free"], capture_output=True, text=True, check=True)
    assert int(pinned.stdout) == 1
    assert int(free.stdout) == len(os.sched_getaffinity(0)) >= 2


# --- missing paths and remote URLs ---

def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


@pytest.mark.parametrize("url", ["s3://bucket/train",
                                 # gcsfs retries an unreachable server 6 times with backoff (about 35 s a
                                 # command, 6 commands): nightly
                                 pytest.param("gs://bucket/train.lmdb",
                                              marks=[pytest.mark.slow, pytest.mark.timeout(900)]),
                                 "https://127.0.0.1:{port}/t.lmdb", "az://container/x"])
def test_remote_urls_are_taken_as_stores_everywhere(src, tmp_path, capsys, monkeypatch, url):
    """Every read command takes a URL as a store: an unreachable one (or one whose filesystem
    is not installed) is one line naming it, never a folder named 's3:' made on the way; a
    URL as convert's SOURCE is refused."""
    url = url.format(port=_closed_port())
    for key, value in (("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_closed_port()}"), ("AWS_ACCESS_KEY_ID", "k"),
                       ("AWS_SECRET_ACCESS_KEY", "s"), ("AWS_REGION", "us-east-1"), ("FASTDATA_REMOTE_RETRIES", "0"),
                       ("FASTDATA_CACHE_DIR", str(tmp_path / "cache"))):
        monkeypatch.setenv(key, value)
    # one attempt: botocore's max_attempts counts the retries (1 was another attempt after a ~0.5 s backoff)
    quick = {"config_kwargs": {"retries": {"max_attempts": 0}}} if url.startswith("s3:") else {}
    flags = ["--storage-option", f"config_kwargs={json.dumps(quick['config_kwargs'])}"] if quick else []
    assert main(["convert", url, str(tmp_path / "o.lmdb"), *flags]) == 2  # (botocore's own retries: 11-18 s)
    assert url in one_line_error(capsys)
    for argv in (["info", url, *flags], ["verify", url, *flags],
                 ["bench", url, "--no-plots", "--out", str(tmp_path / "b"), *flags],
                 ["tune", url, "--memory-budget", "1GiB", "--out", str(tmp_path / "t"), *flags]):
        code = main(argv)
        assert code == 2, argv
        err = one_line_error(capsys)
        assert url in err and "not supported" not in err, argv
        if url.startswith("https:") and argv[0] in ("info", "verify"):
            # fsspec's HTTP filesystem reports a refused connection as a missing file: not "not a store"
            assert "cannot reach the server" in err, argv
    for open_store in (fastdata.open_dataset, LMDBImageDataset, HDF5ImageDataset):
        with pytest.raises(FastdataError, match=url.replace(".", r"\.")):
            open_store(url, storage_options=quick)
    with pytest.raises(FastdataError, match=url.replace(".", r"\.")):
        target_kind(url, {"storage_options": quick})
    made = [d for _, dirs, _ in os.walk(tmp_path) for d in dirs] + os.listdir(".")
    assert not [d for d in made if d.endswith(":")], "a URL was taken for a local path (a folder named 's3:')"


def test_missing_paths_say_does_not_exist(src, tmp_path, capsys):
    missing = str(tmp_path / "nothere.lmdb")
    for argv in (["convert", missing, str(tmp_path / "o.lmdb")], ["info", missing], ["verify", missing]):
        assert main(argv) == 2, argv
        assert f"{missing} does not exist" in one_line_error(capsys), argv
    for open_store in (fastdata.open_dataset, LMDBImageDataset, target_kind):
        with pytest.raises(PathNotFoundError, match="does not exist"):
            open_store(missing)
    assert isinstance(PathNotFoundError("x"), FastdataError)


# --- verify: not a store, unfinished, damaged ---

def test_verify_on_a_folder_that_is_not_a_store(tmp_path, capsys):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "a.jpg").write_bytes(b"x")
    assert main(["verify", str(folder)]) == EXIT_NOT_A_STORE == 3
    err = capsys.readouterr().err
    assert "not a fastdata store: no manifest.json" in err and "DAMAGED" not in err
    assert main(["verify", str(folder / "a.jpg")]) == EXIT_NOT_A_STORE
    assert "not a fastdata store: not a directory" in capsys.readouterr().err
    assert main(["verify", str(folder), "--json"]) == EXIT_NOT_A_STORE
    assert json.loads(capsys.readouterr().out)["status"] == "not_a_store"


def test_verify_on_an_unfinished_conversion_says_how_to_finish_it(src, tmp_path, capsys, monkeypatch):
    dst = tmp_path / "out.h5"

    def ctrl_c(**kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(session_module, "run_shards", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        fastdata.convert(src, str(dst), workers=1, progress=False)
    monkeypatch.undo()
    assert main(["verify", str(dst)]) == EXIT_UNFINISHED == 4
    err = capsys.readouterr().err
    assert f"unfinished conversion: finish it by converting {src} to {dst} again with --resume" in err
    assert "DAMAGED" not in err
    assert verify(str(dst)).status == "unfinished"
    # and the command it prints works
    assert main(["convert", src, str(dst), "--resume", "--quiet"]) == 0
    assert main(["verify", str(dst)]) == 0


def test_verify_damage_is_still_exit_1(src, tmp_path, capsys):
    dst = tmp_path / "out.lmdb"
    fastdata.convert(src, str(dst), workers=1, progress=False)
    shard = next(Path(dst).glob("shard-*.lmdb"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["verify", str(dst)]) == 1
    assert "DAMAGED" in capsys.readouterr().err
    assert verify(str(dst)).status == "damaged"


def test_verify_help_documents_the_exit_codes(capsys):
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for phrase in ("Exit 0 when sound", "1 when damaged", "3 when the path is not a fastdata store",
                   "4 when it holds an unfinished conversion"):
        assert phrase in text
