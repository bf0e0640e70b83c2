"""What this system lacks of the operating-system facilities fastdata uses, and what that costs.

fastdata chooses each facility's path once, by whether the facility exists
(:mod:`fastdata.common.portable`); this module lists them for ``fastdata doctor`` and the docs'
support matrix: present or missing, what fastdata uses it for, and what happens without it.
"""

from __future__ import annotations

import multiprocessing
import os
import platform
import sys
from dataclasses import dataclass

from fastdata.common import portable

__all__ = ["Facility", "facilities", "platform_report"]


@dataclass(frozen=True)
class Facility:
    """One operating-system facility fastdata uses where it exists."""

    #: what it is, e.g. ``"os.memfd_create"``
    name: str
    #: whether this system has it
    present: bool
    #: what fastdata does with it
    used_for: str
    #: what happens where it is missing (correct, but slower or without a feature)
    without: str


def facilities() -> list[Facility]:
    """Every facility fastdata's Linux path uses, with whether this system has it.

    Returns:
        list[Facility]: in a fixed order, present or not.
    """
    methods = multiprocessing.get_all_start_methods()
    return [
        Facility("fork start method", "fork" in methods,
                 "converter and DataLoader workers start as copies of the parent process",
                 "workers start by spawn: each is a new interpreter (seconds to start) that receives the "
                 "dataset pickled; a script that converts with workers > 0 needs "
                 "`if __name__ == \"__main__\":`"),
        Facility("os.memfd_create", hasattr(os, "memfd_create"),
                 "a ring of shared memory that DataLoader workers decode batches into, mapped once",
                 "batches travel from workers pickled (correct; slower for small fixed-size batches)"),
        Facility("os.posix_fadvise", hasattr(os, "posix_fadvise"),
                 "read-ahead advice for shard reads; cold-cache benchmarks (`cold=True`) evict the page cache "
                 "without root",
                 "no read-ahead advice (cold reads are slower); cold-cache benchmarks (`cold=True`) are unavailable"),
        Facility("os.pread", portable.HAS_PREAD,
                 "reads at an offset in one call, from any number of threads at once",
                 "a seek then a read, one at a time per process"),
        Facility("os.copy_file_range", hasattr(os, "copy_file_range"),
                 "the HDF5 writer copies a shard's payload inside the kernel",
                 "the payload is copied through user space (slower)"),
        Facility("os.sched_getaffinity", hasattr(os, "sched_getaffinity"),
                 "the default number of loader workers: the cores this process may use (containers, taskset)",
                 "psutil's CPU affinity where it has one (Windows), else every core of the machine (macOS)"),
        Facility("/proc", _proc_readable(),
                 "PSS memory figures of bench and tune; the LMDB writer's read-ahead span tables",
                 "memory figures are USS and RSS from psutil (no PSS); LMDB stores are written without "
                 "span tables (only Linux readers use them)"),
        Facility("fcntl.flock", portable.LOCKING == "flock",
                 "the store lock of a conversion, and the shared locks of the remote stores' shard cache",
                 "the store lock uses msvcrt (a dead holder's lock is still released by the OS); the remote "
                 "stores' shard cache pins a shard by holding it open, which the OS keeps from deletion"),
    ]


def _proc_readable() -> bool:
    """Whether this process can read its own ``/proc`` entries (Linux's procfs)."""
    try:
        with open("/proc/self/statm", "rb") as fh:
            return bool(fh.read(64))
    except OSError:
        return False


def platform_report() -> str:
    """The system, Python, start methods, and each facility present or missing (with its cost).

    Returns:
        str: lines for a terminal.
    """
    lines = [f"platform: {platform.system() or sys.platform} {platform.machine()}, Python "
             f"{platform.python_version()}, start methods {', '.join(multiprocessing.get_all_start_methods())}"]
    found = facilities()
    missing = [f for f in found if not f.present]
    lines.append(f"  {len(found) - len(missing)} of {len(found)} facilities present"
                 + ("" if missing else ": everything fastdata uses"))
    for f in missing:
        lines.append(f"  missing {f.name}: {f.without}")
    return "\n".join(lines)
