"""Crash loop: kill the converter at random moments, resume, repeat; nothing is lost.

``python -m fastdata convert`` runs as a subprocess in its own session and is
killed after a random delay: SIGKILL to the converter process (an OOM kill, or
``kill -9``), and every fifth time SIGINT to the whole process group (Ctrl-C
in a terminal). Then ``--resume`` runs again, and is itself killed, and so on.
After the last (unkilled) resume:

* the store verifies, holds every valid input exactly once in scan order, byte
  for byte, with the right label, nothing extra; the rejected inputs are listed
  exactly once each; the directory holds nothing but the published files;
* every shard finished before the last kill (a sidecar exists) was kept, not
  redone, and the killed converter's stale lock was taken over, naming its pid.

After every kill: whenever ``manifest.json`` exists the store is complete and
correct (nothing is published while incomplete), and shards finished before a
resume keep their inode (never rewritten). No process of any killed converter
(workers, forkserver, resource tracker) is left at the end; the control test
checks that they go within seconds of the kill.

Reader side: DataLoader workers SIGKILLed repeatedly mid-epoch.

Default: >= 10 kills per backend. Nightly (``FASTDATA_NIGHTLY=1 pytest -m slow``):
100 kills per backend over 2000 images (see docs/RELIABILITY.md).
"""

from __future__ import annotations

import collections
import gc
import os
import random
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
from helpers.backends import SUFFIXES, first_in_ci
from helpers.images import make_tree
from helpers.stores import store_records

import fastdata
from fastdata.format.names import LOCK_NAME, MANIFEST_NAME, REJECTED_NAME, STAGING_DIR, STORE_INDEX_NAME
from fastdata.writer.sources.folder import scan

BAD_INPUTS = {"b/zero.jpg": b"", "c/garbage.jpg": b"\xff\xd8not a jpeg at all" * 20}
#: seconds a killed converter's helper processes may outlive it (workers poll every 0.5 s)
ORPHAN_GRACE_S = 10.0


# ----------------------------------------------------------------------------- helpers

def _make_source(root, per_class: int) -> tuple[str, list[tuple[str, bytes, int]]]:
    """A tree of small photo-like JPEGs plus two bad inputs. Returns the root and the
    expected store content: (relpath, bytes, label) of every valid input in scan order."""
    classes = {"a": per_class + 10, "b": per_class, "c": per_class, "d": per_class - 10}
    src = make_tree(root, classes=classes, size=(32, 24), seed=11)
    for rel, data in BAD_INPUTS.items():
        with open(os.path.join(src, rel), "wb") as fh:
            fh.write(data)
    found = scan(src)
    expected = []
    for path, rel, label in zip(found.paths, found.relpaths, found.labels.tolist(), strict=False):
        rel = os.fsdecode(rel)
        if rel not in BAD_INPUTS:
            with open(path, "rb") as fh:
                expected.append((rel, fh.read(), label))
    assert len(expected) == len(found) - len(BAD_INPUTS)
    return src, expected


def _command(src: str, dst: str, extra: list[str], shard_size: int) -> list[str]:
    return [sys.executable, "-m", "fastdata", "convert", src, dst, "--workers", "2",
            "--shard-size", str(shard_size), *extra]


def _session_processes(sids: set[int]) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and os.getsid(proc.pid) in sids:
                found.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found


def _assert_no_orphans(*sids: int) -> None:
    """Every process of the killed converters' sessions must exit on its own."""
    deadline = time.monotonic() + ORPHAN_GRACE_S
    left = _session_processes(set(sids))
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = _session_processes(set(sids))
    described = [" ".join(p.cmdline())[:100] for p in left if p.is_running()]
    for proc in left:  # clean up before failing: we started these
        try:
            proc.kill()
        except psutil.Error:
            pass
    assert not described, f"processes outlived the killed converter: {described}"


def _check_store(dst: str, expected: list[tuple[str, bytes, int]]) -> None:
    """The published store is complete and exactly the expected content."""
    report = fastdata.verify(dst)
    assert report.ok, report.summary()
    manifest, records = store_records(dst)
    got = [(r["relpath"], r["image"], r["label"]) for r in records]
    assert len(got) == len(expected), f"{len(got)} records, expected {len(expected)}"
    assert [g[0] for g in got] == [e[0] for e in expected], "records out of scan order, missing or repeated"
    assert got == expected, "a record's bytes or label differ from the source"
    assert sorted(r["path"] for r in manifest["rejected"]) == sorted(BAD_INPUTS)


def _sidecars(dst: str) -> int:
    try:
        return sum(1 for n in os.listdir(os.path.join(dst, STAGING_DIR)) if n.endswith(".json") and n != "plan.json")
    except FileNotFoundError:
        return 0


def _finished_shards(dst: str) -> dict[str, int]:
    """Shards proven complete by a sidecar: name -> inode of the shard file."""
    out = {}
    try:
        names = os.listdir(os.path.join(dst, STAGING_DIR))
    except FileNotFoundError:
        return out
    for name in names:
        if name.endswith(".json") and name != "plan.json":
            shard = name[: -len(".json")]
            try:
                out[shard] = os.stat(os.path.join(dst, shard)).st_ino
            except FileNotFoundError:
                pass
    return out


def _default_sigint() -> None:
    """In the converter child: Ctrl-C as in a terminal. A test run started in the
    background of a non-interactive shell inherits SIGINT *ignored* (POSIX), and
    Python keeps an ignored SIGINT ignored, so the Ctrl-C kills would all miss."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _lock_pid(dst: str) -> int | None:
    try:
        with open(os.path.join(dst, LOCK_NAME)) as fh:
            text = fh.read().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def _wait_for_kill_point(proc, dst: str, rng: random.Random, n_shards: int, full_s: float) -> None:
    """Pick the moment to kill: a third of the time anywhere in the first 0.6 s
    (start-up, scan, lock, plan), otherwise just after a random number of further
    shards have finished (plus a few ms, so kills also land inside a shard's
    finish and inside publishing). Random moments, without idle waiting."""
    if rng.random() < 0.3:
        time.sleep(rng.uniform(0.0, 0.6))
        return
    target = _sidecars(dst) + rng.randint(0, n_shards)
    deadline = time.monotonic() + 2 * full_s
    while proc.poll() is None and _sidecars(dst) < target and time.monotonic() < deadline:
        time.sleep(0.002)
    time.sleep(rng.uniform(0.0, 0.03))


def crash_loop(tmp_path, suffix: str, *, per_class: int, kills: int, seed: str) -> dict:
    """Run the kill/resume loop; returns counters for the caller's assertions."""
    rng = random.Random(seed)
    src, expected = _make_source(tmp_path / "src", per_class)
    shard_size = 4000
    # calibrate: how long an uninterrupted conversion takes here, now
    t0 = time.monotonic()
    ref = str(tmp_path / f"reference{suffix}")
    subprocess.run(_command(src, ref, ["--quiet"], shard_size), check=True, timeout=300)
    full_s = time.monotonic() - t0
    _check_store(ref, expected)
    n_shards = len(fastdata.info(ref)["shards"])
    assert n_shards >= 20, "too few shards for kills to land between them"

    dst = str(tmp_path / f"store{suffix}")
    sessions: list[int] = []
    stats = {"kills": 0, "sigint": 0, "completed": 0, "published_at_kill": 0, "launches": 0, "kept_checked": 0}
    while stats["kills"] < kills:
        assert stats["launches"] < 6 * kills, f"kills keep missing the conversion: {stats}"
        stats["launches"] += 1
        if os.path.exists(os.path.join(dst, MANIFEST_NAME)):
            extra = ["--overwrite"]
        elif os.path.exists(dst):
            extra = ["--resume"]
        else:
            extra = []
        # every 5th kill is a Ctrl-C; decided by kills, not launches, so a launch that
        # finishes before its kill point passes the Ctrl-C on to the next one
        use_sigint = stats["kills"] % 5 == 4
        finished = _finished_shards(dst) if extra == ["--resume"] else {}
        proc = subprocess.Popen(_command(src, dst, extra + ["--quiet"], shard_size), start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=_default_sigint)
        if use_sigint:
            # a Ctrl-C before the converter holds the lock would only test Python's own
            # start-up (a KeyboardInterrupt traceback from `import site`, exit 1)
            deadline = time.monotonic() + 30
            while proc.poll() is None and _lock_pid(dst) != proc.pid and time.monotonic() < deadline:
                time.sleep(0.002)
        _wait_for_kill_point(proc, dst, rng, n_shards, full_s)
        if proc.poll() is None:
            if use_sigint:
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.kill()
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            pytest.fail(f"converter did not exit within 60 s of {'SIGINT' if use_sigint else 'SIGKILL'}")
        rc = proc.returncode
        err = err.decode(errors="replace")
        if rc == 0:
            stats["completed"] += 1
            _check_store(dst, expected)
        else:
            if use_sigint:
                # Ctrl-C: a clean exit code, or a worker dying of the same SIGINT first
                assert rc in (130, -signal.SIGINT) or (rc == 2 and "worker died" in err), (rc, err[-2000:])
                stats["sigint"] += 1
            else:
                assert rc == -signal.SIGKILL, (rc, err[-2000:])
            stats["kills"] += 1
            if os.path.exists(os.path.join(dst, MANIFEST_NAME)):
                stats["published_at_kill"] += 1  # killed after publishing: must be complete
                _check_store(dst, expected)
        sessions.append(proc.pid)  # checked at the end (see _assert_no_orphans), not waited for here
        # shards finished before this resume were kept as they were, never rewritten
        for name, inode in finished.items():
            assert os.stat(os.path.join(dst, name)).st_ino == inode, f"finished shard {name} was rewritten"
        stats["kept_checked"] += len(finished)

    _assert_no_orphans(*sessions)

    # final resume, not killed
    kept_before = _sidecars(dst)
    stale = _lock_pid(dst)
    final = subprocess.run(_command(src, dst, ["--resume"], shard_size), capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr
    if os.path.exists(os.path.join(dst, STAGING_DIR)) or kept_before:
        match = re.search(r"(\d+) kept from the interrupted run", final.stdout)
        assert (int(match.group(1)) if match else 0) == kept_before, (kept_before, final.stdout)
    if stale is not None:
        assert f"pid {stale}" in final.stderr, ("the stale lock's pid is not reported", final.stderr)
    _check_store(dst, expected)
    names = set(os.listdir(dst))
    shards = {s["name"] for s in fastdata.info(dst)["shards"]}
    assert names == shards | {MANIFEST_NAME, REJECTED_NAME, STORE_INDEX_NAME}, f"unexpected files: {names - shards}"
    stats["kept_at_end"] = kept_before
    return stats


# ----------------------------------------------------------------------------- tests

# Rerun once: kill times are drawn against the converter's progress, which machine load shifts.
@pytest.mark.flaky(reruns=1)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("suffix", first_in_ci(SUFFIXES))
def test_crash_loop_sigkill_and_ctrl_c_then_resume(tmp_path, suffix):
    # 5 kills (the 5th a Ctrl-C) per backend here; the nightly variant below makes 100
    stats = crash_loop(tmp_path, suffix, per_class=30, kills=5, seed=f"crash{suffix}")
    print(stats)
    assert stats["kills"] >= 5 and stats["sigint"] >= 1
    assert stats["kept_checked"] > 0, "no resume ever had finished shards to keep: the check above was vacuous"


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("suffix", SUFFIXES)
def test_crash_loop_nightly(tmp_path, suffix):
    """The heavy variant: 2000 images, 100 kills per backend."""
    stats = crash_loop(tmp_path, suffix, per_class=500, kills=100, seed=f"nightly{suffix}")
    print(stats)
    assert stats["kills"] >= 100


def test_killed_converter_leaves_no_processes_control(tmp_path):
    """Control for the orphan check: the session scan does see a live converter's
    helpers (workers, forkserver), so an empty result after a kill means something."""
    src, _ = _make_source(tmp_path / "src", 40)
    proc = subprocess.Popen(_command(src, str(tmp_path / "s.lmdb"), ["--quiet"], 4000),
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        helpers = []
        while proc.poll() is None and time.monotonic() < deadline and len(helpers) < 2:
            helpers = [p for p in _session_processes({proc.pid}) if p.pid != proc.pid]
            time.sleep(0.02)
        assert len(helpers) >= 2, "never saw the converter's worker processes"
        proc.kill()
        proc.wait()
        _assert_no_orphans(proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_resume_after_a_kill_between_publish_and_cleanup(tmp_path):
    """The narrowest window: killed after manifest.json was published but before
    staging was removed. The store is complete; --resume says so and finishes
    the cleanup, leaving only the published files."""
    src, expected = _make_source(tmp_path / "src", 12)
    dst = str(tmp_path / "store.lmdb")
    subprocess.run(_command(src, dst, ["--quiet"], 4000), check=True, timeout=120)
    os.makedirs(os.path.join(dst, STAGING_DIR))
    for leftover in (os.path.join(STAGING_DIR, "plan.json"), os.path.join(STAGING_DIR, "shard-00000.lmdb.json"),
                     "manifest.json.tmp-12345", LOCK_NAME):
        with open(os.path.join(dst, leftover), "w") as fh:
            fh.write("{}" if leftover != LOCK_NAME else "12345")
    done = subprocess.run(_command(src, dst, ["--resume"], 4000), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "already a complete store" in done.stdout
    _check_store(dst, expected)
    shards = {s["name"] for s in fastdata.info(dst)["shards"]}
    assert set(os.listdir(dst)) == shards | {MANIFEST_NAME, REJECTED_NAME, STORE_INDEX_NAME}


# ----------------------------------------------------------------------------- reader side

def _open_fds() -> collections.Counter:
    """What this process's file descriptors point at (pipe/socket ids folded)."""
    found = collections.Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found[re.sub(r"\[\d+\]|_\d+", "", os.readlink(f"/proc/self/fd/{fd}"))] += 1
        except OSError:
            pass
    return found


# The run takes 3-6 s: a 60 s timeout bounds what a hang of a forked worker costs before the rerun.
# Nightly: it still hangs now and then before its rerun passes, which costs CI minutes; the on_error and
# worker-death tests of tests/reader run in CI.
# Rerun once: SIGKILLs race the DataLoader's own worker start-up and shutdown on a loaded 2-core machine.
@pytest.mark.slow
@pytest.mark.flaky(reruns=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("suffix", first_in_ci(SUFFIXES))
def test_dataloader_workers_sigkilled_repeatedly(tmp_path, suffix):
    """Workers SIGKILLed mid-epoch, again and again: each time the DataLoader
    raises as PyTorch does; afterwards a new loader on the *same* dataset object
    reads the full epoch correctly, and the parent holds no more file descriptors
    than before (no reader handles or LMDB environments leak per kill)."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from fastdata.reader.open import open_dataset

    src, expected = _make_source(tmp_path / "src", 12)
    dst = str(tmp_path / ("store" + suffix))
    subprocess.run(_command(src, dst, ["--quiet"], 4000), check=True, timeout=120)
    dataset = open_dataset(dst, output="tensor")
    kills = 50 if os.environ.get("FASTDATA_NIGHTLY") == "1" else 8

    def epoch_labels():
        loader = DataLoader(dataset, batch_size=4, num_workers=2, multiprocessing_context="fork")
        return [int(y) for _, labels in loader for y in labels]

    assert epoch_labels() == [label for _, _, label in expected]
    gc.collect()
    fds_before = _open_fds()
    for k in range(kills):
        loader = DataLoader(dataset, batch_size=4, num_workers=2, multiprocessing_context="fork")
        it = iter(loader)
        next(it)
        # PyTorch reports a dead worker from its SIGCHLD handler, i.e. asynchronously:
        # wait for it inside the try, where the RuntimeError is expected
        caught = None
        try:
            os.kill(it._workers[k % 2].pid, signal.SIGKILL)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                time.sleep(0.01)
        except RuntimeError as err:
            caught = err
        assert caught is not None and re.search(r"DataLoader worker \(pid \d+\) is killed by signal", str(caught))
        del it, loader
    assert epoch_labels() == [label for _, _, label in expected]
    gc.collect()
    fds_after = _open_fds()
    grown = sorted((fds_after - fds_before).elements())
    # a leak per kill would show up as ~kills extra descriptors; allow a little slack for
    # torch's shared-memory bookkeeping
    assert len(grown) <= 4, f"file descriptors leak per killed loader: {grown}"
    first = next(iter(DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="fork")))
    assert isinstance(first[0], torch.Tensor) and first[1] == expected[0][2]
    dataset.close()
