"""A WebDataset source's samples from the tar headers alone (:class:`TarScan`), the field of each
member extension (:func:`layout_of`), and a member's bytes as its field's value (:func:`member_value`)."""

from __future__ import annotations

import io
import os
import posixpath
import re
import tarfile
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from fastdata.common import portable
from fastdata.common.bounded import json_loads_bounded
from fastdata.errors import SourceError
from fastdata.format.fields import (
    JSON,
    NUMERIC_DTYPES,
    field_name_for,
    Field,
    Image,
    Int,
    NDArray,
    Ragged,
    Schema,
    String,
)
from fastdata.writer.ingest import MAX_INPUT_BYTES

__all__ = ["KEY_FIELD", "MAX_EXTENDED_HEADER_BYTES", "MAX_JSON_MEMBER_BYTES", "MAX_MEMBER_BYTES", "MAX_SAMPLE_BYTES",
           "TarLayout", "TarScan", "layout_of", "member_value", "read_at"]

#: the largest tar extended header (pax ``x``/``g``, GNU long name ``L`` / long link ``K``) read: tarfile
#: reads one whole, so a crafted header declaring GiBs is refused (SourceError) before it is read
MAX_EXTENDED_HEADER_BYTES = 1 << 20
#: the largest member read (a sample holding a larger one is rejected): one record holds at most ~1 GiB
MAX_MEMBER_BYTES = MAX_INPUT_BYTES
#: the most bytes one sample's members may hold together (every member of a sample is in memory at once)
MAX_SAMPLE_BYTES = MAX_INPUT_BYTES
#: the largest ``.json``/``.jsn`` member parsed (a larger one rejects its sample): parsing costs up to ~12x
MAX_JSON_MEMBER_BYTES = 16 << 20
_EXTENDED_TYPES = {tarfile.XHDTYPE: "pax extended header", tarfile.XGLTYPE: "pax global header",
                   tarfile.SOLARIS_XHDTYPE: "Solaris extended header", tarfile.GNUTYPE_LONGNAME: "GNU long name",
                   tarfile.GNUTYPE_LONGLINK: "GNU long link name"}

IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "webp", "tif", "tiff", "bmp", "ppm", "pgm", "pbm"})
INT_EXTENSIONS = frozenset({"cls", "cls2", "index"})
TEXT_EXTENSIONS = frozenset({"txt", "text"})
JSON_EXTENSIONS = frozenset({"json", "jsn"})
#: WebDataset's split of a member path into key and extension: the key ends at the first dot of the file name
_KEY_EXT = re.compile(r"^((?:.*/|)[^./][^.]*)\.([^/]*)$")
KEY_FIELD = "__key__"


class _BoundedTarInfo(tarfile.TarInfo):
    """A TarInfo that refuses an extended header (pax, GNU long name) over :data:`MAX_EXTENDED_HEADER_BYTES`
    before tarfile reads it whole into memory."""

    #: the tar's name in errors (a URL's tarfile would show as a local path)
    shown: str | None = None

    def _proc_member(self, tarfile_):
        what = _EXTENDED_TYPES.get(self.type)
        if what is not None and self.size > MAX_EXTENDED_HEADER_BYTES:
            raise SourceError(f"{self.shown or tarfile_.name}: the {what} at byte {self.offset:,} (named "
                              f"{self.name!r}) declares {self.size:,} bytes, more than the "
                              f"{MAX_EXTENDED_HEADER_BYTES:,} byte limit for a tar extended header: a damaged or "
                              "crafted tar")
        return super()._proc_member(tarfile_)  # type: ignore[misc]


#: opens tar ``t`` (its path or URL) for a scan: a seekable binary file and its ``(size, identity)``
#: (a local file's modification time, a remote object's ETag key)
TarOpener = Callable[[int, str], tuple[BinaryIO, tuple[int, int]]]


class TarScan:
    """Every tar's samples from its headers: per sample its key, tar and members (extension code,
    data offset, size), and why it is unusable where it is (a member beyond the end of the file).

    ``opener``: how to open each of ``files`` (URLs: a remote reader, see
    :mod:`fastdata.writer.sources.webdataset.remote`); None: they are local paths. The scan reads
    headers only, through the file's seeks (tarfile never reads a member's data here)."""

    def __init__(self, files: list[str], opener: TarOpener | None = None, concurrency: int = 1):
        self._opener = opener
        if opener is None:
            self.files = [os.path.abspath(f) for f in files]
            self.names = [os.path.basename(f) for f in files]
        else:
            self.files = list(files)
            self.names = [posixpath.basename(f) for f in files]
        if len(set(self.names)) < len(self.names):
            if opener is None:
                common = os.path.commonpath(self.files)
                self.names = [os.path.relpath(f, common) for f in self.files]
            else:
                common = posixpath.commonpath([f.split("://", 1)[-1] for f in self.files])
                self.names = [posixpath.relpath(f.split("://", 1)[-1], common) for f in self.files]
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
        if concurrency > 1 and len(self.files) > 1:
            # each tar walked on its own (a remote walk waits on the network), merged in order
            import concurrent.futures as cf

            with cf.ThreadPoolExecutor(min(concurrency, len(self.files))) as pool:
                parts = pool.map(lambda path: TarScan([path], opener), self.files)
                for t, part in enumerate(parts):
                    self._add(t, part)
        else:
            for t, path in enumerate(self.files):
                self._scan(t, path)

    def _add(self, t: int, part: TarScan) -> None:
        """The samples of ``part`` (the scan of tar ``t`` alone) after this scan's."""
        samples, members = len(self.keys), len(self.member_offset)
        self.stats.extend(part.stats)
        self.keys.extend(part.keys)
        self.tar.extend([t] * len(part.keys))
        self.first.extend(f + members for f in part.first)
        self.count.extend(part.count)
        self.bad.update({i + samples: why for i, why in part.bad.items()})
        self.member_ext.extend(self._code(part.exts[c]) for c in part.member_ext)
        self.member_offset.extend(part.member_offset)
        self.member_size.extend(part.member_size)
        self.skipped += part.skipped

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
        fh: BinaryIO | None = None
        info = type("_Shown", (_BoundedTarInfo,), {"shown": path})
        try:
            if self._opener is None:
                st = os.stat(path)
                stat = (st.st_size, st.st_mtime_ns)
                tf = tarfile.open(path, "r:", tarinfo=info)
            else:
                fh, stat = self._opener(t, path)
                tf = tarfile.open(fileobj=fh, mode="r:", tarinfo=info)
        except (tarfile.TarError, OSError) as err:
            if fh is not None:
                fh.close()
            raise SourceError(f"{path}: not a readable tar file ({err})") from None
        self.stats.append(stat)
        size = stat[0]
        try:
            end = self._scan_members(t, path, tf, size)
        finally:
            tf.close()
            if fh is not None:
                fh.close()
        # tarfile ends the listing quietly at a damaged header: where it stopped must be the end
        if end + 512 <= size:
            if self._opener is None:
                with open(path, "rb") as local:
                    local.seek(end)
                    block = local.read(512)
            else:
                fh, _ = self._opener(t, path)
                try:
                    fh.seek(end)
                    block = fh.read(512)
                finally:
                    fh.close()
            if block.strip(b"\0"):
                raise SourceError(f"{path}: the tar header at byte {end:,} is damaged; the members after it "
                                  "cannot be read")

    def _scan_members(self, t: int, path: str, tf: tarfile.TarFile, size: int) -> int:
        """Record the members of the open tar ``tf``; returns the offset where tarfile stopped."""
        key: str | None = None
        seen: set[str] = set()
        total = 0  # the bytes of the current sample's members
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
                key, seen, total = match.group(1), set(), 0
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
            total += member.size
            if member.size > MAX_MEMBER_BYTES:
                self.bad.setdefault(i, f"member {member.name!r} of {member.size:,} bytes exceeds the "
                                       f"{MAX_MEMBER_BYTES:,} byte limit for one member")
            elif total > MAX_SAMPLE_BYTES:
                self.bad.setdefault(i, f"the sample's members hold {total:,} bytes or more, over the "
                                       f"{MAX_SAMPLE_BYTES:,} byte limit for one sample")
            self.member_ext.append(self._code(ext))
            self.member_offset.append(member.offset_data)
            self.member_size.append(member.size)
            self.count[i] += 1
        return tf.offset

    def read_member(self, t: int, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset`` of tar ``t`` (through the scan's opener for a URL)."""
        path = self.files[t]
        if self._opener is None:
            fd = os.open(path, os.O_RDONLY | portable.OPEN_FLAGS)
            try:
                return read_at(fd, offset, size)
            finally:
                os.close(fd)
        fh, _ = self._opener(t, path)
        try:
            fh.seek(offset)
            data = fh.read(size)
        finally:
            fh.close()
        if len(data) != size:
            raise OSError(f"the object ends {size - len(data):,} bytes short of a member")
        return data

    def members(self, i: int) -> list[tuple[int, int, int]]:
        a = self.first[i]
        return [(self.member_ext[j], self.member_offset[j], self.member_size[j]) for j in range(a, a + self.count[i])]

    def sample_bytes(self) -> np.ndarray:
        sizes = np.frombuffer(self.member_size.tobytes(), dtype=np.int64)
        firsts = np.frombuffer(self.first.tobytes(), dtype=np.int64)
        sums = np.add.reduceat(sizes, firsts) if len(sizes) and len(firsts) else np.zeros(len(firsts), np.int64)
        sums = sums.astype(np.int64)
        if self.bad:  # rejected samples are never read, let alone stored
            sums[np.fromiter(self.bad, dtype=np.int64, count=len(self.bad))] = 0
        return sums


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


def read_at(fd: int, offset: int, size: int) -> bytes:
    parts, done = [], 0
    while done < size:
        piece = portable.pread(fd, size - done, offset + done)
        if not piece:
            raise OSError(f"the file ends {size - done:,} bytes short of a member")
        parts.append(piece)
        done += len(piece)
    return b"".join(parts)


def _npy(data: bytes) -> np.ndarray:
    """The array of ``.npy`` bytes, once its header is known to describe exactly the bytes that
    follow it (numpy allocates the declared shape before reading: a header declaring 64 GiB in
    a small member would cost 64 GiB)."""
    try:
        fh = io.BytesIO(data)
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(fh)
        elif version in ((2, 0), (3, 0)):
            shape, _, dtype = np.lib.format.read_array_header_2_0(fh)
        else:
            raise ValueError(f"unsupported .npy version {version}")
        if dtype.hasobject:
            raise ValueError("object arrays are not stored (they would need pickle)")
        count = 1
        for n in shape:
            count *= int(n)
        declared = count * int(dtype.itemsize)
        held = len(data) - fh.tell()
        if declared != held:
            raise ValueError(f"its header declares {declared:,} bytes of data ({tuple(shape)} {dtype}), the member "
                             f"holds {held:,}")
        return np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError, TypeError, OverflowError) as err:
        raise ValueError(f"not a .npy array ({err})") from None


def member_value(kind: str, data: bytes) -> Any:
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
        if len(data) > MAX_JSON_MEMBER_BYTES:
            raise ValueError(f"JSON member of {len(data):,} bytes exceeds the {MAX_JSON_MEMBER_BYTES:,} byte limit")
        try:
            return json_loads_bounded(data)
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
        name = field_name_for(ext, taken)
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
    try:
        array_ = _npy(scan.read_member(scan.tar[t], scan.member_offset[j], scan.member_size[j]))
    except (OSError, ValueError):
        return None
    if array_.dtype.name not in NUMERIC_DTYPES:
        return None
    if array_.ndim == 0:
        return NDArray(array_.dtype.name, ())
    return Ragged(array_.dtype.name, array_.shape[1:])
