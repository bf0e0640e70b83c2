"""``fastdata convert --coco ANNOTATIONS.json IMAGE_DIR DST``: a COCO detection set as a store.

One sample per image of the annotation file, in ``torchvision.datasets.CocoDetection``'s
order (sorted image ids), images without annotations included. Each sample holds the
fields of :data:`COCO_SCHEMA`:

* ``image``: the image file's bytes, bit-exact (decoded when read);
* ``image_id``: the image's id (``CocoDetection.ids[i]``), in the shard index;
* ``width``, ``height``: the sizes the file lists (-1 when absent or not an integer), in the index;
* ``annotations``: the image's annotation dicts exactly as ``json.load`` gave them (same keys,
  key order, values and types: msgpack keeps ints apart from floats and bools), in file order.

The file's ``categories``, ``info`` and ``licenses`` go into the manifest
(``metadata.coco``), where :class:`fastdata.reader.coco.CocoStoreDataset` finds them.

The samples go through :func:`fastdata.write` as a map-style source whose items name the
image file, so the files are read and validated in the worker processes, and ``resume``
finishes an interrupted conversion.

Bad input, as for an image folder: an image file that is missing or not a usable image is
skipped and reported as rejected (the image ids of the others do not move: each sample
stores its own); the annotation file's inconsistencies (annotations of unknown images,
repeated image or annotation ids, unlisted categories: see :mod:`fastdata.writer.sources.coco`)
are reported as warnings. With ``strict=True`` any of them stops the conversion before
anything is written, naming them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from fastdata.errors import RejectedInputError
from fastdata.format.fields import JSON, Image, Int, Schema
from fastdata.writer.convert import resolve_workers
from fastdata.writer.report import ConvertReport
from fastdata.writer.sources.coco import CocoIndex, Problem, load_coco

__all__ = ["COCO_SCHEMA", "CocoSamples", "convert_coco"]

#: the fields of a store converted from a COCO annotation file
COCO_SCHEMA = Schema.of({
    "image": Image(),
    "image_id": Int("int64"),
    "width": Int("int32"),
    "height": Int("int32"),
    "annotations": JSON(),
})
#: problems named in a --strict error (the rest are counted)
_STRICT_LISTED = 5


class CocoSamples:
    """A :class:`~fastdata.writer.sources.coco.CocoIndex` as a map-style dataset of sample dicts
    for :func:`fastdata.write`: ``samples[i]`` names image ``i``'s file (read by the writer's
    worker) and carries its id, listed size and annotation dicts."""

    def __init__(self, index: CocoIndex):
        self.index = index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, Any]:
        index = self.index
        return {
            "image": index.path(i),
            "image_id": int(index.ids[i]),
            "width": int(index.width[i]),
            "height": int(index.height[i]),
            "annotations": index.annotations(i),
        }

    def input_name(self, i: int) -> str:
        """Image ``i``'s ``file_name``: what the rejected list names it by."""
        return self.index.file_name(i)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[i] for i in range(len(self)))


def _missing_files(index: CocoIndex) -> set[str]:
    """Paths of the images :func:`load_coco` could not find (they come back as rejected inputs)."""
    return {index.path(i) for i in (index.sizes < 0).nonzero()[0].tolist()}


def _strict_error(ann_file: str, problems: list[Problem]) -> RejectedInputError:
    listed = "; ".join(f"{where}: {why}" for where, why in problems[:_STRICT_LISTED])
    more = f" (and {len(problems) - _STRICT_LISTED} more)" if len(problems) > _STRICT_LISTED else ""
    return RejectedInputError(
        f"{ann_file}: {len(problems)} problem(s) with the COCO data: {listed}{more}. --strict stops at any of "
        "them; without it, missing or unusable images are skipped and reported, and the rest are warnings")


def coco_metadata(index: CocoIndex, warnings: list[Problem]) -> dict:
    """What the manifest keeps of the annotation file (``metadata.coco``)."""
    return {"coco": {
        "annotation_file": index.ann_file,
        "image_dir": index.image_dir,
        "categories": index.categories,
        "info": index.info,
        "licenses": index.licenses,
        "problems": [{"path": where, "warning": why} for where, why in warnings],
    }}


def convert_coco(
    ann_file: str | os.PathLike,
    image_dir: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    format: str | None = None,
    workers: int | None = None,
    shard_size: int | str | None = None,
    strict: bool | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool | None = None,
    chunk_size: int = 32,
    storage_options: dict | None = None,
    staging_dir: str | os.PathLike | None = None,
) -> ConvertReport:
    """Convert a COCO instances annotation file and its image folder into a store.

    Args:
        ann_file (str | os.PathLike): the COCO annotation JSON (``instances_*.json``).
        image_dir (str | os.PathLike): the folder the images' ``file_name`` is relative to.
        dst (str | os.PathLike): destination directory, or a URL (``s3://bucket/coco.lmdb``, uploaded as
            :func:`fastdata.write` does); its suffix picks the backend unless ``format`` is given.
        format (str | None): ``"lmdb"`` or ``"hdf5"``.
        workers (int | None): reader/validator processes (None or 0: all cores, as ``convert``).
        shard_size (int | str | None): target bytes per shard (e.g. ``"512MiB"``; default 1GiB).
        strict (bool | None): stop, before writing anything, at any problem of the annotation
            file or a missing image (and at an unusable image while writing); default False:
            skip and report them.
        resume (bool): finish an interrupted conversion of the same file, keeping its finished shards.
        overwrite (bool): replace an existing store at ``dst``.
        progress (bool | None): show a progress bar (default: when stderr is a terminal).
        chunk_size (int): images per worker task.
        storage_options (dict | None): fsspec options for a URL ``dst``.
        staging_dir (str | os.PathLike | None): local directory shards of a URL ``dst`` are written in first.

    Returns:
        ConvertReport: counts, rejected images (``rejected_items``) and the annotation file's
        problems (``warnings``).

    Raises:
        SourceError: the annotation file is unusable (names the file and entry).
        RejectedInputError: ``strict`` and a problem was found (names the first ones).
        FastdataError subclasses for the destination (exists, locked, I/O).
    """
    from fastdata.writer.remote_sink import refuse_remote_source
    from fastdata.writer.sources.python import write

    refuse_remote_source(ann_file, "annotation file")
    refuse_remote_source(image_dir, "image folder")
    strict = bool(strict)
    processes, workers_warning = resolve_workers(workers)
    index = load_coco(ann_file, image_dir)
    if strict and index.problems:
        raise _strict_error(index.ann_file, index.problems)
    missing = _missing_files(index)
    warnings = [(where, why) for where, why in index.problems if where not in missing]
    report = write(CocoSamples(index), dst, COCO_SCHEMA, format=format, workers=processes, shard_size=shard_size,
                   resume=resume, overwrite=overwrite, progress=progress, chunk_size=chunk_size, strict=strict,
                   metadata=coco_metadata(index, warnings), storage_options=storage_options, staging_dir=staging_dir)
    report.unit = "images"
    report.options = f"COCO {index.ann_file}, images in {index.image_dir}; {report.options}"
    report.warnings.extend(f"{where}: {why}" for where, why in warnings)
    if workers_warning:
        report.warnings.append(workers_warning)
    return report
