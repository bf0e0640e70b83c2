"""One home per OS facility: fastdata reaches the calls that only some systems have through
``fastdata/common/portable.py``, which picks a portable path beside each, so a new use elsewhere
cannot break Windows or macOS unseen (``os.pread`` in ``verify`` once did; only the Windows-like
proxy run caught it). A few guarded uses live where their facility is the point of the module;
they are listed here by file, and a new one must be added on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "fastdata"
HOME = ROOT / "common" / "portable.py"

#: ``os`` attributes that are missing on Windows or macOS (or both)
PLATFORM_ONLY = {"pread", "preadv", "pwrite", "pwritev", "copy_file_range", "sched_getaffinity",
                 "process_cpu_count", "posix_fadvise", "memfd_create", "register_at_fork", "O_NOFOLLOW",
                 "O_DIRECTORY", "getpgid", "killpg", "setsid", "sched_setaffinity"}
#: ``signal`` attributes that Windows lacks (it has SIGINT, SIGTERM, SIGABRT, SIGFPE, SIGILL, SIGSEGV,
#: SIGBREAK and the CTRL_* events)
SIGNAL_ONLY = {"SIGKILL", "SIGSTOP", "SIGCONT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGCHLD",
               "SIGPIPE", "SIGTSTP", "alarm", "setitimer", "getitimer", "pthread_kill", "pthread_sigmask",
               "sigwait", "sigtimedwait", "siginterrupt"}
#: module name -> its attributes that only some systems have
SCANNED = {"os": PLATFORM_ONLY, "signal": SIGNAL_ONLY}

#: guarded uses outside the home, by file: (attribute, why it stays here)
ALLOWED = {
    "format/backends/lmdb/reader.py": {"posix_fadvise", "register_at_fork"},  # read-ahead advice; a lock per fork
    "reader/batch_ring.py": {"memfd_create"},  # the batch ring is a memfd; pickling where there is none
    "bench/cache.py": {"posix_fadvise"},  # cold-cache eviction, refused with a message where missing
    "reader/seeding.py": {"register_at_fork"},
    "remote/cache.py": {"register_at_fork"},
    "remote/records.py": {"register_at_fork"},
}


def _uses(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.attr in SCANNED.get(node.value.id, ())):
            found.add(node.attr)
    return found


def test_platform_only_os_calls_go_through_the_portable_module():
    strays = {}
    for path in sorted(ROOT.rglob("*.py")):
        if path == HOME:
            continue
        rel = path.relative_to(ROOT).as_posix()
        extra = _uses(path) - ALLOWED.get(rel, set())
        if extra:
            strays[rel] = sorted(extra)
    assert not strays, f"use fastdata.common.portable instead (or list a guarded use in ALLOWED): {strays}"


def test_control_the_scan_sees_a_direct_call(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import os\n\ndef f(fd):\n    return os.pread(fd, 4, 0)\n")
    assert _uses(path) == {"pread"}


def test_control_the_scan_sees_a_signal_that_windows_lacks(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import os, signal\n\n"
                    "def f(pid):\n    os.kill(pid, signal.SIGKILL)\n    os.kill(pid, signal.SIGTERM)\n")
    assert _uses(path) == {"SIGKILL"}


def test_the_allowlist_has_no_stale_entries():
    for rel, names in ALLOWED.items():
        assert names <= _uses(ROOT / rel), f"{rel}: no longer uses {sorted(names - _uses(ROOT / rel))}"
