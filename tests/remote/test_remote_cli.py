"""The read-side commands on remote stores (info, verify, bench, tune) and ``fastdata cache``,
against a real S3-compatible server (SeaweedFS, tests/helpers/s3server.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
from helpers.images import make_small_tree
from helpers.procs import reaped
from test_remote_read import upload_store

import fastdata
from fastdata.cli.main import EXIT_FAILED_CHECK, EXIT_NOT_A_STORE, main
from fastdata.remote.location import RemoteLocation

#: botocore retries a refused connection on its own; one attempt keeps the unreachable tests quick
#: (its ``max_attempts`` counts the retries: 1 was a second attempt after a backoff of about 0.5 s)
ONE_ATTEMPT = 'config_kwargs={"retries": {"max_attempts": 0}}'


def cached_shard_files(cache_dir) -> list[str]:
    """Every file in the cache's shards/ folders (finished shards and downloads in progress)."""
    return sorted(os.path.join(d, f) for d, _, files in os.walk(cache_dir) if os.path.basename(d) == "shards"
                  for f in files)


@pytest.fixture(scope="module")
def local_store(tmp_path_factory) -> str:
    """A small multi-shard LMDB store of the small tree, converted once for the module (the
    tests read it, never write it)."""
    root = tmp_path_factory.mktemp("remote-cli")
    local = str(root / "train.lmdb")
    fastdata.convert(make_small_tree(root / "small_tree"), local, shard_size="20kB", progress=False)
    return local


@pytest.fixture
def remote_store(s3, local_store):
    """The small multi-shard LMDB store, uploaded to this test's bucket; returns (url, local path,
    cache dir)."""
    _, bucket = s3
    local = local_store
    url = f"{bucket}/train.lmdb"
    upload_store(local, url)
    return url, local, os.environ["FASTDATA_CACHE_DIR"]


def test_info_reads_the_manifest_and_downloads_no_shard(remote_store, capsys):
    url, local, cache_dir = remote_store
    assert main(["info", url, "--json"]) == 0
    remote = json.loads(capsys.readouterr().out)
    expected = fastdata.info(local)
    assert remote["path"] == url
    assert {k: remote[k] for k in ("num_samples", "shards", "classes", "backend")} == \
        {k: expected[k] for k in ("num_samples", "shards", "classes", "backend")}
    assert len(remote["shards"]) > 1
    assert main(["info", url]) == 0
    assert f"store:    {url}" in capsys.readouterr().out
    assert cached_shard_files(cache_dir) == []  # only the manifest was read


def test_verify_checks_a_sound_remote_store_without_filling_the_cache(remote_store, tmp_path, capsys):
    url, local, cache_dir = remote_store
    n = len(fastdata.info(local)["shards"])
    assert main(["verify", url]) == 0
    assert f"{url}: OK ({n} shard(s), 24 records verified)" in capsys.readouterr().out
    assert cached_shard_files(cache_dir) == []  # streamed through a scratch file, deleted after its check
    scratch = tmp_path / "scratch"
    report = fastdata.verify(url, decode=True, scratch_dir=str(scratch))
    assert report.ok and report.decoded == 24 and os.listdir(scratch) == []
    assert main(["verify", f"{url}-nothing-here"]) == EXIT_NOT_A_STORE
    assert "not a fastdata store: no manifest.json" in capsys.readouterr().err


def test_verify_names_a_shard_damaged_or_missing_on_the_server(remote_store, capsys):
    url, local, _ = remote_store
    shards = [s["name"] for s in fastdata.info(local)["shards"]]
    loc = RemoteLocation(url)
    data = bytearray(loc.read_bytes(shards[1]))
    data[len(data) // 2] ^= 0xFF
    loc.write_bytes(shards[1], bytes(data))  # same size, one flipped byte
    assert main(["verify", url]) == EXIT_FAILED_CHECK
    err = capsys.readouterr().err
    assert f"{shards[1]}: file checksum mismatch" in err and "DAMAGED" in err
    assert shards[0] not in err
    loc.remove([shards[2]])
    assert main(["verify", url, "--json"]) == EXIT_FAILED_CHECK
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert any(p.startswith(f"{shards[2]}: shard object missing on the server") for p in problems), problems
    assert any(p.startswith(f"{shards[1]}: file checksum mismatch") for p in problems), problems


# nightly (17 s: bench and tune are tested end to end on local stores, and URLs with storage options
# by the remote reads; this is their pairing)
@pytest.mark.slow
def test_bench_and_tune_read_a_url_with_storage_options(remote_store, tmp_path, monkeypatch, capsys):
    """The endpoint given only as --storage-option must reach the measuring subprocesses too."""
    url, _, _ = remote_store
    endpoint = os.environ.pop("AWS_ENDPOINT_URL")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    cache = tmp_path / "bench-cache"
    opts = ["--storage-option", f"endpoint_url={endpoint}", "--cache-dir", str(cache), "--cache-limit", "10MiB"]
    out = tmp_path / "bench"
    assert main(["bench", url, "--workers", "0", "--batch-size", "4", "--epochs", "1", "--warmup-epochs", "0",
                 "--max-batches", "2", "--no-plots", "--quiet", "--out", str(out), *opts]) == 0
    rows = json.loads((out / "results.json").read_text())["results"]
    assert [(r["target"], r["kind"], r["status"]) for r in rows] == [(url, "lmdb", "ok")]
    assert endpoint not in (out / "results.json").read_text()  # options stay out of the results
    assert cached_shard_files(cache)  # the runner read through the cache it was given
    capsys.readouterr()
    # --max-workers 0: the probe and one measurement, each a fresh process that must get the options
    # (a worker count adds runs, not another way for the options to travel; tests/bench/test_tune.py tunes workers)
    assert main(["tune", url, "--memory-budget", "4GiB", "--batch-size", "4", "--max-workers", "0",
                 "--max-batches", "1", "--epochs", "1", "--transform", "rrc224", "--out", str(tmp_path / "tune"),
                 "--quiet", *opts]) == 0
    shown = capsys.readouterr().out
    assert f"fastdata.open_dataset({url!r}" in shown and "cache_limit='10MiB'" in shown
    assert "storage_options=storage_options" in shown and endpoint not in shown


def test_cache_list_shows_a_store_and_clear_removes_its_shards(remote_store, capsys):
    url, local, cache_dir = remote_store
    total = len(fastdata.info(local)["shards"])
    ds = fastdata.open_dataset(url, output="numpy")
    ds[0]
    ds[len(ds) - 1]
    ds.close()
    os.makedirs(os.path.join(cache_dir, ".verify-1234"))  # verify's scratch folder is not a store
    assert main(["cache", "list"]) == 0
    listing = capsys.readouterr().out
    assert url in listing and f"2/{total} shards" in listing
    assert "total: 2 shard(s)" in listing and "in 1 store version(s)" in listing
    from fastdata.remote.inventory import cache_report

    report = cache_report(check=True)
    [entry] = report.stores
    assert (entry.url, entry.shards_cached, entry.shards_total, entry.current) == (url, 2, total, True)
    assert entry.bytes == sum(os.path.getsize(p) for p in cached_shard_files(cache_dir))
    assert main(["cache", "clear", url]) == 0
    assert f"2 shard(s) of {url} removed, 0 kept" in capsys.readouterr().out
    assert cached_shard_files(cache_dir) == []
    assert main(["cache", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stores"] == []


def test_cache_list_says_when_the_store_was_rewritten(remote_store, small_tree, tmp_path, monkeypatch, capsys):
    url, local, _ = remote_store
    fastdata.open_dataset(url, output="numpy")[0]
    other = str(tmp_path / "other.lmdb")
    fastdata.convert(small_tree, other, shard_size="40kB", progress=False)  # a new manifest checksum
    upload_store(other, url)
    monkeypatch.setenv("FASTDATA_CACHE_LIMIT", "5MiB")
    assert main(["cache", "list", "--check"]) == 0
    listing = capsys.readouterr().out
    assert "outdated (the store was rewritten)" in listing and "of a 5.0 MiB limit" in listing


def test_cache_clear_keeps_a_shard_a_live_process_has_open(remote_store, capsys):
    url, _, cache_dir = remote_store
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, fastdata
        ds = fastdata.open_dataset({url!r}, output="numpy")
        ds[0]
        print("ready", flush=True)
        sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    with reaped(holder):
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        fastdata.open_dataset(url, output="numpy")[23]  # a second shard, released by this process
        assert len(cached_shard_files(cache_dir)) == 2
        assert main(["cache", "clear"]) == 0
        assert "1 shard(s) removed, 1 kept (in use by a live process)" in capsys.readouterr().out
        [kept] = cached_shard_files(cache_dir)
        assert kept.endswith("shard-00000.lmdb")
        assert holder.stdin is not None
        holder.stdin.close()
        assert holder.wait(60) == 0
    assert main(["cache", "clear"]) == 0
    assert "1 shard(s) removed, 0 kept" in capsys.readouterr().out


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def test_an_unreachable_endpoint_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_closed_port()}")
    for key, value in (("AWS_ACCESS_KEY_ID", "k"), ("AWS_SECRET_ACCESS_KEY", "s"), ("AWS_REGION", "us-east-1"),
                       ("FASTDATA_REMOTE_RETRIES", "0"), ("FASTDATA_CACHE_DIR", str(tmp_path / "cache"))):
        monkeypatch.setenv(key, value)
    url = "s3://bucket/train.lmdb"
    for argv in (["info", url], ["verify", url], ["bench", url, "--no-plots", "--out", str(tmp_path / "b")],
                 ["tune", url, "--memory-budget", "1GiB", "--out", str(tmp_path / "t")]):
        assert main([*argv, "--storage-option", ONE_ATTEMPT]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert err.startswith(f"fastdata: error: reading {url}/manifest.json: ") and "check the endpoint" in err
