"""Subprocesses the tests start: reaped when a test ends, SIGKILLed mid-write."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def reaped(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """Run the block, then make sure the subprocess ``proc`` is gone: if the block left it
    running (a failed check, an exception), it is killed and waited for, so no test leaves a
    converter behind. Yields ``proc``."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def sigkill_once_a_shard_is_staged(proc: subprocess.Popen, dst: str | os.PathLike, what: str) -> None:
    """SIGKILL ``proc``, which is writing the store ``dst``, as soon as it has finished a shard
    (the shard's sidecar is in the staging folder), and wait for it: an interrupted run that
    ``--resume`` / ``resume=True`` has something to keep from.

    Fails the test when ``proc`` ends first (``what``, e.g. ``"writer"``, names it).
    """
    from fastdata.format.names import STAGING_DIR

    staging = Path(dst) / STAGING_DIR
    with reaped(proc):
        while not (staging.exists() and any(staging.glob("shard-*.json"))):
            if proc.poll() is not None:
                pytest.fail(f"the {what} finished before it could be killed: {proc.communicate()}")
            time.sleep(0.002)  # polling for the sidecar, not waiting for an outcome
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)


def killed_resumed_and_clean(command, dst: Path, clean: Path, env: dict) -> None:
    """The CLI's kill-and-resume contract for one input: ``command(dst, *extra)`` (the argv of a
    conversion into ``dst``) is SIGKILLed once it has finished a shard, run again with
    ``--resume`` (which must say it resumed), and run once more, uninterrupted, into ``clean``;
    both stores must then have several shards, the same ones (names, counts, checksums), and verify.
    """
    import fastdata
    from fastdata.format.manifest import read_manifest

    proc = subprocess.Popen(command(dst), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sigkill_once_a_shard_is_staged(proc, dst, "convert")
    assert not (Path(dst) / "manifest.json").exists()
    again = subprocess.run(command(dst, "--resume"), env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "resum" in (again.stdout + again.stderr).lower(), again.stdout + again.stderr
    done = subprocess.run(command(clean), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr

    def shards(store) -> list:
        return [(s["name"], s["count"], s["xxh"]) for s in read_manifest(str(store))["shards"]]

    assert len(shards(dst)) > 1
    assert shards(dst) == shards(clean)
    assert fastdata.verify(str(dst)).ok


def cli_in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """``fastdata ARGS`` through the CLI in this process (faster than a subprocess): its exit code,
    stdout and stderr, warnings folded into stderr as a subprocess would print them."""
    import warnings

    from fastdata.cli.main import main

    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        code = main(list(args))
    out = capsys.readouterr()
    err = out.err + "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught)
    return subprocess.CompletedProcess(["fastdata", *args], code, out.out, err)


def free_port() -> int:
    """A TCP port of 127.0.0.1 free right now (for a torchrun rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str, nproc: int = 2, check: bool = True, wait: bool = True):
    """``python -m fastdata ARGS`` under ``torch.distributed.run`` with ``nproc`` ranks on this
    machine. ``wait``: run to the end (``check``: asserting exit 0) and return the completed
    process; else return the running ``Popen`` (its own session, so it can be killed whole)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "fastdata", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
