"""The HDF5 shard reader's structure checks (``fastdata.format.backends.hdf5.structure``): sound
version-1, raw and version-2 shards pass; every construct that could redirect a read (soft
or external links, external storage, virtual datasets: anywhere in the file) or allocate
more than the file holds (unwritten chunks, compression, shapes the count does not
imply) is refused before any dataset is read, naming the shard and the dataset."""

from __future__ import annotations

import os
import shutil

import h5py
import numpy as np
import pytest
from helpers import hostile as H

from fastdata.errors import CorruptRecordError, FastdataError, FormatError, UnsafeStoreError
from fastdata.format.backends.base import StorageSpec
from fastdata.format.backends.hdf5.reader import HDF5ShardReader
from fastdata.format.fields import Schema


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    work = tmp_path_factory.mktemp("h5structure")
    tree = H.build_tree(work / "tree")
    return {"v1": H.build_store(work / "v1.h5", tree=tree), "raw": H.build_store(work / "raw.h5", tree=tree, raw="8x8"),
            "v2": H.build_v2_store(work / "v2.h5")}


def _reader_args(store: str) -> tuple[StorageSpec, Schema | None, int]:
    m = H.load_manifest(store)
    schema = Schema.from_json(m["schema"]) if m.get("schema") else None
    return StorageSpec.from_json(m["storage"]), schema, m["shards"][0]["count"]


@pytest.fixture
def shard(stores, tmp_path):
    """``shard(kind) -> (path, storage, schema, count)``: a private copy of the first shard of a sound store."""
    def make(kind: str = "v1"):
        src = H.first_shard(stores[kind])
        dst = str(tmp_path / os.path.basename(src))
        shutil.copyfile(src, dst)
        return (dst, *_reader_args(stores[kind]))
    return make


def read(path: str, storage: StorageSpec, schema, count: int | None):
    with HDF5ShardReader(path, storage, schema=schema, expected_count=count) as reader:
        index = reader.read_index()
        return index, [reader.get(i) for i in range(len(index))]


@pytest.mark.parametrize("kind", ["v1", "raw", "v2"])
def test_sound_shards_pass(shard, kind):
    path, storage, schema, count = shard(kind)
    HDF5ShardReader.check_structure(path, full=True)
    index, records = read(path, storage, schema, count)
    assert len(index) == count == len(records)


def _refused(path, storage, schema, count, error, *words):
    with pytest.raises(error) as err:
        read(path, storage, schema, count)
    message = str(err.value)
    assert message.startswith(f"{path}: "), message
    for w in words:
        assert w in message, message
    return message


def _replace(path: str, name: str, make) -> np.ndarray:
    with h5py.File(path, "r+", locking=False) as f:
        data = f[name][()]
        del f[name]
        make(f, name, data)
    return data


def test_external_storage_anywhere_is_refused(shard, tmp_path):
    path, storage, schema, count = shard()
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x" * 64)
    with h5py.File(path, "r+", locking=False) as f:  # a dataset fastdata never reads
        f.create_dataset("extra/leak", shape=(64,), dtype="u1", external=[(str(outside), 0, 64)])
    _refused(path, storage, schema, count, UnsafeStoreError, "'extra/leak' keeps its data in external files",
             str(outside))
    with pytest.raises(UnsafeStoreError):
        HDF5ShardReader.check_structure(path)


def test_external_storage_of_an_index_array(shard, tmp_path):
    path, storage, schema, count = shard()
    outside = tmp_path / "labels.bin"
    outside.write_bytes(np.zeros(count, "<i8").tobytes())
    _replace(path, "labels", lambda f, n, d: f.create_dataset(n, shape=d.shape, dtype="<i8",
                                                             external=[(str(outside), 0, d.nbytes)]))
    _refused(path, storage, schema, count, UnsafeStoreError, "'labels' keeps its data in external files")


def test_external_link_is_refused_without_being_followed(shard, tmp_path):
    path, storage, schema, count = shard()
    fifo = str(tmp_path / "never-opened.fifo")
    os.mkfifo(fifo)  # following the link would hang the open
    _replace(path, "labels", lambda f, n, d: f.__setitem__(n, h5py.ExternalLink(fifo, "/labels")))
    _refused(path, storage, schema, count, UnsafeStoreError, "'labels' is an external link", "not followed")


def test_soft_link_is_refused(shard):
    path, storage, schema, count = shard()
    with h5py.File(path, "r+", locking=False) as f:
        f.create_dataset("shadow", data=np.zeros(count, "<i8"))
    _replace(path, "labels", lambda f, n, d: f.__setitem__(n, h5py.SoftLink("/shadow")))
    _refused(path, storage, schema, count, UnsafeStoreError, "'labels' is a soft link")


def test_a_dangling_soft_link_elsewhere_is_refused(shard):
    path, storage, schema, count = shard()
    with h5py.File(path, "r+", locking=False) as f:
        f["somewhere/else"] = h5py.SoftLink("/nothing")
    _refused(path, storage, schema, count, UnsafeStoreError, "'somewhere/else' is a soft link")


def test_virtual_dataset_is_refused(shard, tmp_path):
    path, storage, schema, count = shard()
    other = str(tmp_path / "other.h5")
    with h5py.File(other, "w") as f:
        f.create_dataset("labels", data=np.zeros(count, "<i8"))

    def virtual(f, name, data):
        layout = h5py.VirtualLayout(shape=data.shape, dtype="<i8")
        layout[:] = h5py.VirtualSource(other, "labels", shape=data.shape)
        f.create_virtual_dataset(name, layout)
    _replace(path, "labels", virtual)
    _refused(path, storage, schema, count, UnsafeStoreError, "'labels' is a virtual dataset")


def test_a_named_datatype_is_refused(shard):
    path, storage, schema, count = shard()
    with h5py.File(path, "r+", locking=False) as f:
        f["mytype"] = np.dtype("<i8")
    _refused(path, storage, schema, count, UnsafeStoreError, "'mytype' is a named datatype")


@pytest.mark.parametrize("length", [2**28, 2**31])
def test_labels_declared_huge_without_data(shard, length):
    path, storage, schema, count = shard()
    _replace(path, "labels", lambda f, n, d: f.create_dataset(n, shape=(length,), dtype="<i8", chunks=(1 << 16,)))
    _refused(path, storage, schema, count, CorruptRecordError, f"'labels' has shape ({length},)",
             f"expected ({count},)")


@pytest.mark.parametrize("length", [2**28, 2**31])
def test_a_count_declared_huge_with_unwritten_chunks(shard, length):
    """Shapes that agree with a huge count (header and manifest alike) still cannot allocate what the
    file does not store: the unwritten chunks are refused before anything is read."""
    path, storage, schema, _count = shard()
    with h5py.File(path, "r+", locking=False) as f:
        f.attrs["count"] = length
        for name in ("labels", "checksums", "nbytes"):
            del f[name]
            f.create_dataset(name, shape=(length,), dtype="<i8", chunks=(1 << 16,))
    _refused(path, storage, schema, length, UnsafeStoreError, "only 0 bytes are stored (chunks never written)")


def test_an_unwritten_contiguous_dataset(shard):
    path, storage, schema, count = shard()
    _replace(path, "labels", lambda f, n, d: f.create_dataset(n, shape=d.shape, dtype="<i8"))
    _refused(path, storage, schema, count, UnsafeStoreError, "'labels' (contiguous", "never written")


def test_a_compressed_dataset(shard):
    path, storage, schema, count = shard()
    _replace(path, "labels", lambda f, n, d: f.create_dataset(n, data=d, compression="gzip"))
    _refused(path, storage, schema, count, UnsafeStoreError, "'labels' (chunked", "compressed")


def test_a_chunked_fully_written_dataset_is_fine(shard):
    path, storage, schema, count = shard()
    labels = _replace(path, "labels", lambda f, n, d: f.create_dataset(n, data=d, chunks=(max(1, len(d) // 2),)))
    index, _ = read(path, storage, schema, count)
    assert index.labels.tolist() == labels.tolist()


def test_big_endian_is_fine_another_dtype_is_not(shard):
    path, storage, schema, count = shard()
    labels = _replace(path, "labels", lambda f, n, d: f.create_dataset(n, data=d.astype(">i8")))
    assert read(path, storage, schema, count)[0].labels.tolist() == labels.tolist()
    _replace(path, "labels", lambda f, n, d: f.create_dataset(n, data=d.astype("<i4")))
    _refused(path, storage, schema, count, CorruptRecordError, "'labels' has dtype int32, expected int64")


def test_shape_must_follow_the_count(shard):
    path, storage, schema, count = shard()
    _replace(path, "relpath_offsets", lambda f, n, d: f.create_dataset(n, data=np.append(d, d[-1])))
    _refused(path, storage, schema, count, CorruptRecordError, "'relpath_offsets' has shape", f"({count + 1},)")


@pytest.mark.parametrize("kind, name", [("v1", "images"), ("raw", "pixels")])
def test_a_chunked_version1_payload_reads_as_the_first_writer_stored_it(shard, kind, name):
    """fastdata 0.1.0 stored a classification shard's payload chunked (later writers: contiguous,
    mapped): its records read the same through h5py; a chunked payload that is compressed is not."""
    path, storage, schema, count = shard(kind)
    _, records = read(path, storage, schema, count)
    rows = max(1, count // 3) if name == "pixels" else 1024
    data = _replace(path, name, lambda f, n, d: f.create_dataset(n, data=d, chunks=(rows, *d.shape[1:])))
    assert read(path, storage, schema, count)[1] == records
    if name == "pixels":  # the batched raw path too
        with HDF5ShardReader(path, storage, schema=schema, expected_count=count) as reader:
            out = np.zeros_like(data)
            reader.get_raw_batch(np.arange(count)[::-1].copy(), out)
            assert np.array_equal(out, data[::-1])
    _replace(path, name, lambda f, n, d: f.create_dataset(n, data=d, chunks=(rows, *d.shape[1:]), compression="gzip"))
    _refused(path, storage, schema, count, UnsafeStoreError, "compressed")


def test_a_general_stores_payload_must_be_contiguous(shard):
    path, storage, schema, count = shard("v2")
    _replace(path, "records", lambda f, n, d: f.create_dataset(n, data=d, chunks=(1024,)))
    _refused(path, storage, schema, count, CorruptRecordError, "payload dataset 'records' is not contiguous")


def test_the_count_must_be_the_manifests(shard):
    path, storage, schema, count = shard()
    _refused(path, storage, schema, count + 1, CorruptRecordError, f"holds {count} records, the manifest says "
             f"{count + 1}")
    assert len(read(path, storage, schema, None)[0]) == count  # without a manifest count: the header's


def test_a_header_attribute_that_is_an_array(shard):
    path, storage, schema, count = shard()
    with h5py.File(path, "r+", locking=False) as f:
        f.attrs["count"] = np.arange(count)
    _refused(path, storage, schema, count, CorruptRecordError, "damaged shard header (count)")


def test_v2_field_arrays_are_checked(shard):
    path, storage, schema, count = shard("v2")
    _replace(path, "fields/vec", lambda f, n, d: f.create_dataset(n, data=d.astype("<f8")))
    _refused(path, storage, schema, count, CorruptRecordError, "'fields/vec' has dtype float64, expected float32")
    _replace(path, "fields/vec", lambda f, n, d: f.create_dataset(n, shape=(2**28, 4), dtype="<f4", chunks=(64, 4)))
    _refused(path, storage, schema, count, CorruptRecordError, "'fields/vec' has shape (268435456, 4)")


def test_v2_external_link_inside_the_fields_group(shard, tmp_path):
    path, storage, schema, count = shard("v2")
    _replace(path, "fields/label", lambda f, n, d: f.__setitem__(n, h5py.ExternalLink(str(tmp_path / "x.h5"), "/")))
    _refused(path, storage, schema, count, UnsafeStoreError, "'fields/label' is an external link")


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_not_a_regular_file(tmp_path, kind):
    path = str(tmp_path / "shard.h5")
    os.mkfifo(path) if kind == "fifo" else os.mkdir(path)
    with pytest.raises(UnsafeStoreError, match="not a regular file"):
        HDF5ShardReader(path, StorageSpec())
    with pytest.raises(UnsafeStoreError):
        HDF5ShardReader.check_structure(path)


def test_a_missing_or_foreign_file_is_a_format_error(tmp_path):
    with pytest.raises(FormatError, match="cannot open HDF5 shard"):
        HDF5ShardReader(str(tmp_path / "none.h5"), StorageSpec())
    (tmp_path / "junk.h5").write_bytes(b"not hdf5" * 100)
    with pytest.raises(FastdataError, match="cannot open HDF5 shard"):
        HDF5ShardReader(str(tmp_path / "junk.h5"), StorageSpec())
