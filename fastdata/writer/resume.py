"""What ``resume=True`` knows about the interrupted run.

A conversion records, in its staging folder, the options that decide the
store's content (backend, storage mode, shard size, strict) and the source
listing it planned from (relative paths, sizes, labels, classes). ``resume=True``
then reuses the recorded options for every option not given again, and when
the source or a given option differs it can say exactly what differs
("shard size: was 4 MiB, now 1 GiB", "3 files added under n0144/") instead of
only refusing.

Files (inside ``DST/.fastdata-staging/``):

* ``plan.json``: the plan fingerprint the pipeline checks, plus
  ``"source"`` (absolute path), ``"options"`` and ``"classes"``;
* ``listing.npz``: ``relpaths`` (NUL-joined bytes), ``sizes``, ``labels``.
"""

from __future__ import annotations

import io
import json
import os
from collections import Counter
from dataclasses import dataclass

import numpy as np

from fastdata.common.fileio import atomic_write
from fastdata.common.units import Size, exact_size, exact_unit
from fastdata.errors import FastdataError
from fastdata.format.backends.base import StorageSpec
from fastdata.format.manifest import read_manifest
from fastdata.format.names import LISTING_FILE, MANIFEST_NAME, PLAN_FILE, STAGING_DIR
from fastdata.writer.pipeline import io_error
from fastdata.writer.plan import Listing

#: at most this many folders are named in a "files added under ..." line
MAX_FOLDERS_NAMED = 3


@dataclass(frozen=True)
class RunOptions:
    """The resolved options that decide a store's content."""

    backend: str
    storage: StorageSpec
    shard_size: Size
    strict: bool

    def to_json(self) -> dict:
        return {"backend": self.backend, "storage": self.storage.to_json(), "shard_size": self.shard_size.bytes,
                "shard_size_unit": self.shard_size.unit, "strict": self.strict}

    @classmethod
    def from_json(cls, obj: dict) -> RunOptions:
        unit = obj.get("shard_size_unit")
        size = int(obj["shard_size"])
        return cls(backend=str(obj["backend"]), storage=StorageSpec.from_json(obj["storage"]),
                   shard_size=Size(size, unit if isinstance(unit, str) else exact_unit(size)),
                   strict=bool(obj.get("strict", False)))

    def describe(self) -> str:
        """``shard size 4 MiB (4,194,304 bytes), storage original, lmdb`` (for messages)."""
        return (f"{self.backend}, shard size {self.shard_size}, storage {describe_storage(self.storage)}"
                + (", strict=True" if self.strict else ""))


@dataclass
class RecordedRun:
    """What an earlier run recorded: its options, source path and (if kept) its source listing."""

    options: RunOptions
    source: str | None
    fingerprint: str | None
    complete: bool  # a published store (manifest), not an interrupted run
    listing: tuple[list[bytes], np.ndarray, np.ndarray, list[str]] | None = None


def describe_storage(storage: StorageSpec) -> str:
    """``original``, ``re-encode above 512 px at quality 90`` or ``raw 32x32``."""
    if storage.mode.holds_fixed_size_pixels and storage.raw_shape:
        return f"raw {storage.raw_shape[0]}x{storage.raw_shape[1]}"
    if storage.mode.reencodes_large_images:
        return f"re-encode above {storage.max_side} px at quality {storage.quality}"
    if storage.mode.holds_only_native_size_pixels:
        budget = f", raw budget {exact_size(storage.raw_budget)}" if storage.raw_budget is not None else ""
        return f"raw pixels up to {storage.max_side} px{budget}"
    if storage.mode.picks_images_to_hold_as_pixels and storage.raw_budget is not None:
        return (f"mixed: images kept as pixels as far as the raw budget {exact_size(storage.raw_budget)} holds, "
                f"pixels up to {storage.max_side} px")
    if storage.mode.picks_images_to_hold_as_pixels:
        return f"mixed: raw fraction {storage.raw_fraction:g}, pixels up to {storage.max_side} px"
    if storage.mode.transcodes_losslessly:
        return "lossless (zstd TIFF)"
    return storage.mode.value


def _staging(dst: str, name: str) -> str:
    return os.path.join(dst, STAGING_DIR, name)


def source_text(src: str) -> str:
    """How a run's source is recorded: a URL as given, a path made absolute."""
    return src if "://" in src else os.path.abspath(src)


def record_run(dst: str, options: RunOptions, src: str, fingerprint: str, scan: Listing) -> None:
    """Write the options into ``plan.json`` and the listing into ``listing.npz`` in ``dst``'s
    staging folder (each atomically; the listing first, so a record never lacks it).

    Raises:
        ConversionError: an I/O error, naming the file and the free space (as every staging write).
    """
    buf = io.BytesIO()
    np.savez(buf, relpaths=np.frombuffer(b"\0".join(scan.relpaths), dtype=np.uint8),
             sizes=np.asarray(scan.sizes, dtype=np.int64), labels=np.asarray(scan.labels, dtype=np.int64))
    run = {"source": source_text(src), "fingerprint": fingerprint, "options": options.to_json(),
           "classes": list(scan.classes)}
    for name, data in ((LISTING_FILE, buf.getvalue()), (PLAN_FILE, json.dumps(run).encode())):
        try:
            atomic_write(_staging(dst, name), data)
        except OSError as err:
            raise io_error(err, _staging(dst, name)) from err


def read_recorded_run(dst: str) -> RecordedRun | None:
    """The run recorded at ``dst``: a published store's manifest, else the staging
    record of an interrupted run; None when neither exists or can be read."""
    if os.path.exists(os.path.join(dst, MANIFEST_NAME)):
        return _from_manifest(dst)
    try:
        with open(_staging(dst, PLAN_FILE), "rb") as fh:
            run = json.load(fh)
        return RecordedRun(options=RunOptions.from_json(run["options"]), source=run.get("source"),
                           fingerprint=run.get("fingerprint"), complete=False,
                           listing=_read_listing(dst, run.get("classes")))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no record (a run from an older fastdata, or killed before writing it)


def recorded_source(dst: str) -> str | None:
    """The source path an unfinished conversion at ``dst`` was started from, if recorded."""
    try:
        with open(_staging(dst, PLAN_FILE), "rb") as fh:
            source = json.load(fh).get("source")
        return source if isinstance(source, str) else None
    except (OSError, ValueError, AttributeError):
        return None


def _from_manifest(dst: str) -> RecordedRun | None:
    try:
        m = read_manifest(dst)
        opts = m["options"]
        options = RunOptions.from_json({"backend": m["backend"], "storage": m["storage"],
                                        "shard_size": opts["shard_size"], "strict": opts.get("strict", False),
                                        "shard_size_unit": opts.get("shard_size_unit")})
    except (FastdataError, KeyError, TypeError, ValueError):
        return None
    return RecordedRun(options=options, source=opts.get("source"), fingerprint=opts.get("fingerprint"),
                       complete=True)


def _read_listing(dst: str, classes) -> tuple | None:
    try:
        with np.load(_staging(dst, LISTING_FILE)) as z:
            joined = z["relpaths"].tobytes()
            relpaths = joined.split(b"\0") if joined else []
            return relpaths, z["sizes"], z["labels"], list(classes or [])
    except (OSError, ValueError, KeyError):
        return None


def option_differences(recorded: RunOptions, now: RunOptions) -> list[str]:
    """One ``name: was X, now Y`` phrase per content option that differs."""
    diffs = []
    if recorded.backend != now.backend:
        diffs.append(f"format: was {recorded.backend}, now {now.backend}")
    if recorded.shard_size.bytes != now.shard_size.bytes:
        diffs.append(f"shard size: was {recorded.shard_size}, now {now.shard_size}")
    if recorded.storage != now.storage:
        diffs.append(f"storage: was {describe_storage(recorded.storage)}, now {describe_storage(now.storage)}")
    if recorded.strict != now.strict:
        diffs.append(f"strict: was {'on' if recorded.strict else 'off'}, now {'on' if now.strict else 'off'}")
    return diffs


def _files(n: int) -> str:
    return f"{n} file{'s' if n != 1 else ''}"


def _under(paths: list[bytes]) -> str:
    """`` under a/, b/`` naming the top folders of ``paths`` (most files first)."""
    folders = Counter(os.fsdecode(p).split("/", 1)[0] + "/" if b"/" in p else "./" for p in paths)
    named = [f for f, _ in folders.most_common(MAX_FOLDERS_NAMED)]
    more = len(folders) - len(named)
    return " under " + ", ".join(named) + (f" and {more} more folder(s)" if more > 0 else "")


def source_differences(listing: tuple, scan: Listing) -> list[str]:
    """What changed in the source since it was recorded: classes added/removed,
    files added/removed (with the folders), files whose size or label changed."""
    old_paths, old_sizes, old_labels, old_classes = listing
    diffs = []
    if old_classes and list(old_classes) != list(scan.classes):
        added = sorted(set(scan.classes) - set(old_classes))
        removed = sorted(set(old_classes) - set(scan.classes))
        parts = ([f"added {', '.join(added[:5])}"] if added else []) + \
                ([f"removed {', '.join(removed[:5])}"] if removed else [])
        diffs.append("class list changed" + (f" ({'; '.join(parts)})" if parts else " (order or names)"))
    old = {p: i for i, p in enumerate(old_paths)}
    new = {p: i for i, p in enumerate(scan.relpaths)}
    added_paths = [p for p in scan.relpaths if p not in old]
    removed_paths = [p for p in old_paths if p not in new]
    if added_paths:
        diffs.append(f"{_files(len(added_paths))} added{_under(added_paths)}")
    if removed_paths:
        diffs.append(f"{_files(len(removed_paths))} removed{_under(removed_paths)}")
    common = [(old[p], new[p]) for p in scan.relpaths if p in old]
    resized = [scan.relpaths[j] for i, j in common if int(old_sizes[i]) != int(scan.sizes[j])]
    if resized:
        diffs.append(f"{_files(len(resized))} changed size (e.g. {os.fsdecode(resized[0])})")
    old_names = [old_classes[int(old_labels[i])] if old_classes else int(old_labels[i]) for i, _ in common]
    new_names = [scan.classes[int(scan.labels[j])] if old_classes else int(scan.labels[j]) for _, j in common]
    relabelled = sum(a != b for a, b in zip(old_names, new_names, strict=False))
    if relabelled:
        diffs.append(f"{_files(relabelled)} changed class")
    if not diffs and list(old_paths) != list(scan.relpaths):
        diffs.append("the files are listed in a different order")
    return diffs
