"""Appending to a published store: what :class:`~fastdata.writer.session.WriteSession` does
differently with ``append=True`` (``convert(src, store, append=True)``).

An append is an ordinary write session whose shards are numbered after the store's and whose
publish starts from the store's manifest (:class:`~fastdata.writer.pipeline.PublishedBase`):

* **Compatible or refused, before anything is written.** The backend and storage mode are the
  store's (options not given again are taken from it, as ``resume=True`` does; different ones are
  an error naming each), a general store's schema must be the same (the differences are
  listed), and the class names of the new samples map onto the store's class indices: a name
  the store lacks is an error unless ``add_classes`` appends it at the end of the table (the
  table is then no longer sorted as ImageFolder's). A general store's class tables must be equal.
* **Crash-safe.** New shards and their sidecars go where a conversion puts them (shard files
  the old manifest does not list, and ``.fastdata-staging``), the new version's store index
  file gets a new name (``index-00001.fdi``, ...), and the new ``manifest.json`` replaces the old
  one atomically, last. A SIGKILL at any moment leaves the old manifest, which lists only the
  old, untouched shards: the store reads and verifies as before, and ``append=True resume=True``
  finishes the append (a new ``append=True`` without ``resume=True`` discards the unfinished one).
* **Readers keep their version.** Nothing the old manifest lists is rewritten, so a dataset
  opened before the append reads on in the version it opened (its location accepts a newer
  manifest that only adds shards: :func:`fastdata.remote.store.extends`), and one opened after
  sees every sample.

The manifest's ``options.appends`` lists each append (source, samples, shards, fingerprint);
the store's own ``options`` stay those of its first conversion.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import xxhash

from fastdata.errors import FastdataError, IncompleteStoreError
from fastdata.format.added import ADDED_FIELDS_KEY, AddedField, added_fields, field_file_shard
from fastdata.format.fields import SchemaError
from fastdata.format.manifest import CLASS_TABLES_KEY, is_classification, read_manifest
from fastdata.format.names import MANIFEST_NAME, STAGING_DIR, shard_number
from fastdata.format.store_index import MANIFEST_KEY as STORE_INDEX_KEY
from fastdata.format.store_index import index_file_name, shard_entries
from fastdata.writer.owned import check_dir, remove_file
from fastdata.writer.pipeline import PublishedBase, io_error, remove_staging, remove_unlisted_shards
from fastdata.writer.resume import RecordedRun, RunOptions, describe_storage
from fastdata.writer.sources.base import WriteSource

#: top-level manifest keys an append rebuilds (every other one is carried from the store as it is)
_REBUILT_KEYS = ("format", "version", "backend", "storage", "classes", "num_samples", "class_counts", "shards",
                 "rejected", "warnings", "options", "schema", STORE_INDEX_KEY, "checksum")


class AppendError(FastdataError, ValueError):
    """An append refused before anything was written: the store is missing, unfinished, or
    its backend, storage mode, schema or classes do not match the new samples."""


def open_base(dst: str) -> PublishedBase:
    """The published store at ``dst`` an append adds to (its manifest and store index entries).

    Raises:
        AppendError: no store there, or an unfinished first conversion (finish it with ``resume=True``).
    """
    if not os.path.exists(os.path.join(dst, MANIFEST_NAME)):
        if os.path.isdir(dst) and check_dir(os.path.join(dst, STAGING_DIR)):
            raise AppendError(f"{dst} holds an unfinished conversion, not a published store: finish it with "
                              "resume=True (without append=True) before appending to it")
        raise AppendError(f"{dst}: no fastdata store to append to (no {MANIFEST_NAME}); convert into it "
                          "without append=True first")
    try:
        manifest = read_manifest(dst)
    except IncompleteStoreError as err:
        raise AppendError(f"{dst}: {err}") from None
    if STORE_INDEX_KEY not in manifest:
        raise AppendError(f"{dst} was made by an older fastdata (it has no store index file): convert it again "
                          "with this version before appending to it")
    path = os.path.join(dst, index_file_name(manifest))
    try:
        with open(path, "rb") as fh:
            data = fh.read(manifest[STORE_INDEX_KEY]["bytes"] + 1)
    except OSError as err:
        raise io_error(err, path) from err
    return PublishedBase(manifest=manifest, index_entries=shard_entries(data, manifest, path))


def stored_bytes(base: PublishedBase) -> int:
    """The bytes of the store's shard files (as its manifest records them): what a raw budget
    already holds before an append."""
    return sum(int(s.get("bytes", 0)) for s in base.manifest.get("shards", []))


def recorded_run(base: PublishedBase) -> RecordedRun:
    """The store's own options, as a resume's record: the options an append does not give again."""
    m = base.manifest
    opts = m["options"]
    options = RunOptions.from_json({"backend": m["backend"], "storage": m["storage"],
                                    "shard_size": opts["shard_size"], "strict": opts.get("strict", False),
                                    "shard_size_unit": opts.get("shard_size_unit")})
    return RecordedRun(options=options, source=opts.get("source"), fingerprint=opts.get("fingerprint"),
                       complete=True)


def added_field_names(manifest: dict) -> list[str]:
    """The names of a store's added fields (``fastdata.add_fields``), none for most stores."""
    return [f["name"] for f in manifest.get(ADDED_FIELDS_KEY) or []]


def check_options(dst: str, base: PublishedBase, run: RunOptions) -> None:
    """Refuse an append whose backend or storage mode differ from the store's (each named)."""
    stored = recorded_run(base).options
    diffs = []
    if run.backend != stored.backend:
        diffs.append(f"backend: the store is {stored.backend}, the append asks for {run.backend}")
    if run.storage.to_json() != stored.storage.to_json():
        diffs.append(f"storage: the store keeps {describe_storage(stored.storage)}, the append asks for "
                     f"{describe_storage(run.storage)}")
    if diffs:
        raise AppendError(f"cannot append to {dst}: " + "; ".join(diffs) + " (leave the storage options out: an "
                          "append takes the store's)")


@dataclass
class AddedValues:
    """What an append gives the store's added fields (``fastdata.add_fields``) for its new samples,
    checked before any shard is written: per field, the given values (a checked column, one a
    new sample) or a default (``(value,)``: the append's ``added_defaults`` or the one the field
    was added with)."""

    fields: list[AddedField]
    columns: dict[str, Any]
    defaults: dict[str, tuple]
    #: the manifest checksum of the version it was planned against
    base_checksum: str


def plan_added_values(dst: str, base: PublishedBase, values: Mapping[str, Any] | None,
                      defaults: Mapping[str, Any] | None) -> AddedValues | None:
    """Check what an append gives the store's added fields, before anything is written; None for
    a store without added fields (and no values given).

    Raises:
        AppendError: an added field with neither values nor a default (saying how to give them),
            a name that is not an added field of the store, values whose kind, dtype or shape
            the field refuses (named, with the sample: its position among the appended ones).
    """
    from fastdata.writer.add_fields import AddFieldsError, AddedColumn, json_default

    values, defaults = dict(values or {}), dict(defaults or {})
    fields = added_fields(base.manifest, dst)
    names = [a.name for a in fields]
    unknown = [str(n) for n in list(values) + list(defaults) if n not in names]
    if unknown:
        raise AppendError(f"cannot append to {dst}: {', '.join(unknown)}: not added field(s) of the store (its added "
                          f"fields: {', '.join(names) or 'none'}); added_values and added_defaults name those only")
    both = sorted(set(values) & set(defaults))
    if both:
        raise AppendError(f"cannot append to {dst}: field(s) {', '.join(both)} given both values and a default; "
                          "give one")
    if not fields:
        return None
    missing = [a.name for a in fields if a.name not in values and a.name not in defaults and not a.default]
    if missing:
        raise AppendError(
            f"cannot append to {dst}: it has added field(s) {', '.join(missing)} without a default, and the append "
            "gives no values for them: give one value a new sample, in the order the samples are appended "
            "(added_values=VALUES), or one value for every new sample (added_defaults=DEFAULTS), or declare a "
            "default when adding the field (add_fields(..., defaults=...)), or drop the field (fastdata.drop_fields)")
    columns: dict[str, Any] = {}
    given_defaults: dict[str, tuple] = {}
    for a in fields:
        if a.name in values:
            vals = values[a.name]
            try:
                try:
                    count = len(vals)
                except TypeError:
                    raise AddFieldsError(f"field {a.name!r}: values must be a sequence with one value a new "
                                         f"sample, not {type(vals).__name__}") from None
                columns[a.name] = AddedColumn(a.name, a.field, count, vals)
            except (AddFieldsError, SchemaError) as err:
                raise AppendError(f"cannot append to {dst}: added_values: {err} (samples counted from the first "
                                  "appended one)") from None
        elif a.name in defaults:
            try:
                given_defaults[a.name] = json_default(a.name, a.field, defaults[a.name])
            except AddFieldsError as err:
                raise AppendError(f"cannot append to {dst}: added_defaults: {err}") from None
        else:
            given_defaults[a.name] = a.default
    return AddedValues(fields, columns, given_defaults, base.manifest["checksum"])


def check_added_count(dst: str, added: AddedValues, planned: int | None) -> None:
    """Refuse, before anything is written, values for more samples than the append has inputs
    (inputs the writer rejects make fewer samples: checked again when the shards are written)."""
    for name, column in added.columns.items():
        got = len(column)
        if planned is not None and got > planned:
            raise AppendError(f"cannot append to {dst}: added_values[{name!r}] has {got} values, the append has "
                              f"{planned} samples: give one value a new sample, in the order they are appended")


def write_added_field_files(dst: str, added: AddedValues, results: list, rejected: int) -> dict[str, list[dict]]:
    """The field files of the appended shards: for each new shard, one file for every generation
    of the store's added fields (the invariant of FORMAT.md section 10), holding the given values
    or the defaults, written into ``dst`` (each to a temporary name, fsynced, renamed) before the
    manifest that lists them. A kill before the manifest leaves files no manifest lists: the
    append's resume writes them again, a new append or ``fastdata gc`` removes them.

    Args:
        dst: the local store directory (a URL append's local staging: the sink uploads them).
        added: the checked values (:func:`plan_added_values`).
        results: the appended shards' results (``name``, ``count``, ``shard_id``).
        rejected: inputs of this append the writer rejected (named in the error of a count that
            does not match).

    Returns:
        dict: each new shard's name -> its ``field_files`` entries.

    Raises:
        AppendError: given values whose count is not the number of samples appended.
    """
    from fastdata.format.added import build_field_file, field_file_name
    from fastdata.writer.add_fields import AddedColumn, write_field_file

    results = sorted(results, key=lambda r: r.shard_id)
    total = sum(r.count for r in results)
    for name, column in added.columns.items():
        got = len(column)
        if got != total:
            why = f" ({rejected} input(s) were rejected: see the report)" if rejected else ""
            raise AppendError(f"cannot append to {dst}: added_values[{name!r}] has {got} values, the append stores "
                              f"{total} samples{why}: give one value a stored sample, in the order they are appended, "
                              "and run the append again with resume=True (the shards written are kept)")
    generations = sorted({a.generation for a in added.fields})
    out: dict[str, list[dict]] = {}
    first = 0
    for r in results:
        entries = []
        for gen in generations:
            arrays: dict = {}
            used = []
            name = field_file_name(gen, r.name)
            try:
                for a in (a for a in added.fields if a.generation == gen):
                    column = added.columns.get(a.name) or AddedColumn(a.name, a.field, r.count,
                                                                      [added.defaults[a.name][0]] * r.count)
                    used.append(column)
                    parts = column.shard_arrays(first if a.name in added.columns else 0, r.count)
                    arrays.update({a.key + k[len(a.name):]: v for k, v in parts.items()})  # (stored under its key)
                size, xxh = write_field_file(os.path.join(dst, name), build_field_file(r.count, arrays))
            finally:
                arrays.clear()
                for column in used:
                    column.release()
            entries.append({"name": name, "generation": gen, "bytes": size, "xxh": xxh})
        out[r.name] = entries
        first += r.count
    from fastdata.common import portable

    portable.fsync_dir(dst)  # (the files' names are durable before the manifest names them)
    return out


def check_source(dst: str, base: PublishedBase, source: WriteSource, add_classes: bool) -> None:
    """After ``source.plan``: refuse a different kind of store or schema, and map the new samples'
    class names onto the store's class indices (:meth:`WriteSource.adopt_classes`)."""
    m = base.manifest
    general = not is_classification(m)
    if general != (source.schema is not None):
        kinds = ("a general store (fields " + ", ".join(f["name"] for f in m.get("schema", [])) + ")"
                 if general else "a classification store (image + label)")
        new = "general samples" if source.schema is not None else "an image folder or list (image + label)"
        raise AppendError(f"cannot append {new} to {dst}: it is {kinds}")
    if general:
        assert source.schema is not None
        differences = schema_differences(m["schema"], source.schema.to_json())
        if differences:
            raise AppendError(f"cannot append to {dst}: the schema differs: " + "; ".join(differences))
        ours = (source.manifest_extra() or {}).get(CLASS_TABLES_KEY, {})
        theirs = m.get(CLASS_TABLES_KEY, {})
        if ours != theirs:
            fields = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
            raise AppendError(f"cannot append to {dst}: the class table of field(s) {', '.join(fields)} differs "
                              f"from the store's (store: {_short(theirs)}; new: {_short(ours)}); a general store's "
                              "classes are appended only with the same table")
        return
    source.adopt_classes(list(m["classes"]), add_classes)


def _short(tables: dict) -> str:
    text = json.dumps(tables, ensure_ascii=False)
    return text if len(text) <= 200 else text[:197] + "..."


def schema_differences(stored: list, new: list) -> list[str]:
    """What differs between two schemas (``Schema.to_json`` lists), field by field."""
    a = {f["name"]: f for f in stored}
    b = {f["name"]: f for f in new}
    out = [f"field {n!r} is missing from the new samples" for n in a if n not in b]
    out += [f"field {n!r} is not in the store" for n in b if n not in a]
    out += [f"field {n!r}: the store has {json.dumps(a[n], sort_keys=True)}, the new samples "
            f"{json.dumps(b[n], sort_keys=True)}" for n in a if n in b and a[n] != b[n]]
    if not out and [f["name"] for f in stored] != [f["name"] for f in new]:
        out.append("the fields are in another order")
    return out


def fingerprint(source_fingerprint: str, base: PublishedBase) -> str:
    """An append's fingerprint: its input's, tied to the store version it appends to (a resume
    of the append into a store that changed since is refused)."""
    return xxhash.xxh3_128_hexdigest(f"append:{source_fingerprint}:{base.manifest['checksum']}".encode())


def already_appended(base: PublishedBase, source_fingerprint: str) -> bool:
    """Whether the store's latest append is this input's (a resume finding the append published)."""
    appends = base.manifest["options"].get("appends") or []
    return bool(appends) and isinstance(appends[-1], dict) and appends[-1].get("input_fingerprint") == \
        source_fingerprint


def next_shard(base: PublishedBase) -> int:
    """The number of the first new shard: one past the store's highest."""
    numbers = [n for s in base.manifest["shards"] if (n := shard_number(s["name"])) is not None]
    return max(numbers, default=-1) + 1


def discard_unpublished(dst: str, base: PublishedBase) -> None:
    """Remove what an interrupted append left (its staging folder, the shard files the
    manifest does not list and the field files of those shards), before a new append (not a
    resume) starts. A shard file of an earlier version still open in another process (Windows)
    stays, for a later write to delete: an overwrite numbered the store's shards past it, so no
    new shard needs its name. Field files of listed shards are left alone (a reader of an older
    version may read them; ``add_fields`` and ``gc`` remove those)."""
    remove_staging(dst)
    listed = {s["name"] for s in base.manifest["shards"]}
    remove_unlisted_shards(dst, listed)
    for name in os.listdir(dst):
        shard = field_file_shard(name)
        if shard is not None and shard not in listed:
            remove_file(os.path.join(dst, name))


def manifest_parts(base: PublishedBase, source: WriteSource, input_fingerprint: str, added: int,
                   shards: int) -> tuple[dict, dict]:
    """``(options, extra)`` of the appended store's manifest: the store's options with this append
    added to ``appends``, and the store's other top-level keys as they were."""
    m = base.manifest
    entry = {"source": source.recorded_source, "samples": added, "shards": shards,
             "input_fingerprint": input_fingerprint}
    options = {k: v for k, v in m["options"].items() if k != "fastdata_version"}
    options["appends"] = list(options.get("appends") or []) + [entry]
    extra = {k: v for k, v in m.items() if k not in _REBUILT_KEYS}
    return options, extra

