"""Writing a store to a URL: shards staged locally, uploaded as each finishes, checked, manifest last.

``fastdata.convert(src, "s3://bucket/train.lmdb")`` (and ``convert_table``, ``write``,
``convert_coco``, the CLI's ``convert``) runs the ordinary local pipeline into a local
staging directory and gives it a :class:`RemoteDestination` as its shard sink
(:class:`fastdata.writer.pipeline.ShardSink`, an argument of the pipeline's functions):

* **Staging**: ``staging_dir`` if given, else ``default_cache_dir()/uploads/<sha1(url)[:16]>/``,
  holding ``<store name>/`` (e.g. ``train.lmdb/``, so the suffix still picks the backend);
  under ``torchrun`` each rank has its own ``rank-<r>/`` below it. It is emptied when a
  run starts (a resume refills it from the remote staging) and removed when it succeeds.
* **Each shard**, when the pipeline finishes it, is queued for a background upload thread
  (one upload at a time, so converting the next shard overlaps uploading this one). At most
  :data:`MAX_WAITING` finished shards wait for or are in upload; the pipeline blocks when
  that many wait, so the staging directory holds at most ``MAX_WAITING + 1`` shard files
  (those waiting plus the one being written), i.e. about three shard sizes of disk.
* **The check** after each upload: the object's size must equal the local file's; on
  ``s3://`` its ETag must also equal the MD5 computed locally (one PUT) or the multipart
  ETag (MD5 of the parts' MD5 digests + ``-<parts>``, for the part size used here:
  :func:`part_size`); on ``gs://``, ``az://``: the MD5 their service reports, where it does.
  Only then is the local shard file deleted and its sidecars (the index, then the result
  JSON: the proof the shard is uploaded and checked) uploaded to ``URL/.fastdata-staging/``.
  A bucket whose ETags are not MD5s (SSE-KMS / SSE-C encryption) fails the check: set
  ``FASTDATA_UPLOAD_ETAG_CHECK=0`` there to check sizes only.
* **Publishing**: ``rejected.tsv``, ``index.fdi``, then ``manifest.json`` last (each checked
  like a shard); then the remote staging objects are deleted. A reader never sees a
  manifest before every object it names is in place; a URL with staging objects and no
  manifest reads as an unfinished conversion (:class:`~fastdata.errors.IncompleteStoreError`).
* **Destination checks**: a store at the URL is refused unless ``overwrite`` (which deletes
  the manifest first, then the rest) or ``resume``; objects that are not a store's are refused.
* **Lock** (advisory): object stores have no ``flock``, so a run writes the object
  ``URL/.fastdata.lock`` (host, pid, job, time), rewrites it after each uploaded shard and
  deletes it when it ends. Another run refuses the URL while that object is younger than
  :data:`LOCK_STALE_S` (one hour), unless it names a process of this host that is no longer
  running (a killed run: taken over) or this same torchrun job. It is not atomic: two runs
  starting within the same second may both proceed; it stops the common mistakes (a second
  job into a URL being written, a resume while the first run still lives). The local
  staging directory's ``flock`` also stops two runs on one machine.
* **Resume**: a shard whose result sidecar is in the remote staging and whose object there
  has the size the sidecar records is kept (it was checked when uploaded); its sidecars are
  downloaded into the local staging, so publishing builds the manifest and index from them.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from fastdata.common.fileio import ATOMIC_TMP_MARK, atomic_write
from fastdata.common.paths import remote_scheme
from fastdata.errors import FastdataError, RemotePathError, RemoteStoreError, StoreExistsError, StoreLockedError
from fastdata.format.added import field_file_shard, is_field_file_name
from fastdata.format.names import (
    LOCK_NAME,
    MANIFEST_NAME,
    REJECTED_NAME,
    SIDECAR_SUFFIX,
    STAGING_DIR,
    TMP_SUFFIX,
    is_store_index_name,
    shard_name,
)
from fastdata.remote.cache import default_cache_dir
from fastdata.remote.location import RemoteLocation, object_md5
from fastdata.writer.lock import raise_if_locked
from fastdata.writer.owned import check_dir, make_dir, remove_dir, remove_file
from fastdata.writer.pipeline import ShardResult, ShardSink, check_store_entries, staging_made

#: finished shards that may wait for (or be in) upload before the pipeline blocks
MAX_WAITING = 2
#: multipart part size for s3:// uploads (``FASTDATA_UPLOAD_PART_SIZE`` overrides it, in bytes)
DEFAULT_PART_SIZE = 64 << 20
#: S3's limit on parts per upload
MAX_PARTS = 10_000
#: what a single PUT may carry at most (S3's limit)
MAX_SINGLE_PUT = 5 << 30
_S3_SCHEMES = ("s3", "s3a")
#: a lock object older than this (seconds since its last rewrite) belongs to a run that is gone
LOCK_STALE_S = 3600.0


#: suffixes of inputs that are read from URLs only as image files or path,label lists (a URL
#: with none of these is taken as an image folder prefix)
_LOCAL_ONLY_SUFFIXES = (".json", ".parquet", ".tar", ".tgz", ".tar.gz", ".nii", ".nii.gz", ".txt")


def remote_image_source(src: str | os.PathLike) -> bool:
    """Whether the URL ``src`` names an input read remotely: an image folder prefix or a
    ``.csv``/``.tsv``/``.jsonl`` list (not a Parquet, WebDataset, COCO or NIfTI input)."""
    name = os.fspath(src).rstrip("/").lower()
    return not name.endswith(_LOCAL_ONLY_SUFFIXES) and not any(c in name.rsplit("/", 1)[-1] for c in "*?[{")


def refuse_remote_source(src: str | os.PathLike, what: str = "source") -> None:
    """Raise :class:`RemotePathError` when ``src`` is a URL of an input kind that is read from a
    local or mounted filesystem only (single NIfTI files, TIFF images; every other kind is read
    from URLs)."""
    scheme = remote_scheme(src)
    if scheme is not None:
        raise RemotePathError(f"{what} {os.fspath(src)}: this kind of input is read from a local or mounted "
                              f"filesystem (from {scheme}:// URLs fastdata reads image folders, .csv/.tsv/.jsonl "
                              "lists, COCO, Parquet files, WebDataset tars, NIfTI volumes (folders, volume lists, "
                              "Decathlon dataset.json files) and DICOM folders with dicom_tags; not single volumes "
                              "or TIFF images): copy or mount the data and give that path")


def check_url_path(url: str) -> None:
    """Refuse a destination URL whose path has ``.``, ``..`` or empty segments (``s3://b/a/..``,
    ``s3://b//x``) or a NUL: object stores take them literally, but the converter's local
    staging folder (named after the last segment) and every tool reading the URL would not.

    Raises:
        RemotePathError: naming the URL and the segment.
    """
    _, _, rest = url.partition("://")
    segments = rest.rstrip("/").split("/")
    for segment in segments:
        if segment in ("", ".", "..") or "\0" in segment:
            shown = {"": "an empty segment (//)", ".": "a '.' segment", "..": "a '..' segment"}.get(
                segment, "a NUL byte")
            raise RemotePathError(f"destination {url!r}: the path has {shown}; write to a plain prefix such as "
                                  "s3://bucket/datasets/train.lmdb (no '.', '..' or empty segments)")


def local_staging_dir(url: str, staging_dir: str | os.PathLike | None, rank: int | None) -> str:
    """The local directory a conversion into ``url`` writes its shards in before uploading them
    (see the module docstring); ``rank`` is the torchrun rank, or None outside torchrun."""
    base = os.fspath(staging_dir) if staging_dir is not None else os.path.join(
        default_cache_dir(), "uploads", hashlib.sha1(url.rstrip("/").encode()).hexdigest()[:16])
    if rank is not None:
        base = os.path.join(base, f"rank-{rank}")
    return os.path.abspath(os.path.join(base, url.rstrip("/").rsplit("/", 1)[-1] or "store"))


def part_size(size: int) -> int:
    """The multipart part size for an upload of ``size`` bytes: :data:`DEFAULT_PART_SIZE` (or
    ``FASTDATA_UPLOAD_PART_SIZE``), raised where needed to stay within :data:`MAX_PARTS` parts."""
    part = int(os.environ.get("FASTDATA_UPLOAD_PART_SIZE") or DEFAULT_PART_SIZE)
    return max(part, -(-size // MAX_PARTS))


def is_multipart(size: int, part: int) -> bool:
    """Whether s3fs uploads ``size`` bytes in parts of ``part`` (it sends one PUT below two parts)."""
    return size >= min(MAX_SINGLE_PUT, 2 * part)


def expected_etag(path: str, part: int) -> str:
    """The S3 ETag of ``path`` uploaded with part size ``part``: the MD5 hex digest (one PUT),
    or the MD5 of the concatenated part MD5 digests followed by ``-<number of parts>``."""
    size = os.path.getsize(path)
    whole = hashlib.md5(usedforsecurity=False)
    digests = []
    with open(path, "rb") as fh:
        while True:
            block = fh.read(part)
            if not block:
                break
            whole.update(block)
            digests.append(hashlib.md5(block, usedforsecurity=False).digest())
    if not is_multipart(size, part):
        return whole.hexdigest()
    return f"{hashlib.md5(b''.join(digests), usedforsecurity=False).hexdigest()}-{len(digests)}"


def _file_md5(path: str) -> str:
    """The MD5 hex digest of ``path``'s content."""
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as fh:
        while block := fh.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def _etag_check_enabled() -> bool:
    return os.environ.get("FASTDATA_UPLOAD_ETAG_CHECK", "1") not in ("0", "false", "no")


def _put(location: RemoteLocation, local_path: str, name: str, part: int | None) -> None:
    """One upload of ``local_path`` to object ``name`` (with retries); ``part``: the s3 part size."""
    fs = location.filesystem()
    path = location._path(name)
    kwargs = {"chunksize": part} if part is not None else {}
    location.call(f"uploading {local_path} to {location.child(name)}",
                  lambda: fs.put_file(local_path, path, **kwargs))


def upload_checked(location: RemoteLocation, local_path: str, name: str) -> None:
    """Upload ``local_path`` to object ``name``, then check the object: its size, and on ``s3://``
    its ETag against the MD5 (or multipart MD5) computed here; other schemes: the MD5 their
    filesystem reports (:func:`~fastdata.remote.location.object_md5`: gs, and az for a blob put
    in one request) against the file's, else the size only.

    Raises:
        RemoteStoreError: the upload failed, or the object does not match (names both, and
            says nothing was published).
    """
    size = os.path.getsize(local_path)
    s3 = location.scheme in _S3_SCHEMES
    part = part_size(size) if s3 else None
    _put(location, local_path, name, part)
    fs = location.filesystem()
    path = location._path(name)
    fs.invalidate_cache(path)
    info = location.call(f"checking {location.child(name)}", lambda: fs.info(path))
    damaged = (f"{location.child(name)}: the uploaded object does not match {local_path}: {{}}; the upload was "
               "damaged on the way, nothing was published: rerun with resume=True to upload it again")
    remote_size = int(info.get("size") or 0)
    if remote_size != size:
        raise RemoteStoreError(damaged.format(f"it holds {remote_size} bytes, the file {size}"))
    if s3 and part is not None and _etag_check_enabled():
        etag = str(info.get("ETag") or info.get("etag") or "").strip('"')
        want = expected_etag(local_path, part)
        if etag != want:
            raise RemoteStoreError(damaged.format(
                f"its ETag is {etag or 'missing'}, the file's MD5 gives {want} (a bucket with SSE-KMS/SSE-C "
                "encryption has non-MD5 ETags: set FASTDATA_UPLOAD_ETAG_CHECK=0 to check sizes only)"))
    remote_md5 = None if s3 or not _etag_check_enabled() else object_md5(info)
    if remote_md5 is not None:
        local_md5 = _file_md5(local_path)
        if remote_md5.hex() != local_md5:
            raise RemoteStoreError(damaged.format(f"its MD5 is {remote_md5.hex()}, the file's {local_md5}"))


def _staging_key(name: str) -> str:
    return f"{STAGING_DIR}/{name}"


def _is_store_object(name: str) -> bool:
    """Whether object ``name`` (relative to the store URL) is one a conversion writes."""
    top = name.split("/", 1)[0]
    return (top in (MANIFEST_NAME, REJECTED_NAME, STAGING_DIR, LOCK_NAME) or top.startswith("shard-")
            or is_store_index_name(top) or is_field_file_name(top) or ATOMIC_TMP_MARK in top)


def _is_run_record(name: str) -> bool:
    """Whether a local staging file is part of the run's record (plan.json, listing.npz),
    not a shard's sidecar or a temporary/spill file."""
    return not (name.startswith("shard-") or ATOMIC_TMP_MARK in name or name.endswith(TMP_SUFFIX)
                or name.startswith("spill"))


def _job() -> str:
    """What identifies this run in the lock object: the torchrun job (its ranks share it), else
    this process."""
    if os.environ.get("MASTER_PORT") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return ":".join(os.environ.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"))
    return f"{socket.gethostname()}:{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RemoteLock:
    """The advisory lock object ``URL/.fastdata.lock`` (see the module docstring)."""

    def __init__(self, location: RemoteLocation):
        self.location = location
        self.url = location.child(LOCK_NAME)
        #: (pid, host) of a dead or stale holder this run took over, for the report
        self.taken_over: tuple[int, str] | None = None

    def check(self) -> None:
        """Raise :class:`StoreLockedError` when a live run of another job holds the lock."""
        try:
            holder = json.loads(self.location.read_bytes(LOCK_NAME))
            pid, host, job, since = int(holder["pid"]), str(holder["host"]), str(holder["job"]), float(holder["time"])
        except FileNotFoundError:
            return
        except (ValueError, TypeError, KeyError):
            return  # unreadable: a lock object cut short; nothing to honour
        if job == _job():
            return
        age = time.time() - since
        dead_here = host == socket.gethostname() and not _pid_alive(pid)
        if age > LOCK_STALE_S or dead_here:
            self.taken_over = (pid, host)
            return
        raise StoreLockedError(
            f"{self.location.url} is being written by pid {pid} on {host} (its lock object {self.url} was "
            f"renewed {age:.0f} s ago); wait for that run to finish, or, if it is dead, delete {self.url} "
            f"(or wait {LOCK_STALE_S / 3600:g} hour after its last renewal) and rerun with resume=True")

    def write(self) -> None:
        """Take or renew the lock (one PUT of host, pid, job and time)."""
        body = {"host": socket.gethostname(), "pid": os.getpid(), "job": _job(), "time": time.time()}
        self.location.write_bytes(LOCK_NAME, json.dumps(body).encode())

    def release(self) -> None:
        """Delete the lock object (never raises: a lock left behind ages out)."""
        try:
            self.location.remove([LOCK_NAME])
        except Exception:  # noqa: BLE001 - releasing must not hide the run's own outcome
            pass


def check_destination(location: RemoteLocation, *, resume: bool, overwrite: bool, clear: bool,
                      append: bool = False) -> dict[str, int]:
    """Refuse a URL that holds a store (unless ``resume`` or ``overwrite``) or foreign objects;
    with ``overwrite`` and ``clear`` (rank 0 only under torchrun) delete the old store: the
    manifest first, so a run killed while clearing leaves an unfinished conversion, never a
    published store missing objects. Returns the objects left there (name -> size)."""
    what = location.url
    objects = location.listing()
    foreign = sorted(n for n in objects if not _is_store_object(n))
    if foreign:
        raise StoreExistsError(f"{what} holds objects that are not part of a fastdata store (e.g. {foreign[0]!r}); "
                               "refusing to write there: choose an empty or new prefix")
    published = MANIFEST_NAME in objects
    if append:
        if not published:
            raise StoreExistsError(f"{what}: no published fastdata store to append to" + (
                " (it holds an unfinished conversion: finish it with resume=True first)" if objects else ""))
        return objects
    if not (resume or overwrite) and set(objects) - {LOCK_NAME}:
        if published:
            raise StoreExistsError(f"{what} already holds a fastdata store; pass overwrite=True to "
                                   "replace it or choose another destination")
        raise StoreExistsError(f"{what} holds an unfinished conversion; pass resume=True to finish it "
                               "or overwrite=True to start again")
    if overwrite and clear and objects:
        if published:
            location.remove([MANIFEST_NAME])
        location.remove(sorted(n for n in objects if n != MANIFEST_NAME))
        return {}
    return objects


def remove_local(local: str, token: str | None = None) -> None:
    """Delete the local staging folder ``local`` of a conversion into a URL: only a real
    directory with the converter's marker (``token``: the one this run wrote), or an older
    fastdata's holding only a store's files (see :mod:`fastdata.writer.owned`); never a
    folder of the user's that the URL's name or ``staging_dir`` happens to point at."""
    if not check_dir(local):
        return
    raise_if_locked(local)
    remove_dir(local, token=token, legacy=_is_store_object, legacy_dirs={STAGING_DIR: staging_made})


def prepare_local(location: RemoteLocation, local: str, objects: dict[str, int], *, resume: bool,
                  append: bool = False) -> str:
    """Empty the local staging directory ``local`` (refusing while a live run holds its lock,
    and refusing one the converter did not make), then, for a resume, download what the local
    pipeline reads first: the manifest of a store already published, else the run's record
    (plan.json, listing.npz) from the remote staging. Returns the token of ``local``'s marker."""
    if check_dir(local):
        check_store_entries(local)
        remove_local(local)
    os.makedirs(os.path.dirname(local), exist_ok=True)
    token = make_dir(local)
    if append:
        _prepare_append(location, local, objects, resume)
        return token
    if not resume:
        return token
    make_dir(os.path.join(local, STAGING_DIR))
    if MANIFEST_NAME in objects:
        atomic_write(os.path.join(local, MANIFEST_NAME), location.read_bytes(MANIFEST_NAME))
        return token
    for key in objects:
        top, _, name = key.partition("/")
        if top == STAGING_DIR and name and "/" not in name and _is_run_record(name):
            atomic_write(os.path.join(local, STAGING_DIR, name), location.read_bytes(key))
    return token


def _prepare_append(location: RemoteLocation, local: str, objects: dict[str, int], resume: bool) -> None:
    """An append into a URL runs the local append against a copy of the store's metadata: the
    manifest and its store index file (the shards stay on the server). A resume also fetches the
    interrupted append's record; a new append first deletes what an interrupted one left (its
    remote staging objects and the shard objects the manifest does not list)."""
    from fastdata.format.manifest import parse_manifest
    from fastdata.format.store_index import index_file_name

    raw = location.read_bytes(MANIFEST_NAME)
    manifest = parse_manifest(raw, where=location.child(MANIFEST_NAME))
    index = index_file_name(manifest)
    atomic_write(os.path.join(local, index), location.read_bytes(index, limit=manifest["store_index"]["bytes"]))
    atomic_write(os.path.join(local, MANIFEST_NAME), raw)
    if resume:
        records = [k for k in objects if k.startswith(STAGING_DIR + "/") and "/" not in k[len(STAGING_DIR) + 1:]
                   and _is_run_record(k[len(STAGING_DIR) + 1:])]
        if records:
            make_dir(os.path.join(local, STAGING_DIR))
        for key in records:
            atomic_write(os.path.join(local, key), location.read_bytes(key))
        return
    listed = {s["name"] for s in manifest["shards"]}
    location.remove(sorted(k for k in objects if k.split("/", 1)[0] == STAGING_DIR
                           or (k.startswith("shard-") and k not in listed)
                           or (is_field_file_name(k) and field_file_shard(k) not in listed)))


class RemoteDestination:
    """The shard sink of a conversion into a URL (see the module docstring): uploads each
    finished shard in a background thread, checks it, deletes the local file, publishes last.

    Args:
        location (RemoteLocation): the store URL and its storage options.
        publisher (bool): this process publishes (rank 0 under torchrun, else True).
    """

    def __init__(self, location: RemoteLocation, publisher: bool = True, lock: RemoteLock | None = None):
        self.location = location
        self.publisher = publisher
        self.lock = lock
        self._pool: cf.ThreadPoolExecutor | None = None
        self._futures: list[cf.Future] = []
        self._room = threading.BoundedSemaphore(MAX_WAITING)
        self._error: BaseException | None = None

    # -- the pipeline's calls (fastdata.writer.pipeline.ShardSink)

    def start(self, dst: str) -> None:
        """Upload the run's record (plan.json, listing.npz) to the remote staging, before any
        shard, so that a resume of this run can compare its options and source."""
        staging = os.path.join(dst, STAGING_DIR)
        for name in sorted(os.listdir(staging)) if os.path.isdir(staging) else []:
            path = os.path.join(staging, name)
            if _is_run_record(name) and os.path.isfile(path):
                self.location.upload(path, _staging_key(name))

    def shard_finished(self, dst: str, result: Any) -> None:
        """Queue shard ``result.name`` for upload; blocks while :data:`MAX_WAITING` shards wait.
        Raises the error of an earlier upload, so a failed run stops converting."""
        self._raise_failure()
        self._room.acquire()
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastdata-upload")
        try:
            self._futures.append(self._pool.submit(self._upload_shard, dst, result.name))
        except BaseException:
            self._room.release()
            raise

    def drain(self) -> None:
        """Wait for every queued upload; raise the first failure."""
        for fut in self._futures:
            try:
                fut.result()
            except BaseException as err:  # noqa: BLE001 - kept, raised below
                self._error = self._error or err
        self._futures = []
        self._shutdown(wait=True)
        self._raise_failure()

    def abort(self) -> None:
        """Stop: queued uploads are cancelled; one in progress finishes in its thread."""
        self._shutdown(wait=False)

    def load_finished(self, dst: str, backend: str, plans: list) -> dict:
        """Shards of ``plans`` uploaded and checked by an earlier run (or by another rank):
        a result sidecar in the remote staging and an object of the size it records. Their
        sidecars are downloaded into ``dst``'s staging; stale local sidecars are deleted."""
        objects = self.location.listing()
        done: dict[int, ShardResult] = {}
        staging = os.path.join(dst, STAGING_DIR)
        if not check_dir(staging):
            make_dir(staging)
        for plan in plans:
            name = shard_name(backend, plan.shard_id)
            side_key, index_key = _staging_key(name + ".json"), _staging_key(name + SIDECAR_SUFFIX)
            local_side = os.path.join(staging, name + ".json")
            local_index = os.path.join(staging, name + SIDECAR_SUFFIX)
            if side_key in objects and index_key in objects and name in objects:
                try:
                    raw = self.location.read_bytes(side_key)
                    result = ShardResult(**json.loads(raw), resumed=True)
                except FileNotFoundError:
                    result = None
                except (ValueError, TypeError):
                    result = None
                if result is not None and objects[name] == result.bytes and result.name == name:
                    atomic_write(local_index, self.location.read_bytes(index_key))
                    atomic_write(local_side, raw)
                    done[plan.shard_id] = result
                    continue
            for stale in (local_side, local_index):
                remove_file(stale)
        return done

    def publish(self, dst: str) -> None:
        """Upload the field files written for the new shards (an append to a store with added
        fields), ``rejected.tsv``, ``index.fdi``, then ``manifest.json`` (last, each checked),
        then delete the remote staging objects."""
        if not self.publisher:
            return
        from fastdata.format.added import FIELD_FILES_KEY
        from fastdata.format.store_index import index_file_name

        with open(os.path.join(dst, MANIFEST_NAME), "rb") as fh:  # (the local one, just written)
            manifest = json.load(fh)
        index = index_file_name(manifest)  # index.fdi, or an appended version's index-NNNNN.fdi
        # (the store's earlier field files are on the server already; the new shards' are here)
        field_files = [e["name"] for s in manifest["shards"] for e in s.get(FIELD_FILES_KEY, [])
                       if os.path.isfile(os.path.join(dst, e["name"]))]
        for name in (*field_files, REJECTED_NAME, index, MANIFEST_NAME):
            upload_checked(self.location, os.path.join(dst, name), name)
        self.remove_staging()

    # -- helpers

    def remove_staging(self) -> None:
        """Delete the remote staging objects (a finished run's leftovers)."""
        objects = self.location.listing(STAGING_DIR)
        self.location.remove(sorted(objects))

    def _upload_shard(self, dst: str, name: str) -> None:
        try:
            if self._error is not None:
                return
            path = os.path.join(dst, name)
            upload_checked(self.location, path, name)
            staging = os.path.join(dst, STAGING_DIR)
            # the index first, the result last: the result's presence says the shard is complete
            for side in (name + SIDECAR_SUFFIX, name + ".json"):
                self.location.upload(os.path.join(staging, side), _staging_key(side))
            remove_file(path)
            if self.lock is not None:
                self.lock.write()  # renewed: a long run's lock never looks stale
        except BaseException as err:
            self._error = self._error or err
            raise
        finally:
            self._room.release()

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise self._error

    def _shutdown(self, wait: bool) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=wait, cancel_futures=True)
            self._pool = None


def write_to_url(url: str, storage_options: Mapping[str, Any] | None, staging_dir: str | os.PathLike | None, *,
                 resume: bool, overwrite: bool, run: Callable[[str, ShardSink], Any], rank: int | None = None,
                 append: bool = False) -> Any:
    """Run a conversion into ``url``: ``run(local_dir, sink)`` is the local conversion (called with
    ``overwrite`` off: the remote store is cleared here), which passes ``sink``, a
    :class:`RemoteDestination`, to the pipeline as its shard sink. Returns ``run``'s report with ``dst`` set to the URL.
    ``rank``: this process's rank in a torchrun job (rank 0 clears and publishes), None outside one.

    Raises:
        RemoteStoreError: the URL is read-only (``https://``), unreachable, or an upload failed
            its check. StoreExistsError: as for a local destination.
    """
    if resume and overwrite:
        raise ValueError("resume=True and overwrite=True are exclusive")
    check_url_path(url)
    location = RemoteLocation(url, storage_options or {})
    location._writable()
    local = local_staging_dir(location.url, staging_dir, rank)
    lock = RemoteLock(location)
    lock.check()  # a live writer is named before any other complaint (every rank sees the same)
    objects = check_destination(location, resume=resume, overwrite=overwrite, clear=not rank, append=append)
    token = prepare_local(location, local, objects, resume=resume, append=append)
    sink = RemoteDestination(location, publisher=not rank, lock=lock)
    try:
        if not rank:
            lock.write()
        report = run(local, sink)
    except FastdataError as err:
        _name_the_url(err, local, location.url)
        raise
    finally:
        if not rank:
            lock.release()
    if getattr(report, "already_complete", False) and not rank:
        sink.remove_staging()  # a run killed after publishing may have left them
    if lock.taken_over is not None:
        pid, host = lock.taken_over
        report.warnings.append(f"took over the lock object {lock.url} of pid {pid} on {host}, which is no longer "
                               "running (or stopped renewing it over an hour ago)")
    report.dst = location.url
    _remove_local(local, staging_dir, token)
    return report


def _name_the_url(err: Exception, local: str, url: str) -> None:
    """Say ``url`` where the message of ``err`` names the local staging folder as the store
    (e.g. "cannot resume <store>: ..."); paths of files inside it stay local (e.g. a full disk)."""
    if err.args and isinstance(err.args[0], str):
        err.args = (re.sub(re.escape(local) + r"(?![\w/.-])", url, err.args[0]), *err.args[1:])


def _remove_local(local: str, staging_dir: str | os.PathLike | None, token: str) -> None:
    """Delete a finished run's local staging folder (the one this run made: its marker holds
    ``token``) and the now empty folders made above it (``uploads/<key>/``, ``rank-<r>/``,
    removed with ``rmdir``, which only removes empty ones), never a ``staging_dir`` the caller gave."""
    try:
        remove_dir(local, token=token, ignore_errors=True)
    except FastdataError:
        return  # (swapped since the run made it: left alone)
    keep = os.path.abspath(staging_dir if staging_dir is not None else os.path.join(default_cache_dir(), "uploads"))
    parent = os.path.dirname(local)
    while parent != keep and parent.startswith(keep + os.sep):
        try:
            os.rmdir(parent)
        except OSError:  # not empty: another rank's or run's folder is still there
            return
        parent = os.path.dirname(parent)
