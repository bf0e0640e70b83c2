"""The stored values of a list's fields, one column per field: a numpy array for numbers,
packed bytes plus offsets (:class:`PackedBytes`) for the rest, never one Python object per row."""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from fastdata.format.fields import Field, Float, Image, Int, NDArray, Ragged, String
from fastdata.writer.sources.table.spec import Spec

__all__ = ["PackedBytes", "PackedBuilder", "Column", "ScalarColumn", "column_for"]


@dataclass
class PackedBytes:
    """Many byte strings as one ``uint8`` buffer plus ``int64`` offsets (``n + 1``):
    item ``i`` is ``data[offsets[i]:offsets[i + 1]]``. Slicing gives a list."""

    data: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        return self.data[self.offsets[index]:self.offsets[index + 1]].tobytes()

    def __iter__(self) -> Iterator[bytes]:
        return (self[i] for i in range(len(self)))


class PackedBuilder:
    """Byte strings appended one at a time, then frozen into one :class:`PackedBytes`."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._ends = array("q", [0])

    def append(self, item: bytes) -> None:
        self._buf += item
        self._ends.append(len(self._buf))

    def freeze(self) -> PackedBytes:
        packed = PackedBytes(np.frombuffer(bytes(self._buf), dtype=np.uint8),
                             np.frombuffer(self._ends.tobytes(), dtype=np.int64))
        self._buf, self._ends = bytearray(), array("q")
        return packed


class Column:
    """The stored values of one field: appended to while reading, then frozen."""

    def append(self, value: Any) -> None:
        raise NotImplementedError

    def freeze(self) -> None:
        raise NotImplementedError

    def get(self, i: int) -> Any:
        raise NotImplementedError


class ScalarColumn(Column):
    """Int and Float fields (and single-label class indices): one numpy array."""

    def __init__(self, dtype: np.dtype):
        self.dtype = dtype
        self._code = "Q" if dtype.kind == "u" else "d" if dtype.kind == "f" else "q"
        self._values: array | None = array(self._code)
        self.values = np.empty(0, dtype=dtype)

    def append(self, value: Any) -> None:
        assert self._values is not None
        self._values.append(value)

    def freeze(self) -> None:
        assert self._values is not None
        native = {"Q": np.uint64, "d": np.float64, "q": np.int64}[self._code]
        self.values = np.frombuffer(self._values.tobytes(), dtype=native).astype(self.dtype)
        self._values = None

    def get(self, i: int) -> Any:
        return float(self.values[i]) if self.dtype.kind == "f" else int(self.values[i])


class _BytesColumn(Column):
    """Fields stored as bytes per row: strings (UTF-8), json (msgpack), extra image
    paths (file system bytes), fixed-shape and ragged arrays (raw bytes)."""

    def __init__(self, field: Field):
        self.field = field  # the codec is chosen from it (no closures: the source pickles)
        self._builder: PackedBuilder | None = PackedBuilder()
        self.packed = PackedBytes(np.empty(0, np.uint8), np.zeros(1, np.int64))

    def append(self, value: Any) -> None:
        assert self._builder is not None
        self._builder.append(value)

    def freeze(self) -> None:
        assert self._builder is not None
        self.packed, self._builder = self._builder.freeze(), None

    def get(self, i: int) -> Any:
        return _decode(self.field, self.packed[i])


class _RaggedColumn(Column):
    """Ragged fields (and multi-label class indices): all rows' bytes packed, plus row counts."""

    def __init__(self, field: Ragged):
        self.field = field
        self._bytes = _BytesColumn(field)
        self._counts: array | None = array("q")
        self.counts = np.empty(0, dtype=np.int64)

    def append(self, value: np.ndarray) -> None:
        assert self._counts is not None
        self._bytes.append(value.tobytes())
        self._counts.append(int(value.shape[0]))

    def freeze(self) -> None:
        assert self._counts is not None
        self._bytes.freeze()
        self.counts, self._counts = np.frombuffer(self._counts.tobytes(), dtype=np.int64).copy(), None

    def get(self, i: int) -> np.ndarray:
        data = self._bytes.packed[i]
        return np.frombuffer(data, dtype=self.field.dtype).reshape((int(self.counts[i]), *self.field.inner_shape))


def column_for(spec: Spec) -> Column:
    """The empty column that stores ``spec``'s field."""
    f = spec.field
    if spec.role == "multilabel" or isinstance(f, Ragged):
        return _RaggedColumn(f if isinstance(f, Ragged) else Ragged("int64"))
    if isinstance(f, Int | Float):
        return ScalarColumn(f.dtype)
    return _BytesColumn(f)


def _decode(f: Field, data: bytes) -> Any:
    if isinstance(f, String):
        return data.decode("utf-8")
    if isinstance(f, Image):
        return os.fsdecode(data)
    if isinstance(f, NDArray):
        return np.frombuffer(data, dtype=f.dtype).reshape(f.shape)
    if isinstance(f, Ragged):
        return data
    return msgpack.unpackb(data, raw=False)
