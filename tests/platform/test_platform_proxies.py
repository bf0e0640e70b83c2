"""fastdata on proxies of macOS and Windows (issue 38): a fresh interpreter from which
``proxy_site/sitecustomize.py`` removes, before anything is imported, what that system lacks
(macOS: memfd, posix_fadvise, sched_getaffinity, copy_file_range, fdatasync, /proc for fastdata's
reads; Windows: also fcntl, resource, pread/preadv/pwrite, O_NOFOLLOW/O_NONBLOCK/O_CLOEXEC/
O_DIRECTORY, set_blocking, directory descriptors, fsync of read-only descriptors, removing or
renaming an open file, fork and forkserver), runs the steps of
``proxy_steps.py`` on both backends: convert (CLI, 2 spawned workers), verify, append, convert
again with overwrite, a live converter's lock refused and a dead one's taken over, a killed
conversion resumed, chunked volumes from memmaps, open and read every sample, and one epoch of a 2-worker spawn loader.

The two proxies run at once, one subprocess each (~15 s of CPU apiece, most of it spawned
workers importing torch). Linux's own paths are what every other test runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SYSTEMS = ("macos", "windows")
BACKENDS = ("lmdb", "hdf5")
#: samples of the source tree and of the appended one (proxy_steps.CLASSES, APPENDED)
SAMPLES, APPENDED = 9, 3

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def proxies(tmp_path_factory) -> dict[str, dict]:
    """Each proxy's report (proxy_steps.py's JSON), both run at the same time."""
    procs = {}
    for system in SYSTEMS:
        work = tmp_path_factory.mktemp(f"proxy-{system}")
        env = dict(os.environ, FASTDATA_PROXY_SYSTEM=system,
                   PYTHONPATH=os.pathsep.join(p for p in (str(HERE / "proxy_site"), os.environ.get("PYTHONPATH")) if p))
        procs[system] = subprocess.Popen([sys.executable, str(HERE / "proxy_steps.py"), str(work)], env=env,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    for system, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=200)
        assert proc.returncode == 0, f"{system} proxy exited {proc.returncode}: {stderr[-3000:]}"
        out[system] = json.loads(stdout)
    return out


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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("system", SYSTEMS)
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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("system", SYSTEMS)
def test_store_lock_refuses_a_live_converter_and_takes_over_a_dead_ones(proxies, system, backend):
    lock = _ok(proxies[system][backend]["lock"])
    assert lock["refused_live"] and lock["took_over_dead"] and lock["samples"] == SAMPLES


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("system", SYSTEMS)
def test_a_killed_conversion_resumes(proxies, system, backend):
    resumed = _ok(proxies[system][backend]["resume"])
    assert resumed["samples"] == 40 and resumed["verified"]
    # killed once its first shard was finished (it could only have finished first, all 40 shards,
    # had the poller not run for the whole conversion)
    if resumed["killed_mid_run"]:
        assert resumed["resumed_shards"] >= 1 and resumed["took_over"], resumed


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("system", SYSTEMS)
def test_chunked_volumes_from_memmaps_round_trip(proxies, system, backend):
    volumes = _ok(proxies[system][backend]["volumes"])
    assert volumes["voxels_equal"] == volumes["volumes"] == 3


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("system", SYSTEMS)
def test_open_and_read_every_sample(proxies, system, backend):
    read = _ok(proxies[system][backend]["open_read"])
    assert read["samples"] == read["pixels_equal"] == SAMPLES and read["labels_match"]


@pytest.mark.parametrize("system", SYSTEMS)
def test_a_two_worker_spawn_loader_yields_every_sample_once(proxies, system):
    loader = _ok(proxies[system]["loader"])
    for backend in BACKENDS:
        got = loader[backend]
        assert got["samples"] == got["pixels_equal"] == SAMPLES and got["labels_match"], (backend, got)
    assert loader["ring_batches"] == 0  # no memfd: every batch travelled pickled


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
        assert "remote stores (s3://" in doctor["text"] and "__main__" in doctor["text"]
    assert all(f.present for f in facilities()) and "missing" not in platform_report()  # control: Linux
