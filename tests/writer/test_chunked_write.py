"""Writing chunked fields: bit-exact round trips through both backends from arrays and
array-likes (memmaps, h5py datasets, objects with only shape/dtype/slicing), errors that
name the sample, field and chunk, and SIGKILL + resume of a write of memmapped volumes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest
from helpers.procs import sigkill_once_a_shard_is_staged
from helpers.volumes import CHUNKS, SCHEMA, SHAPES, MemmapVolumes, open_memmap, volume, write_memmaps

import fastdata
from fastdata.fields import Chunked, Int, SchemaError
from fastdata.format.chunk_codecs import CHUNK_CODECS
from fastdata.format.manifest import read_manifest
from fastdata.format.names import STAGING_DIR

SUFFIXES = [".lmdb", ".h5"]


def _values(store) -> list[np.ndarray]:
    ds = fastdata.open_dataset(store)
    return [np.asarray(ds[i]["ct"]) for i in range(len(ds))]


@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize("workers", [0, 2])
def test_volumes_round_trip_bit_exact(tmp_path, suffix, workers):
    dst = tmp_path / f"v{suffix}"
    vols = [volume(i) for i in range(len(SHAPES))]
    report = fastdata.write([{"ct": v, "label": i} for i, v in enumerate(vols)], dst, SCHEMA, workers=workers,
                            progress=False)
    assert report.images == len(vols)
    got = _values(dst)
    assert [g.shape for g in got] == [v.shape for v in vols]
    assert all(g.dtype == np.uint16 and g.tobytes() == v.tobytes() for g, v in zip(got, vols, strict=True))
    assert fastdata.verify(str(dst), decode=True).ok
    # every chunk file the workers left in staging was consumed, and staging is gone
    assert not (dst / STAGING_DIR).exists()


@pytest.mark.parametrize("codec", sorted(CHUNK_CODECS))  # every codec of the one table
def test_every_codec_round_trips_several_dtypes(tmp_path, codec):
    rng = np.random.default_rng(1)
    arrays = {"u8": rng.integers(0, 255, (20, 30, 3), dtype=np.uint8),
              "f4": rng.standard_normal((20, 30, 3)).astype(np.float32),
              "i2": rng.integers(-3000, 3000, (20, 30, 3)).astype(np.int16)}
    arrays["f4"][0, 0, 0] = np.nan
    schema = {name: Chunked(a.dtype.name, (8, 8, 3), codec=codec) for name, a in arrays.items()}
    fastdata.write([arrays], tmp_path / "c.h5", schema, workers=0, progress=False)
    row = fastdata.open_dataset(tmp_path / "c.h5")[0]
    for name, a in arrays.items():
        assert np.asarray(row[name]).tobytes() == a.tobytes()
    if codec == "raw":  # uncompressed: the stored chunks are the values' bytes exactly
        assert all(row[name].stored_bytes == a.nbytes for name, a in arrays.items())


def test_memmaps_from_a_map_style_dataset_and_an_iterable_give_the_same_store(tmp_path):
    paths = write_memmaps(tmp_path, len(SHAPES))
    fastdata.write(MemmapVolumes(paths), tmp_path / "map.lmdb", SCHEMA, workers=2, progress=False)
    samples = ({"ct": open_memmap(p, i), "label": i} for i, p in enumerate(paths))
    fastdata.write(samples, tmp_path / "iter.lmdb", SCHEMA, workers=2, progress=False)
    want = [volume(i).tobytes() for i in range(len(SHAPES))]
    assert [v.tobytes() for v in _values(tmp_path / "map.lmdb")] == want
    assert [v.tobytes() for v in _values(tmp_path / "iter.lmdb")] == want


def test_an_iterable_of_memmaps_sends_references_not_values_to_the_workers(tmp_path):
    """A memmap pickles as a copy of all its values; the writer sends its file and layout."""
    import pickle

    from fastdata.writer.chunking import MemmapRef, portable

    path = write_memmaps(tmp_path, 1)[0]
    mm = open_memmap(path, 0)
    ref = portable(mm)
    assert isinstance(ref, MemmapRef) and len(pickle.dumps(ref)) < 1000 < mm.nbytes
    assert len(pickle.dumps(mm)) > mm.nbytes  # the control: what would have travelled
    assert np.array_equal(pickle.loads(pickle.dumps(ref))[3:9, :, 2], mm[3:9, :, 2])
    assert portable(mm[1:]) is not None and not isinstance(portable(mm[1:]), MemmapRef)  # a view: read as an array


def test_h5py_datasets_in_an_iterable_are_reopened_in_the_workers(tmp_path):
    src = tmp_path / "vols.h5"
    with h5py.File(src, "w") as f:
        for i in range(3):
            f.create_dataset(f"v{i}", data=volume(i), chunks=(4, 4, 4), compression="gzip")
    with h5py.File(src, "r") as f:
        samples = ({"ct": f[f"v{i}"], "label": i} for i in range(3))
        fastdata.write(samples, tmp_path / "h.h5", SCHEMA, workers=2, progress=False)
    assert [v.tobytes() for v in _values(tmp_path / "h.h5")] == [volume(i).tobytes() for i in range(3)]


class SliceOnly:
    """An array-like with nothing but ``shape``, ``dtype`` and slicing, counting what it is asked for."""

    def __init__(self, array: np.ndarray, wrong_at: int | None = None, dtype=None):
        self.array, self.wrong_at = array, wrong_at
        self.shape, self.dtype = array.shape, np.dtype(dtype or array.dtype)
        self.reads: list[tuple] = []

    def __getitem__(self, key):
        self.reads.append(key)
        block = self.array[key]
        if self.wrong_at is not None and len(self.reads) > self.wrong_at:
            return block[:-1]
        return block.astype(self.dtype)


def test_a_slicing_only_array_like_is_read_in_slabs_never_whole(tmp_path):
    big = volume(0, (64, 40, 24))
    like = SliceOnly(big)
    fastdata.write([{"ct": like, "label": 0}], tmp_path / "s.lmdb", SCHEMA, workers=0, progress=False)
    assert np.asarray(fastdata.open_dataset(tmp_path / "s.lmdb")[0]["ct"]).tobytes() == big.tobytes()
    # the writing: one slab per chunk row along the first axis (64 / 16 = 4), each one chunk deep
    slabs = [k for k in like.reads if k[1:] == (slice(0, 40), slice(0, 24))]
    assert [(k[0].start, k[0].stop) for k in slabs] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    # the shard planner's probe: a few single chunks (of the 4 x 3 x 2), not the whole value
    probe = [k for k in like.reads if k not in slabs]
    assert 1 <= len(probe) <= 8 and all(r.stop - r.start <= c for k in probe
                                    for r, c in zip(k, CHUNKS, strict=True))


def test_slabs_larger_than_the_bound_are_read_chunk_by_chunk(tmp_path, monkeypatch):
    from fastdata.writer import chunking

    monkeypatch.setattr(chunking, "SLAB_BYTES", 16 * 16 * 16 * 2)  # one chunk
    big = volume(0, (32, 32, 20))
    like = SliceOnly(big)
    fastdata.write(iter([{"ct": like, "label": 0}]), tmp_path / "s.lmdb", SCHEMA, workers=0, progress=False)
    # an iterable's first sample is probed too (8 chunks), then every chunk is read on its own
    assert len(like.reads) == 8 + 2 * 2 * 2
    assert sorted(map(str, like.reads[:8])) == sorted(map(str, like.reads[8:]))
    assert np.asarray(fastdata.open_dataset(tmp_path / "s.lmdb")[0]["ct"]).tobytes() == big.tobytes()


def test_a_slice_of_the_wrong_shape_names_the_sample_field_and_region(tmp_path):
    bad = SliceOnly(volume(0, (40, 20, 20)), wrong_at=1)
    message = r"sample 1 field 'ct': the array-like returned shape \(15, .* expected \(16, "
    with pytest.raises(SchemaError, match=message):
        fastdata.write([{"ct": volume(1, (4, 4, 4)), "label": 0}, {"ct": bad, "label": 1}], tmp_path / "s.lmdb",
                       SCHEMA, workers=0, progress=False)
    assert not (tmp_path / "s.lmdb" / "manifest.json").exists()
    leftovers = [p for p in (tmp_path / "s.lmdb").rglob("*.spill")]
    assert leftovers == []  # the failed sample's chunk file was removed with it


def test_values_that_do_not_fit_the_dtype_are_refused_naming_the_chunk(tmp_path):
    values = volume(0, (20, 20, 20)).astype(np.int64)
    fastdata.write([{"ct": values, "label": 0}], tmp_path / "ok.lmdb", SCHEMA, workers=0, progress=False)
    assert np.array_equal(np.asarray(fastdata.open_dataset(tmp_path / "ok.lmdb")[0]["ct"]), values)
    values[19, 19, 19] = 70000  # in the last chunk (grid 2x2x2: chunk 7)
    with pytest.raises(SchemaError, match=r"field 'ct' chunk 7: values of dtype int64 do not fit uint16 exactly"):
        fastdata.write([{"ct": values, "label": 0}], tmp_path / "bad.lmdb", SCHEMA, workers=0, progress=False)


@pytest.mark.parametrize("value, message", [
    (np.zeros((4, 4), np.uint16), r"shape \[4, 4\] does not have the 3 axes"),
    ("not an array", "takes a numpy array or an array-like"),
    (np.zeros((2, 2, 2), dtype=complex), "not numeric"),
])
def test_values_that_are_not_arrays_of_the_fields_axes_are_refused(tmp_path, value, message):
    with pytest.raises(SchemaError, match=message):
        fastdata.write([{"ct": value, "label": 0}], tmp_path / "s.lmdb", SCHEMA, workers=0, progress=False)


@pytest.mark.parametrize("kwargs, message", [
    ({"chunks": (16, 0, 16)}, "has a side that is not positive"),
    ({"chunks": (16, -2, 16)}, "has a side that is not positive"),
    ({"chunks": ()}, "is not a tuple of 1 to"),
    ({"chunks": (1 << 15, 1 << 15)}, "more than the"),
    ({"chunks": (8, 8), "codec": "gzip"}, "codec 'gzip' is not one of"),
    ({"chunks": (8, 8), "codec": "blosc-zstd", "level": 12}, "takes a level from 0 to 9"),
    ({"chunks": (8, 8), "codec": "lz4", "level": 1}, "takes no level"),
])
def test_bad_chunked_declarations_are_refused(kwargs, message):
    with pytest.raises(SchemaError, match=message):
        Chunked("uint16", **kwargs)


def test_shards_are_sized_by_the_stored_chunks(tmp_path):
    """Shard planning counts a sample's chunks, not only its record (a few hundred bytes)."""
    vols = [volume(i, (48, 48, 48)) for i in range(12)]
    schema = {"ct": Chunked("uint16", CHUNKS, codec="raw"), "label": Int()}
    fastdata.write([{"ct": v, "label": i} for i, v in enumerate(vols)], tmp_path / "s.h5", schema, workers=0,
                   shard_size="1MiB", progress=False)
    shards = read_manifest(str(tmp_path / "s.h5"))["shards"]
    # 221,184 bytes of chunks a volume: 4 fit a shard of 1 MiB (the records alone would all fit one)
    assert [s["count"] for s in shards] == [4, 4, 4] and all(s["bytes"] <= 1 << 20 for s in shards)
    assert [v.tobytes() for v in _values(tmp_path / "s.h5")] == [v.tobytes() for v in vols]


def test_sigkill_then_resume_of_memmapped_volumes_equals_a_clean_run(tmp_path, monkeypatch):
    paths = write_memmaps(tmp_path, 18)
    dst = tmp_path / "out.lmdb"
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})
        import fastdata
        from helpers.volumes import SCHEMA, MemmapVolumes
        if __name__ == "__main__":
            fastdata.write(MemmapVolumes({paths!r}, delay=0.05), {str(dst)!r}, SCHEMA, workers=2,
                           shard_size=40000, progress=False)
    """)
    env = dict(os.environ, FASTDATA_MIN_SHARD_SIZE="1")
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sigkill_once_a_shard_is_staged(proc, dst, "writer")
    assert not (dst / "manifest.json").exists()
    monkeypatch.setenv("FASTDATA_MIN_SHARD_SIZE", "1")
    report = fastdata.write(MemmapVolumes(paths), dst, SCHEMA, workers=2, shard_size=40000, resume=True,
                            progress=False)
    clean = tmp_path / "clean.lmdb"
    fastdata.write(MemmapVolumes(paths), clean, SCHEMA, workers=0, shard_size=40000, progress=False)
    assert report.resumed_shards >= 1
    assert [v.tobytes() for v in _values(dst)] == [volume(i).tobytes() for i in range(18)]
    shards = lambda m: [(s["name"], s["count"], s["xxh"]) for s in m["shards"]]  # noqa: E731
    assert shards(read_manifest(str(dst))) == shards(read_manifest(str(clean)))
    assert fastdata.verify(str(dst)).ok


# nightly (10 s: a regression check of one warning; the conversions with worker processes run in CI)
@pytest.mark.slow
def test_a_conversion_with_worker_processes_leaves_no_leaked_semaphore_warning(tmp_path):
    """numcodecs' Blosc lock, made in each forkserver worker, was reported as a leaked semaphore
    at the end of every conversion (one warning per worker)."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})
        import fastdata
        from helpers.volumes import SCHEMA, volume
        if __name__ == "__main__":
            fastdata.write([{{"ct": volume(i), "label": i}} for i in range(6)], {str(tmp_path / "s.lmdb")!r}, SCHEMA,
                           workers=2, progress=False)
            ds = fastdata.open_dataset({str(tmp_path / "s.lmdb")!r})
            print(int(ds[0]["ct"][...].sum()))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) == int(volume(0).astype(np.int64).sum())
    assert "leaked semaphore" not in proc.stderr


def test_info_lists_the_shapes_and_verify_decodes_every_chunk(tmp_path, capsys):
    from fastdata.cli.main import main

    dst = tmp_path / "s.h5"
    fastdata.write([{"ct": volume(i), "label": i} for i in range(3)], dst, SCHEMA, workers=0, progress=False)
    assert main(["info", str(dst)]) == 0
    raw = sum(volume(i).nbytes for i in range(3))
    assert f"ct:       shapes (5, 16, 9) .. (40, 70, 21); {raw / 1024:.1f} KiB of values uncompressed" in \
        capsys.readouterr().out
    assert fastdata.info(str(dst))["arrays"]["ct"]["raw_bytes"] == raw
    assert main(["verify", str(dst), "--decode"]) == 0
    assert "3 records verified, 3 decoded" in capsys.readouterr().out


def test_the_same_data_written_twice_gives_the_same_chunks(tmp_path):
    """Blosc's threads make its frames differ from run to run; a store (and the fingerprint resume
    compares) must not."""
    noisy = np.random.default_rng(0).standard_normal((40, 40, 40)).astype(np.float32)
    schema = {"x": Chunked("float32", (20, 20, 20))}
    tables = []
    for k in range(3):
        fastdata.write([{"x": noisy}], tmp_path / f"s{k}.lmdb", schema, workers=0, progress=False)
        tables.append(fastdata.open_dataset(tmp_path / f"s{k}.lmdb")[0]["x"]._table.xxh.tolist())
    assert tables[0] == tables[1] == tables[2]


def test_a_list_of_memmaps_travels_to_the_workers_as_references(tmp_path):
    """A list (map-style) goes to every worker whole: its memmaps must not be pickled by value
    (measured before: a 1.2 GB memmap copied into the converter and into each worker)."""
    import pickle

    from fastdata.writer.sources.python import portable_samples

    paths = write_memmaps(tmp_path, 3)
    samples = [{"ct": open_memmap(p, i), "label": i} for i, p in enumerate(paths)]
    light = portable_samples(samples, SCHEMA)
    assert len(pickle.dumps(light)) < 3000 < sum(v["ct"].nbytes for v in samples) < len(pickle.dumps(samples))
    assert portable_samples(MemmapVolumes(paths), SCHEMA).__class__ is MemmapVolumes  # a dataset: as it is
    fastdata.write(samples, tmp_path / "l.h5", SCHEMA, workers=2, progress=False)
    assert [v.tobytes() for v in _values(tmp_path / "l.h5")] == [volume(i).tobytes() for i in range(3)]
