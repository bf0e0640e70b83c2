"""``fastdata merge A B ... -o C`` / :func:`merge`: one store from several, without reading a record.

A shard is self-contained (its records are keyed by their index within the shard, and its index
travels in the store index file), so a merged store is the inputs' shard files under new names
plus a new manifest and store index file:

* **No record is decoded, re-encoded or even read.** Each shard file is hard-linked into the
  output (no extra disk; the files are never modified in place by fastdata: appends add shards,
  ``overwrite=True`` unlinks them), or copied where a link is impossible (another filesystem, or
  ``link=False``). The shards' index entries are carried from each input's store index file.
* **Order.** ``C[i]`` is the concatenation of the inputs in the order given: input 1's samples,
  then input 2's, and so on.
* **Classes.** A classification store's class tables are unified by name. When every input has
  the same table it is kept (and nothing is remapped). Otherwise the merged table is the sorted
  union when every input's table is sorted (ImageFolder's order, so ``ds.classes`` stays what
  ImageFolder would give for the combined folders), else the names in order of first appearance;
  each shard of an input whose table differs gets a ``label_map`` in the manifest (its stored
  label ``k`` means class ``label_map[k]``), applied by the readers when they load the index:
  a few bytes per class in the manifest and one gather per shard when a dataset opens; nothing is
  rewritten. Such a store has layout version 3 (docs/FORMAT.md), which older readers refuse instead
  of misreading its labels. General stores (``fastdata.write``) must have the same class tables.
* **Refused with the differences named**: stores of different backends, storage modes, kinds
  (classification or general) or schemas; a store that is being written (locked) or unfinished.
* **Crash-safe**: the manifest is written last; a merge killed before leaves an unfinished store,
  which the next ``merge`` into it clears and redoes (merging is cheap and idempotent).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastdata.common.fileio import atomic_write, fsync_dir, fsync_file
from fastdata.common.paths import check_local_path
from fastdata.errors import FastdataError
from fastdata.format.manifest import (
    CLASS_TABLES_KEY,
    STORE_FORMAT,
    STORE_VERSION,
    STORE_VERSION_REMAPPED,
    is_classification,
    write_manifest,
)
from fastdata.format.names import MANIFEST_NAME, PLAN_FILE, REJECTED_NAME, STAGING_DIR, STORE_INDEX_NAME, shard_name
from fastdata.format.store_index import MANIFEST_KEY as STORE_INDEX_KEY
from fastdata.format.store_index import build_store_index, manifest_entry
from fastdata.remote.store import is_remote
from fastdata.format.added import FIELD_FILES_KEY, added_fields
from fastdata.writer.add_fields import (
    added_fields_differences,
    carry_added_fields,
    finish_merged_fields,
    merged_field_file,
)
from fastdata.writer.append import open_base, schema_differences
from fastdata.writer.lock import StoreLock, raise_if_locked
from fastdata.writer.pipeline import PublishedBase, clear_store, io_error
from fastdata.writer.session import check_destination, refuse_input_as_destination
from fastdata.writer.resume import describe_storage

#: what a merged store's ``options.source`` says
MERGE_SOURCE = "fastdata.merge"


class MergeError(FastdataError, ValueError):
    """Stores that cannot be merged (their differences named), or a destination that cannot take them."""


@dataclass
class MergeReport:
    """What :func:`merge` made."""

    dst: str
    inputs: list[str]
    samples: int = 0
    shards: int = 0
    linked: int = 0  # shard files hard-linked
    copied: int = 0  # shard files copied (another filesystem, or link=False)
    bytes: int = 0  # the shards' bytes (what a copy costs; hard links cost none)
    classes: int = 0
    remapped_shards: int = 0  # shards whose labels the readers remap (label_map)
    server_side: int = 0  # of the copies: made by the server (stores at URLs)
    elapsed: float = 0.0
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """A few human-readable lines."""
        how = [f"{self.linked} hard-linked"] * bool(self.linked) + [
            f"{self.copied} copied" + (" by the server" if self.server_side else "")] * bool(self.copied)
        lines = [f"merged {len(self.inputs)} stores into {self.dst}: {self.samples} samples, {self.shards} shard(s) "
                 f"({', '.join(how) or 'none'}; {self.bytes:,} bytes of shards), {self.elapsed:.2f} s"]
        if self.remapped_shards:
            lines.append(f"classes unified by name: {self.classes} classes; {self.remapped_shards} shard(s) carry a "
                         "label map (their labels are remapped when a dataset opens; nothing was rewritten)")
        return "\n".join(lines + self.notes)


def merge(inputs: Sequence[str | os.PathLike], dst: str | os.PathLike, *, overwrite: bool = False,
          link: bool = True, storage_options: Mapping[str, Any] | None = None) -> MergeReport:
    """Make one store at ``dst`` from the stores ``inputs`` (same backend, storage and schema), their
    samples concatenated in the order given, without decoding, re-encoding or reading a record.

    Args:
        inputs: two or more published stores: local directories, or URLs of one S3-compatible
            server (``s3://``...) when ``dst`` is a URL there too.
        dst: the new store's directory or URL (must not hold a store, unless ``overwrite``).
        overwrite: replace a store at ``dst``.
        link: local stores: hard-link the shard files where the filesystem allows (no extra disk),
            copying the others; ``False`` copies every file. URLs: every shard is copied by the
            server (``CopyObject``), none passes through this machine.
        storage_options: fsspec options of the URLs (endpoint, credentials...).

    Returns:
        MergeReport: counts, and how the shards were placed.

    Raises:
        MergeError: the inputs differ (backend, storage, kind, schema, a general store's class
            tables: each difference named), fewer than two inputs, ``dst`` among them, a mix of
            local paths and URLs.
        StoreExistsError, StoreLockedError, FastdataError: the destination or an input.
    """
    if len(inputs) < 2:
        raise MergeError(f"merge takes two or more stores, got {len(inputs)}")
    return _merge(inputs, dst, overwrite, link, storage_options, MERGE_SOURCE)


def publish_parts(parts: Sequence[str | os.PathLike], dst: str | os.PathLike, *, source: str,
                  overwrite: bool = False, link: bool = True,
                  storage_options: Mapping[str, Any] | None = None) -> MergeReport:
    """Publish one store at ``dst`` from the part stores that the tasks of an engine wrote (Ray
    Data, Spark, Dask: each task a part, the driver publishes once): :func:`merge` of one or more
    parts, in the order given, the manifest's ``options.source`` set to ``source`` and its
    ``options.merged`` listing each part with its sample count.

    Args:
        parts: one or more published part stores (local directories, or URLs of one server
            when ``dst`` is a URL there too).
        dst: the store's directory or URL (must not hold a store, unless ``overwrite``).
        source: what the manifest records as the writer (e.g. ``"fastdata.integrations.ray"``).
        overwrite, link, storage_options: as for :func:`merge`.

    Returns:
        MergeReport: counts, and how the shards were placed.

    Raises:
        MergeError: no part, or the parts differ (each difference named); FastdataError subclasses
            for the destination, as :func:`merge`.
    """
    if not parts:
        raise MergeError("publish_parts takes one or more part stores, got none")
    return _merge(parts, dst, overwrite, link, storage_options, source)


def _merge(inputs: Sequence[str | os.PathLike], dst: str | os.PathLike, overwrite: bool, link: bool,
           storage_options: Mapping[str, Any] | None, source: str) -> MergeReport:
    started = time.perf_counter()
    given = [os.fspath(p) for p in inputs]
    dst = os.fspath(dst)
    remote = [is_remote(p) for p in [*given, dst]]
    if any(remote):
        if not all(remote):
            raise MergeError("merge local stores into a local store, or stores at URLs into a URL on the same "
                             "server; copy the others first")
        report = _merge_remote(given, dst, overwrite, dict(storage_options or {}), source)
    else:
        report = _merge_local(given, dst, overwrite, link, source)
    report.elapsed = time.perf_counter() - started
    return report


def _merge_local(given: list[str], dst: str, overwrite: bool, link: bool, source: str) -> MergeReport:
    paths = [os.path.abspath(p) for p in given]
    check_local_path(dst, "destination", must_exist=False)
    dst = os.path.abspath(dst)
    if dst in paths:
        raise MergeError(f"{dst} is one of the inputs: merge into a new store")
    refuse_input_as_destination(dst, paths, MergeError)  # (a symlink, a bind mount or a folder inside an input)
    for path in paths:
        raise_if_locked(path)
    bases = [open_base(p) for p in paths]
    _check_same_kind(paths, bases)
    _prepare_destination(dst, overwrite)
    with StoreLock(dst):
        _mark_unfinished(dst)
        report = MergeReport(dst=dst, inputs=paths)

        def place(i: int, shard: dict, name: str) -> bool:
            return _place(os.path.join(paths[i], shard["name"]), os.path.join(dst, name), shard["bytes"], link)

        body, entries = _assemble(paths, bases, report, place, source)
        carry_added_fields(dst, [(p, b.manifest, shard) for p, b in zip(paths, bases, strict=True)
                                 for shard in b.manifest["shards"]], body)
        fsync_dir(dst)
        try:
            _write_metadata(dst, body, entries)
        except OSError as err:
            raise io_error(err, os.path.join(dst, MANIFEST_NAME)) from err
        shutil.rmtree(os.path.join(dst, STAGING_DIR), ignore_errors=True)
    return report


def _merge_remote(given: list[str], dst: str, overwrite: bool, storage_options: dict, source: str) -> MergeReport:
    """The merge of stores at URLs of one server: shards copied server-side, then the index file,
    the rejected list and the manifest (last) uploaded and checked."""
    from fastdata.format.manifest import MAX_MANIFEST_BYTES, parse_manifest
    from fastdata.format.store_index import index_file_name, shard_entries
    from fastdata.remote.location import RemoteLocation
    from fastdata.writer.remote_sink import RemoteLock, check_destination, check_url_path, upload_checked

    locations = [RemoteLocation(p, storage_options) for p in given]
    target = RemoteLocation(dst, storage_options)
    check_url_path(target.url)
    target._writable()
    # by what the URLs name, not their spelling (S3:// or s3a://, //, ./ and ../, a prefix inside an input)
    refuse_input_as_destination(target.url, [loc.url for loc in locations], MergeError)
    bases = []
    for loc in locations:
        RemoteLock(loc).check()
        raw = loc.read_bytes(MANIFEST_NAME, limit=MAX_MANIFEST_BYTES)
        m = parse_manifest(raw, where=loc.child(MANIFEST_NAME))
        if STORE_INDEX_KEY not in m:
            raise MergeError(f"{loc.url} was made by an older fastdata (no store index file): convert it again")
        name = index_file_name(m)
        data = loc.read_bytes(name, limit=m[STORE_INDEX_KEY]["bytes"])
        bases.append(PublishedBase(manifest=m, index_entries=shard_entries(data, m, loc.child(name))))
    urls = [loc.url for loc in locations]
    _check_same_kind(urls, bases)
    lock = RemoteLock(target)
    lock.check()
    check_destination(target, resume=False, overwrite=overwrite, clear=True)
    report = MergeReport(dst=target.url, inputs=urls)
    lock.write()
    try:
        def place(i: int, shard: dict, name: str) -> bool:
            target.copy_from(locations[i], shard["name"], name)
            if target.size(name) != shard["bytes"]:
                raise MergeError(f"{target.child(name)}: the server-side copy of {locations[i].child(shard['name'])} "
                                 f"is not {shard['bytes']:,} bytes")
            return False

        body, entries = _assemble(urls, bases, report, place, source)
        with tempfile.TemporaryDirectory(prefix="fastdata-merge-") as local:
            _carry_remote_added_fields(locations, bases, target, body, local)
            _write_metadata(local, body, entries)
            for name in (REJECTED_NAME, STORE_INDEX_NAME, MANIFEST_NAME):
                upload_checked(target, os.path.join(local, name), name)
    finally:
        lock.release()
    report.server_side = report.copied
    return report


def _carry_remote_added_fields(locations: list, bases: list[PublishedBase], target: Any, body: dict,
                               local: str) -> None:
    """:func:`carry_added_fields` for stores at URLs: for each merged shard, its input's field
    files downloaded (bounded by and checked against their manifest entries), the merged shard's
    field file written locally, uploaded and checked, and the local copies deleted, one shard
    at a time (the local disk holds one shard's field files)."""
    from fastdata.writer.remote_sink import upload_checked

    first = added_fields(bases[0].manifest)
    if not first:
        return
    inputs = os.path.join(local, "inputs")
    os.makedirs(inputs)
    new_shards = iter(body["shards"])
    for loc, base in zip(locations, bases, strict=True):
        for shard in base.manifest["shards"]:
            fetched = []
            for entry in shard.get(FIELD_FILES_KEY, []):
                path = os.path.join(inputs, entry["name"])
                atomic_write(path, loc.read_bytes(entry["name"], limit=entry["bytes"]))
                fetched.append(path)
            name = merged_field_file(local, lambda n: os.path.join(inputs, n), base.manifest, shard, next(new_shards),
                                     first)
            upload_checked(target, os.path.join(local, name), name)
            for path in [*fetched, os.path.join(local, name)]:
                os.remove(path)
    finish_merged_fields(body, first)


def _assemble(inputs: list[str], bases: list[PublishedBase], report: MergeReport,
              place: Callable[[int, dict, str], bool],
              source: str = MERGE_SOURCE) -> tuple[dict, list[tuple[str, bytes]]]:
    """The merged manifest body (without its index entry) and store index entries; ``place(i, shard,
    new name)`` puts input ``i``'s shard in the output (True: hard-linked); ``source``: what
    ``options.source`` records. Fills ``report``."""
    classes, label_maps = _unified_classes(bases)
    report.classes = len(classes)
    shards, entries, k = [], [], 0
    class_counts = [0] * len(classes)
    rejected, warnings = [], []
    for i, (base, label_map) in enumerate(zip(bases, label_maps, strict=True)):
        m = base.manifest
        for shard, (_, index_bytes) in zip(m["shards"], base.index_entries, strict=True):
            name = shard_name(m["backend"], k)
            k += 1
            report.linked += place(i, shard, name)
            entry = {key: shard[key] for key in ("count", "bytes", "xxh", "image_bytes")}
            entry.update(name=name, first_index=report.samples)
            if label_map is not None:
                entry["label_map"] = label_map
                report.remapped_shards += 1
            shards.append(entry)
            entries.append((name, index_bytes))
            report.samples += shard["count"]
            report.bytes += shard["bytes"]
        for c, count in enumerate(m["class_counts"]):
            class_counts[label_map[c] if label_map is not None else c] += count
        rejected += m["rejected"]
        warnings += m.get("warnings", [])
    report.shards = len(shards)
    report.copied = report.shards - report.linked
    first = bases[0].manifest
    body = {key: v for key, v in first.items() if key not in ("checksum", STORE_INDEX_KEY)}
    body.update(
        format=STORE_FORMAT, classes=classes, class_counts=class_counts, num_samples=report.samples, shards=shards,
        rejected=rejected, warnings=warnings,
        version=(STORE_VERSION_REMAPPED if report.remapped_shards else
                 STORE_VERSION if is_classification(first) else first["version"]),
        options={"source": source, "shard_size": first["options"]["shard_size"],
                 "shard_size_unit": first["options"].get("shard_size_unit"),
                 "strict": all(b.manifest["options"].get("strict", False) for b in bases),
                 "merged": [{"store": p, "checksum": b.manifest["checksum"], "samples": b.manifest["num_samples"],
                             "shards": len(b.manifest["shards"])} for p, b in zip(inputs, bases, strict=True)]})
    if not all(b.manifest.get("image_modes") == first.get("image_modes") for b in bases):
        body.pop("image_modes", None)
        report.notes.append("the inputs record different default read modes: none is recorded for the merge")
    return body, entries


def _write_metadata(folder: str, body: dict, entries: list[tuple[str, bytes]]) -> None:
    """The store index file, ``rejected.tsv`` and then the manifest (last) into ``folder``."""
    index_file = build_store_index(entries)
    atomic_write(os.path.join(folder, STORE_INDEX_NAME), index_file)
    body[STORE_INDEX_KEY] = manifest_entry(index_file)
    tsv = "path\treason\n" + "".join(f"{_tsv(r['path'])}\t{_tsv(r['reason'])}\n" for r in body["rejected"])
    atomic_write(os.path.join(folder, REJECTED_NAME), tsv.encode("utf-8", "surrogateescape"))
    write_manifest(folder, body)


def _tsv(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")


def _check_same_kind(paths: list[str], bases: list[PublishedBase]) -> None:
    first, where = bases[0].manifest, paths[0]
    problems = added_fields_differences([(p, b.manifest) for p, b in zip(paths, bases, strict=True)])
    for path, base in zip(paths[1:], bases[1:], strict=True):
        m = base.manifest
        if m["backend"] != first["backend"]:
            problems.append(f"{path} is {m['backend']}, {where} is {first['backend']}")
        if m["storage"] != first["storage"]:
            from fastdata.format.backends.base import StorageSpec

            problems.append(f"{path} keeps {describe_storage(StorageSpec.from_json(m['storage']))}, {where} keeps "
                            f"{describe_storage(StorageSpec.from_json(first['storage']))}")
        if is_classification(m) != is_classification(first):
            problems.append(f"{path} and {where} are not both classification stores (image + label) or both general "
                            "stores")
        elif not is_classification(m):
            problems += [f"{path}: {d}" for d in schema_differences(first["schema"], m["schema"])]
            if m.get(CLASS_TABLES_KEY, {}) != first.get(CLASS_TABLES_KEY, {}):
                problems.append(f"{path}: its class tables differ from {where}'s (a general store's classes are "
                                "merged only with the same tables)")
    if problems:
        raise MergeError("cannot merge: " + "; ".join(problems))


def _unified_classes(bases: list[PublishedBase]) -> tuple[list[str], list[list[int] | None]]:
    """The merged class table and, per input, its label map (None: its labels are kept as they are)."""
    tables = [list(b.manifest["classes"]) for b in bases]
    if all(t == tables[0] for t in tables) or not is_classification(bases[0].manifest):
        return tables[0], [None] * len(bases)
    if all(t == sorted(t) for t in tables):
        union = sorted({c for t in tables for c in t})
    else:
        union = list(dict.fromkeys(c for t in tables for c in t))
    position = {c: i for i, c in enumerate(union)}
    maps = []
    for table in tables:
        mapped = [position[c] for c in table]
        maps.append(None if mapped == list(range(len(table))) else mapped)
    return union, maps


def _prepare_destination(dst: str, overwrite: bool) -> None:
    """Refuse a destination as a conversion does (a file, foreign files, a store without ``overwrite``,
    an unfinished conversion), except an unfinished merge, which is cleared and redone."""
    if not os.path.exists(dst):
        os.makedirs(dst)
        return
    check_destination(dst, resume=_unfinished_merge(dst), overwrite=overwrite)
    clear_store(dst)


def _unfinished_merge(dst: str) -> bool:
    try:
        with open(os.path.join(dst, STAGING_DIR, PLAN_FILE), "rb") as fh:
            return json.load(fh).get("source") == MERGE_SOURCE
    except (OSError, ValueError, AttributeError):
        return False


def _mark_unfinished(dst: str) -> None:
    """Say, until the manifest is written, that ``dst`` is a merge in progress (the next merge
    into it clears it; ``verify`` calls it unfinished)."""
    from fastdata.writer.owned import ensure_dir

    ensure_dir(os.path.join(dst, STAGING_DIR))
    atomic_write(os.path.join(dst, STAGING_DIR, PLAN_FILE), json.dumps({"source": MERGE_SOURCE}).encode())


def _place(src: str, dst: str, size: int, link: bool) -> bool:
    """Hard-link (``link``) or copy shard file ``src`` to ``dst``; True when linked. A file that is
    not ``size`` bytes (the input's manifest) is refused: the input is damaged or being changed."""
    st = os.lstat(src)
    if st.st_size != size or not os.path.isfile(src) or os.path.islink(src):
        raise MergeError(f"{src}: not the regular file of {size:,} bytes its manifest lists; run fastdata verify "
                         "on that store")
    if link:
        try:
            os.link(src, dst, follow_symlinks=False)
            return True
        except OSError as err:
            if err.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
                raise io_error(err, dst) from err
    try:
        shutil.copyfile(src, dst, follow_symlinks=False)
        fsync_file(dst)
    except OSError as err:
        raise io_error(err, dst) from err
    return False
