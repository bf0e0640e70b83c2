"""I/O errors during conversion: a clear error, nothing published, resume succeeds.

Each case injects ``OSError(ENOSPC)`` or ``OSError(EIO)`` (in-process, by
monkeypatching) at the N-th operation of one kind on files inside the
destination:

* ``write``  ``os.write`` (used by ``atomic_write``: plan, sidecars, rejected.tsv, manifest)
* ``fsync``  ``os.fsync`` (shard files, sidecars, the manifest, their directory)
* ``rename`` ``os.replace`` / ``os.rename`` (shard publish, atomic_write)
* ``lmdb-commit`` the LMDB write transaction's commit (raises ``lmdb.DiskError`` / ``lmdb.Error``)
* ``hdf5-write`` writes libhdf5 makes through its file object (metadata, index arrays)
* ``hdf5-payload`` the HDF5 writer's own writes of image bytes into the shard file

For every case: ``fastdata.convert`` raises :class:`ConversionError` whose
message names a path in the store and the cause; ``manifest.json`` does not
exist; every shard whose finish did not complete is rewritten by the resume
(no sidecar is trusted after a failed fsync) and every shard that did finish is
kept; the resumed store verifies and holds exactly the reference records.
A real ENOSPC on a tiny tmpfs closes the loop where the test may mount one.
"""

from __future__ import annotations

import errno
import os
import re
import resource
import signal
import subprocess
import sys

import lmdb
import pytest

import fastdata
from fastdata.errors import ConversionError
from fastdata.format.names import MANIFEST_NAME, STAGING_DIR
from fastdata.writer import pipeline

NIGHTLY = os.environ.get("FASTDATA_NIGHTLY") == "1"
SHARD_SIZE = 3000
CAUSES = {errno.ENOSPC: "No space left on device", errno.EIO: "Input/output error"}

pytestmark = pytest.mark.timeout(180)

from helpers.backends import SUFFIXES  # noqa: E402
from helpers.images import make_tree  # noqa: E402
from helpers.stores import store_records  # noqa: E402

# ----------------------------------------------------------------------------- injection

def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


class Faults:
    """Counts operations of one kind on paths under ``root``; the ``nth`` one fails."""

    def __init__(self, root: str, nth: int | None, code: int):
        self.root = os.path.realpath(root)
        self.nth = nth
        self.code = code
        self.count = 0
        self.failed_at = ""

    def mine(self, path) -> bool:
        return bool(path) and os.path.realpath(os.fsdecode(path)).startswith(self.root)

    def hit(self, path) -> bool:
        if not self.mine(path):
            return False
        self.count += 1
        if self.count == self.nth:
            self.failed_at = os.fsdecode(path)
            return True
        return False

    def oserror(self) -> OSError:
        # like the real ones: os.write/os.fsync errors carry no file name
        return OSError(self.code, os.strerror(self.code))

    def lmdb_error(self) -> lmdb.Error:
        cls = lmdb.DiskError if self.code == errno.ENOSPC else lmdb.Error
        return cls(f"mdb_txn_commit: {os.strerror(self.code)}")


class _TxnProxy:
    def __init__(self, txn, faults: Faults, path: str):
        self._txn, self._faults, self._path = txn, faults, path

    def __getattr__(self, name):
        return getattr(self._txn, name)

    def __enter__(self):
        self._txn.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None and self._faults.hit(self._path):
            self._txn.abort()
            raise self._faults.lmdb_error()
        return self._txn.__exit__(exc_type, exc, tb)


class _EnvProxy:
    def __init__(self, env, faults: Faults, path: str):
        self._env, self._faults, self._path = env, faults, path

    def __getattr__(self, name):
        return getattr(self._env, name)

    def begin(self, *args, **kwargs):
        txn = self._env.begin(*args, **kwargs)
        return _TxnProxy(txn, self._faults, self._path) if kwargs.get("write") else txn


def install(monkeypatch, op: str, faults: Faults) -> None:
    """Patch the operations of kind ``op`` to consult ``faults``."""
    if op == "write":
        real_write = os.write

        def write(fd, data):
            if faults.hit(_fd_path(fd)):
                raise faults.oserror()
            return real_write(fd, data)

        monkeypatch.setattr(os, "write", write)
    elif op == "fsync":
        real_fsync = os.fsync

        def fsync(fd):
            fd_num = fd if isinstance(fd, int) else fd.fileno()
            if faults.hit(_fd_path(fd_num)):
                raise faults.oserror()
            return real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)
    elif op == "rename":
        for name in ("replace", "rename"):
            real = getattr(os, name)

            def renamer(src, dst, *args, _real=real, **kwargs):
                if faults.hit(src):
                    # real rename errors do name both paths
                    raise OSError(faults.code, os.strerror(faults.code), src, None, dst)
                return _real(src, dst, *args, **kwargs)

            monkeypatch.setattr(os, name, renamer)
    elif op == "lmdb-commit":
        real_open = lmdb.open

        def open_env(path, *args, **kwargs):
            env = real_open(path, *args, **kwargs)
            if kwargs.get("readonly") or not faults.mine(path):
                return env
            return _EnvProxy(env, faults, path)

        monkeypatch.setattr(lmdb, "open", open_env)
    elif op == "hdf5-write":
        from fastdata.format.backends.hdf5 import writer as hdf5_writer

        real_write = hdf5_writer.file_write

        def file_write(fh, view):  # every write libhdf5 makes through its file object
            if faults.hit(fh.name):
                raise faults.oserror()
            return real_write(fh, view)

        monkeypatch.setattr(hdf5_writer, "file_write", file_write)
    elif op == "hdf5-payload":
        from fastdata.format.backends.hdf5 import writer as hdf5_writer

        class FaultyFile:
            def __init__(self, fh):
                self._fh = fh

            def __getattr__(self, name):
                return getattr(self._fh, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self._fh.close()

            def write(self, data):
                if faults.hit(self._fh.name):
                    raise faults.oserror()
                return self._fh.write(data)

        def fake_open(path, mode="r", *args, **kwargs):
            fh = open(path, mode, *args, **kwargs)
            return FaultyFile(fh) if "w" in mode or "a" in mode else fh

        monkeypatch.setattr(hdf5_writer, "open", fake_open, raising=False)
    else:
        raise ValueError(op)


def _shard_files(dst: str) -> dict[str, tuple[int, int]]:
    """The shard files in ``dst``: name -> (inode, mtime in ns)."""
    if not os.path.isdir(dst):
        return {}
    out = {}
    for name in os.listdir(dst):
        if name.startswith("shard-") and name.endswith(SUFFIXES):
            st = os.stat(os.path.join(dst, name))
            out[name] = (st.st_ino, st.st_mtime_ns)
    return out


class ShardLog:
    """Which shards a run into ``dst`` finished and which it wrote, seen from outside the pipeline.

    A shard is finished once its result sidecar (``.fastdata-staging/<shard>.json``, the proof it
    is complete) is written: the last step of finishing it, so a write that returns is a shard
    that finished. A shard was written by the run when its file is a new one afterwards (a shard
    kept by a resume is never touched; one written goes through a new file renamed into place).
    Make it just before the run; ``started`` is read after it."""

    def __init__(self, monkeypatch, dst: str):
        self.finished: list[str] = []
        self._dst, self._before = dst, _shard_files(dst)
        staging = os.path.join(dst, STAGING_DIR)
        real_atomic_write = pipeline.atomic_write

        def atomic_write(path, data, *args, **kwargs):
            real_atomic_write(path, data, *args, **kwargs)
            name = os.path.basename(path)
            if os.path.dirname(path) == staging and name.startswith("shard-") and name.endswith(".json"):
                self.finished.append(name[: -len(".json")])

        monkeypatch.setattr(pipeline, "atomic_write", atomic_write)

    @property
    def started(self) -> list[str]:
        """The shards whose files the run wrote (new, or replaced)."""
        return [name for name, ident in _shard_files(self._dst).items() if self._before.get(name) != ident]


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    src = make_tree(root / "src", classes={"cat": 8, "dog": 6, "emu": 6}, size=(24, 16))
    open(os.path.join(src, "dog", "empty.jpg"), "wb").close()  # one rejected input
    return src


@pytest.fixture(scope="module")
def reference(source, tmp_path_factory):
    """A clean conversion per backend: its records, shard names and op counts."""
    out = {}
    for backend, suffix in (("lmdb", ".lmdb"), ("hdf5", ".h5")):
        counts = {}
        for op in OPS_BY_BACKEND[backend]:
            dst = str(tmp_path_factory.mktemp("ref") / f"store{suffix}")
            with pytest.MonkeyPatch.context() as mp:
                faults = Faults(dst, None, errno.EIO)
                install(mp, op, faults)
                _convert(source, dst)
            counts[op] = faults.count
        manifest, records = store_records(dst)
        out[backend] = {"suffix": suffix, "counts": counts, "records": records,
                        "shards": [s["name"] for s in manifest["shards"]], "rejected": manifest["rejected"]}
        assert len(out[backend]["shards"]) >= 4 and len(manifest["rejected"]) == 1
    return out


def _convert(src: str, dst: str, **kwargs):
    return fastdata.convert(src, dst, workers=1, shard_size=SHARD_SIZE, progress=False, **kwargs)


OPS_BY_BACKEND = {"lmdb": ["write", "fsync", "rename", "lmdb-commit"],
                  "hdf5": ["write", "fsync", "rename", "hdf5-write", "hdf5-payload"]}


def _which_n(op: str, count: int) -> list[int]:
    """N = 1..k (all of them nightly); by default the first operations (plan,
    first shard) and the last ones (rejected.tsv and manifest), where each kind
    of sync point occurs at least once."""
    if NIGHTLY:
        return list(range(1, count + 1))
    head = {"fsync": 6, "write": 2, "rename": 3, "lmdb-commit": 3, "hdf5-write": 2, "hdf5-payload": 2}[op]
    tail = {"fsync": 4, "write": 2, "rename": 2, "lmdb-commit": 1, "hdf5-write": 1, "hdf5-payload": 1}[op]
    return sorted({n for n in list(range(1, head + 1)) + list(range(count - tail + 1, count + 1)) if 1 <= n <= count})


CASES = [(backend, op) for backend, ops in OPS_BY_BACKEND.items() for op in ops]


# ----------------------------------------------------------------------------- the tests

def test_counting_pass_sees_every_kind_of_operation(reference):
    """Control: the injector really intercepts the operations it claims to
    (otherwise every case below would pass vacuously)."""
    for backend, ref in reference.items():
        n = len(ref["shards"])
        counts = ref["counts"]
        # per shard at least: file fsync, dir fsync, sidecar fsync + its dir fsync
        assert counts["fsync"] >= 4 * n + 4, counts
        assert counts["rename"] >= 2 * n + 2, counts
        assert counts["write"] >= n + 2, counts
        for key in ("lmdb-commit",) if backend == "lmdb" else ("hdf5-write", "hdf5-payload"):
            assert counts[key] >= n, counts


@pytest.mark.parametrize("backend,op", CASES)
def test_fault_at_nth_operation_then_resume(source, reference, tmp_path, monkeypatch, backend, op):
    ref = reference[backend]
    for k, nth in enumerate(_which_n(op, ref["counts"][op])):
        code = (errno.EIO, errno.ENOSPC)[k % 2]
        dst = str(tmp_path / f"{op}-{nth}{ref['suffix']}")
        case = f"{backend} {op} #{nth} {errno.errorcode[code]}"
        with monkeypatch.context() as mp:
            faults = Faults(dst, nth, code)
            install(mp, op, faults)
            log = ShardLog(mp, dst)
            with pytest.raises(ConversionError) as exc:
                _convert(source, dst)
        message = str(exc.value)
        assert faults.failed_at, f"{case}: the fault never fired"
        cause = CAUSES[code]
        assert cause in message, f"{case}: the cause is not named: {message}"
        assert dst in message and "resume=True" in message, f"{case}: {message}"
        assert not os.path.exists(os.path.join(dst, MANIFEST_NAME)), f"{case}: a manifest was published"

        with monkeypatch.context() as mp:
            again = ShardLog(mp, dst)
            report = _convert(source, dst, resume=True)
        # nothing that finished is redone; everything that did not finish is rewritten
        assert sorted(again.started) == sorted(set(ref["shards"]) - set(log.finished)), case
        assert report.resumed_shards == len(log.finished), case
        assert fastdata.verify(dst).ok, case
        manifest, records = store_records(dst)
        assert records == ref["records"], f"{case}: resumed store differs from the reference"
        assert manifest["rejected"] == ref["rejected"], case
        assert sorted(os.listdir(dst)) == sorted(ref["shards"] + [MANIFEST_NAME, "rejected.tsv", "index.fdi"]), case


def test_eio_from_fsync_of_a_shard_means_it_is_rewritten(source, reference, tmp_path, monkeypatch):
    """The fsyncgate rule, spelled out: the shard whose fsync failed has no
    sidecar, and resume writes it again from the source."""
    dst = str(tmp_path / "eio.lmdb")
    shard_fsyncs = []
    real_fsync = os.fsync

    def fsync(fd):
        path = _fd_path(fd)
        if path.startswith(dst) and path.endswith(".lmdb.tmp"):
            shard_fsyncs.append(path)
            if len(shard_fsyncs) == 2:  # the second shard's data sync
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_fsync(fd)

    with monkeypatch.context() as mp:
        mp.setattr(os, "fsync", fsync)
        with pytest.raises(ConversionError, match="Input/output error"):
            _convert(source, dst)
    failed = os.path.basename(shard_fsyncs[-1])[: -len(".tmp")]
    staging = os.path.join(dst, ".fastdata-staging")
    assert not os.path.exists(os.path.join(staging, failed + ".json"))
    assert not os.path.exists(os.path.join(dst, failed))
    with monkeypatch.context() as mp:
        log = ShardLog(mp, dst)
        _convert(source, dst, resume=True)
    assert failed in log.started
    assert fastdata.verify(dst).ok


def test_failed_directory_sync_after_manifest_rename_unpublishes(source, tmp_path, monkeypatch):
    """The very last operation (fsync of the store directory after the manifest
    rename) failing must leave no manifest: it was never durable."""
    dst = str(tmp_path / "last.h5")
    calls = []
    real_fsync = os.fsync

    def fsync(fd):
        path = _fd_path(fd)
        calls.append(path)
        if path == dst and os.path.exists(os.path.join(dst, MANIFEST_NAME)):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_fsync(fd)

    with monkeypatch.context() as mp:
        mp.setattr(os, "fsync", fsync)
        with pytest.raises(ConversionError, match=f"{MANIFEST_NAME}: Input/output error"):
            _convert(source, dst)
    assert not os.path.exists(os.path.join(dst, MANIFEST_NAME))
    report = _convert(source, dst, resume=True)
    assert report.resumed_shards == report.shards  # every shard was kept
    assert fastdata.verify(dst).ok


# ----------------------------------------------------------------------------- real ENOSPC

@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 256 KiB tmpfs, or a skip when this process may not mount one."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("a real ENOSPC needs a tiny tmpfs, and mounting one needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}); "
                    "the in-process ENOSPC injection above still runs")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_real_enospc_on_a_tiny_filesystem_then_free_space_and_resume(tiny_tmpfs, tmp_path, suffix):
    src = make_tree(tmp_path / "big", classes={"a": 40, "b": 40}, size=(96, 64))
    dst = os.path.join(tiny_tmpfs, "store" + suffix)
    with pytest.raises(ConversionError) as exc:
        fastdata.convert(src, dst, workers=2, shard_size=60_000, progress=False)
    message = str(exc.value)
    assert dst in message, message
    # LMDB reports a full disk as a short write (EIO): the free space figure tells the user
    assert "No space left on device" in message or re.search(r"\(\d+ B free on that filesystem\)", message), message
    assert not os.path.exists(os.path.join(dst, MANIFEST_NAME))
    # free space (grow the filesystem), then resume
    subprocess.run(["mount", "-o", "remount,size=64m", tiny_tmpfs], check=True)
    report = fastdata.convert(src, dst, workers=2, shard_size=60_000, progress=False, resume=True)
    assert report.images == 80 and fastdata.verify(dst).ok
    manifest, records = store_records(dst)
    assert [r["relpath"] for r in records] == sorted(
        os.path.join(c, f) for c in ("a", "b") for f in os.listdir(os.path.join(src, c)))


# ----------------------------------------------------------------------------- a real write error, end to end

def _limit_file_size(limit: int):
    """A preexec_fn: writes past ``limit`` bytes of one file fail with EFBIG (a real
    kernel write error; no root needed)."""
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.parametrize("suffix,shard_size,limit,repeat", [
    (".lmdb", "1G", 150_000, 4),     # fails in LMDB's page writes
    (".h5", "1G", 150_000, 1),       # fails in the HDF5 writer's side file of image bytes
    (".h5", "100000", 101_000, 2),   # side files fit; fails inside libhdf5 writing the shard
])
def test_cli_write_error_mid_run_exits_promptly_with_one_error_line(tmp_path, suffix, shard_size, limit, repeat):
    """The write fails while both workers are sending large results. The CLI must
    print one error line and exit 2 promptly: no hang at exit (a worker
    terminated mid-send used to wedge the pool's manager thread, which the
    interpreter joins at exit), no hang or crash inside libhdf5 (it cannot close
    a file whose write failed). Then a resume without the limit finishes."""
    src = make_tree(tmp_path / "src", classes={"a": 60, "b": 60}, size=(160, 120))
    dst = str(tmp_path / ("store" + suffix))
    command = [sys.executable, "-m", "fastdata", "convert", src, dst, "--workers", "2", "--quiet",
               "--shard-size", shard_size]
    for attempt in range(repeat):
        done = subprocess.run(command + (["--resume"] if attempt else []), preexec_fn=_limit_file_size(limit),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
        assert done.stderr.startswith("fastdata: error: I/O error while writing " + dst), done.stderr[-3000:]
        assert "Traceback" not in done.stderr and "Segmentation" not in done.stderr, done.stderr[-3000:]
        assert not os.path.exists(os.path.join(dst, MANIFEST_NAME))
    # the resume without the limit: the CLI in this process (no limit to apply, no exit to watch)
    from fastdata.cli.main import main

    assert main(command[3:] + ["--resume"]) == 0
    assert fastdata.verify(dst).ok
