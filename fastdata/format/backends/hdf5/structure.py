"""Check an HDF5 shard's structure before any dataset is read.

An HDF5 file can make the library read elsewhere: *external storage* (a dataset's bytes
in another file named in the dataset's creation properties, e.g. ``/proc/self/environ``),
*external links* (a name resolved in another HDF5 file, or in a FIFO, which hangs the
open), *soft links* (a name that is another path of the file), *virtual datasets*
(mappings onto other files). A dataset can also declare far more data than the file
holds: a chunked dataset with no chunk written reads as fill values of its declared
size (2**31 int64 labels: 16 GiB for a file of a few KB), and a compressed one expands.

fastdata's layout (``spec.py``) uses none of these, so the reader refuses them all,
anywhere in the file, before it reads anything:

* :func:`walk`: every link in the file (``H5Lvisit`` over the hard-linked groups; soft
  and external links are reported, never resolved) is a hard link to a group or a
  dataset; no dataset has external storage or a virtual layout. Returns what each
  dataset declares (:class:`DatasetInfo`); nothing is read but the file's metadata.
* :func:`check_dataset`: before one dataset is read, its dtype is exactly the layout's
  (any byte order), its shape the one the shard's count implies, and its declared bytes
  stored in the file: contiguous data allocated and ending within the file, chunked data
  unfiltered (uncompressed) with every chunk written (storage >= declared bytes) and no
  more than the file, compact data at most 64 KiB (HDF5's own limit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import h5py
import numpy as np

from fastdata.errors import CorruptRecordError, UnsafeStoreError

_LINK_KINDS = {h5py.h5l.TYPE_SOFT: "a soft link", h5py.h5l.TYPE_EXTERNAL: "an external link"}
_LAYOUTS = {h5py.h5d.CONTIGUOUS: "contiguous", h5py.h5d.CHUNKED: "chunked", h5py.h5d.COMPACT: "compact"}
#: HDF5 keeps a compact dataset's data in its object header, at most 64 KiB
COMPACT_LIMIT = 1 << 16


@dataclass(frozen=True)
class DatasetInfo:
    """What one dataset declares (from its metadata only)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    layout: int
    offset: int | None  #: file offset of contiguous data, None when not allocated
    storage: int  #: bytes allocated in the file
    filters: int

    @property
    def size(self) -> int:
        """Number of elements (exact: Python integers, no wrap)."""
        n = 1
        for d in self.shape:
            n *= int(d)
        return n

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


def walk(f: h5py.File, path: str) -> dict[str, DatasetInfo]:
    """Check every link and object of ``f`` (the shard file ``path``) and describe its datasets.

    Raises:
        UnsafeStoreError: a soft, external or user-defined link, an object that is not a group
            or dataset, a dataset with external storage or a virtual layout.
        CorruptRecordError: the file's metadata is unreadable.
    """
    datasets: dict[str, DatasetInfo] = {}
    unsafe: list[str] = []
    damaged: list[str] = []

    def visit(raw: bytes, info) -> int | None:
        # an exception raised here would surface from h5py as a SystemError: report, then stop
        name = raw.decode("utf-8", "backslashreplace")
        try:
            problem = _visit(f, datasets, name, raw, info)
        except Exception as err:  # damaged metadata of this object
            damaged.append(f"object {name!r} is unreadable ({type(err).__name__}: {err})")
            return 1
        if problem:
            unsafe.append(problem)
            return 1
        return None

    try:
        f.id.links.visit(visit, info=True)
    except Exception as err:  # damaged metadata (libhdf5 errors are OSError, some RuntimeError/ValueError)
        damaged.append(f"its links are unreadable ({type(err).__name__}: {err})")
    if unsafe:
        raise UnsafeStoreError(f"{path}: unsafe HDF5 shard: {unsafe[0]}")
    if damaged:
        raise CorruptRecordError(f"{path}: damaged HDF5 shard: {damaged[0]}", shard=path)
    return datasets


def _visit(f: h5py.File, datasets: dict[str, DatasetInfo], name: str, raw: bytes, info) -> str | None:
    """Check one link (and the object it names); returns what is unsafe about it, if anything."""
    if info.type != h5py.h5l.TYPE_HARD:
        kind = _LINK_KINDS.get(info.type, f"a link of type {info.type}")
        return f"{name!r} is {kind}; fastdata's layout has hard links only (not followed)"
    obj = h5py.h5o.open(f.id, raw)
    if isinstance(obj, h5py.h5g.GroupID):
        return None
    if not isinstance(obj, h5py.h5d.DatasetID):
        kind = "a named datatype" if isinstance(obj, h5py.h5t.TypeID) else f"a {type(obj).__name__}"
        return f"{name!r} is {kind}, not a group or dataset"
    dcpl = obj.get_create_plist()
    layout = dcpl.get_layout()
    if dcpl.get_external_count():
        target = dcpl.get_external(0)[0].decode("utf-8", "backslashreplace")
        return f"dataset {name!r} keeps its data in external files (e.g. {target!r}); refused, not read"
    if layout not in _LAYOUTS:
        what = "a virtual dataset (mapped onto other files)" if layout == h5py.h5d.VIRTUAL else \
            f"of unknown layout {layout}"
        return f"dataset {name!r} is {what}; refused, not read"
    offset = obj.get_offset() if layout == h5py.h5d.CONTIGUOUS else None
    datasets[name] = DatasetInfo(name, obj.dtype, tuple(int(d) for d in obj.shape), layout, offset,
                                 int(obj.get_storage_size()), dcpl.get_nfilters())
    return None


def check_dataset(datasets: dict[str, DatasetInfo], name: str, dtype: np.dtype | str,
                  shape: tuple[int, ...] | Callable[[tuple[int, ...]], str | None], file_size: int,
                  path: str, *, contiguous: bool = False) -> DatasetInfo:
    """Check dataset ``name`` before it is read (see the module docstring).

    Args:
        shape: the exact shape expected, or a function returning what is wrong with a shape (None: fine).
        contiguous: the dataset must be contiguous (the payload, which readers map).

    Raises:
        CorruptRecordError: missing, another dtype or shape, data past the end of the file.
        UnsafeStoreError: it declares more bytes than it stores, or is compressed.
    """
    info = datasets.get(name)
    if info is None:
        raise CorruptRecordError(f"{path}: dataset {name!r} is missing", shard=path)
    want = np.dtype(dtype)
    got = info.dtype
    if got.fields is not None or got.subdtype is not None or got.kind != want.kind or \
            got.itemsize != want.itemsize:
        raise CorruptRecordError(f"{path}: dataset {name!r} has dtype {got}, expected {want}", shard=path)
    wrong = (None if info.shape == shape else f"expected {shape}") if isinstance(shape, tuple) else shape(info.shape)
    if wrong:
        raise CorruptRecordError(f"{path}: dataset {name!r} has shape {info.shape}, {wrong}", shard=path)
    nbytes = info.nbytes
    where = f"{path}: dataset {name!r} ({_LAYOUTS[info.layout]}, {nbytes:,} bytes declared)"
    if contiguous and nbytes and info.layout != h5py.h5d.CONTIGUOUS:
        raise CorruptRecordError(f"{path}: payload dataset {name!r} is not contiguous", shard=path)
    if info.layout == h5py.h5d.CONTIGUOUS:
        if nbytes and info.offset is None:
            raise UnsafeStoreError(f"{where}: its data was never written to the file; refused, not read")
        if info.offset is not None and info.offset + nbytes > file_size:
            raise CorruptRecordError(f"{where}: its data runs past the end of the file ({file_size:,} bytes; "
                                     "truncated shard)", shard=path)
    elif info.layout == h5py.h5d.COMPACT:
        if nbytes > COMPACT_LIMIT:
            raise UnsafeStoreError(f"{where}: more than a compact dataset can hold")
    else:
        if info.filters:
            raise UnsafeStoreError(f"{where}: it is compressed or filtered; fastdata's layout stores every "
                                   "dataset uncompressed; refused, not read")
        if info.storage < nbytes:
            raise UnsafeStoreError(f"{where}: only {info.storage:,} bytes are stored (chunks never written); "
                                   "refused, not read")
        if info.storage > file_size:
            raise CorruptRecordError(f"{where}: stores {info.storage:,} bytes, more than the file's {file_size:,}",
                                     shard=path)
    return info


def rows(count: int, per: tuple[int, ...] = ()) -> Callable[[tuple[int, ...]], str | None]:
    """Shape rule: ``(count, *per)``, or flat with as many values."""
    values = count
    for d in per:
        values *= d

    def check(shape: tuple[int, ...]) -> str | None:
        if shape == (count, *per) or shape == (values,):
            return None
        return f"expected {(count, *per)} (the shard holds {count} records)"
    return check


def flat(shape: tuple[int, ...]) -> str | None:
    """Shape rule: one dimension, any length (byte arrays: their size is checked against the file)."""
    return None if len(shape) == 1 else "expected one dimension"


def scalar_attr(f: h5py.File, name: str, path: str):
    """Root attribute ``name`` if it is a scalar of a number or string type (read only then), else None."""
    try:
        if name not in f.attrs:
            return None
        aid = h5py.h5a.open(f.id, name.encode())
        if aid.shape != () or aid.dtype.kind not in "iuSOU":
            return None
        return f.attrs[name]
    except Exception as err:  # damaged metadata: libhdf5 errors surface as several types
        raise CorruptRecordError(f"{path}: shard header attribute {name!r} unreadable ({err})", shard=path) from None
