"""A reader decoding chunks of a large store does not keep the store mapped: once the chunks
it decoded add up to a window (``FASTDATA_MAPPED_WINDOW``), their pages leave the process's page
tables (``MADV_DONTNEED``), so a worker's RSS/PSS stays flat instead of growing toward the
store's size. Linux only (/proc/self/smaps)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import fastdata
from fastdata.fields import Chunked

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")

SHAPE = (128, 128, 128)


def _mapped_kib(path: str) -> int:
    """Resident KiB of this process's mappings of ``path`` (every file under it, for a directory)."""
    real = os.path.realpath(path)
    total, current = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
                current = len(head) >= 6 and head[-1].startswith(real)
            elif current and head[:1] == ["Rss:"]:
                total += int(head[1])
    return total


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("mapped")
    rng = np.random.default_rng(0)
    # noise: chunks that barely compress, so the store is about as large as the volume (4 MiB)
    vol = rng.integers(0, 4096, SHAPE, dtype=np.uint16)
    out = {}
    for suffix in (".lmdb", ".h5"):
        dst = root / f"noise{suffix}"
        fastdata.write([{"ct": vol}], dst, {"ct": Chunked("uint16", (32, 32, 32))}, workers=0, progress=False)
        out[suffix] = str(dst)
    return out, vol


@pytest.mark.parametrize("suffix", [".lmdb", ".h5"])
@pytest.mark.parametrize("release", [True, False], ids=["released", "control"])
def test_decoded_chunks_do_not_stay_mapped(stores, suffix, release, monkeypatch):
    """With a window of 256 KiB (FASTDATA_MAPPED_WINDOW) a reader keeps about that much of the
    store mapped, whatever the store's size."""
    paths, vol = stores
    # control: the same reads with releasing switched off (a window of 0) keep the store mapped
    monkeypatch.setenv("FASTDATA_MAPPED_WINDOW", str(256 << 10) if release else "0")
    ds = fastdata.open_dataset(paths[suffix])
    arr = ds[0]["ct"]
    store_kib = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(paths[suffix]) for f in fs) // 1024
    for z in range(0, SHAPE[0], 32):  # every chunk, a slab at a time
        assert np.array_equal(arr[z:z + 32], vol[z:z + 32])
    mapped = _mapped_kib(paths[suffix])
    ds.close()
    assert store_kib > 3000
    if release:
        # what is left: at most the window, the index and record pages
        assert mapped < 256 + store_kib * 0.1, (mapped, store_kib)
    else:
        assert mapped > store_kib * 0.8, (mapped, store_kib)
