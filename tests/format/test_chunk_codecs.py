"""Every chunk codec in the one table: documented, and bounded on hostile frames (round trips through
a store: tests/writer/test_chunked_write.py)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from fastdata.errors import CorruptRecordError
from fastdata.format.chunk_codecs import CHUNK_CODECS, chunk_codec

FORMAT_MD = (Path(__file__).resolve().parents[2] / "docs" / "FORMAT.md").read_text()
CHUNK = np.arange(16 * 16 * 16, dtype=np.uint16).reshape(16, 16, 16) % 1000


def documented_codecs(text: str) -> set[str]:
    """The codec names in the first column of FORMAT.md's codec table."""
    table = text.split("| codec | a stored chunk is |", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r"^\| `([a-z0-9-]+)`", table, flags=re.M))


def test_format_md_documents_every_codec_and_no_other():
    assert documented_codecs(FORMAT_MD) == set(CHUNK_CODECS)


def test_a_codec_missing_from_format_md_is_seen_control():
    assert "blosc-zstd" not in documented_codecs(FORMAT_MD.replace("| `blosc-zstd` |", "| blosc zstd |"))


@pytest.mark.parametrize("name", sorted(CHUNK_CODECS))
def test_each_codec_refuses_a_frame_of_another_size_without_writing_past_the_buffer(name):
    codec = chunk_codec(name)
    big = np.zeros((32, 16, 16), dtype=np.uint16)  # twice the chunk the reader expects
    out = np.empty_like(CHUNK)
    with pytest.raises(CorruptRecordError, match="sample 3"):
        codec.decode_into(codec.encode(big, codec.default_level), out, "sample 3")
    with pytest.raises(CorruptRecordError, match="sample 3"):
        codec.decode_into(b"\x02\x01" + bytes(30), out, "sample 3")
