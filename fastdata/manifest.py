"""The per-store manifest (``manifest.json``): schema, validation, atomic write.

The manifest is written last, atomically (temp file, fsync, ``os.replace``,
fsync of the directory): a store without it is an unfinished conversion. It
carries its own checksum (``xxh3_64`` of the canonical JSON of every other
field), so a hand edit or a flipped byte is detected on open.
"""

from __future__ import annotations

import json
import os
from typing import Any

import xxhash

from .errors import FormatError, IncompleteStoreError

MANIFEST_NAME = "manifest.json"
REJECTED_NAME = "rejected.tsv"
STORE_FORMAT = "fastdata-store"
STORE_VERSION = 1
BACKENDS = ("lmdb", "hdf5")
MAX_MANIFEST_BYTES = 256 << 20

_REQUIRED = {
    "format": str,
    "version": int,
    "backend": str,
    "storage": dict,
    "classes": list,
    "num_samples": int,
    "class_counts": list,
    "shards": list,
    "rejected": list,
    "options": dict,
}
_SHARD_REQUIRED = {"name": str, "first_index": int, "count": int, "bytes": int, "xxh": str, "image_bytes": int}


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes (sorted keys, no spaces) used for checksums."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def _body_checksum(body: dict) -> str:
    return xxhash.xxh3_64_hexdigest(canonical_json(body))


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the new one, never a mix."""
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def fsync_dir(path: str) -> None:
    """fsync a directory so a rename inside it survives power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(store_dir: str, body: dict) -> dict:
    """Validate ``body``, add its checksum and publish it atomically. Returns the written dict."""
    body = dict(body)
    body.pop("checksum", None)
    validate_manifest(body, where=store_dir, check_sum=False)
    full = dict(body, checksum=_body_checksum(body))
    atomic_write(os.path.join(store_dir, MANIFEST_NAME), json.dumps(full, indent=1, sort_keys=True).encode("ascii"))
    return full


def read_manifest(store_dir: str) -> dict:
    """Load and validate a store's manifest.

    Raises :class:`IncompleteStoreError` when there is none (an unfinished or
    interrupted conversion) and :class:`FormatError` for anything malformed.
    """
    path = os.path.join(store_dir, MANIFEST_NAME)
    if not os.path.isdir(store_dir):
        raise FormatError(f"{store_dir}: not a fastdata store (not a directory)")
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        hint = " (an interrupted conversion: rerun it with --resume)" if _has_staging(store_dir) else ""
        raise IncompleteStoreError(f"{store_dir}: no {MANIFEST_NAME}: not a finished fastdata store{hint}") from None
    return parse_manifest(raw, where=path)


def _has_staging(store_dir: str) -> bool:
    from .layout import STAGING_DIR  # local import: layout imports nothing heavy

    return os.path.isdir(os.path.join(store_dir, STAGING_DIR))


def parse_manifest(raw: bytes, where: str = "manifest") -> dict:
    """Parse manifest bytes; only ever raises :class:`FormatError`."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise FormatError(f"{where}: manifest larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise FormatError(f"{where}: manifest is not valid JSON ({err}); the store is damaged") from None
    if not isinstance(body, dict):
        raise FormatError(f"{where}: manifest is not a JSON object")
    validate_manifest(body, where=where, check_sum=True)
    return body


def validate_manifest(body: dict, *, where: str, check_sum: bool) -> None:
    """Check the manifest schema, version, internal consistency and (optionally) checksum."""
    if body.get("format") != STORE_FORMAT:
        raise FormatError(f"{where}: not a fastdata manifest (format={body.get('format')!r})")
    if body.get("version") != STORE_VERSION:
        raise FormatError(
            f"{where}: store layout version {body.get('version')!r} is not supported by this fastdata "
            f"(expects {STORE_VERSION}); convert the data again or install a matching fastdata"
        )
    for key, typ in _REQUIRED.items():
        if type(body.get(key)) is not typ:
            raise FormatError(f"{where}: manifest field {key!r} missing or not {typ.__name__}")
    if check_sum:
        stored = body.get("checksum")
        rest = {k: v for k, v in body.items() if k != "checksum"}
        if not isinstance(stored, str) or stored != _body_checksum(rest):
            raise FormatError(f"{where}: manifest checksum mismatch: the manifest was edited or damaged")
    if body["backend"] not in BACKENDS:
        raise FormatError(f"{where}: unknown backend {body['backend']!r}")
    if not all(isinstance(c, str) for c in body["classes"]):
        raise FormatError(f"{where}: class names must be strings")
    if len(body["class_counts"]) != len(body["classes"]) or not all(
        type(c) is int and c >= 0 for c in body["class_counts"]
    ):
        raise FormatError(f"{where}: class_counts does not match classes")
    expected_first = 0
    for i, shard in enumerate(body["shards"]):
        if not isinstance(shard, dict):
            raise FormatError(f"{where}: shard entry {i} is not an object")
        for key, typ in _SHARD_REQUIRED.items():
            if type(shard.get(key)) is not typ:
                raise FormatError(f"{where}: shard entry {i}: field {key!r} missing or not {typ.__name__}")
        name = shard["name"]
        if os.path.basename(name) != name or name.startswith("."):
            raise FormatError(f"{where}: shard name {name!r} is not a plain file name")
        if shard["first_index"] != expected_first or shard["count"] < 0:
            raise FormatError(f"{where}: shard {name}: first_index/count inconsistent")
        expected_first += shard["count"]
    if expected_first != body["num_samples"] or sum(body["class_counts"]) != body["num_samples"]:
        raise FormatError(f"{where}: num_samples does not match the shard and class counts")
