"""What the NIfTI and TIFF readers share: their optional libraries imported with a clear
message, a file's name as a message prefix, native dtypes, the chunk shape and ``Chunked``
field of the ``chunks``/``codec`` options, and a sample's values opened with the files to close."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import numpy as np

from fastdata.errors import MissingExtraError
from fastdata.format.fields import Chunked, SchemaError

__all__ = ["OpenedSample", "chunk_shape", "chunked_field", "named", "native_dtype", "require_extra"]

_INSTALL = {"nibabel": "pip install 'fastdata[volumes]'", "tifffile": "pip install 'fastdata[images]'",
            "imagecodecs": "pip install 'fastdata[images]'"}


def require_extra(module: str, what: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtraError` naming the extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtraError(f"{what} needs {module}, which is not installed: {_INSTALL[module]}") from None


def named(name: str) -> str:
    """``"name: "``, or nothing for an empty name (the input itself: rejected.tsv names it)."""
    return f"{name}: " if name else ""


def native_dtype(dtype: Any) -> np.dtype:
    """``dtype`` in the native byte order."""
    dtype = np.dtype(dtype)
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def chunk_shape(ndim: int, given: tuple[int, ...] | None, default: tuple[int, ...], what: str) -> tuple[int, ...]:
    """The chunk shape of ``ndim``-axis values: ``given`` (or ``default``), extended by 1 on the
    axes after those given."""
    sides = given if given is not None else default[:ndim]
    if len(sides) > ndim:
        raise ValueError(f"chunks={','.join(map(str, sides))} names {len(sides)} sides, but the {what} have "
                         f"{ndim} axes")
    return tuple(sides) + (1,) * (ndim - len(sides))


def chunked_field(dtype: np.dtype, chunks: tuple[int, ...], codec: str | None) -> Chunked:
    """The ``Chunked`` field of these chunks and codec; a bad one is a :class:`ValueError` naming the options."""
    try:
        return Chunked(dtype, chunks, codec=codec)
    except SchemaError as err:
        raise ValueError(f"chunks/codec: {err}") from None


class OpenedSample:
    """A sample's values with the files they read from, closed by :meth:`close`."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.closers: list[Any] = []

    def close(self) -> None:
        for close in self.closers:
            try:
                close()
            except Exception:  # noqa: BLE001 - closing a file that failed to read
                pass

