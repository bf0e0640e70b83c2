"""The small interface a storage backend implements.

A *shard writer* receives samples in store order and produces one shard file;
a *shard reader* opens one finished shard file and returns stored bytes by
local index (0 .. count-1). Everything else (planning, parallelism, rotation,
checksums of whole files, resume, manifest) lives in the shared pipeline.
"""

from __future__ import annotations

import abc
import ctypes
import mmap
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import xxhash

from fastdata.errors import CorruptRecordError, FormatError
from fastdata.format.chunks import ChunkTable, PendingChunks
from fastdata.format.fields import Schema
from fastdata.format.record import FORMAT_CODES, SampleIndex, ShardIndex, checksum, chunk_first_key
from fastdata.format.storage_mode import StorageMode


_madvise: object = None  # libc's madvise, False where it is unavailable (set on first use)
#: the default of ``FASTDATA_MAPPED_WINDOW``: bytes of decoded chunks after which a reader
#: releases the pages it has mapped since the last release
DEFAULT_MAPPED_WINDOW = 64 << 20


def _libc_madvise():
    """libc's ``madvise`` (Linux), or None."""
    global _madvise
    if _madvise is None:
        try:
            if not sys.platform.startswith("linux"):
                raise OSError("MADV_DONTNEED only unmaps on Linux")
            call = ctypes.CDLL(None, use_errno=True).madvise
            call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            call.restype = ctypes.c_int
            _madvise = call
        except (OSError, AttributeError):
            _madvise = False
    return _madvise or None


def mapped_window_bytes() -> int:
    """``FASTDATA_MAPPED_WINDOW`` (bytes; default 64 MiB; 0 turns releasing off)."""
    try:
        return max(0, int(os.environ.get("FASTDATA_MAPPED_WINDOW", DEFAULT_MAPPED_WINDOW)))
    except ValueError:
        return DEFAULT_MAPPED_WINDOW


class MappedPages:
    """Keeps a reader from holding most of a large shard mapped.

    A worker reading random chunks of a large store ends up with most of the store's pages in
    its page tables: clean page cache, but counted in its RSS and PSS, which then grow with the
    store instead of staying flat (measured: 481 vs 286 MB peak PSS for 2 workers over 512^3 vs
    128^3 volumes, the difference all file-backed). So each chunk's buffer is noted once used
    (:meth:`used`), and once the chunks noted add up to ``FASTDATA_MAPPED_WINDOW`` bytes (and the
    span they lie in is at least that large) the span is released with ``madvise(MADV_DONTNEED)``,
    which for a shared, read-only file mapping only unmaps: the page cache keeps the pages and
    the next access maps them again with a minor fault (~0.55 us a page here). A window rather
    than every chunk: releasing each chunk made every later read of it fault again (+30% on a
    96^3 patch); with a 64 MiB window a 117 MB store costs ~+10% and the worker maps at most
    about the window. Linux only (elsewhere a no-op); advice only: a failure is ignored.

    One object per mapping (the span between the lowest and highest address noted must lie in
    one read-only file mapping, never in anonymous memory).
    """

    __slots__ = ("window", "_lo", "_hi", "_pending")

    def __init__(self) -> None:
        self.window = mapped_window_bytes()
        self._lo = -1
        self._hi = 0
        self._pending = 0

    def used(self, view) -> None:
        """Note ``view`` (a buffer into the mapping, decoded and no longer needed)."""
        if not self.window:
            return
        nbytes = len(view)
        if not nbytes:
            return
        address = np.frombuffer(view, dtype=np.uint8).ctypes.data
        self._lo = address if self._lo < 0 else min(self._lo, address)
        self._hi = max(self._hi, address + nbytes)
        self._pending += nbytes
        # a span smaller than the window holds fewer pages than that: nothing worth releasing (a
        # store smaller than the window is never released, and costs nothing)
        if self._pending >= self.window and self._hi - self._lo >= self.window:
            self.release()

    def release(self) -> None:
        """Unmap every page of the span noted since the last release."""
        call = _libc_madvise() if self._lo >= 0 else None
        if call is not None:
            lo = self._lo - self._lo % mmap.PAGESIZE
            call(lo, self._hi - lo, mmap.MADV_DONTNEED)
        self._lo, self._hi, self._pending = -1, 0, 0

    def forget(self) -> None:
        """The mapping is gone: nothing to release."""
        self._lo, self._hi, self._pending = -1, 0, 0


@dataclass(frozen=True)
class Sample:
    """One validated input, ready to store."""

    image: bytes
    label: int
    width: int
    height: int
    fmt: str
    xxh: int
    relpath: bytes
    #: the numpy dtype name and channel count of the image as stored (``image_mode="unchanged"``)
    dtype: str = "uint8"
    channels: int = 3


@dataclass(frozen=True, init=False)
class StorageSpec:
    """How images are stored: ``mode`` is a :class:`~fastdata.format.storage_mode.StorageMode`
    (a mode's string, as a manifest records it, is accepted and turned into one):

    * ``ORIGINAL``: each file's bytes as they are (validated);
    * ``REENCODE``: images larger than ``max_side`` re-encoded as JPEG at ``quality``;
    * ``FIXED_SIZE_PIXELS`` (``convert(raw="HxW")``): decoded RGB pixels squashed to ``raw_shape``;
    * ``LOSSLESS`` (``convert(lossless="tiff")``): every image but JPEG, WebP and DICOM files
      re-encoded as a zstd TIFF of its unchanged pixels, checked bit-exact (see
      :func:`fastdata.writer.ingest.lossless_sample`); read like ``ORIGINAL``;
    * ``NATIVE_SIZE_PIXELS`` (``convert(storage="raw", max_side=N)``): every image's decoded RGB
      pixels at its own size, scaled down so that the longer side is at most ``max_side``, each
      record a binary PPM (``P6``, maxval 255: :func:`fastdata.common.imageio.encode_ppm`);
    * ``MIXED`` (``convert(storage="mixed", raw_fraction=F, max_side=N)``): the images that
      :meth:`stores_native_pixels` picks (a fraction ``raw_fraction`` of them) as in ``NATIVE_SIZE_PIXELS``,
      the others as in ``ORIGINAL``. With ``raw_budget`` (bytes) instead of a fraction, the
      conversion's plan picks them: the images whose decode saves the most time per extra byte, as
      many as the budget holds (:mod:`fastdata.writer.raw_budget`).

    ``raw_budget`` (modes ``NATIVE_SIZE_PIXELS`` and ``MIXED``) is the most bytes the images may
    take in the store, recorded so that ``info`` and a resumed write say it.

    Both native-size pixel modes are read like ``ORIGINAL``: a PPM record is an image like any
    other, whose decode is a header parse and a view of its pixels.
    """

    mode: StorageMode = StorageMode.ORIGINAL
    max_side: int | None = None
    quality: int | None = None
    raw_shape: tuple[int, int] | None = None  # (H, W) for mode FIXED_SIZE_PIXELS
    raw_fraction: float | None = None  # for mode MIXED: the share of images stored as pixels
    raw_budget: int | None = None  # for the native-size pixel modes: the bytes the images may take

    def __init__(self, mode: StorageMode | str = StorageMode.ORIGINAL, max_side: int | None = None,
                 quality: int | None = None, raw_shape: tuple[int, int] | None = None,
                 raw_fraction: float | None = None, raw_budget: int | None = None) -> None:
        # a mode's string (as a manifest records it) becomes its StorageMode here, once
        values = {"mode": StorageMode.parse(mode), "max_side": max_side, "quality": quality,
                  "raw_shape": raw_shape, "raw_fraction": raw_fraction, "raw_budget": raw_budget}
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def stores_native_pixels(self, relpath: bytes) -> bool:
        """Whether the image at ``relpath`` (its path relative to the source root, as recorded) is
        stored as pixels: always in mode ``NATIVE_SIZE_PIXELS``; in mode ``MIXED`` when
        ``xxh3_64(relpath) / 2**64 < raw_fraction``. A function of the path alone, so a
        resumed write, a rerun or another machine picks the same images, and a fraction F picks
        about F of them (exactly those the rule says); never in the other modes.

        Raises:
            ValueError: mode ``MIXED`` with a ``raw_budget``: there the plan picks the images
                (:func:`fastdata.writer.raw_budget.choose_raw`), not the path.
        """
        if self.mode.holds_only_native_size_pixels:
            return True
        if self.mode.picks_images_to_hold_as_pixels and self.raw_budget is not None:
            raise ValueError("a mixed store with a raw budget picks its raw images by their sizes, in the "
                             "conversion's plan: the path alone does not tell")
        if not self.mode.picks_images_to_hold_as_pixels or not self.raw_fraction:
            return False
        return xxhash.xxh3_64_intdigest(relpath) / 2.0**64 < self.raw_fraction

    def holds_pixels(self, relpath: bytes, fmt_code: int) -> bool:
        """Whether the record of the image at ``relpath``, indexed as format ``fmt_code``, is meant
        to hold native-size pixels: :meth:`stores_native_pixels` where the store has a rule (mode
        ``NATIVE_SIZE_PIXELS``, mode ``MIXED`` with a fraction); in a mixed store with a raw budget,
        which records no rule (its plan chose from the images' sizes), when the record is a PPM."""
        if self.mode.picks_images_to_hold_as_pixels and self.raw_budget is not None:
            return fmt_code == FORMAT_CODES["PPM"]
        return self.stores_native_pixels(relpath)

    def fixed_pixel_shape(self) -> tuple[int, int]:
        """``(H, W)`` of every image of a store of fixed-size pixels.

        Raises ValueError when this spec has no ``raw_shape`` (only stores of mode
        ``FIXED_SIZE_PIXELS`` have one; their manifest always records it)."""
        if self.raw_shape is None:
            raise ValueError(f"storage mode {self.mode.value!r} has no raw_shape: only stores of fixed-size "
                             "pixels (raw='HxW') hold fixed-size pixel arrays")
        return self.raw_shape

    def reencode_max_side(self) -> int:
        """Longest side (pixels) above which a reencode-mode store scales images down.

        Raises ValueError when this spec has no ``max_side`` (only reencode-mode
        stores have one; their manifest always records it)."""
        if self.max_side is None:
            raise ValueError(f"storage mode {self.mode.value!r} has no max_side: only reencode-mode stores "
                             "(max_side=N) scale images down")
        return self.max_side

    def to_json(self) -> dict:
        out: dict = {"mode": self.mode.value, "max_side": self.max_side, "quality": self.quality,
                     "raw_shape": list(self.raw_shape) if self.raw_shape else None}
        if self.mode.picks_images_to_hold_as_pixels:  # only there: the manifests of the other modes keep their keys
            out["raw_fraction"] = self.raw_fraction
        if self.raw_budget is not None:  # (only given: stores without one keep their keys)
            out["raw_budget"] = self.raw_budget
        return out

    @classmethod
    def from_json(cls, obj: dict) -> StorageSpec:
        shape = obj.get("raw_shape")
        return cls(obj.get("mode", StorageMode.ORIGINAL.value), obj.get("max_side"), obj.get("quality"),
                   tuple(shape) if shape else None, obj.get("raw_fraction"), obj.get("raw_budget"))


#: smallest ``max_side`` of the native-size pixel modes: a crop of a smaller image has too few pixels to train on
MIN_RAW_MAX_SIDE = 32


class ShardWriter(abc.ABC):
    """Writes one shard file at ``path`` (the pipeline passes a temporary name)."""

    #: the backend library's own I/O error types (the pipeline reports them like OSError)
    io_errors: ClassVar[tuple[type[Exception], ...]] = ()

    def __init__(self, path: str, storage: StorageSpec, *, schema: Schema | None = None, **options):
        """``schema``: None for a classification (version-1) shard of :class:`Sample`; a
        schema for a general (version-2) shard of :class:`~fastdata.format.record.EncodedSample`."""
        self.path = path
        self.storage = storage
        self.schema = schema

    @abc.abstractmethod
    def put(self, samples: Sequence) -> None:
        """Append ``samples`` (in store order): :class:`Sample` objects for a version-1
        shard, :class:`~fastdata.format.record.EncodedSample` objects for a version-2 one."""

    @abc.abstractmethod
    def close(self) -> ShardIndex | SampleIndex:
        """Flush, write the index, sync to disk and close. Returns the index written."""

    def put_chunks(self, pending: PendingChunks) -> int:
        """Store one chunked field's chunks (in grid order) and return where the first one
        is: the field's ``.first`` index entry (what it means is the backend's: its ``spec.py``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot store chunked fields")

    def place_chunks(self, sample) -> dict | None:
        """Store the chunks ``sample`` (an EncodedSample) brings, deleting the files they waited
        in; returns the index entries saying where they went (None when it has none)."""
        if not getattr(sample, "chunks", ()):
            return None
        placed = {}
        for pending in sample.chunks:
            placed[chunk_first_key(pending.field)] = self.put_chunks(pending)
            os.unlink(pending.path)
        return placed

    @abc.abstractmethod
    def abort(self) -> None:
        """Close without finishing (the pipeline deletes the file)."""


class ShardReader(abc.ABC):
    """Reads one finished shard file. Opening happens in the constructor, so
    datasets create readers lazily, once per process."""

    def __init__(self, path: str, storage: StorageSpec, *, schema: Schema | None = None,
                 expected_count: int | None = None, **options):
        """``schema``: None for a classification (version-1) shard; the store's schema for a
        general (version-2) one, whose :meth:`get` returns whole record bytes.
        ``expected_count``: the record count the manifest gives this shard, when the caller
        has it; the shard's own count must equal it before any index array is read
        (:meth:`check_count`)."""
        self.path = path
        self.storage = storage
        self.schema = schema
        self.expected_count = expected_count
        #: held while state loaded at first use (the index's checksums, a payload mapping, an advice
        #: descriptor) is loaded: thread workers share one reader, and must not load it twice
        self.lazy_lock = threading.Lock()

    @classmethod
    def check_structure(cls, path: str, *, full: bool = False) -> None:
        """Check the shard file ``path`` before anything reads it: a regular file (never a
        FIFO, device or directory) whose structure cannot make a reader read outside it,
        allocate more than it holds, hang or fault. Readers run the same checks when they
        open; ``verify`` calls this first, with ``full`` for the checks too slow for every open.

        Raises:
            UnsafeStoreError: the file is not a regular file, or its structure is unsafe.
            FormatError: it is damaged (naming the file and what is wrong).
        """
        from fastdata.common.fileio import check_regular

        try:
            check_regular(path, "shard")
        except OSError as err:
            raise FormatError(f"{path}: cannot open the shard ({err.strerror or err})") from None

    def check_count(self, count: int) -> None:
        """Refuse a shard whose own record ``count`` is not the manifest's (``expected_count``)."""
        if self.expected_count is not None and count != self.expected_count:
            raise CorruptRecordError(f"{self.path}: holds {count} records, the manifest says {self.expected_count}",
                                     shard=self.path)

    @abc.abstractmethod
    def read_index(self) -> ShardIndex | SampleIndex:
        """The per-sample metadata arrays of this shard, validated (a :class:`SampleIndex`
        for a version-2 shard)."""

    @abc.abstractmethod
    def get(self, local_index: int) -> bytes:
        """Stored image bytes of one sample, or a version-2 shard's record bytes (checksum verified)."""

    @classmethod
    def from_stored_value(cls, value: bytes, local_index: int, expected: int, *, schema: Schema | None,
                          where: str) -> bytes:
        """What :meth:`get` returns for record ``local_index``, from its stored bytes ``value`` read
        without opening the shard (the pieces the store index file's ``record_ranges`` place, joined:
        a ranged read of a remote store), checked against ``expected``, the index's checksum.

        Here: ``value`` itself, whose xxh3-64 must be ``expected`` (the layout of an HDF5 shard, whose
        payload holds the image bytes or general records, and of a general LMDB record).

        Raises:
            CorruptRecordError: the checksum does not match (naming ``where``).
        """
        if checksum(value) != expected:
            raise CorruptRecordError(f"{where}: checksum mismatch (the record is damaged)", index=local_index)
        return value

    @classmethod
    def stored_value_bounds(cls, nbytes: int, path_bytes: int, *, schema: Schema | None) -> tuple[int, int]:
        """The least and most bytes the stored value of a record may have, from its index entries
        (``nbytes``; ``path_bytes``: its stored path's length): what a ranged read checks the
        ranges it was given against before it reads anything. Here: exactly ``nbytes``."""
        return nbytes, nbytes

    def get_many(self, local_indices: Sequence[int]) -> list[bytes]:
        """Stored bytes for several samples, in the order given."""
        return [self.get(i) for i in local_indices]

    def read_images(self, local_indices: Sequence[int], consume) -> None:
        """Call ``consume(k, data)`` with the stored image bytes of the ``k``-th of ``local_indices``,
        checked as :meth:`get` checks them. ``data`` may be a view into the shard valid only during
        the call (a raw-native PPM record in an LMDB transaction's buffer): ``consume`` decodes it
        there, without a copy, and must not read from the store itself. Here: :meth:`get_many`'s
        bytes."""
        for k, data in enumerate(self.get_many(local_indices)):
            consume(k, data)

    def chunk_bytes(self, first: int, table: ChunkTable, chunk: int) -> bytes | memoryview | np.ndarray | None:
        """The stored bytes of chunk number ``chunk`` of a value whose chunks start at ``first``
        (its ``.first`` index entry), unchecked (see :meth:`get_chunks`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot read chunked fields")

    #: where :meth:`chunk_bytes` returns views of a file mapping, that mapping's
    #: :class:`MappedPages` (set by the backend; None: nothing to release)
    mapped_pages: MappedPages | None = None

    def read_chunks(self, first: int, table: ChunkTable, chunks: Sequence[int], where: str, consume) -> None:
        """Call ``consume(k, data)`` for the ``k``-th of chunks ``chunks`` with its stored bytes,
        checked as :meth:`get_chunks` checks them. ``data`` may be a view into the shard that is
        valid only during the call (an LMDB transaction's buffer): ``consume`` decodes it there,
        without a copy of the stored bytes."""
        pages = self.mapped_pages
        for k, data in enumerate(self.get_chunks(first, table, chunks, where)):
            consume(k, data)
            if pages is not None:
                pages.used(data)

    def get_chunks(self, first: int, table: ChunkTable, chunks: Sequence[int], where: str) -> list:
        """The stored bytes of chunks ``chunks`` (grid numbers) of one value, each checked against
        its table entry (length and xxh3-64).

        Raises:
            CorruptRecordError: a chunk is missing, of another length, or damaged (naming ``where``
                and the chunk).
        """
        out = []
        for j in chunks:
            data = self.chunk_bytes(first, table, j)
            if data is None or len(data) != int(table.nbytes[j]):
                raise CorruptRecordError(f"{where} chunk {j}: missing or of the wrong length in {self.path}; "
                                         "run 'fastdata verify'", shard=self.path)
            if checksum(data) != int(table.xxh[j]):
                raise CorruptRecordError(f"{where} chunk {j}: checksum mismatch (the chunk is damaged); run "
                                         "'fastdata verify'", shard=self.path)
            out.append(data)
        return out

    def get_raw_batch(self, local_indices: np.ndarray, out: np.ndarray) -> None:
        """Raw-mode stores: copy pixels of ``local_indices`` into ``out`` [n,H,W,3]."""
        h, w = self.storage.fixed_pixel_shape()
        for j, i in enumerate(local_indices):
            out[j] = np.frombuffer(self.get(int(i)), dtype=np.uint8).reshape(h, w, 3)

    @abc.abstractmethod
    def close(self) -> None:
        """Release every OS handle."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
