"""The contract every storage backend keeps, checked over every backend in the registry
(``BACKENDS``) and a test-only one declared in one ``register_backend`` call (modelled on
torchvision's ``DatasetTestCase``: one suite, every implementation).

For each backend a classification store (``fastdata.convert`` of a tiny ImageFolder tree)
and a general store (``fastdata.write`` of samples of every field kind) are written through
the public API, then read back through the backend's own shard reader class:

* records round-trip bit-exact, and the index arrays hold what was written;
* a flipped byte in a record is a :class:`CorruptRecordError` (and ``verify`` fails), while
  the untouched store passes ``verify``;
* a dataset pickles before it opens anything, and reads in a forked child;
* ``close()`` releases the shard file (no descriptor, no mapping left);
* the registry's suffixes select the backend.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers.backends import DUMMY, NAMES, dummy_backend
from helpers.images import make_tree
from helpers.samples import SCHEMA, sample
from PIL import Image

import fastdata
from fastdata.errors import CorruptRecordError
from fastdata.format.backends.base import StorageSpec
from fastdata.format.backends.registry import Backend, backend_for_path, get_backend
from fastdata.format.manifest import read_manifest
from fastdata.format.record import FORMAT_CODES, SampleIndexBuilder, checksum

N_V2 = 6


@pytest.fixture(scope="module", params=[*NAMES, DUMMY])
def backend(request):
    """Each registered backend, then the test-only one (registered for its tests alone)."""
    if request.param == DUMMY:
        with dummy_backend() as dummy:
            yield dummy
    else:
        yield get_backend(request.param)


@pytest.fixture(scope="module")
def stores(backend: Backend, tmp_path_factory):
    """``{"tree", "v1", "v2"}``: the source tree, its converted store and a written store."""
    root = tmp_path_factory.mktemp(f"contract-{backend.name}")
    tree = make_tree(root / "tree", {"ant": 3, "bee": 2}, size=(24, 16))
    v1 = str(root / f"v1{backend.shard_suffix}")
    fastdata.convert(tree, v1, workers=1, progress=False)
    v2 = str(root / f"v2{backend.shard_suffix}")
    fastdata.write([sample(i) for i in range(N_V2)], v2, schema=SCHEMA, workers=0, progress=False)
    return {"tree": tree, "v1": v1, "v2": v2}


def _shards(store: str) -> list[dict]:
    return read_manifest(store)["shards"]


def _open(backend: Backend, store: str, shard: dict, schema=None):
    storage = StorageSpec.from_json(read_manifest(store)["storage"])
    return backend.reader_class()(os.path.join(store, shard["name"]), storage, schema=schema)


# -- the registry --------------------------------------------------------------------------------

def test_the_suffixes_select_the_backend(backend, stores, tmp_path):
    for suffix in backend.suffixes:
        assert backend_for_path(f"/data/train{suffix}") == backend.name
        assert backend_for_path(f"/data/train{suffix.upper()}/") == backend.name
    for store in (stores["v1"], stores["v2"]):
        assert read_manifest(store)["backend"] == backend.name
        assert all(s["name"].endswith(backend.shard_suffix) for s in _shards(store))
    for suffix in backend.suffixes[1:]:  # every other suffix writes the same backend
        dst = tmp_path / f"alt{suffix}"
        fastdata.write([sample(0)], dst, schema=SCHEMA, workers=0, progress=False)
        assert read_manifest(str(dst))["backend"] == backend.name


# -- records and index -----------------------------------------------------------------------------

def test_classification_records_round_trip_bit_exact_with_their_index(backend, stores):
    tree = Path(stores["tree"])
    files = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*.jpg"))
    classes = sorted({f.split("/")[0] for f in files})
    seen = []
    for shard in _shards(stores["v1"]):
        with _open(backend, stores["v1"], shard) as reader:
            index = reader.read_index()
            assert len(index) == shard["count"]
            for i in range(len(index)):
                rel = os.fsdecode(index.relpath(i))
                data = (tree / rel).read_bytes()
                assert reader.get(i) == data, rel  # bit-exact
                with Image.open(tree / rel) as im:
                    assert (int(index.widths[i]), int(index.heights[i])) == im.size
                assert int(index.labels[i]) == classes.index(rel.split("/")[0])
                assert int(index.formats[i]) == FORMAT_CODES["JPEG"]
                assert int(index.nbytes[i]) == len(data) and int(index.checksums[i]) == checksum(data)
                seen.append(rel)
            assert reader.get_many([len(index) - 1, 0]) == [reader.get(len(index) - 1), reader.get(0)]
    assert sorted(seen) == files


def test_general_records_round_trip_bit_exact_with_their_index(backend, stores):
    from fastdata.writer.sources.python import prepare_sample

    encoded = [prepare_sample(SCHEMA, sample(i), i) for i in range(N_V2)]
    start = 0
    for shard in _shards(stores["v2"]):
        with _open(backend, stores["v2"], shard, schema=SCHEMA) as reader:
            index = reader.read_index()
            mine = encoded[start:start + len(index)]
            assert [reader.get(i) for i in range(len(index))] == [e.record for e in mine]  # bit-exact
            builder = SampleIndexBuilder(SCHEMA)
            for e in mine:
                builder.add(e)
            want = builder.build().arrays
            assert sorted(index.arrays) == sorted(want)
            for key in want:
                np.testing.assert_array_equal(index.arrays[key], want[key], err_msg=key)
            start += len(index)
    assert start == N_V2
    ds = fastdata.open_dataset(stores["v2"])
    assert ds[N_V2 - 1]["caption"] == sample(N_V2 - 1)["caption"]


# -- checksums ---------------------------------------------------------------------------------------

def test_a_flipped_byte_is_a_corrupt_record_error_and_fails_verify(backend, stores, tmp_path):
    assert fastdata.verify(stores["v1"]).ok and fastdata.verify(stores["v2"]).ok  # control: intact stores pass
    store = str(tmp_path / f"copy{backend.shard_suffix}")
    shutil.copytree(stores["v1"], store)
    shard = _shards(store)[0]
    with _open(backend, store, shard) as reader:
        victim = reader.get(1)
    path = os.path.join(store, shard["name"])
    raw = bytearray(Path(path).read_bytes())
    at = raw.find(victim)
    assert at >= 0 and raw.find(victim, at + 1) < 0, "the record's bytes are stored once, contiguously"
    raw[at + len(victim) // 2] ^= 0xFF
    Path(path).write_bytes(bytes(raw))
    with _open(backend, store, shard) as reader:
        assert reader.get(0)  # the others still read
        with pytest.raises(CorruptRecordError):
            reader.get(1)
    assert not fastdata.verify(store).ok


# -- processes and handles ---------------------------------------------------------------------------

def _read_in_child(ds, i, queue) -> None:
    img, label = ds[i]
    queue.put((np.asarray(img).tobytes(), int(label)))


def test_a_dataset_pickles_before_opening_and_reads_after_fork(backend, stores):
    ds = fastdata.open_dataset(stores["v1"], output="numpy")
    again = pickle.loads(pickle.dumps(ds))  # nothing opened yet: nothing unpicklable
    want = [(np.asarray(img).tobytes(), int(label)) for img, label in (ds[i] for i in range(len(ds)))]
    assert [(np.asarray(img).tobytes(), int(label)) for img, label in (again[i] for i in range(len(ds)))] == want
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(ds, len(ds) - 1, queue))  # ds has its shards open
    child.start()
    try:
        assert queue.get(timeout=60) == want[-1]
        child.join(30)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    assert (np.asarray(ds[0][0]).tobytes(), int(ds[0][1])) == want[0]  # the parent's readers still work


def _handles_on(path: str) -> list[str]:
    """This process's descriptors and memory maps of ``path``."""
    real = os.path.realpath(path)
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.path.realpath(f"/proc/self/fd/{fd}") == real:
                fds.append(f"fd {fd}")
        except OSError:
            pass
    with open("/proc/self/maps") as fh:
        maps = [line.strip() for line in fh if line.rstrip().endswith(real)]
    return fds + maps


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc")
def test_close_releases_the_shard_file(backend, stores):
    shard = _shards(stores["v1"])[0]
    path = os.path.join(stores["v1"], shard["name"])
    reader = _open(backend, stores["v1"], shard)
    reader.get(0)
    assert _handles_on(path), "control: an open reader holds the file"
    reader.close()
    assert _handles_on(path) == []
