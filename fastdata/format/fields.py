"""Typed fields: the one table a store's samples are declared in.

A *schema* is an ordered list of named fields; each field has a *kind* from
:data:`KINDS`. A kind owns everything about its values: how a value given to the
writer is checked and normalised (:meth:`Field.check`), how it is stored
(:meth:`Field.encode` / :meth:`Field.decode`, msgpack-native values only, never
pickle), whether it lives in the shard *index* (fixed-size numbers, readable
without touching a record: :attr:`Field.index_shape`) or in the *record*, and how
it is described in ``docs/FORMAT.md`` (:meth:`Field.describe`). Records, index
arrays, writers, readers and ``verify`` are built from these methods, so adding a
kind is one class here decorated with :func:`register_kind`.

Kinds:

============  ==========================================  =====================
kind          value (after reading)                        stored in
============  ==========================================  =====================
``image``     encoded image bytes kept bit-exact           record (``bin``)
``int``       Python ``int`` (any numpy integer dtype)     index
``float``     Python ``float`` (float16/32/64)             index
``string``    ``str`` (UTF-8)                              record (``str``)
``ndarray``   ``numpy.ndarray`` of a fixed shape/dtype     index (<= 1 KiB) or record
``ragged``    ``numpy.ndarray`` ``(N, *inner)``, N varies  record (``[N, bin]``)
``json``      msgpack-native value (dict/list/str/...)     record (as is)
``chunked``   N-D array of any shape, read by region       compressed chunks; table in the record
============  ==========================================  =====================

Arrays are stored as their raw little-endian bytes with an explicit dtype in the
schema, so a reader in any language can decode them.
"""

from __future__ import annotations

import abc
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from fastdata.common.extensions import has_image_extension
from fastdata.common.imagemodes import IMAGE_MODES
from fastdata.errors import FastdataError, FormatError


class SchemaError(FastdataError):
    """A sample does not match the schema (wrong type, dtype, shape, missing or
    extra field), or a schema is malformed. The message names the sample and field."""


#: kind name -> Field subclass; filled by :func:`register_kind`
KINDS: dict[str, type[Field]] = {}
#: fixed-size arrays up to this many bytes per sample live in the index
INDEX_ARRAY_MAX_BYTES = 1024
#: numpy dtypes a numeric field may have (explicit little-endian on disk)
NUMERIC_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                  "float16", "float32", "float64")
#: names used by the record layout itself
RESERVED_NAMES = frozenset({"v", "path", "xxh"})


def field_name_for(text: str, taken: set[str] | frozenset[str] = frozenset(), fallback: str = "value") -> str:
    """A field name for ``text`` (a column name, a file extension): ``text`` itself when it is one
    and is free, else its characters outside ``[A-Za-z0-9_]`` as ``_`` (at most 60; ``fallback``
    when none is left; ``_`` in front of a leading digit), with ``_`` appended until it is neither
    reserved nor in ``taken``."""
    if _NAME.match(text) and text not in RESERVED_NAMES and text not in taken:
        return text
    out = re.sub(r"[^A-Za-z0-9_]", "_", text)[:60] or fallback
    if not re.match(r"^[A-Za-z_]", out):
        out = "_" + out
    while out in RESERVED_NAMES or out in taken:
        out += "_"
    return out
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
#: nesting limit for json values (hostile records cannot recurse deeply)
MAX_JSON_DEPTH = 32
#: most dimensions of an ndarray field or a ragged field's inner shape
MAX_NDIM = 32
#: most bytes of one ndarray field value, or of one row of a ragged field (a record's own limit)
MAX_ARRAY_BYTES = 1 << 30


def register_kind(cls: type[Field]) -> type[Field]:
    """Class decorator: make ``cls`` a field kind known to schemas, by ``cls.kind``."""
    if not cls.kind or cls.kind in KINDS and KINDS[cls.kind] is not cls:
        raise ValueError(f"field kind {cls.kind!r} is empty or already registered")
    KINDS[cls.kind] = cls
    return cls


def _dtype(name: Any, where: str) -> np.dtype:
    try:
        dtype = np.dtype(name)
    except TypeError:
        raise SchemaError(f"{where}: {name!r} is not a numpy dtype") from None
    if dtype.name not in NUMERIC_DTYPES:
        raise SchemaError(f"{where}: dtype {dtype.name} is not one of {', '.join(NUMERIC_DTYPES)}")
    # stored little-endian whatever the machine: compare and convert against that
    return np.dtype(dtype.name).newbyteorder("<") if dtype.itemsize > 1 else np.dtype(dtype.name)


def _shape(shape: Any, where: str, itemsize: int = 1) -> tuple[int, ...]:
    """``shape`` as a tuple of ints, refused unless every dimension is a non-negative integer,
    there are at most :data:`MAX_NDIM` and one array of it (``itemsize`` bytes per value) is at
    most :data:`MAX_ARRAY_BYTES` (Python ints: no int64 product can wrap)."""
    try:
        if isinstance(shape, str | bytes) or len(shape) > MAX_NDIM:
            raise TypeError
        if any(isinstance(s, bool | np.bool_) or not isinstance(s, int | np.integer) for s in shape):
            raise TypeError
        out = tuple(int(s) for s in shape)
    except (TypeError, ValueError):
        raise SchemaError(f"{where}: shape {shape!r:.80} is not a tuple of at most {MAX_NDIM} integers") from None
    if any(s < 0 for s in out):
        raise SchemaError(f"{where}: shape {shape!r} has a negative dimension")
    if math.prod(out) * itemsize > MAX_ARRAY_BYTES:
        raise SchemaError(f"{where}: shape {list(out)} is {math.prod(out) * itemsize:,} bytes, more than the "
                          f"{MAX_ARRAY_BYTES:,} an array may hold")
    return out


def _as_array(value: Any) -> np.ndarray | None:
    """``value`` as a numpy array when it is one (or a torch tensor), else None."""
    if isinstance(value, np.ndarray):
        return value
    if type(value).__module__.startswith("torch") and hasattr(value, "numpy"):
        return value.detach().cpu().numpy()
    return None


class Field(abc.ABC):
    """One kind of value. Subclasses set :attr:`kind` and implement the methods."""

    #: the name stored in the manifest's schema
    kind: ClassVar[str] = ""

    def params(self) -> dict:
        """Parameters stored with the kind in the manifest (JSON-serialisable)."""
        return {}

    def to_json(self) -> dict:
        return {"kind": self.kind, **self.params()}

    @property
    def index_shape(self) -> tuple[np.dtype, tuple[int, ...]] | None:
        """``(dtype, per-sample shape)`` when the field lives in the shard index, else None."""
        return None

    @abc.abstractmethod
    def check(self, value: Any, where: str) -> Any:
        """Validate a value given to the writer and return it normalised (the form
        :meth:`encode` and the index take). Raises :class:`SchemaError` naming ``where``."""

    def encode(self, value: Any) -> Any:
        """A checked value as a msgpack-native object (record-resident fields)."""
        return value

    @abc.abstractmethod
    def decode(self, obj: Any, where: str) -> Any:
        """The value from what :meth:`encode` stored (or from the index); validates
        types and lengths and raises :class:`FormatError` naming ``where``."""

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for FORMAT.md: what the stored form is."""

    @classmethod
    def example(cls) -> Field:
        """An instance to describe the kind with (FORMAT.md's table of kinds)."""
        return cls()

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.to_json() == self.to_json()

    def __hash__(self) -> int:
        return hash(repr(self))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"


@register_kind
class Image(Field):
    """An encoded image (JPEG, PNG, ...), stored bit-exact and decoded when read.

    The writer accepts bytes, a path to an image file (``str``/``os.PathLike``:
    read in a worker process), a ``PIL.Image.Image`` or an HWC ``uint8`` array
    (both encoded losslessly as PNG). What reaches :meth:`check` is always bytes:
    the writer's workers read paths and encode pixels first.
    """

    kind = "image"

    def __init__(self, mode: str | None = None):
        """Args:
            mode: the read mode datasets use for this field unless ``image_mode=`` says
                otherwise: ``"RGB"``, ``"L"``, ``"RGBA"`` or ``"unchanged"`` (the stored
                dtype and channels). None: ``"RGB"`` for a field named ``image``
                (ImageFolder parity), ``"unchanged"`` for any other image field (a mask,
                a depth map).
        """
        if mode is not None and mode not in IMAGE_MODES:
            raise SchemaError(f"image field: mode {mode!r} is not one of {', '.join(IMAGE_MODES)} (or None)")
        self.mode = mode

    def params(self) -> dict:
        return {} if self.mode is None else {"mode": self.mode}

    def default_mode(self, name: str) -> str:
        """The read mode of this field when the reader is not told one (see ``mode``)."""
        if self.mode is not None:
            return self.mode
        return "RGB" if name == "image" else "unchanged"

    def check(self, value: Any, where: str) -> bytes:
        if isinstance(value, bytearray | memoryview):
            value = bytes(value)
        if not isinstance(value, bytes):
            raise SchemaError(f"{where}: an image field needs encoded bytes, got {type(value).__name__}")
        if not value:
            raise SchemaError(f"{where}: empty image")
        return value

    def decode(self, obj: Any, where: str) -> bytes:
        if type(obj) is not bytes:
            raise FormatError(f"{where}: image field must be binary, found {type(obj).__name__}")
        return obj

    def describe(self) -> str:
        return "record: `bin`, the encoded image file bytes (bit-exact)"


class _Scalar(Field):
    python_type: ClassVar[type]
    default_dtype: ClassVar[str]

    def __init__(self, dtype: Any = None):
        self.dtype = _dtype(dtype or self.default_dtype, f"{self.kind} field")

    def params(self) -> dict:
        return {"dtype": self.dtype.name}

    @property
    def index_shape(self) -> tuple[np.dtype, tuple[int, ...]]:
        return self.dtype, ()

    def decode(self, obj: Any, where: str) -> Any:
        return self.python_type(obj)

    def describe(self) -> str:
        return f"index: one `{self.dtype.str}` per sample"


@register_kind
class Int(_Scalar):
    """An integer (class index, image id, ...), kept in the shard index."""

    kind = "int"
    python_type = int
    default_dtype = "int64"

    def __init__(self, dtype: Any = None):
        super().__init__(dtype)
        if self.dtype.kind not in "biu":
            raise SchemaError(f"int field: dtype {self.dtype.name} is not an integer type")

    def check(self, value: Any, where: str) -> int:
        if isinstance(value, bool | np.bool_):
            value = int(value)
        array = _as_array(value)
        if array is not None and array.ndim == 0:
            value = array.item()
        if not isinstance(value, int | np.integer) or isinstance(value, bool):
            raise SchemaError(f"{where}: expected an integer, got {type(value).__name__} {value!r:.40}")
        info = np.iinfo(self.dtype) if self.dtype.kind != "b" else None
        value = int(value)
        if info is not None and not info.min <= value <= info.max:
            raise SchemaError(f"{where}: {value} does not fit {self.dtype.name}")
        if info is None and value not in (0, 1):
            raise SchemaError(f"{where}: {value} is not a bool (0 or 1)")
        return value


@register_kind
class Float(_Scalar):
    """A floating-point number, kept in the shard index. NaN is allowed only with
    ``allow_nan=True`` (a NaN target is usually a bug upstream)."""

    kind = "float"
    python_type = float
    default_dtype = "float64"

    def __init__(self, dtype: Any = None, allow_nan: bool = False):
        super().__init__(dtype)
        if self.dtype.kind != "f":
            raise SchemaError(f"float field: dtype {self.dtype.name} is not a floating-point type")
        self.allow_nan = bool(allow_nan)

    def params(self) -> dict:
        return {**super().params(), "allow_nan": self.allow_nan}

    def check(self, value: Any, where: str) -> float:
        array = _as_array(value)
        if array is not None and array.ndim == 0:
            value = array.item()
        if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
            raise SchemaError(f"{where}: expected a number, got {type(value).__name__} {value!r:.40}")
        value = float(value)
        if math.isnan(value) and not self.allow_nan:
            raise SchemaError(f"{where}: NaN (declare Float(allow_nan=True) if NaN is meant)")
        return value


@register_kind
class String(Field):
    """A UTF-8 string (caption, file name, ...), kept in the record."""

    kind = "string"
    max_bytes = 1 << 20

    def check(self, value: Any, where: str) -> str:
        if not isinstance(value, str):
            raise SchemaError(f"{where}: expected a str, got {type(value).__name__}")
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError as err:
            raise SchemaError(f"{where}: not encodable as UTF-8 ({err.reason})") from None
        if size > self.max_bytes:
            raise SchemaError(f"{where}: string of {size} bytes exceeds {self.max_bytes}")
        return value

    def decode(self, obj: Any, where: str) -> str:
        if type(obj) is not str:
            raise FormatError(f"{where}: string field must be a msgpack str, found {type(obj).__name__}")
        return obj

    def describe(self) -> str:
        return "record: msgpack `str` (UTF-8)"


def _array_check(value: Any, dtype: np.dtype, where: str) -> np.ndarray:
    array = _as_array(value)
    if array is None:
        if isinstance(value, list | tuple):
            try:
                array = np.asarray(value)
            except ValueError:
                raise SchemaError(f"{where}: a list that is not a rectangular array") from None
        else:
            raise SchemaError(f"{where}: expected an array, got {type(value).__name__}")
    if array.dtype == object or array.dtype.kind not in "biuf":
        raise SchemaError(f"{where}: array of dtype {array.dtype} is not numeric")
    if array.size and array.dtype != dtype:
        cast = array.astype(dtype)
        lossless = bool(np.array_equal(cast.astype(array.dtype), array, equal_nan=array.dtype.kind == "f"))
        if not lossless:
            raise SchemaError(f"{where}: values of dtype {array.dtype} do not fit {dtype.name} exactly")
        array = cast
    return np.ascontiguousarray(array, dtype=dtype)


@register_kind
class NDArray(Field):
    """A numeric array of one fixed shape and dtype (an embedding, a fixed-size
    mask, ...). Up to :data:`INDEX_ARRAY_MAX_BYTES` per sample it lives in the
    shard index; larger ones in the record as raw little-endian bytes."""

    kind = "ndarray"

    def __init__(self, dtype: Any, shape: Iterable[int]):
        self.dtype = _dtype(dtype, "ndarray field")
        self.shape = _shape(shape, "ndarray field", self.dtype.itemsize)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize

    @classmethod
    def example(cls) -> Field:
        return cls("float32", (4,))

    def params(self) -> dict:
        return {"dtype": self.dtype.name, "shape": list(self.shape)}

    @property
    def index_shape(self) -> tuple[np.dtype, tuple[int, ...]] | None:
        return (self.dtype, self.shape) if self.nbytes <= INDEX_ARRAY_MAX_BYTES else None

    def check(self, value: Any, where: str) -> np.ndarray:
        array = _array_check(value, self.dtype, where)
        if array.shape != self.shape:
            raise SchemaError(f"{where}: shape {array.shape} is not the schema's {self.shape} "
                              "(declare Ragged(dtype, inner_shape) if the first dimension varies)")
        return array

    def encode(self, value: np.ndarray) -> bytes:
        return value.tobytes()

    def decode(self, obj: Any, where: str) -> np.ndarray:
        if isinstance(obj, np.ndarray):  # from the index
            return obj
        if type(obj) is not bytes or len(obj) != self.nbytes:
            raise FormatError(f"{where}: ndarray field must be {self.nbytes} bytes")
        return np.frombuffer(obj, dtype=self.dtype).reshape(self.shape)

    def describe(self) -> str:
        where = "index" if self.index_shape else "record: `bin`,"
        return f"{where} `{self.dtype.str}` array of shape {list(self.shape)} (C order)"


@register_kind
class Ragged(Field):
    """A numeric array ``(N, *inner_shape)`` whose first dimension varies from
    sample to sample: boxes ``float32 (N, 4)``, labels ``int64 (N,)``, polygon
    coordinates ``float64 (N, 2)``. Stored in the record as ``[N, bin]``."""

    kind = "ragged"
    max_bytes = 1 << 28

    def __init__(self, dtype: Any, inner_shape: Iterable[int] = ()):
        self.dtype = _dtype(dtype, "ragged field")
        self.inner_shape = _shape(inner_shape, "ragged field", self.dtype.itemsize)
        self.row_bytes = math.prod(self.inner_shape) * self.dtype.itemsize

    @classmethod
    def example(cls) -> Field:
        return cls("float32", (4,))

    def params(self) -> dict:
        return {"dtype": self.dtype.name, "inner_shape": list(self.inner_shape)}

    def check(self, value: Any, where: str) -> np.ndarray:
        array = _as_array(value)
        if array is None and isinstance(value, list | tuple) and len(value) == 0:
            array = np.zeros((0, *self.inner_shape), dtype=self.dtype)
        array = _array_check(value if array is None else array, self.dtype, where)
        if array.size == 0 and array.ndim == 1:
            array = array.reshape((0, *self.inner_shape))
        if array.ndim == 0 or array.shape[1:] != self.inner_shape:
            raise SchemaError(f"{where}: shape {array.shape} is not (N, *{self.inner_shape})")
        if array.nbytes > self.max_bytes:
            raise SchemaError(f"{where}: {array.nbytes} bytes exceeds {self.max_bytes}")
        return array

    def encode(self, value: np.ndarray) -> list:
        return [int(value.shape[0]), value.tobytes()]

    def decode(self, obj: Any, where: str) -> np.ndarray:
        if (type(obj) is not tuple and type(obj) is not list) or len(obj) != 2:
            raise FormatError(f"{where}: ragged field must be [count, bytes]")
        count, data = obj
        if type(count) is not int or count < 0 or type(data) is not bytes or len(data) != count * self.row_bytes:
            raise FormatError(f"{where}: ragged field holds {len(data) if isinstance(data, bytes) else '?'} "
                              f"bytes, not {count} rows of {self.row_bytes}")
        return np.frombuffer(data, dtype=self.dtype).reshape((count, *self.inner_shape))

    def describe(self) -> str:
        return (f"record: `[N, bin]`, N rows of `{self.dtype.str}` with inner shape {list(self.inner_shape)} "
                "(C order)")


def _check_text(text: str, where: str) -> None:
    """Refuse a str that is not valid Unicode (a lone surrogate such as ``"\\udc80"``, which
    JSON escapes allow): msgpack stores strings as UTF-8, which cannot hold it."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise SchemaError(f"{where}: string {text[max(0, err.start - 20):err.end + 20]!r} is not valid "
                              f"Unicode ({err.reason} at position {err.start}); fix the text in the "
                              "input (e.g. the annotation file)") from None


def _check_json(value: Any, where: str, depth: int = 0) -> Any:
    if depth > MAX_JSON_DEPTH:
        raise SchemaError(f"{where}: nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, str):
        _check_text(value, where)
        return value
    if value is None or isinstance(value, bool | bytes):
        return value
    if isinstance(value, int | np.integer):
        value = int(value)
        if not -(1 << 63) <= value < (1 << 64):
            raise SchemaError(f"{where}: integer {value} does not fit 64 bits")
        return value
    if isinstance(value, float | np.floating):
        return float(value)
    if isinstance(value, list | tuple):
        return [_check_json(v, where, depth + 1) for v in value]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise SchemaError(f"{where}: mapping key {k!r} is not a str")
            _check_text(k, f"{where} (a key)")
            out[k] = _check_json(v, f"{where}.{k}", depth + 1)
        return out
    raise SchemaError(f"{where}: {type(value).__name__} is not msgpack-native "
                      "(None, bool, int, float, str, bytes, list, dict with str keys)")


_CONTAINERS = (list, tuple, dict)


def _thaw(obj: Any, where: str, depth: int = 0) -> Any:
    """A stored json value as the writer gave it: lists (tuples, from an unpacker run
    with ``use_list=False``, become lists), nested at most :data:`MAX_JSON_DEPTH` deep.

    Lists and dicts are fixed in place (records are unpacked with ``use_list=True``, so
    usually nothing is rebuilt: only the depth is checked)."""
    if depth > MAX_JSON_DEPTH:
        raise FormatError(f"{where}: json value nested deeper than {MAX_JSON_DEPTH} levels")
    kind = type(obj)
    if kind is tuple:
        return [_thaw(v, where, depth + 1) for v in obj]
    if kind is list:
        for i, v in enumerate(obj):
            if type(v) in _CONTAINERS:
                obj[i] = _thaw(v, where, depth + 1)
    elif kind is dict:
        for k, v in obj.items():
            if type(v) in _CONTAINERS:
                obj[k] = _thaw(v, where, depth + 1)
    return obj


@register_kind
class JSON(Field):
    """Any msgpack-native value: None, bool, int, float, str, bytes, and lists and
    str-keyed dicts of these (COCO annotations, multi-label lists, attributes)."""

    kind = "json"

    def check(self, value: Any, where: str) -> Any:
        return _check_json(value, where)

    def decode(self, obj: Any, where: str) -> Any:
        return _thaw(obj, where)

    def describe(self) -> str:
        return "record: the msgpack value itself (no extension types)"


def _is_array_like(value: Any) -> bool:
    return all(hasattr(value, attr) for attr in ("shape", "dtype", "__getitem__"))


@register_kind
class Chunked(Field):
    """An N-D numeric array per sample, of any shape (it may differ from sample to sample),
    stored as independently compressed chunks so that a region is read by decoding only
    the chunks it touches: CT/MRI volumes, whole-slide and satellite images.

    The writer takes a numpy array or any array-like with ``shape``, ``dtype`` and slicing
    (``np.memmap``, an h5py dataset, a zarr array, ``tifffile.imread(path, aszarr=True)``,
    nibabel's ``dataobj``) and reads it chunk by chunk: the whole value is never in memory.
    Readers return a lazy array (:class:`fastdata.reader.chunked.ChunkedArray`).

    Chunk layout and codecs: :mod:`fastdata.format.chunks`, :mod:`fastdata.format.chunk_codecs`.
    """

    kind = "chunked"

    def __init__(self, dtype: Any, chunks: Iterable[int], codec: str | None = "blosc-lz4", level: int | None = None):
        """Args:
            dtype: the stored numpy dtype (values of another dtype are cast when exactly
                representable, else refused).
            chunks: the chunk shape, one positive side per axis; its length is the values'
                number of axes (e.g. ``(64, 64, 64)`` for volumes, ``(512, 512, 3)`` for RGB slides).
            codec: a name from :data:`fastdata.format.chunk_codecs.CHUNK_CODECS` (the default,
                ``"blosc-lz4"``, is :data:`~fastdata.format.chunk_codecs.DEFAULT_CODEC`; ``"blosc-zstd"``
                stores smaller and decodes at about half the speed); ``None`` or
                ``"raw"`` for uncompressed chunks.
            level: the codec's compression level (None: its default).
        """
        from fastdata.format.chunks import MAX_CHUNK_BYTES
        from fastdata.format.chunk_codecs import chunk_codec

        self.dtype = _dtype(dtype, "chunked field")
        try:
            if isinstance(chunks, str | bytes) or not 1 <= len(tuple(chunks)) <= MAX_NDIM:
                raise TypeError
            sides = tuple(chunks)
            if any(isinstance(c, bool | np.bool_) or not isinstance(c, int | np.integer) for c in sides):
                raise TypeError
        except TypeError:
            raise SchemaError(f"chunked field: chunks {chunks!r:.80} is not a tuple of 1 to {MAX_NDIM} integers") \
                from None
        self.chunks = tuple(int(c) for c in sides)
        if any(c <= 0 for c in self.chunks):
            raise SchemaError(f"chunked field: chunk shape {list(self.chunks)} has a side that is not positive; "
                              "every side of a chunk must be at least 1")
        chunk_bytes = math.prod(self.chunks) * self.dtype.itemsize
        if chunk_bytes > MAX_CHUNK_BYTES:
            raise SchemaError(f"chunked field: a chunk of {list(self.chunks)} {self.dtype.name} is {chunk_bytes:,} "
                              f"bytes, more than the {MAX_CHUNK_BYTES:,} a chunk may hold: use smaller chunks")
        try:
            self.codec = chunk_codec(codec).name
            self.level = chunk_codec(self.codec).check_level(level, "chunked field")
        except ValueError as err:
            raise SchemaError(str(err)) from None

    @classmethod
    def example(cls) -> Field:
        return cls("uint16", (64, 64, 64))

    @property
    def ndim(self) -> int:
        return len(self.chunks)

    def params(self) -> dict:
        return {"dtype": self.dtype.name, "chunks": list(self.chunks), "codec": self.codec, "level": self.level}

    def check(self, value: Any, where: str) -> Any:
        """The array-like itself (not read here: the writer reads it chunk by chunk),
        after checking its number of axes and dtype."""
        array = _as_array(value)
        if array is not None:
            value = array
        elif isinstance(value, list | tuple):
            value = _array_check(value, self.dtype, where)
        if not _is_array_like(value):
            raise SchemaError(f"{where}: a chunked field takes a numpy array or an array-like with shape, dtype "
                              f"and slicing, got {type(value).__name__}")
        try:
            shape = tuple(int(s) for s in value.shape)
            dtype = np.dtype(value.dtype)
        except (TypeError, ValueError):
            raise SchemaError(f"{where}: the array-like's shape or dtype is not a numpy shape/dtype") from None
        if len(shape) != self.ndim or any(s < 0 for s in shape):
            raise SchemaError(f"{where}: shape {list(shape)} does not have the {self.ndim} axes of the field's "
                              f"chunks {list(self.chunks)}")
        if dtype.kind not in "biuf":
            raise SchemaError(f"{where}: array of dtype {dtype} is not numeric")
        return value

    def decode(self, obj: Any, where: str) -> bytes:
        if type(obj) is not bytes:
            raise FormatError(f"{where}: a chunked field's record value must be its binary chunk table")
        return obj

    def encode(self, value: Any) -> bytes:
        from fastdata.format.chunks import ChunkTable

        if not isinstance(value, ChunkTable):
            raise TypeError("a chunked field is encoded from the ChunkTable its chunks were written with")
        return value.to_bytes()

    def describe(self) -> str:
        return (f"`{self.dtype.str}` chunks of {list(self.chunks)}, codec `{self.codec}`: record `bin` chunk table; "
                "index `.shape`, `.first`")


def field_from_json(obj: Any, where: str) -> Field:
    """The field a manifest's schema entry describes."""
    if not isinstance(obj, Mapping) or not isinstance(obj.get("kind"), str):
        raise FormatError(f"{where}: a schema field needs a 'kind'")
    cls = KINDS.get(obj["kind"])
    if cls is None:
        raise FormatError(f"{where}: field kind {obj['kind']!r} is unknown to this fastdata version "
                          f"(known: {', '.join(KINDS)}); upgrade fastdata")
    params = {k: v for k, v in obj.items() if k not in ("kind", "name")}
    try:
        return cls(**params)
    except (TypeError, SchemaError) as err:
        raise FormatError(f"{where}: bad parameters for a {obj['kind']} field ({err})") from None


def infer_field(value: Any, where: str) -> Field:
    """The kind a value most likely needs (declare a schema when this guesses wrong).

    bytes, PIL images, ``os.PathLike`` paths and ``str`` paths of existing files with an
    image extension (``.jpg``, ``.png``, ...) are images; Python/numpy integers
    and bools ``int``; floats ``float``; ``str`` ``string``; arrays, tensors and
    lists of numbers ``ragged`` along their first axis (declare ``NDArray`` for a
    fixed shape); anything else msgpack-native ``json``.
    """
    if isinstance(value, bytes | bytearray | memoryview | os.PathLike):
        return Image()
    if type(value).__module__.startswith("PIL.") and hasattr(value, "save"):
        return Image()
    if isinstance(value, bool | np.bool_):
        return Int("bool")
    if isinstance(value, int | np.integer):
        return Int()
    if isinstance(value, float | np.floating):
        return Float(allow_nan=isinstance(value, float) and math.isnan(value))
    if isinstance(value, str):  # a path to an image file is how an image is given; text never names one
        return Image() if has_image_extension(value) and os.path.isfile(value) else String()
    array = _as_array(value)
    if array is None and isinstance(value, list | tuple) and value and all(
            isinstance(v, int | float | np.number) and not isinstance(v, bool) or isinstance(v, list | tuple)
            for v in value):
        try:
            array = np.asarray(value)
        except ValueError:
            array = None
        if array is not None and array.dtype.kind not in "iuf":
            array = None
        if array is not None and array.dtype.kind == "i":
            array = array.astype(np.int64)
    if array is not None:
        if array.ndim == 0:
            return infer_field(array.item(), where)
        if array.dtype.kind not in "biuf":
            raise SchemaError(f"{where}: cannot store an array of dtype {array.dtype}")
        return Ragged(array.dtype.name, array.shape[1:])
    _check_json(value, where)
    return JSON()


@dataclass(frozen=True)
class Schema:
    """The ordered fields of every sample of a store."""

    fields: tuple[tuple[str, Field], ...]

    def __post_init__(self) -> None:
        seen = set()
        for name, field in self.fields:
            if not isinstance(name, str) or not _NAME.match(name) or name in RESERVED_NAMES:
                raise SchemaError(f"field name {name!r} must be an identifier of at most 64 characters, "
                                  f"not one of {sorted(RESERVED_NAMES)}")
            if name in seen:
                raise SchemaError(f"field {name!r} is declared twice")
            if not isinstance(field, Field):
                raise SchemaError(f"field {name!r}: {field!r} is not a fastdata.fields.Field")
            seen.add(name)
        if not self.fields:
            raise SchemaError("a schema needs at least one field")

    @classmethod
    def of(cls, fields: Mapping[str, Field] | Schema) -> Schema:
        """A schema from a ``{name: Field}`` mapping (kept in its order)."""
        return fields if isinstance(fields, Schema) else cls(tuple(fields.items()))

    @classmethod
    def infer(cls, sample: Mapping[str, Any], where: str = "sample 0") -> Schema:
        """The schema of ``sample`` by :func:`infer_field` on each value."""
        if not isinstance(sample, Mapping):
            raise SchemaError(f"{where}: samples must be dicts of field name -> value, got {type(sample).__name__}")
        return cls(tuple((str(k), infer_field(v, f"{where} field {k!r}")) for k, v in sample.items()))

    @classmethod
    def from_json(cls, obj: Any, where: str = "schema") -> Schema:
        if not isinstance(obj, list):
            raise FormatError(f"{where}: must be a list of fields")
        out = []
        for i, entry in enumerate(obj):
            if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
                raise FormatError(f"{where}[{i}]: a field needs a 'name'")
            out.append((entry["name"], field_from_json(entry, f"{where} field {entry['name']!r}")))
        try:
            return cls(tuple(out))
        except SchemaError as err:
            raise FormatError(f"{where}: {err}") from None

    def to_json(self) -> list[dict]:
        return [{"name": name, **field.to_json()} for name, field in self.fields]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.fields)

    def __getitem__(self, name: str) -> Field:
        for key, field in self.fields:
            if key == name:
                return field
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return any(key == name for key, _ in self.fields)

    def __iter__(self):
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)

    def image_fields(self) -> tuple[str, ...]:
        return tuple(name for name, f in self.fields if isinstance(f, Image))

    def chunked_fields(self) -> tuple[str, ...]:
        return tuple(name for name, f in self.fields if isinstance(f, Chunked))

    def index_fields(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """``{name: (dtype, per-sample shape)}`` of the fields kept in the shard index."""
        return {name: shape for name, f in self.fields if (shape := f.index_shape) is not None}

    def record_fields(self) -> tuple[str, ...]:
        return tuple(name for name, f in self.fields if f.index_shape is None)

    def check(self, sample: Any, where: str) -> dict[str, Any]:
        """``sample`` validated and normalised field by field (see :meth:`Field.check`).

        Raises :class:`SchemaError` naming ``where`` (e.g. ``"sample 17"``) and the
        field for a missing or extra key, or a value its field refuses.
        """
        if not isinstance(sample, Mapping):
            raise SchemaError(f"{where}: expected a dict of field name -> value, got {type(sample).__name__}")
        missing = [name for name in self.names if name not in sample]
        extra = [str(k) for k in sample if k not in self]
        if missing or extra:
            parts = ([f"missing {', '.join(map(repr, missing))}"] if missing else []) + (
                [f"not in the schema: {', '.join(map(repr, extra))}"] if extra else [])
            raise SchemaError(f"{where}: {'; '.join(parts)} (schema fields: {', '.join(self.names)})")
        return {name: field.check(sample[name], f"{where} field {name!r}") for name, field in self.fields}

    def describe_markdown(self) -> str:
        """The schema as a Markdown table (``fastdata info``, FORMAT.md examples)."""
        rows = ["| field | kind | stored as |", "|---|---|---|"]
        rows += [f"| `{name}` | {field.kind} | {field.describe()} |" for name, field in self.fields]
        return "\n".join(rows)


def kinds_markdown() -> str:
    """The table of field kinds FORMAT.md shows (generated from :data:`KINDS`)."""
    rows = ["| kind | parameters | stored as (example) |", "|---|---|---|"]
    for kind, cls in KINDS.items():
        example = cls.example()
        rows.append(f"| `{kind}` | {', '.join(example.params()) or '-'} | {example.describe()} |")
    return "\n".join(rows)


#: the schema of every version-1 (image-classification) store
CLASSIFICATION = Schema((("image", Image()), ("label", Int())))
