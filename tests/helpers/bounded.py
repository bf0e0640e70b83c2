"""Run a function in a forked child under an address-space limit and a timeout.

The hostile-input tests use it to show that an attack ends in a typed error, not in an
unbounded allocation or a hang, without risking the test process: the child's ``RLIMIT_AS`` is
its own size at the fork plus ``growth``, and it is killed after ``timeout`` seconds. Import
what the child runs before calling (torch alone maps more than a usual ``growth``).
"""

from __future__ import annotations

import os
import pickle
import resource
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

#: what a case may allocate beyond the child's address space at the fork
GROWTH = 1 << 30
#: seconds a case may run
TIMEOUT = 20.0


def vm_size() -> int:
    """This process's address space (bytes), from ``/proc/self/status``."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmSize in /proc/self/status")


def _outcome(fn: Callable, args: tuple, kwargs: dict) -> dict:
    from fastdata.errors import FastdataError

    try:
        return {"outcome": "ok", "value": fn(*args, **kwargs)}
    except MemoryError as err:
        return {"outcome": "memory", "type": "MemoryError", "message": str(err)}
    except BaseException as err:  # noqa: BLE001 - every failure is an outcome
        typed = isinstance(err, FastdataError)
        return {"outcome": "typed_error" if typed else "untyped_error", "type": type(err).__name__,
                "message": str(err)[:2000]}


def run_bounded(fn: Callable, *args: Any, env: dict[str, str] | None = None, growth: int = GROWTH,
                timeout: float = TIMEOUT, **kwargs: Any) -> dict:
    """``fn(*args, **kwargs)`` in a forked child limited to ``growth`` more bytes of address space
    and ``timeout`` seconds, with ``env`` added to its environment.

    Returns:
        dict: ``{"outcome": "ok", "value": ...}``; ``typed_error`` (a ``FastdataError``),
        ``untyped_error`` or ``memory``, with ``type`` and ``message``; or ``timeout`` / ``signal``
        with ``message``.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(r)
            os.environ.update(env or {})
            # one torch thread, as DataLoader workers do: an OpenMP pool the parent started does not
            # survive fork, and a parallel region in the child could wait on it for ever
            if "torch" in sys.modules:
                sys.modules["torch"].set_num_threads(1)
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            limit = vm_size() + growth
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            os.write(w, pickle.dumps(_outcome(fn, args, kwargs)))
        finally:
            os._exit(0)
    os.close(w)
    data, status = wait_for_child(pid, r, timeout)
    if status is None:
        return {"outcome": "timeout", "message": f"still running after {timeout} s"}
    if os.WIFSIGNALED(status):
        return {"outcome": "signal", "message": signal.Signals(os.WTERMSIG(status)).name}
    return pickle.loads(data) if data else {"outcome": "untyped_error", "message": "no result"}


def _drain(fd: int) -> bytes:
    """What the non-blocking pipe ``fd`` holds now."""
    out = b""
    try:
        while chunk := os.read(fd, 1 << 16):
            out += chunk
    except BlockingIOError:
        pass
    return out


def wait_for_child(pid: int, r: int, timeout: float, group: bool = False) -> tuple[bytes, int | None]:
    """Read the pipe ``r`` of the forked child ``pid`` until the child exits (read as it writes, so
    a result larger than the pipe's buffer never blocks it), then close ``r``.

    Returns:
        ``(bytes read, wait status)``; the status is None when the child was still running after
        ``timeout`` seconds and was killed with SIGKILL (with ``group``, its process group first).
    """
    os.set_blocking(r, False)
    data, status, deadline = b"", None, time.monotonic() + timeout
    while True:
        data += _drain(r)
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
            break
        if time.monotonic() > deadline:
            for target in ((-pid, pid) if group else (pid,)):
                try:
                    os.kill(target, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            os.waitpid(pid, 0)
            break
        time.sleep(0.005)
    data += _drain(r)
    os.close(r)
    return data, status
