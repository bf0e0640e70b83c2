"""A bounded local cache of remote shards, shared by every process on the machine.

LMDB and HDF5 map local files, so a remote shard is downloaded whole before it is
read. The cache directory is shared by DataLoader workers, ranks and separate jobs;
it is coordinated only through ``flock`` locks, which the kernel releases when a
process dies (SIGKILL included), so nothing a dead process held stays held::

    CACHE_DIR/
      .space.lock                 held while a process reserves room (accounting, eviction)
      <store key>/                one per store *version*: sha1(url)[:16] + "-" + manifest checksum
        store.json                url and manifest checksum (for ``fastdata cache``)
        manifest.json, index.fdi  the store's metadata, as downloaded and checked
        shards/shard-00000.lmdb   finished downloads, verified against the manifest checksum
        shards/<name>.part-<pid>  a download in progress (preallocated to its full size)
        locks/<name>.lock         held (exclusive) by the one process downloading <name>
        pins/<name>.pin           held (shared) by every process that has <name> open

Where the OS has no shared locks (Windows: ``msvcrt`` locks are exclusive) a pin is an open
handle on the shard file itself instead (:data:`PIN_BY_HANDLE`): that OS refuses to delete an
open file, so eviction, which deletes, skips the shard for as long as any process holds it.

Rules (docs/RELIABILITY.md, "Remote stores"):

* A shard is renamed into ``shards/`` only after its size and xxh3-64 checksum match the
  manifest; a ``.part`` file is never read, and one left by a dead process is deleted by
  the next process that takes that shard's download lock.
* One process downloads a shard; the others block on its download lock, then use it.
* Eviction removes the least recently used shards, and only those whose pin file it
  can lock exclusively (or, pinned by handle, that the OS lets it delete): a shard a live
  process has open is never removed. A download pins its shard before renaming it into place
  (by handle: renames and opens it while holding ``.space.lock``, which eviction takes), so it
  is never evicted before its first reader.
* A forked child closes its copies of every lock and pin file this module has open
  (a flock belongs to the open file, which fork shares), so it never holds its
  parent's locks.
* The key includes the manifest checksum: a store rewritten remotely gets a new key, so
  shards of the old version are never served for it (they age out by LRU).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from fastdata.common import portable
from fastdata.common.fileio import atomic_write, fsync_dir
from fastdata.common.units import format_size, parse_size
from fastdata.errors import CacheFullError, CorruptRecordError, RemoteStoreError


SPACE_LOCK = ".space.lock"
SHARDS, LOCKS, PINS = "shards", "locks", "pins"
PART_MARK = ".part-"
STORE_INFO = "store.json"
#: how long a download waits for pinned shards to be released before CacheFullError
#: (``$FASTDATA_CACHE_WAIT_S`` overrides it)
DEFAULT_WAIT_S = 120.0
#: attempts at a download whose bytes do not match the manifest checksum
CHECKSUM_ATTEMPTS = 3


def default_cache_dir() -> str:
    """``$FASTDATA_CACHE_DIR``, else ``$XDG_CACHE_HOME/fastdata``, else ``~/.cache/fastdata``."""
    env = os.environ.get("FASTDATA_CACHE_DIR")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fastdata")


def resolve_limit(limit: int | str | None) -> int | None:
    """``cache_limit`` as bytes: an int, a size string ("50GiB", "2g"), or None (no limit)."""
    if limit is None or limit == "":
        env = os.environ.get("FASTDATA_CACHE_LIMIT")
        return resolve_limit(env) if env else None
    if isinstance(limit, int):
        if limit <= 0:
            raise ValueError(f"cache_limit must be positive, got {limit}")
        return limit
    return int(parse_size(str(limit)))


def store_key(url: str, manifest_checksum: str) -> str:
    """Cache directory name of one version of the store at ``url``."""
    return f"{hashlib.sha1(url.encode()).hexdigest()[:16]}-{manifest_checksum[:16]}"


# Every lock and pin file this process has open. A flock lock belongs to the open file, which
# fork shares: a child forked while a thread holds one (a prefetch downloading while a
# DataLoader starts its workers) would hold it for its whole life, and with it a download
# lock, the space lock or a pin. The child closes its copies as it starts (the parent's
# locks stay held). Every such fd is opened and closed through these two functions.
#: pins are open handles on the shard files where the locks are msvcrt's (Windows: exclusive only,
#: and an open file cannot be deleted there); see the module docstring
PIN_BY_HANDLE = portable.LOCKING == "msvcrt"
_LOCK_FDS: set[int] = set()
_LOCK_FDS_GUARD = threading.Lock()


def _open_lock_fd(path: str, flags: int = os.O_RDWR | os.O_CREAT) -> int:
    with _LOCK_FDS_GUARD:
        fd = os.open(path, flags | portable.OPEN_FLAGS, 0o644)
        _LOCK_FDS.add(fd)
    return fd


def _close_lock_fd(fd: int) -> None:
    """Close a lock or pin fd (which releases its lock)."""
    with _LOCK_FDS_GUARD:
        _LOCK_FDS.discard(fd)
        os.close(fd)


def _close_inherited_lock_fds() -> None:
    for fd in _LOCK_FDS:
        try:
            os.close(fd)
        except OSError:
            pass
    _LOCK_FDS.clear()
    _LOCK_FDS_GUARD.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_LOCK_FDS_GUARD.acquire, after_in_parent=_LOCK_FDS_GUARD.release,
                        after_in_child=_close_inherited_lock_fds)


@contextmanager
def _flocked(path: str) -> Iterator[int]:
    """``path`` locked exclusively (waiting for it) while the block runs."""
    fd = _open_lock_fd(path)
    try:
        portable.lock(fd, wait=True)
        yield fd
    finally:
        _close_lock_fd(fd)  # closing releases the lock


def _open_lock_file(path: str) -> int:
    """Open (creating) a lock or pin file; its folder too, if ``fastdata cache clear`` removed it."""
    try:
        return _open_lock_fd(path)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return _open_lock_fd(path)


def _try_exclusive(path: str) -> int | None:
    """An fd holding ``path`` locked exclusively (close it with :func:`_close_lock_fd`), or None
    when another process holds it."""
    try:
        fd = _open_lock_fd(path)
    except OSError:
        return None
    try:
        if portable.lock(fd):
            return fd
    except OSError:
        pass
    _close_lock_fd(fd)
    return None


class Pin:
    """A shard held open in the cache: while it lives (and its process lives), eviction skips
    the shard. :meth:`release` (or garbage collection, or process death) lets it go."""

    def __init__(self, path: str, fd: int):
        self.path = path
        self._fd: int | None = fd
        self._pid = os.getpid()

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None and self._pid == os.getpid():
            _close_lock_fd(fd)

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


@dataclass
class CachedShard:
    """A finished shard file in the cache (for eviction and ``fastdata cache``)."""

    key: str
    name: str
    path: str
    size: int
    last_use: float


class ShardCache:
    """The cache at ``root``, kept under ``limit`` bytes (None: unbounded).

    Args:
        root: cache directory (created on first use).
        limit: the most bytes of shards it holds, downloads in progress included (at their
            full size from their start); a download that finds every cached shard pinned
            for ``wait_s`` raises :class:`CacheFullError` instead of exceeding it.
        wait_s: how long a download waits for pinned shards to be released (default
            ``$FASTDATA_CACHE_WAIT_S``, else 120 s).
    """

    def __init__(self, root: str | None = None, limit: int | str | None = None, wait_s: float | None = None):
        if portable.LOCKING == "none":  # no lock at all: processes sharing the cache could not coordinate
            raise RemoteStoreError("the remote shard cache needs file locks (fcntl's flock, or msvcrt on Windows), "
                                   "which this platform lacks: copy the store to a local disk and open it there")
        self.root = os.path.abspath(root or default_cache_dir())
        self.limit = resolve_limit(limit)
        self.wait_s = float(os.environ.get("FASTDATA_CACHE_WAIT_S", DEFAULT_WAIT_S)) if wait_s is None else wait_s

    # -- paths --------------------------------------------------------------------------
    def store_dir(self, key: str) -> str:
        return os.path.join(self.root, key)

    def _paths(self, key: str, name: str) -> tuple[str, str, str]:
        d = self.store_dir(key)
        return (os.path.join(d, SHARDS, name), os.path.join(d, LOCKS, name + ".lock"),
                os.path.join(d, PINS, name + ".pin"))

    def prepare_store(self, key: str, url: str, manifest_checksum: str) -> str:
        """Create ``key``'s directory (and its ``store.json``); returns it."""
        d = self.store_dir(key)
        try:
            for sub in (SHARDS, LOCKS, PINS):
                os.makedirs(os.path.join(d, sub), exist_ok=True)
            info = os.path.join(d, STORE_INFO)
            if not os.path.exists(info):
                atomic_write(info, json.dumps({"url": url, "manifest_checksum": manifest_checksum}).encode())
        except OSError as err:
            raise self._os_error(err, d) from None
        return d

    # -- the one public operation readers need ------------------------------------------
    def acquire(self, key: str, name: str, *, size: int, xxh: str, download: Callable[[str], str],
                wait: bool = True, keep: Collection[str] = (), on_wait: Callable[[], None] | None = None,
                ) -> Pin | None:
        """Pin shard ``name`` of store ``key``, downloading it first if it is not cached.

        ``download(part_path)`` writes the shard into ``part_path`` and returns the xxh3-64
        hex digest of what it wrote; it must raise on a network failure. The shard is used
        only when that digest and the file size match ``size``/``xxh`` (the manifest's).

        ``wait=False`` (prefetch) returns None instead of waiting for room or for another
        process's download. ``keep``: shard names of store ``key`` that making room must not
        evict (a prefetch keeps the windows about to be read). ``on_wait`` is called once
        before waiting for room, so the caller can release pins it holds but no longer needs.
        Raises :class:`CacheFullError`, :class:`CorruptRecordError`
        (the remote bytes never matched the manifest) and :class:`RemoteStoreError`.
        """
        final, lock_path, pin_path = self._paths(key, name)
        pin = self._pin(pin_path, final, size)
        if pin is not None:
            return pin
        try:
            fd = _open_lock_file(lock_path)
            os.makedirs(os.path.dirname(final), exist_ok=True)
        except OSError as err:
            raise self._os_error(err, lock_path) from None
        try:
            if not self._lock_download(fd, wait, on_wait):
                return None  # another process is downloading it
            pin = self._pin(pin_path, final, size)  # it may have finished while we waited
            if pin is not None:
                return pin
            self._remove_parts(final)
            part = f"{final}{PART_MARK}{os.getpid()}"
            if not self._reserve(part, size, wait, (key, frozenset(keep)), on_wait):
                return None
            # pinned before it is renamed into place: another process making room never
            # evicts a shard between its arrival and its first reader
            pin_fd = None if PIN_BY_HANDLE else self._hold_pin(pin_path)
            try:
                self._download_checked(part, size, xxh, download, os.path.basename(final))
                if PIN_BY_HANDLE:  # renamed and opened while no other process can be making room
                    with _flocked(os.path.join(self._ensure_root(), SPACE_LOCK)):
                        os.replace(part, final)
                        pin_fd = _open_lock_fd(final, os.O_RDONLY)
                else:
                    os.replace(part, final)
                fsync_dir(os.path.dirname(final))
            except BaseException:
                if pin_fd is not None:
                    _close_lock_fd(pin_fd)
                _unlink(part)
                raise
        finally:
            _close_lock_fd(fd)
        assert pin_fd is not None
        return Pin(final, pin_fd)

    def _lock_download(self, fd: int, wait: bool, on_wait: Callable[[], None] | None) -> bool:
        """Take the download lock ``fd``; False when another process holds it and not ``wait``.

        Under a limit, ``on_wait`` runs before blocking behind another process's download: that
        download may need the room of this process's idle pins, and would wait for them while
        this process waits for it (two DataLoader workers reading the same shards in turn)."""
        if portable.lock(fd):
            return True
        if not wait:
            return False
        if on_wait is not None and self.limit is not None:
            on_wait()
        return portable.lock(fd, wait=True)

    def _hold_pin(self, pin_path: str) -> int:
        """An fd holding a shared lock on ``pin_path`` (while it is open, eviction skips the shard)."""
        try:
            fd = _open_lock_file(pin_path)
        except OSError as err:
            raise self._os_error(err, pin_path) from None
        portable.lock(fd, shared=True, wait=True)  # waits while an evictor holds it exclusively
        return fd

    def _pin(self, pin_path: str, final: str, size: int) -> Pin | None:
        """Take a shared lock on the pin file, then check the shard is (still) in place (pinned by
        handle: open the shard, which keeps it in place)."""
        if PIN_BY_HANDLE:
            try:
                fd = _open_lock_fd(final, os.O_RDONLY)
            except FileNotFoundError:
                return None
            except OSError as err:
                raise self._os_error(err, final) from None
            st = os.fstat(fd)
        else:
            fd = self._hold_pin(pin_path)
            try:
                st = os.stat(final)
            except FileNotFoundError:
                _close_lock_fd(fd)
                return None
        if st.st_size != size:  # cannot happen unless someone edits the cache by hand
            _close_lock_fd(fd)
            _delete_unless_open(final)
            return None
        try:
            os.utime(final)  # last use, for LRU
        except OSError:
            pass
        return Pin(final, fd)

    def _download_checked(self, part: str, size: int, xxh: str, download: Callable[[str], str], name: str) -> None:
        """Download shard ``name`` into ``part`` until its size and checksum are the manifest's."""
        for attempt in range(1, CHECKSUM_ATTEMPTS + 1):
            try:
                got = download(part)
            except OSError as err:
                if err.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise CacheFullError(f"{self.root}: the disk is full while downloading {name} "
                                         f"({err.strerror}); free space or choose another cache_dir") from None
                raise
            if os.path.getsize(part) == size and got == xxh:
                return
            if attempt == CHECKSUM_ATTEMPTS:
                raise CorruptRecordError(
                    f"remote shard {name}: {CHECKSUM_ATTEMPTS} downloads did not match the manifest's checksum "
                    f"(got {got}, expected {xxh}): the remote copy is damaged (rewrite the store), or the store "
                    "was rewritten after this dataset opened it (open it again)",
                    shard=name)

    def _remove_parts(self, final: str) -> None:
        """Delete ``.part`` files of ``final`` (the caller holds its download lock, so any
        such file belongs to a download that died)."""
        d, base = os.path.split(final)
        for entry in os.listdir(d):
            if entry.startswith(base + PART_MARK):
                _unlink(os.path.join(d, entry))

    # -- room ---------------------------------------------------------------------------
    def _reserve(self, part: str, size: int, wait: bool, keep: tuple[str, frozenset[str]] = ("", frozenset()),
                 on_wait: Callable[[], None] | None = None) -> bool:
        """Make room for ``size`` bytes and preallocate ``part`` (so every process counts it)."""
        deadline = time.monotonic() + self.wait_s
        while True:
            with _flocked(os.path.join(self._ensure_root(), SPACE_LOCK)):
                if self.limit is None or self._make_room(size, keep):
                    self._preallocate(part, size)
                    return True
            if not wait:
                return False
            if on_wait is not None:
                on_wait()
                on_wait = None
                continue
            if time.monotonic() > deadline:
                raise CacheFullError(
                    f"{self.root}: cannot make room for a {format_size(size)} shard under cache_limit "
                    f"{format_size(self.limit or 0)}: every cached shard is in use by a live process; raise "
                    "cache_limit, or read fewer shards at once (fewer workers, a smaller shard window)")
            time.sleep(0.2)

    def _preallocate(self, part: str, size: int) -> None:
        try:
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                if size:
                    os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
        except OSError as err:
            _unlink(part)
            raise self._os_error(err, part) from None

    def _make_room(self, size: int, keep: tuple[str, frozenset[str]] = ("", frozenset())) -> bool:
        assert self.limit is not None
        used = self.used_bytes()
        if used + size <= self.limit:
            return True
        for shard in sorted(self.shards(), key=lambda s: s.last_use):
            if shard.key == keep[0] and shard.name in keep[1]:
                continue
            if self._evict(shard):
                used -= shard.size
                if used + size <= self.limit:
                    return True
        return False

    def _evict(self, shard: CachedShard) -> bool:
        if PIN_BY_HANDLE:
            return _delete_unless_open(shard.path)
        _, _, pin_path = self._paths(shard.key, shard.name)
        fd = _try_exclusive(pin_path)
        if fd is None:
            return False  # a live process has it open
        try:
            _unlink(shard.path)
        finally:
            _close_lock_fd(fd)
        return True

    # -- inventory ----------------------------------------------------------------------
    def store_keys(self) -> list[str]:
        try:
            # dot-folders are not stores (``verify`` downloads into one while it checks a shard)
            return sorted(e for e in os.listdir(self.root)
                          if not e.startswith(".") and os.path.isdir(os.path.join(self.root, e)))
        except FileNotFoundError:
            return []

    def _scan(self, key: str | None = None) -> Iterator[tuple[str, os.DirEntry, os.stat_result]]:
        """``(store key, entry, stat)`` of every file in the ``shards/`` folders (of ``key``, or all),
        skipping files that vanish meanwhile (another process evicting them)."""
        for k in [key] if key else self.store_keys():
            try:
                entries = list(os.scandir(os.path.join(self.root, k, SHARDS)))
            except FileNotFoundError:
                continue
            for e in entries:
                try:
                    yield k, e, e.stat()
                except FileNotFoundError:
                    continue

    def shards(self, key: str | None = None) -> list[CachedShard]:
        """Finished shards in the cache (of store ``key``, or of every store)."""
        return [CachedShard(k, e.name, e.path, st.st_size, st.st_mtime) for k, e, st in self._scan(key)
                if PART_MARK not in e.name]

    def used_bytes(self) -> int:
        """Bytes of finished shards plus downloads in progress (preallocated at full size); the
        ``.part`` files of dead downloads are deleted on the way (their lock is free)."""
        return sum(st.st_size for k, e, st in self._scan()
                   if not (PART_MARK in e.name and self._dead_part(k, e.name)))

    def _dead_part(self, key: str, entry: str) -> bool:
        name = entry.split(PART_MARK, 1)[0]
        _, lock_path, _ = self._paths(key, name)
        fd = _try_exclusive(lock_path)
        if fd is None:
            return False
        try:
            _unlink(os.path.join(self.root, key, SHARDS, entry))
        finally:
            _close_lock_fd(fd)
        return True

    def clear(self, key: str | None = None) -> tuple[int, int]:
        """Delete unpinned shards (of ``key``, or all); returns (shards removed, shards kept because in use).
        A store directory left with no shards is removed."""
        removed = kept = 0
        with _flocked(os.path.join(self._ensure_root(), SPACE_LOCK)):
            for shard in self.shards(key):
                if self._evict(shard):
                    removed += 1
                else:
                    kept += 1
            for k in [key] if key else self.store_keys():
                if not self.shards(k):
                    _remove_tree_if_unlocked(self.store_dir(k))
        return removed, kept

    def _ensure_root(self) -> str:
        os.makedirs(self.root, exist_ok=True)
        return self.root

    def _os_error(self, err: OSError, path: str) -> Exception:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            return CacheFullError(f"{self.root}: the disk holding the cache is full ({path}: {err.strerror}); "
                                  "free space, lower cache_limit or choose another cache_dir")
        return RemoteStoreError(f"cache directory {self.root}: cannot write {path}: {err.strerror or err}; "
                                "choose a writable cache_dir (or set FASTDATA_CACHE_DIR)")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _delete_unless_open(path: str) -> bool:
    """Delete ``path`` unless the OS refuses because a handle holds it open (Windows: the pin of
    a process reading it); True when it is gone."""
    return portable.remove_unless_held(_unlink, path)


def _remove_tree_if_unlocked(d: str) -> None:
    """Remove a store's cache directory unless a process still holds one of its locks."""
    held: list[int] = []
    try:
        for sub in (LOCKS, PINS):
            for entry in os.listdir(os.path.join(d, sub)):
                fd = _try_exclusive(os.path.join(d, sub, entry))
                if fd is None:
                    return  # (the locks taken so far are closed below, once)
                held.append(fd)
        import shutil
        shutil.rmtree(d, ignore_errors=True)
    except FileNotFoundError:
        pass
    finally:
        for h in held:
            try:
                _close_lock_fd(h)
            except OSError:
                pass
