"""A class-folder tree of DICOM files whose chosen tags are kept as fields (``convert
dicom_tags``): a general (layout version 2) store.

Without ``dicom_tags`` a DICOM folder converts as any image folder does (a classification
store, :class:`~fastdata.writer.sources.folder.FolderInput`). With them, the folder is scanned
as ImageFolder would (same classes, order and labels) and each file becomes a sample of

* ``image``: the file's bytes, bit-exact (``Image(mode="unchanged")`` unless ``image_mode``
  says otherwise: a DICOM's pixels are 16-bit or signed values an RGB read would clip);
* ``label``: the class index (the manifest's ``classes`` and ``class_tables["label"]``);
* one ``json`` field per tag (its name is the tag's keyword), the value
  :func:`fastdata.common.imageio.dicom_tags` reads (None where the file lacks the tag).

The samples are a map-style input (:class:`DicomSamples`) whose items are read in the worker
processes: the tags are read there, and each file is then validated like any image (a file
that is not a usable image is skipped and reported, named by its path in the folder).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from fastdata.common import imageio
from fastdata.common.imagemodes import check_mode
from fastdata.errors import SourceError
from fastdata.format.fields import JSON, Image, Int, Schema, SchemaError
from fastdata.format.manifest import CLASS_TABLES_KEY
from fastdata.writer.ingest import Rejected, read_bytes
from fastdata.writer.pipeline import ShardResult, count_labels
from fastdata.writer.plan import ShardPlan
from fastdata.writer.resume import RunOptions
from fastdata.writer.sources.folder import SourceScan, check_destination_outside, scan_folder
from fastdata.writer.sources.python import MapInput

#: at most this many tags (each is a field of every record)
MAX_DICOM_TAGS = 64


def parse_dicom_tags(tags: str | Sequence[str]) -> list[str]:
    """``"RescaleSlope,PixelSpacing"`` or a list of keywords -> the list, checked: DICOM keywords
    (identifiers), no repeats, none named like the store's own ``image``/``label`` fields.

    Raises:
        ValueError: naming the bad entry.
    """
    names = [t.strip() for t in tags.split(",")] if isinstance(tags, str) else [str(t).strip() for t in tags]
    if not names or any(not n for n in names):
        raise ValueError(f"dicom_tags takes a comma-separated list of DICOM keywords (e.g. "
                         f"RescaleSlope,PixelSpacing), got {tags!r}")
    if len(names) > MAX_DICOM_TAGS:
        raise ValueError(f"dicom_tags: at most {MAX_DICOM_TAGS} tags, got {len(names)}")
    for n in names:
        if n in ("image", "label") or not n.isidentifier():
            raise ValueError(f"dicom_tags: {n!r} is not a DICOM keyword (an identifier such as RescaleSlope, "
                             "not image or label)")
    if len(set(names)) != len(names):
        raise ValueError(f"dicom_tags: a tag is named twice in {','.join(names)}")
    return names


def _jsonable(value: Any) -> Any:
    """A tag value as a json field stores it: numbers, strings, lists of them (pydicom's
    multi-values, DS/IS strings and person names become lists, floats, ints and strings)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("latin-1")
    if isinstance(value, list | tuple | np.ndarray) or type(value).__name__ == "MultiValue":
        return [_jsonable(v) for v in value]
    return str(value)


def read_tags(data: bytes, names: list[str]) -> dict[str, Any]:
    """The tags ``names`` of DICOM file bytes ``data`` (:func:`fastdata.common.imageio.dicom_tags`),
    None for each when ``data`` is not a DICOM file (it is then validated as the image it is, or
    rejected with the decoder's reason)."""
    try:
        found = imageio.dicom_tags(data, names)
    except imageio.ImageDecodeError:
        return dict.fromkeys(names)
    return {n: _jsonable(found.get(n)) for n in names}


class DicomSamples:
    """The samples of a scanned DICOM folder: ``samples[i]`` reads file ``i`` and its tags (in
    whichever process calls it: the converter's workers)."""

    def __init__(self, scan: SourceScan, tags: list[str]):
        self.scan, self.tags = scan, tags

    def __len__(self) -> int:
        return len(self.scan)

    def __getitem__(self, i: int) -> dict[str, Any]:
        path = self.scan.paths[i]
        label = int(self.scan.labels[i])
        try:
            data = read_bytes(path)
        except Rejected:
            # the path, not bytes: the image check reads it again and rejects it with the reason
            return {"image": os.fsdecode(path), "label": label, **dict.fromkeys(self.tags)}
        # the image as its path too (the record keeps it; the page cache serves the second read)
        return {"image": os.fsdecode(path), "label": label, **read_tags(data, self.tags)}

    def input_name(self, i: int) -> str:
        """The file's path in the folder (for rejected.tsv)."""
        return os.fsdecode(self.scan.relpaths[i])


def dicom_schema(tags: list[str], image_mode: str | None) -> Schema:
    """The schema of a DICOM folder converted with ``tags``: image, label, one json field per tag."""
    try:
        return Schema((("image", Image(mode=image_mode or "unchanged")), ("label", Int()),
                       *((t, JSON()) for t in tags)))
    except SchemaError as err:
        raise ValueError(f"dicom_tags: {err}") from None


class DicomFolderInput(MapInput):
    """A class-folder tree of DICOM files with ``tags`` kept as fields (see the module docstring)."""

    made_from = "made from different inputs or options"

    def __init__(self, src: str, tags: str | Sequence[str], image_mode: str | None = None):
        self.tags = parse_dicom_tags(tags)
        mode = None if image_mode is None else check_mode(image_mode, "image_mode")
        super().__init__([], dicom_schema(self.tags, mode))
        self.recorded_source = os.path.abspath(src)
        self.src = src
        self.folder: SourceScan | None = None

    def plan(self, run: RunOptions, dst: str) -> list[ShardPlan]:
        if not os.path.isdir(self.src):
            raise SourceError(f"{self.src}: dicom_tags applies to a folder of class folders of DICOM files")
        found = self.folder = scan_folder(self.src)
        if not found.classes:
            raise SourceError(f"{self.src}: no class folders found (expected SRC/<class>/<DICOM files>)")
        self.warnings.extend(f"{path}: {problem}" for path, problem in found.walk_problems)
        check_destination_outside(found, dst)
        self.samples = DicomSamples(found, self.tags)
        self.metadata = {"dicom_tags": list(self.tags)}
        return super().plan(run, dst)

    def _folder(self) -> SourceScan:
        assert self.folder is not None, "DicomFolderInput.plan scans the folder first"
        return self.folder

    def fingerprint(self, run: RunOptions) -> str:
        """:meth:`MapInput.fingerprint` (a few encoded samples) and every file's path, class and
        size: a resume refuses a file added, removed, moved or resized anywhere in the folder (as
        an image folder's resume does), not only at the samples probed."""
        found = self._folder()
        h = xxhash.xxh3_128(super().fingerprint(run).encode())
        for rel in found.relpaths:
            h.update(len(rel).to_bytes(4, "little"))
            h.update(rel)
        h.update(found.labels.astype("<i8").tobytes())
        h.update(found.sizes.astype("<i8").tobytes())
        return h.hexdigest()

    def classes(self) -> list[str]:
        return list(self._folder().classes)

    def remarks(self) -> list[tuple[str, str]]:
        return list(self._folder().walk_problems)

    def manifest_extra(self) -> dict[str, Any]:
        return {CLASS_TABLES_KEY: {"label": self.classes()}, "metadata": dict(self.metadata or {})}

    def finish_results(self, dst: str, backend: str, results: list[ShardResult]) -> None:
        """Each shard's ``class_counts`` from the labels its index sidecar holds (rejected files
        are not in it)."""
        count_labels(dst, backend, results, self._checked_schema(), len(self.classes()))

    def report_notes(self) -> list[str]:
        mode = self._checked_schema()["image"]
        return [f"kept DICOM tag(s) as fields: {', '.join(self.tags)}",
                f"default read mode of 'image': {getattr(mode, 'mode', None)!r} (recorded in the schema: "
                "Image(mode=...); image_mode= of a reader overrides it)"]
