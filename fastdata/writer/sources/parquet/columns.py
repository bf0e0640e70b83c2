"""Arrow columns as fastdata fields, and an Arrow table's rows as sample values.

Each column becomes one field, its kind decided from its Arrow type and, where the input
has one, its Hugging Face ``features`` entry (the ``huggingface`` key of a Parquet file's
schema metadata, a ``datasets.Dataset``'s ``features``):

=================================================  ==========================================
column                                             field
=================================================  ==========================================
``struct<bytes: binary, path: string>`` (HF        ``image``: the bytes as they are (a null
``Image``), a binary column whose first value is   ``bytes`` with a ``path``: that file's bytes);
an image, a column named by ``image_columns``      never decoded and re-encoded
HF ``ClassLabel`` (an integer column)              class field: ``int64`` indices, names kept (a
                                                   column holding -1, "no label": ``int``)
list of HF ``ClassLabel``                          multi-label class field (ragged ``int64``)
integers, booleans                                 ``int`` of that dtype (``bool``: 0/1)
floats                                             ``float`` of that dtype (NaN kept)
strings                                            ``string``
fixed-size lists of numbers (HF ``ArrayND``)       ``ndarray`` of that shape
lists of numbers (of fixed-size lists)             ``ragged`` ``(N, *inner)``
binary (not an image), structs, maps, lists of     ``json`` (bytes kept as bytes)
anything else, a scalar column holding nulls
=================================================  ==========================================

Any other type (timestamps, decimals, ...) is refused naming the column. Column names that
are not field names (``image.png``, ``path``, which records use themselves) are renamed and
the renaming is reported.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from fastdata.errors import SourceError
from fastdata.format.fields import (JSON, RESERVED_NAMES, Field, Float, Image, Int, NDArray, Ragged, Schema, String,
                                    field_name_for)
from fastdata.writer.ingest import Rejected, read_bytes

__all__ = ["Column", "Layout", "Bad", "check_class_names", "looks_like_image", "make_layout", "plain_table",
           "row_values"]

#: the most names a ``ClassLabel`` may have (a Parquet file's metadata, a sidecar, a Dataset's features)
MAX_CLASS_NAMES = 1_000_000
#: the most bytes (UTF-8) a ``ClassLabel``'s names may hold together
MAX_CLASS_NAMES_BYTES = 8 << 20
#: features nested deeper than this are not looked into for class names
_MAX_FEATURE_DEPTH = 32

#: the first bytes of the image files a binary column is recognised by
_IMAGE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"II*\x00", b"MM\x00*", b"II+\x00",
                b"MM\x00+", b"BM")


def looks_like_image(data: bytes | None) -> bool:
    """Whether ``data`` starts like an image file (JPEG, PNG, GIF, TIFF, BMP, WebP, PPM, DICOM)."""
    if not data:
        return False
    head = bytes(data[:16])
    return (head.startswith(_IMAGE_MAGIC) or head[:4] == b"RIFF" and head[8:12] == b"WEBP"
            or re.match(rb"^P[1-6]\s", head) is not None or len(data) >= 132 and bytes(data[128:132]) == b"DICM")


@dataclass(frozen=True)
class Column:
    """How one Arrow column becomes one field."""

    #: the Arrow column's name, and the field's
    name: str
    field_name: str
    #: "image", "class", "multilabel", "int", "float", "string", "json", "ndarray", "ragged"
    role: str
    field: Field
    #: the class names of a class field
    classes: tuple[str, ...] = ()
    #: an image column's form: "struct" (bytes, path), "binary" or "path" (a string column)
    image_form: str = ""
    #: per-row shape of an array field, None for the first dimension of a ragged one
    dims: tuple[int | None, ...] = ()


@dataclass
class Layout:
    """Every column's field: what the workers need to turn rows into samples (it pickles: no handles)."""

    columns: tuple[Column, ...]
    schema: Schema
    #: class field -> names (the manifest's ``class_tables``)
    class_tables: dict[str, list[str]]
    #: remarks for the report (renamed columns, nullable columns stored as json)
    remarks: list[str] = field(default_factory=list)
    #: plain int fields of ClassLabel columns holding -1 ("no label") -> their class names
    class_names: dict[str, list[str]] = field(default_factory=dict)

    def to_json(self) -> dict:
        """What decides the stored values, for the resume fingerprint."""
        return {"schema": self.schema.to_json(), "class_tables": self.class_tables, "class_names": self.class_names,
                "columns": [[c.name, c.field_name, c.role, c.image_form] for c in self.columns]}


class Bad:
    """A value a row cannot be stored with; ``reason`` says why (the row is rejected with it)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


# --------------------------------------------------------------------------- types -> fields


def _storage(t: pa.DataType) -> pa.DataType:
    """The type the values have (an extension type's storage, a dictionary's values)."""
    while True:
        if isinstance(t, pa.ExtensionType):
            t = t.storage_type
        elif pa.types.is_dictionary(t):
            t = t.value_type
        else:
            return t


def _never(t: pa.DataType) -> bool:
    return False


def _is_string(t: pa.DataType) -> bool:
    # (the view types exist from pyarrow 16 on)
    return pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view", _never)(t)


def _is_binary(t: pa.DataType) -> bool:
    return (pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t)
            or getattr(pa.types, "is_binary_view", _never)(t))


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _numpy_dtype(t: pa.DataType) -> str:
    return np.dtype(t.to_pandas_dtype()).name


def is_image_struct(t: pa.DataType) -> bool:
    """Hugging Face's image (and audio) storage: ``struct<bytes: binary, path: string>``."""
    t = _storage(t)
    if not pa.types.is_struct(t) or {t.field(i).name for i in range(t.num_fields)} != {"bytes", "path"}:
        return False
    return _is_binary(_storage(t.field("bytes").type)) and _is_string(_storage(t.field("path").type))


def _json_able(t: pa.DataType) -> bool:
    """Whether every value of type ``t`` is msgpack-native once converted (``to_pylist``)."""
    t = _storage(t)
    if _is_number(t) or _is_string(t) or _is_binary(t) or pa.types.is_null(t):
        return True
    if _is_list(t):
        return _json_able(t.value_type)
    if pa.types.is_struct(t):
        return all(_json_able(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_map(t):
        return _is_string(_storage(t.key_type)) and _json_able(t.item_type)
    return False


def _list_dims(t: pa.DataType) -> tuple[tuple[int | None, ...], pa.DataType]:
    """``(per-level sizes, leaf type)`` of nested lists: a fixed-size list's size, None for a list's."""
    dims: list[int | None] = []
    t = _storage(t)
    while _is_list(t):
        dims.append(t.list_size if pa.types.is_fixed_size_list(t) else None)
        t = _storage(t.value_type)
    return tuple(dims), t


def _feature_type(feature: Any) -> str:
    return feature.get("_type", "") if isinstance(feature, Mapping) else ""


def _names_size(names: Any, where: str) -> None:
    if len(names) > MAX_CLASS_NAMES:
        raise SourceError(f"{where}: a ClassLabel of {len(names):,} names, more than the {MAX_CLASS_NAMES:,} allowed")
    total = 0
    for n in names:
        if isinstance(n, str):
            total += len(n.encode("utf-8", "surrogatepass"))
        elif isinstance(n, int | float) and not isinstance(n, bool):
            total += 24
        else:
            raise SourceError(f"{where}: a ClassLabel name is a {type(n).__name__}, not a string")
        if total > MAX_CLASS_NAMES_BYTES:
            raise SourceError(f"{where}: a ClassLabel whose {len(names):,} names hold more than the "
                              f"{MAX_CLASS_NAMES_BYTES:,} bytes allowed")


def check_class_names(features: Any, where: str) -> None:
    """Refuse a ``ClassLabel`` anywhere in ``features`` (a features dict, or one feature) with more than
    :data:`MAX_CLASS_NAMES` names or :data:`MAX_CLASS_NAMES_BYTES` bytes of them, or a name that is
    not a string (or number); counted before any name is copied.

    Raises:
        SourceError: naming ``where`` (the file the features come from) and the limit.
    """
    stack: list[tuple[Any, int]] = [(features, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > _MAX_FEATURE_DEPTH:
            continue
        if isinstance(value, Mapping):
            if value.get("_type") == "ClassLabel" and isinstance(value.get("names"), list | dict):
                names = value["names"]
                _names_size(list(names.values()) if isinstance(names, dict) else names, where)
                continue
            stack.extend((v, depth + 1) for v in value.values() if isinstance(v, Mapping | list))
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value if isinstance(v, Mapping | list))


def _class_names(feature: Any, where: str = "the features") -> list[str] | None:
    if _feature_type(feature) == "ClassLabel" and isinstance(feature.get("names"), list):
        _names_size(feature["names"], where)
        return [str(n) for n in feature["names"]]
    return None


def _list_item(feature: Any) -> Any:
    """The item feature of a HF ``List``/``Sequence``/``LargeList`` (older files: a one-item list), else None."""
    if isinstance(feature, list) and len(feature) == 1:
        return feature[0]
    if _feature_type(feature) in ("List", "Sequence", "LargeList"):
        return feature.get("feature")
    return None


def column_for(name: str, t: pa.DataType, feature: Any, forced_image: bool, nulls: int | None,
               first_binary: Callable[[], bytes | None], where: str) -> Column:
    """The field of column ``name`` of Arrow type ``t`` (see the module docstring); ``feature`` is its
    Hugging Face feature (or None), ``nulls`` its null count (None: unknown), ``first_binary()``
    its first non-null value (read only for a binary column that may hold images).

    Raises:
        SourceError: the column's type has no field kind, or it cannot be the image it is named as.
    """
    s = _storage(t)
    kind = _feature_type(feature)
    if forced_image or kind == "Image" or (is_image_struct(s) and kind in ("", "Image")):
        # datasets' Image(mode="L") decodes to that mode: the store's default read mode says the same
        mode = feature.get("mode") if kind == "Image" else None
        image = Image(mode if mode in ("RGB", "L", "RGBA") else None)
        if is_image_struct(s) or pa.types.is_struct(s) and "bytes" in {s.field(i).name for i in range(s.num_fields)}:
            return Column(name, name, "image", image, image_form="struct")
        if _is_binary(s):
            return Column(name, name, "image", image, image_form="binary")
        if _is_string(s):
            return Column(name, name, "image", image, image_form="path")
        raise SourceError(f"{where}: column {name!r} ({t}) cannot be an image column: an image column holds "
                          "encoded bytes (binary), a struct<bytes, path> or file paths (strings)")
    names = _class_names(feature, f"{where}: column {name!r}")
    if names is not None and pa.types.is_integer(s):
        return Column(name, name, "class", Int("int64"), classes=tuple(names))
    item_names = _class_names(_list_item(feature), f"{where}: column {name!r}")
    if item_names is not None and _is_list(s) and pa.types.is_integer(_storage(s.value_type)):
        return Column(name, name, "multilabel", Ragged("int64"), classes=tuple(item_names), dims=(None,))
    scalar = None
    if pa.types.is_boolean(s):
        scalar = Column(name, name, "int", Int("bool"))
    elif pa.types.is_integer(s):
        scalar = Column(name, name, "int", Int(_numpy_dtype(s)))
    elif pa.types.is_floating(s):
        scalar = Column(name, name, "float", Float(_numpy_dtype(s), allow_nan=True))
    elif _is_string(s):
        scalar = Column(name, name, "string", String())
    if scalar is not None:
        if nulls:  # an int/float/string field holds no null: json keeps them, and the values
            return Column(name, name, "json", JSON())
        return scalar
    if _is_binary(s):
        if kind == "" and looks_like_image(first_binary()):
            return Column(name, name, "image", Image(), image_form="binary")
        return Column(name, name, "json", JSON())
    if _is_list(s):
        dims, leaf = _list_dims(s)
        if kind.startswith("Array") and isinstance(feature.get("shape"), list | tuple):
            shape = feature["shape"]
            if len(shape) == len(dims):
                dims = tuple(None if d is None else int(d) for d in shape)
        if _is_number(leaf) and all(d is not None for d in dims[1:]):
            dtype = "bool" if pa.types.is_boolean(leaf) else _numpy_dtype(leaf)
            inner = tuple(int(d) for d in dims[1:] if d is not None)
            if dims[0] is not None:
                return Column(name, name, "ndarray", NDArray(dtype, (int(dims[0]), *inner)), dims=dims)
            return Column(name, name, "ragged", Ragged(dtype, inner), dims=dims)
    if _json_able(s):
        return Column(name, name, "json", JSON())
    raise SourceError(f"{where}: column {name!r} has Arrow type {t}, which no fastdata field holds (fields hold "
                      "integers, floats, strings, bytes, numeric arrays and JSON-like values): cast it first, "
                      "e.g. to a string")


def make_layout(schema: pa.Schema, features: Mapping[str, Any] | None, image_columns: tuple[str, ...],
                nulls: Mapping[str, int | None], first_binary: Callable[[str], bytes | None], where: str,
                minimum: Callable[[str], int | None] = lambda column: None) -> Layout:
    """The fields of every column of ``schema`` (see :func:`column_for`); ``where`` names the input in errors.

    ``minimum(column)`` is a ``ClassLabel`` column's smallest value (None: unknown). A column holding
    -1 (Hugging Face's "no label", as in a test split) is stored as a plain int field, its names
    kept in :attr:`Layout.class_names`: a class field's every sample is in one of its classes.

    Raises:
        SourceError: a column named by ``image_columns`` does not exist, or a column has no field kind.
    """
    missing = [c for c in image_columns if c not in schema.names]
    if missing:
        raise SourceError(f"{where}: no column {missing[0]!r} (image_column); the columns are "
                          f"{', '.join(schema.names)}")
    if len(set(schema.names)) != len(schema.names):
        raise SourceError(f"{where}: two columns share a name ({', '.join(schema.names)})")
    columns: list[Column] = []
    taken: set[str] = set()
    remarks: list[str] = []
    unlabelled: dict[str, list[str]] = {}
    for f in schema:
        col = column_for(f.name, f.type, (features or {}).get(f.name), f.name in image_columns,
                         nulls.get(f.name), functools.partial(first_binary, f.name), where)
        if col.role == "class" and (low := minimum(f.name)) is not None and low < 0:
            unlabelled[f.name] = list(col.classes)
            remarks.append(f"column {f.name!r} holds label {low} (no label): stored as a plain int field, not "
                           f"a class field; its {len(col.classes)} class names are in the manifest's "
                           "metadata (class_names)")
            col = Column(col.name, col.field_name, "int", col.field)
        field_name = field_name_for(f.name, taken, "column")
        taken.add(field_name)
        if field_name != f.name:
            col = Column(col.name, field_name, col.role, col.field, col.classes, col.image_form, col.dims)
            remarks.append(f"column {f.name!r} is stored as field {field_name!r} (a field name is an identifier, "
                           f"not one of {', '.join(sorted(RESERVED_NAMES))})")
        if col.role == "json" and nulls.get(f.name) and not _is_binary(_storage(f.type)) and _is_number_or_text(f.type):
            remarks.append(f"column {f.name!r} holds {nulls[f.name]} null(s): stored as a json field, which keeps "
                           "them (None)")
        columns.append(col)
    if not columns:
        raise SourceError(f"{where}: no columns")
    class_tables = {c.field_name: list(c.classes) for c in columns if c.role in ("class", "multilabel")}
    renamed = {c.name: c.field_name for c in columns}
    return Layout(tuple(columns), Schema(tuple((c.field_name, c.field) for c in columns)), class_tables, remarks,
                  {renamed[k]: v for k, v in unlabelled.items()})


def _is_number_or_text(t: pa.DataType) -> bool:
    s = _storage(t)
    return _is_number(s) or _is_string(s)


# --------------------------------------------------------------------------- rows -> values


def plain_table(table: pa.Table) -> pa.Table:
    """``table`` with extension columns (``datasets``' ``Array2D``...) as their storage, so that a
    process without the extension's package reads the same values."""
    if not any(isinstance(t, pa.ExtensionType) for t in table.schema.types):
        return table
    cols = [pa.chunked_array([c.storage for c in col.chunks], type=col.type.storage_type)
            if isinstance(col.type, pa.ExtensionType) else col for col in table.columns]
    return pa.Table.from_arrays(cols, names=table.column_names)


def _plain(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    while True:
        if isinstance(arr, pa.ExtensionArray):
            arr = arr.storage
        elif pa.types.is_dictionary(arr.type):
            arr = arr.dictionary_decode()
        else:
            return arr


class _Slow(Exception):
    """The array column needs the row-by-row path (nulls, or a list whose length is not its shape)."""


def _arrays(arr: pa.Array, dims: tuple[int | None, ...]) -> list[Any]:
    """Each row of a (nested) list column as a numpy array of per-row shape ``dims`` (None: the
    row's own length), from the flattened values at once; rows with nulls or other lengths come
    as Python lists (the field's check then names what is wrong) or :class:`Bad`."""
    n = len(arr)
    try:
        cur, first = arr, None
        for k, d in enumerate(dims):
            if cur.null_count:
                raise _Slow
            lengths = (np.full(len(cur), cur.type.list_size, dtype=np.int64) if pa.types.is_fixed_size_list(cur.type)
                       else pc.list_value_length(cur).to_numpy(zero_copy_only=False).astype(np.int64))
            if k == 0:
                first = lengths
            if d is not None and not (lengths == d).all():
                raise _Slow
            cur = cur.flatten()
        if cur.null_count or first is None:
            raise _Slow
        leaf = cur.to_numpy(zero_copy_only=False)
        inner = tuple(int(d) for d in dims[1:] if d is not None)
        ends = np.cumsum(first * math.prod(inner))
        starts = ends - first * math.prod(inner)
        return [leaf[int(a):int(b)].reshape((int(c), *inner)) for a, b, c in zip(starts, ends, first, strict=True)]
    except _Slow:
        values = arr.to_pylist()
        return [Bad("null") if v is None else v for v in values[:n]]


def _image_values(col: Column, arr: pa.Array, base_dir: str) -> tuple[list[Any], list[str | None]]:
    """``(bytes or Bad per row, image path per row)`` of an image column; a ``struct`` row with null
    bytes and a path, or a ``path`` column's row, is read from that file."""
    if col.image_form == "struct":
        kids = dict(zip([arr.type.field(i).name for i in range(arr.type.num_fields)], arr.flatten(), strict=True))
        datas = kids["bytes"].to_pylist()
        paths = kids["path"].to_pylist() if "path" in kids else [None] * len(arr)
        valid = arr.is_valid().to_pylist()
    elif col.image_form == "binary":
        datas, paths = arr.to_pylist(), [None] * len(arr)
        valid = [d is not None for d in datas]
    else:
        paths = arr.to_pylist()
        datas, valid = [None] * len(arr), [p is not None for p in paths]
    out: list[Any] = []
    for ok, data, path in zip(valid, datas, paths, strict=True):
        if not ok:
            out.append(Bad("null (no image)"))
        elif data:
            out.append(bytes(data))
        elif path and "://" in base_dir:  # (a remote file's paths would name files on the converter's disk)
            out.append(Bad(f"{path}: an image named by path in a Parquet file at a URL is not read; only image "
                           "bytes stored in the file are"))
        elif path:
            full = path if os.path.isabs(path) or not base_dir else os.path.join(base_dir, path)
            try:
                out.append(read_bytes(os.fsencode(full)))
            except Rejected as why:
                out.append(Bad(f"{full}: {why}"))
        else:
            out.append(Bad("empty image (no bytes and no path)"))
    return out, [p if isinstance(p, str) else None for p in paths]


def _class_values(col: Column, values: list[Any]) -> list[Any]:
    """Class indices checked against the names (every sample of a class field is in a class)."""
    n = len(col.classes)
    out: list[Any] = []
    for v in values:
        if isinstance(v, Bad) or v is None:
            out.append(v if isinstance(v, Bad) else Bad("null label"))
            continue
        items = np.asarray(v).reshape(-1)
        bad = [int(x) for x in items if not 0 <= int(x) < n]
        out.append(Bad(f"label {bad[0]} is not a class index (0..{n - 1})") if bad else v)
    return out


def row_values(layout: Layout, table: pa.Table, base_dir: str = "") -> tuple[list[dict | str], list[str | None]]:
    """Every row of ``table`` as ``{field: value}`` (images as their bytes), or the reason
    (``str``, naming the column) it cannot be stored; and each row's first image path (None: none).
    Values are what :meth:`Schema.check` takes; arrays are numpy arrays. A relative image path
    whose bytes are not in the table is read from ``base_dir`` (the Parquet file's folder)."""
    n = table.num_rows
    rows: list[dict | str] = [{} for _ in range(n)]
    image_paths: list[str | None] = [None] * n
    for col in layout.columns:
        arr = _plain(table.column(col.name))
        paths: list[str | None] = []
        if col.role == "image":
            values, paths = _image_values(col, arr, base_dir)
        elif col.role in ("ndarray", "ragged", "multilabel"):
            values = _arrays(arr, col.dims)
        else:
            values = arr.to_pylist()
            if col.role != "json":
                values = [Bad("null") if v is None else v for v in values]
        if col.role in ("class", "multilabel"):
            values = _class_values(col, values)
        for i, v in enumerate(values):
            row = rows[i]
            if isinstance(row, str):
                continue
            if isinstance(v, Bad):
                rows[i] = f"column {col.name!r}: {v.reason}"
            else:
                row[col.field_name] = v
                if paths and image_paths[i] is None and paths[i]:
                    image_paths[i] = paths[i]
    return rows, image_paths
