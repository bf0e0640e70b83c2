"""WebDataset tar shards as a write source (:class:`TarInput`): the plan from the headers
(:class:`~fastdata.writer.sources.webdataset.scan.TarScan`), and the workers, which read each
sample's members at their offsets (:func:`encode_tar_chunk`)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import xxhash

from fastdata.common import portable
from fastdata.common.imageio import ImageDecodeError, inspect_image
from fastdata.errors import SourceError
from fastdata.format.fields import SchemaError
from fastdata.format.record import encode_sample
from fastdata.writer.ingest import spill
from fastdata.writer.options import check_shard_count
from fastdata.writer.pipeline import Chunk, ChunkSource
from fastdata.writer.plan import ShardPlan, plan_shards
from fastdata.writer.resume import RecordedRun, RunOptions
from fastdata.writer.sources.base import WriteSource, record_run, refuse_changed_resume
from fastdata.writer.sources.webdataset.scan import (
    KEY_FIELD,
    MAX_MEMBER_BYTES,
    TarLayout,
    TarScan,
    layout_of,
    member_value,
    read_at,
)

__all__ = ["TarChunks", "TarInput", "encode_samples", "encode_tar_chunk"]


def encode_tar_chunk(layout: TarLayout, path: str, size: int, name: str, samples: list, start: int,
                     spill_dir: str | None):
    """Worker entry point: ``samples`` (``(key, reason or None, members)``, store samples ``start ..``)
    of the tar ``path`` read at their offsets, as records or rejection reasons."""
    results: list = []
    nbytes = 0
    if samples:
        fd = os.open(path, os.O_RDONLY | portable.OPEN_FLAGS)
        try:
            if os.fstat(fd).st_size != size:
                raise SourceError(f"{path} changed since the conversion started; convert it again with overwrite=True")
            results, nbytes = encode_samples(layout, lambda offset, n: read_at(fd, offset, n), name, samples)
        except OSError as err:
            raise SourceError(f"{path}: cannot be read ({err})") from None
        finally:
            os.close(fd)
    return (spill(results, spill_dir) if spill_dir is not None else results), nbytes


def encode_samples(layout: TarLayout, read: Callable[[int, int], bytes], name: str,
                   samples: list) -> tuple[list, int]:
    """``samples`` (``(key, reason or None, members)``) of the tar ``name`` as records or rejection
    reasons, each member's bytes from ``read(offset, size)`` (called in the tar's order), and
    the bytes read."""
    results: list = []
    nbytes = 0
    for key, bad, members in samples:
        if bad is not None:
            results.append(bad)
            continue
        try:
            result, got = _encode_sample(layout, read, name, key, members)
        except MemoryError:  # one sample too large for this machine: rejected, the conversion goes on
            result, got = "out of memory while reading or encoding the sample", 0
        results.append(result)
        nbytes += got
    return results, nbytes


def _encode_sample(layout: TarLayout, read_member: Callable[[int, int], bytes], name: str, key: str,
                   members: list) -> tuple[Any, int]:
    by_ext = {layout.exts[code]: (offset, size) for code, offset, size in members}
    values: dict[str, Any] = {KEY_FIELD: key}
    images: dict[str, tuple] = {}
    read = 0
    for ext, field_name, kind in layout.fields:
        if ext not in by_ext:
            return f"no .{ext} member (every sample needs one: the shards hold .{ext} members)", read
        offset, size = by_ext[ext]
        if size > MAX_MEMBER_BYTES:
            return f".{ext}: member of {size:,} bytes exceeds the {MAX_MEMBER_BYTES:,} byte limit", read
        data = read_member(offset, size)
        read += size
        try:
            values[field_name] = member_value(kind, data)
        except ValueError as err:
            return f".{ext}: {err}", read
        if kind == "image":
            try:
                info = inspect_image(data)
            except ImageDecodeError as err:
                return f".{ext}: not a usable image ({err})", read
            images[field_name] = (info.format, info.width, info.height, info.dtype, info.channels)
    try:
        checked = layout.schema.check(values, key)
        # a record readers would refuse (too many values for its size) rejects its sample, not the conversion
        return encode_sample(layout.schema, checked, images, f"{name}/{key}".encode("utf-8", "surrogateescape")), read
    except SchemaError as err:
        return str(err).removeprefix(f"{key} "), read


class TarChunks(ChunkSource):
    """The pipeline's feed: ``chunk_size`` samples of one tar at a time (their member offsets)."""

    worker = staticmethod(encode_tar_chunk)

    def __init__(self, scan: TarScan, layout: TarLayout, chunk_size: int):
        self.scan, self.layout, self.chunk_size = scan, layout, chunk_size

    def chunks(self, plans: list[ShardPlan] | None) -> Iterator[Chunk]:
        scan = self.scan
        for plan in plans or []:
            if plan.start == plan.stop:
                yield Chunk(plan, plan.start, plan.stop, True, (self.layout, "", 0, "", [], plan.start))
            a = plan.start
            while a < plan.stop:
                t = scan.tar[a]
                b = a + 1
                while b < plan.stop and b - a < self.chunk_size and scan.tar[b] == t:
                    b += 1
                samples = [(scan.keys[i], scan.bad.get(i), scan.members(i)) for i in range(a, b)]
                yield Chunk(plan, a, b, b == plan.stop, (self.layout, scan.files[t], scan.stats[t][0],
                                                         scan.names[t], samples, a))
                a = b

    def describe(self, start: int, stop: int) -> str:
        scan = self.scan
        return f"{scan.files[scan.tar[start]]} samples {scan.keys[start]!r} .. {scan.keys[stop - 1]!r}"

    def input_name(self, i: int) -> str:
        return f"{self.scan.names[self.scan.tar[i]]} {self.scan.keys[i]}"

    def input_path(self, i: int) -> str:
        return f"{self.scan.files[self.scan.tar[i]]} {self.scan.keys[i]}"


class TarInput(WriteSource):
    """WebDataset tar shards as a general store (see the module docstring)."""

    unit = "samples"
    torchrun_refusal = "WebDataset shards convert on one machine: run it without torchrun"

    def __init__(self, src: str, files: list[str]):
        super().__init__(os.path.abspath(src))
        self.src, self.paths = src, files
        self.scan: TarScan | None = None
        self.layout: TarLayout | None = None

    def _scanned_only(self) -> TarScan:
        assert self.scan is not None, "plan scans the shards first"
        return self.scan

    def _scanned(self) -> tuple[TarScan, TarLayout]:
        assert self.scan is not None and self.layout is not None, "plan scans the shards first"
        return self.scan, self.layout

    def plan(self, run: RunOptions, dst: str) -> list[ShardPlan]:
        self.scan = TarScan(self.paths)
        return self._plan_scanned(run)

    def _plan_scanned(self, run: RunOptions) -> list[ShardPlan]:
        """The plan of the scanned tars (:attr:`scan`): their fields, and shards by sample bytes."""
        scan = self._scanned_only()
        if not len(scan):
            raise SourceError(f"{self.src}: the tar files hold no samples (members named KEY.EXTENSION)")
        layout = self.layout = layout_of(scan)
        self.schema = layout.schema
        if scan.skipped:
            self.warnings.append(f"{self.recorded_source}: {scan.skipped} member(s) skipped: links, devices and "
                                 "files without an extension are not samples' values (nothing is extracted)")
        sizes = scan.sample_bytes() + 64
        plans = plan_shards(sizes, run.shard_size.bytes)
        check_shard_count(plans, int(sizes.sum()), run.shard_size)
        return plans

    def fingerprint(self, run: RunOptions) -> str:
        scan, layout = self._scanned()
        h = xxhash.xxh3_128()
        h.update(json.dumps([run.backend, run.shard_size.bytes, layout.schema.to_json(), list(layout.fields),
                             [[f, *s] for f, s in zip(scan.files, scan.stats, strict=True)], len(scan)]).encode())
        return h.hexdigest()

    def chunks(self, run: RunOptions, chunk_size: int) -> TarChunks:
        scan, layout = self._scanned()
        return TarChunks(scan, layout, chunk_size)

    def options_text(self, run: RunOptions) -> str:
        return f"{run.backend}, shard size {run.shard_size}" + (", strict=True" if run.strict else "")

    def manifest_extra(self) -> dict[str, Any]:
        return {"metadata": {"webdataset": {"files": self._scanned()[0].names}}}

    def report_notes(self) -> list[str]:
        layout = self._scanned()[1]
        images = [name for _, name, kind in layout.fields if kind == "image"]
        return [f"{', '.join(images)}: the image bytes as they are (not re-encoded), each decoded once to check it"
                ] if images else []

    def check_resume(self, dst: str, recorded: RecordedRun | None, run: RunOptions, fingerprint: str) -> None:
        """Refuse a resume whose options or tar files differ from the interrupted run's, naming the options."""
        refuse_changed_resume(dst, recorded, run, fingerprint, f"the tar files {self.src} changed")

    def record(self, dst: str, run: RunOptions, fingerprint: str) -> None:
        """What a later ``resume=True`` reuses (the options) and compares against (the fingerprint)."""
        record_run(dst, self.recorded_source, run, fingerprint)
