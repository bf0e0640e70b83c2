"""Scan the conversion input: an ImageFolder tree or a CSV/TSV list file.

Pure functions. For a folder the classes, class indices and sample order are the
ones ``torchvision.datasets.ImageFolder(root, allow_empty=True)`` produces:
classes are the sorted names of the root's subdirectories (hidden ones included,
as ImageFolder does, but reported so the caller can warn), files are found with
``os.walk(followlinks=True)`` in sorted order, and the extension test is a
case-insensitive suffix match over :data:`IMG_EXTENSIONS`.

One deliberate difference: a directory symlink that points back to a directory
already being walked (a symlink loop) would make ``os.walk`` recurse until the
path is too long. We walk each real directory once per class and report the loop.

Paths are kept as ``bytes`` (``os.fsencode``) so non-UTF-8 file names survive.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass, field

import numpy as np

from .errors import SourceError

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


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
    walk_problems: list[tuple[str, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.classes)}


def has_image_extension(name: str | bytes) -> bool:
    """True when ``name`` ends with one of :data:`IMG_EXTENSIONS`, ignoring case."""
    if isinstance(name, bytes):
        name = os.fsdecode(name)
    return name.lower().endswith(IMG_EXTENSIONS)


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
    """Scan an ImageFolder-layout tree. See the module docstring for the rules."""
    root = os.path.abspath(root)
    classes = find_classes(root)
    paths: list[bytes] = []
    relpaths: list[bytes] = []
    labels: list[int] = []
    problems: list[tuple[str, str]] = []
    prefix = os.path.join(root, "")  # every walked path starts with it (os.path.relpath is 20 us a file)
    for idx, cls in enumerate(classes):
        for path in _walk_class_dir(os.path.join(root, cls), problems):
            if has_image_extension(path):
                paths.append(os.fsencode(path))
                relpaths.append(os.fsencode(path[len(prefix):]))
                labels.append(idx)
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


def scan_list(list_file: str) -> SourceScan:
    """Scan a CSV (``path,label``) or TSV (``path<TAB>label``) list file.

    Relative paths are taken relative to the list file's folder. Labels are class
    names; classes are their sorted unique values (as ImageFolder sorts folder
    names). A first row ``path,label`` is treated as a header. Order is the file's.
    """
    list_file = os.path.abspath(list_file)
    base = os.path.dirname(list_file)
    delimiter = "\t" if list_file.lower().endswith(".tsv") else ","
    rows: list[tuple[str, str]] = []
    try:
        # utf-8-sig: spreadsheet exports often start with a BOM, which would hide the header row
        with open(list_file, newline="", encoding="utf-8-sig", errors="surrogateescape") as fh:
            for lineno, row in enumerate(csv.reader(fh, delimiter=delimiter), start=1):
                if not row or (len(row) == 1 and not row[0].strip()):
                    continue
                if len(row) != 2:
                    raise SourceError(
                        f"{list_file}:{lineno}: expected 2 columns (path{delimiter}label), got {len(row)}"
                    )
                path, label = row[0].strip(), row[1].strip()
                if lineno == 1 and (path.lower(), label.lower()) == ("path", "label"):
                    continue
                if not path or not label:
                    raise SourceError(f"{list_file}:{lineno}: empty path or label")
                rows.append((path, label))
    except FileNotFoundError:
        raise SourceError(f"list file not found: {list_file}") from None
    classes = sorted({label for _, label in rows})
    class_to_idx = {c: i for i, c in enumerate(classes)}
    paths = [os.fsencode(p if os.path.isabs(p) else os.path.join(base, p)) for p, _ in rows]
    relpaths = [os.fsencode(os.path.normpath(p)) for p, _ in rows]
    return SourceScan(
        root=base,
        classes=classes,
        paths=paths,
        relpaths=relpaths,
        labels=np.asarray([class_to_idx[lbl] for _, lbl in rows], dtype=np.int64),
        sizes=_stat_sizes(paths),
    )


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
