"""fastdata on proxies of macOS and Windows (issue 38): a fresh interpreter from which
``proxy_site/sitecustomize.py`` removes, before anything is imported, what that system lacks
(macOS: memfd, posix_fadvise, sched_getaffinity, copy_file_range, fdatasync, /proc for fastdata's
reads; Windows: also fcntl, resource, pread/preadv/pwrite, O_NOFOLLOW/O_NONBLOCK/O_CLOEXEC/
O_DIRECTORY, set_blocking, directory descriptors, fsync of read-only descriptors, removing or
renaming an open file, fork and forkserver), runs the steps of
``proxy_steps.py`` (the Windows proxy on both backends, the macOS proxy on LMDB in CI and both
nightly): convert (CLI, 2 spawned workers), verify, append, convert
again with overwrite, a live converter's lock refused and a dead one's taken over, a killed
conversion resumed, chunked volumes from memmaps, open and read every sample, ``fastdata.write`` of
Python samples with 2 workers, a merge of two stores, a store converted to ``s3://`` (the session's
SeaweedFS server) and read back through the shard cache, and one epoch of a 2-worker spawn loader.

The two proxies run at once, one subprocess each (~20 s of CPU apiece, most of it spawned
workers importing torch). Linux's own paths are what every other test runs.
"""

from __future__ import annotations

import json
import os
import time

import pytest
from helpers.proxies import collect, start

SYSTEMS = ("macos", "windows")
BACKENDS = ("lmdb", "hdf5")
#: the backends each proxy runs: the Windows proxy lacks every facility the macOS one lacks, and runs
#: both backends; the macOS one runs LMDB in CI (what is its own: forkserver, flock, pread) and both nightly
BACKENDS_OF = {"windows": BACKENDS, "macos": BACKENDS if os.environ.get("FASTDATA_NIGHTLY") == "1" else ("lmdb",)}
PAIRS = [(system, backend) for system in SYSTEMS for backend in BACKENDS_OF[system]]
#: samples of the source tree and of the appended one (proxy_steps.CLASSES, APPENDED)
SAMPLES, APPENDED = 9, 3
#: samples of the write step (proxy_steps.WRITTEN)
WRITTEN = 7

pytestmark = pytest.mark.timeout(240)


def _s3_env(request) -> dict[str, str]:
    """What points a proxy at a fresh bucket of the session's S3 server (tests/conftest.py's
    ``s3_server``, started when collection ends because :func:`test_remote_stores` takes it): the
    AWS_* variables and ``FASTDATA_PROXY_S3``. Empty where there is no ``weed`` binary, unless
    FASTDATA_REQUIRE_S3 is set (CI), where the fixture's failure fails these tests."""
    from helpers.s3server import weed_binary

    if weed_binary() is None and not os.environ.get("FASTDATA_REQUIRE_S3"):
        return {}
    server = request.getfixturevalue("s3_server")
    bucket = server.take_bucket(f"proxies-{os.getpid()}-{time.time_ns() % 10**12}")
    return {**server.env(), "FASTDATA_PROXY_S3": f"s3://{bucket}", "FASTDATA_REMOTE_RETRIES": "2"}


@pytest.fixture(scope="module")
def proxies(tmp_path_factory, request) -> dict[str, dict]:
    """Each proxy's report (proxy_steps.py's JSON), both run at the same time. The S3 server's
    variables reach them through a file written once it serves (its start-up, ~3 s, overlaps their
    first steps; the remote step, near their end, waits for the file)."""
    procs = {}
    s3_file = tmp_path_factory.mktemp("proxy-s3") / "s3.json"
    for system in SYSTEMS:
        work = tmp_path_factory.mktemp(f"proxy-{system}")
        procs[system] = start("proxy_steps.py", system, str(work), env={
            "FASTDATA_CACHE_DIR": str(work / "cache"), "FASTDATA_PROXY_S3_FILE": str(s3_file),
            "FASTDATA_PROXY_BACKENDS": ",".join(BACKENDS_OF[system])})
    try:
        s3_env = _s3_env(request)
    except BaseException:
        for proc in procs.values():
            proc.kill()
            proc.communicate()
        raise
    s3_file.with_suffix(".tmp").write_text(json.dumps(s3_env))
    s3_file.with_suffix(".tmp").replace(s3_file)
    return collect(procs)


def _ok(result: dict) -> dict:
    assert result["ok"], f"{result['error']}\n{result.get('where', '')}"
    return result


@pytest.mark.parametrize("system", SYSTEMS)
def test_the_proxy_lacks_what_its_system_lacks(proxies, system):
    proxy = proxies[system]["proxy"]
    linux_only = ["memfd_create", "posix_fadvise", "sched_getaffinity", "copy_file_range", "fdatasync"]
    assert proxy["proc_readable_by_fastdata"] is False
    assert proxy["native_threads"] >= 1 and proxy["cores"] >= 1  # psutil / os.cpu_count instead of /proc
    assert proxies[system]["start"] == "spawn"
    if system == "macos":
        assert proxy["os_missing"] == linux_only
        assert proxy["fcntl_importable"] and proxy["fork_context"]
        assert proxies[system]["locking"] == "flock" and proxies[system]["pread"]
        assert proxy["lock_file_left_after_release"] is None  # unlinked
    else:
        assert proxy["os_missing"] == [*linux_only, "pread", "preadv", "pwrite", "O_NOFOLLOW", "O_NONBLOCK",
                                       "O_CLOEXEC", "O_DIRECTORY", "set_blocking"]
        assert not proxy["fcntl_importable"] and not proxy["fork_context"]
        assert proxy["start_methods"] == ["spawn"]
        assert proxies[system]["locking"] == "msvcrt" and not proxies[system]["pread"]
        assert proxy["lock_file_left_after_release"] == 0  # an open file cannot be removed: left, emptied


@pytest.mark.parametrize(("system", "backend"), PAIRS)
def test_convert_verify_append_overwrite(proxies, system, backend):
    steps = proxies[system][backend]
    converted = _ok(steps["convert_cli"])
    assert converted["samples"] == SAMPLES and converted["shards"] > 1  # 2 spawned workers, several shards
    assert [(c["name"], c["count"]) for c in converted["classes"]] == [("cat", 5), ("dog", 4)]
    assert _ok(steps["verify"])["verified"]
    appended = _ok(steps["append"])
    assert appended["appended"] == APPENDED and appended["samples"] == SAMPLES + APPENDED
    overwritten = _ok(steps["overwrite"])
    assert overwritten["images"] == overwritten["samples"] == SAMPLES and overwritten["verified"]
    # the lock released by each earlier run (on Windows: left there, emptied) reads as nobody's
    assert not [w for w in appended["warnings"] + overwritten["warnings"] if "took over the lock" in w]


@pytest.mark.parametrize(("system", "backend"), PAIRS)
def test_store_lock_refuses_a_live_converter_and_takes_over_a_dead_ones(proxies, system, backend):
    lock = _ok(proxies[system][backend]["lock"])
    assert lock["refused_live"] and lock["took_over_dead"] and lock["samples"] == SAMPLES


@pytest.mark.parametrize(("system", "backend"), PAIRS)
def test_a_killed_conversion_resumes(proxies, system, backend):
    resumed = _ok(proxies[system][backend]["resume"])
    assert resumed["samples"] == 40 and resumed["verified"]
    # killed once its first shard was finished (it could only have finished first, all 40 shards,
    # had the poller not run for the whole conversion)
    if resumed["killed_mid_run"]:
        assert resumed["resumed_shards"] >= 1 and resumed["took_over"], resumed


@pytest.mark.parametrize(("system", "backend"), PAIRS)
def test_chunked_volumes_from_memmaps_round_trip(proxies, system, backend):
    volumes = _ok(proxies[system][backend]["volumes"])
    assert volumes["voxels_equal"] == volumes["volumes"] == 3


@pytest.mark.parametrize(("system", "backend"), PAIRS)
def test_open_and_read_every_sample(proxies, system, backend):
    read = _ok(proxies[system][backend]["open_read"])
    assert read["samples"] == read["pixels_equal"] == SAMPLES and read["labels_match"]


@pytest.mark.parametrize(("system", "backend"), PAIRS)
def test_write_python_samples_with_two_workers(proxies, system, backend):
    """``fastdata.write`` of dicts (image array, int, float, ragged array) through a 2-worker pool
    started as the system starts it (Windows: spawn, the workers import the script; macOS:
    forkserver), every field read back equal."""
    written = _ok(proxies[system][backend]["write"])
    assert written["pools"] == [[2, "spawn" if system == "windows" else "forkserver"]]
    assert written["written"] == written["samples"] == WRITTEN and written["shards"] > 1 and written["verified"]
    assert written["fields_equal"] == {"image": WRITTEN, "label": WRITTEN, "score": WRITTEN, "boxes": WRITTEN}


@pytest.mark.parametrize(("system", "backend"), PAIRS)
def test_merge_two_stores_into_a_third(proxies, system, backend):
    merged = _ok(proxies[system][backend]["merge"])
    assert merged["samples"] == merged["read"] == SAMPLES + APPENDED and merged["verified"], merged["problems"]
    assert merged["classes"] == [["cat", 7], ["dog", 5]]
    assert merged["labels"] == [0] * 5 + [1] * 4 + [0] * 2 + [1]  # the first store's, then the second's


@pytest.mark.parametrize(("system", "backend"), PAIRS)
def test_add_fields_replace_and_gc_while_a_reader_holds_the_old_version(proxies, system, backend):
    """Added fields replaced while a dataset of the first version is open, then gc: the dataset
    reads on from the field file it holds (on Windows gc cannot remove that one: it stays, and goes
    once the dataset is closed; elsewhere it goes at once and the reader keeps its unlinked file),
    and says the store changed for a field file it had not opened (gc is for when no reader is)."""
    got = _ok(proxies[system][backend]["add_fields"])
    n = got["samples"]
    assert got["old_first"] == "a0" and got["old_after"] == "a0" and got["old_unopened"] == "StoreChangedError"
    assert got["scores"] == [2.0 * i for i in range(n)] and got["tags"] == [f"b{i}" for i in range(n)]
    shards = len(got["field_files"])
    assert shards >= 1 and all(f.startswith("fields-00002.") for f in got["field_files"]), got["field_files"]
    if system == "windows":
        assert (got["removed_while_open"], got["removed_after"]) == (shards - 1, 1)
    else:
        assert (got["removed_while_open"], got["removed_after"]) == (shards, 0)
    assert got["verified"]


@pytest.mark.parametrize(("system", "backend"), PAIRS)
def test_remote_stores(proxies, system, backend, s3_server):
    """Converting straight to ``s3://`` works on both (shards staged locally, uploaded, staging
    removed). Reading goes through the shard cache under a limit of two shards, so it evicts as it
    reads: its pins are shared locks on macOS, open handles on Windows (msvcrt has exclusive locks
    only; an open file cannot be deleted there): both read every sample within the limit."""
    remote = _ok(proxies[system][backend]["remote"])
    assert remote["uploaded"] == SAMPLES and remote["shards"] > 2 and remote["objects_match"]
    assert remote["remote_leftovers"] == [] and remote["staging_left"] == []
    assert "read_error" not in remote, remote["read_error"]
    assert remote["read"] == remote["pixels_equal"] == SAMPLES and remote["labels_match"]
    # evicted while reading: never more than the limit, fewer shards than the store has
    assert 0 < remote["cached_bytes"] <= remote["cache_limit"] and remote["cached_shards"] < remote["shards"]


@pytest.mark.parametrize("system", SYSTEMS)
def test_a_two_worker_spawn_loader_yields_every_sample_once(proxies, system):
    loader = _ok(proxies[system]["loader"])
    for backend in BACKENDS_OF[system]:
        got = loader[backend]
        assert got["samples"] == got["pixels_equal"] == SAMPLES and got["labels_match"], (backend, got)
    assert loader["ring_batches"] == 0  # no memfd: every batch travelled pickled


@pytest.mark.parametrize("system", SYSTEMS)
def test_two_thread_workers_yield_every_sample_once(proxies, system):
    """Thread workers start no process: the same epoch, on a system without fork."""
    loader = _ok(proxies[system]["thread_loader"])
    for backend in BACKENDS_OF[system]:
        got = loader[backend]
        assert got["samples"] == got["pixels_equal"] == SAMPLES and got["labels_match"], (backend, got)


@pytest.mark.parametrize("system", SYSTEMS)
def test_doctor_reports_what_the_platform_lacks(proxies, system):
    """``fastdata doctor`` names each missing facility and its cost; on Linux (this process) nothing."""
    from fastdata.tools.platform_report import facilities, platform_report

    doctor = _ok(proxies[system]["doctor"])
    common = ["os.memfd_create", "os.posix_fadvise", "os.copy_file_range", "os.sched_getaffinity", "/proc"]
    expected = common if system == "macos" else ["fork start method", *common[:2], "os.pread", *common[2:],
                                                   "fcntl.flock"]
    assert doctor["rc"] == 0 and doctor["missing"] == expected
    for name in expected:
        assert f"missing {name}: " in doctor["text"]
    assert f"{8 - len(expected)} of 8 facilities present" in doctor["text"]
    if system == "windows":
        assert "holding it open" in doctor["text"] and "__main__" in doctor["text"]
    assert all(f.present for f in facilities()) and "missing" not in platform_report()  # control: Linux
