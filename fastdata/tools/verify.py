"""``info`` and ``verify``: describe a store and check it end to end."""

from __future__ import annotations

import functools
import multiprocessing
import os
import shlex
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fastdata.common import portable
from fastdata.common.fileio import file_checksum, read_regular
from fastdata.common.paths import check_local_path
from fastdata.errors import FastdataError, FormatError, IncompleteStoreError, RemoteStoreError
from fastdata.format.backends.base import ShardReader, StorageSpec
from fastdata.format.backends.registry import reader_class
from fastdata.format.chunks import ChunkTable, check_shape, chunk_region, iter_grid
from fastdata.format.chunk_codecs import chunk_codec
from fastdata.format.added import added_fields, check_field_file, field_files
from fastdata.format.manifest import IMAGE_MODES_KEY, is_classification, label_map_of, read_manifest, schema_of
from fastdata.format.names import MANIFEST_NAME, STAGING_DIR, STORE_INDEX_NAME
from fastdata.format.store_index import MANIFEST_KEY, index_file_name, parse_store_index
from fastdata.format.record import (
    chunk_first_key,
    chunk_shape_key,
    FIELD_PREFIX,
    FORMAT_CODES,
    FORMAT_NAMES,
    IMAGE_DTYPE_NAMES,
    NOT_RECORDED,
    SampleIndex,
    ShardIndex,
    decode_record_v2,
)
from fastdata.remote.location import RemoteSizeError
from fastdata.remote.store import RemoteStore, is_remote, locate_store
from fastdata.writer.pipeline import WRITE_SOURCE


def info(store: str, *, storage_options: Mapping[str, Any] | None = None, cache_dir: str | None = None) -> dict:
    """Describe a published store (from its manifest; no shard is opened or downloaded).

    Args:
        store (str): a store directory, or a URL (``s3://``, ``gs://``, ``az://``, ``https://``).
        storage_options (Mapping | None): fsspec options for a URL (endpoint, credentials...).
        cache_dir (str | None): the shard cache a URL's manifest is kept in (default: the user's).

    Returns:
        dict: JSON-serialisable: backend, version, storage mode, counts, classes with
        per-class counts, shards with sizes, rejected inputs; for a detection store (converted
        from COCO) also ``categories`` (each ``id``, ``name`` and ``supercategory`` when the file
        gives one) and ``num_categories``, else None and 0; ``added_fields``: the fields added
        since the store was written (``fastdata.add_fields``), each its ``name``, kind and
        parameters, ``generation``, ``added`` (UTC time) and ``default`` when one was declared
        (what an append gives new samples), in the order they were added.
    """
    remote: RemoteStore | None = None
    if is_remote(store):
        located = locate_store(store, storage_options=storage_options, cache_dir=cache_dir)
        assert isinstance(located, RemoteStore), "a URL locates a remote store"
        remote, m = located, located.manifest
        where = store.rstrip("/")
    else:
        if storage_options:
            raise RemoteStoreError(f"{store}: storage_options apply to remote URLs only, not to a local path")
        m = read_manifest(store)
        where = os.path.abspath(store)
    images, arrays, images_error, raw_split = _census(where, m, remote)
    return {
        "path": where,
        "backend": m["backend"],
        "version": m["version"],
        "storage": m["storage"],
        "num_samples": m["num_samples"],
        "num_classes": len(m["classes"]),
        "classes": [{"name": c, "index": i, "count": n}
                    for i, (c, n) in enumerate(zip(m["classes"], m["class_counts"], strict=True))],
        **_detection_categories(m),
        "shards": [{"name": s["name"], "count": s["count"], "bytes": s["bytes"],
                    **({"label_map": s["label_map"]} if "label_map" in s else {})} for s in m["shards"]],
        "total_bytes": sum(s["bytes"] for s in m["shards"]),
        "rejected": len(m["rejected"]),
        "rejected_items": m["rejected"],
        "options": m["options"],
        "schema": m.get("schema"),
        "added_fields": [{"name": a.name, **a.field.to_json(), "generation": a.generation, "added": a.added,
                          **({"default": a.default[0]} if a.default else {})} for a in added_fields(m, where)],
        "images": images,
        "arrays": arrays,
        "images_error": images_error,
        "image_modes": _default_modes(m),
        "raw_split": raw_split,
    }


def _detection_categories(m: dict) -> dict:
    """``categories`` and ``num_categories`` of a store converted from COCO (``metadata.coco``):
    its labels are the annotation file's categories, not the manifest's (empty) class table.
    Only the keys that name a category are kept (a keypoint category's ``keypoints`` and
    ``skeleton`` are long and say nothing about what is detected)."""
    metadata = m.get("metadata")
    coco = metadata.get("coco") if isinstance(metadata, dict) else None
    if not isinstance(coco, dict) or not isinstance(coco.get("categories"), list):
        return {"categories": None, "num_categories": 0}
    categories = [{key: c[key] for key in ("id", "name", "supercategory") if key in c}
                  for c in coco["categories"] if isinstance(c, dict)]
    return {"categories": categories, "num_categories": len(categories)}


def _default_modes(m: dict) -> dict[str, str]:
    """The read mode each image field is read in unless a reader says otherwise: a general store's
    ``Image(mode=...)`` (or its default by name), a classification store's manifest ``image_modes``
    (or ``"RGB"``, ImageFolder's)."""
    from fastdata.format.fields import Image

    schema = schema_of(m)
    recorded = m.get(IMAGE_MODES_KEY) if is_classification(m) else None
    out = {}
    for name, f in schema:
        if isinstance(f, Image):
            mode = recorded.get(name) if isinstance(recorded, dict) else None
            out[name] = mode if isinstance(mode, str) else f.default_mode(name)
    return out


def _raw_split(indexes: list, storage: dict) -> dict | None:
    """For a store whose mode may hold native-size pixels (``NATIVE_SIZE_PIXELS``, ``MIXED``):
    ``{"raw": {"count", "bytes"}, "encoded": {...}}``,
    the records held as PPM pixels and as encoded images, with their stored bytes (the disk each
    costs); None for the other modes."""
    spec = StorageSpec.from_json(storage)
    if not spec.mode.may_hold_native_size_pixels:
        return None
    out = {"raw": {"count": 0, "bytes": 0}, "encoded": {"count": 0, "bytes": 0}}
    for index in indexes:
        if not isinstance(index, ShardIndex) or not len(index):
            continue
        # by the storage rule, not the format: a mixed store's kept originals may be PPM files too
        raw = np.fromiter((spec.holds_pixels(index.relpath(i), int(index.formats[i])) for i in range(len(index))),
                          dtype=bool, count=len(index))
        for key, chosen in (("raw", raw), ("encoded", ~raw)):
            out[key]["count"] += int(chosen.sum())
            out[key]["bytes"] += int(index.nbytes[chosen].sum())
    return out


def _census(where: str, m: dict, remote: RemoteStore | None) \
        -> tuple[dict | None, dict | None, str | None, dict | None]:
    """``({image field: image_census}, {chunked field: array census}, None, raw split)`` from the store
    index file (``index.fdi``: no shard is opened), or ``(None, None, why, None)`` when the store has none
    (made by an older fastdata) or it is unreadable. A store made before dtypes were recorded counts its
    images as "not recorded". An array census gives the smallest and largest shape and the values'
    bytes uncompressed (``raw_bytes``); the raw split is :func:`_raw_split`'s."""
    from fastdata.writer.census import image_census

    if MANIFEST_KEY not in m:
        return None, None, f"not recorded (no {STORE_INDEX_NAME}: the store was made by an older fastdata)", None
    schema = schema_of(m)
    try:
        if remote is not None:
            indexes = remote.shard_indexes(None, StorageSpec.from_json(m["storage"]),
                                           None if is_classification(m) else schema)
        else:
            path = os.path.join(where, index_file_name(m))
            data = read_regular(path, m[MANIFEST_KEY]["bytes"] + 1, "store index")
            indexes = parse_store_index(data, m, None if is_classification(m) else schema, path)
    except (FastdataError, OSError) as err:
        return None, None, f"unreadable ({err})", None
    arrays = {}
    for name in schema.chunked_fields():
        shapes = [index.arrays[chunk_shape_key(name)] for index in indexes if len(index)]
        both = np.concatenate(shapes) if shapes else np.zeros((0, schema[name].ndim), dtype=np.int64)
        values = int(np.prod(both.astype(object), axis=1).sum()) if len(both) else 0
        arrays[name] = {"min_shape": both.min(axis=0).tolist() if len(both) else None,
                        "max_shape": both.max(axis=0).tolist() if len(both) else None,
                        "raw_bytes": values * schema[name].dtype.itemsize}
    return ({name: image_census(indexes, name) for name in schema.image_fields()}, arrays, None,
            _raw_split(indexes, m["storage"]))


#: :attr:`VerifyReport.status` values
SOUND, DAMAGED, NOT_A_STORE, UNFINISHED = "ok", "damaged", "not_a_store", "unfinished"


@dataclass
class VerifyReport:
    """Result of :func:`verify`. ``problems`` name the shard and record at fault.

    ``status`` says which kind of result it is: ``"ok"``, ``"damaged"`` (a store
    whose files or records are damaged), ``"not_a_store"`` (no ``manifest.json``
    and no unfinished conversion) or ``"unfinished"`` (an interrupted conversion:
    finish it with ``resume=True``). Only ``"damaged"`` means damage.
    """

    store: str
    ok: bool = True
    records_checked: int = 0
    shards_checked: int = 0
    decoded: int = 0
    #: values of added fields checked (``fastdata.add_fields``: their field files)
    field_values_checked: int = 0
    problems: list[str] = field(default_factory=list)
    status: str = SOUND

    def fail(self, message: str) -> None:
        self.ok = False
        self.status = DAMAGED
        self.problems.append(message)

    def refuse(self, status: str, message: str) -> None:
        """Not damage: the path is not a (finished) store; ``message`` says what it is and what to do."""
        self.ok = False
        self.status = status
        self.problems.append(message)

    def summary(self) -> str:
        if self.status in (NOT_A_STORE, UNFINISHED):
            return f"{self.store}: {self.problems[0]}"
        if self.ok:
            extra = f", {self.decoded} decoded" if self.decoded else ""
            if self.field_values_checked:
                extra += f", {self.field_values_checked} values of added fields"
            return f"{self.store}: OK ({self.shards_checked} shard(s), {self.records_checked} records verified{extra})"
        head = f"{self.store}: DAMAGED ({len(self.problems)} problem(s))"
        return "\n".join([head] + [f"  {p}" for p in self.problems[:50]] +
                         ([f"  ... {len(self.problems) - 50} more"] if len(self.problems) > 50 else []))


def _open_indexed(backend: str, path: str, storage: StorageSpec, schema, expected_count: int,
                  expected_bytes: int, name: str) -> tuple[ShardReader, ShardIndex | SampleIndex, list[str]] | str:
    """Open shard ``path`` (named ``name`` in problems) and read its index, the first steps of
    every shard check.

    Args:
        schema (Schema | None): the general store's schema; None for a version-1 shard.
        expected_count (int): the record count the manifest gives the shard.
        expected_bytes (int): the manifest's ``image_bytes`` of the shard, the sum of its
            records' sizes (what ``info`` and the tuner's memory plan read).

    Returns:
        ``(reader, index, problems)``, ``problems`` holding the count or size mismatch if any (the
        caller closes ``reader``); or the problem, as a string, that stopped opening the shard
        or reading its index (nothing is left open then).
    """
    try:
        reader = reader_class(backend)(path, storage, schema=schema, expected_count=expected_count)
    except FastdataError as err:
        return f"{name}: {err}"
    try:
        index = reader.read_index()
    except FastdataError as err:
        reader.close()
        return f"{name}: {err}"
    problems = []
    if len(index) != expected_count:
        problems.append(f"{name}: holds {len(index)} records, the manifest says {expected_count}")
    elif (held := int(index.nbytes.sum())) != expected_bytes:
        problems.append(f"{name}: its records hold {held} bytes, the manifest says {expected_bytes} (image_bytes): "
                        "the manifest or the shard index is damaged")
    return reader, index, problems


def _check_records(backend: str, path: str, storage_json: dict, expected_count: int, expected_bytes: int,
                   num_classes: int, decode: bool, schema_json: list | None,
                   name: str) -> tuple[int, int, list[str]]:
    """Read every record of one shard. Returns (checked, decoded, problems).
    ``schema_json`` is None for a version-1 shard, else the general store's schema."""
    from fastdata.common.imageio import inspect_image  # imports the decoders: only when decoding

    if schema_json is not None:
        return _check_records_v2(backend, path, storage_json, expected_count, expected_bytes, decode, schema_json,
                                 name)
    storage = StorageSpec.from_json(storage_json)
    checked = decoded = 0
    opened = _open_indexed(backend, path, storage, None, expected_count, expected_bytes, name)
    if isinstance(opened, str):
        return 0, 0, [opened]
    reader, index, problems = opened
    with reader:
        assert isinstance(index, ShardIndex)
        if len(index) and int(index.labels.max()) >= num_classes:
            problems.append(f"{name}: a label is outside the {num_classes} classes")
        problems.extend(_storage_mismatch(index, storage, name))
        for i in range(len(index)):
            try:
                data = reader.get(i)
            except FastdataError as err:
                # the reader's message already starts with "<path> record <i>"; keep one prefix
                problems.append(f"{name} record {i}: {str(err).removeprefix(f'{path} record {i}: ')}")
                continue
            checked += 1
            mismatch = _record_vs_index(reader, index, i)
            if mismatch:
                problems.append(f"{name} record {i}: {mismatch}")
                continue
            if (storage.mode.may_hold_native_size_pixels
                    and storage.holds_pixels(index.relpath(i), int(index.formats[i]))):
                problem = _ppm_problem(data, int(index.formats[i]), int(index.widths[i]), int(index.heights[i]))
                if problem:
                    problems.append(f"{name} record {i}: {problem}")
                    continue
            if decode:
                fmt = FORMAT_NAMES[int(index.formats[i])]
                try:
                    if fmt == "RAW":
                        h, w = storage.fixed_pixel_shape()
                        np.frombuffer(data, dtype=np.uint8).reshape(h, w, 3)
                        actual = ("uint8", 3)
                    else:
                        got = inspect_image(data)  # the readers' policy: same verdict as ds[i]
                        actual = (got.dtype, got.channels)
                    decoded += 1
                except Exception as err:  # any decoder failure is a finding, not a crash
                    problems.append(f"{name} record {i}: cannot decode {fmt} image ({type(err).__name__}: {err})")
                    continue
                wrong = _native_mismatch(actual, int(index.dtypes[i]), int(index.channels[i]))
                if wrong:
                    problems.append(f"{name} record {i}: {wrong}")
    return checked, decoded, problems


def _ppm_problem(data, fmt: int, width: int, height: int) -> str | None:
    """What is wrong with a record that its store's storage mode says is raw-native pixels
    (:meth:`~fastdata.format.backends.base.StorageSpec.stores_native_pixels`; None: nothing): it must be a PPM by
    the index, its header must parse, hold all its pixels and nothing after them, and say the size the
    index records. A header read, no decode: cheap enough for every verify, and what a reader trusts
    before viewing the pixels."""
    from fastdata.common.imageio import ImageDecodeError, ppm_header

    if fmt != FORMAT_CODES["PPM"]:
        return (f"the storage mode says this record holds raw pixels, but the index says it is a "
                f"{FORMAT_NAMES.get(fmt, fmt)} image: the record, index or manifest is damaged")

    try:
        header = ppm_header(data)
    except ImageDecodeError as err:
        return f"raw PPM record is damaged: {err}"
    if header is None:
        return "a raw record of this store is not a binary 8-bit PPM (P6, maxval 255)"
    w, h, offset = header
    if (w, h) != (width, height):
        return f"raw PPM header says {w}x{h}, the index says {width}x{height}: the record or index is damaged"
    if len(data) != offset + w * h * 3:
        return (f"raw PPM record holds {len(data) - offset - w * h * 3} bytes after its {w}x{h} pixels: the record "
                "is damaged")
    return None


def _check_records_v2(backend: str, path: str, storage_json: dict, expected_count: int, expected_bytes: int,
                      decode: bool, schema_json: list, name: str) -> tuple[int, int, list[str]]:
    """A version-2 shard: every record against its checksum, decoded against the schema,
    its path and size against the index; with ``decode`` every image field fully decoded
    and its format and size compared with the index."""
    from fastdata.common.imageio import inspect_image
    from fastdata.format.fields import Schema

    schema = Schema.from_json(schema_json)
    checked = decoded = 0
    opened = _open_indexed(backend, path, StorageSpec.from_json(storage_json), schema, expected_count, expected_bytes,
                           name)
    if isinstance(opened, str):
        return 0, 0, [opened]
    reader, index, problems = opened
    with reader:
        assert isinstance(index, SampleIndex)
        for i in range(len(index)):
            where = f"{name} record {i}"
            try:
                data = reader.get(i)
                record = decode_record_v2(data, schema, where=where)
            except FastdataError as err:
                problems.append(f"{where}: {str(err).removeprefix(f'{path} record {i}: ').removeprefix(where + ': ')}")
                continue
            checked += 1
            wrong = [k for k, ok in (("size", len(data) == int(index.nbytes[i])),
                                     ("path", record["path"] == index.relpath(i))) if not ok]
            if wrong:
                problems.append(f"{where}: record disagrees with the shard index ({', '.join(wrong)}): "
                                "the record or index is damaged")
                continue
            for field in schema.chunked_fields():
                problem = _check_chunks(reader, index, schema[field], field, record[field], i, decode, where)
                if problem:
                    problems.append(problem)
            if not decode:
                continue
            for field in schema.image_fields():
                meta = {k: int(index.arrays[f"{FIELD_PREFIX}{field}.{k}"][i]) for k in ("format", "width", "height")}
                try:
                    got = inspect_image(record[field])
                    actual = {"format": FORMAT_CODES.get(got.format, -1), "width": got.width, "height": got.height}
                except Exception as err:  # any decoder failure is a finding, not a crash
                    problems.append(f"{where}: cannot decode image field {field!r} ({type(err).__name__}: {err})")
                    continue
                if actual != meta:
                    problems.append(f"{where}: image field {field!r} is {actual}, the index says {meta}")
                native = _native_mismatch((got.dtype, got.channels),
                                         int(index.arrays[f"{FIELD_PREFIX}{field}.dtype"][i]),
                                         int(index.arrays[f"{FIELD_PREFIX}{field}.channels"][i]))
                if native:
                    problems.append(f"{where}: image field {field!r}: {native}")
            decoded += 1
    return checked, decoded, problems


def _check_chunks(reader, index, field, name: str, table_bytes: bytes, i: int, decode: bool, where: str) -> str | None:
    """What is wrong with the chunks of chunked field ``name`` of record ``i`` (None: nothing):
    every chunk's length and xxh3-64 against the record's table, and with ``decode`` each one
    decoded to its shape."""
    named = f"{where} field {name!r}"
    try:
        shape = check_shape(index.arrays[chunk_shape_key(name)][i], field.chunks, field.dtype.itemsize, named)
        table = ChunkTable.from_bytes(table_bytes, shape, field.chunks, named)
        first = int(index.arrays[chunk_first_key(name)][i])
        codec = chunk_codec(field.codec)
        positions = iter_grid(shape, field.chunks)
        for start in range(0, len(table), 64):
            ids = list(range(start, min(start + 64, len(table))))
            stored = reader.get_chunks(first, table, ids, named)
            for j, data in zip(ids, stored, strict=True):
                position = next(positions)
                if decode:
                    out = np.empty(tuple(r.stop - r.start for r in chunk_region(position, shape, field.chunks)),
                                   dtype=field.dtype)
                    codec.decode_into(data, out, f"{named} chunk {j}")
    except FastdataError as err:
        return str(err)
    return None


def _native_mismatch(actual: tuple[str, int], dtype_code: int, channels: int) -> str | None:
    """Why a decoded image's ``(dtype, channels)`` is not what the index records (codes
    :data:`~fastdata.format.record.IMAGE_DTYPE_CODES`), or None; nothing to compare when the index
    does not record them (:data:`~fastdata.format.record.NOT_RECORDED`: a store made before)."""
    if dtype_code == NOT_RECORDED and channels == NOT_RECORDED:
        return None
    recorded = (IMAGE_DTYPE_NAMES.get(dtype_code, f"code {dtype_code}"), channels)
    if (actual[0], actual[1]) == recorded:
        return None
    return (f"decodes as {actual[0]} x{actual[1]} but the index records {recorded[0]} x{recorded[1]}: "
            "the record or index is damaged")


def _record_vs_index(reader, index, i: int) -> str | None:
    """Backends whose records carry their own metadata (LMDB's msgpack records)
    must agree with the shard index field by field, so a flipped byte in a
    record's label/size/path is pinned to that record, not only to the file."""
    get_record = getattr(reader, "get_record", None)
    if get_record is None:
        return None
    try:
        rec = get_record(i)
    except FastdataError as err:
        return str(err)
    expected = {
        "label": int(index.labels[i]), "width": int(index.widths[i]), "height": int(index.heights[i]),
        "format": FORMAT_NAMES[int(index.formats[i])], "checksum": int(index.checksums[i]),
        "size": int(index.nbytes[i]), "path": index.relpath(i),
    }
    actual = {"label": rec.label, "width": rec.width, "height": rec.height, "format": rec.fmt,
              "checksum": rec.xxh, "size": len(rec.image), "path": rec.relpath}
    wrong = [k for k in expected if expected[k] != actual[k]]
    if wrong:
        return f"record metadata disagrees with the shard index ({', '.join(wrong)}): the record or index is damaged"
    return None


def _storage_mismatch(index, storage: StorageSpec, name: str) -> list[str]:
    """Records must match the manifest's storage mode (fixed-size pixels iff mode ``FIXED_SIZE_PIXELS``):
    a manifest edited to say so would make readers reinterpret JPEG bytes as pixels."""
    is_raw = index.formats == FORMAT_CODES["RAW"]
    if storage.mode.holds_fixed_size_pixels:
        h, w = storage.fixed_pixel_shape()
        if len(index) and (not is_raw.all() or bool((index.nbytes != h * w * 3).any())):
            return [f"{name}: records are not {h}x{w} raw pixels, as the manifest's storage mode says"]
    elif is_raw.any():
        return [f"{name}: holds raw-pixel records but the manifest's storage mode is {storage.mode.value!r}"]
    return []


def _check_in_child(conn, args) -> None:
    try:
        conn.send(_check_records(*args))
    except BaseException as err:  # report anything to the parent rather than dying silently
        conn.send((0, 0, [f"{args[-1]}: verification failed ({type(err).__name__}: {err})"]))
    finally:
        conn.close()


def _check_records_isolated(args: tuple, timeout: float) -> tuple[int, int, list[str]]:
    """Run :func:`_check_records` in a child: a damaged LMDB page can crash the
    C library (LMDB keeps no page checksums), which must become a finding."""
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(method)
    parent, child = ctx.Pipe(duplex=False)
    # typeshed: get_context(str) returns BaseContext, which declares no Process (every concrete context has one)
    proc = ctx.Process(target=_check_in_child, args=(child, args), daemon=True)  # type: ignore[attr-defined]
    proc.start()
    child.close()
    name = args[-1]
    try:
        if parent.poll(timeout):
            return parent.recv()
        return 0, 0, [f"{name}: verification did not finish within {timeout:.0f} s (damaged internal structure?)"]
    except EOFError:
        return 0, 0, [f"{name}: the reader crashed on this shard (exit code {proc.exitcode}): "
                      "its internal structure is damaged; reconvert it"]
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
        parent.close()


def _is_store_candidate(store: str, report: VerifyReport) -> bool:
    """False (with the reason in ``report``) when ``store`` is not a directory with a
    manifest: an unfinished conversion, or something that is not a store at all."""
    if not os.path.isdir(store):
        report.refuse(NOT_A_STORE, "not a fastdata store: not a directory (a store is a directory holding "
                                   f"{MANIFEST_NAME} and shard files)")
        return False
    if os.path.lexists(os.path.join(store, MANIFEST_NAME)):
        return True
    if os.path.isdir(os.path.join(store, STAGING_DIR)):
        from fastdata.writer.resume import recorded_source

        source = recorded_source(store) or "SRC"
        if source == WRITE_SOURCE:
            report.refuse(UNFINISHED, "unfinished fastdata.write(): finish it by calling it again with resume=True "
                                      "(map-style samples), or start over with overwrite=True")
            return False
        report.refuse(UNFINISHED, f"unfinished conversion: finish it by converting {shlex.quote(source)} to "
                                  f"{shlex.quote(store)} again with resume=True")
        return False
    report.refuse(NOT_A_STORE, f"not a fastdata store: no {MANIFEST_NAME}")
    return False


def verify(store: str, *, decode: bool = False, timeout: float = 600.0,
           storage_options: Mapping[str, Any] | None = None, scratch_dir: str | None = None) -> VerifyReport:
    """Check a store: manifest, shard files (size and whole-file checksum), every
    record against its checksum, counts against the manifest; with ``decode``
    also fully decode every image.

    A URL (``s3://``, ``gs://``, ``az://``, ``https://``) is checked the same way: its
    manifest, its store index file, then each shard streamed from the server into one
    temporary file under ``scratch_dir`` (default: the shard cache directory), its
    checksum computed while it arrives, its records checked, the file deleted. The
    shard cache is neither used nor evicted, so a store larger than the cache can be
    verified, and what is checked is the server's copy, not a cached one.

    Never raises for damage: every finding lands in ``report.problems``. A folder
    that is not a store, or holds an unfinished conversion, is reported with
    ``status`` ``"not_a_store"``/``"unfinished"``, not as damage.

    Args:
        store (str): a store directory or URL.
        decode (bool): also fully decode every image.
        timeout (float): seconds a damaged shard's isolated check may take.
        storage_options (Mapping | None): fsspec options for a URL (endpoint, credentials...).
        scratch_dir (str | None): where a URL's shard is downloaded while it is checked.

    Raises:
        PathNotFoundError: ``store`` does not exist.
        RemoteStoreError: the server cannot be reached (after retries), or refuses access.
    """
    if is_remote(store):
        return _verify_remote(store, decode, timeout, storage_options, scratch_dir)
    if storage_options:
        raise RemoteStoreError(f"{store}: storage_options apply to remote URLs only, not to a local path")
    report = VerifyReport(store=os.path.abspath(store))
    check_local_path(store, "store")
    if not _is_store_candidate(store, report):
        return report
    try:
        m = read_manifest(store)
    except FormatError as err:
        report.fail(str(err))
        return report
    indexes = _check_local_index(store, m, report)
    seen_classes = np.zeros(len(m["classes"]), dtype=np.int64)
    for k, shard in enumerate(m["shards"]):
        name = shard["name"]
        path = os.path.join(store, name)
        try:
            size = os.path.getsize(path)
        except OSError as err:
            report.shards_checked += 1
            report.fail(f"{name}: shard file missing or unreadable ({err.strerror})")
            continue
        checksum = functools.partial(file_checksum, path)  # computed only when the size is right
        _check_shard(report, m, shard, path, size, checksum, decode, timeout, seen_classes,
                     indexes[k] if indexes else None)
    _check_class_counts(report, m, seen_classes)
    _check_field_files(report, m, lambda name: os.path.join(store, name))
    return report


def _check_field_files(report: VerifyReport, m: dict, path_of: Callable[[str], str]) -> None:
    """Every field file of the store's added fields (``fastdata.add_fields``), whole: size,
    checksum, header, arrays, every value (``path_of(name)``: the file's local path, or a copy)."""
    fields = added_fields(m, report.store)
    for shard in m["shards"]:
        for gen, entry in sorted(field_files(shard).items()):
            name = entry["name"]
            try:
                report.field_values_checked += check_field_file(
                    path_of(name), [a for a in fields if a.generation == gen], shard["count"], entry, name)
            except FastdataError as err:
                report.fail(str(err))
            except OSError as err:
                report.fail(f"{name}: field file missing or unreadable ({err.strerror or err})")


def _check_shard(report: VerifyReport, m: dict, shard: dict, path: str, size: int, checksum: Callable[[], str],
                 decode: bool, timeout: float, seen_classes: np.ndarray, stored_index=None) -> None:
    """Check one shard file at ``path`` (``size`` bytes; ``checksum()`` its xxh3-64) against
    manifest ``m``'s entry ``shard``, then its records; findings go to ``report``. A file that
    is not what the manifest says has its records checked in a child process (it may crash
    the reader); a version-1 shard adds its labels to ``seen_classes``. ``stored_index``: the
    shard's entry of the store index file, whose ``record_ranges`` (when it has them) are checked
    against a sound shard (:func:`_check_ranges`)."""
    name = shard["name"]
    report.shards_checked += 1
    file_ok = size == shard["bytes"]
    if not file_ok:
        report.fail(f"{name}: file is {size} bytes, the manifest says {shard['bytes']} (truncated or replaced)")
    elif checksum() != shard["xxh"]:
        file_ok = False
        report.fail(f"{name}: file checksum mismatch (the shard was modified or damaged)")
    try:  # the backend's structure checks (pread only: they cannot fault), before any record is read
        reader_class(m["backend"]).check_structure(path, full=True)
    except FastdataError as err:
        report.fail(f"{name}: {err}")
        return
    args = (m["backend"], path, m["storage"], shard["count"], shard["image_bytes"], len(m["classes"]), decode,
            m.get("schema"), name)
    checked, decoded, problems = _check_records(*args) if file_ok else _check_records_isolated(args, timeout)
    report.records_checked += checked
    report.decoded += decoded
    for p in problems:
        report.fail(p)
    if file_ok and not problems and stored_index is not None:
        _check_ranges(report, m, name, path, stored_index)
    if file_ok and not problems and is_classification(m):
        with reader_class(m["backend"])(path, StorageSpec.from_json(m["storage"])) as reader:
            index = reader.read_index()
            assert isinstance(index, ShardIndex)
            labels = index.labels
            label_map = label_map_of(shard)
            if label_map is not None:  # (a merged store's shard: its labels are its own store's classes)
                if len(labels) and int(labels.max()) >= len(label_map):
                    report.fail(f"{name}: a label is outside its label_map of {len(label_map)} classes")
                    return
                labels = np.asarray(label_map, dtype=np.int64)[labels]
            seen_classes += np.bincount(labels, minlength=len(seen_classes))[: len(seen_classes)]


def _check_ranges(report: VerifyReport, m: dict, name: str, path: str, index) -> None:
    """The store index file's ``record_ranges`` of shard ``name`` (at ``path``, a sound file), when it
    has them: every record's pieces lie in the file and give the record, checked as a ranged read
    (``cache="records"``) checks it; the first record that does not is reported."""
    ranges = index.record_ranges
    if ranges is None:
        return
    reader_cls, schema = reader_class(m["backend"]), _manifest_schema(m)
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))  # (Windows opens in text mode without it)
    try:
        for j in range(len(ranges)):
            pieces = [(a, n) for a, n in ranges[j].tolist() if n]
            why = None
            if any(a + n > size for a, n in pieces):
                why = "place it past the end of the shard"
            else:
                value = b"".join(portable.pread(fd, n, a) for a, n in pieces)
                try:
                    reader_cls.from_stored_value(value, j, int(index.checksums[j]), schema=schema, where="")
                except FastdataError as err:
                    why = f"do not give the record ({str(err).lstrip(': ')})"
            if why is not None:
                report.fail(f"{name}: record {j}: the record_ranges of {index_file_name(m)} {why}; reading it "
                            "with cache='records' fails (the store index file is damaged or was crafted)")
                return
    finally:
        os.close(fd)


def _manifest_schema(m: dict):
    """The general store's schema, or None for a version-1 store (whose index has no schema)."""
    if not m.get("schema"):
        return None
    from fastdata.format.fields import Schema

    return Schema.from_json(m["schema"])


def _check_local_index(store: str, m: dict, report: VerifyReport) -> list | None:
    """``index.fdi`` (what remote readers use instead of the shards' own indexes) against the
    manifest: a regular file (never a FIFO) of exactly the declared size, read with that size as
    the limit, with the declared checksum and the manifest's shards and counts. Returns its shard
    indexes (None: none, or unreadable)."""
    from fastdata.common.fileio import read_regular

    entry = m.get(MANIFEST_KEY)
    if entry is None:
        return None  # an older store: it has none
    name = index_file_name(m)
    path = os.path.join(store, name)
    try:
        data = read_regular(path, entry["bytes"], "store index")
        return parse_store_index(data, m, _manifest_schema(m), path)
    except FileNotFoundError:
        report.fail(f"{name}: missing (the manifest lists one of {entry['bytes']} bytes)")
    except OSError as err:
        report.fail(f"{name}: unreadable ({err.strerror or err})")
    except FormatError as err:
        report.fail(f"{name}: {err}")
    return None


def _check_class_counts(report: VerifyReport, m: dict, seen_classes: np.ndarray) -> None:
    if report.ok and is_classification(m) and seen_classes.tolist() != m["class_counts"]:
        report.fail(f"per-class counts {seen_classes.tolist()} differ from the manifest's {m['class_counts']}")


def _verify_remote(url: str, decode: bool, timeout: float, storage_options: Mapping[str, Any] | None,
                   scratch_dir: str | None) -> VerifyReport:
    """:func:`verify` of a store at a URL (see there)."""
    report = VerifyReport(store=url.rstrip("/"))
    store = _open_remote_for_verify(url, storage_options, report)
    if store is None:
        return report
    m = store.manifest
    indexes = _check_remote_index(store, m, report)
    seen_classes = np.zeros(len(m["classes"]), dtype=np.int64)
    scratch = _scratch_root(scratch_dir)
    with tempfile.TemporaryDirectory(prefix=".verify-", dir=scratch) as tmp:
        for k, shard in enumerate(m["shards"]):
            name = shard["name"]
            size = store.location.size(name)
            if size is None:
                report.shards_checked += 1
                report.fail(f"{name}: shard object missing on the server ({store.location.child(name)})")
                continue
            if size != shard["bytes"]:  # never download more than the manifest says, whatever the server claims
                report.shards_checked += 1
                report.fail(f"{name}: the server says the object is {size} bytes, the manifest says "
                            f"{shard['bytes']} (truncated or replaced)")
                continue
            path = os.path.join(tmp, name)
            try:
                digest = store.location.download(name, path, shard["bytes"])
            except FileNotFoundError:  # deleted since it was looked up
                report.shards_checked += 1
                report.fail(f"{name}: shard object missing on the server ({store.location.child(name)})")
                continue
            except RemoteSizeError as err:  # longer or shorter than the manifest says while it downloaded
                report.shards_checked += 1
                report.fail(f"{name}: {err}")
                continue
            try:
                checksum = functools.partial(str, digest)  # computed while it downloaded
                _check_shard(report, m, shard, path, size, checksum, decode, timeout, seen_classes,
                             indexes[k] if indexes else None)
            finally:
                os.unlink(path)
        _check_field_files(report, m, functools.partial(_download_field_file, store, tmp))
    _check_class_counts(report, m, seen_classes)
    return report


def _download_field_file(store: RemoteStore, tmp: str, name: str) -> str:
    """A field file of a remote store, downloaded into ``tmp`` (the server's copy) to be checked."""
    path = os.path.join(tmp, name)
    nbytes = next(e["bytes"] for s in store.manifest["shards"] for e in field_files(s).values() if e["name"] == name)
    try:
        store.location.download(name, path, nbytes)
    except RemoteSizeError as err:
        raise OSError(str(err)) from None
    return path


def _open_remote_for_verify(url: str, storage_options: Mapping[str, Any] | None,
                            report: VerifyReport) -> RemoteStore | None:
    """The remote store, or None with why in ``report`` (not a store, unfinished, damaged manifest)."""
    try:
        store = locate_store(url, storage_options=storage_options)
    except IncompleteStoreError as err:
        report.refuse(UNFINISHED, str(err).removeprefix(f"{report.store}: "))
        return None
    except FormatError as err:
        from fastdata.remote.location import RemoteLocation

        if RemoteLocation(url, storage_options or {}).size(MANIFEST_NAME) is None:
            report.refuse(NOT_A_STORE, f"not a fastdata store: no {MANIFEST_NAME} at this URL")
        else:
            report.fail(str(err))
        return None
    assert isinstance(store, RemoteStore)
    return store


def _check_remote_index(store: RemoteStore, m: dict, report: VerifyReport) -> list | None:
    """The store index file (what readers use instead of opening every shard) against the manifest;
    returns its shard indexes (None: none, or unreadable)."""
    if MANIFEST_KEY not in m:
        return None  # an older store: readers cannot open it remotely, but its shards can still be verified
    schema = _manifest_schema(m)
    name = index_file_name(m)
    try:  # the server's copy, not the cache's: that is what a fresh reader would get
        data = store.location.read_bytes(name, limit=m[MANIFEST_KEY]["bytes"])
        return parse_store_index(data, m, schema, store.location.child(name))
    except FileNotFoundError:
        report.fail(f"{name}: missing on the server ({store.location.child(name)})")
    except FormatError as err:
        report.fail(f"{name}: {err}")
    return None


def _scratch_root(scratch_dir: str | None) -> str:
    """The folder a shard being verified is downloaded into (created if needed)."""
    from fastdata.remote.cache import default_cache_dir

    root = os.path.abspath(scratch_dir or default_cache_dir())
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as err:
        raise RemoteStoreError(f"cannot create {root} to download shards into while verifying ({err.strerror}); "
                               "choose another folder with scratch_dir") from None
    return root
