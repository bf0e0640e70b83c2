"""Real Azure Blob and Google Cloud Storage emulators for the ``az://`` and ``gs://`` tests,
started on a free loopback port like the S3 server (tests/helpers/s3server.py: same process
lifetime rules, killed with the test process however it ends).

* :class:`Azurite`: Microsoft's Azurite blob service (npm package ``azurite``; ``.ci/run``
  installs it under ``.venv/node``), driven through adlfs with the emulator's well-known
  development account in a connection string.
* :class:`GcsEmulator`: ``gcp-storage-emulator`` (PyPI, in the test extra), the JSON API that
  gcsfs speaks, driven through gcsfs with ``endpoint_url`` and ``token="anon"``.

``server.storage_options`` is what a test passes as ``storage_options`` (and what the CLI takes
as ``key=value`` options); ``server.make_bucket(name)`` makes a bucket (a container on Azure);
``server.url(name)`` is its URL.
"""

from __future__ import annotations

import http.client
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from helpers.s3server import free_port_block, kill_server, spawn_server

#: set where the emulators must run (CI): a missing one fails its tests instead of skipping them
REQUIRE_ENV = "FASTDATA_REQUIRE_EMULATORS"

#: Azurite's fixed development account (documented by Microsoft; not a secret)
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def azurite_binary() -> str | None:
    """The ``azurite-blob`` executable: ``.venv/node`` of this environment (where ``.ci/run``
    installs it), else one on PATH; None where there is none (or no node to run it)."""
    if shutil.which("node") is None:
        return None
    here = os.path.join(sys.prefix, "node", "node_modules", ".bin", "azurite-blob")
    return here if os.access(here, os.X_OK) else shutil.which("azurite-blob")


def gcs_emulator_binary() -> str | None:
    """The ``gcp-storage-emulator`` executable of this environment, or None."""
    here = os.path.join(os.path.dirname(sys.executable), "gcp-storage-emulator")
    return here if os.access(here, os.X_OK) else shutil.which("gcp-storage-emulator")


class _Emulator:
    scheme = ""
    name = ""

    def __init__(self, root: str):
        self.root = root
        os.makedirs(root, exist_ok=True)
        self.port = free_port_block(1)[0]
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(root, f"{self.scheme}-emulator.log")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        raise NotImplementedError

    @property
    def storage_options(self) -> dict[str, Any]:
        """The ``storage_options`` of a store on this emulator."""
        return self.options_via(self.endpoint)

    def options_via(self, endpoint: str) -> dict[str, Any]:
        """``storage_options`` that reach this emulator at ``endpoint`` (a proxy in front of it)."""
        raise NotImplementedError

    def spawn(self) -> subprocess.Popen:
        self.proc = spawn_server(self.argv(), self.log_path)
        return self.proc

    def start(self, timeout: float = 60.0):
        self.spawn()
        return self.wait(timeout)

    def wait(self, timeout: float = 60.0):
        """Wait until the emulator answers HTTP (any status: an error document means it is up)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=1).close()
                return self
            except urllib.error.HTTPError:
                return self
            except (OSError, http.client.HTTPException):
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"{self.name} did not answer within {timeout} s; see {self.log_path}")

    def kill(self) -> None:
        if self.proc is not None:
            kill_server(self.proc)
        self.proc = None

    def filesystem(self):
        import fsspec

        return fsspec.filesystem(self.scheme, skip_instance_cache=True, **self.storage_options)

    def make_bucket(self, name: str) -> None:
        self.filesystem().mkdir(name)

    def url(self, bucket: str) -> str:
        return f"{self.scheme}://{bucket}"


class Azurite(_Emulator):
    """Azurite's blob service; its data lives in ``root`` (across a restart on the same port)."""

    scheme = "az"
    name = "Azurite"

    def argv(self) -> list[str]:
        binary = azurite_binary()
        if binary is None:
            raise FileNotFoundError("azurite-blob (npm install --prefix .venv/node azurite; needs node)")
        return [binary, "--blobHost", "127.0.0.1", "--blobPort", str(self.port), "--location",
                os.path.join(self.root, "data"), "--silent", "--disableTelemetry",
                # the newest adlfs/azure-storage-blob may send an API version this Azurite predates
                "--skipApiVersionCheck", "--loose"]

    def options_via(self, endpoint: str) -> dict[str, Any]:
        return {"connection_string": f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
                                     f"AccountKey={AZURITE_KEY};BlobEndpoint={endpoint}/{AZURITE_ACCOUNT};"}


class GcsEmulator(_Emulator):
    """gcp-storage-emulator, its data in memory (lost when it stops)."""

    scheme = "gs"
    name = "gcp-storage-emulator"

    def argv(self) -> list[str]:
        binary = gcs_emulator_binary()
        if binary is None:
            raise FileNotFoundError("gcp-storage-emulator (pip install gcp-storage-emulator, in the test extra)")
        return [binary, "start", "--host", "127.0.0.1", "--port", str(self.port), "--in-memory", "--quiet"]

    def options_via(self, endpoint: str) -> dict[str, Any]:
        return {"endpoint_url": endpoint, "token": "anon"}


EMULATORS: dict[str, type[_Emulator]] = {"az": Azurite, "gs": GcsEmulator}
_BINARY = {"az": azurite_binary, "gs": gcs_emulator_binary}


def missing(scheme: str) -> str | None:
    """Why the emulator of ``scheme`` cannot start here (its program or fsspec library is
    missing), or None."""
    if _BINARY[scheme]() is None:
        return {"az": "no azurite-blob (npm install --prefix .venv/node azurite; needs node)",
                "gs": "no gcp-storage-emulator (pip install gcp-storage-emulator, in the test extra)"}[scheme]
    library = {"az": "adlfs", "gs": "gcsfs"}[scheme]
    try:
        __import__(library)
    except ImportError:
        return f"no {library} (pip install {library}, in the test extra)"
    return None
