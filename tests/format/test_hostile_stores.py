"""Hostile stores: each crafted store carries one attack, with every checksum re-signed so it
looks valid, and is read in a fresh process under bounded memory (the reader's baseline + 384
MiB) and time (20 s) by the harness of ``tests/helpers/hostile.py``.

Every attack must end in a typed error (a :class:`fastdata.errors.FastdataError` naming the
store or shard; for ``verify``: a report of damage), never a signal, a hang, a MemoryError,
an untyped exception, bytes from outside the store, or a silent wrong read. Every test has a
``control``: the same store put through the same surgery with benign content reads fine under
the same harness, so the store is well-formed apart from its one attack.

Several of these fail on the current code: they are the specification the fixes work to.
"""

from __future__ import annotations

import json
import os
import random
import struct

import numpy as np
import pytest
import fastdata
from helpers import hostile as H
from helpers.hostile import describe, expect

from fastdata.format.backends.registry import BACKENDS

pytestmark = pytest.mark.timeout(600)

ALL = list(BACKENDS)
MODES = ["control", "attack"]
#: seconds a case that can only hang (a FIFO opened for reading) is given: a sound read of these
#: stores takes ~0.05 s, so 2 s tells a hang apart and keeps the file's runtime short
HANG_TIMEOUT = 2.0


# -- fixtures: sound stores built once, copied per case -----------------------------------------

@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("hostile")


@pytest.fixture(scope="module")
def trees(work):
    return {"a": H.build_tree(work / "tree-a"),
            "b": H.build_tree(work / "tree-b", {"ant": 1, "bee": 1, "cat": 4}, size=(40, 30), seed=9)}


class Pristine:
    """Sound stores, built on first use: ``get(kind, backend)`` with kind ``v1``, ``raw`` or ``v2``."""

    def __init__(self, work, trees):
        self.work, self.trees, self.stores = work, trees, {}

    def get(self, kind: str, backend: str) -> str:
        key = (kind, backend)
        if key not in self.stores:
            dst = str(self.work / "pristine" / kind / H.store_name(backend))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if kind == "v2":
                H.build_v2_store(dst)
            else:
                H.build_store(dst, tree=self.trees["a"], raw="8x8" if kind == "raw" else None)
            self.stores[key] = dst
        return self.stores[key]


@pytest.fixture(scope="module")
def pristine(work, trees):
    return Pristine(work, trees)


@pytest.fixture(scope="module")
def harness(work, pristine):
    h = H.Harness(work / "logs")
    h.calibrate([pristine.get("v1", b) for b in ALL])
    yield h
    h.close()


@pytest.fixture
def fresh(pristine, tmp_path):
    """``fresh(kind, backend) -> path``: a private copy of a sound store."""
    def make(kind: str, backend: str) -> str:
        return H.copy_store(pristine.get(kind, backend), tmp_path / H.store_name(backend))
    return make


@pytest.fixture(scope="module")
def reference(harness, pristine):
    """``reference(kind, backend)``: what the harness reads from the sound store (its digest)."""
    cache = {}

    def get(kind: str, backend: str) -> dict:
        if (kind, backend) not in cache:
            cache[kind, backend] = harness.run("open", store=pristine.get(kind, backend))
            assert cache[kind, backend]["outcome"] == "ok", describe(cache[kind, backend])
        return cache[kind, backend]
    return get


def outside(tmp_path, name: str = "secret.txt") -> str:
    """A canary file outside any store."""
    d = tmp_path / "outside"
    d.mkdir(exist_ok=True)
    path = d / name
    path.write_text(H.CANARY_FILE_TEXT)
    return str(path)




def expect_cli(result: dict, mode: str) -> None:
    """``fastdata verify/info``: control exits 0; attack exits non-zero with one clear line, no
    traceback, no signal (SIGBUS is exit 135 / -7) and no hang."""
    text = result["stdout"] + result["stderr"]
    if mode == "control":
        assert result["outcome"] == "exit" and result["rc"] == 0, f"control failed: {result}"
        return
    assert result["outcome"] == "exit", f"{result['outcome']} (rc {result['rc']}, {result['elapsed']} s): " \
                                         f"{text[-500:]}"
    assert result["rc"] != 0, f"exit 0 for a hostile store: {text[-500:]}"
    assert "Traceback" not in text, text[-1500:]


def shard_of(store: str) -> str:
    return H.first_shard(store)


def names(store: str) -> tuple[str, ...]:
    return (store, os.path.basename(shard_of(store)))


# -- 1-3. HDF5 external storage, external links, soft links, virtual datasets -------------------

def _relpaths_external(store: str, mode: str) -> None:
    shard = shard_of(store)
    n = len(H.h5_read(shard, "labels"))
    if mode == "control":
        data, offsets = H.h5_read(shard, "relpaths"), H.h5_read(shard, "relpath_offsets")
        H.h5_replace(shard, "relpaths", H.h5_dataset(data))
        H.h5_replace(shard, "relpath_offsets", H.h5_dataset(offsets))
    else:
        H.h5_replace(shard, "relpaths", lambda f, name: f.create_dataset(
            name, shape=(1 << 16,), dtype="u1", external=[("/proc/self/environ", 0, 1 << 16)]))
        H.h5_replace(shard, "relpath_offsets", H.h5_dataset(np.array([0] + [1 << 16] * n, dtype="<i8")))
    H.resign(store)


@pytest.mark.parametrize("op", ["open", "verify"])
@pytest.mark.parametrize("mode", MODES)
def test_hdf5_external_storage_relpaths_reads_proc_self_environ(harness, fresh, mode, op):
    store = fresh("v1", "hdf5")
    _relpaths_external(store, mode)
    result = harness.run(op, store=store)
    expect(result, mode, *names(store))


def _outside_labels(tmp_path, n: int) -> tuple[str, np.ndarray]:
    labels = np.array([1] * (n // 2) + [0] * (n - n // 2), dtype="<i8")  # the store's, reversed
    path = tmp_path / "outside" / "labels.bin"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(labels.tobytes())
    return str(path), labels


def _no_outside_labels(result: dict, labels: np.ndarray, where: str = "from a file outside the store") -> None:
    if result["outcome"] == "ok":
        assert result["targets"] != labels.tolist(), f"labels read {where}: {describe(result)}"


@pytest.mark.parametrize("mode", MODES)
def test_hdf5_external_storage_labels_read_from_a_file_outside(harness, fresh, tmp_path, mode):
    store = fresh("v1", "hdf5")
    shard = shard_of(store)
    labels = H.h5_read(shard, "labels")
    path, evil = _outside_labels(tmp_path, len(labels))
    if mode == "control":
        H.h5_replace(shard, "labels", H.h5_dataset(labels))
    else:
        H.h5_replace(shard, "labels", lambda f, name: f.create_dataset(
            name, shape=labels.shape, dtype="<i8", external=[(path, 0, labels.nbytes)]))
    H.resign(store)
    result = harness.run("open", store=store)
    _no_outside_labels(result, evil)
    expect(result, mode, *names(store))


def _outside_h5(tmp_path, labels: np.ndarray) -> str:
    import h5py

    path = str(tmp_path / "outside" / "other.h5")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with h5py.File(path, "w") as f:
        f.create_dataset("labels", data=labels)
    return path


@pytest.mark.parametrize("mode", MODES)
def test_hdf5_external_link_labels_to_another_file(harness, fresh, tmp_path, mode):
    import h5py

    store = fresh("v1", "hdf5")
    shard = shard_of(store)
    labels = H.h5_read(shard, "labels")
    evil = labels[::-1].copy()
    other = _outside_h5(tmp_path, evil)
    make = H.h5_dataset(labels) if mode == "control" else \
        (lambda f, name: f.__setitem__(name, h5py.ExternalLink(other, "/labels")))
    H.h5_replace(shard, "labels", make)
    H.resign(store)
    result = harness.run("open", store=store)
    _no_outside_labels(result, evil)
    expect(result, mode, *names(store))


@pytest.mark.parametrize("op", ["open", "verify"])
@pytest.mark.parametrize("mode", MODES)
def test_hdf5_external_link_to_a_fifo_never_hangs(harness, fresh, tmp_path, mode, op):
    import h5py

    store = fresh("v1", "hdf5")
    shard = shard_of(store)
    labels = H.h5_read(shard, "labels")
    fifo = str(tmp_path / "outside.fifo")
    os.mkfifo(fifo)
    make = H.h5_dataset(labels) if mode == "control" else \
        (lambda f, name: f.__setitem__(name, h5py.ExternalLink(fifo, "/labels")))
    H.h5_replace(shard, "labels", make)
    H.resign(store)
    expect(harness.run(op, store=store, timeout=HANG_TIMEOUT), mode, *names(store))


@pytest.mark.parametrize("mode", MODES)
def test_hdf5_soft_link_in_place_of_labels(harness, fresh, mode):
    import h5py

    store = fresh("v1", "hdf5")
    shard = shard_of(store)
    labels = H.h5_read(shard, "labels")
    evil = labels[::-1].copy()
    with h5py.File(shard, "r+", locking=False) as f:
        f.create_dataset("shadow", data=evil)
    make = H.h5_dataset(labels) if mode == "control" else \
        (lambda f, name: f.__setitem__(name, h5py.SoftLink("/shadow")))
    H.h5_replace(shard, "labels", make)
    H.resign(store)
    result = harness.run("open", store=store)
    _no_outside_labels(result, evil, "through a soft link to another dataset")
    expect(result, mode, *names(store))


@pytest.mark.parametrize("mode", MODES)
def test_hdf5_virtual_dataset_in_place_of_labels(harness, fresh, tmp_path, mode):
    import h5py

    store = fresh("v1", "hdf5")
    shard = shard_of(store)
    labels = H.h5_read(shard, "labels")
    evil = labels[::-1].copy()
    other = _outside_h5(tmp_path, evil)

    def virtual(f, name):
        layout = h5py.VirtualLayout(shape=labels.shape, dtype="<i8")
        layout[:] = h5py.VirtualSource(other, "labels", shape=labels.shape)
        f.create_virtual_dataset(name, layout)

    H.h5_replace(shard, "labels", H.h5_dataset(labels) if mode == "control" else virtual)
    H.resign(store)
    result = harness.run("open", store=store)
    _no_outside_labels(result, evil)
    expect(result, mode, *names(store))


# -- 4. allocation before validation ------------------------------------------------------------

@pytest.mark.parametrize("length", [2**28, 2**31])
@pytest.mark.parametrize("mode", MODES)
def test_hdf5_labels_declared_huge_without_data(harness, fresh, mode, length):
    """A chunked ``labels`` of 2**28 (2 GiB) or 2**31 (16 GiB) elements, none written: a few KB on disk."""
    store = fresh("v1", "hdf5")
    shard = shard_of(store)
    labels = H.h5_read(shard, "labels")

    def make(f, name):
        if mode == "control":
            f.create_dataset(name, data=labels, chunks=(len(labels),))
        else:
            f.create_dataset(name, shape=(length,), dtype="<i8", chunks=(1 << 16,), fillvalue=0)

    H.h5_replace(shard, "labels", make)
    H.resign(store)
    assert os.path.getsize(shard) < 1 << 20
    expect(harness.run("open", store=store), mode, *names(store))


@pytest.mark.parametrize("output", ["tensor", "numpy"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ALL)
def test_index_image_size_46340_batch_allocates_tens_of_gb(harness, fresh, backend, mode, output):
    """Every index width/height 46340 (the stored JPEGs are 64x48): a batch of two asks 12.9 GB."""
    store = fresh("v1", backend)
    shard = shard_of(store)
    widths = H.index_array(backend, shard, "widths", "<i4")
    heights = H.index_array(backend, shard, "heights", "<i4")
    if mode == "attack":
        widths[:] = 46340
        heights[:] = 46340
    H.set_index_arrays(store, backend, shard, {"widths": widths, "heights": heights})
    H.resign(store)
    expect(harness.run("batch", store=store, output=output), mode, *names(store))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ALL)
def test_raw_shape_huge_in_the_manifest(harness, fresh, backend, mode):
    """A raw store (8x8) whose manifest says ``raw_shape`` 100000x100000 (30 GB a sample)."""
    store = fresh("raw", backend)
    body = H.load_manifest(store)
    if mode == "attack":
        body["storage"]["raw_shape"] = [10**5, 10**5]
    H.resign(store, body)
    expect(harness.run("batch", store=store, output="numpy"), mode, store)


# -- 5. expansion bombs ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ALL)
def test_json_field_of_8_million_empty_lists(harness, fresh, backend, mode):
    """Record 0's JSON field: 8 million empty lists, one 8 MB record (~580 MB decoded)."""
    import msgpack

    store = fresh("v2", backend)
    shard = shard_of(store)
    record = H.stored_item(backend, shard, 0)
    obj = msgpack.unpackb(record, raw=False)
    raw = {"meta": H.empty_lists_msgpack(8_000_000)} if mode == "attack" else {}
    H.replace_item(store, backend, shard, 0, H.repack_map(obj, raw))
    H.resign(store)
    expect(harness.run("open", store=store), mode, *names(store))


@pytest.mark.parametrize("mode", MODES)
def test_manifest_of_nested_empty_lists(harness, fresh, mode):
    """A 48 MiB manifest whose ``options`` holds 16 million empty lists (~1.4 GB as Python objects)."""
    store = fresh("v1", ALL[0])
    body = H.load_manifest(store)
    body["options"]["note"] = "@@BOMB@@"
    bomb = H.empty_lists_json(16 << 20) if mode == "attack" else b"[[]]"
    H.resign(store, body, splice=("@@BOMB@@", bomb))
    expect(harness.run("open", store=store), mode, store)


@pytest.mark.parametrize("kind", ["v1", "v2"])
@pytest.mark.parametrize("backend", ALL)
def test_verify_checks_the_manifests_image_bytes(fresh, backend, kind):
    """A shard's ``image_bytes`` (the sum of its records' sizes, which ``info`` and the tuner read)
    changed in a re-signed manifest is damage that verify names; the unchanged, re-signed manifest
    (the control) verifies."""
    store = fresh(kind, backend)
    body = H.load_manifest(store)
    H.resign(store, body)
    assert fastdata.verify(store).ok
    shard = body["shards"][0]
    shard["image_bytes"] += 1
    H.resign(store, body)
    report = fastdata.verify(store)
    assert not report.ok
    assert any(shard["name"] in p and "image_bytes" in p for p in report.problems), report.problems


# -- 6. LMDB pages past the end of the file ------------------------------------------------------

def _root_past_end(store: str, mode: str) -> None:
    shard = shard_of(store)
    meta = max(H.lmdb_meta(shard), key=lambda m: m["txnid"])
    pages = os.path.getsize(shard) // meta["psize"]
    if mode == "attack":
        H.lmdb_set_meta(shard, main_root=pages + 100, last_pg=pages + 200)
    else:
        H.lmdb_set_meta(shard, main_root=meta["main_root"], last_pg=meta["last_pg"])
    H.resign(store)


@pytest.mark.parametrize("op", ["open", "verify"])
@pytest.mark.parametrize("mode", MODES)
def test_lmdb_main_root_page_past_the_end_of_the_file(harness, fresh, mode, op):
    store = fresh("v1", "lmdb")
    _root_past_end(store, mode)
    expect(harness.run(op, store=store), mode, *names(store))


@pytest.mark.parametrize("cmd", ["verify", "info"])
@pytest.mark.parametrize("mode", MODES)
def test_cli_on_lmdb_root_page_past_the_end(harness, fresh, mode, cmd):
    store = fresh("v1", "lmdb")
    _root_past_end(store, mode)
    result = H.run_cli([cmd, store], limit=harness.limit)
    if cmd == "info":  # info reads the manifest only: a sound manifest describes the store
        assert result["outcome"] == "exit" and result["rc"] == 0, result
        return
    expect_cli(result, mode)


@pytest.mark.parametrize("op", ["open", "verify"])
@pytest.mark.parametrize("mode", MODES)
def test_lmdb_overflow_value_size_past_the_end_of_the_file(harness, tmp_path, mode, op):
    # 96x72 JPEGs (~5 KB): records of more than a page, so their heads are overflow values
    store = H.build_store(tmp_path / "victim.lmdb", tree=H.build_tree(tmp_path / "src", size=(96, 72)))
    shard = shard_of(store)
    node, size, pgno = H.lmdb_bigdata_node(shard, None)
    end = os.path.getsize(shard)
    H.lmdb_set_node_size(shard, node, size if mode == "control" else end - pgno * 4096 + (1 << 20))
    H.resign(store)
    expect(harness.run(op, store=store), mode, *names(store))


# -- 7. FIFOs where files belong ------------------------------------------------------------------

def _fifo_in_place(store: str, what: str, mode: str) -> None:
    target = shard_of(store) if what == "shard" else os.path.join(store, what)
    if mode == "control":
        data = open(target, "rb").read()
        os.unlink(target)
        with open(target, "wb") as fh:
            fh.write(data)
    else:
        os.unlink(target)
        os.mkfifo(target)


@pytest.mark.parametrize("op", ["open", "verify"])
@pytest.mark.parametrize("what", ["manifest.json", "shard", "index.fdi"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ALL)
def test_fifo_in_place_of_a_store_file_never_hangs(harness, fresh, backend, mode, what, op):
    store = fresh("v1", backend)
    _fifo_in_place(store, what, mode)
    result = harness.run(op, store=store, timeout=HANG_TIMEOUT)
    if what == "index.fdi" and op == "open":
        # a local reader need not read index.fdi at all; it must not hang on it
        assert result["outcome"] in (("ok",) if mode == "control" else ("ok", "typed_error")), describe(result)
        return
    expect(result, mode, store)


@pytest.mark.parametrize("what", ["manifest.json", "shard"])
@pytest.mark.parametrize("mode", MODES)
def test_cli_verify_on_a_fifo_never_hangs(harness, fresh, mode, what):
    store = fresh("v1", ALL[0])
    _fifo_in_place(store, what, mode)
    expect_cli(H.run_cli(["verify", store], limit=harness.limit, timeout=HANG_TIMEOUT + 2), mode)


# -- 8. destination clobber -----------------------------------------------------------------------

@pytest.mark.parametrize("how", ["overwrite", "resume"])
@pytest.mark.parametrize("mode", MODES)
def test_lock_symlink_to_a_file_outside(harness, fresh, trees, tmp_path, mode, how):
    store = fresh("v1", ALL[0])
    canary = outside(tmp_path)
    lock = os.path.join(store, ".fastdata.lock")
    if mode == "attack":
        os.symlink(canary, lock)
    result = harness.run("convert", src=trees["a"], dst=store, watch=[canary], **{how: True})
    assert result["outcome"] != "clobbered", describe(result)
    assert result["outcome"] in (("ok",) if mode == "control" else ("ok", "typed_error")), describe(result)


@pytest.mark.parametrize("how", ["overwrite", "resume"])
@pytest.mark.parametrize("mode", MODES)
def test_staging_symlink_to_a_folder_outside(harness, fresh, trees, tmp_path, mode, how):
    store = fresh("v1", ALL[0])
    canary = outside(tmp_path)
    if mode == "attack":
        os.symlink(os.path.dirname(canary), os.path.join(store, ".fastdata-staging"))
    result = harness.run("convert", src=trees["a"], dst=store, watch=[canary, os.path.dirname(canary)],
                         **{how: True})
    assert result["outcome"] != "clobbered", describe(result)
    assert result["outcome"] in (("ok",) if mode == "control" else ("ok", "typed_error")), describe(result)


@pytest.mark.parametrize("how", ["overwrite", "resume"])
@pytest.mark.parametrize("mode", MODES)
def test_lock_hard_link_to_a_file_outside(harness, fresh, trees, tmp_path, mode, how):
    """A hard link (not a symlink) named ``.fastdata.lock``: writing the pid would clobber the
    file it shares its inode with. Control: a stale lock file holding a pid is taken over."""
    store = fresh("v1", ALL[0])
    canary = outside(tmp_path)
    lock = os.path.join(store, ".fastdata.lock")
    if mode == "attack":
        os.link(canary, lock)
    else:
        with open(lock, "w") as fh:
            fh.write("999999999")
    result = harness.run("convert", src=trees["a"], dst=store, watch=[canary], **{how: True})
    assert result["outcome"] != "clobbered", describe(result)
    assert result["outcome"] in (("ok",) if mode == "control" else ("ok", "typed_error")), describe(result)


@pytest.mark.parametrize("mode", MODES)
def test_shard_symlink_to_a_file_outside(harness, fresh, trees, tmp_path, mode):
    """A shard of the store replaced by a symlink to a file outside: ``--overwrite`` must not
    delete, truncate or write it. Control: the regular shard is replaced."""
    store = fresh("v1", ALL[0])
    canary = outside(tmp_path)
    if mode == "attack":
        shard = shard_of(store)
        os.unlink(shard)
        os.symlink(canary, shard)
    result = harness.run("convert", src=trees["a"], dst=store, watch=[canary], overwrite=True)
    assert result["outcome"] != "clobbered", describe(result)
    expect(result, mode, ".lmdb")


# -- 9. a store rewritten while a Dataset has it open ---------------------------------------------

@pytest.mark.parametrize("how", ["after", "reopened", "fork"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ALL)
def test_store_rewritten_while_open(harness, fresh, trees, backend, mode, how):
    """``convert(other_tree, store, overwrite=True)`` while a Dataset has it open: reading on
    must raise an error naming the store ("rewritten since it was opened"), never mix the old
    index with the new images (tree b: other labels, 40x30 images instead of 64x48)."""
    store = fresh("v1", backend)
    result = harness.run("rewrite", store=store, new_src=trees["b"], mode=how, rewrite=mode == "attack")
    if result["outcome"] == "ok":
        shapes = sorted({tuple(p[0]) for p in result["pairs"]})
        labels = [p[1] for p in result["pairs"]]
        verdict = "MIXED: new images with old labels" if shapes == [(30, 40, 3)] and labels == [0, 0, 0, 1, 1, 1] \
            else "the old store's data, silently"
        assert mode == "control", (
            f"read on after the rewrite without an error ({verdict}): {len(result['pairs'])} samples, image "
            f"shapes {shapes}, "
            f"labels {[p[1] for p in result['pairs']]} (the new store: 6 samples of (30, 40, 3), labels "
            "[0, 1, 2, 2, 2, 2]; the old: (48, 64, 3), [0, 0, 0, 1, 1, 1])")
        return
    expect(result, mode, store)
    assert "rewritten" in result["message"], describe(result)


# -- 10. hostile metadata -------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ALL)
def test_nul_byte_in_a_shard_name(harness, fresh, backend, mode):
    store = fresh("v1", backend)
    body = H.load_manifest(store)
    if mode == "attack":
        body["shards"][0]["name"] = body["shards"][0]["name"] + "\x00.evil"
    H.resign(store, body)
    for op in ("open", "verify"):
        expect(harness.run(op, store=store), mode, store)


@pytest.mark.parametrize("mode", MODES)
def test_coco_file_name_with_a_nul(harness, tmp_path, trees, mode):
    from helpers.images import make_jpeg

    images = tmp_path / "images"
    make_jpeg(images / "a.jpg", size=(16, 12))
    make_jpeg(images / "b.jpg", size=(16, 12), seed=1)
    name = "b\x00.jpg" if mode == "attack" else "b.jpg"
    ann = {"images": [{"id": 1, "file_name": "a.jpg", "width": 16, "height": 12},
                      {"id": 2, "file_name": name, "width": 16, "height": 12}],
           "annotations": [], "categories": [{"id": 1, "name": "thing"}]}
    path = tmp_path / "instances.json"
    path.write_text(json.dumps(ann))
    dst = str(tmp_path / H.store_name(ALL[0], "coco"))
    result = harness.run("convert", kind="coco", src=str(path), image_dir=str(images), dst=dst, watch=[])
    if mode == "control":
        assert result["outcome"] == "ok", describe(result)
        return
    # a typed refusal, or the image rejected with a reason: never an untyped ValueError
    if result["outcome"] == "ok":
        rejected = H.load_manifest(dst)["rejected"]
        assert any("b" in r["path"] for r in rejected), f"the NUL name was neither refused nor rejected: {rejected}"
        return
    assert result["outcome"] == "typed_error", describe(result)


@pytest.mark.parametrize("shape", [[2**70], [2**32, 2**32]], ids=["2**70", "wraps-to-0"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ALL)
def test_ndarray_field_shape_overflow(harness, fresh, backend, mode, shape):
    store = fresh("v2", backend)
    body = H.load_manifest(store)
    for field in body["schema"]:
        if field["name"] == "vec" and mode == "attack":
            field["shape"] = shape
    H.resign(store, body)
    for op in ("open", "verify"):
        expect(harness.run(op, store=store), mode, store)


@pytest.mark.parametrize("mode", MODES)
def test_ansi_escapes_in_class_names_are_escaped_by_info(harness, fresh, mode):
    store = fresh("v1", ALL[0])
    body = H.load_manifest(store)
    if mode == "attack":
        body["classes"] = ["\x1b[31mred\x1b[0m", "\x1b]0;owned\x07dog"]
    H.resign(store, body)
    result = H.run_cli(["info", store], limit=harness.limit)
    assert result["outcome"] == "exit" and result["rc"] == 0, result
    assert "\x1b" not in result["stdout"] + result["stderr"], \
        f"raw escape sequences printed: {(result['stdout'] + result['stderr'])[-400:]!r}"


# -- 11. safe today: regression guards ------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ALL)
def test_dotdot_traversal_in_a_shard_name(harness, fresh, tmp_path, backend, mode):
    store = fresh("v1", backend)
    body = H.load_manifest(store)
    if mode == "attack":
        name = body["shards"][0]["name"]
        os.replace(os.path.join(store, name), tmp_path / name)
        body["shards"][0]["name"] = "../" + name
    H.resign(store, body)
    for op in ("open", "verify"):
        expect(harness.run(op, store=store), mode, store)


@pytest.mark.parametrize("bomb", ["length", "depth"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ALL)
def test_msgpack_bombs_in_a_record(harness, fresh, backend, mode, bomb):
    """A general store's record 0 replaced (checksums re-signed) by an array32 claiming 2**32-1
    elements, or by 100000 nested arrays."""
    store = fresh("v2", backend)
    shard = shard_of(store)
    record = H.stored_item(backend, shard, 0)
    if mode == "attack":
        record = b"\xdd\xff\xff\xff\xff" + b"\x90" * 16 if bomb == "length" else b"\x91" * 100_000 + b"\x90"
    H.replace_item(store, backend, shard, 0, record)
    H.resign(store)
    expect(harness.run("open", store=store), mode, *names(store))


@pytest.mark.parametrize("mapsize", [4096, 2**62], ids=["tiny", "huge"])
@pytest.mark.parametrize("mode", MODES)
def test_lmdb_map_size_lies(harness, fresh, reference, mode, mapsize):
    store = fresh("v1", "lmdb")
    shard = shard_of(store)
    meta = max(H.lmdb_meta(shard), key=lambda m: m["txnid"])
    H.lmdb_set_meta(shard, mapsize=meta["mapsize"] if mode == "control" else mapsize)
    H.resign(store)
    result = harness.run("open", store=store)
    if mode == "attack" and result["outcome"] == "ok":  # LMDB maps the file as it is: a correct read is fine
        assert result["digest"] == reference("v1", "lmdb")["digest"], describe(result)
        return
    expect(result, mode, *names(store))


def _png_bomb(width: int, height: int) -> bytes:
    import zlib

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
            + chunk(b"IEND", b""))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ALL)
def test_image_bomb_inside_a_store(harness, fresh, backend, mode):
    """Record 0's image: a PNG declaring 30000x30000 pixels (2.7 GB decoded), index and checksums agreeing."""
    from fastdata.format.record import FORMAT_CODES, decode_record, encode_record

    store = fresh("v1", backend)
    shard = shard_of(store)
    stored = H.stored_item(backend, shard, 0)
    rec = decode_record(stored) if backend == "lmdb" else None
    img, w, h, fmt = (_png_bomb(30000, 30000), 30000, 30000, "PNG") if mode == "attack" else \
        ((rec.image if rec else stored), 64, 48, "JPEG")
    if backend == "lmdb":
        data = encode_record(img, label=rec.label, width=w, height=h, fmt=fmt, relpath=rec.relpath)
    else:
        data = img
    H.replace_item(store, backend, shard, 0, data, checksummed=img, widths=w, heights=h, formats=FORMAT_CODES[fmt])
    H.resign(store)
    expect(harness.run("open", store=store), mode, *names(store))


# -- fuzz-ish structural mutations, re-signed: a typed error or a correct read -----------------------

def _typed_or_correct(result: dict, ref: dict) -> None:
    if result["outcome"] == "ok" and "digest" in result:
        assert result["digest"] == ref["digest"], f"a wrong read without an error: {describe(result)}"
        return
    assert result["outcome"] in ("ok", "typed_error"), describe(result)


def _opened_and_verified_safely(harness, store: str, ref: dict) -> None:
    """A mutated store opens and verifies to a typed error or to exactly the reference's content."""
    _typed_or_correct(harness.run("open", store=store), ref)
    _typed_or_correct(harness.run("verify", store=store), ref)


_HOSTILE_VALUES = [None, True, -1, 0, 2**63, 2**64 + 5, 1e308, "", "\x00", "../x", [], {}, [[[]]], "shard-99999.h5",
                   {"name": "x"}, [0] * 3]


def _mutate_json(obj, rng: random.Random):
    """Replace one random leaf or container of ``obj`` (in place) by a hostile value; returns the path."""
    path = []
    node = obj
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            return path
        key = rng.choice(keys)
        child = node[key]
        path.append(key)
        if not isinstance(child, (dict, list)) or not child or rng.random() < 0.3:
            node[key] = rng.choice(_HOSTILE_VALUES)
            return path
        node = child


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("backend", ALL)
def test_fuzz_manifest_structure(harness, fresh, reference, backend, seed):
    store = fresh("v1", backend)
    body = H.load_manifest(store)
    body.pop("checksum")
    rng = random.Random(seed)
    for _ in range(1 + seed % 3):
        _mutate_json(body, rng)
    H.resign(store, body)
    _opened_and_verified_safely(harness, store, reference("v1", backend))


@pytest.mark.parametrize("seed", range(8))
def test_fuzz_hdf5_structure(harness, fresh, reference, seed):
    """Byte flips in the HDF5 file's structure (superblock, object headers, B-trees, heaps: every
    byte outside the datasets' raw data), the file re-signed."""
    store = fresh("v1", "hdf5")
    shard = shard_of(store)
    data = H.h5_data_ranges(shard)
    size = os.path.getsize(shard)
    structural = [o for o in range(size) if not any(a <= o < b for a, b in data)]
    rng = random.Random(seed)
    H.flip_bytes(shard, rng.sample(structural, 1 + seed % 4), rng)
    H.resign(store)
    _opened_and_verified_safely(harness, store, reference("v1", "hdf5"))


@pytest.mark.parametrize("seed", range(8))
def test_fuzz_lmdb_meta_and_tree_pages(harness, fresh, reference, seed):
    """Byte flips in the LMDB meta pages' fields and in the main DB's root page (the named
    databases' records), the file re-signed."""
    store = fresh("v1", "lmdb")
    shard = shard_of(store)
    meta = max(H.lmdb_meta(shard), key=lambda m: m["txnid"])
    root = meta["main_root"] * meta["psize"]
    candidates = [o for page in (0, 4096) for o in range(page + 16, page + H.META_END)]
    candidates += list(range(root, root + meta["psize"]))
    rng = random.Random(seed)
    H.flip_bytes(shard, rng.sample(candidates, 1 + seed % 4), rng)
    H.resign(store)
    _opened_and_verified_safely(harness, store, reference("v1", "lmdb"))


@pytest.mark.parametrize("seed", range(8))
def test_fuzz_lmdb_branch_and_leaf_pages(harness, fresh, reference, seed):
    """Byte flips in the page headers, node pointers and node headers (sizes, flags, key sizes,
    child and overflow page numbers) of every B-tree page, the named databases' leaves included,
    the file re-signed: never a signal, whatever LMDB would make of it."""
    store = fresh("v1", "lmdb")
    shard = shard_of(store)
    candidates: list[int] = []
    for pgno, flags, page in H.lmdb_pages(shard):
        if not flags & (H.P_LEAF | 0x01):
            continue
        base = pgno * 4096
        lower = struct.unpack_from("<H", page, 12)[0]
        candidates += range(base, base + min(lower, 4096))  # header and node pointers
        for k in range(max(0, min(lower, 4096) - H.PAGE_HEADER) // 2):
            ptr = struct.unpack_from("<H", page, H.PAGE_HEADER + 2 * k)[0]
            if ptr + 16 <= 4096:
                candidates += range(base + ptr, base + ptr + 16)  # node header and the start of its key/data
    rng = random.Random(seed)
    H.flip_bytes(shard, rng.sample(candidates, 1 + seed % 4), rng)
    H.resign(store)
    _opened_and_verified_safely(harness, store, reference("v1", "lmdb"))
