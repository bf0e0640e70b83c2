"""A dataset is tied to the store version it opened (fastdata.remote.store, fastdata.reader.shards).

A store rewritten with ``convert(..., overwrite=True)`` under an open dataset raises
:class:`~fastdata.errors.StoreChangedError` naming the store, in the process that opened it
(readers already open, a reader opened after the rewrite, an LRU re-open) and in DataLoader
workers (fork and spawn), and never returns a mix of the new shards and the old index. The
controls: a store that is not rewritten reads the same over many epochs and LRU re-opens,
in workers too, and a manifest touched in place (same checksum) is the same version.
"""

from __future__ import annotations

import os
import pickle
import time

import numpy as np
import pytest
import torch.utils.data
from helpers.backends import NAME_SUFFIXES, first_in_ci
from helpers.images import make_tree

import fastdata
from fastdata.errors import StoreChangedError
from fastdata.reader import shards as shards_module

BACKENDS = dict(NAME_SUFFIXES)


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    base = tmp_path_factory.mktemp("version-trees")
    return {"old": make_tree(base / "old", {"ant": 6, "bee": 6}, size=(24, 20), seed=3),
            "new": make_tree(base / "new", {"cat": 4, "dog": 8}, size=(16, 12), seed=4)}


@pytest.fixture(params=sorted(BACKENDS))
def store(request, trees, tmp_path) -> str:
    """A store of several shards (a few images each), made from the "old" tree."""
    dst = str(tmp_path / f"s{BACKENDS[request.param]}")
    fastdata.convert(trees["old"], dst, workers=0, progress=False, shard_size=3000)
    assert len(fastdata.info(dst)["shards"]) >= 3
    return dst


def _rewrite(trees, store: str) -> None:
    fastdata.convert(trees["new"], store, overwrite=True, workers=0, progress=False, shard_size=3000)


def _read_all(ds) -> list:
    return [(np.asarray(img).shape, int(label)) for img, label in (ds[i] for i in range(len(ds)))]


@pytest.fixture(autouse=True)
def _check_every_read(monkeypatch):
    """Readers already open check the manifest at most every CHECK_INTERVAL_S: at 0 every
    read checks, so these tests do not depend on how long a rewrite takes."""
    monkeypatch.setattr(shards_module, "CHECK_INTERVAL_S", 0.0)


def _expect_changed(err: BaseException, store: str) -> None:
    text = str(err)
    assert store in text and "rewritten since it was opened; open it again" in text, text


@pytest.mark.parametrize("how", ["open-readers", "lazy-open", "all-read"])
def test_rewritten_store_raises_in_the_process_that_opened_it(trees, store, how):
    ds = fastdata.open_dataset(store, output="numpy")
    if how == "open-readers":
        ds[0]
    elif how == "all-read":
        _read_all(ds)
    _rewrite(trees, store)
    with pytest.raises(StoreChangedError) as exc:
        _read_all(ds)
    _expect_changed(exc.value, store)


def test_rewritten_store_raises_on_the_batch_path_and_is_never_skipped(trees, store):
    ds = fastdata.open_dataset(store, output="numpy", on_error="skip")
    ds.__getitems__([0, 1])
    _rewrite(trees, store)
    with pytest.raises(StoreChangedError):
        ds.__getitems__(list(range(len(ds))))
    with pytest.raises(StoreChangedError):
        ds[len(ds) - 1]
    assert ds.skipped == 0


def test_lru_reopen_after_a_rewrite_is_refused_even_between_manifest_checks(trees, store, monkeypatch):
    """A shard re-opened after the LRU closed it always checks the shard file and the manifest,
    whatever the interval of the open readers' checks."""
    monkeypatch.setattr(shards_module, "CHECK_INTERVAL_S", 3600.0)
    ds = fastdata.open_dataset(store, output="numpy", max_open_shards=1)
    ds[0]
    ds[len(ds) - 1]  # closes shard 0
    _rewrite(trees, store)
    with pytest.raises(StoreChangedError):
        ds[0]


def test_open_reader_between_checks_reads_the_old_version_whole(trees, store, monkeypatch):
    """Between two manifest checks an open reader may still read, but only the old version
    (its files are the old ones): never the new images with the old labels."""
    monkeypatch.setattr(shards_module, "CHECK_INTERVAL_S", 3600.0)
    ds = fastdata.open_dataset(store, output="numpy")
    before = _read_all(ds)
    _rewrite(trees, store)
    assert _read_all(ds) == before
    monkeypatch.setattr(shards_module, "CHECK_INTERVAL_S", 0.0)
    with pytest.raises(StoreChangedError):
        ds[0]


def test_a_shard_replaced_in_place_is_refused_when_opened(store):
    ds = fastdata.open_dataset(store, output="numpy")
    name = fastdata.info(store)["shards"][1]["name"]
    path = os.path.join(store, name)
    copy = path + ".copy"
    with open(path, "rb") as src, open(copy, "wb") as dst:
        dst.write(src.read())
    os.replace(copy, path)  # same bytes, another file: not the one the dataset opened
    with pytest.raises(StoreChangedError, match=name):
        _read_all(ds)


def _loader_read(ds, context: str) -> list:
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context=context)
    it = iter(loader)
    try:
        return [int(x) for _, labels in it for x in labels]
    except StoreChangedError as err:
        # Drop the traceback (as test_on_error_matrix.read_all does): its frames hold the iterator,
        # whose worker the garbage collector would otherwise shut down later, mid-way through
        # another test, after torch's 5 s join timeout; this way it stops here, while it still listens.
        error = err.with_traceback(None)
    del it
    raise error


# spawn over one backend in CI, the other nightly: the fork variants run over every backend
@pytest.mark.parametrize("store,context", [
    *((b, "fork") for b in sorted(BACKENDS)),
    *(pytest.param(p.values[0], "spawn", marks=p.marks) for p in first_in_ci(sorted(BACKENDS))),
], indirect=["store"])
def test_rewritten_store_raises_in_a_dataloader_worker(trees, store, context):
    ds = fastdata.open_dataset(store, output="tensor")
    ds[0]
    _rewrite(trees, store)
    with pytest.raises(StoreChangedError) as exc:
        _loader_read(ds, context)
    _expect_changed(exc.value, store)


# spawn: nightly; the spawn variant of the rewritten-store test above runs in CI
@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_store_not_rewritten_reads_in_workers_over_epochs(store, context):
    ds = fastdata.open_dataset(store, output="tensor", max_open_shards=1)
    expected = [int(x) for x in ds.targets]
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=context,
                                         persistent_workers=True)
    for _ in range(3):
        assert sorted(int(x) for _, labels in loader for x in labels) == sorted(expected)


def test_store_not_rewritten_reads_the_same_over_many_epochs_and_lru_reopens(store):
    ds = fastdata.open_dataset(store, output="numpy", max_open_shards=1)
    first = _read_all(ds)
    rng = np.random.default_rng(0)
    for _ in range(20):
        order = rng.permutation(len(ds)).tolist()  # jumps between shards: an LRU re-open almost every read
        assert [(np.asarray(ds[i][0]).shape, int(ds[i][1])) for i in order] == [first[i] for i in order]
    copy = pickle.loads(pickle.dumps(ds))
    assert _read_all(copy) == first


def test_a_manifest_touched_in_place_is_the_same_version(store):
    ds = fastdata.open_dataset(store, output="numpy")
    first = _read_all(ds)
    manifest = os.path.join(store, "manifest.json")
    later = time.time() + 5
    os.utime(manifest, (later, later))
    with open(manifest, "rb") as fh:
        body = fh.read()
    tmp = manifest + ".again"
    with open(tmp, "wb") as fh:
        fh.write(body)
    os.replace(tmp, manifest)  # another inode, the same checksum
    assert _read_all(ds) == first


def test_a_store_being_rewritten_while_opened_is_refused_or_consistent(trees, store):
    """Opening while the manifest is gone (a rewrite has started) is an error, never a half-open store."""
    os.rename(os.path.join(store, "manifest.json"), os.path.join(store, "manifest.json.moved"))
    with pytest.raises(fastdata.errors.FormatError):
        fastdata.open_dataset(store)
