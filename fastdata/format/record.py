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

import math
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import xxhash

from fastdata.common.bounded import BYTES_PER_OBJECT, OBJECTS_FLOOR, ExpansionError, object_budget, unpackb_bounded
from fastdata.errors import CorruptRecordError

RECORD_VERSION = 1
#: stored image format names and their 1-byte codes in the index
FORMAT_CODES = {"JPEG": 0, "PNG": 1, "PPM": 2, "BMP": 3, "TIFF": 4, "WEBP": 5, "RAW": 6, "DICOM": 7}
FORMAT_NAMES = {v: k for k, v in FORMAT_CODES.items()}
#: numpy dtype names of stored images (their pixels as stored: ``image_mode="unchanged"``) and their
#: 1-byte codes in the index; code 0 means "not recorded" (stores written before fastdata recorded it)
IMAGE_DTYPE_CODES = {"uint8": 1, "uint16": 2, "int16": 3, "int32": 4, "uint32": 5, "float32": 6, "float64": 7,
                     "int8": 8, "float16": 9, "int64": 10, "uint64": 11}
IMAGE_DTYPE_NAMES = {v: k for k, v in IMAGE_DTYPE_CODES.items()}
#: the index's code for a dtype or channel count that was not recorded
NOT_RECORDED = 0
#: hard limit for one record: refuse to unpack anything larger (hostile input)
MAX_RECORD_BYTES = 1 << 30
_FIELDS = ("v", "label", "w", "h", "fmt", "xxh", "path", "img")
_unpackb = msgpack.unpackb
_UNPACK_LIMITS = dict(raw=False, use_list=False, strict_map_key=True, max_bin_len=MAX_RECORD_BYTES,
                      max_str_len=1 << 16, max_array_len=16, max_map_len=16, max_ext_len=0)


def checksum(data: bytes | memoryview | np.ndarray) -> int:
    """xxh3-64 of ``data`` as an unsigned int (the per-record checksum).

    python-xxhash releases the GIL while it hashes more than about 100 kB: a raw record's pixels
    come from main memory at a few GB/s (60-80 us for 400 kB here), long enough that thread
    workers gain from hashing outside the GIL (held, it was a quarter of the time the GIL was held)."""
    return xxhash.xxh3_64_intdigest(data.data if isinstance(data, np.ndarray) else data)


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


def _unpack_bounded(buf: bytes | memoryview, where: str, limits: dict, counted: bool = False) -> Any:
    """msgpack-decode one stored record under ``limits`` (``msgpack.unpackb`` keyword arguments);
    ``counted``: also under :func:`fastdata.common.bounded.object_budget` (records whose
    fields may nest: version 2).

    Raises:
        CorruptRecordError: the record is larger than :data:`MAX_RECORD_BYTES`, is not
            valid msgpack, or would decode to more objects than its budget (named by ``where``).
    """
    if len(buf) > MAX_RECORD_BYTES:
        raise CorruptRecordError(f"{where}: record of {len(buf)} bytes exceeds the {MAX_RECORD_BYTES} byte limit")
    try:
        return unpackb_bounded(buf, **limits) if counted else _unpackb(buf, **limits)
    except Exception as err:  # msgpack raises several unrelated types on garbage
        if counted and (isinstance(err, ExpansionError) or "exceeds max_" in str(err)):
            what = f"it {err}" if isinstance(err, ExpansionError) else str(err)
            raise CorruptRecordError(
                f"{where}{_largest_field(buf)}: record refused as an expansion bomb ({what}; a record of "
                f"{len(buf):,} bytes may decode to at most {object_budget(len(buf)):,} objects)") from None
        raise CorruptRecordError(f"{where}: record is not valid msgpack ({type(err).__name__}: {err})") from None


def _largest_field(buf: bytes | memoryview) -> str:
    """`` field 'name'``: the key of the record map's largest value (what made it expand), found
    by skipping values without building them; empty when the map cannot be walked."""
    try:
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(buf) + 1, max_str_len=1 << 16,
                                    max_bin_len=0, max_array_len=0, max_map_len=1 << 16, max_ext_len=0)
        unpacker.feed(buf)
        best, best_size = None, -1
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            start = unpacker.tell()
            unpacker.skip()
            if unpacker.tell() - start > best_size:
                best, best_size = key, unpacker.tell() - start
        return f" field {best!r}" if isinstance(best, str) else ""
    except Exception:  # noqa: BLE001 - only a nicer message: any failure leaves it out
        return ""


def _unpack_record(buf: bytes | memoryview, where: str, verify: bool) -> dict:
    obj = _unpack_bounded(buf, where, _UNPACK_LIMITS)
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


def _bin_header(n: int) -> bytes:
    """The header msgpack writes before ``n`` bytes of ``bin`` (the smallest form: bin8/16/32)."""
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


#: an empty ``bin`` value: what the image is replaced by to check the rest of a record with msgpack
_EMPTY_BIN = _bin_header(0)


def record_image_view(buf: memoryview, nbytes: int, *, where: str = "",
                      expected: int | None = None) -> bytes | memoryview:
    """:func:`record_image` without copying the image out of ``buf``: the same checks (the record
    decoded by msgpack, its fields, version and checksum), the image returned as a view of
    ``buf``'s last ``nbytes`` bytes, valid as long as ``buf`` is. The writer puts the image last
    (``img`` is the last field), so the record is its head, the image's ``bin`` header, then the
    image: the head is checked with an empty image in its place. A record of another layout
    (``nbytes`` not what it holds, a header of another width) takes :func:`record_image`'s path,
    with its verdict and a copy. ``expected``: the checksum the store's index lists for this
    record, which the record's own must equal (it is the record the index lists).

    Raises:
        CorruptRecordError: as :func:`record_image`, or the record's checksum is not ``expected``.
    """
    header = _bin_header(nbytes)
    cut = len(buf) - nbytes - len(header)
    if nbytes <= 0 or cut <= 0 or buf[cut:cut + len(header)] != header:
        obj = _unpack_record(buf, where, True)
        image = obj["img"]
    else:
        obj = _unpack_record(bytes(buf[:cut]) + _EMPTY_BIN, where, False)
        image = buf[cut + len(header):]
        if checksum(image) != obj["xxh"]:
            raise CorruptRecordError(f"{where}: image checksum mismatch (the record is damaged)")
    if expected is not None and obj["xxh"] != expected:
        raise CorruptRecordError(f"{where}: checksum mismatch (the record is not the one the index lists)")
    return image


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
    "dtypes": "u1",
    "channels": "<u2",
}
#: the store index file's optional array of where each record's stored bytes lie in its shard file:
#: ``<u8 [n, k, 2]``, row ``j, p`` = the file offset and length of piece ``p`` of record ``j`` (the
#: bytes a shard reader's lookup gives before it decodes them: an LMDB value with its tail parts,
#: an HDF5 record's slice of the payload), zero-length pieces ignored. Written by the shard writers
#: (who have the finished file), so that one record of a remote store is read with a ranged request
#: (docs/FORMAT.md, section 3a); never in a shard's own index
RECORD_RANGES = "record_ranges"
#: most pieces one record's row may have (an LMDB head and at most 64 tail parts)
MAX_RECORD_PIECES = 65
#: index arrays a store written before fastdata recorded them lacks: read as :data:`NOT_RECORDED`
OPTIONAL_INDEX_ARRAYS = frozenset({"dtypes", "channels"})


def image_dtype_code(dtype: str) -> int:
    """The index code of an image's numpy dtype name (``"uint16"`` -> 2).

    Raises:
        ValueError: a dtype no stored image may have (complex, object, ...).
    """
    try:
        return IMAGE_DTYPE_CODES[dtype]
    except KeyError:
        raise ValueError(f"images of dtype {dtype} cannot be stored (supported: {', '.join(IMAGE_DTYPE_CODES)})") \
            from None


def v1_index_arrays(get, count: int, where: str) -> dict[str, np.ndarray]:
    """The arrays of a version-1 shard index from ``get(name) -> bytes | None`` (a backend's stored
    arrays), in native byte order. The arrays of :data:`OPTIONAL_INDEX_ARRAYS` that a store written
    before they existed lacks read as zeros (:data:`NOT_RECORDED`); any other missing or damaged
    array raises :class:`CorruptRecordError`."""
    arrays = {}
    for name, dtype in INDEX_DTYPES.items():
        buf = get(name)
        if buf is None and name in OPTIONAL_INDEX_ARRAYS:
            arrays[name] = np.zeros(count, dtype=np.dtype(dtype).newbyteorder("="))
            continue
        if isinstance(buf, np.ndarray):
            buf = np.ascontiguousarray(buf, dtype=dtype).tobytes()
        if buf is None or len(buf) % np.dtype(dtype).itemsize:
            raise CorruptRecordError(f"{where}: index array {name!r} missing or damaged")
        arrays[name] = np.frombuffer(buf, dtype=dtype).astype(np.dtype(dtype).newbyteorder("="))
    return arrays


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
    dtypes: np.ndarray          # uint8 [n], IMAGE_DTYPE_CODES (0: not recorded)
    channels: np.ndarray        # uint16 [n] (0: not recorded)
    #: where each record's stored bytes lie in the shard file, for the store index file only
    #: (see :data:`RECORD_RANGES`); None where the writer did not learn them (an older store)
    record_ranges: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def relpath(self, i: int) -> bytes:
        return self.relpaths[self.relpath_offsets[i]:self.relpath_offsets[i + 1]].tobytes()

    def validate(self, where: str) -> None:
        """Raise :class:`CorruptRecordError` when the arrays are inconsistent."""
        n = len(self.labels)
        for name in ("checksums", "widths", "heights", "formats", "nbytes", "dtypes", "channels"):
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
        if n and not np.isin(self.dtypes, [NOT_RECORDED, *IMAGE_DTYPE_NAMES]).all():
            raise CorruptRecordError(f"{where}: unknown image dtype code in the index")


class IndexBuilder:
    """Accumulates a :class:`ShardIndex` while a shard is written."""

    def __init__(self) -> None:
        self._labels: list[int] = []
        self._checksums: list[int] = []
        self._widths: list[int] = []
        self._heights: list[int] = []
        self._formats: list[int] = []
        self._nbytes: list[int] = []
        self._dtypes: list[int] = []
        self._channels: list[int] = []
        self._paths = bytearray()
        self._path_offsets = [0]

    def add(self, *, label: int, xxh: int, width: int, height: int, fmt: str, nbytes: int, relpath: bytes,
            dtype: str = "uint8", channels: int = 3) -> None:
        self._dtypes.append(image_dtype_code(dtype))
        self._channels.append(channels)
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
            dtypes=np.asarray(self._dtypes, dtype=np.uint8),
            channels=np.asarray(self._channels, dtype=np.uint16),
        )


# -- layout version 2: stores of general samples (any schema but the classification one) -------------------------

#: version of general (schema) records and shards
RECORD_VERSION_2 = 2
#: per image field, what the writer learnt from its validation decode
IMAGE_META = {"format": "u1", "width": "<i4", "height": "<i4", "dtype": "u1", "channels": "<u2"}
#: image-field index keys a store written before fastdata recorded them lacks (read as NOT_RECORDED)
OPTIONAL_IMAGE_META = frozenset({"dtype", "channels"})
#: prefix of a field's index arrays: a field may be called "checksums" without clashing with the layout's arrays
FIELD_PREFIX = "fields/"
#: use_list=True: json fields come back as the lists they were written as, without a rebuild
_UNPACK_V2 = dict(raw=False, use_list=True, strict_map_key=True, max_ext_len=0)


def index_layout(schema) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """Every index array of a version-2 shard of ``schema``: key -> (dtype, per-sample shape).

    ``checksums`` (xxh3_64 of each record's bytes), ``nbytes`` (record length) and,
    per field, ``fields/<name>`` for index-resident fields (ints, floats, small
    fixed arrays) and ``fields/<image>.format|.width|.height|.dtype|.channels`` for image fields.
    ``relpaths``/``relpath_offsets`` are variable-length and not listed here.
    """
    out: dict[str, tuple[np.dtype, tuple[int, ...]]] = {
        "checksums": (np.dtype("<u8"), ()), "nbytes": (np.dtype("<i8"), ())}
    for name, (dtype, shape) in schema.index_fields().items():
        out[FIELD_PREFIX + name] = (dtype, shape)
    for name in schema.image_fields():
        for meta, dtype in IMAGE_META.items():
            out[f"{FIELD_PREFIX}{name}.{meta}"] = (np.dtype(dtype), ())
    for name in schema.chunked_fields():
        out[f"{FIELD_PREFIX}{name}.shape"] = (np.dtype("<i8"), (schema[name].ndim,))
        out[f"{FIELD_PREFIX}{name}.first"] = (np.dtype("<u8"), ())
    return out


def chunk_first_key(name: str) -> str:
    """The index key of where a chunked field's first chunk is (see the backends' ``spec.py``)."""
    return f"{FIELD_PREFIX}{name}.first"


def chunk_shape_key(name: str) -> str:
    """The index key of a chunked field's per-sample shape."""
    return f"{FIELD_PREFIX}{name}.shape"


@dataclass(frozen=True)
class EncodedSample:
    """One general sample ready to store: its record bytes and its index entries."""

    record: bytes
    xxh: int
    relpath: bytes
    #: index key (see :func:`index_layout`, without ``checksums``/``nbytes``) -> value
    index: dict
    #: the chunks of its chunked fields, waiting in files for the shard writer (which sets
    #: each field's ``.first`` index entry when it stores them)
    chunks: tuple = ()
    #: stored bytes of its chunked fields' chunks (also when they were only measured, not kept)
    chunk_bytes: int = 0

    @property
    def stored_bytes(self) -> int:
        """Bytes this sample adds to a shard: its record and its chunks."""
        return len(self.record) + self.chunk_bytes


def encode_sample(schema, checked: dict, images: dict[str, tuple], relpath: bytes,
                  chunks: tuple = ()) -> EncodedSample:
    """Pack a checked sample (:meth:`Schema.check`) as a version-2 record.

    ``images`` gives each image field's ``(format, width, height)`` or
    ``(format, width, height, dtype, channels)`` from its validation decode
    (without the last two: ``uint8`` and 3 channels). A chunked field's checked value is the
    :class:`~fastdata.format.chunks.ChunkTable` its chunks were written with, and ``chunks`` the
    :class:`~fastdata.format.chunks.PendingChunks` holding them. The record is one msgpack map
    ``{"v": 2, "path": bin, <record field>: Field.encode(value), ...}`` in schema order.
    """
    body: dict = {"v": RECORD_VERSION_2, "path": bytes(relpath)}
    index: dict = {}
    for name, field in schema.fields:
        if field.index_shape is None:
            body[name] = field.encode(checked[name])
        else:
            index[FIELD_PREFIX + name] = checked[name]
    for name, info in images.items():
        fmt, width, height = info[:3]
        dtype, channels = info[3:5] if len(info) >= 5 else ("uint8", 3)
        index[f"{FIELD_PREFIX}{name}.format"] = FORMAT_CODES[fmt]
        index[f"{FIELD_PREFIX}{name}.width"] = width
        index[f"{FIELD_PREFIX}{name}.height"] = height
        index[f"{FIELD_PREFIX}{name}.dtype"] = image_dtype_code(dtype)
        index[f"{FIELD_PREFIX}{name}.channels"] = channels
    for name in schema.chunked_fields():
        index[chunk_shape_key(name)] = checked[name].shape
        index[chunk_first_key(name)] = 0  # where the shard writer puts the chunks
    record = msgpack.packb(body, use_bin_type=True)
    if len(record) > OBJECTS_FLOOR:  # smaller ones cannot exceed it (see fastdata.common.bounded)
        _check_record_budget(body, len(record))
    chunk_bytes = sum(checked[name].stored_bytes for name in schema.chunked_fields())
    return EncodedSample(record, checksum(record), bytes(relpath), index, tuple(chunks), chunk_bytes)


def _objects(value: Any) -> int:
    """Objects a value adds when unpacked, as :func:`fastdata.common.bounded.unpackb_bounded` counts them."""
    kind = type(value)
    if kind is list or kind is tuple:
        return 1 + len(value) + sum(_objects(v) for v in value if type(v) in (list, tuple, dict))
    if kind is dict:
        return 1 + 2 * len(value) + sum(_objects(v) for v in value.values() if type(v) in (list, tuple, dict))
    return 0


def _check_record_budget(body: dict, size: int) -> None:
    """Refuse (SchemaError naming the field) a record readers would refuse as an expansion bomb:
    one decoding to more than ``object_budget(size)`` objects."""
    from fastdata.format.fields import SchemaError

    counts = {name: _objects(value) for name, value in body.items()}
    total = 1 + 2 * len(body) + sum(counts.values())
    budget = object_budget(size)
    if total > budget:
        name = max(counts, key=lambda k: counts[k])
        raise SchemaError(f"field {name!r}: {counts[name]:,} values in one record of {size:,} bytes; a record may "
                          f"hold at most {budget:,} (65,536 + 1 per {BYTES_PER_OBJECT} bytes): store large "
                          "arrays as a Ragged or NDArray field, not as JSON lists")


def unpack_record_v2(buf: bytes | memoryview, *, where: str) -> dict:
    """The raw msgpack map of a version-2 record (keys checked, values not decoded yet)."""
    obj = _unpack_bounded(buf, where, _UNPACK_V2, counted=True)
    if type(obj) is not dict or obj.get("v") != RECORD_VERSION_2 or type(obj.get("path")) is not bytes:
        raise CorruptRecordError(f"{where}: not a version-2 record (needs 'v': 2 and a binary 'path')")
    return obj


def decode_record_v2(buf: bytes | memoryview, schema, *, where: str) -> dict:
    """Unpack a version-2 record and decode its record-resident fields (schema order).

    Returns ``{"path": bytes, <field>: value}``. Raises :class:`CorruptRecordError`
    for bad msgpack, a missing or unexpected key, or a value its field refuses.
    """
    from fastdata.errors import FormatError

    obj = unpack_record_v2(buf, where=where)
    names = schema.record_fields()
    if tuple(obj) != ("v", "path", *names):
        raise CorruptRecordError(f"{where}: record has the fields {list(obj)[2:]}, the schema says {list(names)}")
    out = {"path": obj["path"]}
    for name in names:
        try:
            out[name] = schema[name].decode(obj[name], f"{where} field {name!r}")
        except FormatError as err:
            raise CorruptRecordError(str(err)) from None
    return out


@dataclass
class SampleIndex:
    """The index of a version-2 shard: ``arrays`` keyed as :func:`index_layout` says,
    plus ``relpaths``/``relpath_offsets``."""

    arrays: dict
    #: as :attr:`ShardIndex.record_ranges`
    record_ranges: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.arrays["checksums"])

    @property
    def checksums(self) -> np.ndarray:
        return self.arrays["checksums"]

    @property
    def nbytes(self) -> np.ndarray:
        return self.arrays["nbytes"]

    def relpath(self, i: int) -> bytes:
        off = self.arrays["relpath_offsets"]
        return self.arrays["relpaths"][off[i]:off[i + 1]].tobytes()

    def validate(self, schema, where: str) -> None:
        """Raise :class:`CorruptRecordError` when the arrays are inconsistent with each other or the schema."""
        n = len(self)
        for key, (_dtype, shape) in index_layout(schema).items():
            arr = self.arrays.get(key)
            if arr is None or arr.shape != (n, *shape):
                raise CorruptRecordError(f"{where}: index array {key!r} is missing or not of shape {(n, *shape)}")
        off = self.arrays["relpath_offsets"]
        if len(off) != n + 1 or (n and (off[0] != 0 or off[-1] != len(self.arrays["relpaths"])
                                        or np.any(np.diff(off) < 0))):
            raise CorruptRecordError(f"{where}: relpath offsets are inconsistent")
        if n and self.nbytes.min() < 0:
            raise CorruptRecordError(f"{where}: negative record size in the index")
        for name in schema.chunked_fields():
            if n and self.arrays[chunk_shape_key(name)].min() < 0:
                raise CorruptRecordError(f"{where}: negative side in the shapes of chunked field {name!r}")
        for name in schema.image_fields():
            if n and not np.isin(self.arrays[f"{FIELD_PREFIX}{name}.format"], list(FORMAT_NAMES)).all():
                raise CorruptRecordError(f"{where}: unknown format code in the index of image field {name!r}")
            if n and not np.isin(self.arrays[f"{FIELD_PREFIX}{name}.dtype"], [NOT_RECORDED, *IMAGE_DTYPE_NAMES]).all():
                raise CorruptRecordError(f"{where}: unknown image dtype code in the index of image field {name!r}")


def _optional_key(key: str) -> bool:
    """Whether ``key`` is an image field's index array that older stores lack."""
    return key.startswith(FIELD_PREFIX) and key.rsplit(".", 1)[-1] in OPTIONAL_IMAGE_META and "." in key


def read_index_arrays(schema, get, count: int, where: str) -> SampleIndex:
    """Build a :class:`SampleIndex` from ``get(key) -> bytes | np.ndarray | None`` (a backend's
    stored arrays), converting to native byte order; damaged or missing arrays raise."""
    arrays: dict = {}
    layout = dict(index_layout(schema))
    layout["relpaths"] = (np.dtype("u1"), ())
    layout["relpath_offsets"] = (np.dtype("<i8"), ())
    for key, (dtype, shape) in layout.items():
        raw = get(key)
        if raw is None and _optional_key(key):
            arrays[key] = np.zeros((count, *shape), dtype=dtype.newbyteorder("="))
            continue
        if raw is None:
            raise CorruptRecordError(f"{where}: index array {key!r} is missing")
        if isinstance(raw, np.ndarray):
            arr = np.asarray(raw, dtype=dtype)
        else:
            if len(raw) % dtype.itemsize:
                raise CorruptRecordError(f"{where}: index array {key!r} is damaged")
            arr = np.frombuffer(raw, dtype=dtype)
        per = math.prod(shape)
        if key not in ("relpaths", "relpath_offsets"):
            if arr.size != count * per:
                raise CorruptRecordError(f"{where}: index array {key!r} has {arr.size} values, expected {count * per}")
            arr = arr.reshape((count, *shape))
        arrays[key] = arr.astype(dtype.newbyteorder("="))
    index = SampleIndex(arrays)
    index.validate(schema, where)
    return index


class SampleIndexBuilder:
    """Accumulates a :class:`SampleIndex` while a version-2 shard is written."""

    def __init__(self, schema) -> None:
        self.schema = schema
        self.layout = index_layout(schema)
        self._values: dict[str, list] = {key: [] for key in self.layout}
        self._paths = bytearray()
        self._path_offsets = [0]

    def add(self, sample: EncodedSample, placed: dict | None = None) -> None:
        """Add ``sample``'s index entries; ``placed``: entries the shard writer decided (where
        each chunked field's chunks went), which replace the sample's own."""
        self._values["checksums"].append(sample.xxh)
        self._values["nbytes"].append(len(sample.record))
        for key, value in sample.index.items():
            self._values[key].append(value if not placed or key not in placed else placed[key])
        self._paths += sample.relpath
        self._path_offsets.append(len(self._paths))

    def __len__(self) -> int:
        return len(self._values["checksums"])

    def build(self) -> SampleIndex:
        arrays = {}
        n = len(self)
        for key, (dtype, shape) in self.layout.items():
            values = self._values[key]
            arr = np.asarray(values, dtype=dtype) if values else np.zeros((0, *shape), dtype=dtype)
            arrays[key] = arr.reshape((n, *shape))
        arrays["relpaths"] = np.frombuffer(bytes(self._paths), dtype=np.uint8).copy()
        arrays["relpath_offsets"] = np.asarray(self._path_offsets, dtype="<i8")
        return SampleIndex(arrays)
