"""Environment traps that break multi-worker loading, detected before measuring.

* A small ``/dev/shm``: DataLoader workers hand batches to the main process through
  shared memory; Docker's default is 64 MB, and a worker then dies with "bus error"
  or "unable to write to file </torch_...>" once ``workers x prefetch_factor``
  batches no longer fit.
* A low open-files limit (``ulimit -n``): with torch's default ``file_descriptor``
  sharing strategy every shared tensor in flight holds a descriptor, so many
  workers with deep prefetch hit "received 0 items of ancdata" / "Too many open files".
"""

from __future__ import annotations

import os

from fastdata.common.units import format_size

#: below this, warn about ulimit -n even for few workers
MIN_NOFILE = 4096


def shm_needed(workers: int, prefetch_factor: int, batch_size: int, sample_bytes: float) -> int:
    """Bytes of shared memory the batches in flight occupy: ``workers x prefetch x batch x sample``."""
    return int(max(1, workers) * max(1, prefetch_factor) * batch_size * sample_bytes)


def check_shm(workers: int, prefetch_factor: int, batch_size: int, sample_bytes: float,
              shm_path: str = "/dev/shm") -> list[str]:
    """Warnings when ``shm_path`` is too small for the batches in flight (empty when fine).

    Args:
        workers, prefetch_factor, batch_size: the largest values the run will use.
        sample_bytes: decoded bytes per sample (e.g. 224*224*3).
        shm_path: where shared memory lives.
    """
    if workers <= 0:
        return []
    try:
        st = os.statvfs(shm_path)
    except OSError:
        return []
    total = st.f_frsize * st.f_blocks
    free = st.f_frsize * st.f_bavail
    need = shm_needed(workers, prefetch_factor, batch_size, sample_bytes)
    if need <= free:
        return []
    return [
        f"{shm_path} has {format_size(free)} free of {format_size(total)}, but {workers} workers x prefetch "
        f"{prefetch_factor} x batch {batch_size} x ~{format_size(sample_bytes)} per sample need about "
        f"{format_size(need)} of shared memory: workers may die with 'bus error'. In Docker, run with "
        "--shm-size=8g (or --ipc=host); otherwise lower num_workers/prefetch_factor/batch_size"
    ]


def check_nofile(workers: int, prefetch_factor: int = 2, limit: int | None = None) -> list[str]:
    """Warnings when the open-files limit is low for the worker count (empty when fine).

    Args:
        workers, prefetch_factor: the largest values the run will use.
        limit: the soft ``RLIMIT_NOFILE`` (read from the process when None).
    """
    if limit is None:
        try:
            import resource
        except ImportError:  # Windows
            return []
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if limit == -1 or workers <= 0:  # RLIM_INFINITY
        return []
    # a few hundred for the interpreter and libraries, plus descriptors for tensors in flight
    need = max(MIN_NOFILE, 256 + 64 * workers * max(1, prefetch_factor))
    if limit >= need:
        return []
    return [
        f"open-files limit (ulimit -n) is {limit}; with {workers} workers this can fail with 'Too many open "
        "files' or 'received 0 items of ancdata'. Raise it (ulimit -n 65536) or call "
        "torch.multiprocessing.set_sharing_strategy('file_system')"
    ]


def check_environment(workers: int, prefetch_factor: int, batch_size: int, sample_bytes: float) -> list[str]:
    """All environment warnings for a run with at most these settings."""
    return check_shm(workers, prefetch_factor, batch_size, sample_bytes) + check_nofile(workers, prefetch_factor)
