"""The per-sample record: msgpack schema, checksums and the per-shard index.

A record is one msgpack map (never pickle: a store must be safe to open even if
it came from elsewhere). Field order is fixed and ``img`` comes last::

    {"v": 1, "label": int, "w": int, "h": int, "fmt": str, "xxh": uint64,
     "path": bin (source path relative to the converted root, raw bytes),
     "img": bin (the stored image bytes, or raw RGB pixels when fmt == "RAW")}

``xxh`` is ``xxhash.xxh3_64`` of ``img``. Every decoded record is validated
(types, ranges, checksum) before anything is returned.

The per-shard *index* holds the same per-sample metadata as numpy arrays so a
reader can learn labels and sizes without touching the records (see
:class:`ShardIndex`).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import numpy as np
import xxhash

from .errors import CorruptRecordError

RECORD_VERSION = 1
#: stored image format names and their 1-byte codes in the index
FORMAT_CODES = {"JPEG": 0, "PNG": 1, "PPM": 2, "BMP": 3, "TIFF": 4, "WEBP": 5, "RAW": 6}
FORMAT_NAMES = {v: k for k, v in FORMAT_CODES.items()}
#: hard limit for one record: refuse to unpack anything larger (hostile input)
MAX_RECORD_BYTES = 1 << 30
_FIELDS = ("v", "label", "w", "h", "fmt", "xxh", "path", "img")
_unpackb = msgpack.unpackb
_UNPACK_LIMITS = dict(raw=False, use_list=False, strict_map_key=True, max_bin_len=MAX_RECORD_BYTES,
                      max_str_len=1 << 16, max_array_len=16, max_map_len=16, max_ext_len=0)


def checksum(data: bytes | memoryview) -> int:
    """xxh3-64 of ``data`` as an unsigned int (the per-record checksum)."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True)
class Record:
    """One decoded, validated record."""

    label: int
    width: int
    height: int
    fmt: str
    xxh: int
    relpath: bytes
    image: bytes


def encode_record(image: bytes, *, label: int, width: int, height: int, fmt: str,
                  relpath: bytes, xxh: int | None = None) -> bytes:
    """Pack one record. ``xxh`` is computed when not given."""
    if fmt not in FORMAT_CODES:
        raise ValueError(f"unknown image format {fmt!r}")
    return msgpack.packb(
        {
            "v": RECORD_VERSION,
            "label": int(label),
            "w": int(width),
            "h": int(height),
            "fmt": fmt,
            "xxh": checksum(image) if xxh is None else int(xxh),
            "path": bytes(relpath),
            "img": bytes(image),
        },
        use_bin_type=True,
    )


def _unpack_record(buf: bytes | memoryview, where: str, verify: bool) -> dict:
    if len(buf) > MAX_RECORD_BYTES:
        raise CorruptRecordError(f"{where}: record of {len(buf)} bytes exceeds the {MAX_RECORD_BYTES} byte limit")
    try:
        obj = _unpackb(buf, **_UNPACK_LIMITS)
    except Exception as err:  # msgpack raises several unrelated types on garbage
        raise CorruptRecordError(f"{where}: record is not valid msgpack ({type(err).__name__}: {err})") from None
    if type(obj) is not dict or tuple(obj) != _FIELDS:
        raise CorruptRecordError(f"{where}: record does not have the fields {_FIELDS}")
    if obj["v"] != RECORD_VERSION:
        raise CorruptRecordError(f"{where}: record version {obj['v']!r} is not {RECORD_VERSION}")
    label, w, h, xxh = obj["label"], obj["w"], obj["h"], obj["xxh"]
    if not (type(label) is int and type(w) is int and type(h) is int and type(xxh) is int
            and label >= 0 and w >= 0 and h >= 0 and xxh >= 0):
        raise CorruptRecordError(f"{where}: fields 'label', 'w', 'h', 'xxh' must be non-negative integers")
    if obj["fmt"] not in FORMAT_CODES:
        raise CorruptRecordError(f"{where}: unknown image format {obj['fmt']!r}")
    if type(obj["img"]) is not bytes or type(obj["path"]) is not bytes:
        raise CorruptRecordError(f"{where}: 'img' and 'path' must be binary")
    if verify and checksum(obj["img"]) != xxh:
        raise CorruptRecordError(f"{where}: image checksum mismatch (the record is damaged)")
    return obj


def decode_record(buf: bytes | memoryview, *, where: str = "", verify: bool = True) -> Record:
    """Unpack and validate one record.

    Raises :class:`CorruptRecordError` (message prefixed with ``where``) for
    anything that is not a well-formed record: bad msgpack, wrong types, a
    version we do not know, or (with ``verify``) an image checksum mismatch.
    """
    obj = _unpack_record(buf, where, verify)
    return Record(obj["label"], obj["w"], obj["h"], obj["fmt"], obj["xxh"], obj["path"], obj["img"])


def record_image(buf: bytes | memoryview, *, where: str = "") -> bytes:
    """The validated, checksum-verified image bytes of one record (the readers'
    hot path: same checks as :func:`decode_record`, no :class:`Record` built)."""
    return _unpack_record(buf, where, True)["img"]


#: the per-shard index arrays and their on-disk dtypes (explicit little-endian);
#: both backends store exactly these (see their spec modules and docs/FORMAT.md)
INDEX_DTYPES = {
    "labels": "<i8",
    "checksums": "<u8",
    "widths": "<i4",
    "heights": "<i4",
    "formats": "u1",
    "nbytes": "<i8",
    "relpaths": "u1",
    "relpath_offsets": "<i8",
}


@dataclass
class ShardIndex:
    """Per-sample metadata of one shard as numpy arrays (no per-sample objects)."""

    labels: np.ndarray          # int64 [n]
    checksums: np.ndarray       # uint64 [n]
    widths: np.ndarray          # int32 [n]
    heights: np.ndarray         # int32 [n]
    formats: np.ndarray         # uint8 [n], FORMAT_CODES
    nbytes: np.ndarray          # int64 [n], stored image byte length
    relpaths: np.ndarray        # uint8 [total], concatenated relpath bytes
    relpath_offsets: np.ndarray  # int64 [n + 1]

    def __len__(self) -> int:
        return len(self.labels)

    def relpath(self, i: int) -> bytes:
        return self.relpaths[self.relpath_offsets[i]:self.relpath_offsets[i + 1]].tobytes()

    def validate(self, where: str) -> None:
        """Raise :class:`CorruptRecordError` when the arrays are inconsistent."""
        n = len(self.labels)
        for name in ("checksums", "widths", "heights", "formats", "nbytes"):
            if len(getattr(self, name)) != n:
                raise CorruptRecordError(
                    f"{where}: index array {name!r} has {len(getattr(self, name))} entries, expected {n}")
        off = self.relpath_offsets
        if len(off) != n + 1 or (n and (off[0] != 0 or off[-1] != len(self.relpaths) or np.any(np.diff(off) < 0))):
            raise CorruptRecordError(f"{where}: relpath offsets are inconsistent")
        if n and (self.labels.min() < 0 or self.nbytes.min() < 0):
            raise CorruptRecordError(f"{where}: negative label or size in the index")
        if n and not np.isin(self.formats, list(FORMAT_NAMES)).all():
            raise CorruptRecordError(f"{where}: unknown format code in the index")


class IndexBuilder:
    """Accumulates a :class:`ShardIndex` while a shard is written."""

    def __init__(self) -> None:
        self._labels: list[int] = []
        self._checksums: list[int] = []
        self._widths: list[int] = []
        self._heights: list[int] = []
        self._formats: list[int] = []
        self._nbytes: list[int] = []
        self._paths = bytearray()
        self._path_offsets = [0]

    def add(self, *, label: int, xxh: int, width: int, height: int, fmt: str, nbytes: int, relpath: bytes) -> None:
        self._labels.append(label)
        self._checksums.append(xxh)
        self._widths.append(width)
        self._heights.append(height)
        self._formats.append(FORMAT_CODES[fmt])
        self._nbytes.append(nbytes)
        self._paths += relpath
        self._path_offsets.append(len(self._paths))

    def __len__(self) -> int:
        return len(self._labels)

    def build(self) -> ShardIndex:
        return ShardIndex(
            labels=np.asarray(self._labels, dtype=np.int64),
            checksums=np.asarray(self._checksums, dtype=np.uint64),
            widths=np.asarray(self._widths, dtype=np.int32),
            heights=np.asarray(self._heights, dtype=np.int32),
            formats=np.asarray(self._formats, dtype=np.uint8),
            nbytes=np.asarray(self._nbytes, dtype=np.int64),
            relpaths=np.frombuffer(bytes(self._paths), dtype=np.uint8).copy(),
            relpath_offsets=np.asarray(self._path_offsets, dtype=np.int64),
        )
