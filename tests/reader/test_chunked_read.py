"""Reading chunked fields: region reads equal numpy slicing (Hypothesis), touch only the
chunks they need (counted), pickle light and read in DataLoader workers; damaged chunks
and hostile indexes are clear errors before any large allocation."""

from __future__ import annotations

import multiprocessing
import os
import pickle

import numpy as np
import pytest
import torch
from helpers.backends import first_in_ci
from helpers.volumes import SCHEMA, volume
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastdata
from fastdata.errors import CorruptRecordError
from fastdata.fields import Chunked

SHAPES = [(64, 64, 64), (40, 33, 21), (5, 70, 9)]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunked")
    vols = [volume(i, shape) for i, shape in enumerate(SHAPES)]
    out = {}
    for suffix in (".lmdb", ".h5"):
        dst = root / f"v{suffix}"
        fastdata.write([{"ct": v, "label": i} for i, v in enumerate(vols)], dst, SCHEMA, workers=0, progress=False)
        out[suffix] = dst
    return out, vols


def _axis_key(size: int):
    """A strategy for one axis' index: an int in range or a slice with any step."""
    bound = st.integers(-size - 3, size + 3) | st.none()
    step = st.integers(-7, 7).filter(lambda s: s != 0) | st.none()
    as_slice = st.builds(slice, bound, bound, step)
    return as_slice | st.integers(-size, size - 1) if size else as_slice


@pytest.mark.parametrize("suffix", [".lmdb", ".h5"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_region_reads_equal_numpy_slicing(stores, suffix, data):
    paths, vols = stores
    ds = fastdata.open_dataset(paths[suffix])
    i = data.draw(st.integers(0, len(vols) - 1))
    arr, want = ds[i]["ct"], vols[i]
    key = tuple(data.draw(_axis_key(n)) for n in want.shape[:data.draw(st.integers(1, 3))])
    if data.draw(st.booleans()):
        key = (*key, Ellipsis)
    got = arr[key]
    assert got.shape == want[key].shape and got.dtype == want.dtype
    assert np.array_equal(got, want[key])


def test_a_region_touches_only_its_chunks(stores):
    paths, vols = stores
    ds = fastdata.open_dataset(paths[".lmdb"])
    arr = ds[0]["ct"]  # 64^3 in chunks of 16^3: 64 chunks
    patch = arr[10:42, 20:52, 30:62]  # axes touch chunks 0-2, 1-3, 1-3
    assert np.array_equal(patch, vols[0][10:42, 20:52, 30:62])
    assert arr.chunks_read == 3 * 3 * 3
    assert arr.chunks_read * 16 ** 3 * 2 <= 4 * patch.nbytes  # bytes decoded <= 4x the patch's own
    aligned = ds[0]["ct"]
    aligned[16:48, 16:48, 16:48]
    assert aligned.chunks_read == 8
    strided = ds[0]["ct"]
    assert np.array_equal(strided[::32, 5, 5], vols[0][::32, 5, 5])
    assert strided.chunks_read == 2  # rows 0 and 32: chunks 0 and 2 along the axis, never 1 or 3


def test_a_lazy_array_pickles_light_and_reads_in_a_spawned_process(stores):
    paths, vols = stores
    arr = fastdata.open_dataset(paths[".h5"])[0]["ct"]
    arr[0, 0, 0]  # its dataset has the shard open in this process: none of that travels
    blob = pickle.dumps(arr)
    assert len(blob) < 20_000 < vols[0].nbytes
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        got = pool.apply(_region_sum, (blob,))
    assert got == int(vols[0][3:40, ::3, 7].astype(np.int64).sum())


def _region_sum(blob: bytes) -> int:
    return int(pickle.loads(blob)[3:40, ::3, 7].astype(np.int64).sum())


class _Regions(torch.utils.data.Dataset):
    """Reads one fixed region of every sample (what a patch dataset does)."""

    def __init__(self, store):
        self.ds = fastdata.open_dataset(store)

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return torch.from_numpy(self.ds[i]["ct"][:4, :4, :4].astype(np.int32))


@pytest.mark.parametrize("context", first_in_ci(["fork", "spawn"]))  # spawn pickling: the test above
def test_dataloader_workers_read_regions(stores, context):
    paths, vols = stores
    ds = _Regions(paths[".lmdb"])
    ds.ds[0]["ct"][0, 0, 0]  # the parent has the shard open before the workers start
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=context)
    got = [t.numpy() for t in loader]
    assert all(np.array_equal(g, v[:4, :4, :4]) for g, v in zip(got, vols, strict=True))


def test_bad_indices_are_index_errors(stores):
    paths, _ = stores
    arr = fastdata.open_dataset(paths[".lmdb"])[1]["ct"]
    for key, message in [((40, 0, 0), "out of bounds for axis 0"), ((0, 0, 0, 0), "too many indices"),
                         (([1, 2],), "basic indexing"), ((..., ...), "single ellipsis")]:
        with pytest.raises(IndexError, match=message):
            arr[key]
    assert arr.chunks_read == 0


def test_read_refuses_a_box_outside_the_array_where_slicing_clips(stores):
    paths, vols = stores
    arr = fastdata.open_dataset(paths[".h5"])[1]["ct"]  # (40, 33, 21)
    assert np.array_equal(arr.read((30, 0, 5), (10, 33, 16)), vols[1][30:40, :, 5:21])
    with pytest.raises(IndexError, match=r"field 'ct': region \[30, 41\) is outside axis 0 of size 40"):
        arr.read((30, 0, 0), (11, 4, 4))
    with pytest.raises(IndexError, match="outside axis 2"):
        arr.read((0, 0, -1), (1, 1, 2))
    assert arr[30:41].shape == (10, 33, 21)  # numpy's clipping, for slices


def test_a_region_over_the_read_limit_is_refused_before_allocating(stores, monkeypatch):
    paths, _ = stores
    arr = fastdata.open_dataset(paths[".lmdb"])[0]["ct"]
    monkeypatch.setenv("FASTDATA_MAX_REGION_BYTES", str(1000))
    with pytest.raises(ValueError, match="more than the 1,000 one read may allocate"):
        arr[...]
    assert arr[:5, :5, :5].shape == (5, 5, 5)  # 250 bytes: fine


def _flip_in_file(path, needle: bytes, at: int) -> None:
    data = path.read_bytes()
    where = data.find(needle)
    assert where >= 0 and data.find(needle, where + 1) < 0, "the chunk's bytes must occur once in the shard"
    with open(path, "r+b") as fh:
        fh.seek(where + at)
        byte = fh.read(1)
        fh.seek(where + at)
        fh.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("suffix", [".lmdb", ".h5"])
def test_a_damaged_chunk_names_the_sample_field_and_chunk(tmp_path, suffix):
    dst = tmp_path / f"d{suffix}"
    fastdata.write([{"ct": volume(i, (32, 32, 32)), "label": i} for i in range(2)], dst, SCHEMA, workers=0,
                   progress=False)
    ds = fastdata.open_dataset(dst)
    arr = ds[1]["ct"]
    stored = ds._reader(0).get_chunks(arr._first, arr._table, [5], "x")[0]
    ds.close()
    _flip_in_file(dst / f"shard-00000{suffix}", bytes(stored), len(stored) // 2)
    fresh = fastdata.open_dataset(dst)[1]["ct"]
    assert np.array_equal(fresh[:16, :16, :16], volume(1, (32, 32, 32))[:16, :16, :16])  # chunk 0 is fine
    with pytest.raises(CorruptRecordError, match=r"sample 1\) field 'ct' chunk 5: checksum mismatch"):
        fresh[16:, :16, 16:]  # chunk (1, 0, 1) = 5
    report = fastdata.verify(str(dst))
    assert not report.ok and any("field 'ct' chunk 5: checksum mismatch" in p for p in report.problems)


def _in_a_fresh_process(name: str, *args):
    """``helpers.raw_store.<name>(*args)`` in a new interpreter that imports no fastdata code (and
    has none of this process's LMDB environments or HDF5 files open: both refuse a second open of a
    file in one process)."""
    import subprocess
    import sys

    helpers = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = ("import pickle, sys; sys.path.insert(0, sys.argv[1]); import helpers.raw_store as raw; "
              "args = pickle.loads(bytes.fromhex(sys.argv[2])); out = getattr(raw, sys.argv[3])(*args); "
              "assert not any(m.startswith('fastdata') for m in sys.modules), 'fastdata was imported'; "
              "sys.stdout.buffer.write(pickle.dumps(out))")
    proc = subprocess.run([sys.executable, "-c", script, helpers, pickle.dumps(args).hex(), name],
                          capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    return pickle.loads(proc.stdout)


def test_chunks_the_index_places_outside_the_chunk_data_are_errors_not_reads(tmp_path):
    dst = tmp_path / "f.h5"
    fastdata.write([{"ct": volume(0, (20, 20, 20)), "label": 0}], dst, SCHEMA, workers=0, progress=False)
    _in_a_fresh_process("set_first", str(dst / "shard-00000.h5"), 1 << 40)  # a terabyte past the data
    arr = fastdata.open_dataset(dst)[0]["ct"]
    with pytest.raises(CorruptRecordError, match="field 'ct' chunk 0: missing or of the wrong length"):
        arr[:2, :2, :2]
    assert not fastdata.verify(str(dst)).ok


def test_a_hostile_shape_in_the_index_is_refused_before_any_allocation(tmp_path):
    dst = tmp_path / "h.h5"
    fastdata.write([{"ct": volume(0, (20, 20, 20)), "label": 0}], dst, SCHEMA, workers=0, progress=False)
    shard = str(dst / "shard-00000.h5")
    _in_a_fresh_process("set_shape", shard, [1 << 40, 1 << 40, 1 << 20])  # exabytes, 2^92 chunks
    with pytest.raises(CorruptRecordError, match="chunks, more than the"):
        fastdata.open_dataset(dst)[0]
    _in_a_fresh_process("set_shape", shard, [2000, 2000, 2000])  # within the chunk limit, not the table's length
    with pytest.raises(CorruptRecordError, match="chunk table of 96 bytes, expected"):
        fastdata.open_dataset(dst)[0]


def test_the_chunk_layout_reads_with_lmdb_h5py_and_numcodecs_alone(stores):
    """What FORMAT.md promises: a reader with no fastdata code gets the values back."""
    paths, vols = stores
    for suffix, path in paths.items():
        assert np.array_equal(_in_a_fresh_process("read_without_fastdata", path, suffix), vols[1]), suffix



def test_a_chunked_schema_round_trips_through_the_manifest():
    from fastdata.format.fields import Schema

    schema = Schema.of({"ct": Chunked("int16", (8, 16, 4), codec="zstd", level=7), "raw": Chunked("float32", (5,),
                                                                                                 codec=None)})
    back = Schema.from_json(schema.to_json())
    assert back == schema and back["raw"].codec == "raw" and back["ct"].level == 7


def test_fastdata_collate_reads_whole_values_in_the_workers(tmp_path):
    dst = tmp_path / "same.lmdb"
    vols = [volume(i, (12, 10, 8)) for i in range(4)]
    fastdata.write([{"ct": v, "label": i} for i, v in enumerate(vols)], dst, SCHEMA, workers=0, progress=False)
    batches = list(fastdata.loader(fastdata.open_dataset(dst), batch_size=2, shuffle=False, num_workers=2))
    assert [type(b["ct"]) for b in batches] == [torch.Tensor, torch.Tensor]  # read and stacked, not lazy
    assert np.array_equal(torch.cat([b["ct"] for b in batches]).numpy(), np.stack(vols))
