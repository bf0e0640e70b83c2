"""An ImageFolder tree or a CSV/TSV ``path,label`` list file as a write source.

The scan (:func:`scan`) is pure functions; :class:`FolderInput` is the input for the
write session (classification stores, layout version 1, split across torchrun's ranks),
:class:`FolderSource` the pipeline's feed of its chunks.

For a folder the classes, class indices and sample order are the
ones ``torchvision.datasets.ImageFolder(root, allow_empty=True)`` produces:
classes are the sorted names of the root's subdirectories (hidden ones included,
as ImageFolder does, but reported so the caller can warn), files are found with
``os.walk(followlinks=True)`` in sorted order, and the extension test is a
case-insensitive suffix match over :data:`IMG_EXTENSIONS`.

Like ImageFolder, a tree with no image file at all is an error (:class:`SourceError`
naming the folder and the extensions searched), while a class folder without
images is kept as a class with no samples (``allow_empty=True``) and reported in
``walk_problems`` so the caller can warn, as are class folders named like dataset
splits (``train``, ``val``...: the user almost certainly meant ``root/train``).

One deliberate difference: a directory symlink that points back to a directory
already being walked (a symlink loop) would make ``os.walk`` recurse until the
path is too long. We walk each real directory once per class and report the loop.

Paths are kept as ``bytes`` (``os.fsencode``) so non-UTF-8 file names survive.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fastdata.common.extensions import EXTENSION_FORMATS, IMG_EXTENSIONS, has_image_extension
from fastdata.common.imagemodes import check_mode
from fastdata.common.paths import remote_scheme
from fastdata.errors import ResumeMismatchError, SourceError
from fastdata.format.backends.base import StorageSpec
from fastdata.format.manifest import IMAGE_MODES_KEY
from fastdata.format.record import ShardIndex
from fastdata.format.store_index import decode_shard_index
from fastdata.writer.ingest import ingest_chunk, starts_like_jpeg
from fastdata.writer.census import census_notes, image_census
from fastdata.writer.options import check_shard_count
from fastdata.writer.pipeline import Chunk, ChunkSource, ShardResult, shard_index_bytes
from fastdata.writer.plan import ShardPlan, estimated_sizes, plan_fingerprint, plan_shards
from fastdata.writer.raw_budget import plan_raw
from fastdata.writer.resume import (
    option_differences,
    record_run,
    RecordedRun,
    RunOptions,
    source_differences,
    source_text,
)
from fastdata.writer.sources.base import WriteSource

#: class folder names that are really dataset splits (compared lower-case)
SPLIT_NAMES = frozenset({"train", "training", "val", "valid", "validation", "test", "testing"})
#: at most this many bad list rows are quoted in one error
MAX_ROW_ERRORS = 20
#: integer labels are class indices; a larger one is refused (it would make millions of classes)
MAX_INTEGER_LABEL = 1_000_000


@dataclass
class SourceScan:
    """The result of a scan.

    ``paths`` are absolute file paths (bytes), ``relpaths`` the same relative to
    ``root`` (bytes), ``labels`` class indices (int64), ``sizes`` file sizes at
    scan time (int64, -1 when stat failed; the reader will reject such files).
    """

    root: str
    classes: list[str]
    paths: list[bytes]
    relpaths: list[bytes]
    labels: np.ndarray
    sizes: np.ndarray
    hidden_classes: list[str] = field(default_factory=list)
    #: True when the scan came from a CSV/TSV list file (``root`` is its folder)
    is_list: bool = False
    #: (path, problem) pairs the caller reports as warnings: unreadable directories,
    #: symlink loops, empty class folders, class folders named like splits
    walk_problems: list[tuple[str, str]] = field(default_factory=list)
    #: with ``raw_budget``, set by the plan (:func:`fastdata.writer.raw_budget.plan_raw`): whether
    #: each input is stored as pixels, and the bytes it will take in the store
    raw: np.ndarray | None = None
    stored_sizes: np.ndarray | None = None
    #: a remote source's: each object's ETag as listed (:func:`fastdata.remote.location.etag_key`),
    #: fingerprinted beside the sizes (a local file's content is known by its size alone, as before)
    etags: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.classes)}


def find_classes(root: str) -> list[str]:
    """Sorted names of the subdirectories of ``root`` (symlinks to dirs count)."""
    try:
        with os.scandir(root) as it:
            return sorted(entry.name for entry in it if entry.is_dir())
    except FileNotFoundError:
        raise SourceError(f"source folder not found: {root}") from None
    except NotADirectoryError:
        raise SourceError(f"source is not a folder or a .csv/.tsv list: {root}") from None
    except PermissionError:
        raise SourceError(f"cannot list source folder (permission denied): {root}") from None


def _walk_class_dir(class_dir: str, problems: list[tuple[str, str]]) -> list[str]:
    """Files under ``class_dir`` in ImageFolder's order, each real directory once."""
    found: list[str] = []
    seen_dirs: set[tuple[int, int]] = set()

    def onerror(err: OSError) -> None:
        problems.append((str(err.filename), f"cannot list directory: {err.strerror}"))

    # Sorting os.walk's whole output (as ImageFolder does) needs the walk to end;
    # a symlink loop would never end, so prune revisited directories while walking.
    entries = []
    for root, dirs, files in os.walk(class_dir, followlinks=True, onerror=onerror):
        try:
            st = os.stat(root)
            key = (st.st_dev, st.st_ino)
        except OSError as err:
            problems.append((root, f"cannot stat directory: {err.strerror}"))
            dirs[:] = []
            continue
        if key in seen_dirs:
            problems.append((root, "directory symlink loop: already walked, skipped"))
            dirs[:] = []
            continue
        seen_dirs.add(key)
        entries.append((root, dirs[:], files))
    for root, _dirs, files in sorted(entries):
        for name in sorted(files):
            found.append(os.path.join(root, name))
    return found


def scan_folder(root: str) -> SourceScan:
    """Scan an ImageFolder-layout tree. See the module docstring for the rules.

    Raises:
        SourceError: ``root`` is missing or unreadable, or its class folders hold
            no image file at all.
    """
    root = os.path.abspath(root)
    classes = find_classes(root)
    paths: list[bytes] = []
    relpaths: list[bytes] = []
    labels: list[int] = []
    problems: list[tuple[str, str]] = []
    empty: list[str] = []
    prefix = os.path.join(root, "")  # every walked path starts with it (os.path.relpath is 20 us a file)
    for idx, cls in enumerate(classes):
        found = 0
        for path in _walk_class_dir(os.path.join(root, cls), problems):
            if has_image_extension(path):
                paths.append(os.fsencode(path))
                relpaths.append(os.fsencode(path[len(prefix):]))
                labels.append(idx)
                found += 1
        if not found:
            empty.append(cls)
    if classes and not paths:
        raise SourceError(
            f"{root}: no image files found in its {len(classes)} class folder(s) "
            f"(searched for {_extensions_text()}, any case); ImageFolder refuses such a tree too")
    problems.extend(_class_warnings(root, classes, empty))
    hidden = [c for c in classes if c.startswith(".")]
    return SourceScan(
        root=root,
        classes=classes,
        paths=paths,
        relpaths=relpaths,
        labels=np.asarray(labels, dtype=np.int64),
        sizes=_stat_sizes(paths),
        hidden_classes=hidden,
        walk_problems=problems,
    )


def _extensions_text() -> str:
    return " ".join(IMG_EXTENSIONS)


def _class_warnings(root: str, classes: list[str], empty: list[str]) -> list[tuple[str, str]]:
    """Warnings about the class folders themselves: empty ones, and split-like names."""
    out = []
    if empty:
        names = ", ".join(empty[:20]) + (" ..." if len(empty) > 20 else "")
        warning = (f"{len(empty)} class folder(s) hold no image file ({_extensions_text()}): {names}; "
                   "kept as classes with 0 samples, as ImageFolder(allow_empty=True) does")
        out.append((root, warning))
    splits = [c for c in classes if c.lower() in SPLIT_NAMES]
    # one such name among real classes can be a genuine class; all of them, or two, are splits
    if splits and (len(splits) >= 2 or len(splits) == len(classes)):
        hint = (f"class folder(s) named like dataset splits ({', '.join(splits)}): the classes should be the "
                f"folders inside one split; did you mean {os.path.join(root, splits[0])}?")
        out.append((root, hint))
    return out


def check_destination_outside(scan: SourceScan, dst: str) -> None:
    """Refuse a destination inside a source folder: the next scan of that folder
    would take the store for a class (its shard files are not images, so the class
    would be empty or the files rejected).

    Compared after resolving symlinks (``os.path.realpath``). For a list file the
    root is the list's folder, whose files are never scanned, so any destination
    is fine.

    Raises:
        SourceError: ``dst`` is ``scan.root`` or lies inside it (folder sources).
    """
    if scan.is_list:
        return
    root, target = os.path.realpath(scan.root), os.path.realpath(dst)
    if target == root or target.startswith(os.path.join(root, "")):
        raise SourceError(
            f"the destination {dst} is inside the source folder {scan.root}: the store would become a class of "
            "the next conversion of that folder; choose a destination outside it")


def is_url(path: str) -> bool:
    """Whether a list row's ``path`` is a URL (``s3://b/x.jpg``): read remotely, never joined to a
    local list's folder."""
    return remote_scheme(path) is not None


def refuse_mixed_rows(list_file: str, paths: Iterable[str], lines: Iterable[int]) -> None:
    """Refuse a local list whose rows do not all name URLs, or all local paths: one line naming
    the first row that differs from the first row, and what to do.

    Raises:
        SourceError: a row names a URL and another a local path.
    """
    first: tuple[int, str, bool] | None = None
    for path, line in zip(paths, lines, strict=True):
        url = is_url(path)
        if first is None:
            first = (line, path, url)
        elif url != first[2]:
            raise SourceError(mixed_rows_message(list_file, line, path, first[0], first[1]))


def mixed_rows_message(list_file: str, line: int, path: str, first_line: int, first_path: str) -> str:
    """The one-line refusal of a list naming both URLs and local paths (see :func:`refuse_mixed_rows`)."""
    kind, first_kind = ("a URL", "a local path") if is_url(path) else ("a local path", "a URL")
    return (f"{list_file}:{line}: the row names {kind} ({path}) while line {first_line} names {first_kind} "
            f"({first_path}): a list's rows name URLs or local paths, not both; write the URL rows and the local rows "
            "into two lists and convert the second into the same store with append=True, or copy the files to one "
            "place")


def scan_list(list_file: str) -> SourceScan:
    """Scan a CSV (``path,label``) or TSV (``path<TAB>label``) list file.

    Relative paths are taken relative to the list file's folder. A first row
    ``path,label`` is treated as a header. Order is the file's.

    Labels: when every label is a non-negative integer (``0``, ``7``, ``10``), the
    label *is* the target, and the classes are ``'0'`` .. ``str(max label)`` (so
    ``10`` is target 10, not the third class in string order). Otherwise labels are
    class names, and the classes are their sorted unique values (as ImageFolder
    sorts folder names).

    Raises:
        SourceError: the file is missing, lists nothing, has bad rows (all of
            them are listed, up to :data:`MAX_ROW_ERRORS`, with line numbers), or names
            local paths and URLs (:func:`refuse_mixed_rows`; a list of URLs is read by
            :func:`fastdata.writer.sources.remote.scan_remote_list`).
    """
    list_file = os.path.abspath(list_file)
    base = os.path.dirname(list_file)
    rows = _read_rows(list_file)
    if not rows:
        raise SourceError(f"{list_file}: the list names no image files (expected rows of path,label)")
    refuse_mixed_rows(list_file, (p for p, _, _ in rows), (n for _, _, n in rows))
    classes, labels = list_labels(list_file, rows)
    paths = [os.fsencode(p if os.path.isabs(p) else os.path.join(base, p)) for p, _, _ in rows]
    relpaths = [os.fsencode(os.path.normpath(p)) for p, _, _ in rows]
    return SourceScan(
        root=base,
        classes=classes,
        paths=paths,
        relpaths=relpaths,
        labels=labels,
        sizes=_stat_sizes(paths),
        is_list=True,
    )


def _read_rows(list_file: str) -> list[tuple[str, str, int]]:
    """``(path, label, line number)`` of every data row; every malformed row is
    collected and reported in one :class:`SourceError`."""
    try:
        # utf-8-sig: spreadsheet exports often start with a BOM, which would hide the header row
        with open(list_file, newline="", encoding="utf-8-sig", errors="surrogateescape") as fh:
            return parse_rows(list_file, fh)
    except FileNotFoundError:
        raise SourceError(f"list file not found: {list_file}") from None


def parse_rows(list_file: str, lines: Iterable[str]) -> list[tuple[str, str, int]]:
    """``(path, label, line number)`` of every data row of the list named ``list_file`` (a path or
    a URL; ``.tsv``: tab-separated) whose text is ``lines``; every malformed row is collected and
    reported in one :class:`SourceError`."""
    delimiter = "\t" if list_file.lower().endswith(".tsv") else ","
    rows: list[tuple[str, str, int]] = []
    bad: list[tuple[int, str]] = []  # (line number, problem)
    reader = csv.reader(lines, delimiter=delimiter)
    try:
        for row in reader:
            _check_row(row, reader.line_num, delimiter, rows, bad)
    except csv.Error as err:  # e.g. a NUL byte: csv cannot read past it
        bad.append((reader.line_num, f"{err}; the rest of the file was not read"))
    if len(bad) == 1:
        raise SourceError(f"{list_file}:{bad[0][0]}: {bad[0][1]}")
    if bad:
        # one line (the CLI prints errors as one line), every bad row up to the limit
        shown = "; ".join(f"line {n}: {why}" for n, why in bad[:MAX_ROW_ERRORS])
        more = f"; ... and {len(bad) - MAX_ROW_ERRORS} more" if len(bad) > MAX_ROW_ERRORS else ""
        raise SourceError(f"{list_file}: {len(bad)} bad rows (fix them all, then convert again): {shown}{more}")
    return rows


def _check_row(row: list[str], lineno: int, delimiter: str, rows: list, bad: list[tuple[int, str]]) -> None:
    """Append a good row to ``rows`` or ``(lineno, problem)`` to ``bad``; skip blank
    lines and a ``path,label`` header on line 1."""
    if not row or (len(row) == 1 and not row[0].strip()):
        return
    if len(row) != 2:
        bad.append((lineno, f"expected 2 columns (path{delimiter}label), got {len(row)}"))
        return
    path, label = row[0].strip(), row[1].strip()
    if lineno == 1 and (path.lower(), label.lower()) == ("path", "label"):
        return
    if not path or not label:
        bad.append((lineno, "empty path or label"))
        return
    rows.append((path, label, lineno))


def list_labels(list_file: str, rows: list[tuple[str, str, int]]) -> tuple[list[str], np.ndarray]:
    """Classes and per-row targets from the label column (rule: see :func:`scan_list`)."""
    if all(label.isascii() and label.isdigit() for _, label, _ in rows):
        targets = [int(label) for _, label, _ in rows]
        top = max(targets)
        if top >= MAX_INTEGER_LABEL:
            lineno = next(n for (_, _, n), t in zip(rows, targets, strict=False) if t == top)
            raise SourceError(
                f"{list_file}:{lineno}: integer label {top} is taken as a class index and would make {top + 1} "
                f"classes (limit {MAX_INTEGER_LABEL}); renumber the labels from 0, or use class names")
        return [str(i) for i in range(top + 1)], np.asarray(targets, dtype=np.int64)
    classes = sorted({label for _, label, _ in rows})
    class_to_idx = {c: i for i, c in enumerate(classes)}
    return classes, np.asarray([class_to_idx[label] for _, label, _ in rows], dtype=np.int64)


def scan(src: str | os.PathLike) -> SourceScan:
    """Scan ``src``: a ``.csv``/``.tsv`` list file or an ImageFolder tree."""
    src = os.fspath(src)
    if src.lower().endswith((".csv", ".tsv")) and not os.path.isdir(src):
        return scan_list(src)
    return scan_folder(src)


def _stat_sizes(paths: list[bytes]) -> np.ndarray:
    sizes = np.empty(len(paths), dtype=np.int64)
    for i, p in enumerate(paths):
        try:
            sizes[i] = os.stat(p).st_size
        except OSError:
            sizes[i] = -1
    return sizes


# --------------------------------------------------------------------------- the write source


class FolderSource(ChunkSource):
    """The inputs of a source scan (ImageFolder tree or list file), read and validated
    by :func:`fastdata.writer.ingest.ingest_chunk`."""

    worker = staticmethod(ingest_chunk)

    def __init__(self, scan: SourceScan, storage: StorageSpec, chunk_size: int):
        self.scan, self.storage, self.chunk_size = scan, storage, chunk_size

    def chunks(self, plans: list[ShardPlan] | None) -> Iterator[Chunk]:
        scan = self.scan
        for plan in plans or []:
            if plan.start == plan.stop:  # (an empty plan cannot come from a scan, but be safe)
                yield Chunk(plan, plan.start, plan.stop, True, ([], [], [], self.storage, None))
            for a in range(plan.start, plan.stop, self.chunk_size):
                b = min(a + self.chunk_size, plan.stop)
                raw = scan.raw[a:b].tolist() if scan.raw is not None else None
                yield Chunk(plan, a, b, b == plan.stop,
                            (scan.paths[a:b], scan.relpaths[a:b], scan.labels[a:b].tolist(), self.storage, raw))

    def describe(self, start: int, stop: int) -> str:
        return f"{os.fsdecode(self.scan.paths[start])} .. {os.fsdecode(self.scan.paths[stop - 1])}"

    def input_name(self, i: int) -> str:
        return os.fsdecode(self.scan.relpaths[i])

    def input_path(self, i: int) -> str:
        return os.fsdecode(self.scan.paths[i])

    def runs_in_main_first(self, chunk: Chunk) -> bool:
        # JPEG chunks only: a decoder crash here would take the converter down instead of a
        # worker, and libjpeg-turbo is the most hardened of the decoders. The content picks the
        # decoder, so the names are not enough: the first bytes must be a JPEG's too.
        return all(EXTENSION_FORMATS.get(os.path.splitext(os.fsdecode(p))[1].lower()) == "JPEG"
                   and starts_like_jpeg(p) for p in self.scan.paths[chunk.start:chunk.stop])


def check_resume(dst: str, src: str, recorded: RecordedRun | None, run: RunOptions, fingerprint: str,
                 scan: SourceScan) -> None:
    """Refuse a resume whose options or source differ from the recorded run, naming each difference.

    Without a record (a run from an older fastdata) the staging fingerprint check decides.

    Raises:
        ResumeMismatchError: listing every differing option (was/now) and the source changes.
    """
    if recorded is None or recorded.fingerprint == fingerprint:
        return
    diffs = option_differences(recorded.options, run)
    if recorded.listing is not None:
        changes = source_differences(recorded.listing, scan)
    else:  # a published store keeps no listing: tell whether the source (not only the options) changed
        same = plan_fingerprint(scan, recorded.options.backend, recorded.options.storage,
                                recorded.options.shard_size.bytes) == recorded.fingerprint
        changes = [] if same else ["the source files differ (files added, removed or changed)"]
    if changes and recorded.source and source_text(src) != recorded.source:
        changes.append(f"source: was {recorded.source}, now {source_text(src)}")
    what = "; ".join(diffs + changes) or "the inputs differ"
    if recorded.complete:
        raise ResumeMismatchError(f"{dst} is a complete store made from different inputs or options ({what}); "
                                  "use overwrite=True to replace it")
    hint = (" Leave out the differing options: resume=True reuses the recorded ones "
            f"({recorded.options.describe()})." if diffs else "")
    raise ResumeMismatchError(f"cannot resume {dst}: {what}.{hint} Or start over with overwrite=True "
                              "(this discards the finished shards)")


class FolderInput(WriteSource):
    """An ImageFolder tree or a ``path,label`` list (``src``) as a classification store (layout
    version 1); ``max_side``/``quality``/``raw``/``lossless``/``storage``/``raw_fraction``/``raw_budget`` pick the
    storage mode and
    ``image_mode`` the default read mode recorded in the manifest (see :func:`fastdata.convert`)."""

    splits_across_ranks = True

    def __init__(self, src: str, *, max_side: int | None = None, quality: int | None = None, raw=None,
                 lossless: str | None = None, image_mode: str | None = None, storage: str | None = None,
                 raw_fraction: float | None = None, raw_budget: int | str | None = None):
        super().__init__(os.path.abspath(src))
        self.src = src
        self.storage_request = {"max_side": max_side, "quality": quality, "raw": raw, "lossless": lossless,
                                "storage": storage, "raw_fraction": raw_fraction, "raw_budget": raw_budget}
        self.image_mode = None if image_mode is None else check_mode(image_mode, "image_mode")
        self.scan: SourceScan | None = None
        self.storage = StorageSpec()
        #: the manifest's IMAGE_MODES_KEY entry, set by :meth:`finish_results`
        self.image_modes: dict[str, str] = {}
        self.notes: list[str] = []
        #: the plan's own summary lines (a raw budget's choice)
        self.plan_notes: list[str] = []

    def _scan(self) -> SourceScan:
        assert self.scan is not None, "FolderInput.plan scans the source first"
        return self.scan

    def plan(self, run: RunOptions, dst: str) -> list[ShardPlan]:
        self.scan = scan(self.src)
        return self._plan_scanned(run, dst)

    def _plan_scanned(self, run: RunOptions, dst: str) -> list[ShardPlan]:
        """:meth:`plan` once :attr:`scan` is made (a remote source's scan too): checks, warnings, shards."""
        found = self._scan()
        self.storage = run.storage
        if not found.classes:
            raise SourceError(f"{self.src}: no class folders found (expected SRC/<class>/<image files>)")
        if found.hidden_classes:
            self.warnings.append("hidden folder(s) taken as classes, as ImageFolder does: "
                                 f"{', '.join(found.hidden_classes)} (remove them if they are not classes)")
        self.warnings.extend(f"{path}: {problem}" for path, problem in found.walk_problems)
        check_destination_outside(found, dst)
        if run.storage.raw_budget is not None:
            found.raw, found.stored_sizes, note = plan_raw(run.storage, found.paths, found.sizes, self.src,
                                                           used=self.raw_budget_used)
            self.plan_notes = [note]
        sizes = estimated_sizes(found, run.storage)
        plans = plan_shards(sizes, run.shard_size.bytes)
        check_shard_count(plans, int(sizes.sum()), run.shard_size)
        return plans

    def fingerprint(self, run: RunOptions) -> str:
        return plan_fingerprint(self._scan(), run.backend, run.storage, run.shard_size.bytes)

    def chunks(self, run: RunOptions, chunk_size: int) -> FolderSource:
        return FolderSource(self._scan(), run.storage, chunk_size)

    def check_resume(self, dst: str, recorded: RecordedRun | None, run: RunOptions, fingerprint: str) -> None:
        check_resume(dst, self.src, recorded, run, fingerprint, self._scan())

    def record(self, dst: str, run: RunOptions, fingerprint: str) -> None:
        record_run(dst, run, self.src, fingerprint, self._scan())

    def classes(self) -> list[str]:
        return list(self._scan().classes)

    def adopt_classes(self, store_classes: list[str], add_classes: bool) -> None:
        """Renumber the scan's labels to the store's class table (names matched exactly). The
        classes the store lacks are an error, or with ``add_classes`` are appended at the end of
        the table in sorted order (the store's table is then no longer ImageFolder's sorted order)."""
        found = self._scan()
        known = {name: i for i, name in enumerate(store_classes)}
        new = [name for name in found.classes if name not in known]
        if new and not add_classes:
            shown = ", ".join(repr(n) for n in new[:5]) + (f" and {len(new) - 5} more" if len(new) > 5 else "")
            raise SourceError(f"{self.src}: class(es) {shown} are not among the store's {len(store_classes)} "
                              "classes; pass add_classes=True to append them at the end of its "
                              "class table (its order is then no longer ImageFolder's sorted order), or fix the "
                              "folder names")
        table = list(store_classes) + new
        position = {name: i for i, name in enumerate(table)}
        mapping = np.array([position[name] for name in found.classes], dtype=np.int64)
        found.labels = mapping[found.labels] if len(found.labels) else found.labels
        found.classes = table

    def remarks(self) -> list[tuple[str, str]]:
        return list(self._scan().walk_problems)

    def finish_results(self, dst: str, backend: str, results: list[ShardResult]) -> None:
        """Count what the shards hold (from their index sidecars: a shard uploaded to a URL
        destination is no longer here) for the summary, and choose the default read mode: the one
        given (``image_mode``), else ``"unchanged"`` when the store holds a DICOM image (its pixels
        are 16-bit or signed values an RGB read would clip)."""
        indexes = []
        for r in results:
            index = decode_shard_index(shard_index_bytes(dst, backend, r.name, None), None, r.name)
            assert isinstance(index, ShardIndex), "a classification store's shards hold a ShardIndex"
            indexes.append(index)
        census = image_census(indexes)
        mode = self.image_mode or ("unchanged" if census["formats"].get("DICOM") else None)
        self.image_modes = {"image": mode} if mode is not None else {}
        self.notes = census_notes(census, self.image_modes, self.storage)

    def manifest_extra(self) -> dict[str, Any] | None:
        return {IMAGE_MODES_KEY: dict(self.image_modes)} if self.image_modes else None

    def report_notes(self) -> list[str]:
        return self.plan_notes + self.notes
