"""Field kinds and backends are each declared in one place."""

from __future__ import annotations

import os

import numpy as np

import fastdata
from fastdata.convert import choose_backend
from fastdata.fields import kinds_markdown
from fastdata.formats import reader_class, writer_class
from fastdata.formats.lmdb.reader import LMDBShardReader
from fastdata.formats.registry import Backend, get_backend, register_backend, unregister_backend

FORMAT_MD = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "FORMAT.md")


def test_format_md_holds_the_generated_table_of_field_kinds():
    assert kinds_markdown() in open(FORMAT_MD, encoding="utf-8").read()


def test_a_backend_registered_in_one_call_is_selectable_and_readable(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTDATA_MIN_SHARD_SIZE", "1")
    lmdb = get_backend("lmdb")
    register_backend(Backend("dummy", (".dmy",), lmdb.writer, lmdb.reader, lmdb.spec))
    try:
        assert choose_backend(str(tmp_path / "x.dmy"), None) == "dummy"
        assert choose_backend("x.lmdb", "DUMMY") == "dummy"
        assert reader_class("dummy") is LMDBShardReader and writer_class("dummy") is writer_class("lmdb")
        dst = tmp_path / "s.dmy"
        fastdata.write([{"x": np.arange(i, dtype=np.int64)} for i in range(5)], dst, workers=0, progress=False)
        assert sorted(p.name for p in dst.glob("shard-*")) == ["shard-00000.dmy"]
        assert fastdata.open_dataset(dst)[4]["x"].tolist() == [0, 1, 2, 3]
        assert fastdata.verify(str(dst)).ok
    finally:
        unregister_backend("dummy")
