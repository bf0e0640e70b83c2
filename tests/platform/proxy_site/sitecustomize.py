"""A proxy of macOS or Windows on Linux: removes, before anything else is imported, what
that system lacks, so that fastdata's portable paths run here. Python imports this module
at start-up when its folder is on PYTHONPATH; ``FASTDATA_PROXY_SYSTEM`` picks the system
(``macos`` or ``windows``; unset: nothing changes). Every process started from the proxy
(spawned DataLoader and converter workers, ``python -m fastdata`` subprocesses) inherits
both variables, so it is a proxy too.

macos: no ``os.memfd_create``, ``os.posix_fadvise``, ``os.sched_getaffinity``,
``os.copy_file_range``, ``os.fdatasync``, and no ``/proc`` for fastdata's own reads (libraries
such as psutil keep theirs: on macOS they use the system's own calls instead).

windows: the same, plus no ``fcntl`` or ``resource`` module, no ``os.pread``/``os.preadv``/
``os.pwrite``, no ``O_NOFOLLOW``/``O_NONBLOCK``/``O_CLOEXEC``/``O_DIRECTORY`` or
``os.set_blocking`` (Python 3.11 has it for pipes only there); fastdata's ``os.open`` of a
directory fails (``PermissionError``), its ``os.fsync`` of a read-only descriptor too
(``EBADF``), and its removes and renames of a file a process of this session has open or mapped
(``PermissionError`` with ``winerror`` 32, a sharing violation), as there; and only the spawn
start method (``os.fork`` and ``os.register_at_fork`` stay:
torch registers an at-fork hook at import everywhere but on ``sys.platform == "win32"``). Windows
has ``msvcrt`` (byte-range locks the OS drops with their holder); Linux does not, so the
proxy provides ``msvcrt.locking`` over ``flock`` (one exclusive lock per open file, as
Windows keeps one per handle), captured before ``fcntl`` is hidden.
"""

from __future__ import annotations

import builtins
import errno
import os
import sys
import types

SYSTEM = os.environ.get("FASTDATA_PROXY_SYSTEM", "")

#: what each proxy removes from os, for the test's report
_MACOS = ("memfd_create", "posix_fadvise", "sched_getaffinity", "copy_file_range", "fdatasync")
REMOVED_OS = {
    "macos": _MACOS,
    "windows": (*_MACOS, "pread", "preadv", "pwrite", "pwritev", "O_NOFOLLOW", "O_NONBLOCK", "O_CLOEXEC",
                "O_DIRECTORY", "set_blocking"),
}


def _from_fastdata() -> bool:
    """Whether the call being checked was made by fastdata's own code (two frames up: the
    caller of the patched function)."""
    frame = sys._getframe(2)
    return str(frame.f_globals.get("__name__", "")).startswith("fastdata")


def _is_proc(path) -> bool:
    if isinstance(path, int):
        return False
    try:
        text = os.fsdecode(path)
    except TypeError:
        return False
    return text == "/proc" or text.startswith("/proc/")


_REAL_LISTDIR, _REAL_OPEN = os.listdir, builtins.open


def _hide_proc(no_directory_fds: bool) -> None:
    """fastdata's reads of /proc fail as they would where there is none; with
    ``no_directory_fds`` (Windows), so does its ``os.open`` of a directory."""

    def guard(original):
        def patched(path, *args, **kwargs):
            if _is_proc(path) and _from_fastdata():
                raise FileNotFoundError(errno.ENOENT, f"no /proc on the {SYSTEM} proxy", os.fsdecode(path))
            if (no_directory_fds and original is real_open and not isinstance(path, int) and os.path.isdir(path)
                    and _from_fastdata()):
                raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(path))
            return original(path, *args, **kwargs)

        patched.__wrapped__ = original  # type: ignore[attr-defined]
        return patched

    real_open = os.open
    builtins.open = guard(builtins.open)
    os.open = guard(os.open)
    os.listdir = guard(os.listdir)
    os.scandir = guard(os.scandir)


def _stand_in_msvcrt(flock, lock_ex: int, lock_nb: int, lock_un: int) -> types.ModuleType:
    module = types.ModuleType("msvcrt", "stand-in for Windows' msvcrt (locking only), over flock")
    module.LK_UNLCK, module.LK_LOCK, module.LK_NBLCK, module.LK_RLCK, module.LK_NBRLCK = 0, 1, 2, 3, 4

    def locking(fd: int, mode: int, nbytes: int) -> None:
        if mode == module.LK_UNLCK:
            flock(fd, lock_un)
            return
        try:
            flock(fd, lock_ex | (lock_nb if mode in (module.LK_NBLCK, module.LK_NBRLCK) else 0))
        except BlockingIOError:
            # what msvcrt.locking raises for a range another handle holds
            raise PermissionError(errno.EACCES, "Permission denied") from None

    module.locking = locking
    return module


def _fsync_needs_write_access(fcntl) -> None:
    """fastdata's ``os.fsync`` of a descriptor open read-only fails as on Windows (whose
    FlushFileBuffers needs write access): ``EBADF``."""
    real_fsync = os.fsync

    def fsync(fd):
        number = fd if isinstance(fd, int) else fd.fileno()
        if fcntl.fcntl(number, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY and _from_fastdata():
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real_fsync(fd)

    os.fsync = fsync


def _session_pids() -> list[str]:
    """The processes of this process's session (the test run that started the proxy, its workers and
    its subprocesses): Windows refuses to delete a file any process holds open; the proxy looks at
    those that take part in the run (every other process's paths are elsewhere)."""
    sid, pids = os.getsid(0), []
    for pid in _REAL_LISTDIR("/proc"):
        if not pid.isdigit():
            continue
        try:
            with _REAL_OPEN(f"/proc/{pid}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 3 and int(fields[3]) == sid:  # the session id: field 6 of stat (4th after the name)
            pids.append(pid)
    return pids


def _in_use(path) -> bool:
    """Whether a process of this session has ``path`` (or a file under it) open or mapped (read in
    /proc: the proxy's own reads, not fastdata's)."""
    try:
        real = os.path.realpath(os.fsdecode(path))
    except (TypeError, ValueError):
        return False
    inside = real.rstrip("/") + "/"
    targets = []
    for pid in _session_pids():
        try:
            names = _REAL_LISTDIR(f"/proc/{pid}/fd")
        except OSError:  # gone, or not ours to read
            continue
        for name in names:
            try:
                targets.append(os.readlink(f"/proc/{pid}/fd/{name}"))
            except OSError:  # closed meanwhile (the listing's own descriptor)
                pass
        try:
            with _REAL_OPEN(f"/proc/{pid}/maps") as maps:
                targets += [parts[5].rstrip("\n") for parts in (line.split(maxsplit=5) for line in maps)
                            if len(parts) == 6]
        except OSError:
            continue
    return any(t == real or t.startswith(inside) for t in targets)


def _open_files_stay() -> None:
    """fastdata's removes and renames of a file this process has open or mapped (or of a folder
    holding one) fail as on Windows, where an open file cannot be deleted or renamed."""
    import shutil

    def refuse_in_use(original, paths: int):
        def patched(*args, **kwargs):
            if _from_fastdata() and any(_in_use(p) for p in args[:paths]):
                err = PermissionError(errno.EACCES, "The process cannot access the file because it is being used "
                                      "by another process", os.fsdecode(args[0]))
                err.winerror = 32  # ERROR_SHARING_VIOLATION, as Windows sets it  # type: ignore[attr-defined]
                raise err
            return original(*args, **kwargs)

        return patched

    for module, name, paths in ((os, "unlink", 1), (os, "remove", 1), (os, "rmdir", 1), (os, "replace", 2),
                                (os, "rename", 2), (shutil, "rmtree", 1)):
        setattr(module, name, refuse_in_use(getattr(module, name), paths))


def _spawn_only() -> None:
    import multiprocessing
    import multiprocessing.context as context

    for method in ("fork", "forkserver"):
        context._concrete_contexts.pop(method, None)
    spawn = context._concrete_contexts["spawn"]
    context._default_context._actual_context = spawn
    context.DefaultContext.get_all_start_methods = lambda self: ["spawn"]
    multiprocessing.get_all_start_methods = lambda: ["spawn"]


def install(system: str) -> None:
    for name in REMOVED_OS[system]:
        if hasattr(os, name):
            delattr(os, name)
    if "sched_getaffinity" in REMOVED_OS[system] and hasattr(os, "process_cpu_count"):
        # Python 3.13's os.process_cpu_count calls the sched_getaffinity it found when os was
        # imported; where that is missing (macOS, Windows) it is os.cpu_count, as here
        os.process_cpu_count = os.cpu_count
    _hide_proc(no_directory_fds=system == "windows")
    import multiprocessing

    # spawn: the default on both systems (macOS keeps fork and forkserver beside it)
    multiprocessing.set_start_method("spawn", force=True)
    if system == "windows":
        import fcntl
        import subprocess  # noqa: F401  # before msvcrt appears: subprocess takes its presence for Windows

        import psutil  # noqa: F401  # before resource goes: psutil's Linux build imports it (its Windows one does not)

        sys.modules["msvcrt"] = _stand_in_msvcrt(fcntl.flock, fcntl.LOCK_EX, fcntl.LOCK_NB, fcntl.LOCK_UN)
        _fsync_needs_write_access(fcntl)
        _open_files_stay()
        for module in ("fcntl", "resource"):
            sys.modules[module] = None  # type: ignore[assignment]  # import fails: ModuleNotFoundError
        _spawn_only()


if SYSTEM:
    install(SYSTEM)
