"""Added fields: values given to a published store after it was written (``fastdata.add_fields``).

The one place that declares this file kind. An added field's values live in *field files* beside
the shards, one per shard and per ``add_fields`` call (a *generation*), never in a shard file: no
shard is rewritten, so a store grows by columns the way an append grows it by rows.

Manifest (both optional; a store without added fields has neither)::

    "added_fields": [{"name": "clip", "field": {"kind": "ndarray", "dtype": "float16", "shape": [512]},
                      "generation": 1, "added": "2026-12-07T15:50:17Z"}, ...]
    "shards": [{..., "field_files": [{"name": "fields-00001.shard-00000.lmdb.fdf", "generation": 1,
                                      "bytes": int, "xxh": str}]}, ...]

Every generation that ``added_fields`` names has exactly one field file in every shard entry, and
a shard entry lists no other. A field file (``FIELD_FILE_MAGIC``, then the little-endian uint64
length of a msgpack header, then the arrays it places, each at a 64-byte aligned offset)::

    header = {"format": "fastdata-field-file", "version": 1, "count": n,
              "arrays": {KEY: [DTYPE, SHAPE, OFFSET, NBYTES, XXH]}}

``KEY`` is, for each field of the generation: ``<name>`` (a fixed-size field: the field's
dtype, shape ``[n, *shape]``: what ``ds.column`` returns, read without opening a shard), or
``<name>.offsets`` (``<i8 [n + 1]``), ``<name>.checksums`` (``<u8 [n]``, xxh3-64 of each
value's bytes) and ``<name>.data`` (``|u1``: the values one after another, each the msgpack of
the field kind's stored value, exactly what a record would hold for it) for any other field; an
image field also has ``<name>.format|.width|.height|.dtype|.channels`` (``IMAGE_META_ARRAYS``:
each image's format code, size, pixel dtype code and channels, as a written image field's index
arrays hold them); a chunked field also has ``<name>.shape`` (``<i8 [n, ndim]``), ``<name>.first``
(``<u8 [n]``) and ``<name>.chunks`` (``|u1``: every value's stored chunks, back to back in grid
order, compressed with the field's codec exactly as a shard stores them; value ``j``'s start at
byte ``first[j]``), its values being the chunk tables (``CHUNKED_ARRAYS``).
``OFFSET`` is from the file's start, ``XXH`` the xxh3-64 hex digest of the array's bytes.

A file is untrusted input: the header is read with a bound, every array is checked against the
file's size and against the field the manifest declares before anything is read, and every
array or value is checked against its checksum when read.
"""

from __future__ import annotations

import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import xxhash

from fastdata.common.bounded import unpackb_bounded
from fastdata.errors import CorruptRecordError, FormatError
from fastdata.format.fields import Chunked, Field, Image, SchemaError, field_from_json
from fastdata.format.names import check_file_name

#: manifest key: the added fields, in the order they were added
ADDED_FIELDS_KEY = "added_fields"
#: shard entry key: the shard's field files
FIELD_FILES_KEY = "field_files"
#: only while values computed shard by shard are being added (``fastdata.compute_fields``): the
#: run's plan and each finished shard's field file, for ``resume=True``
FIELDS_STAGING_DIR = ".fastdata-fields-staging"
#: the first bytes of every field file (the last two: the layout version)
FIELD_FILE_MAGIC = b"FDFIELD\x01"
FIELD_FILE_FORMAT = "fastdata-field-file"
FIELD_FILE_VERSION = 1
_HEAD = struct.Struct("<8sQ")
#: the largest header a field file may have (it lists a few arrays per field)
MAX_HEADER_BYTES = 1 << 20
#: arrays start at multiples of this (aligned reads, and numpy views of a mapped file)
ALIGN = 64
#: the most generations a store may have (names have 5 digits)
MAX_GENERATION = 99999
_FIELD_FILE_RE = re.compile(r"fields-([0-9]{5})\.(.+)\.fdf")
#: the numeric dtypes an array of a field file may have
_ARRAY_DTYPES = frozenset({"|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8"})


def field_file_name(generation: int, shard: str) -> str:
    """The field file of generation ``generation`` beside shard ``shard``."""
    return f"fields-{generation:05d}.{shard}.fdf"


def is_field_file_name(name: str) -> bool:
    """Whether ``name`` is a field file's name (of some generation and shard)."""
    return _FIELD_FILE_RE.fullmatch(name) is not None


def field_file_generation(name: str) -> int | None:
    """The generation in a field file's name, None for another name."""
    match = _FIELD_FILE_RE.fullmatch(name)
    return int(match.group(1)) if match else None


def field_file_shard(name: str) -> str | None:
    """The shard a field file's name places it beside, None for another name."""
    match = _FIELD_FILE_RE.fullmatch(name)
    return match.group(2) if match else None


def addable(field: Field) -> str | None:
    """Why ``field`` cannot be added to a store (None: it can). Every kind can: a chunked field's
    chunks go into the field file itself (``<key>.chunks``, see the module docstring)."""
    return None


#: per-sample arrays an added image field's field file holds besides its values (the
#: ``fields/<image>.*`` index arrays of a written image field: format code, size, pixel dtype
#: code and channel count, from the validation decode when it was added)
IMAGE_META_ARRAYS = {"format": "|u1", "width": "<i4", "height": "<i4", "dtype": "|u1", "channels": "<u2"}
#: per-sample arrays an added chunked field's field file holds besides its values (its chunk
#: tables): each value's shape (``[n, ndim]``, a written chunked field's ``fields/<name>.shape``),
#: where its first chunk starts in ``<key>.chunks`` (``[n]``, bytes) and the stored chunks
#: themselves, each value's back to back in grid order (``[total]`` bytes)
CHUNKED_ARRAYS = {"shape": "<i8", "first": "<u8", "chunks": "|u1"}


@dataclass(frozen=True)
class AddedField:
    """One added field as the manifest declares it."""

    name: str
    field: Field
    generation: int
    added: str
    #: the name its values are stored under in the generation's field files (the name it was
    #: added with: a rename changes only :attr:`name`)
    key: str
    #: ``(value,)``: the value an append gives the new samples when it is given none for this
    #: field (a JSON value the field's kind accepts); ``()``: no default, an append must give values
    default: tuple = ()

    def to_json(self) -> dict:
        out = {"name": self.name, "field": self.field.to_json(), "generation": self.generation,
               "added": self.added, "key": self.key}
        if self.default:
            out["default"] = self.default[0]
        return out

    @property
    def fixed(self) -> bool:
        """Whether its values are fixed-size numbers (one array row a sample, like the index)."""
        return self.field.index_shape is not None


def added_fields(manifest: dict, where: str = "manifest") -> list[AddedField]:
    """The added fields a manifest declares (checked: see :func:`validate_added`)."""
    out = []
    for i, entry in enumerate(manifest.get(ADDED_FIELDS_KEY) or []):
        if not (isinstance(entry, dict) and set(entry) - {"default"} == {"name", "field", "generation", "added", "key"}
                and isinstance(entry["name"], str) and isinstance(entry["key"], str)
                and type(entry["generation"]) is int
                and 1 <= entry["generation"] <= MAX_GENERATION and isinstance(entry["added"], str)
                and isinstance(entry["field"], dict) and "name" not in entry["field"]):
            raise FormatError(f"{where}: {ADDED_FIELDS_KEY}[{i}] is not {{'name': str, 'field': {{kind...}}, "
                              f"'generation': 1..{MAX_GENERATION}, 'added': str, 'key': str[, 'default': value]}}")
        field = field_from_json(entry["field"], f"{where}: added field {entry['name']!r}")
        why = addable(field)
        if why is not None:
            raise FormatError(f"{where}: added field {entry['name']!r}: {why}")
        default: tuple = ()
        if "default" in entry:
            try:
                field.check(entry["default"], f"{where}: added field {entry['name']!r}: its default")
            except SchemaError as err:
                raise FormatError(str(err)) from None
            default = (entry["default"],)
        out.append(AddedField(entry["name"], field, entry["generation"], entry["added"], entry["key"], default))
    return out


def validate_added(body: dict, base_names: tuple[str, ...], where: str) -> None:
    """Check a manifest's added fields and every shard's field files against each other.

    Raises:
        FormatError: a malformed entry, a name the store has already, a generation without a file
            in some shard (or a file of a generation no field has), or a file name that is not
            the field file name of its generation and shard.
    """
    if ADDED_FIELDS_KEY not in body:
        if any(FIELD_FILES_KEY in s for s in body["shards"]):
            raise FormatError(f"{where}: shards list field files but the manifest declares no added fields")
        return
    if type(body[ADDED_FIELDS_KEY]) is not list:
        raise FormatError(f"{where}: manifest field {ADDED_FIELDS_KEY!r} is not list")
    fields = added_fields(body, where)
    from fastdata.format.fields import Schema

    try:  # names: identifiers, unique
        if fields:
            Schema(tuple((a.name, a.field) for a in fields))
    except SchemaError as err:
        raise FormatError(f"{where}: added fields: {err}") from None
    clash = sorted({a.name for a in fields} & set(base_names))
    if clash:
        raise FormatError(f"{where}: added field(s) {', '.join(clash)} have the name of a field the store was "
                          "written with")
    keys = [(a.generation, a.key) for a in fields]
    if len(set(keys)) != len(keys):
        raise FormatError(f"{where}: two added fields read the same values (generation and key)")
    generations = sorted({a.generation for a in fields})
    seen: set[str] = set()
    for shard in body["shards"]:
        files = shard.get(FIELD_FILES_KEY, [])
        if not isinstance(files, list):
            raise FormatError(f"{where}: shard {shard['name']}: {FIELD_FILES_KEY!r} is not a list")
        gens = []
        for entry in files:
            if not (isinstance(entry, dict) and set(entry) == {"name", "generation", "bytes", "xxh"}
                    and type(entry["generation"]) is int and type(entry["bytes"]) is int and entry["bytes"] >= 0
                    and isinstance(entry["xxh"], str) and isinstance(entry["name"], str)):
                raise FormatError(f"{where}: shard {shard['name']}: a field file entry is not "
                                  "{'name': str, 'generation': int, 'bytes': int, 'xxh': str}")
            name = entry["name"]
            if (check_file_name(name) is not None or name != field_file_name(entry["generation"], shard["name"])
                    or name in seen):
                raise FormatError(f"{where}: shard {shard['name']}: field file {name!r:.80} is not this shard's "
                                  f"field file of generation {entry['generation']} (or is listed twice)")
            seen.add(name)
            gens.append(entry["generation"])
        if sorted(gens) != generations:
            raise FormatError(f"{where}: shard {shard['name']}: its field files are of generations {sorted(gens)}, "
                              f"the added fields of generations {generations}; the store is damaged")


def field_files(shard: dict) -> dict[int, dict]:
    """A (validated) shard entry's field files by generation."""
    return {e["generation"]: e for e in shard.get(FIELD_FILES_KEY, [])}


# -- the file ------------------------------------------------------------------------------

def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _little(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))


def encode_value(field: Field, value: Any) -> bytes:
    """A checked value of a record-resident field as the bytes a field file stores."""
    return msgpack.packb(field.encode(value), use_bin_type=True)


def build_field_file(count: int, arrays: dict[str, np.ndarray]) -> list[bytes | memoryview]:
    """A field file's bytes, in pieces to write one after another (no copy of the arrays)."""
    entries: dict[str, list] = {}
    little = {key: _little(arr) for key, arr in arrays.items()}
    # the header's size depends on the offsets it lists: place with a bound, then pad to it
    header_guess = 256 + 160 * len(little)
    offset = _align(_HEAD.size + header_guess)
    for key, arr in little.items():
        entries[key] = [arr.dtype.str, list(arr.shape), offset, arr.nbytes, xxhash.xxh3_64_hexdigest(arr.data)]
        offset = _align(offset + arr.nbytes)
    header = msgpack.packb({"format": FIELD_FILE_FORMAT, "version": FIELD_FILE_VERSION, "count": count,
                            "arrays": entries}, use_bin_type=True)
    assert len(header) <= header_guess, "field file header larger than its bound"
    pieces: list[bytes | memoryview] = [_HEAD.pack(FIELD_FILE_MAGIC, len(header)), header]
    pos = _HEAD.size + len(header)
    for key, arr in little.items():
        start = entries[key][2]
        pieces.append(bytes(start - pos))
        pieces.append(arr.reshape(-1).view(np.uint8).data if arr.nbytes else b"")
        pos = start + arr.nbytes
    return pieces


@dataclass(frozen=True)
class ArrayEntry:
    """Where one array of a field file lies, and what it is (checked against the file's size)."""

    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    xxh: str


def expected_arrays(fields: list[AddedField], count: int) -> dict[str, tuple[np.dtype | None, tuple[int, ...] | None]]:
    """``{key: (dtype, shape)}`` the field file of ``fields`` (one generation) must hold for a
    shard of ``count`` records (``None``: any length, the values' bytes)."""
    out: dict[str, tuple[np.dtype | None, tuple[int, ...] | None]] = {}
    for a in fields:
        layout = a.field.index_shape
        if layout is not None:
            out[a.key] = (layout[0].newbyteorder("<"), (count, *layout[1]))
        else:
            out[a.key + ".offsets"] = (np.dtype("<i8"), (count + 1,))
            out[a.key + ".checksums"] = (np.dtype("<u8"), (count,))
            out[a.key + ".data"] = (np.dtype("|u1"), None)
            if isinstance(a.field, Image):
                out.update({f"{a.key}.{meta}": (np.dtype(dtype), (count,))
                            for meta, dtype in IMAGE_META_ARRAYS.items()})
            if isinstance(a.field, Chunked):
                out[a.key + ".shape"] = (np.dtype("<i8"), (count, a.field.ndim))
                out[a.key + ".first"] = (np.dtype("<u8"), (count,))
                out[a.key + ".chunks"] = (np.dtype("|u1"), None)
    return out


def value_parts(field: Field) -> tuple[str, ...]:
    """The parts (``<key>.<part>`` arrays) of a record-resident added field's values."""
    extra = IMAGE_META_ARRAYS if isinstance(field, Image) else CHUNKED_ARRAYS if isinstance(field, Chunked) else ()
    return ("offsets", "checksums", "data", *extra)


def chunked_tables(field: Chunked, shapes: np.ndarray, firsts: np.ndarray, chunks_bytes: int, tables: list[bytes],
                   where: str, name: str) -> list[Any]:
    """Each value's :class:`~fastdata.format.chunks.ChunkTable` of an added chunked field (one
    shard's), from its stored shapes, first-chunk offsets and table bytes, refused unless every
    value's chunks lie inside the ``chunks_bytes`` of its ``<key>.chunks`` array.

    Raises:
        CorruptRecordError: naming ``where``, the field and the first bad record.
    """
    from fastdata.format.chunks import ChunkTable, check_shape

    out = []
    for i, raw in enumerate(tables):
        at = f"{where} field {name!r} record {i}"
        shape = check_shape(shapes[i], field.chunks, field.dtype.itemsize, at)
        table = ChunkTable.from_bytes(raw, shape, field.chunks, at)
        if int(firsts[i]) + table.stored_bytes > chunks_bytes:
            raise CorruptRecordError(f"{at}: its chunks ({table.stored_bytes} bytes from {int(firsts[i])}) end past "
                                     f"the field file's {chunks_bytes} bytes of chunks")
        out.append(table)
    return out


def check_image_meta(arrays: dict[str, np.ndarray], where: str, name: str) -> None:
    """Refuse an added image field's per-sample format or dtype codes that name no format or
    dtype (``arrays``: its parts by name), and negative sizes.

    Raises:
        CorruptRecordError: naming ``where``, the field and the first bad record.
    """
    from fastdata.format.record import FORMAT_NAMES, IMAGE_DTYPE_NAMES, NOT_RECORDED

    for part, allowed in (("format", list(FORMAT_NAMES)), ("dtype", [NOT_RECORDED, *IMAGE_DTYPE_NAMES])):
        bad = ~np.isin(arrays[part], allowed)
        if bad.any():
            raise CorruptRecordError(f"{where}: added image field {name!r} record {int(np.flatnonzero(bad)[0])}: "
                                     f"unknown {part} code {int(arrays[part][bad][0])}")
    for part in ("width", "height"):
        if (arrays[part] < 0).any():
            raise CorruptRecordError(f"{where}: added image field {name!r}: a negative {part}")


def parse_header(head: bytes, size: int, fields: list[AddedField], count: int, where: str) -> dict[str, ArrayEntry]:
    """The arrays of a field file from its first bytes ``head`` (at least ``_HEAD.size`` +
    the header; :func:`header_bytes` says how many), checked against the file's ``size`` and
    against what ``fields`` of a shard of ``count`` records need.

    Raises:
        CorruptRecordError: naming ``where`` and what is wrong.
    """
    if len(head) < _HEAD.size:
        raise CorruptRecordError(f"{where}: field file shorter than its header ({size} bytes)")
    magic, length = _HEAD.unpack_from(head)
    if magic != FIELD_FILE_MAGIC:
        raise CorruptRecordError(f"{where}: not a fastdata field file (or one of another layout version)")
    if length > MAX_HEADER_BYTES or _HEAD.size + length > min(size, len(head)):
        raise CorruptRecordError(f"{where}: field file header of {length} bytes does not fit the file")
    try:
        body = unpackb_bounded(head[_HEAD.size:_HEAD.size + length], raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as err:
        raise CorruptRecordError(f"{where}: field file header is not readable ({err})") from None
    if not (isinstance(body, dict) and body.get("format") == FIELD_FILE_FORMAT
            and body.get("version") == FIELD_FILE_VERSION and body.get("count") == count
            and isinstance(body.get("arrays"), dict)):
        raise CorruptRecordError(f"{where}: field file header is not a version-{FIELD_FILE_VERSION} field file "
                                 f"of {count} records")
    expected = expected_arrays(fields, count)
    missing = sorted(set(expected) - set(body["arrays"]))  # (more: fields of the generation since dropped)
    if missing:
        raise CorruptRecordError(f"{where}: field file lacks arrays {missing[:8]} that the manifest's fields need")
    out = {}
    for key, (dtype, shape) in expected.items():
        value = body["arrays"][key]
        ok = (isinstance(value, list) and len(value) == 5 and isinstance(value[0], str) and value[0] in _ARRAY_DTYPES
              and isinstance(value[1], list) and all(type(d) is int and d >= 0 for d in value[1])
              and all(type(v) is int for v in value[2:4]) and isinstance(value[4], str))
        if ok:
            got_dtype, got_shape = np.dtype(value[0]), tuple(value[1])
            offset, nbytes = value[2], value[3]
            ok = (got_dtype == dtype and (got_shape == shape if shape is not None else len(got_shape) == 1)
                  and nbytes == math.prod(got_shape) * got_dtype.itemsize
                  and _HEAD.size + length <= offset and offset + nbytes <= size)
        if not ok:
            raise CorruptRecordError(f"{where}: field file array {key!r} is damaged or does not match the field "
                                     f"({value!r:.120})")
        out[key] = ArrayEntry(got_dtype, got_shape, offset, nbytes, value[4])
    return out


def header_bytes(first: bytes) -> int:
    """How many bytes from a field file's start hold its header, from its first 16 bytes (the
    most to read: at most :data:`MAX_HEADER_BYTES` plus 16, whatever the file says)."""
    if len(first) < _HEAD.size:
        return _HEAD.size
    return _HEAD.size + min(_HEAD.unpack_from(first)[1], MAX_HEADER_BYTES + 1)


def array_of(entry: ArrayEntry, raw: bytes | memoryview, where: str, key: str) -> np.ndarray:
    """Array ``key`` from its bytes ``raw``, checked against its checksum (read-only)."""
    if len(raw) != entry.nbytes or xxhash.xxh3_64_hexdigest(raw) != entry.xxh:
        raise CorruptRecordError(f"{where}: field file array {key!r} does not match its checksum")
    return np.frombuffer(raw, dtype=entry.dtype).reshape(entry.shape)


def check_offsets(offsets: np.ndarray, data_bytes: int, where: str, name: str) -> None:
    """A record-resident field's offsets: from 0, never decreasing, ending at the data's size."""
    if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != data_bytes or bool(np.any(np.diff(offsets) < 0)):
        raise CorruptRecordError(f"{where}: field {name!r}: its value offsets are damaged")


def decode_value(field: Field, raw: bytes, checksum: int, where: str) -> Any:
    """A record-resident value from its stored bytes, checked against its checksum."""
    if xxhash.xxh3_64_intdigest(raw) != checksum:
        raise CorruptRecordError(f"{where}: does not match its checksum")
    try:
        obj = unpackb_bounded(raw, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as err:
        raise CorruptRecordError(f"{where}: not readable ({err})") from None
    try:
        return field.decode(obj, where)
    except FormatError as err:
        raise CorruptRecordError(str(err)) from None


def load_field_file(path: str, fields: list[AddedField], count: int, entry: dict, where: str, *,
                    check_values: bool = True) -> dict[str, dict[str, np.ndarray]]:
    """Read one field file completely: its size and checksum against the manifest's ``entry``,
    its header, every array's checksum, and (``check_values``) every value of a record-resident
    field (offsets, checksum, decoding).

    Returns:
        ``{field name: {"values": array}}`` for a fixed-size field, ``{"offsets", "checksums",
        "data"}`` arrays for any other, an image's also its ``IMAGE_META_ARRAYS`` (what
        :func:`build_field_file` takes, keyed by part: :func:`value_parts`).

    Raises:
        CorruptRecordError: the first problem, naming ``where``, the field and the record.
        OSError: the file cannot be read.
    """
    from fastdata.common import portable
    from fastdata.common.fileio import open_regular

    fd = open_regular(path, "field file")
    try:
        size = os.fstat(fd).st_size
        if size != entry["bytes"]:
            raise CorruptRecordError(f"{where}: {size} bytes, the manifest says {entry['bytes']} (truncated or "
                                     "replaced)")
        digest = xxhash.xxh3_64()
        for offset in range(0, size, 1 << 24):
            digest.update(portable.pread(fd, min(1 << 24, size - offset), offset))
        if digest.hexdigest() != entry["xxh"]:
            raise CorruptRecordError(f"{where}: file checksum mismatch (the field file was modified or damaged)")
        head = portable.pread(fd, header_bytes(portable.pread(fd, _HEAD.size, 0)), 0)
        arrays = parse_header(head, size, fields, count, where)
        out: dict[str, dict[str, np.ndarray]] = {}
        for a in fields:
            if a.fixed:
                e = arrays[a.key]
                out[a.name] = {"values": array_of(e, portable.pread(fd, e.nbytes, e.offset), where, a.key)}
                continue
            loaded = {}
            for part in value_parts(a.field):
                e = arrays[f"{a.key}.{part}"]
                if part == "chunks":  # (possibly large: mapped, not read into memory; the file's size and
                    # checksum were checked above)
                    loaded[part] = _mapped(path, e, where, f"{a.key}.{part}")
                    continue
                loaded[part] = array_of(e, portable.pread(fd, e.nbytes, e.offset), where, f"{a.key}.{part}")
            check_offsets(loaded["offsets"], len(loaded["data"]), where, a.name)
            if isinstance(a.field, Image):
                check_image_meta(loaded, where, a.name)
            if check_values:
                data = loaded["data"].tobytes()
                offsets = loaded["offsets"].tolist()
                values = [decode_value(a.field, data[offsets[i]:offsets[i + 1]], int(loaded["checksums"][i]),
                                       f"{where} field {a.name!r} record {i}") for i in range(count)]
                if isinstance(a.field, Chunked):
                    _check_chunks(a.field, loaded, values, where, a.name)
            out[a.name] = loaded
        return out
    finally:
        os.close(fd)


def _mapped(path: str, entry: ArrayEntry, where: str, key: str) -> np.ndarray:
    """Array ``key`` of a field file mapped read-only (checked against its checksum)."""
    if entry.nbytes == 0:
        return array_of(entry, b"", where, key)
    array = np.memmap(path, dtype=entry.dtype, mode="r", offset=entry.offset, shape=entry.shape)
    if xxhash.xxh3_64_hexdigest(array.data) != entry.xxh:
        raise CorruptRecordError(f"{where}: field file array {key!r} does not match its checksum")
    return array


def _check_chunks(field: Chunked, loaded: dict[str, np.ndarray], tables: list[bytes], where: str, name: str) -> None:
    """Every value of an added chunked field: its shape and table, its chunks inside the file's
    chunks, each chunk's checksum and decoding to its shape."""
    from fastdata.format.chunk_codecs import chunk_codec
    from fastdata.format.chunks import chunk_region, iter_grid

    codec = chunk_codec(field.codec)
    chunks = loaded["chunks"]
    for i, table in enumerate(chunked_tables(field, loaded["shape"], loaded["first"], len(chunks), tables, where,
                                             name)):
        at = f"{where} field {name!r} record {i}"
        start = int(loaded["first"][i])
        for j, (position, size) in enumerate(zip(iter_grid(table.shape, field.chunks), table.nbytes.tolist(),
                                                 strict=False)):
            raw = chunks[start:start + size].tobytes()
            start += size
            if xxhash.xxh3_64_intdigest(raw) != int(table.xxh[j]):
                raise CorruptRecordError(f"{at} chunk {j}: does not match its checksum")
            shape = tuple(r.stop - r.start for r in chunk_region(position, table.shape, field.chunks))
            codec.decode_into(raw, np.empty(shape, dtype=field.dtype), f"{at} chunk {j}")


def check_field_file(path: str, fields: list[AddedField], count: int, entry: dict, where: str) -> int:
    """Check one field file completely (``fastdata verify``: :func:`load_field_file`); returns
    the values checked.

    Raises:
        CorruptRecordError: the first problem, naming ``where``, the field and the record.
        OSError: the file cannot be read.
    """
    load_field_file(path, fields, count, entry, where)
    return count * len(fields)
