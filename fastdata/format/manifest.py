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

from fastdata.common.bounded import ExpansionError, json_loads_bounded
from fastdata.common.fileio import atomic_write, read_regular
from fastdata.errors import FormatError, IncompleteStoreError
from fastdata.format.storage_mode import StorageMode
from fastdata.format.names import MANIFEST_NAME, REJECTED_NAME, STORE_INDEX_NAME, check_file_name, is_store_index_name

STORE_FORMAT = "fastdata-store"
STORE_VERSION = 1
#: layout version of general stores (a ``schema`` other than the classification one)
STORE_VERSION_2 = 2
#: a classification store (version 1 records and shards) whose shards may carry a ``label_map``
#: (``fastdata merge`` of stores with different class tables): a reader that ignored the map
#: would misread labels, so such a store has its own version
STORE_VERSION_REMAPPED = 3
#: the versions of classification stores (image + label)
CLASSIFICATION_VERSIONS = (STORE_VERSION, STORE_VERSION_REMAPPED)
#: the most entries a shard's ``label_map`` may have (one per class of the store it came from)
MAX_LABEL_MAP = 1 << 20
#: the largest manifest read (local or remote); its JSON decodes under
#: :func:`fastdata.common.bounded.json_loads_bounded`'s budget (see docs/SECURITY.md)
MAX_MANIFEST_BYTES = 256 << 20
#: the largest raw image (``storage.raw_shape`` H x W x 3 bytes): a record's own limit
MAX_RAW_RECORD_BYTES = 1 << 30
#: the largest ``index.fdi`` a manifest may declare
MAX_STORE_INDEX_BYTES = 4 << 30

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
    interrupted conversion), :class:`FormatError` for anything malformed, and
    :class:`PathNotFoundError`/:class:`RemotePathError` for a missing path or a URL.
    """
    from fastdata.common.paths import check_local_path

    check_local_path(store_dir, "store")  # a URL or a missing path is named as such, not as "not a store"
    path = os.path.join(store_dir, MANIFEST_NAME)
    if not os.path.isdir(store_dir):
        raise FormatError(f"{store_dir}: not a fastdata store (not a directory)")
    try:
        # a regular file only (a FIFO would block the open forever), at most MAX_MANIFEST_BYTES
        raw = read_regular(path, MAX_MANIFEST_BYTES, "manifest")
    except FileNotFoundError:
        hint = " (an interrupted conversion: rerun it with resume=True)" if _has_staging(store_dir) else ""
        raise IncompleteStoreError(f"{store_dir}: no {MANIFEST_NAME}: not a finished fastdata store{hint}") from None
    except OSError as err:
        raise FormatError(f"{path}: cannot read the manifest ({err.strerror or err})") from None
    return parse_manifest(raw, where=path)


def _has_staging(store_dir: str) -> bool:
    from fastdata.format.names import STAGING_DIR  # local import: layout imports nothing heavy

    return os.path.isdir(os.path.join(store_dir, STAGING_DIR))


def parse_manifest(raw: bytes, where: str = "manifest") -> dict:
    """Parse manifest bytes; only ever raises :class:`FormatError`."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise FormatError(f"{where}: manifest larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        body = json_loads_bounded(raw)
    except ExpansionError as err:
        raise FormatError(f"{where}: manifest refused: {err} (a JSON expansion bomb, or damage)") from None
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
    if body.get("version") not in (*CLASSIFICATION_VERSIONS, STORE_VERSION_2) or type(body.get("version")) is not int:
        raise FormatError(
            f"{where}: store layout version {body.get('version')!r} is not supported by this fastdata "
            f"(expects {STORE_VERSION}, {STORE_VERSION_2} or {STORE_VERSION_REMAPPED}); convert the data again or "
            "install a matching fastdata"
        )
    for key, typ in _REQUIRED.items():
        if type(body.get(key)) is not typ:
            raise FormatError(f"{where}: manifest field {key!r} missing or not {typ.__name__}")
    if check_sum:
        stored = body.get("checksum")
        rest = {k: v for k, v in body.items() if k != "checksum"}
        if not isinstance(stored, str) or stored != _body_checksum(rest):
            raise FormatError(f"{where}: manifest checksum mismatch: the manifest was edited or damaged")
    from fastdata.format.backends.registry import BACKENDS  # local import: the registry imports the backends' base

    if body["backend"] not in BACKENDS:
        raise FormatError(f"{where}: unknown backend {body['backend']!r}")
    if not all(isinstance(c, str) for c in body["classes"]):
        raise FormatError(f"{where}: class names must be strings")
    if len(body["class_counts"]) != len(body["classes"]) or not all(
        type(c) is int and c >= 0 for c in body["class_counts"]
    ):
        raise FormatError(f"{where}: class_counts does not match classes")
    _validate_storage(body["storage"], where)
    for i, item in enumerate(body["rejected"]):
        if not (isinstance(item, dict) and set(item) == {"path", "reason"}
                and isinstance(item["path"], str) and isinstance(item["reason"], str)):
            raise FormatError(f"{where}: rejected entry {i} is not {{'path': str, 'reason': str}}")
    # optional (stores written before it existed have none): inputs kept with a remark
    if type(body.get("warnings", [])) is not list:
        raise FormatError(f"{where}: manifest field 'warnings' is not list")
    for i, item in enumerate(body.get("warnings", [])):
        if not (isinstance(item, dict) and set(item) == {"path", "warning"}
                and isinstance(item["path"], str) and isinstance(item["warning"], str)):
            raise FormatError(f"{where}: warnings entry {i} is not {{'path': str, 'warning': str}}")
    raw_shape = body["storage"]["raw_shape"]
    # Python ints: a product of hostile sizes cannot wrap
    raw_bytes = raw_shape[0] * raw_shape[1] * 3 if raw_shape else None
    if raw_bytes is not None and raw_bytes > MAX_RAW_RECORD_BYTES:
        raise FormatError(f"{where}: storage raw_shape {raw_shape} is {raw_bytes:,} bytes an image, more than the "
                          f"{MAX_RAW_RECORD_BYTES:,} a record may hold")
    expected_first = 0
    names: set = set()
    for i, shard in enumerate(body["shards"]):
        if not isinstance(shard, dict):
            raise FormatError(f"{where}: shard entry {i} is not an object")
        for key, typ in _SHARD_REQUIRED.items():
            if type(shard.get(key)) is not typ:
                raise FormatError(f"{where}: shard entry {i}: field {key!r} missing or not {typ.__name__}")
        name = shard["name"]
        problem = check_file_name(name)
        if problem is None and (name.startswith(".") or name in names
                                or name in (MANIFEST_NAME, REJECTED_NAME) or is_store_index_name(name)):
            problem = "not unique, hidden or a name the store itself uses"
        if problem is not None:
            raise FormatError(f"{where}: shard entry {i}: name {name!r} is not a plain, unique shard file name "
                              f"({problem})")
        if shard["bytes"] < 0 or shard["image_bytes"] < 0:
            raise FormatError(f"{where}: shard {name}: negative 'bytes' or 'image_bytes'")
        names.add(name)
        if shard["first_index"] != expected_first or shard["count"] < 0:
            raise FormatError(f"{where}: shard {name}: first_index/count inconsistent")
        if raw_bytes is not None and shard["count"] * raw_bytes > shard["bytes"]:
            raise FormatError(f"{where}: shard {name}: {shard['count']} raw images of {raw_shape[0]}x{raw_shape[1]} "
                              f"are {shard['count'] * raw_bytes:,} bytes, more than the shard's {shard['bytes']:,}")
        expected_first += shard["count"]
        if "label_map" in shard:
            _validate_label_map(shard["label_map"], len(body["classes"]), body["version"], f"{where}: shard {name}")
    _validate_store_index_entry(body, where)
    general = body["version"] == STORE_VERSION_2
    if expected_first != body["num_samples"] or (
            sum(body["class_counts"]) != body["num_samples"] and not (general and not body["classes"])):
        raise FormatError(f"{where}: num_samples does not match the shard and class counts")
    if general:
        schema = schema_of(body, where)
        _validate_class_tables(body, schema, where)
    elif "schema" in body:
        raise FormatError(f"{where}: a version-1 manifest has no schema (it is always image + label)")
    from fastdata.format.added import validate_added  # local import: added imports the field kinds

    validate_added(body, schema_of(body, where).names, where)


def _validate_label_map(label_map: object, num_classes: int, version: int, where: str) -> None:
    """A shard's ``label_map`` (version 3 only): a list of at most :data:`MAX_LABEL_MAP` ints, each a
    class index of the store; stored label ``k`` of the shard means class ``label_map[k]``."""
    if version != STORE_VERSION_REMAPPED:
        raise FormatError(f"{where}: a label_map belongs to a store of version {STORE_VERSION_REMAPPED} only")
    if not (isinstance(label_map, list) and len(label_map) <= MAX_LABEL_MAP
            and all(type(x) is int and 0 <= x < num_classes for x in label_map)):
        raise FormatError(f"{where}: label_map is not a list of class indices (0..{num_classes - 1})")


def is_classification(manifest: dict) -> bool:
    """Whether ``manifest`` is a classification store's (image + label: version 1, or 3 with label maps)."""
    return manifest["version"] in CLASSIFICATION_VERSIONS


def label_map_of(shard: dict) -> list[int] | None:
    """A shard entry's ``label_map`` (None: its stored labels are the store's class indices)."""
    return shard.get("label_map")


def _validate_store_index_entry(body: dict, where: str) -> None:
    """``store_index`` (optional: stores made before it existed have none): exactly
    ``{"name": "index.fdi", "bytes": int, "xxh": str}`` (or ``index-NNNNN.fdi``, an appended
    store's later version: :func:`~fastdata.format.names.store_index_name`), the size at most
    :data:`MAX_STORE_INDEX_BYTES` (what a reader reads it with as its limit)."""
    entry = body.get("store_index")
    if entry is None and "store_index" not in body:
        return
    if not (isinstance(entry, dict) and set(entry) == {"name", "bytes", "xxh"} and isinstance(entry["name"], str)
            and is_store_index_name(entry["name"]) and type(entry["bytes"]) is int
            and 0 <= entry["bytes"] <= MAX_STORE_INDEX_BYTES and isinstance(entry["xxh"], str)):
        raise FormatError(f"{where}: manifest field 'store_index' is not {{'name': {STORE_INDEX_NAME!r} "
                          "or 'index-NNNNN.fdi', "
                          f"'bytes': 0..{MAX_STORE_INDEX_BYTES}, 'xxh': str}}")


#: manifest key of a general store's class tables: ``{field name: [class names]}``
CLASS_TABLES_KEY = "class_tables"
#: a classification (version-1) store's default read mode per image field, ``{"image": "unchanged"}``
#: (a general store records it in its schema: ``Image(mode=...)``); absent: the field's default
IMAGE_MODES_KEY = "image_modes"


def _validate_class_tables(body: dict, schema, where: str) -> None:
    """``class_tables`` (optional, version 2): each key a field of the schema, each
    value a list of class names; ``classes`` is the table of :func:`target_field`."""
    tables = body.get(CLASS_TABLES_KEY)
    if tables is None:
        return
    names = {name for name, _ in schema}
    if not isinstance(tables, dict) or not all(
            k in names and isinstance(v, list) and all(isinstance(c, str) for c in v) for k, v in tables.items()):
        raise FormatError(f"{where}: {CLASS_TABLES_KEY} must map fields of the schema to lists of class names")
    target = target_field(schema, tables)
    if body["classes"] != (tables[target] if target is not None else []):
        raise FormatError(f"{where}: classes must be the class table of the single-label class field")


def target_field(schema, class_tables: dict) -> str | None:
    """The field whose class indices are a general store's ``targets`` (and whose table
    is its ``classes``): ``label`` when it is a single-label class field (an int),
    else the only single-label class field, else None (e.g. multi-label only)."""
    from fastdata.format.fields import Int

    single = [name for name, f in schema if name in class_tables and isinstance(f, Int)]
    if "label" in single:
        return "label"
    return single[0] if len(single) == 1 else None


def schema_of(body: dict, where: str = "manifest"):
    """The :class:`~fastdata.format.fields.Schema` of a (validated) manifest: its ``schema`` for
    version 2, :data:`~fastdata.format.fields.CLASSIFICATION` for version 1 (which has none).
    Raises :class:`FormatError` for a malformed or unknown schema."""
    from fastdata.format.fields import CLASSIFICATION, Schema

    if body.get("version") != STORE_VERSION_2:
        return CLASSIFICATION
    if "schema" not in body:
        raise FormatError(f"{where}: a version-2 manifest needs a 'schema'")
    return Schema.from_json(body["schema"], f"{where}: schema")


def _validate_storage(storage: dict, where: str) -> None:
    """The storage mode record: exactly the keys ``StorageSpec.to_json`` writes, consistent per mode."""
    def positive_int(v) -> bool:
        return type(v) is int and v > 0

    keys = {"mode", "max_side", "quality", "raw_shape"}
    try:
        mode = StorageMode.parse(storage.get("mode"))
    except FormatError:
        raise FormatError(f"{where}: manifest field 'storage' is not a valid storage mode: {storage!r}") from None
    shape = storage.get("raw_shape")
    if mode.picks_images_to_hold_as_pixels:
        keys = keys | {"raw_fraction"}
    budget = storage.get("raw_budget")
    if mode.may_hold_native_size_pixels and "raw_budget" in storage:
        keys = keys | {"raw_budget"}
    fraction = storage.get("raw_fraction")
    # a mixed store has a raw fraction or a raw budget (then its fraction is null), not both
    mixed_ok = ((isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0 <= fraction <= 1
                 and budget is None) or (fraction is None and positive_int(budget)))
    ok = set(storage) == keys and (
        (mode.may_hold_native_size_pixels and type(storage["max_side"]) is int and storage["max_side"] >= 32
         and storage["quality"] is None and shape is None
         and (budget is None or positive_int(budget))
         and (mode.holds_only_native_size_pixels or mixed_ok))
        or ((mode.keeps_files_as_given or mode.transcodes_losslessly) and storage["max_side"] is None
            and storage["quality"] is None and shape is None)
        or (mode.reencodes_large_images and positive_int(storage["max_side"]) and type(storage["quality"]) is int
            and 1 <= storage["quality"] <= 100 and shape is None)
        or (mode.holds_fixed_size_pixels and storage["max_side"] is None and storage["quality"] is None
            and isinstance(shape, list) and len(shape) == 2 and all(positive_int(v) for v in shape))
    )
    if not ok:
        raise FormatError(f"{where}: manifest field 'storage' is not a valid storage mode: {storage!r}")
