"""The S3 server of a remote source killed mid-conversion, then restarted, then ``--resume``
(issue 40): against a SeaweedFS server of this test alone (tests/helpers/s3server.py: ``kill()``,
then ``start()`` on the same ports and data). The converter (the CLI, in a subprocess) is stopped
with SIGSTOP once it has staged a shard, the server killed, the converter continued: it must end
within its retries with one line naming the object and what to check, publishing nothing; after
the restart ``--resume`` keeps the staged shards and gives the store of an uninterrupted local
conversion."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers.images import make_tree
from helpers.procs import reaped
from test_remote_sources import same_store, upload_tree

import fastdata
from fastdata.format.names import STAGING_DIR

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGSTOP/SIGCONT")


@pytest.fixture
def lone_s3(tmp_path, monkeypatch):
    """A SeaweedFS server of this test alone (the test kills it), with a bucket; yields
    ``(server, "s3://bucket")``. Killed at the end whatever state the test left it in."""
    from helpers.s3server import lone_server

    yield from lone_server(tmp_path, monkeypatch, "killed")


@pytest.mark.slow
def test_server_killed_mid_conversion_is_one_error_then_resume_after_restart_equals_local(lone_s3, tmp_path):
    server, bucket = lone_s3
    # more images than the pipeline's window (4 tasks of 32 with one worker) holds: some are still to fetch
    tree = make_tree(tmp_path / "imgs", {"a": 200, "b": 200}, size=(32, 24))
    upload_tree(tree, f"{bucket}/imgs")
    local = str(tmp_path / "local.lmdb")
    fastdata.convert(tree, local, shard_size="20kB", progress=False, workers=0)
    dst = tmp_path / "remote.lmdb"
    # retries bounded and short: the run must end, not hang (2 retries of ours, botocore's own off)
    env = dict(os.environ, FASTDATA_MIN_SHARD_SIZE="1", FASTDATA_REMOTE_RETRIES="2", AWS_MAX_ATTEMPTS="1",
               FASTDATA_REMOTE_CONNECT_TIMEOUT="2", FASTDATA_REMOTE_READ_TIMEOUT="3")
    command = [sys.executable, "-m", "fastdata", "convert", f"{bucket}/imgs", str(dst), "--shard-size", "20kB",
               "--workers", "1", "--quiet"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    staging = dst / STAGING_DIR
    with reaped(proc):
        while not (staging.exists() and any(staging.glob("shard-*.json"))):
            assert proc.poll() is None, f"the converter ended before a shard was staged: {proc.communicate()}"
            time.sleep(0.002)  # polling for the sidecar, not waiting for an outcome
        proc.send_signal(signal.SIGSTOP)  # (its worker goes on: it waits for tasks)
        staged = len(list(staging.glob("shard-*.json")))
        server.kill()
        proc.send_signal(signal.SIGCONT)
        started = time.monotonic()
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - started
    assert proc.returncode != 0, (out, err)
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err.decode(), err.decode()
    # measured: "fastdata: error: reading s3://killed/imgs/a/a_071.jpg: EndpointConnectionError: Could not connect
    # to the endpoint URL: "http://127.0.0.1:PORT/killed/imgs/a/a_071.jpg" (after 3 attempts); check the endpoint,
    # credentials and network, then rerun", 2.2 s after the server was killed
    assert f"{bucket}/imgs/" in lines[0] and server.endpoint in lines[0] and "check the endpoint" in lines[0], lines[0]
    assert not (dst / "manifest.json").exists()
    assert took < 60, took  # bounded retries, no hang
    server.start()
    report = fastdata.convert(f"{bucket}/imgs", str(dst), shard_size="20kB", progress=False, workers=0, resume=True)
    assert report.resumed_shards >= staged >= 1
    same_store(str(dst), local)
