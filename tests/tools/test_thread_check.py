"""``fastdata doctor``'s thread check: does a Dataset's loading run in parallel in thread workers?

The robust cases on a loaded 2-core machine: a pure-Python busy loop holds the GIL (two threads
run at about 1.0x one, under the 1.3x threshold however busy the machine), and a sleep releases
it (two threads at about 2x one, whatever else runs: sleeping needs no core).
"""

from __future__ import annotations

import sys
import textwrap
import time

import pytest
import torch

from fastdata.common import portable
from fastdata.tools.diagnose import ThreadScaling, check_thread_workers, diagnose

needs_two_cores = pytest.mark.skipif(portable.available_cores() < 2, reason="needs 2 usable cores")


class BusyLoop(torch.utils.data.Dataset):
    """Pure Python per item: holds the GIL the whole time."""

    def __len__(self):
        return 512

    def __getitem__(self, i):
        x = 0
        for j in range(20_000):
            x += j
        return x


class Sleepy(BusyLoop):
    """Waits 5 ms per item without the GIL (as reading a file or a GIL-free decoder would)."""

    def __getitem__(self, i):
        time.sleep(0.005)
        return i


@needs_two_cores
def test_gil_holding_dataset_blocks_threads():
    result, why = check_thread_workers(BusyLoop(), budget_s=1.0)
    assert result is not None, why
    assert result.blocks and result.speedup < 1.3
    msg = result.message()
    assert msg.startswith("your Dataset holds the GIL while it loads (2 threads ran at ")
    assert f"{result.speedup:.2f}x one): use worker_type='process' (the default)" in msg


@needs_two_cores
def test_gil_releasing_dataset_scales():
    t0 = time.perf_counter()
    result, why = check_thread_workers(Sleepy(), batch_size=8, budget_s=1.0)
    elapsed = time.perf_counter() - t0
    assert result is not None, why
    assert not result.blocks and result.speedup >= 1.3, result
    assert result.message().startswith(f"thread workers scale ({result.speedup:.2f}x")
    assert result.batches >= 2 and result.batches % 2 == 0 and result.batch_size == 8
    assert elapsed < 3.0  # the budget holds (1 s asked; slack for a busy machine)


def test_message_thresholds():
    blocks = ThreadScaling(speedup=1.05, one_thread_s=0.5, two_threads_s=0.476, batches=8, batch_size=16, cores=2)
    scales = ThreadScaling(speedup=1.95, one_thread_s=0.5, two_threads_s=0.256, batches=8, batch_size=16, cores=2)
    assert blocks.blocks and "(2 threads ran at 1.05x one)" in blocks.message()
    assert "costs little" not in blocks.message()
    assert not scales.blocks and scales.message().startswith("thread workers scale (1.95x")
    quick = ThreadScaling(speedup=0.4, one_thread_s=0.002, two_threads_s=0.005, batches=8, batch_size=16, cores=2)
    assert "costs little either way" in quick.message()


def test_not_measured_when_it_cannot_be(monkeypatch):
    class Short(Sleepy):
        def __len__(self):
            return 5

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(100))

    class Broken(Sleepy):
        def __getitem__(self, i):
            raise OSError("disk on fire")

    assert check_thread_workers(Short())[0] is None and "too few" in check_thread_workers(Short())[1]
    assert "IterableDataset" in check_thread_workers(Stream())[1]
    result, why = check_thread_workers(Broken())
    assert result is None and "OSError: disk on fire" in why
    monkeypatch.setattr(portable, "available_cores", lambda: 1)
    result, why = check_thread_workers(Sleepy())
    assert result is None and "one usable core" in why


@needs_two_cores
def test_diagnose_reports_threads_only_when_asked():
    plain = diagnose(BusyLoop())
    assert plain.threads is None and "thread workers" not in str(plain)
    report = diagnose(BusyLoop(), check_threads=True)
    assert report.ok  # advice, not a hazard: the default loader uses processes
    assert report.threads is not None and report.threads.blocks
    assert "thread workers: your Dataset holds the GIL" in str(report)
    assert any(n.startswith("thread check: ") for n in report.notes)


USER_MODULE = textwrap.dedent('''
    import time

    import torch


    class Sleepy(torch.utils.data.Dataset):
        def __len__(self):
            return 256

        def __getitem__(self, i):
            time.sleep(0.005)
            return i
''')


@needs_two_cores
def test_doctor_cli_prints_the_thread_check(tmp_path, monkeypatch, capsys):
    from fastdata.cli.main import main

    (tmp_path / "threadcheck_user.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    try:
        assert main(["doctor", "threadcheck_user:Sleepy"]) == 0
        out = capsys.readouterr().out
        assert "thread workers: thread workers scale (" in out
        assert main(["doctor", "threadcheck_user:Sleepy", "--no-thread-check"]) == 0
        assert "thread workers:" not in capsys.readouterr().out
    finally:
        sys.modules.pop("threadcheck_user", None)
