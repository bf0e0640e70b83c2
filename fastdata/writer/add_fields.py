"""Adding fields to a published store without rewriting it: :func:`add_fields`, :func:`drop_fields`,
:func:`rename_field`, :func:`gc`.

Each call publishes a new version of the store the way an append does (see
:mod:`fastdata.writer.append`): the values go into new field files beside each shard
(:mod:`fastdata.format.added`, one per shard for the call's *generation*), written under names the
current manifest does not list, each written to a temporary name, fsynced and renamed; then the new
``manifest.json`` replaces the old one atomically, last. No shard file, and no file the old
manifest lists, is written to: a dataset opened before reads on in its version (its manifest
check accepts a later manifest whose shards are the same), one opened after sees the fields, and a
SIGKILL at any moment leaves the previous version published (the next call removes what it left).

Files of fields dropped or replaced stay while the version before the current one may still be
read (a dataset opened on it); the next call, or :func:`gc`, removes those no manifest since then lists.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import xxhash

from fastdata.common import portable
from fastdata.errors import FastdataError
from fastdata.format.added import (
    ADDED_FIELDS_KEY,
    IMAGE_META_ARRAYS,
    FIELD_FILES_KEY,
    FIELDS_STAGING_DIR,
    MAX_GENERATION,
    AddedField,
    addable,
    added_fields,
    build_field_file,
    encode_value,
    field_file_generation,
    field_file_name,
    is_field_file_name,
)
from fastdata.format.fields import Chunked, NDArray, Field, Float, Image, Int, SchemaError, infer_field
from fastdata.format.fields import Schema
from fastdata.format.manifest import read_manifest, schema_of, write_manifest
from fastdata.format.names import ATOMIC_TMP_MARK, check_file_name
from fastdata.writer.lock import StoreLock

#: options key: one entry per call that changed the added fields (what ``info`` reports)
HISTORY_KEY = "field_history"


class AddFieldsError(FastdataError, ValueError):
    """Values refused before anything was published: wrong length, a dtype or shape that
    disagrees between samples, a name the store has, a store being written, a function that
    raised. The message names the field and the sample."""


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _as_numpy(values: Any) -> np.ndarray | None:
    """``values`` as a numeric numpy array when it is one already (numpy, torch, anything with
    ``__array__`` but a list), else None."""
    if isinstance(values, np.ndarray):
        return values
    if type(values).__module__.startswith("torch") and hasattr(values, "numpy"):
        return values.detach().cpu().numpy()
    if not isinstance(values, list | tuple) and hasattr(values, "__array__"):
        return np.asarray(values)
    return None


def _array_field(name: str, array: np.ndarray) -> Field:
    """The field of an array of values indexed like the store (row ``i``: sample ``i``)."""
    if array.dtype.kind not in "biuf":
        raise AddFieldsError(f"field {name!r}: an array of dtype {array.dtype} is not numeric; give a list of "
                             "values instead (strings, JSON) or cast it")
    if array.ndim == 1:
        if array.dtype.kind == "f":
            return Float(array.dtype.name, allow_nan=bool(np.isnan(array).any()))
        return Int(array.dtype.name)
    return NDArray(array.dtype.name, array.shape[1:])


class AddedColumn:
    """One field's values, checked: a fixed-size field as one array, any other as encoded bytes,
    a chunked field as the array-likes given (their shapes and dtypes checked; each is read and
    compressed chunk by chunk when its shard's field file is built, never whole)."""

    def __init__(self, name: str, field: Field, count: int, values: Any, first: int = 0):
        self.name, self.field, self.first = name, field, first
        self.fixed = field.index_shape is not None
        self.array: np.ndarray | None = None
        self.encoded: list[bytes] | None = None
        #: a chunked field's values (array-likes, read when their shard's file is built)
        self.lazy: list[Any] | None = None
        #: where a chunked field's compressed chunks wait for their field file (None: the system's
        #: temporary folder); the caller sets the store's own folder where it can
        self.spill_dir: str | None = None
        self._spills: list[str] = []
        #: an image field's per-sample arrays (format code, width, height, dtype code, channels)
        self.image_meta: dict[str, np.ndarray] = {}
        array = _as_numpy(values)
        if isinstance(field, Chunked):
            self.lazy = [field.check(v, f"field {name!r} sample {i}") for i, v in enumerate(_each(name, values), first)]
        elif self.fixed:
            dtype, shape = field.index_shape  # type: ignore[misc]
            if array is not None and array.dtype.kind in "biuf":
                self.array = self._checked_array(array, dtype, shape)
            else:
                rows = [field.check(v, f"field {name!r} sample {i}") for i, v in enumerate(_each(name, values), first)]
                self.array = np.asarray(rows, dtype=dtype).reshape((len(rows), *shape))
        elif isinstance(field, Image):
            self.encoded, self.image_meta = _images(name, values, first)
        else:
            self.encoded = [encode_value(field, field.check(v, f"field {name!r} sample {i}"))
                            for i, v in enumerate(_each(name, values), first)]
        got = len(self)
        if got != count:
            raise AddFieldsError(f"field {name!r}: {got} values for a store of {count} samples (give one a sample, "
                                 "in store order)")

    def _checked_array(self, array: np.ndarray, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A whole array at once: its rows' shape, a lossless cast to the field's dtype, NaN."""
        name = self.name
        if array.shape[1:] != shape:
            raise AddFieldsError(f"field {name!r}: each sample's value has shape {array.shape[1:]}, the field "
                                 f"{self.field!r} needs {shape}")
        with np.errstate(over="ignore", invalid="ignore"):  # (what does not fit is found just below)
            cast = array.astype(dtype, copy=False)
            back = cast.astype(array.dtype)
        if cast.dtype != array.dtype:
            bad = ~((back == array) | (np.isnan(array) & np.isnan(back)) if array.dtype.kind == "f" else back == array)
            if bad.any():
                i = self.first + int(np.flatnonzero(bad.reshape(len(array), -1).any(axis=1))[0])
                raise AddFieldsError(f"field {name!r} sample {i}: values of dtype {array.dtype} do not fit "
                                     f"{dtype.name} exactly")
        if isinstance(self.field, Float) and not self.field.allow_nan and cast.dtype.kind == "f":
            nan = np.isnan(cast)
            if nan.any():
                raise AddFieldsError(f"field {name!r} sample {self.first + int(np.flatnonzero(nan)[0])}: NaN (declare "
                                     "Float(allow_nan=True) if NaN is meant)")
        if isinstance(self.field, Int) and self.field.dtype.kind == "b" and array.dtype.kind != "b":
            bad = (array != 0) & (array != 1)
            if bad.any():
                raise AddFieldsError(f"field {name!r} sample {self.first + int(np.flatnonzero(bad)[0])}: not a bool "
                                     "(0 or 1)")
        return np.ascontiguousarray(cast)

    def __len__(self) -> int:
        """How many values (samples) the column has."""
        if self.array is not None:
            return len(self.array)
        return len(self.lazy if self.lazy is not None else self.encoded or ())

    def shard_arrays(self, first: int, count: int) -> dict[str, np.ndarray]:
        """The field file arrays of this field for samples ``first .. first + count`` (a chunked
        field's chunks wait in a file until :meth:`release`).

        Raises:
            AddFieldsError: a chunked value the field refuses once read (a dtype that does not
                fit, a region of another shape), naming the field and sample.
        """
        if self.array is not None:
            return {self.name: self.array[first:first + count]}
        if self.lazy is not None:
            return self._chunked_arrays(first, count)
        assert self.encoded is not None
        out = self._value_arrays(self.encoded[first:first + count], count)
        out.update({f"{self.name}.{meta}": array[first:first + count] for meta, array in self.image_meta.items()})
        return out

    def _chunked_arrays(self, first: int, count: int) -> dict[str, np.ndarray]:
        """A chunked field's arrays: each value read and compressed chunk by chunk as a conversion
        writes it (:func:`fastdata.writer.chunking.write_chunks`), its chunks appended to one file
        (mapped as ``<name>.chunks``), its table the value."""
        import tempfile

        from fastdata.writer.chunking import write_chunks

        field = self.field
        assert isinstance(field, Chunked) and self.lazy is not None
        shapes = np.zeros((count, field.ndim), dtype="<i8")
        firsts = np.zeros(count, dtype="<u8")
        tables: list[bytes] = []
        fd, path = tempfile.mkstemp(prefix=".fastdata-added-chunks-", dir=self.spill_dir)
        self._spills.append(path)
        pos = 0
        with os.fdopen(fd, "wb") as out:
            for k in range(count):
                where = f"field {self.name!r} sample {self.first + first + k}"
                try:
                    table, pending = write_chunks(field, self.name, self.lazy[first + k], where,
                                                  self.spill_dir or tempfile.gettempdir())
                except SchemaError as err:
                    raise AddFieldsError(str(err)) from None
                assert pending is not None
                try:
                    for data in pending.stored():
                        out.write(data)
                finally:
                    os.unlink(pending.path)
                shapes[k] = table.shape
                firsts[k] = pos
                pos += table.stored_bytes
                tables.append(encode_value(field, table))
        chunks = np.memmap(path, dtype=np.uint8, mode="r") if pos else np.zeros(0, dtype=np.uint8)
        out_arrays = self._value_arrays(tables, count)
        out_arrays.update({f"{self.name}.shape": shapes, f"{self.name}.first": firsts, f"{self.name}.chunks": chunks})
        return out_arrays

    def release(self) -> None:
        """Remove the files a chunked field's chunks waited in (once their field files are written)."""
        for path in self._spills:
            try:
                os.remove(path)
            except OSError:
                pass
        self._spills = []

    def _value_arrays(self, values: list[bytes], count: int) -> dict[str, np.ndarray]:
        """The offsets, checksums and data arrays of encoded values."""
        offsets = np.zeros(count + 1, dtype="<i8")
        np.cumsum([len(v) for v in values], out=offsets[1:])
        checksums = np.fromiter((xxhash.xxh3_64_intdigest(v) for v in values), dtype="<u8", count=count)
        data = np.frombuffer(b"".join(values), dtype=np.uint8)
        return {f"{self.name}.offsets": offsets, f"{self.name}.checksums": checksums, f"{self.name}.data": data}


def _images(name: str, values: Any, first: int) -> tuple[list[bytes], dict[str, np.ndarray]]:
    """An image field's values encoded as a record holds them (the encoded file's bytes: bytes as
    they are, a path read, a PIL image, a numpy array or torch tensor encoded losslessly, as
    :func:`fastdata.write` takes them), each fully decoded once to check it and to record its
    format, size, pixel dtype and channels (the index arrays of a written image field)."""
    from fastdata.common.imageio import ImageDecodeError, inspect_image
    from fastdata.errors import RejectedInputError
    from fastdata.format.record import FORMAT_CODES, image_dtype_code
    from fastdata.writer.sources.python import encoded_image_bytes

    encoded: list[bytes] = []
    rows: list[tuple[int, int, int, int, int]] = []
    for i, value in enumerate(_each(name, values), first):
        where = f"field {name!r} sample {i}"
        try:
            data, _path, info = encoded_image_bytes(value, where)
            if info is None:
                info = inspect_image(data)
        except (SchemaError, RejectedInputError) as err:
            raise AddFieldsError(str(err)) from None
        except ImageDecodeError as err:
            raise AddFieldsError(f"{where}: not a usable image ({err})") from None
        encoded.append(encode_value(Image(), data))
        rows.append((FORMAT_CODES[info.format], info.width, info.height, image_dtype_code(info.dtype), info.channels))
    table = np.asarray(rows, dtype=np.int64).reshape(len(rows), 5)
    meta = {part: table[:, k].astype(dtype) for k, (part, dtype) in enumerate(IMAGE_META_ARRAYS.items())}
    return encoded, meta


def _each(name: str, values: Any):
    if isinstance(values, str | bytes) or not hasattr(values, "__len__") or not hasattr(values, "__getitem__"):
        raise AddFieldsError(f"field {name!r}: values must be a sequence with one value a sample (a list or an "
                             f"array), not {type(values).__name__}")
    return (values[i] for i in range(len(values)))


def _field_of(name: str, values: Any, declared: Field | None) -> Field:
    if declared is not None:
        field = declared
    else:
        array = _as_numpy(values)
        if array is not None and array.ndim >= 1:
            field = _array_field(name, array)
        else:
            try:
                first = values[0]
            except (TypeError, IndexError, KeyError):
                raise AddFieldsError(f"field {name!r}: no values to infer its kind from; declare it with "
                                     "fields={name: fastdata.fields....}") from None
            try:
                field = infer_field(first, f"field {name!r} sample 0")
            except SchemaError as err:
                raise AddFieldsError(str(err)) from None
    why = addable(field)
    if why is not None:
        raise AddFieldsError(f"field {name!r}: {why}")
    return field


def json_default(name: str, field: Field, value: Any) -> tuple:
    """``(value,)`` as the manifest records a field's default (a JSON value the field's kind
    accepts: an array as nested lists, a numpy number as a Python one), checked.

    Raises:
        AddFieldsError: a value the field does not accept, or one JSON cannot hold.
    """
    import json

    where = f"field {name!r}: its default"
    try:
        checked = field.check(value, where)
    except SchemaError as err:
        raise AddFieldsError(str(err)) from None
    plain = checked.tolist() if isinstance(checked, np.ndarray | np.generic) else checked
    try:
        json.dumps(plain, allow_nan=False)
    except (TypeError, ValueError):
        raise AddFieldsError(f"{where}: {value!r:.60} cannot be recorded in the manifest (a JSON value without "
                             "NaN or infinity is needed)") from None
    return (plain,)


def _lock(store: str) -> StoreLock:
    return StoreLock(store).acquire()


def _published(store: str) -> dict:
    from fastdata.common.paths import check_local_path

    check_local_path(store, "store")
    return read_manifest(store)


def _next_generation(manifest: dict, store: str) -> int:
    history = manifest["options"].get(HISTORY_KEY) or []
    gens = [e.get("generation", 0) for e in history if isinstance(e, dict) and type(e.get("generation")) is int]
    gen = max(gens, default=0) + 1
    if gen > MAX_GENERATION:
        raise AddFieldsError(f"{store}: {MAX_GENERATION} generations of added fields: rewrite the store")
    return gen


def _remove_unpublished(store: str, manifest: dict, keep: set[str]) -> None:
    """Field files of a call that did not publish (a higher generation than any published, or a
    temporary), and those no manifest from ``keep`` on lists."""
    listed = {e["name"] for s in manifest["shards"] for e in s.get(FIELD_FILES_KEY, [])} | keep
    shutil.rmtree(os.path.join(store, FIELDS_STAGING_DIR, SPILL_DIR), ignore_errors=True)  # (a killed add's chunks)
    for name in os.listdir(store):
        base = name.split(ATOMIC_TMP_MARK, 1)[0]
        if (is_field_file_name(name) and name not in listed) or (base != name and is_field_file_name(base)):
            portable.remove_unless_held(os.remove, os.path.join(store, name))


def write_field_file(path: str, pieces: list) -> tuple[int, str]:
    """Write ``pieces`` to ``path`` through a temporary (fsync, rename); ``(bytes, xxh3-64 hex)``."""
    tmp = f"{path}{ATOMIC_TMP_MARK}{os.getpid()}"
    digest = xxhash.xxh3_64()
    size = 0
    fd = portable.open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | portable.OPEN_FLAGS, 0o644)
    try:
        with os.fdopen(fd, "wb") as fh:
            for piece in pieces:
                fh.write(piece)
                digest.update(piece)
                size += len(piece)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    return size, digest.hexdigest()


def add_fields(store: str | os.PathLike, values: Mapping[str, Any], *, fields: Mapping[str, Field] | None = None,
               replace: bool = False, defaults: Mapping[str, Any] | None = None,
               progress: Callable[[int, int], None] | None = None,
               storage_options: Mapping[str, Any] | None = None, resume: bool = False) -> dict:
    """Add fields to a published store without rewriting it, as a new version.

    Args:
        store: the store directory, or its URL (``s3://...``: the field files are uploaded and
            checked, then the manifest, last, under the store's lock object).
        values: ``{name: values}``, one value a sample in store order: an array indexed like the
            store (``N`` numbers: an int or float field; ``N x ...``: an ndarray field, e.g. an
            ``N x 512`` float16 embedding), or a list (ragged arrays, strings, JSON values; the
            kind inferred from the first value as :func:`fastdata.write` infers it).
        fields: declared kinds (``{name: fastdata.fields.Float("float32")}``) for names whose
            kind is not to be inferred; ``fastdata.fields.Chunked(dtype, chunks)`` for N-D arrays
            read by region (each value an array-like, read and compressed chunk by chunk).
        replace: replace added fields of these names (a field the store was written with is
            never replaced).
        defaults: ``{name: value}``: the value a later append (``convert(..., append=True)``)
            gives its new samples for these fields when it is given none (recorded in the
            manifest: a JSON value the field accepts, e.g. ``0.0``, ``""``, ``[0, 0, 0]``).
            Without one an append must give the field's values (``added_values=``).
        progress: called ``progress(done, total)`` after each shard's field file.
        storage_options: fsspec options of a store at a URL (endpoint, credentials...).
        resume: finish a call with the same values that was interrupted (a crash, SIGKILL,
            Ctrl-C): the field files it wrote (uploaded, at a URL) whose bytes are those these
            values give are kept, the others written; a call that had published already is not
            repeated (its manifest is returned). Without it, what an interrupted call left is
            removed and everything is written again (as a new append discards an unfinished one).

    Returns:
        dict: the new manifest.

    Raises:
        AddFieldsError: a length that is not the store's sample count, values whose dtype or
            shape disagree with the field (named, with the first sample that does), a name the
            store has (without ``replace``), an image or chunked value the field refuses;
            nothing is published.
        StoreLockedError: a conversion, append or another ``add_fields`` is writing the store.
    """
    store = os.fspath(store)
    declared = dict(fields or {})
    unknown = sorted(set(declared) - set(values))
    if unknown:
        raise AddFieldsError(f"fields= declares {', '.join(unknown)}, which values= does not give")
    if not values:
        raise AddFieldsError("no fields to add")
    unknown = sorted(set(defaults or {}) - set(values))
    if unknown:
        raise AddFieldsError(f"defaults= names {', '.join(map(str, unknown))}, which values= does not give")
    declared_defaults = dict(defaults or {})
    if _is_url(store):
        return add_fields_remote(store, values, declared, replace, progress, storage_options, declared_defaults,
                                 resume=resume)
    manifest = _published(store)
    lock = _lock(store)
    try:
        manifest = _published(store)  # (the version under the lock)
        if resume and _published_already(store, manifest, values, declared, declared_defaults):
            return manifest
        columns, gen, new_fields = _prepare(store, manifest, values, declared, replace, declared_defaults)
        # (resume: this generation's files a killed call wrote are kept, to be compared below)
        _remove_unpublished(store, manifest, {field_file_name(gen, s["name"]) for s in manifest["shards"]}
                            if resume else set())
        spill = _spill_dir(store, columns)

        def place(name: str, pieces: list) -> tuple[int, str]:
            path = os.path.join(store, name)
            if resume:
                same = _same_file(path, pieces)
                if same is not None:  # written by the interrupted call, from these values
                    return same
            return write_field_file(path, pieces)

        try:
            shards = _write_shard_files(store, manifest, columns, gen, place, progress)
        finally:
            if spill is not None:
                shutil.rmtree(spill, ignore_errors=True)
                try:
                    os.rmdir(os.path.dirname(spill))  # (the staging folder, unless a compute run's is there)
                except OSError:
                    pass
        entry = {"generation": gen, "action": "add", "fields": [c.name for c in columns], "at": new_fields[-1].added}
        return _publish(store, manifest, new_fields, shards, entry)
    finally:
        lock.release()


#: the folder (in a local store's fields staging folder) where an add's chunked values wait, compressed,
#: for their field files (removed when the add ends, or by the next add or gc after a kill)
SPILL_DIR = "chunks"


def _spill_dir(store: str, columns: list[AddedColumn]) -> str | None:
    """Make the folder the chunked columns among ``columns`` spill into, inside the store (the
    same file system as the field files), and point them at it; None when none is chunked."""
    if not any(c.lazy is not None for c in columns):
        return None
    path = os.path.join(store, FIELDS_STAGING_DIR, SPILL_DIR)
    os.makedirs(path, exist_ok=True)
    for c in columns:
        c.spill_dir = path
    return path


def _digest(pieces: list) -> tuple[int, str]:
    """``(bytes, xxh3-64 hex)`` of a field file's pieces, as :func:`write_field_file` would write them."""
    digest = xxhash.xxh3_64()
    size = 0
    for piece in pieces:
        digest.update(piece)
        size += len(piece)
    return size, digest.hexdigest()


def _same_file(path: str, pieces: list) -> tuple[int, str] | None:
    """``(bytes, xxh3-64 hex)`` when the file at ``path`` holds exactly ``pieces`` (a field file an
    interrupted call wrote: written whole, then renamed into place), else None."""
    from fastdata.common.fileio import open_regular

    size, xxh = _digest(pieces)
    try:
        fd = open_regular(path, "field file")
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != size:
            return None
        digest = xxhash.xxh3_64()
        for offset in range(0, size, 1 << 24):
            digest.update(portable.pread(fd, min(1 << 24, size - offset), offset))
    finally:
        os.close(fd)
    return (size, xxh) if digest.hexdigest() == xxh else None


def _published_already(store: str, manifest: dict, values: Mapping[str, Any], declared: Mapping[str, Field],
                       defaults: Mapping[str, Any]) -> bool:
    """Whether the store's current version is the one an ``add_fields`` of exactly ``values``
    publishes (a resume of a call killed after its manifest): its last change added these fields,
    of the same kinds and defaults, and every shard's file of that generation holds the bytes
    these values give (compared by size and checksum with the manifest: no file is read)."""
    history = manifest["options"].get(HISTORY_KEY) or []
    last = history[-1] if history and isinstance(history[-1], dict) else {}
    if last.get("action") != "add" or sorted(map(str, last.get("fields") or [])) != sorted(map(str, values)):
        return False
    current = {a.name: a for a in added_fields(manifest, store)}
    mine = [current.get(name) for name in values]
    if any(a is None or a.generation != last.get("generation") or a.key != a.name for a in mine):
        return False
    try:
        columns = []
        for a in mine:
            assert a is not None
            field = _field_of(a.name, values[a.name], declared.get(a.name))
            default = json_default(a.name, field, defaults[a.name]) if a.name in defaults else ()
            if field.to_json() != a.field.to_json() or default != a.default:
                return False
            columns.append(AddedColumn(a.name, field, manifest["num_samples"], values[a.name]))
    except (AddFieldsError, SchemaError):
        return False
    gen = last["generation"]
    for shard in manifest["shards"]:
        entry = next((e for e in shard.get(FIELD_FILES_KEY, []) if e["generation"] == gen), None)
        arrays: dict[str, np.ndarray] = {}
        try:
            for c in columns:
                arrays.update(c.shard_arrays(shard["first_index"], shard["count"]))
            got = _digest(build_field_file(shard["count"], arrays))
        finally:
            arrays.clear()
            for c in columns:
                c.release()
        if entry is None or got != (entry["bytes"], entry["xxh"]):
            return False
    return True


def _uploaded_already(location: Any, local_path: str, name: str) -> bool:
    """Whether object ``name`` holds the file ``local_path`` (an interrupted call uploaded it):
    on ``s3://`` its size and its ETag against the file's MD5 (or multipart MD5), as
    ``upload_checked`` checks an upload; other schemes cannot tell, and upload again."""
    from fastdata.writer.remote_sink import expected_etag, part_size

    if location.scheme not in ("s3", "s3a"):
        return False
    fs = location.filesystem()
    path = location._path(name)
    fs.invalidate_cache(path)

    def info() -> dict | None:
        try:
            return fs.info(path)
        except FileNotFoundError:
            return None
    found = location.call(f"looking up {location.child(name)}", info)
    size = os.path.getsize(local_path)
    if not found or int(found.get("size") or 0) != size:
        return False
    etag = str(found.get("ETag") or found.get("etag") or "").strip('"')
    return etag == expected_etag(local_path, part_size(size))


def _is_url(store: str) -> bool:
    from fastdata.common.paths import remote_scheme

    return remote_scheme(store) is not None


def _prepare(store: str, manifest: dict, values: Mapping[str, Any], declared: Mapping[str, Field],
             replace: bool, defaults: Mapping[str, Any] | None = None
             ) -> tuple[list[AddedColumn], int, list[AddedField]]:
    """The checked columns of ``values``, the new generation, and the store's added fields after the
    call (those kept, then the new ones)."""
    count = manifest["num_samples"]
    base = schema_of(manifest, store).names
    current = added_fields(manifest, store)
    current_names = {a.name for a in current}
    for name in values:
        if not isinstance(name, str):
            raise AddFieldsError(f"field name {name!r} is not a string")
        if name in base:
            raise AddFieldsError(f"{store}: field {name!r} is one the store was written with; it cannot be "
                                 "replaced (choose another name)")
        if name in current_names and not replace:
            raise AddFieldsError(f"{store}: field {name!r} was added already; pass replace=True to replace it "
                                 "(or drop_fields first)")
    columns = []
    for name, vals in values.items():
        try:
            columns.append(AddedColumn(name, _field_of(name, vals, declared.get(name)), count, vals))
        except SchemaError as err:
            raise AddFieldsError(str(err)) from None
    try:
        Schema(tuple((c.name, c.field) for c in columns))
    except SchemaError as err:
        raise AddFieldsError(f"{store}: {err}") from None
    gen = _next_generation(manifest, store)
    when = _now()
    new_fields = [a for a in current if a.name not in values]
    new_fields += [AddedField(c.name, c.field, gen, when, c.name,
                              json_default(c.name, c.field, defaults[c.name]) if defaults and c.name in defaults
                              else ())
                   for c in columns]
    return columns, gen, new_fields


def _write_shard_files(store: str, manifest: dict, columns: list[AddedColumn], gen: int,
                       place: Callable[[str, list], tuple[int, str]],
                       progress: Callable[[int, int], None] | None) -> list[dict]:
    """Each shard's field file of generation ``gen`` (``place(name, pieces) -> (bytes, xxh)`` puts
    it in the store); returns the shard entries with it listed."""
    shards = [dict(s) for s in manifest["shards"]]
    for k, shard in enumerate(shards):
        name = field_file_name(gen, shard["name"])
        if check_file_name(name) is not None:
            raise AddFieldsError(f"{store}: shard {shard['name']}: its field file name would be too long")
        arrays: dict[str, np.ndarray] = {}
        try:
            for c in columns:
                arrays.update(c.shard_arrays(shard["first_index"], shard["count"]))
            size, xxh = place(name, build_field_file(shard["count"], arrays))
        finally:
            arrays.clear()
            for c in columns:
                c.release()
        shard[FIELD_FILES_KEY] = list(shard.get(FIELD_FILES_KEY, [])) + [
            {"name": name, "generation": gen, "bytes": size, "xxh": xxh}]
        if progress is not None:
            progress(k + 1, len(shards))
    return shards


def add_fields_remote(url: str, values: Mapping[str, Any], declared: Mapping[str, Field], replace: bool,
                       progress: Callable[[int, int], None] | None,
                       storage_options: Mapping[str, Any] | None, defaults: Mapping[str, Any],
                       base_checksum: str | None = None, history: Mapping[str, Any] | None = None,
                       resume: bool = False) -> dict:
    """:func:`add_fields` of a store at a URL: each field file written locally and uploaded (its size
    and ETag checked), then the new manifest uploaded last, under the store's lock object. Datasets
    opened before read on in their version (their cache is keyed by the manifest's checksum)."""
    import tempfile

    from fastdata.format.names import MANIFEST_NAME
    from fastdata.writer.remote_sink import upload_checked

    with _remote_store_locked(url, storage_options) as (location, manifest):
        if resume and _published_already(location.url, manifest, values, declared, defaults):
            return manifest
        if base_checksum is not None and manifest["checksum"] != base_checksum:
            raise AddFieldsError(f"{location.url}: the store was changed (a new version published) while its values "
                                 "were computed; nothing was added: run it again")
        columns, gen, new_fields = _prepare(location.url, manifest, values, declared, replace, defaults)
        with tempfile.TemporaryDirectory(prefix="fastdata-add-fields-") as tmp:
            for c in columns:
                c.spill_dir = tmp

            def place(name: str, pieces: list) -> tuple[int, str]:
                path = os.path.join(tmp, name)
                size, xxh = write_field_file(path, pieces)
                if not (resume and _uploaded_already(location, path, name)):  # (resume: the same bytes are there)
                    upload_checked(location, path, name)
                os.remove(path)
                return size, xxh

            shards = _write_shard_files(location.url, manifest, columns, gen, place, progress)
            entry = {"generation": gen, "action": "add", "fields": [c.name for c in columns],
                     "at": new_fields[-1].added, **(history or {})}
            write_manifest(tmp, _new_body(manifest, new_fields, shards, entry))
            upload_checked(location, os.path.join(tmp, MANIFEST_NAME), MANIFEST_NAME)  # last
            return _read_remote_manifest(location)


#: the samples a field history entry lists by index and reason (``compute_fields(on_error="skip")``;
#: ``skipped_count`` counts them all)
MAX_SKIPPED_LISTED = 1000


class FieldsRun:
    """Adding fields whose values arrive shard by shard (computed by a function over the store:
    :func:`fastdata.tools.compute.compute_fields`), resumable after a crash.

    Each finished shard's field file is written into the store's fields staging folder with a
    sidecar of its size and checksum; :meth:`publish` moves them into place and publishes the
    manifest. The store's lock is held from construction to :meth:`close`. The fields' kinds are
    those declared, else inferred from the first shard's values, and recorded in the plan, so a
    resumed run checks its values against the same kinds.

    A store at a URL (``manifest`` and ``staging`` given) stages its field files in the local
    folder ``staging`` (locked by this run) instead; :meth:`publish` uploads them (keeping those
    an interrupted publish uploaded already) and then the manifest, under the store's lock object,
    refused if the store was changed since ``manifest`` (the version the values were computed on).

    Args:
        store: a published local store, or a store's URL.
        resume: finish the run a crash left (its staged shards are kept); without it, a staging
            folder left behind is discarded.
        fields: declared kinds by name.
        replace: replace added fields of the names the values give.
        manifest: a store at a URL: the manifest of the version the values are computed on
            (None: its current one, read).
        staging: a store at a URL: the local folder its run stages in.
        storage_options: a store at a URL: fsspec options.

    Raises:
        AddFieldsError: ``resume`` with nothing to resume, or with a store changed since.
        StoreLockedError: the store (local) or the staging folder (URL) is being written.
    """

    def __init__(self, store: str | os.PathLike, *, resume: bool = False, fields: Mapping[str, Field] | None = None,
                 replace: bool = False, defaults: Mapping[str, Any] | None = None, manifest: dict | None = None,
                 staging: str | None = None, storage_options: Mapping[str, Any] | None = None):
        import json

        self.store = os.fspath(store)
        self.remote = staging is not None
        self.storage_options = dict(storage_options or {})
        if staging is not None:
            os.makedirs(staging, exist_ok=True)
            self.manifest = manifest if manifest is not None else _remote_manifest(self.store, self.storage_options)
            self._lock: StoreLock | None = StoreLock(staging).acquire()
        else:
            self.manifest = _published(self.store)
            self._lock = _lock(self.store)
        try:
            if staging is None:
                self.manifest = _published(self.store)
            # (a URL's run: a folder inside the locked one, so that discarding it keeps the lock file)
            self.staging = os.path.join(self.store, FIELDS_STAGING_DIR) if staging is None else os.path.join(
                staging, "run")
            self.replace = replace
            plan_path = os.path.join(self.staging, "plan.json")
            plan = None
            if os.path.exists(plan_path):
                with open(plan_path, encoding="utf-8") as fh:
                    plan = json.load(fh)
            if resume and (plan is None or plan.get("base") != self.manifest["checksum"]):
                why = ("nothing to resume (no interrupted run)" if plan is None else
                       "the store has another version than when the interrupted run started")
                raise AddFieldsError(f"{self.store}: cannot resume: {why}; run it without resume=True")
            if not resume:
                shutil.rmtree(self.staging, ignore_errors=True)
                plan = None
            self.declared = dict(fields or {})
            self.defaults = dict(defaults or {})
            if plan is None:
                os.makedirs(self.staging, exist_ok=True)
                plan = {"base": self.manifest["checksum"], "generation": _next_generation(self.manifest, self.store),
                        "fields": None, "replace": replace}
                _write_json(plan_path, plan)
                if staging is None:
                    _remove_unpublished(self.store, self.manifest, set())
            self.plan, self._plan_path = plan, plan_path
            self.generation = int(plan["generation"])
        except BaseException:
            self.close()
            raise

    def done(self, shard: int) -> bool:
        """Whether shard ``shard`` (its position in the manifest) has its field file staged."""
        return os.path.exists(self._sidecar(shard))

    def _sidecar(self, shard: int) -> str:
        return os.path.join(self.staging, f"{shard:05d}.json")

    def put(self, shard: int, values: Mapping[str, Any], skipped: Sequence[tuple[int, str]] = ()) -> None:
        """Stage shard ``shard``'s values (one a sample of the shard, by field name), checked
        against the run's field kinds (inferred from the first shard's values when not declared);
        ``skipped``: ``(sample index, why)`` of its samples given their fields' defaults instead
        of computed values (recorded in the published version's history).

        Raises:
            AddFieldsError: values of the wrong count, dtype, shape or kind (naming the field and
                the sample's index in the store), or other names than the first shard gave.
        """
        entry = self.manifest["shards"][shard]
        known = self.plan["fields"]
        if known is None:
            self._check_names(values)
            kinds = {name: _field_of(name, vals, self.declared.get(name)) for name, vals in values.items()}
            self.plan["fields"] = {name: f.to_json() for name, f in kinds.items()}
            _write_json(self._plan_path, self.plan)
            known = self.plan["fields"]
        if sorted(values) != sorted(known):
            raise AddFieldsError(f"{self.store}: shard {entry['name']}: values for {', '.join(sorted(values))}, "
                                 f"the run adds {', '.join(sorted(known))}")
        from fastdata.format.fields import field_from_json

        arrays: dict[str, np.ndarray] = {}
        columns = []
        name = field_file_name(self.generation, entry["name"])
        try:
            for field_name in known:
                column = AddedColumn(field_name, field_from_json(known[field_name], field_name), entry["count"],
                                     values[field_name], first=entry["first_index"])
                column.spill_dir = self.staging
                columns.append(column)
                arrays.update(column.shard_arrays(0, entry["count"]))
            size, xxh = write_field_file(os.path.join(self.staging, name), build_field_file(entry["count"], arrays))
        finally:
            arrays.clear()
            for column in columns:
                column.release()
        _write_json(self._sidecar(shard), {"name": name, "bytes": size, "xxh": xxh,
                                           "skipped": [[int(i), str(why)] for i, why in skipped]})

    def _check_names(self, values: Mapping[str, Any]) -> None:
        base = schema_of(self.manifest, self.store).names
        current = {a.name for a in added_fields(self.manifest, self.store)}
        for name in values:
            if name in base:
                raise AddFieldsError(f"{self.store}: field {name!r} is one the store was written with")
            if name in current and not self.replace:
                raise AddFieldsError(f"{self.store}: field {name!r} was added already; pass replace=True to "
                                     "replace it")
        try:
            Schema(tuple((n, Int()) for n in values))
        except SchemaError as err:
            raise AddFieldsError(f"{self.store}: {err}") from None

    def publish(self) -> dict:
        """Move every staged field file into place and publish the manifest (last); the staging
        folder is removed.

        Raises:
            AddFieldsError: a shard has no staged values.
        """
        import json

        from fastdata.format.fields import field_from_json

        shards = [dict(s) for s in self.manifest["shards"]]
        missing = [s["name"] for k, s in enumerate(shards) if not self.done(k)]
        if missing or self.plan["fields"] is None:
            raise AddFieldsError(f"{self.store}: no values for shard(s) {', '.join(missing[:5])}")
        skipped: list = []
        staged_files = []
        for k, shard in enumerate(shards):
            with open(self._sidecar(k), encoding="utf-8") as fh:
                staged = json.load(fh)
            skipped += staged.get("skipped") or []
            staged_files.append(staged["name"])
            shard[FIELD_FILES_KEY] = list(shard.get(FIELD_FILES_KEY, [])) + [
                {"name": staged["name"], "generation": self.generation, "bytes": staged["bytes"],
                 "xxh": staged["xxh"]}]
        names = list(self.plan["fields"])
        when = _now()
        fields = [a for a in added_fields(self.manifest, self.store) if a.name not in names]
        kinds = {n: field_from_json(self.plan["fields"][n], n) for n in names}
        fields += [AddedField(n, kinds[n], self.generation, when, n,
                              json_default(n, kinds[n], self.defaults[n]) if n in self.defaults else ())
                   for n in names]
        entry = {"generation": self.generation, "action": "add", "fields": names, "at": when}
        if skipped:
            entry.update(skipped_count=len(skipped), skipped=skipped[:MAX_SKIPPED_LISTED])
        if self.remote:
            new = self._publish_remote(staged_files, fields, shards, entry)
        else:
            for name in staged_files:
                os.replace(os.path.join(self.staging, name), os.path.join(self.store, name))
            new = _publish(self.store, self.manifest, fields, shards, entry)
        shutil.rmtree(self.staging, ignore_errors=True)
        return new

    def _publish_remote(self, staged: list[str], fields: list[AddedField], shards: list[dict], entry: dict) -> dict:
        """:meth:`publish` of a store at a URL: under its lock object, refused if a new version was
        published since the one the values were computed on; each staged file uploaded and checked
        (one an interrupted publish uploaded, the same bytes, is kept), then the manifest, last."""
        import tempfile

        from fastdata.format.names import MANIFEST_NAME
        from fastdata.writer.remote_sink import upload_checked

        with _remote_store_locked(self.store, self.storage_options) as (location, current):
            if current["checksum"] != self.manifest["checksum"]:
                raise AddFieldsError(f"{location.url}: the store was changed (a new version published) while its "
                                     "values were computed; nothing was added: run it again without resume")
            for name in staged:
                path = os.path.join(self.staging, name)
                if not _uploaded_already(location, path, name):
                    upload_checked(location, path, name)
            with tempfile.TemporaryDirectory(prefix="fastdata-fields-") as tmp:
                write_manifest(tmp, _new_body(self.manifest, fields, shards, entry))
                upload_checked(location, os.path.join(tmp, MANIFEST_NAME), MANIFEST_NAME)  # last
            return _read_remote_manifest(location)

    def close(self) -> None:
        """Release the store's lock (what was staged stays, for ``resume=True``)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def _remote_manifest(url: str, storage_options: Mapping[str, Any] | None) -> dict:
    """The (validated) manifest of the store at ``url``."""
    from fastdata.remote.location import RemoteLocation

    return _read_remote_manifest(RemoteLocation(url, dict(storage_options or {})))


def _read_remote_manifest(location) -> dict:
    """The (validated) manifest of the store at ``location`` (a :class:`RemoteLocation`)."""
    from fastdata.format.manifest import MAX_MANIFEST_BYTES, parse_manifest
    from fastdata.format.names import MANIFEST_NAME

    try:
        raw = location.read_bytes(MANIFEST_NAME, limit=MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise AddFieldsError(f"{location.url}: no fastdata store there (no {MANIFEST_NAME})") from None
    return parse_manifest(raw, where=location.child(MANIFEST_NAME))


@contextlib.contextmanager
def _remote_store_locked(url: str, storage_options: Mapping[str, Any] | None) -> Iterator[tuple[Any, dict]]:
    """The store at ``url`` under its lock object (no add, append or conversion uploads into it
    meanwhile): ``(location, manifest)``, the manifest read once the lock is held."""
    from fastdata.remote.location import RemoteLocation
    from fastdata.writer.remote_sink import RemoteLock

    location = RemoteLocation(url, dict(storage_options or {}))
    lock = RemoteLock(location)
    lock.check()
    lock.write()
    try:
        yield location, _read_remote_manifest(location)
    finally:
        lock.release()


def _write_json(path: str, obj: Any) -> None:
    import json

    from fastdata.common.fileio import atomic_write

    atomic_write(path, json.dumps(obj).encode("utf-8"))


def _new_body(manifest: dict, fields: list[AddedField], shards: list[dict], entry: dict) -> dict:
    """The new manifest's body: ``fields`` added, ``shards`` listing the field files of their
    generations only, ``entry`` appended to the history."""
    live = {a.generation for a in fields}
    for shard in shards:
        kept = [e for e in shard.get(FIELD_FILES_KEY, []) if e["generation"] in live]
        shard.pop(FIELD_FILES_KEY, None)
        if kept:
            shard[FIELD_FILES_KEY] = kept
    body = {k: v for k, v in manifest.items() if k not in ("checksum", ADDED_FIELDS_KEY, "shards")}
    body["shards"] = shards
    if fields:
        body[ADDED_FIELDS_KEY] = [a.to_json() for a in fields]
    body["options"] = dict(manifest["options"])
    body["options"][HISTORY_KEY] = list(manifest["options"].get(HISTORY_KEY) or []) + [entry]
    return body


def _publish(store: str, manifest: dict, fields: list[AddedField], shards: list[dict], entry: dict) -> dict:
    """Write the new manifest (last), then remove the field files neither it nor the previous one lists."""
    body = _new_body(manifest, fields, shards, entry)
    portable.fsync_dir(store)  # the field files' names are durable before the manifest names them
    new = write_manifest(store, body)
    previous = {e["name"] for s in manifest["shards"] for e in s.get(FIELD_FILES_KEY, [])}
    _remove_unpublished(store, new, previous)  # (a reader of the previous version may still read those)
    return new


def _change(store: str, storage_options: Mapping[str, Any] | None,
            build: Callable[[dict], tuple[list[AddedField], dict]]) -> dict:
    """Publish a new version whose added fields ``build(manifest)`` gives (``(fields, history
    entry)``; no field file is written): locally under the store's lock, or at a URL by uploading
    the manifest under its lock object."""
    if not _is_url(store):
        lock = _lock(store)
        try:
            manifest = _published(store)
            fields, entry = build(manifest)
            return _publish(store, manifest, fields, [dict(s) for s in manifest["shards"]], entry)
        finally:
            lock.release()
    import tempfile

    from fastdata.format.manifest import MAX_MANIFEST_BYTES, parse_manifest
    from fastdata.format.names import MANIFEST_NAME
    from fastdata.remote.location import RemoteLocation
    from fastdata.writer.remote_sink import RemoteLock, upload_checked

    location = RemoteLocation(store, dict(storage_options or {}))
    remote_lock = RemoteLock(location)
    remote_lock.check()
    remote_lock.write()
    try:
        manifest = parse_manifest(location.read_bytes(MANIFEST_NAME, limit=MAX_MANIFEST_BYTES),
                                  where=location.child(MANIFEST_NAME))
        fields, entry = build(manifest)
        with tempfile.TemporaryDirectory(prefix="fastdata-fields-") as tmp:
            new = write_manifest(tmp, _new_body(manifest, fields, [dict(s) for s in manifest["shards"]], entry))
            upload_checked(location, os.path.join(tmp, MANIFEST_NAME), MANIFEST_NAME)
        return new
    finally:
        remote_lock.release()


def drop_fields(store: str | os.PathLike, names: Sequence[str], *,
                storage_options: Mapping[str, Any] | None = None) -> dict:
    """Drop added fields, as a new version (their files stay while the previous version may be
    read; :func:`gc` removes them at once).

    Args:
        store: the store directory, or its URL (the new manifest is uploaded; the files stay).
        names: added fields of the store.
        storage_options: fsspec options of a store at a URL.

    Raises:
        AddFieldsError: a name that is not an added field of the store.
    """
    store = os.fspath(store)

    def build(manifest: dict) -> tuple[list[AddedField], dict]:
        current = added_fields(manifest, store)
        missing = sorted(set(names) - {a.name for a in current})
        if missing:
            raise AddFieldsError(f"{store}: {', '.join(missing)}: not added field(s) of the store (added fields: "
                                 f"{', '.join(a.name for a in current) or 'none'})")
        kept = [a for a in current if a.name not in set(names)]
        return kept, {"generation": _next_generation(manifest, store), "action": "drop", "fields": list(names),
                      "at": _now()}

    return _change(store, storage_options, build)


def rename_field(store: str | os.PathLike, old: str, new: str, *,
                 storage_options: Mapping[str, Any] | None = None) -> dict:
    """Rename an added field, as a new version (no file is written: the manifest maps the new
    name to the values stored under the old one).

    Args:
        store: the store directory, or its URL (the new manifest is uploaded).
        old, new: the field's name and its new one.
        storage_options: fsspec options of a store at a URL.

    Raises:
        AddFieldsError: ``old`` is not an added field, or ``new`` is a field of the store.
    """
    store = os.fspath(store)

    def build(manifest: dict) -> tuple[list[AddedField], dict]:
        current = added_fields(manifest, store)
        names = {a.name for a in current}
        if old not in names:
            raise AddFieldsError(f"{store}: {old!r} is not an added field of the store")
        if new in names or new in schema_of(manifest, store).names:
            raise AddFieldsError(f"{store}: the store has a field {new!r} already")
        try:
            Schema(((new, current[0].field),))
        except SchemaError as err:
            raise AddFieldsError(str(err)) from None
        renamed = [AddedField(new, a.field, a.generation, a.added, a.key, a.default) if a.name == old else a
                   for a in current]
        return renamed, {"generation": _next_generation(manifest, store), "action": "rename", "fields": [old, new],
                         "at": _now()}

    return _change(store, storage_options, build)


def _unlisted_field_files(names: Sequence[str], manifest: dict) -> list[str]:
    """Of ``names`` (a store's files or objects), the field files ``manifest`` does not list and
    the temporaries of field files, sorted."""
    listed = {e["name"] for s in manifest["shards"] for e in s.get(FIELD_FILES_KEY, [])}
    out = []
    for name in sorted(names):
        base = name.split(ATOMIC_TMP_MARK, 1)[0]
        if (is_field_file_name(name) and name not in listed) or (base != name and is_field_file_name(base)):
            out.append(name)
    return out


def gc(store: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Remove the field files the current manifest does not list (of dropped or replaced fields,
    or of a call that was killed). A dataset still open on an older version may then fail to read
    those fields: run it when none is.

    Args:
        store: the store directory, or its URL (``s3://...``: the objects are listed and the
            unlisted field files deleted, under the store's lock object; a file the manifest
            lists is never deleted).
        storage_options: fsspec options of a store at a URL.

    Returns:
        list[str]: the names removed.

    Raises:
        StoreLockedError: the store is being written (a conversion, an append, an add).
    """
    store = os.fspath(store)
    if _is_url(store):
        return _gc_remote(store, storage_options)
    if storage_options:
        raise ValueError("storage_options apply to a store at a URL only")
    lock = _lock(store)
    try:
        manifest = _published(store)
        removed = []
        spill = os.path.join(store, FIELDS_STAGING_DIR, SPILL_DIR)
        if os.path.isdir(spill):  # (the chunks a killed add of a chunked field left)
            shutil.rmtree(spill, ignore_errors=True)
            removed.append(os.path.join(FIELDS_STAGING_DIR, SPILL_DIR))
        for name in _unlisted_field_files(os.listdir(store), manifest):
            if portable.remove_unless_held(os.remove, os.path.join(store, name)):
                removed.append(name)
        return removed
    finally:
        lock.release()


def _gc_remote(url: str, storage_options: Mapping[str, Any] | None) -> list[str]:
    """:func:`gc` of a store at a URL: under its lock object (so no add, append or conversion is
    uploading files the manifest does not list yet), the manifest read, the store's top-level
    objects listed, and the field files it does not list deleted."""
    with _remote_store_locked(url, storage_options) as (location, manifest):
        # (the listing follows the manifest: a field file listed by it exists before it is published)
        names = [n for n in location.listing() if "/" not in n]
        removed = _unlisted_field_files(names, manifest)
        location.remove(removed)
        return removed


__all__ = ["AddFieldsError", "add_fields", "appended_values_from_files", "drop_fields", "field_file_generation", "gc",
           "rename_field", "store_paths", "values_from_file"]


#: what ``values_from_file`` reads: NumPy arrays, Parquet and CSV tables
VALUE_FILE_SUFFIXES = (".npy", ".parquet", ".csv")
#: how the rows of a table find their samples
KEYS = ("index", "path")


def store_paths(store: str, manifest: dict) -> list[str]:
    """Every sample's stored path (a folder conversion's relative path; a general store's source
    path, or the sample's index as digits), in store order, from the store index file."""
    from fastdata.common.fileio import read_regular
    from fastdata.format.manifest import is_classification
    from fastdata.format.record import ShardIndex
    from fastdata.format.store_index import MANIFEST_KEY, index_file_name, parse_store_index

    if MANIFEST_KEY not in manifest:
        raise AddFieldsError(f"{store} was made by an older fastdata (no store index file): key values by index")
    path = os.path.join(store, index_file_name(manifest))
    data = read_regular(path, manifest[MANIFEST_KEY]["bytes"] + 1, "store index")
    schema = None if is_classification(manifest) else schema_of(manifest, store)
    out: list[str] = []
    for index in parse_store_index(data, manifest, schema, path):
        if isinstance(index, ShardIndex):
            raw, offsets = index.relpaths, index.relpath_offsets
        else:
            raw, offsets = index.arrays["relpaths"], index.arrays["relpath_offsets"]
        text = np.asarray(raw, dtype=np.uint8).tobytes()
        bounds = np.asarray(offsets).tolist()
        out += [os.fsdecode(text[bounds[i]:bounds[i + 1]]) for i in range(len(bounds) - 1)]
    return out


def _table_columns(path: str) -> dict[str, list]:
    """A Parquet or CSV file's columns as lists (CSV cells: numbers where they parse as numbers)."""
    if path.endswith(".parquet"):
        from fastdata.common.extras import require

        require("pyarrow", "reading values from Parquet files")
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pydict()
    import csv

    with open(path, newline="", encoding="utf-8") as fh:
        rows = list(csv.reader(fh))
    if not rows:
        raise AddFieldsError(f"{path}: an empty CSV file (it needs a header line naming the columns)")
    header, body = rows[0], rows[1:]
    columns: dict[str, list] = {name: [] for name in header}
    for n, row in enumerate(body, start=2):
        if len(row) != len(header):
            raise AddFieldsError(f"{path} line {n}: {len(row)} cells, the header names {len(header)}")
        for name, cell in zip(header, row, strict=True):
            columns[name].append(cell)
    for name, cells in columns.items():
        for kind in (int, float):
            try:
                columns[name] = [kind(c) for c in cells]
                break
            except ValueError:
                continue
    return columns


def _column_values(name: str, cells: list) -> Any:
    """A table column as add_fields values: equal-length lists of numbers as one ``N x D`` array,
    numbers as a 1-D array, anything else as the list."""
    if cells and all(isinstance(c, int | float) and not isinstance(c, bool) for c in cells):
        return np.asarray(cells)
    if cells and all(isinstance(c, list) for c in cells) and len({len(c) for c in cells}) == 1:
        try:
            array = np.asarray(cells)
        except ValueError:
            return cells
        if array.dtype.kind in "iuf" and array.ndim == 2:
            return array
    return cells


def values_from_file(store: str | os.PathLike, path: str | os.PathLike, *, names: Sequence[str] = (),
                     key: str = "index") -> dict[str, Any]:
    """``add_fields`` values read from a file (what the ``add-fields`` command reads).

    Args:
        store: the store the values are for.
        path: a ``.npy`` array (one field: ``names`` gives its name; rows in store order), a
            ``.parquet`` or ``.csv`` table (one field a column; the key column excluded).
        names: the columns to add (default: every column but the key); for ``.npy`` the one name.
        key: ``"index"``: rows in store order, or, when the table has an ``index`` column, each
            row's sample index there; ``"path"``: the table's ``path`` column names each row's
            sample by its stored path (a folder conversion's relative path).

    Raises:
        AddFieldsError: an unknown suffix or key, a missing column, a key that names no sample
            or one sample twice, a sample no row names.
    """
    store, path = os.fspath(store), os.fspath(path)
    if key not in KEYS:
        raise AddFieldsError(f"key must be one of {', '.join(KEYS)}, not {key!r}")
    if not path.endswith(VALUE_FILE_SUFFIXES):
        raise AddFieldsError(f"{path}: values are read from {', '.join(VALUE_FILE_SUFFIXES)} files")
    if path.endswith(".npy"):
        if len(names) != 1:
            raise AddFieldsError(f"{path}: a .npy file holds one field: give its name (names=NAME)")
        if key != "index":
            raise AddFieldsError(f"{path}: a .npy file's rows are in store order (key 'index'); use a table to key "
                                 "values by path")
        try:
            return {names[0]: np.load(path, allow_pickle=False)}
        except ValueError as err:
            raise AddFieldsError(f"{path}: not a numeric .npy array ({err})") from None
    columns = _table_columns(path)
    key_column = key if key == "path" or "index" in columns else None
    if key == "path" and "path" not in columns:
        raise AddFieldsError(f"{path}: key 'path' needs a 'path' column (columns: {', '.join(columns)})")
    wanted = list(names) or [c for c in columns if c != key_column]
    missing = [n for n in wanted if n not in columns]
    if missing:
        raise AddFieldsError(f"{path}: no column(s) {', '.join(missing)} (columns: {', '.join(columns)})")
    if key_column is None:
        return {n: _column_values(n, columns[n]) for n in wanted}
    if _is_url(store):
        raise AddFieldsError(f"{path}: a table keyed by {'path' if key == 'path' else 'an index column'} needs a "
                             "local store; for a store at a URL, give the rows in store order (no index column)")
    manifest = read_manifest(store)
    count = manifest["num_samples"]
    if key == "path":
        where = {p: i for i, p in enumerate(store_paths(store, manifest))}
        order = [where.get(str(p), -1) for p in columns["path"]]
    else:
        order = [i if isinstance(i, int) and not isinstance(i, bool) else -1 for i in columns["index"]]
    for row, i in enumerate(order):
        if not 0 <= i < count:
            raise AddFieldsError(f"{path} row {row}: {key} {columns[key_column][row]!r:.80} names no sample of {store}")
    rows = np.full(count, -1, dtype=np.int64)
    for row, i in enumerate(order):
        if rows[i] >= 0:
            raise AddFieldsError(f"{path} rows {rows[i]} and {row} both name sample {i}")
        rows[i] = row
    if (rows < 0).any():
        raise AddFieldsError(f"{path}: no row for sample {int(np.flatnonzero(rows < 0)[0])} ({int((rows < 0).sum())} "
                             f"of {count} samples have none)")
    return {n: _column_values(n, [columns[n][r] for r in rows.tolist()]) for n in wanted}


def appended_values_from_files(specs: Sequence[str]) -> dict[str, Any]:
    """``added_values`` of an append read from files (what the command line's append takes): each
    spec a ``.parquet`` or ``.csv`` table (one field a column, rows in the order the samples are
    appended) or ``NAME=FILE.npy`` (one field, rows in that order).

    Raises:
        AddFieldsError: an unknown suffix, a ``.npy`` file without a name, a field given twice.
    """
    out: dict[str, Any] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if sep and path.endswith(".npy"):
            try:
                got = {name: np.load(path, allow_pickle=False)}
            except (OSError, ValueError) as err:
                raise AddFieldsError(f"{path}: not a readable numeric .npy array ({err})") from None
        elif spec.endswith((".parquet", ".csv")):
            if not os.path.isfile(spec):
                raise AddFieldsError(f"{spec}: no such file")
            got = {n: _column_values(n, cells) for n, cells in _table_columns(spec).items()}
        else:
            raise AddFieldsError(f"added values {spec!r}: give a .parquet or .csv table (one field a column, rows "
                                 "in the order the samples are appended) or NAME=FILE.npy")
        twice = sorted(set(got) & set(out))
        if twice:
            raise AddFieldsError(f"added values {spec}: field(s) {', '.join(twice)} given twice")
        out.update(got)
    return out


def added_fields_differences(stores: Sequence[tuple[str, dict]]) -> list[str]:
    """How the added fields of stores to be merged differ (each named), empty when every store
    has the same added fields (names and kinds; generations may differ)."""
    def described(m: dict) -> dict[str, dict]:
        return {a.name: a.field.to_json() for a in added_fields(m)}

    first_path, first = stores[0]
    want = described(first)
    out = []
    for path, m in stores[1:]:
        have = described(m)
        if have != want:
            out.append(f"{path} has added fields {sorted(have) or 'none'}, {first_path} "
                       f"{sorted(want) or 'none'} (or of other kinds): a merge needs the same added fields")
    return out


def carry_added_fields(dst: str, sources: Sequence[tuple[str, dict, dict]], body: dict) -> None:
    """Give a merged store the added fields of its inputs: for each new shard, one field file of
    generation 1 holding every added field's values, read from its input shard's field files
    (checked: sizes, checksums, arrays) and written beside it; the manifest ``body`` gets the
    fields (as the first input declares them) and the files.

    Args:
        dst: the merged store's directory.
        sources: ``(input store, its manifest, its shard entry)`` of each new shard, in order.
        body: the merged manifest body, its ``shards`` the new shards in the same order.
    """
    if not sources or not added_fields(sources[0][1]):
        return
    first = added_fields(sources[0][1])
    for (path, m, shard), new in zip(sources, body["shards"], strict=True):
        merged_field_file(dst, _joiner(path), m, shard, new, first)
    finish_merged_fields(body, first)


def _joiner(folder: str) -> Callable[[str], str]:
    return lambda name: os.path.join(folder, name)


def merged_field_file(dst: str, path_of: Callable[[str], str], m: dict, shard: dict, new: dict,
                      first: list[AddedField]) -> str:
    """One merged shard's field file of generation 1 (see :func:`carry_added_fields`): the values
    of input shard ``shard`` (of the store whose manifest is ``m``; ``path_of(name)`` is where its
    field file ``name`` lies, locally) for the fields ``first``, written into ``dst`` and listed
    in the new shard entry ``new``.

    Returns:
        str: the file's name.
    """
    from fastdata.format.added import field_files, load_field_file

    mine = added_fields(m)
    loaded: dict[str, dict[str, np.ndarray]] = {}
    for gen, entry in field_files(shard).items():
        path = path_of(entry["name"])
        loaded.update(load_field_file(path, [a for a in mine if a.generation == gen], shard["count"], entry, path,
                                      check_values=False))
    arrays: dict[str, np.ndarray] = {}
    for a in first:
        parts = loaded[a.name]
        if "values" in parts:
            arrays[a.name] = parts["values"]
        else:  # (an image's per-sample format, size, dtype and channels too)
            arrays.update({f"{a.name}.{part}": array for part, array in parts.items()})
    name = field_file_name(1, new["name"])
    size, xxh = write_field_file(os.path.join(dst, name), build_field_file(shard["count"], arrays))
    new[FIELD_FILES_KEY] = [{"name": name, "generation": 1, "bytes": size, "xxh": xxh}]
    return name


def finish_merged_fields(body: dict, first: list[AddedField]) -> None:
    """The merged manifest ``body``'s added fields (those of the first input, all of generation
    1, each under its own name) and its history entry."""
    body[ADDED_FIELDS_KEY] = [AddedField(a.name, a.field, 1, a.added, a.name, a.default).to_json() for a in first]
    body["options"] = dict(body["options"])
    body["options"][HISTORY_KEY] = [{"generation": 1, "action": "merge", "fields": [a.name for a in first],
                                     "at": _now()}]
