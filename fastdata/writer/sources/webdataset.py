"""WebDataset tar shards as a write source (``fastdata convert 'shards/train-{000000..000099}.tar' DST``).

The members of each tar are grouped into samples the WebDataset way: a member's *key* is its
path up to the first ``.`` of its file name, its *extension* the rest (``a/0001.seg.png``: key
``a/0001``, extension ``seg.png``), and consecutive members with one key are one sample. Each
extension becomes a field (its name with other characters than letters, digits and ``_`` as
``_``), plus ``__key__``, the key as a string:

==============================================  ============================================
extension                                       field
==============================================  ============================================
``jpg``, ``jpeg``, ``png``, ``webp``, ``tif``,  ``image``-kind: the bytes as they are
``tiff``, ``bmp``, ``ppm`` (and ``*.png`` ...)  (validated, never re-encoded)
``cls``, ``cls2``, ``index``                    ``int`` (decimal text)
``txt``, ``text``                               ``string`` (UTF-8)
``json``, ``jsn``                               ``json`` (the parsed value)
``npy``                                         ``ragged`` (N, ...) of the first one's dtype
anything else                                   the bytes, in a ``json`` field
==============================================  ============================================

The plan is made from the tar headers alone (the main process reads headers, never member
data); the workers read each member's bytes at its offset. Nothing is ever extracted: a
member named with an absolute path or ``..`` only gives a key, links and other non-file
members are skipped (counted in a warning), and a member whose header claims more bytes than
the file holds rejects its sample (reported). A sample that lacks one of the fields, or
whose value does not parse, is rejected and reported (``--strict`` stops at the first).
Only uncompressed ``.tar`` files (what WebDataset writes) are read: a ``.tar.gz`` is refused
with the command that decompresses it.
"""

from __future__ import annotations

import glob
import io
import json
import os
import re
import tarfile
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from fastdata.common.fileio import atomic_write
from fastdata.common.imageio import ImageDecodeError, inspect_image
from fastdata.errors import ResumeMismatchError, SourceError
from fastdata.format.fields import (
    JSON,
    NUMERIC_DTYPES,
    RESERVED_NAMES,
    Field,
    Image,
    Int,
    NDArray,
    Ragged,
    Schema,
    SchemaError,
    String,
)
from fastdata.format.names import PLAN_FILE, STAGING_DIR
from fastdata.format.record import encode_sample
from fastdata.writer.ingest import MAX_INPUT_BYTES, spill
from fastdata.writer.options import check_shard_count
from fastdata.writer.pipeline import Chunk, ChunkSource, io_error
from fastdata.writer.plan import ShardPlan, plan_shards
from fastdata.writer.resume import RecordedRun, RunOptions, option_differences
from fastdata.writer.sources.base import WriteSource

__all__ = ["TarInput", "encode_tar_chunk", "expand_braces", "tar_files"]

TAR_SUFFIX = ".tar"
#: compressed tars: refused (a worker could not seek to a member), with the command that fixes it
COMPRESSED_SUFFIXES = {".tar.gz": "gunzip", ".tgz": "gunzip", ".tar.bz2": "bunzip2", ".tar.xz": "unxz",
                       ".tar.zst": "unzstd"}
IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "webp", "tif", "tiff", "bmp", "ppm", "pgm", "pbm"})
INT_EXTENSIONS = frozenset({"cls", "cls2", "index"})
TEXT_EXTENSIONS = frozenset({"txt", "text"})
JSON_EXTENSIONS = frozenset({"json", "jsn"})
#: WebDataset's split of a member path into key and extension: the key ends at the first dot of the file name
_KEY_EXT = re.compile(r"^((?:.*/|)[^./][^.]*)\.([^/]*)$")
_BRACE = re.compile(r"\{([^{}]*)\}")
#: the most files one brace pattern may name
MAX_FILES = 1_000_000
KEY_FIELD = "__key__"


def expand_braces(pattern: str) -> list[str]:
    """``train-{000000..000002}.tar`` -> the three names (zero-padded as written); ``{a,b}`` -> each.

    Raises:
        SourceError: a range that runs backwards or names more than :data:`MAX_FILES` files.
    """
    match = _BRACE.search(pattern)
    if match is None:
        return [pattern]
    body = match.group(1)
    span = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if span:
        first, last = span.group(1), span.group(2)
        if int(last) < int(first) or int(last) - int(first) >= MAX_FILES:
            raise SourceError(f"{pattern}: the range {{{body}}} must run forwards and name at most {MAX_FILES:,} files")
        width = len(first) if first.startswith("0") else 0
        options = [str(i).zfill(width) for i in range(int(first), int(last) + 1)]
    else:
        options = body.split(",")
    head, tail = pattern[:match.start()], pattern[match.end():]
    out: list[str] = []
    for option in options:
        out.extend(expand_braces(head + option + tail))
        if len(out) > MAX_FILES:
            raise SourceError(f"{pattern} names more than {MAX_FILES:,} files")
    return out


def _compressed(name: str) -> str | None:
    lower = name.lower()
    return next((s for s in COMPRESSED_SUFFIXES if lower.endswith(s)), None)


def tar_files(src: str) -> list[str] | None:
    """The tar shards ``src`` names (a ``.tar`` file, a brace pattern, a glob, a folder of ``.tar``
    files), or None when ``src`` is not a WebDataset source.

    Raises:
        SourceError: a compressed tar (with the command that decompresses it), a pattern naming a
            missing file, or a glob matching none.
    """
    candidates = expand_braces(src) if _BRACE.search(src) else [src]
    if not any(c.lower().endswith(TAR_SUFFIX) or _compressed(c) for c in candidates):
        if os.path.isdir(src):
            try:
                entries = os.listdir(src)
            except OSError:
                return None
            names = sorted(n for n in entries
                           if n.lower().endswith(TAR_SUFFIX) and os.path.isfile(os.path.join(src, n)))
            # a folder of shards, not an image folder (class subfolders) with a stray archive in it
            if names and not any(os.path.isdir(os.path.join(src, n)) for n in entries if not n.startswith(".")):
                return [os.path.join(src, n) for n in names]
        return None
    files: list[str] = []
    for c in candidates:
        files.extend(sorted(glob.glob(c)) if glob.has_magic(c) else [c])
    if not files:
        raise SourceError(f"no file matches {src}")
    for f in files:
        suffix = _compressed(f)
        if suffix:
            raise SourceError(f"{f}: a compressed tar cannot be read by offset; decompress it first "
                              f"({COMPRESSED_SUFFIXES[suffix]} {f})")
        if not os.path.isfile(f):
            missing = sum(not os.path.isfile(x) for x in files)
            raise SourceError(f"{f} does not exist" + (f" ({missing} of the {len(files)} files named are missing)"
                                                       if missing > 1 else ""))
    return files


# --------------------------------------------------------------------------- the scan (headers only)


class TarScan:
    """Every tar's samples from its headers: per sample its key, tar and members (extension code,
    data offset, size), and why it is unusable where it is (a member beyond the end of the file)."""

    def __init__(self, files: list[str]):
        self.files = [os.path.abspath(f) for f in files]
        self.names = [os.path.basename(f) for f in files]
        if len(set(self.names)) < len(self.names):
            common = os.path.commonpath(self.files)
            self.names = [os.path.relpath(f, common) for f in self.files]
        self.stats: list[tuple[int, int]] = []
        self.keys: list[str] = []
        self.tar = array("i")
        self.first = array("q")
        self.count = array("i")
        self.bad: dict[int, str] = {}
        self.member_ext = array("h")
        self.member_offset = array("q")
        self.member_size = array("q")
        self.exts: list[str] = []
        self._codes: dict[str, int] = {}
        #: members that are not files (links, devices) or have no extension: skipped
        self.skipped = 0
        for t, path in enumerate(self.files):
            self._scan(t, path)

    def __len__(self) -> int:
        return len(self.keys)

    def _code(self, ext: str) -> int:
        code = self._codes.get(ext)
        if code is None:
            if len(self.exts) >= 1024:
                raise SourceError(f"{self.files[-1]}: more than 1,024 member extensions: not a WebDataset shard set")
            code = self._codes[ext] = len(self.exts)
            self.exts.append(ext)
        return code

    def _scan(self, t: int, path: str) -> None:
        try:
            st = os.stat(path)
            tf = tarfile.open(path, "r:")
        except (tarfile.TarError, OSError) as err:
            raise SourceError(f"{path}: not a readable tar file ({err})") from None
        self.stats.append((st.st_size, st.st_mtime_ns))
        size = st.st_size
        with tf:
            key: str | None = None
            seen: set[str] = set()
            overran = False  # the last member claims more bytes than the file holds
            while True:
                try:
                    member = tf.next()
                except (tarfile.TarError, OSError) as err:
                    if overran:  # nothing follows a member that runs past the end (it is rejected)
                        break
                    raise SourceError(f"{path}: damaged tar header near byte {tf.offset:,} ({err})") from None
                if member is None:
                    break
                if not member.isreg():
                    self.skipped += not member.isdir()
                    continue
                match = _KEY_EXT.match(member.name)
                if match is None:
                    self.skipped += 1
                    continue
                if match.group(1) != key:
                    key, seen = match.group(1), set()
                    self.keys.append(key)
                    self.tar.append(t)
                    self.first.append(len(self.member_offset))
                    self.count.append(0)
                i = len(self.keys) - 1
                ext = match.group(2).lower()
                if ext in seen:
                    self.bad.setdefault(i, f"two members with the extension {ext!r}")
                seen.add(ext)
                overran = member.offset_data + member.size > size
                if overran:
                    self.bad.setdefault(i, f"member {member.name!r} claims {member.size:,} bytes, more than the "
                                           f"{max(0, size - member.offset_data):,} left in the file")
                self.member_ext.append(self._code(ext))
                self.member_offset.append(member.offset_data)
                self.member_size.append(member.size)
                self.count[i] += 1
            end = tf.offset
        # tarfile ends the listing quietly at a damaged header: where it stopped must be the end
        if end + 512 <= size:
            with open(path, "rb") as fh:
                fh.seek(end)
                block = fh.read(512)
            if block.strip(b"\0"):
                raise SourceError(f"{path}: the tar header at byte {end:,} is damaged; the members after it "
                                  "cannot be read")

    def members(self, i: int) -> list[tuple[int, int, int]]:
        a = self.first[i]
        return [(self.member_ext[j], self.member_offset[j], self.member_size[j]) for j in range(a, a + self.count[i])]

    def sample_bytes(self) -> np.ndarray:
        sizes = np.frombuffer(self.member_size.tobytes(), dtype=np.int64)
        firsts = np.frombuffer(self.first.tobytes(), dtype=np.int64)
        sums = np.add.reduceat(sizes, firsts) if len(sizes) and len(firsts) else np.zeros(len(firsts), np.int64)
        return sums.astype(np.int64)


# --------------------------------------------------------------------------- fields


def _field_name(ext: str, taken: set[str]) -> str:
    out = re.sub(r"[^A-Za-z0-9_]", "_", ext)[:60] or "value"
    if not re.match(r"^[A-Za-z_]", out):
        out = "_" + out
    while out in RESERVED_NAMES or out in taken:
        out += "_"
    return out


def _kind_of(ext: str) -> str:
    last = ext.rsplit(".", 1)[-1]
    if last in IMAGE_EXTENSIONS:
        return "image"
    if ext in INT_EXTENSIONS:
        return "int"
    if ext in TEXT_EXTENSIONS:
        return "string"
    if ext in JSON_EXTENSIONS:
        return "json"
    if last == "npy":
        return "npy"
    return "bytes"


@dataclass(frozen=True)
class TarLayout:
    """Each extension's field (what the workers need; it pickles)."""

    #: (extension, field name, kind) per field after ``__key__``
    fields: tuple[tuple[str, str, str], ...]
    schema: Schema
    exts: tuple[str, ...]


def _read(fd: int, offset: int, size: int) -> bytes:
    parts, done = [], 0
    while done < size:
        piece = os.pread(fd, size - done, offset + done)
        if not piece:
            raise OSError(f"the file ends {size - done:,} bytes short of a member")
        parts.append(piece)
        done += len(piece)
    return b"".join(parts)


def _npy(data: bytes) -> np.ndarray:
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise ValueError(f"not a .npy array ({err})") from None


def _value(kind: str, data: bytes) -> Any:
    if kind == "int":
        text = data.decode("ascii", "replace").strip()
        if not re.fullmatch(r"[+-]?\d+", text):
            raise ValueError(f"{text[:40]!r} is not an integer")
        return int(text)
    if kind == "string":
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"not UTF-8 text ({err.reason} at byte {err.start})") from None
    if kind == "json":
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as err:
            raise ValueError(f"not JSON ({err})") from None
    if kind == "npy":
        return _npy(data)
    return data  # image (validated by the caller), bytes


def layout_of(scan: TarScan) -> TarLayout:
    """The field of every extension the shards hold (a ``.npy`` field's dtype and inner shape from its first one)."""
    taken = {KEY_FIELD}
    fields: list[tuple[str, str, str]] = []
    schema_fields: list[tuple[str, Field]] = [(KEY_FIELD, String())]
    for code, ext in enumerate(scan.exts):
        kind = _kind_of(ext)
        name = _field_name(ext, taken)
        taken.add(name)
        field: Field
        if kind == "image":
            field = Image()
        elif kind == "int":
            field = Int("int64")
        elif kind == "string":
            field = String()
        elif kind == "npy":
            field = _npy_field(scan, code) or JSON()
            kind = "npy" if not isinstance(field, JSON) else "bytes"
        else:
            field = JSON()
        fields.append((ext, name, kind))
        schema_fields.append((name, field))
    return TarLayout(tuple(fields), Schema(tuple(schema_fields)), tuple(scan.exts))


def _npy_field(scan: TarScan, code: int) -> Field | None:
    j = next((j for j in range(len(scan.member_ext)) if scan.member_ext[j] == code), None)
    if j is None or scan.member_size[j] > MAX_INPUT_BYTES:
        return None
    t = int(np.searchsorted(np.frombuffer(scan.first.tobytes(), dtype=np.int64), j, side="right")) - 1
    path = scan.files[scan.tar[t]]
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            array_ = _npy(_read(fd, scan.member_offset[j], scan.member_size[j]))
        finally:
            os.close(fd)
    except (OSError, ValueError):
        return None
    if array_.dtype.name not in NUMERIC_DTYPES:
        return None
    if array_.ndim == 0:
        return NDArray(array_.dtype.name, ())
    return Ragged(array_.dtype.name, array_.shape[1:])


# --------------------------------------------------------------------------- workers


def encode_tar_chunk(layout: TarLayout, path: str, size: int, name: str, samples: list, start: int,
                     spill_dir: str | None):
    """Worker entry point: ``samples`` (``(key, reason or None, members)``, store samples ``start ..``)
    of the tar ``path`` read at their offsets, as records or rejection reasons."""
    results: list = []
    nbytes = 0
    if samples:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size != size:
                raise SourceError(f"{path} changed since the conversion started; convert it again with --overwrite")
            for key, bad, members in samples:
                if bad is not None:
                    results.append(bad)
                    continue
                result, read = _encode_sample(layout, fd, name, key, members)
                results.append(result)
                nbytes += read
        except OSError as err:
            raise SourceError(f"{path}: cannot be read ({err})") from None
        finally:
            os.close(fd)
    return (spill(results, spill_dir) if spill_dir is not None else results), nbytes


def _encode_sample(layout: TarLayout, fd: int, name: str, key: str, members: list) -> tuple[Any, int]:
    by_ext = {layout.exts[code]: (offset, size) for code, offset, size in members}
    values: dict[str, Any] = {KEY_FIELD: key}
    images: dict[str, tuple] = {}
    read = 0
    for ext, field_name, kind in layout.fields:
        if ext not in by_ext:
            return f"no .{ext} member (every sample needs one: the shards hold .{ext} members)", read
        offset, size = by_ext[ext]
        if size > MAX_INPUT_BYTES:
            return f".{ext}: member of {size:,} bytes exceeds the {MAX_INPUT_BYTES:,} byte limit", read
        data = _read(fd, offset, size)
        read += size
        try:
            values[field_name] = _value(kind, data)
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
    except SchemaError as err:
        return str(err).removeprefix(f"{key} "), read
    return encode_sample(layout.schema, checked, images, f"{name}/{key}".encode("utf-8", "surrogateescape")), read


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

    def _scanned(self) -> tuple[TarScan, TarLayout]:
        assert self.scan is not None and self.layout is not None, "plan scans the shards first"
        return self.scan, self.layout

    def plan(self, run: RunOptions, dst: str) -> list[ShardPlan]:
        scan = self.scan = TarScan(self.paths)
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
        return f"{run.backend}, shard size {run.shard_size}" + (", --strict" if run.strict else "")

    def manifest_extra(self) -> dict[str, Any]:
        return {"metadata": {"webdataset": {"files": self._scanned()[0].names}}}

    def report_notes(self) -> list[str]:
        layout = self._scanned()[1]
        images = [name for _, name, kind in layout.fields if kind == "image"]
        return [f"{', '.join(images)}: the image bytes as they are (not re-encoded), each decoded once to check it"
                ] if images else []

    def check_resume(self, dst: str, recorded: RecordedRun | None, run: RunOptions, fingerprint: str) -> None:
        """Refuse a resume whose options or tar files differ from the interrupted run's, naming the options."""
        if recorded is None or recorded.fingerprint == fingerprint:
            return
        what = "; ".join(option_differences(recorded.options, run) or [f"the tar files {self.src} changed"])
        if recorded.complete:
            raise ResumeMismatchError(f"{dst} is a complete store made from different inputs or options ({what}); "
                                      "use --overwrite to replace it")
        raise ResumeMismatchError(f"cannot resume {dst}: {what}. Leave out differing options (--resume reuses the "
                                  f"recorded ones: {recorded.options.describe()}), or start over with --overwrite")

    def record(self, dst: str, run: RunOptions, fingerprint: str) -> None:
        """What a later ``--resume`` reuses (the options) and compares against (the fingerprint)."""
        path = os.path.join(dst, STAGING_DIR, PLAN_FILE)
        body = {"source": self.recorded_source, "fingerprint": fingerprint, "options": run.to_json()}
        try:
            atomic_write(path, json.dumps(body).encode())
        except OSError as err:
            raise io_error(err, path) from err
