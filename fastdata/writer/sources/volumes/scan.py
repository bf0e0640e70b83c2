"""What a volume or image source lists (:class:`FileScan`): a folder (class subfolders give
labels), a CSV/TSV/JSONL volume list or a Decathlon ``dataset.json``; and the detection of a
NIfTI source (:func:`is_volume_source`). Rules: :mod:`~fastdata.writer.sources.volumes`."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastdata.common.extensions import IMG_EXTENSIONS
from fastdata.errors import SourceError
from fastdata.format.fields import JSON, RESERVED_NAMES, Field, Float, Int, Schema, SchemaError, String
from fastdata.remote.sources import join_url
from fastdata.writer.sources.folder import find_classes, is_url, MAX_INTEGER_LABEL, MAX_ROW_ERRORS

__all__ = ["FileScan", "IMAGE_COLUMNS", "LABEL_COLUMN", "LIST_SUFFIXES", "NIFTI_SUFFIXES", "OWN_FIELDS", "is_nifti",
           "is_volume_list_text", "is_volume_source", "names_urls", "scan_decathlon", "scan_file_folder",
           "scan_volume_list"]

NIFTI_SUFFIXES = (".nii", ".nii.gz")
LIST_SUFFIXES = (".csv", ".tsv", ".jsonl", ".ndjson")
#: the fields a volume source makes itself (a list's other columns must be named otherwise)
OWN_FIELDS = ("image", "label", "affine", "spacing", "scl_slope", "scl_inter")
#: list columns (compared lower-case) that name the image volume, in order of preference
IMAGE_COLUMNS = ("image", "path")
LABEL_COLUMN = "label"
_INTEGER = re.compile(r"-?[0-9]+")


def is_nifti(name: str | bytes) -> bool:
    """True when ``name`` ends with ``.nii`` or ``.nii.gz`` (any case)."""
    return os.fsdecode(name).lower().endswith(NIFTI_SUFFIXES)


@dataclass
class FileScan:
    """What a volume or image source lists: per sample the file (``paths`` absolute, ``relpaths``
    as recorded), an optional label volume (``label_paths``/``label_relpaths``, None without), an
    optional class index (``labels``, with ``classes``), other fields (``extras``: name ->
    (field, one value per sample)); ``problems`` are ``(path, warning)`` pairs to report."""

    root: str
    paths: list[bytes]
    relpaths: list[bytes]
    classes: list[str] = field(default_factory=list)
    labels: list[int] | None = None
    label_paths: list[bytes] | None = None
    label_relpaths: list[bytes] | None = None
    extras: dict[str, tuple[Field, list]] = field(default_factory=dict)
    problems: list[tuple[str, str]] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    #: True when the source is a folder (a destination inside it is refused)
    is_folder: bool = False

    def __len__(self) -> int:
        return len(self.paths)


def _walk(folder: str, suffixes: tuple[str, ...], problems: list[tuple[str, str]]) -> list[str]:
    """Files under ``folder`` whose names end with ``suffixes`` (any case), in ImageFolder's
    order (sorted walk, directory symlinks followed, each real directory walked once)."""
    seen: set[tuple[int, int]] = set()
    entries = []

    def onerror(err: OSError) -> None:
        problems.append((str(err.filename), f"cannot list directory: {err.strerror}"))

    for root, dirs, files in os.walk(folder, followlinks=True, onerror=onerror):
        try:
            st = os.stat(root)
        except OSError as err:
            problems.append((root, f"cannot stat directory: {err.strerror}"))
            dirs[:] = []
            continue
        if (st.st_dev, st.st_ino) in seen:
            problems.append((root, "directory symlink loop: already walked, skipped"))
            dirs[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        entries.append((root, files))
    return [os.path.join(root, name) for root, files in sorted(entries) for name in sorted(files)
            if name.lower().endswith(suffixes)]


def scan_file_folder(root: str, suffixes: tuple[str, ...], what: str) -> FileScan:
    """The files of folder ``root`` whose names end with ``suffixes``: class subfolders (those
    holding such files, searched recursively) give class labels; without any, the folder's own
    files are the samples, unlabeled (rules: :mod:`~fastdata.writer.sources.volumes`).

    Raises:
        SourceError: ``root`` is missing or holds no such file.
    """
    root = os.path.abspath(root)
    problems: list[tuple[str, str]] = []
    found = {c: _walk(os.path.join(root, c), suffixes, problems) for c in find_classes(root)}
    classes = [c for c, files in found.items() if files]
    try:
        top = sorted(n for n in os.listdir(root) if n.lower().endswith(suffixes)
                     and os.path.isfile(os.path.join(root, n)))
    except OSError as err:
        raise SourceError(f"cannot list source folder {root}: {err.strerror}") from None
    prefix = os.path.join(root, "")
    if classes:
        files = [(path, label) for label, c in enumerate(classes) for path in found[c]]
        if top:
            problems.append((root, f"{len(top)} {what} file(s) directly in the folder are not in a class folder "
                                   f"({', '.join(top[:5])}{' ...' if len(top) > 5 else ''}): skipped, as "
                                   "ImageFolder does"))
        empty = [c for c in found if not found[c]]
        if empty:
            problems.append((root, f"subfolder(s) holding no {what} file: {', '.join(empty[:20])}: not classes"))
    else:
        files = [(os.path.join(root, n), -1) for n in top]
    if not files:
        raise SourceError(f"{root}: no {what} files found ({', '.join(suffixes)}, any case) in the folder or its "
                          "class subfolders")
    if os.path.isfile(os.path.join(root, "dataset.json")) and suffixes == NIFTI_SUFFIXES:
        problems.append((root, "the folder holds a dataset.json: convert SRC/dataset.json to pair each image with "
                               "its label volume (a Decathlon task)"))
    return FileScan(root=root, paths=[os.fsencode(p) for p, _ in files],
                    relpaths=[os.fsencode(p[len(prefix):]) for p, _ in files], classes=classes if classes else [],
                    labels=[label for _, label in files] if classes else None, problems=problems, is_folder=True)


def _list_rows(list_file: str) -> tuple[list[str], list[tuple[int, dict[str, Any] | str]], bool]:
    """``(keys in order, [(line, {key: value} or what is wrong with the row)], from_text)`` of a
    CSV/TSV (header row) or JSONL list.

    Raises:
        SourceError: the file is missing, a JSONL line is not an object, or the header repeats a name.
    """
    try:
        fh = open(list_file, newline="", encoding="utf-8-sig", errors="surrogateescape")
    except FileNotFoundError:
        raise SourceError(f"list file not found: {list_file}") from None
    except OSError as err:
        raise SourceError(f"cannot read list file {list_file}: {err.strerror}") from None
    with fh:
        return _parse_list_rows(list_file, fh)


def _parse_list_rows(list_file: str, fh: Iterable[str]) -> tuple[list[str], list[tuple[int, dict[str, Any] | str]],
                                                                  bool]:
    """:func:`_list_rows` of the lines ``fh`` of ``list_file`` (a local file, or the text of one at a URL)."""
    rows: list[tuple[int, dict[str, Any] | str]] = []
    keys: list[str] = []
    if list_file.lower().endswith((".jsonl", ".ndjson")):
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise SourceError(f"{list_file}:{lineno}: not a JSON object ({err.msg})") from None
            except RecursionError:  # (as the table lists' rows: json.loads recurses per nesting level)
                raise SourceError(f"{list_file}:{lineno}: JSON nested too deeply to read") from None
            if not isinstance(obj, dict):
                raise SourceError(f"{list_file}:{lineno}: expected a JSON object per line, got "
                                  f"{type(obj).__name__}")
            keys.extend(k for k in obj if k not in keys)
            rows.append((lineno, obj))
        return keys, rows, False
    reader = csv.reader(fh, delimiter="\t" if list_file.lower().endswith(".tsv") else ",")
    try:
        for row in reader:
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if not keys:
                keys = [c.strip() for c in row]
                if len(set(keys)) != len(keys):
                    raise SourceError(f"{list_file}:{reader.line_num}: the header names a column twice")
                if is_nifti(keys[0]):
                    raise SourceError(f"{list_file}: a volume list needs a header row naming its columns "
                                      "(e.g. image,label); its first line names a file")
                continue
            if len(row) != len(keys):
                rows.append((reader.line_num, f"expected {len(keys)} columns, got {len(row)}"))
                continue
            rows.append((reader.line_num, {k: v.strip() for k, v in zip(keys, row, strict=True)}))
    except csv.Error as err:
        raise SourceError(f"{list_file}:{reader.line_num}: {err}; fix that line") from None
    return keys, rows, True


def _column(keys: list[str], names: Sequence[str]) -> str | None:
    lower = {k.lower(): k for k in keys}
    return next((lower[n] for n in names if n in lower), None)


def _extra_field(name: str, values: list, from_text: bool) -> tuple[Field, list]:
    """The field of a list's other column and its values (rules: :mod:`~fastdata.writer.sources.volumes`)."""
    if from_text:
        if values and all(_INTEGER.fullmatch(v) for v in values):
            return Int(), [int(v) for v in values]
        try:
            numbers = [float(v) for v in values]
            return Float(allow_nan=any(math.isnan(v) for v in numbers)), numbers
        except ValueError:
            return String(), values
    if all(isinstance(v, bool) for v in values):
        return Int("bool"), values
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return Int(), values
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return Float(allow_nan=any(math.isnan(v) for v in values)), [float(v) for v in values]
    if all(isinstance(v, str) for v in values):
        return String(), values
    return JSON(), values


def _class_labels(texts: list[str]) -> tuple[list[str], list[int]]:
    """Classes and indices of a class column (the rule of ``path,label`` lists)."""
    if all(t.isascii() and t.isdigit() for t in texts):
        targets = [int(t) for t in texts]
        if max(targets) >= MAX_INTEGER_LABEL:
            raise ValueError(f"integer label {max(targets)} is taken as a class index and would make too many "
                             "classes; renumber the labels from 0, or use class names")
        return [str(i) for i in range(max(targets) + 1)], targets
    classes = sorted(set(texts))
    index = {c: i for i, c in enumerate(classes)}
    return classes, [index[t] for t in texts]


def _outside(root: str, text: str) -> bool:
    """Whether the path ``text`` (relative to ``root``, or absolute; a URL) resolves outside ``root``
    (``..``, an absolute path, or a symbolic link leading out; a URL or a folder URL ``root``: the
    joined URL not under it)."""
    if is_url(root) or is_url(text.strip()):
        try:
            return not _located(root, text)[0].startswith(os.fsencode(root.rstrip("/") + "/"))
        except SourceError:  # (an absolute local path in a list at a URL)
            return True
    real_root = os.path.join(os.path.realpath(root), "")
    return not os.path.realpath(os.path.join(root, text.strip())).startswith(real_root)


def _located(root: str, text: str) -> tuple[bytes, bytes]:
    """``(path, recorded relpath)`` of a list's path ``text``: a URL as it is; else relative to
    ``root`` (a local folder, or the folder URL of a list at a URL: ``..`` resolved) unless absolute.
    The relpath is the text normalized, as a local list records it."""
    text = text.strip()
    if is_url(text):
        return text.encode(), text.encode()
    if is_url(root):
        return join_url(root, text).encode(), os.fsencode(os.path.normpath(text))
    return os.fsencode(text if os.path.isabs(text) else os.path.join(root, text)), os.fsencode(os.path.normpath(text))


def _entries_scan(where: str, root: str, entries: Sequence[tuple[int, dict[str, Any] | str]], keys: list[str],
                  from_text: bool, line_word: str = "line", confined: bool = False) -> FileScan:
    """A :class:`FileScan` of list entries (``(line or entry number, {key: value})``), every bad
    entry reported at once in one :class:`SourceError`. ``confined``: every image and label path
    must resolve inside ``root`` (a bad entry otherwise)."""
    image_key = _column(keys, IMAGE_COLUMNS)
    if image_key is None:
        raise SourceError(f"{where}: no image column (expected one named {' or '.join(IMAGE_COLUMNS)}; "
                          f"found {', '.join(keys) or 'none'})")
    label_key = _column(keys, (LABEL_COLUMN,))
    bad: list[str] = []
    kept: list[tuple[int, dict[str, Any]]] = []
    for lineno, row in entries:
        problem = row if isinstance(row, str) else None
        if isinstance(row, dict):
            image = row.get(image_key)
            if not isinstance(image, str) or not image.strip():
                problem = f"no {image_key!r} path"
            elif label_key is not None and not (isinstance(row.get(label_key), str | int)
                                                and str(row.get(label_key)).strip()):
                problem = f"empty {label_key!r}: every row of a list with a {label_key!r} column needs one"
        if problem is not None or not isinstance(row, dict):
            bad.append(f"{line_word} {lineno}: {problem}")
        else:
            kept.append((lineno, row))
    if not bad and not kept:
        raise SourceError(f"{where}: the list names no volumes")
    segmentation = False
    if label_key is not None and kept:
        kinds = {is_nifti(str(row[label_key])) for _, row in kept}
        if len(kinds) > 1:
            first = next(n for n, row in kept if is_nifti(str(row[label_key])) != is_nifti(str(kept[0][1][label_key])))
            bad.append(f"{line_word} {first}: {label_key!r} mixes NIfTI paths (label volumes) and class labels")
        segmentation = kinds == {True}
    if confined:
        for lineno, row in kept:
            for key in (image_key, label_key if segmentation else None):
                if key is not None and _outside(root, str(row[key])):
                    bad.append(f"{line_word} {lineno}: {key} path {str(row[key]).strip()!r} resolves outside "
                               f"{root} (an absolute path, '..' or a symbolic link leading out): a dataset.json "
                               "names files inside its folder; move them there, or list them in a CSV/JSONL "
                               "volume list, which may name any path")
    if bad:
        shown = "; ".join(bad[:MAX_ROW_ERRORS]) + (f"; ... and {len(bad) - MAX_ROW_ERRORS} more"
                                                   if len(bad) > MAX_ROW_ERRORS else "")
        raise SourceError(f"{where}: {len(bad)} bad row(s) (fix them all, then convert again): {shown}")

    images = [_located(root, str(row[image_key])) for _, row in kept]
    scan = FileScan(root=root, paths=[p for p, _ in images], relpaths=[r for _, r in images])
    if label_key is not None and segmentation:
        labels = [_located(root, str(row[label_key])) for _, row in kept]
        scan.label_paths, scan.label_relpaths = [p for p, _ in labels], [r for _, r in labels]
    elif label_key is not None:
        try:
            scan.classes, scan.labels = _class_labels([str(row[label_key]).strip() for _, row in kept])
        except ValueError as err:
            raise SourceError(f"{where}: {err}") from None
    for key in keys:
        if key in (image_key, label_key):
            continue
        if key in OWN_FIELDS or key in RESERVED_NAMES or not key.isidentifier():
            raise SourceError(f"{where}: column {key!r} cannot be a field: rename it (fields are identifiers, not "
                              f"one of {', '.join(OWN_FIELDS + tuple(sorted(RESERVED_NAMES)))}, which a volume "
                              "store uses itself)")
        scan.extras[key] = _extra_field(key, [row.get(key) for _, row in kept], from_text)
    if scan.extras:
        try:
            Schema(tuple((name, f) for name, (f, _) in scan.extras.items()))
        except SchemaError as err:
            raise SourceError(f"{where}: {err}") from None
    return scan


def _list_location(list_file: str, text: bytes | None) -> tuple[str, str]:
    """``(the list's name, the folder its relative paths start from)``: a URL's parent URL, a local
    file's absolute folder."""
    if text is not None and is_url(list_file):
        return list_file, list_file.rsplit("/", 1)[0]
    list_file = os.path.abspath(list_file)
    return list_file, os.path.dirname(list_file)


def scan_volume_list(list_file: str, text: bytes | None = None) -> FileScan:
    """A CSV/TSV (header row) or JSONL list of volumes (rules: :mod:`~fastdata.writer.sources.volumes`).
    ``text``: the list's bytes, read by the caller (a list at a URL: ``list_file`` is its URL, and
    relative paths are keys under the list's folder URL); None: read from the local file.
    A row may name a URL (read remotely by :mod:`~fastdata.writer.sources.volumes.remote`).

    Raises:
        SourceError: the file is missing, names no image column, or has bad rows (all listed).
    """
    list_file, root = _list_location(list_file, text)
    if text is None:
        keys, rows, from_text = _list_rows(list_file)
    else:
        lines = io.StringIO(text.decode("utf-8-sig", errors="surrogateescape"), newline="")
        keys, rows, from_text = _parse_list_rows(list_file, lines)
    return _entries_scan(list_file, root, rows, keys, from_text)


def scan_decathlon(json_file: str, text: bytes | None = None) -> FileScan:
    """A Medical Segmentation Decathlon ``dataset.json``: its ``"training"`` image/label pairs.
    ``text``: its bytes, read by the caller (``json_file`` a URL: paths are keys under its folder
    URL, and must stay under it, as a local file's must stay in its folder); None: read from the file.

    Raises:
        SourceError: the file is not such a JSON object, or an entry lacks its image or label.
    """
    json_file, root = _list_location(json_file, text)
    body = _decathlon_body(json_file, text)
    if body is None:
        raise SourceError(f"{json_file}: not a Decathlon dataset.json (a JSON object with a \"training\" list of "
                          "{\"image\": ..., \"label\": ...} entries)")
    entries = body["training"]
    if not entries:
        raise SourceError(f"{json_file}: its \"training\" list is empty")
    if not all(isinstance(e, dict) for e in entries):
        raise SourceError(f"{json_file}: every \"training\" entry must be an object with image and label paths")
    keys: list[str] = []
    for e in entries:
        keys.extend(k for k in e if k not in keys)
    scan = _entries_scan(json_file, root, list(enumerate(entries)), keys, False, line_word="training entry",
                         confined=True)
    scan.metadata = {"decathlon": {k: v for k, v in body.items() if k not in ("training", "test")}}
    return scan


def _decathlon_body(json_file: str, text: bytes | None = None) -> dict | None:
    """The JSON object of ``json_file`` (or of its bytes ``text``) when it has a ``"training"`` list, else None."""
    try:
        if text is not None:
            body = json.loads(text.decode("utf-8"))
        else:
            with open(json_file, encoding="utf-8") as fh:
                body = json.load(fh)
    except (OSError, ValueError, RecursionError):
        return None
    return body if isinstance(body, dict) and isinstance(body.get("training"), list) else None


def _first_kind(root: str, look: int = 100) -> str | None:
    """``"nifti"`` when, among the first ``look`` NIfTI or image files under ``root`` (walked
    top-down, sorted), NIfTI files are at least as many as images; ``"image"`` when images are
    more; None when there are neither (a preview PNG beside the volumes does not make an image folder)."""
    counts: Counter[str] = Counter()
    for _dirpath, dirs, files in os.walk(root, followlinks=False):
        dirs.sort()
        for name in sorted(files):
            kind = "nifti" if is_nifti(name) else "image" if name.lower().endswith(IMG_EXTENSIONS) else None
            if kind is not None:
                counts[kind] += 1
        if sum(counts.values()) >= look:
            break
    if not counts:
        return None
    return "nifti" if counts["nifti"] >= counts["image"] else "image"


def _is_volume_list(src: str) -> bool:
    """A local CSV/TSV/JSONL list whose first row's image column names a NIfTI file."""
    try:
        with open(src, newline="", encoding="utf-8-sig", errors="replace") as fh:
            return _names_volumes(src, fh)
    except OSError:
        return False


def is_volume_list_text(name: str, text: bytes) -> bool:
    """Whether the CSV/TSV/JSONL list ``name`` (a URL) whose bytes are ``text`` names NIfTI volumes:
    its first row's image column names a ``.nii``/``.nii.gz`` file, as :func:`is_volume_source`
    tells a local list."""
    return _names_volumes(name, io.StringIO(text.decode("utf-8-sig", errors="replace"), newline=""))


def _names_volumes(src: str, fh: Iterable[str]) -> bool:
    """Whether the first row of the list ``src`` (its lines ``fh``) names a NIfTI image."""
    try:
        if src.lower().endswith((".jsonl", ".ndjson")):
            line = next((ln for ln in fh if ln.strip()), "")
            obj = json.loads(line) if line else None
            if not isinstance(obj, dict):
                return False
            key = _column(list(obj), IMAGE_COLUMNS)
            return key is not None and isinstance(obj[key], str) and is_nifti(obj[key])
        reader = csv.reader(fh, delimiter="\t" if src.lower().endswith(".tsv") else ",")
        rows = [r for r in (next(reader, None), next(reader, None)) if r]
    except (ValueError, RecursionError, csv.Error):
        return False
    if not rows:
        return False
    if is_nifti(rows[0][0].strip()):
        return True  # (no header: the scan says that it needs one)
    key = _column([c.strip() for c in rows[0]], IMAGE_COLUMNS)
    if key is None or len(rows) < 2:
        return False
    header = [c.strip() for c in rows[0]]
    cells = dict(zip(header, (c.strip() for c in rows[1]), strict=False))
    return is_nifti(cells.get(key, ""))


def names_urls(src: str) -> bool:
    """Whether the local volume list ``src`` names a volume (or label volume) by URL, so that it is
    read as a remote source (:mod:`~fastdata.writer.sources.volumes.remote`). False for anything
    else, and for a list that does not scan (the scan says why when the source is read)."""
    lower = src.lower()
    if not os.path.isfile(src) or not lower.endswith(LIST_SUFFIXES):
        return False  # (a dataset.json names files in its folder: a URL there is refused by its scan)
    try:
        scan = scan_volume_list(src)
    except SourceError:
        return False
    return any(is_url(os.fsdecode(p)) for p in scan.paths + (scan.label_paths or []))


def is_volume_source(src: str) -> bool:
    """Whether ``src`` is a NIfTI source: a folder whose first folder with files holds NIfTI
    files, a CSV/TSV/JSONL list whose first row names a ``.nii``/``.nii.gz`` image, or a
    Decathlon ``dataset.json``."""
    if os.path.isdir(src):
        return _first_kind(src) == "nifti"
    if not os.path.isfile(src):
        return False
    lower = src.lower()
    if lower.endswith(".json"):
        return _decathlon_body(src) is not None
    return lower.endswith(LIST_SUFFIXES) and _is_volume_list(src)


class ScannedSamples:
    """What the samples of a scanned source share: sample ``i`` is the ``i``-th file of the scan,
    named by its path relative to the source. Subclasses add ``open(i)``."""

    def __init__(self, scan: FileScan):
        self.scan = scan

    def __len__(self) -> int:
        return len(self.scan)

    def input_name(self, i: int) -> str:
        return os.fsdecode(self.scan.relpaths[i])

    def input_path(self, i: int) -> str:
        return os.fsdecode(self.scan.paths[i])

    def relpath(self, i: int) -> bytes:
        return self.scan.relpaths[i]

    def files_of(self, i: int) -> list[bytes]:
        """The files sample ``i`` is read from."""
        return [self.scan.paths[i]]

    def input_bytes(self, i: int) -> int:
        return sum(os.stat(p).st_size for p in self.files_of(i) if os.path.isfile(p))

