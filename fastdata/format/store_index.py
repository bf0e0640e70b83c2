"""The store index file: every shard's index arrays in one small file beside the shards.

A reader of a local store gets each shard's index from the shard itself. A reader of
a remote store cannot: LMDB and HDF5 need the whole shard file on local disk before
they can be opened, and downloading every shard to learn the sample count would defeat
a bounded cache. So each store published by this version also holds ``index.fdi``:

    msgpack map {
      "format": "fastdata-store-index", "version": 1,
      "shards": [ {"name": "shard-00000.lmdb", "count": N,
                   "arrays": {key: [dtype, shape, raw little-endian bytes]}} ... ]
    }

The keys and dtypes are exactly those of the shard's own index (``INDEX_DTYPES`` for a
version-1 store; :func:`fastdata.format.record.index_layout` for a general one), plus, in stores
written since it exists, ``record_ranges`` (:data:`fastdata.format.record.RECORD_RANGES`: where each
record lies in its shard file, for reading one record of a remote store with a ranged request). The manifest
names the file with its size and xxh3-64 checksum (key ``store_index``), so a reader
checks it before trusting it. No pickle: arrays are raw bytes with a numeric dtype.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import msgpack
import numpy as np
import xxhash

from fastdata.common.bounded import unpackb_bounded
from fastdata.errors import CorruptRecordError, FormatError
from fastdata.format.names import SIDECAR_SUFFIX, STORE_INDEX_NAME
from fastdata.format.record import (
    INDEX_DTYPES,
    MAX_RECORD_PIECES,
    RECORD_RANGES,
    SampleIndex,
    ShardIndex,
    read_index_arrays,
    v1_index_arrays,
)

#: manifest key: {"name": STORE_INDEX_NAME, "bytes": int, "xxh": str}
MANIFEST_KEY = "store_index"
_FORMAT = "fastdata-store-index"
_VERSION = 1


def _arrays_of(index: ShardIndex | SampleIndex) -> dict[str, np.ndarray]:
    arrays = dict(index.arrays) if isinstance(index, SampleIndex) else {name: getattr(index, name)
                                                                          for name in INDEX_DTYPES}
    if index.record_ranges is not None:
        arrays[RECORD_RANGES] = np.asarray(index.record_ranges, dtype="<u8")
    return arrays


def _record_ranges(value: list, count: int, where: str) -> np.ndarray:
    """The optional ``record_ranges`` array of an entry (``[dtype, shape, raw]``) as ``uint64 [count, k, 2]``.

    Raises:
        CorruptRecordError: a dtype other than ``<u8``, a shape other than ``[count, k, 2]`` with
            ``1 <= k <= MAX_RECORD_PIECES``, or raw bytes of another length.
    """
    dtype, shape, raw = value
    k = shape[1] if isinstance(shape, list) and len(shape) == 3 and all(type(d) is int for d in shape) else -1
    if dtype != "<u8" or shape != [count, k, 2] or not 1 <= k <= MAX_RECORD_PIECES or len(raw) != count * k * 16:
        raise CorruptRecordError(f"{where}: index array {RECORD_RANGES!r} is damaged (dtype {dtype!r}, shape "
                                 f"{shape!r:.80}, {len(raw)} bytes)")
    return np.frombuffer(raw, dtype="<u8").reshape(count, k, 2).astype(np.uint64)


def encode_shard_index(index: ShardIndex | SampleIndex) -> bytes:
    """One shard's index as msgpack bytes (the ``shards`` entry format, without the name)."""
    arrays = {}
    for key, arr in _arrays_of(index).items():
        little = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
        arrays[key] = [little.dtype.str, list(little.shape), little.tobytes()]
    return msgpack.packb({"count": len(index), "arrays": arrays}, use_bin_type=True)


def _decode_entry(entry: object, schema, where: str) -> ShardIndex | SampleIndex:
    if not (isinstance(entry, dict) and isinstance(entry.get("arrays"), dict) and type(entry.get("count")) is int):
        raise CorruptRecordError(f"{where}: damaged store index entry")
    stored: dict[str, bytes] = {}
    for key, value in entry["arrays"].items():
        if not (isinstance(key, str) and isinstance(value, list) and len(value) == 3 and isinstance(value[2], bytes)):
            raise CorruptRecordError(f"{where}: damaged store index array {key!r}")
        stored[key] = value[2]
    count = entry["count"]
    ranges = entry["arrays"].get(RECORD_RANGES)
    index: ShardIndex | SampleIndex
    if schema is not None:
        index = read_index_arrays(schema, stored.get, count, where)
    else:
        index = ShardIndex(**v1_index_arrays(stored.get, count, where))
        if len(index) != count:
            raise CorruptRecordError(f"{where}: index has {len(index)} entries, expected {count}")
        index.validate(where)
    if ranges is not None:  # (optional: stores written before it have none)
        index.record_ranges = _record_ranges(ranges, count, where)
    return index


def decode_shard_index(raw: bytes, schema, where: str) -> ShardIndex | SampleIndex:
    """One shard's index from :func:`encode_shard_index` bytes (e.g. a staging sidecar)."""
    try:
        entry = unpackb_bounded(raw, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as err:
        raise CorruptRecordError(f"{where}: index sidecar is not readable ({err})") from None
    return _decode_entry(entry, schema, where)


def build_store_index(entries: Iterable[tuple[str, bytes]]) -> bytes:
    """The store index file's bytes from ``(shard name, encode_shard_index bytes)`` pairs, in store order."""
    shards = []
    for name, raw in entries:
        entry = msgpack.unpackb(raw, raw=False)
        shards.append({"name": name, "count": entry["count"], "arrays": entry["arrays"]})
    return msgpack.packb({"format": _FORMAT, "version": _VERSION, "shards": shards}, use_bin_type=True)


def manifest_entry(data: bytes, name: str = STORE_INDEX_NAME) -> dict:
    """The manifest's ``store_index`` value for index file bytes ``data`` saved as ``name``."""
    return {"name": name, "bytes": len(data), "xxh": xxhash.xxh3_64_hexdigest(data)}


def index_file_name(manifest: dict) -> str:
    """The name of the store index file ``manifest`` lists (``index.fdi`` when it lists none)."""
    entry = manifest.get(MANIFEST_KEY)
    return entry["name"] if isinstance(entry, dict) and isinstance(entry.get("name"), str) else STORE_INDEX_NAME


def shard_entries(data: bytes, manifest: dict, where: str) -> list[tuple[str, bytes]]:
    """``(shard name, encode_shard_index bytes)`` of every shard in index file bytes ``data``,
    checked against ``manifest`` as :func:`parse_store_index` does (an append or a merge
    carries the shards it keeps into a new index file with these, decoding no array)."""
    from fastdata.format.manifest import is_classification, schema_of

    parse_store_index(data, manifest, None if is_classification(manifest) else schema_of(manifest, where), where)
    body = msgpack.unpackb(data, raw=False, strict_map_key=True)  # (checked just above)
    return [(e["name"], msgpack.packb({"count": e["count"], "arrays": e["arrays"]}, use_bin_type=True))
            for e in body["shards"]]



def parse_store_index(data: bytes, manifest: dict, schema, where: str) -> list[ShardIndex | SampleIndex]:
    """Every shard's index, in manifest order, from index file bytes, checked against the manifest.

    Raises :class:`FormatError` when the manifest names no index file, and
    :class:`CorruptRecordError` when the bytes do not match the manifest's size and
    checksum or disagree with its shard list."""
    entry = manifest.get(MANIFEST_KEY)
    if not isinstance(entry, dict):
        raise FormatError(f"{where}: the store has no index file (made by an older fastdata)")
    if len(data) != entry.get("bytes") or xxhash.xxh3_64_hexdigest(data) != entry.get("xxh"):
        raise CorruptRecordError(f"{where}: {index_file_name(manifest)} does not match the manifest's size and "
                                 "checksum; the store is damaged or was rewritten while being read")
    try:  # bounded: at most object_budget(len(data)) objects (fastdata.common.bounded)
        body = unpackb_bounded(data, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as err:
        raise CorruptRecordError(f"{where}: {index_file_name(manifest)} is not readable ({err})") from None
    if not (isinstance(body, dict) and body.get("format") == _FORMAT and body.get("version") == _VERSION
            and isinstance(body.get("shards"), list)):
        raise CorruptRecordError(f"{where}: {index_file_name(manifest)} has an unknown layout")
    shards = manifest["shards"]
    if [e.get("name") if isinstance(e, dict) else None for e in body["shards"]] != [s["name"] for s in shards]:
        raise CorruptRecordError(f"{where}: {index_file_name(manifest)} lists other shards than the manifest")
    out = []
    for shard, e in zip(shards, body["shards"], strict=True):
        index = _decode_entry(e, schema, f"{where} ({shard['name']})")
        if len(index) != shard["count"]:
            raise CorruptRecordError(f"{where}: {shard['name']}: the index holds {len(index)} records, the manifest "
                                     f"says {shard['count']}")
        out.append(index)
    return out


def sidecar_path(staging_dir: str, shard: str) -> str:
    """Where a finished shard's index sidecar lives in the staging directory."""
    return os.path.join(staging_dir, shard + SIDECAR_SUFFIX)
