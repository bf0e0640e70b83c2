"""NIfTI and TIFF sources as write sources (:func:`chunked_input`, :class:`VolumeInput`,
:class:`TiffImageInput`): their options, the plan (a probe of a few files sizes the shards),
the resume fingerprint, and the worker side: one file per task, opened and written chunk by
chunk in the worker (:func:`set_samples`, :func:`encode_files`, module level so that they
pickle by name)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from fastdata.common.extensions import IMG_EXTENSIONS
from fastdata.common.imageio import pixel_limit
from fastdata.common.units import parse_size
from fastdata.errors import RejectedInputError, SourceError
from fastdata.format.chunk_codecs import DEFAULT_CODEC
from fastdata.format.fields import Chunked, Field, Int, Schema, SchemaError
from fastdata.format.manifest import CLASS_TABLES_KEY, canonical_json
from fastdata.format.record import EncodedSample, encode_sample
from fastdata.writer.chunking import write_chunks
from fastdata.writer.ingest import spill
from fastdata.writer.options import check_shard_count
from fastdata.writer.pipeline import ShardResult, count_labels, staging_path
from fastdata.writer.plan import ShardPlan
from fastdata.writer.resume import RunOptions
from fastdata.writer.sources.python import MapInput, MapSource
from fastdata.writer.sources.volumes.common import chunked_field
from fastdata.writer.sources.volumes.nifti import VolumeSamples, require_nibabel, volume_layout, volume_schema
from fastdata.writer.sources.volumes.scan import (
    NIFTI_SUFFIXES,
    FileScan,
    is_volume_source,
    scan_decathlon,
    scan_file_folder,
    scan_volume_list,
)
from fastdata.writer.sources.volumes.tiff import TIFF_SUFFIXES, TiffSamples, image_layout, require_tifffile

__all__ = ["BOMB_HINT", "FileChunks", "TiffImageInput", "VolumeInput", "chunked_input", "encode_file", "encode_files",
           "parse_chunks", "parse_max_pixels", "set_samples"]

#: what a refusal by the decompression-bomb limit of an ordinary image conversion adds
BOMB_HINT = ("to store large TIFF images (whole slides, satellite scenes) as chunked arrays read tile by tile, "
             "convert their folder with chunks=512,512 and max_pixels=N (e.g. 2G)")


# --------------------------------------------------------------------------- options


def parse_chunks(spec: str | Sequence[int]) -> tuple[int, ...]:
    """``"64,64,64"`` or ``(64, 64, 64)`` -> the chunk sides, checked (positive integers).

    Raises:
        ValueError: naming ``chunks`` and the bad entry.
    """
    parts = [p.strip() for p in spec.split(",")] if isinstance(spec, str) else list(spec)
    sides = []
    for p in parts:
        if isinstance(p, str) and p.isascii() and p.isdigit():
            sides.append(int(p))
        elif isinstance(p, int | np.integer) and not isinstance(p, bool):
            sides.append(int(p))
        else:
            sides.append(0)
    if not sides or any(s <= 0 for s in sides):
        raise ValueError(f"chunks=SIDES takes positive integers separated by commas (e.g. 64,64,64 or 512,512), "
                         f"got {spec!r}")
    return tuple(sides)


def parse_max_pixels(spec: int | str) -> int:
    """``"2G"``, ``"500M"``, ``400000000`` -> a pixel count (k/M/G decimal, as sizes are).

    Raises:
        ValueError: naming ``max_pixels``.
    """
    try:
        return parse_size(spec)
    except ValueError:
        raise ValueError(f"max_pixels takes a pixel count such as 2G (2,000,000,000), 500M or 400000000, "
                         f"got {spec!r}") from None


# --------------------------------------------------------------------------- the worker side


#: the samples of this worker process (set by the pool initializer)
_SAMPLES: VolumeSamples | TiffSamples | None = None


def set_samples(samples: VolumeSamples | TiffSamples | None) -> None:
    """Worker initializer: keep the samples for :func:`encode_files` (None: let them go)."""
    global _SAMPLES
    _SAMPLES = samples


def encode_file(samples: VolumeSamples | TiffSamples, schema: Schema, i: int,
                chunk_dir: str | None) -> EncodedSample | str:
    """Sample ``i`` opened, checked and written chunk by chunk into ``chunk_dir`` (None: a probe,
    measured and not kept), or the reason (``str``) why its file is rejected."""
    where = f"{samples.input_name(i)}"
    try:
        opened = samples.open(i)
    except RejectedInputError as err:
        return str(err)
    pending = []
    try:
        checked = schema.check(opened.values, where)
        for name in schema.chunked_fields():
            chunked = schema[name]
            assert isinstance(chunked, Chunked)
            checked[name], waiting = write_chunks(chunked, name, checked[name], f"{where} field {name!r}", chunk_dir)
            if waiting is not None:
                pending.append(waiting)
        return encode_sample(schema, checked, {}, samples.relpath(i), tuple(pending))
    except (RejectedInputError, SchemaError) as err:
        for waiting in pending:
            os.unlink(waiting.path)
        return str(err)
    except BaseException:
        for waiting in pending:
            os.unlink(waiting.path)
        raise
    finally:
        opened.close()


def encode_files(schema: Schema, start: int, stop: int, items: list | None, strict: bool, chunk_dir: str | None,
                 spill_dir: str | None):
    """Worker entry point: samples ``start .. stop-1`` of this worker's samples as
    :class:`EncodedSample` objects or rejection reasons (the pipeline stops at the first under
    ``strict=True``); see :class:`~fastdata.writer.pipeline.ChunkSource` for the return value."""
    samples = _SAMPLES
    assert samples is not None, "set_samples runs in each worker first"
    results = [encode_file(samples, schema, i, chunk_dir) for i in range(start, stop)]
    nbytes = sum(samples.input_bytes(i) for i in range(start, stop))
    return (spill(results, spill_dir) if spill_dir is not None else results), nbytes


class FileChunks(MapSource):
    """The pipeline's feed: one file per task, read by :func:`encode_files` in the workers."""

    worker = staticmethod(encode_files)

    def __init__(self, samples: VolumeSamples | TiffSamples, schema: Schema, strict: bool, chunk_dir: str | None):
        super().__init__(samples, schema, 1, strict, chunk_dir)
        self.samples = samples
        self.worker_init = (set_samples, (samples,))

    def describe(self, start: int, stop: int) -> str:
        return self.samples.input_path(start) + (f" .. {self.samples.input_path(stop - 1)}" if stop - start > 1 else "")

    def input_path(self, i: int) -> str:
        return self.samples.input_path(i)


# --------------------------------------------------------------------------- the write sources


class _FilesInput(MapInput):
    """What both sources share: a scan, the layout from the files' headers, a probe of a few files
    for the shard size, one file per worker task."""

    made_from = "made from different inputs or options"

    def __init__(self, src: str, chunks: tuple[int, ...] | None, codec: str | None):
        super().__init__([], None)
        self.src = src
        self.recorded_source = os.path.abspath(src)
        self.chunks_given, self.codec = chunks, DEFAULT_CODEC if codec is None else codec
        self.scan: FileScan | None = None
        self.files: VolumeSamples | TiffSamples | None = None
        self.notes: list[str] = []

    def _scan_source(self) -> FileScan:
        raise NotImplementedError

    def _layout(self, scan: FileScan) -> tuple[VolumeSamples | TiffSamples, Schema]:
        raise NotImplementedError

    def plan(self, run: RunOptions, dst: str) -> list[ShardPlan]:
        self.chunk_dir = staging_path(dst)
        scan = self.scan = self._scan_source()
        if scan.is_folder:
            root, target = os.path.realpath(scan.root), os.path.realpath(dst)
            if target == root or target.startswith(os.path.join(root, "")):
                raise SourceError(f"the destination {dst} is inside the source folder {scan.root}: choose a "
                                  "destination outside it")
        self.warnings.extend(f"{path}: {problem}" for path, problem in scan.problems)
        files, schema = self._layout(scan)
        self.files, self.samples, self.schema = files, files, schema
        count = self.count = len(files)
        picks = sorted({0, count // 4, count // 2, 3 * count // 4, count - 1})
        probe = [encode_file(files, schema, i, None) for i in picks]
        self.probe = [p for p in probe if not isinstance(p, str)]
        sizes = [p.stored_bytes + len(p.relpath) + 16 + 8 * len(p.index) for p in self.probe] or [1]
        per_shard = max(1, run.shard_size.bytes // max(1, int(np.mean(sizes))))
        plans = [ShardPlan(k, a, min(a + per_shard, count)) for k, a in enumerate(range(0, count, per_shard))]
        check_shard_count(plans, int(np.mean(sizes)) * count, run.shard_size)
        self.metadata = {**scan.metadata, **self._metadata()}
        return plans

    def _metadata(self) -> dict[str, Any]:
        return {}

    def _scanned(self) -> FileScan:
        assert self.scan is not None, "plan scans the source first"
        return self.scan

    def fingerprint(self, run: RunOptions) -> str:
        """What identifies the conversion for ``resume=True``: backend, shard size, schema, metadata and
        every file's path, size and modification time. (Not the probe's encoded records, as
        :meth:`MapInput.fingerprint` hashes: Blosc's output bytes are not always the same from one
        run to the next for the same chunk, and the files' listing says more about a change.)"""
        h = xxhash.xxh3_128()
        h.update(repr((run.backend, run.shard_size.bytes, self.count, self._checked_schema().to_json())).encode())
        h.update(canonical_json(dict(self.metadata or {})))
        scan = self._scanned()
        for paths in (scan.paths, scan.label_paths or []):
            for p in paths:
                try:
                    st = os.stat(p)
                    h.update(repr((p, st.st_size, st.st_mtime_ns)).encode())
                except OSError:
                    h.update(repr((p, None)).encode())
        return h.hexdigest()

    def chunks(self, run: RunOptions, chunk_size: int) -> FileChunks:
        assert self.files is not None, "plan opens the source first"
        return FileChunks(self.files, self._checked_schema(), run.strict, self.chunk_dir)

    def options_text(self, run: RunOptions) -> str:
        schema = self._checked_schema()
        image = schema["image"]
        assert isinstance(image, Chunked)
        return (f"{run.backend}, shard size {run.shard_size}, chunks {','.join(map(str, image.chunks))}, "
                f"codec {image.codec}")

    def classes(self) -> list[str]:
        return list(self._scanned().classes)

    def remarks(self) -> list[tuple[str, str]]:
        return list(self._scanned().problems)

    def manifest_extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"metadata": dict(self.metadata or {})}
        if self.classes():
            extra[CLASS_TABLES_KEY] = {"label": self.classes()}
        return extra

    def finish_results(self, dst: str, backend: str, results: list[ShardResult]) -> None:
        """Each shard's ``class_counts`` from the labels its index sidecar holds, with class labels."""
        if not self.classes():
            return
        count_labels(dst, backend, results, self._checked_schema(), len(self.classes()))

    def report_notes(self) -> list[str]:
        return list(self.notes)


class VolumeInput(_FilesInput):
    """A NIfTI folder, volume list or Decathlon ``dataset.json`` (see :mod:`~fastdata.writer.sources.volumes`)."""

    unit = "volumes"

    def _scan_source(self) -> FileScan:
        require_nibabel()  # before anything: one clear line when nibabel is missing
        src = self.src
        if os.path.isdir(src):
            return scan_file_folder(src, NIFTI_SUFFIXES, "NIfTI")
        if src.lower().endswith(".json"):
            return scan_decathlon(src)
        return scan_volume_list(src)

    def _layout(self, scan: FileScan) -> tuple[VolumeSamples, Schema]:
        layout = volume_layout(scan, self.chunks_given)
        schema = volume_schema(scan, layout, self.codec)
        self.notes = [f"image: {layout.dtype.name} {layout.ndim}-D volumes, raw stored values (physical value = "
                      "image * scl_slope + scl_inter)"]
        if layout.label_dtype is not None:
            self.notes.append(f"label: {layout.label_dtype.name} {layout.label_ndim}-D label volumes")
        return VolumeSamples(scan, layout), schema

    def _metadata(self) -> dict[str, Any]:
        return {"volumes": {"format": "nifti", "values": "raw stored values: image * scl_slope + scl_inter"}}


class TiffImageInput(_FilesInput):
    """A folder of TIFF images stored as chunked arrays read tile by tile (see
    :mod:`~fastdata.writer.sources.volumes`)."""

    unit = "images"

    def __init__(self, src: str, chunks: tuple[int, ...] | None, codec: str | None, max_pixels: int | None):
        super().__init__(src, chunks, codec)
        self.max_pixels = max_pixels

    def _scan_source(self) -> FileScan:
        require_tifffile()
        if not os.path.isdir(self.src):
            raise SourceError(f"{self.src}: chunks/max_pixels store the TIFF images of a folder (class "
                              "subfolders give labels) or NIfTI volumes; this is not a folder")
        return scan_file_folder(self.src, tuple(dict.fromkeys(TIFF_SUFFIXES + IMG_EXTENSIONS)), "TIFF/image")

    def _layout(self, scan: FileScan) -> tuple[TiffSamples, Schema]:
        layout = image_layout(scan, self.chunks_given, self.max_pixels)
        fields: list[tuple[str, Field]] = [("image", chunked_field(layout.dtype, layout.chunks, self.codec))]
        if scan.labels is not None:
            fields.append(("label", Int()))
        limit = self.max_pixels if self.max_pixels is not None else pixel_limit()
        self.notes = [f"image: {layout.dtype.name} {'HxWxC' if layout.ndim == 3 else 'HxW'} arrays read tile by tile; "
                      f"pixel limit {limit:,} per image" + (" (max_pixels)" if self.max_pixels is not None else "")]
        return TiffSamples(scan, layout, self.max_pixels), Schema(tuple(fields))


def chunked_input(src: str, *, chunks: str | Sequence[int] | None = None, codec: str | None = None,
                  max_pixels: int | str | None = None) -> VolumeInput | TiffImageInput | None:
    """The write source of ``src`` when it is stored as chunked arrays, else None.

    A NIfTI source (:func:`is_volume_source`) is a :class:`VolumeInput`; a folder converted with
    ``chunks`` or ``max_pixels`` is a :class:`TiffImageInput`; anything else is None (an ordinary
    image source, which takes none of these options; ``codec`` alone does not make a folder chunked).

    Raises:
        ValueError: a malformed option, or ``max_pixels`` for NIfTI volumes.
    """
    sides = None if chunks is None else parse_chunks(chunks)
    pixels = None if max_pixels is None else parse_max_pixels(max_pixels)
    if is_volume_source(src):
        if pixels is not None:
            raise ValueError("max_pixels applies to TIFF images; NIfTI volumes are read slab by slab without it")
        return VolumeInput(src, sides, codec)
    if os.path.isdir(src) and (sides is not None or pixels is not None):
        if sides is not None and len(sides) not in (2, 3):
            raise ValueError(f"chunks for images takes 2 sides (rows,columns; every band in each chunk) or 3 "
                             f"(rows,columns,bands), got {len(sides)}")
        return TiffImageInput(src, sides, codec, pixels)
    return None
