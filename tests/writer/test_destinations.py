"""Destinations that cannot be turned against the user (fastdata.writer.owned, lock, pipeline,
session, remote_sink).

* every entry a conversion writes (the lock, the staging folder and its files, shards, the
  manifest, temporaries) that is a symlink (or a FIFO, or a hard link for the lock) is refused
  with an UnsafeStoreError naming it, before anything is written, and nothing outside the
  destination changes; the control: the same entry as a regular file is used or replaced;
* URL destinations with ``.``, ``..`` or empty segments are refused before any request;
* only directories the converter made (carrying its marker) are deleted: ``--overwrite``,
  ``clear_store`` and a URL destination's local staging folder never remove a folder without
  the marker (control: with it they do); the marker survives ``--resume``.
"""

from __future__ import annotations

import json
import os
import stat

import pytest
from helpers.images import make_tree

import fastdata
from fastdata.errors import RemotePathError, StoreExistsError, UnsafeStoreError
from fastdata.format.names import LOCK_NAME, MANIFEST_NAME, STAGING_DIR
from fastdata.writer import owned, pipeline, session
from fastdata.writer.lock import StoreLock
from fastdata.writer.remote_sink import check_url_path, prepare_local, remove_local

CANARY = "a file outside the destination\n"


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return make_tree(tmp_path_factory.mktemp("dest-tree") / "src", {"ant": 4, "bee": 4}, size=(24, 20), seed=1)


@pytest.fixture
def store(tree, tmp_path) -> str:
    dst = str(tmp_path / "store.lmdb")
    fastdata.convert(tree, dst, workers=0, progress=False, shard_size=3000)
    return dst


@pytest.fixture
def canary(tmp_path) -> str:
    d = tmp_path / "outside"
    d.mkdir()
    (d / "secret.txt").write_text(CANARY)
    return str(d / "secret.txt")


def _outside_intact(canary: str) -> None:
    with open(canary) as fh:
        assert fh.read() == CANARY, "a file outside the destination was written"
    assert sorted(os.listdir(os.path.dirname(canary))) == ["secret.txt"]


def _convert(tree, dst, **kw):
    return fastdata.convert(tree, dst, workers=0, progress=False, shard_size=3000, **kw)


def _unfinished(tree, dst, monkeypatch) -> None:
    """An interrupted conversion: every shard written, the publish step failed."""
    def fail(*a, **k):
        raise fastdata.errors.ConversionError("interrupted (test)")
    with monkeypatch.context() as mp:
        mp.setattr(session, "publish", fail)  # the pipeline's publish, as the session calls it
        with pytest.raises(fastdata.errors.ConversionError):
            _convert(tree, dst)


# -- symlinked entries -------------------------------------------------------------------------

ENTRIES = [LOCK_NAME, MANIFEST_NAME, "rejected.tsv", "index.fdi", "shard-00000.lmdb", "shard-00001.lmdb.tmp",
           "manifest.json.tmp-4242"]


@pytest.mark.parametrize("how", ["overwrite", "resume"])
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_symlinked_entry_is_refused_before_anything_is_written(tree, store, canary, entry, how):
    path = os.path.join(store, entry)
    if os.path.lexists(path):
        os.unlink(path)
    os.symlink(canary, path)
    before = sorted(os.listdir(store))
    with pytest.raises(UnsafeStoreError) as exc:
        _convert(tree, store, **{how: True})
    assert path in str(exc.value) and "symbolic link" in str(exc.value), str(exc.value)
    _outside_intact(canary)
    assert sorted(os.listdir(store)) == before and os.path.islink(path)


@pytest.mark.parametrize("entry", ENTRIES)
def test_control_the_same_entry_as_a_regular_file_is_replaced(tree, store, entry):
    path = os.path.join(store, entry)
    if not os.path.lexists(path):
        with open(path, "w") as fh:
            fh.write("" if entry == LOCK_NAME else "left by an interrupted run")
    _convert(tree, store, overwrite=True)
    assert fastdata.verify(store).ok
    assert not os.path.exists(os.path.join(store, LOCK_NAME))


@pytest.mark.parametrize("how", ["overwrite", "resume", "new"])
def test_a_symlinked_staging_folder_is_refused(tree, store, tmp_path, how):
    outside = tmp_path / "theirs"
    outside.mkdir()
    (outside / "keep.txt").write_text(CANARY)
    dst = store if how != "new" else str(tmp_path / "new.lmdb")
    os.makedirs(dst, exist_ok=True)
    os.symlink(outside, os.path.join(dst, STAGING_DIR))
    with pytest.raises(UnsafeStoreError, match=STAGING_DIR):
        _convert(tree, dst, **({how: True} if how != "new" else {}))
    assert sorted(os.listdir(outside)) == ["keep.txt"]


def test_a_symlink_inside_staging_is_refused_on_resume(tree, tmp_path, canary, monkeypatch):
    dst = str(tmp_path / "half.lmdb")
    _unfinished(tree, dst, monkeypatch)
    plan = os.path.join(dst, STAGING_DIR, "plan.json")
    os.unlink(plan)
    os.symlink(canary, plan)
    with pytest.raises(UnsafeStoreError, match="plan.json"):
        _convert(tree, dst, resume=True)
    _outside_intact(canary)


def test_a_fifo_lock_is_refused_without_hanging(tree, store):
    os.mkfifo(os.path.join(store, LOCK_NAME))
    with pytest.raises(UnsafeStoreError, match="FIFO"):
        _convert(tree, store, overwrite=True)


def test_a_hard_linked_lock_is_refused_and_its_target_untouched(tree, store, canary):
    os.link(canary, os.path.join(store, LOCK_NAME))
    with pytest.raises(UnsafeStoreError, match="hard links"):
        _convert(tree, store, overwrite=True)
    _outside_intact(canary)


def test_a_lock_file_holding_something_else_is_never_truncated(tmp_path):
    dst = tmp_path / "d"
    dst.mkdir()
    (dst / LOCK_NAME).write_text("not a pid: someone's notes\n")
    with pytest.raises(UnsafeStoreError, match="not a fastdata lock"):
        StoreLock(str(dst)).acquire()
    assert (dst / LOCK_NAME).read_text() == "not a pid: someone's notes\n"


def test_control_a_stale_lock_with_a_pid_is_taken_over(tmp_path):
    dst = tmp_path / "d"
    dst.mkdir()
    (dst / LOCK_NAME).write_text("999999999")
    lock = StoreLock(str(dst)).acquire()
    try:
        assert lock.stale_pid == 999999999
        lock.record_token("ab" * 16)
        assert (dst / LOCK_NAME).read_text().split() == [str(os.getpid()), "ab" * 16]
    finally:
        lock.release()
    assert not (dst / LOCK_NAME).exists()


def test_a_directory_in_place_of_a_shard_is_refused_not_deleted(tree, store):
    os.unlink(os.path.join(store, "shard-00000.lmdb"))
    os.mkdir(os.path.join(store, "shard-00000.lmdb"))
    (open(os.path.join(store, "shard-00000.lmdb", "mine.txt"), "w")).close()
    with pytest.raises(UnsafeStoreError, match="shard-00000.lmdb"):
        _convert(tree, store, overwrite=True)
    assert os.listdir(os.path.join(store, "shard-00000.lmdb")) == ["mine.txt"]


def test_shard_temporaries_are_created_exclusively(tmp_path, canary):
    path = str(tmp_path / "x.tmp")
    os.symlink(canary, path)
    with pytest.raises(UnsafeStoreError):
        owned.create_file(path)
    os.unlink(path)
    os.close(owned.create_file(path))
    assert stat.S_ISREG(os.lstat(path).st_mode)
    _outside_intact(canary)


# -- URL destinations --------------------------------------------------------------------------

@pytest.mark.parametrize("url", ["s3://bucket/a/..", "s3://bucket/a/../b.lmdb", "s3://bucket/./b.lmdb",
                                 "s3://bucket//b.lmdb", "s3://bucket/a/.", "gs://bucket/..", "s3://bucket/a\0/b"])
def test_url_destinations_with_dot_dotdot_or_empty_segments_are_refused(tree, url):
    with pytest.raises(RemotePathError, match="segment|NUL"):
        check_url_path(url)
    with pytest.raises(RemotePathError):  # before any request: no server needed
        fastdata.convert(tree, url, workers=0, progress=False)


@pytest.mark.parametrize("url", ["s3://bucket/a/b.lmdb", "s3://bucket/a/b.lmdb/", "gs://b/x.y.h5", "s3://b/..x"])
def test_control_plain_url_paths_pass(url):
    check_url_path(url)


# -- deleting only what the converter made -----------------------------------------------------

def test_overwrite_never_removes_a_staging_folder_without_the_marker(tree, store):
    staging = os.path.join(store, STAGING_DIR)
    os.mkdir(staging)
    with open(os.path.join(staging, "thesis.tex"), "w") as fh:
        fh.write("years of work")
    with pytest.raises(UnsafeStoreError, match="marker"):
        _convert(tree, store, overwrite=True)
    with pytest.raises(UnsafeStoreError, match="marker"):
        pipeline.clear_store(store)
    assert os.listdir(staging) == ["thesis.tex"]


def test_control_a_staging_folder_with_the_marker_is_removed(tree, store):
    staging = os.path.join(store, STAGING_DIR)
    token = owned.make_dir(staging)
    assert owned.read_marker(staging) == token
    with open(os.path.join(staging, "anything.bin"), "w") as fh:
        fh.write("made by the run")
    _convert(tree, store, overwrite=True)
    assert not os.path.exists(staging) and fastdata.verify(store).ok


def test_an_older_fastdatas_staging_without_marker_is_emptied_of_its_own_files_only(tree, store):
    staging = os.path.join(store, STAGING_DIR)
    os.mkdir(staging)
    for name in ("plan.json", "shard-00000.lmdb.json", "shard-00000.lmdb.index", "listing.npz"):
        with open(os.path.join(staging, name), "w") as fh:
            fh.write("{}")
    pipeline.clear_store(store)
    assert not os.path.exists(staging)


def test_a_foreign_marker_is_not_a_marker(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / owned.MARKER_NAME).write_text(json.dumps({"kind": "something else", "token": "x"}))
    (d / "mine.txt").write_text("keep")
    with pytest.raises(UnsafeStoreError):
        owned.remove_dir(str(d))
    real = tmp_path / "real"
    token = owned.make_dir(str(real))
    with pytest.raises(UnsafeStoreError, match="another run"):
        owned.remove_dir(str(real), token="0" * 32)
    owned.remove_dir(str(real), token=token)
    assert not real.exists() and (d / "mine.txt").exists()


def test_a_symlinked_marker_does_not_count(tmp_path):
    real = tmp_path / "real"
    token = owned.make_dir(str(real))
    other = tmp_path / "other"
    other.mkdir()
    (other / "mine.txt").write_text("keep")
    os.symlink(real / owned.MARKER_NAME, other / owned.MARKER_NAME)
    assert owned.read_marker(str(other)) is None
    with pytest.raises(UnsafeStoreError):
        owned.remove_dir(str(other), token=token)
    assert (other / "mine.txt").exists()


def test_rmtree_of_a_symlinked_directory_never_follows_it(tmp_path):
    real = tmp_path / "real"
    owned.make_dir(str(real))
    (real / "keep.txt").write_text("keep")
    link = tmp_path / "link"
    os.symlink(real, link)
    with pytest.raises(UnsafeStoreError, match="symbolic link"):
        owned.remove_dir(str(link))
    assert (real / "keep.txt").exists()


def test_the_marker_survives_resume(tree, tmp_path, monkeypatch):
    dst = str(tmp_path / "half.lmdb")
    _unfinished(tree, dst, monkeypatch)
    staging = os.path.join(dst, STAGING_DIR)
    token = owned.read_marker(staging)
    assert token
    _unfinished_resume = pytest.raises(fastdata.errors.ConversionError)
    with monkeypatch.context() as mp:
        mp.setattr(session, "publish", lambda *a, **k: (_ for _ in ()).throw(
            fastdata.errors.ConversionError("interrupted again (test)")))
        with _unfinished_resume:
            _convert(tree, dst, resume=True)
    assert owned.read_marker(staging) == token
    report = _convert(tree, dst, resume=True)
    assert report.images == 8 and not os.path.exists(staging) and fastdata.verify(dst).ok


def test_a_url_destinations_local_staging_folder_is_removed_only_with_the_marker(tmp_path):
    """``staging_dir=<a folder of the user's>`` and a URL whose store name is one of its
    subfolders: the converter must not empty that subfolder."""
    user = tmp_path / "home"
    (user / "Documents").mkdir(parents=True)
    (user / "Documents" / "cv.pdf").write_text("mine")
    local = str(user / "Documents")
    with pytest.raises((UnsafeStoreError, StoreExistsError)):
        prepare_local(None, local, {}, resume=False)  # type: ignore[arg-type]
    with pytest.raises(UnsafeStoreError):
        remove_local(local)
    assert os.listdir(local) == ["cv.pdf"]
    # control: one the converter made goes (and is made again, with a new marker)
    made = str(user / "train.lmdb")
    first = prepare_local(None, made, {}, resume=False)  # type: ignore[arg-type]
    with open(os.path.join(made, "shard-00000.lmdb"), "w") as fh:
        fh.write("a shard")
    second = prepare_local(None, made, {}, resume=False)  # type: ignore[arg-type]
    assert first != second and os.listdir(made) == [owned.MARKER_NAME]
    remove_local(made, token=second)
    assert not os.path.exists(made)

