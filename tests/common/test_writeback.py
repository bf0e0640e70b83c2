"""Background writeback of shard files: it syncs while the shard grows, and its
first error fails the shard at close (a shard is never trusted after one)."""

from __future__ import annotations

import errno
import os

import pytest

from fastdata.common import writeback
from fastdata.common.writeback import Writeback


def test_syncs_in_the_background_every_so_many_bytes(tmp_path, monkeypatch):
    calls = []
    real = os.fdatasync
    monkeypatch.setattr(writeback.os, "fdatasync", lambda fd: (calls.append(fd), real(fd)))
    path = tmp_path / "shard.tmp"
    path.write_bytes(b"")
    wb = Writeback(str(path), every=100)
    with open(path, "ab") as fh:
        for _ in range(5):
            fh.write(b"x" * 60)
            fh.flush()
            wb.wrote(60)
            if wb._thread is not None:
                wb._thread.join()
    wb.close()
    assert len(calls) == 2  # after 120 bytes, then after the next 120 (the rest is left to the final fsync)


def test_first_writeback_error_is_raised_at_close(tmp_path, monkeypatch):
    def failing(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(writeback.os, "fdatasync", failing)
    path = tmp_path / "shard.tmp"
    path.write_bytes(b"")
    wb = Writeback(str(path), every=1)
    wb.wrote(10)
    with pytest.raises(OSError, match="Input/output error"):
        wb.close()
    assert wb.fd == -1  # the descriptor is released all the same
