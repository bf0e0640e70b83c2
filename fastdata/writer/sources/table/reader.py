"""JSONL and CSV/TSV list files with any fields, parsed into typed numpy columns.

A *list file* names one image per row plus any other values of that sample:

- **JSONL** (``.jsonl``/``.ndjson``): one JSON object per line, ``{"path": "a.jpg",
  "boxes": [[1, 2, 3, 4]], "caption": "a cat", "label": "cat"}``.
- **CSV/TSV** (``.csv``/``.tsv``): a header row naming the columns, one of them
  ``path`` (any case); every other column is a field. A file of exactly two columns
  without a header is read as today's ``path,label`` list.

``path`` (relative to the list file's folder, or absolute) becomes the image field
``image``; every other key or column becomes a field of the same name, in the
file's order (JSONL: the order keys are first seen). Names must be identifiers.

Field kinds, when not declared (see :func:`parse_schema` to declare them):

===================================  ==============================================
value in every row                   field
===================================  ==============================================
JSON ``true``/``false``              ``Int("bool")``
integers (CSV: ``-?[0-9]+``)          ``Int("int64")``
numbers, some not integers           ``Float("float64")`` (NaN allowed if one is seen)
strings (CSV: anything else)         ``String()``
JSON lists of numbers / of lists     ``Ragged(int64 or float64, inner shape)``:
of numbers, one inner shape          ``[]`` fits any inner shape
anything else (objects, mixed)       ``JSON()`` (JSON ``null`` is then a value)
===================================  ==============================================

CSV cells are only inferred as int, float or string; declare ``ragged``,
``ndarray`` or ``json`` to read a cell as JSON text (``"[[1, 2, 3, 4]]"``).
Cells are stripped of surrounding spaces.

**Class fields.** A key or column named ``label`` or ``labels`` (any case) is a
class field, as are fields declared ``class`` or ``multilabel``. Its values are
class names or non-negative integers, read as text (``7`` and ``"7"`` are the same
label). The rule of :func:`fastdata.writer.sources.folder.scan_list` makes the class table: when
every label of the field is a non-negative integer, the label *is* the index and
the classes are ``"0"`` .. ``str(max)``; otherwise the classes are the sorted
unique names, as ImageFolder sorts folder names. The table is
``TableSource.class_tables[name]`` (``TableSource.classes`` for ``label``), for
the manifest's ``classes``.

- single-label: ``Int("int64")``, the class index;
- multi-label (a JSON list per row, or a CSV cell with ``|`` between labels, e.g.
  ``cat|dog``; declared ``multilabel``): ``Ragged("int64")``, the class indices in
  the order written. A JSON ``[]`` or an empty declared default means no label.

**Missing values.** A key missing from a JSONL object, a JSON ``null`` (except in a
``json`` field) or an empty CSV cell is a bad row, unless the field declares a
default. Every bad row is reported at once (up to 20, with line numbers) in one
:class:`~fastdata.errors.SourceError`; image files that do not exist are not an
error here but listed in ``TableSource.problems`` (the writer rejects them as it
rejects unreadable images, ``--strict`` stopping).

**Memory.** The file is read twice (once to infer kinds and class tables, once to
store values), one row at a time; values are kept as numpy columns (numbers), or
packed bytes plus offsets (paths, strings, arrays, msgpack for json), never one
Python object per row.
"""

from __future__ import annotations

import json
import math
import os
import re
from array import array
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

import msgpack
import numpy as np

from fastdata.errors import SourceError
from fastdata.format.fields import (
    JSON,
    Field,
    Float,
    Image,
    Int,
    NDArray,
    Ragged,
    Schema,
    SchemaError,
    String,
    field_from_json,
)
from fastdata.writer.sources.folder import MAX_INTEGER_LABEL, MAX_ROW_ERRORS

__all__ = ["TableSource", "PackedBytes", "Declared", "scan_table", "parse_schema", "is_table_list",
           "JSONL_SUFFIXES", "LABEL_SEPARATOR"]

JSONL_SUFFIXES = (".jsonl", ".ndjson")
CSV_SUFFIXES = (".csv", ".tsv")
#: separates the labels of one multi-label CSV cell
LABEL_SEPARATOR = "|"
#: names (compared lower-case) that make an undeclared column a class field
CLASS_NAMES = frozenset({"label", "labels"})
#: the list's path column/key; it becomes the image field :data:`IMAGE_FIELD`
PATH_KEY = "path"
IMAGE_FIELD = "image"
#: declared kinds that are class fields (the stored field is Int / Ragged int64 of class indices)
CLASS_KINDS = ("class", "multilabel")
_INT_TEXT = re.compile(r"^[+-]?[0-9]+$")
_FLOAT_TEXT = re.compile(r"^[+-]?([0-9]+\.?[0-9]*([eE][+-]?[0-9]+)?|\.[0-9]+([eE][+-]?[0-9]+)?|nan|inf|infinity)$",
                         re.IGNORECASE)
_MISSING = object()
#: a JSON list nested deeper than this is a json value, not an array (numpy's own limit is 64)
MAX_ARRAY_DIMS = 32


# --------------------------------------------------------------------------- declared schema


@dataclass(frozen=True)
class Declared:
    """A field declared with ``--schema``: its kind (a :class:`~fastdata.format.fields.Field`,
    or ``"class"``/``"multilabel"``) and an optional default for missing values
    (a JSON-like value, as a JSONL row would hold it)."""

    kind: Field | str
    default: Any = _MISSING

    @property
    def has_default(self) -> bool:
        return self.default is not _MISSING


_DTYPE_KINDS = {**{d: Int for d in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                                    "uint64")},
                **{d: Float for d in ("float16", "float32", "float64")}}
_SPEC_KIND = re.compile(r"^([a-z0-9_]+)(?:\[([^\]]*)\])?$")
SPEC_GRAMMAR = """\
spec    := field ("," field)*
field   := NAME ":" kind ["=" default]
kind    := image | string | json | class | multilabel
         | int ["[" dtype "]"] | float ["[" dtype "]"] | dtype
         | ndarray "[" dtype ("," dim)+ "]" | ragged "[" dtype ("," dim)* "]"
dtype   := bool | int8 | int16 | int32 | int64 | uint8 | uint16 | uint32 | uint64 | float16 | float32 | float64
default := text up to the next top-level comma, written as a CSV cell of that kind
           (numbers as text, arrays and json as JSON, multilabel as a|b; empty: no label)
example: boxes:ragged[float32,4],score:float32=0,caption:string,label:multilabel"""


def _kind_from_text(text: str, where: str) -> Field | str:
    """The kind an inline spec names (grammar: :data:`SPEC_GRAMMAR`)."""
    match = _SPEC_KIND.match(text.strip().lower())
    if not match:
        raise SchemaError(f"{where}: cannot read kind {text!r}; expected e.g. int, float32, string, json, class, "
                          "multilabel, image, ragged[float32,4], ndarray[uint8,3,3]")
    name, args_text = match.group(1), match.group(2)
    args = [a.strip() for a in args_text.split(",")] if args_text else []
    simple: dict[str, Callable[[], Field | str]] = {
        "image": Image, "string": String, "json": JSON, "class": lambda: "class", "multilabel": lambda: "multilabel"}
    if name in simple and not args:
        return simple[name]()
    if name in ("int", "float") and len(args) <= 1:
        return (Int if name == "int" else Float)(args[0] if args else None)
    if name in _DTYPE_KINDS and not args:
        return _DTYPE_KINDS[name](name)
    if name in ("ragged", "ndarray") and args and (name == "ragged" or len(args) >= 2):
        try:
            dims = [int(a) for a in args[1:]]
        except ValueError:
            raise SchemaError(f"{where}: dimensions of {text!r} must be integers") from None
        return Ragged(args[0], dims) if name == "ragged" else NDArray(args[0], dims)
    raise SchemaError(f"{where}: unknown or malformed kind {text!r}; the grammar is:\n{SPEC_GRAMMAR}")


def _split_top_level(spec: str) -> list[str]:
    """``spec`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(spec[start:i])
            start = i + 1
    parts.append(spec[start:])
    return [p for p in parts if p.strip()]


def _parse_inline(spec: str) -> dict[str, Declared]:
    out: dict[str, Declared] = {}
    for item in _split_top_level(spec):
        name, colon, rest = item.partition(":")
        name = name.strip()
        where = f"--schema field {name!r}"
        if not colon or not name:
            raise SchemaError(f"--schema: {item.strip()!r} is not NAME:KIND; the grammar is:\n{SPEC_GRAMMAR}")
        kind_text, eq, default_text = rest.partition("=")
        kind = _kind_from_text(kind_text, where)
        default = _MISSING
        if eq:
            default = _default_from_text(default_text.strip(), kind, where)
        _add_declared(out, name, Declared(kind, default))
    return out


def _default_from_text(text: str, kind: Field | str, where: str) -> Any:
    if kind == "multilabel" and text == "":
        return []
    if text == "" and not isinstance(kind, String):
        raise SchemaError(f"{where}: empty default (only string and multilabel fields take an empty default)")
    try:
        return _cell_value(text, kind)
    except _CellError as err:
        raise SchemaError(f"{where}: default {err}") from None


def _add_declared(out: dict[str, Declared], name: str, declared: Declared) -> None:
    if name in out:
        raise SchemaError(f"--schema: field {name!r} is declared twice")
    out[name] = declared


def _parse_json_schema(obj: Any, where: str) -> dict[str, Declared]:
    """A JSON schema: a list of ``{"name", "kind", ...parameters, "default"?}`` (the
    manifest's form, plus the kinds ``class``/``multilabel``), or a mapping of name
    to an inline kind (``{"boxes": "ragged[float32,4]"}``) or to such an object."""
    entries: list[tuple[str, Any]]
    if isinstance(obj, Mapping):
        entries = [(str(k), v) for k, v in obj.items()]
    elif isinstance(obj, list):
        if not all(isinstance(e, Mapping) and isinstance(e.get("name"), str) for e in obj):
            raise SchemaError(f"{where}: every entry of a schema list needs a 'name'")
        entries = [(e["name"], {k: v for k, v in e.items() if k != "name"}) for e in obj]
    else:
        raise SchemaError(f"{where}: a schema is a JSON list of fields or an object of name: kind")
    out: dict[str, Declared] = {}
    for name, entry in entries:
        field_where = f"{where} field {name!r}"
        if isinstance(entry, str):
            kind_text, eq, default_text = entry.partition("=")
            kind = _kind_from_text(kind_text, field_where)
            _add_declared(out, name, Declared(kind, _default_from_text(default_text.strip(), kind, field_where)
                                              if eq else _MISSING))
            continue
        if not isinstance(entry, Mapping) or not isinstance(entry.get("kind"), str):
            raise SchemaError(f"{field_where}: needs a 'kind'")
        params = {k: v for k, v in entry.items() if k != "default"}
        kind_obj: Field | str
        if params["kind"] in CLASS_KINDS:
            if len(params) > 1:
                raise SchemaError(f"{field_where}: a {params['kind']} field takes no parameters")
            kind_obj = params["kind"]
        else:
            try:
                kind_obj = field_from_json(params, field_where)
            except Exception as err:  # FormatError from the manifest reader: same message, schema's type
                raise SchemaError(str(err)) from None
        _add_declared(out, name, Declared(kind_obj, entry.get("default", _MISSING)))
    return out


def parse_schema(spec: str | os.PathLike | Mapping | list | None) -> dict[str, Declared]:
    """Declared fields from ``--schema``: an inline spec (grammar:
    :data:`SPEC_GRAMMAR`), the path of a JSON file (``*.json``, or any existing
    file), or an already loaded JSON value. Fields not declared are inferred.

    Returns:
        dict[str, Declared]: field name -> declaration, in the spec's order.

    Raises:
        SchemaError: the spec is malformed (names the field and shows the grammar).
        SourceError: the JSON file is missing or not JSON.
    """
    if spec is None:
        return {}
    if isinstance(spec, Mapping | list):
        return _parse_json_schema(spec, "--schema")
    text = os.fspath(spec)
    if text.lower().endswith(".json") or os.path.isfile(text):
        try:
            with open(text, encoding="utf-8") as fh:
                obj = json.load(fh)
        except FileNotFoundError:
            raise SourceError(f"--schema file not found: {text}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise SourceError(f"--schema file {text} is not JSON: {err}") from None
        return _parse_json_schema(obj, text)
    return _parse_inline(text)


# --------------------------------------------------------------------------- cell and value conversion


class _CellError(ValueError):
    """A value that its field cannot take; the message names no line (the caller adds it)."""


def _cell_value(text: str, kind: Field | str) -> Any:
    """A CSV cell (or an inline default) as the JSON-like value its kind takes."""
    return _cell_parser(kind)(text)


def _cell_parser(kind: Field | str) -> Callable[[str], Any]:
    """``cell text -> JSON-like value`` for one kind (chosen once per column)."""
    if kind == "multilabel":
        return lambda text: [t.strip() for t in text.split(LABEL_SEPARATOR) if t.strip()]
    if isinstance(kind, Int | Float):
        pattern, convert = (_INT_TEXT, int) if isinstance(kind, Int) else (_FLOAT_TEXT, float)
        what = "an integer" if isinstance(kind, Int) else "a number"
        dtype = kind.dtype.name

        def number(text: str) -> Any:
            if not pattern.match(text):
                raise _CellError(f"{text!r:.60} is not {what} ({dtype})")
            return convert(text)

        return number
    if isinstance(kind, Ragged | NDArray | JSON):
        name = kind.kind

        def json_text(text: str) -> Any:
            try:
                return json.loads(text)
            except json.JSONDecodeError as err:
                raise _CellError(f"{text!r:.60} is not JSON ({err.msg}); a {name} cell holds JSON text such "
                                 "as [[1, 2, 3, 4]]") from None
            except RecursionError:
                raise _CellError("JSON nested too deeply to read") from None

        return json_text
    return _same  # string, image path, class name


def _same(text: str) -> str:
    return text


def _label_texts(value: Any, multi: bool) -> list[str]:
    """The labels of one class value as text (``7`` and ``"7"`` are one label)."""
    items = value if isinstance(value, list) else [value]
    if isinstance(value, list) and not multi:
        raise _CellError("a list in a single-label field (declare it multilabel)")
    out = []
    for item in items:
        if isinstance(item, str) and item.strip():
            out.append(item.strip())
        elif type(item) is int:
            out.append(str(item))
        else:
            raise _CellError(f"label {item!r:.60} is not a class name or an integer")
    return out


# --------------------------------------------------------------------------- inference


class _Evidence:
    """What one undeclared column's values have shown so far."""

    def __init__(self) -> None:
        self.tags: set[str] = set()
        self.inner_shapes: set[tuple[int, ...]] = set()
        self.nan = False
        self.class_like = True  # every value a label or a list of labels
        self.multi = False

    def add_text(self, text: str) -> None:
        if _INT_TEXT.match(text):
            self.tags.add("int")
        elif _FLOAT_TEXT.match(text):
            self.tags.add("float")
            self.nan = self.nan or math.isnan(float(text))
        else:
            self.tags.add("str")
        self.multi = self.multi or LABEL_SEPARATOR in text

    def add_json(self, value: Any) -> None:
        if type(value) is bool:
            self.tags.add("bool")
        elif type(value) is int:
            self.tags.add("int")
        elif type(value) is float:
            self.tags.add("float")
            self.nan = self.nan or math.isnan(value)
        elif type(value) is str:
            self.tags.add("str")
        elif value is None:
            self.tags.add("null")
        else:
            self._add_list_or_other(value)
        if isinstance(value, list):
            self.multi = True
            self.class_like = self.class_like and all(
                type(v) is int or isinstance(v, str) for v in value)
        elif not (type(value) is int or isinstance(value, str) or value is None):
            self.class_like = False

    def _add_list_or_other(self, value: Any) -> None:
        shape = _numeric_shape(value)
        if shape is None:
            self.tags.add("other")
            return
        dims, is_float = shape
        self.tags.add("list_float" if is_float else "list_int")
        if dims != (0,):  # [] fits any inner shape
            self.inner_shapes.add(dims[1:])

    def resolve(self, from_text: bool) -> Field:
        tags = self.tags - {"null"}
        if not tags:
            return String() if from_text else JSON()
        if tags == {"bool"}:
            return Int("bool")
        if tags == {"int"}:
            return Int()
        if tags <= {"int", "float"}:
            return Float(allow_nan=self.nan)
        if tags == {"str"}:
            return String()
        if from_text:
            return String()
        if tags <= {"list_int", "list_float"} and len(self.inner_shapes) <= 1:
            inner = next(iter(self.inner_shapes), ())
            return Ragged("float64" if "list_float" in tags else "int64", inner)
        return JSON()


def _numeric_shape(value: Any, depth: int = 0) -> tuple[tuple[int, ...], bool] | None:
    """``(shape, has_float)`` of a rectangular JSON list of numbers, else None
    (also for lists nested deeper than an array may be: they are json values)."""
    if type(value) is int:
        return (), False
    if type(value) is float:
        return (), True
    if type(value) is not list or depth >= MAX_ARRAY_DIMS:
        return None
    if not value:
        return (0,), False
    shapes = [_numeric_shape(v, depth + 1) for v in value]
    first = shapes[0]
    if first is None or any(s is None or s[0] != first[0] for s in shapes):
        return None
    return (len(value), *first[0]), any(s[1] for s in shapes if s is not None)


# --------------------------------------------------------------------------- columns


@dataclass
class PackedBytes:
    """Many byte strings as one ``uint8`` buffer plus ``int64`` offsets (``n + 1``):
    item ``i`` is ``data[offsets[i]:offsets[i + 1]]``. Slicing gives a list."""

    data: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        return self.data[self.offsets[index]:self.offsets[index + 1]].tobytes()

    def __iter__(self) -> Iterator[bytes]:
        return (self[i] for i in range(len(self)))


class _PackedBuilder:
    def __init__(self) -> None:
        self._buf = bytearray()
        self._ends = array("q", [0])

    def append(self, item: bytes) -> None:
        self._buf += item
        self._ends.append(len(self._buf))

    def freeze(self) -> PackedBytes:
        packed = PackedBytes(np.frombuffer(bytes(self._buf), dtype=np.uint8),
                             np.frombuffer(self._ends.tobytes(), dtype=np.int64))
        self._buf, self._ends = bytearray(), array("q")
        return packed


class _Column:
    """The stored values of one field: appended to while reading, then frozen."""

    def append(self, value: Any) -> None:
        raise NotImplementedError

    def freeze(self) -> None:
        raise NotImplementedError

    def get(self, i: int) -> Any:
        raise NotImplementedError


class _ScalarColumn(_Column):
    """Int and Float fields (and single-label class indices): one numpy array."""

    def __init__(self, dtype: np.dtype):
        self.dtype = dtype
        self._code = "Q" if dtype.kind == "u" else "d" if dtype.kind == "f" else "q"
        self._values: array | None = array(self._code)
        self.values = np.empty(0, dtype=dtype)

    def append(self, value: Any) -> None:
        assert self._values is not None
        self._values.append(value)

    def freeze(self) -> None:
        assert self._values is not None
        native = {"Q": np.uint64, "d": np.float64, "q": np.int64}[self._code]
        self.values = np.frombuffer(self._values.tobytes(), dtype=native).astype(self.dtype)
        self._values = None

    def get(self, i: int) -> Any:
        return float(self.values[i]) if self.dtype.kind == "f" else int(self.values[i])


class _BytesColumn(_Column):
    """Fields stored as bytes per row: strings (UTF-8), json (msgpack), extra image
    paths (file system bytes), fixed-shape and ragged arrays (raw bytes)."""

    def __init__(self, field: Field):
        self.field = field  # the codec is chosen from it (no closures: the source pickles)
        self._builder: _PackedBuilder | None = _PackedBuilder()
        self.packed = PackedBytes(np.empty(0, np.uint8), np.zeros(1, np.int64))

    def append(self, value: Any) -> None:
        assert self._builder is not None
        self._builder.append(value)

    def freeze(self) -> None:
        assert self._builder is not None
        self.packed, self._builder = self._builder.freeze(), None

    def get(self, i: int) -> Any:
        return _decode(self.field, self.packed[i])


class _RaggedColumn(_Column):
    """Ragged fields (and multi-label class indices): all rows' bytes packed, plus row counts."""

    def __init__(self, field: Ragged):
        self.field = field
        self._bytes = _BytesColumn(field)
        self._counts: array | None = array("q")
        self.counts = np.empty(0, dtype=np.int64)

    def append(self, value: np.ndarray) -> None:
        assert self._counts is not None
        self._bytes.append(value.tobytes())
        self._counts.append(int(value.shape[0]))

    def freeze(self) -> None:
        assert self._counts is not None
        self._bytes.freeze()
        self.counts, self._counts = np.frombuffer(self._counts.tobytes(), dtype=np.int64).copy(), None

    def get(self, i: int) -> np.ndarray:
        data = self._bytes.packed[i]
        return np.frombuffer(data, dtype=self.field.dtype).reshape((int(self.counts[i]), *self.field.inner_shape))


def _column_for(spec: _Spec) -> _Column:
    f = spec.field
    if spec.role == "multilabel" or isinstance(f, Ragged):
        return _RaggedColumn(f if isinstance(f, Ragged) else Ragged("int64"))
    if isinstance(f, Int | Float):
        return _ScalarColumn(f.dtype)
    return _BytesColumn(f)


def _decode(f: Field, data: bytes) -> Any:
    if isinstance(f, String):
        return data.decode("utf-8")
    if isinstance(f, Image):
        return os.fsdecode(data)
    if isinstance(f, NDArray):
        return np.frombuffer(data, dtype=f.dtype).reshape(f.shape)
    if isinstance(f, Ragged):
        return data
    return msgpack.unpackb(data, raw=False)


# --------------------------------------------------------------------------- the source


@dataclass
class _Spec:
    """How one key/column of the list becomes one field."""

    name: str
    key: str
    role: str  # "image" (the path), "value", "class", "multilabel"
    field: Field
    default: Any = _MISSING
    classes: list[str] = dataclass_field(default_factory=list)
    class_index: dict[str, int] = dataclass_field(default_factory=dict)

    @property
    def kind(self) -> Field | str:
        return self.role if self.role in CLASS_KINDS else self.field


@dataclass
class TableSource:
    """A parsed list file: its schema, class tables and every row's values as columns.

    ``schema`` starts with the image field ``image`` (from ``path``), then the
    other fields in the file's order. ``relpaths`` are the image paths as written
    (normalised) and ``paths`` the same made absolute (joined to ``root``, the list
    file's folder, when relative; built on first use and not pickled, so a source
    sent to worker processes carries each path once), both :class:`PackedBytes`;
    ``sizes`` the image file sizes at scan time (-1: missing or unreadable);
    ``lines`` each row's line number in the list file. ``class_tables`` maps each
    class field to its class names; ``classes`` is the ``label`` field's (or the
    only class field's) table. ``problems`` are ``(path, problem)`` pairs to warn
    about (missing image files, at most :data:`MAX_ROW_ERRORS` listed, then one
    line counting the rest); ``missing`` the row indices whose image is missing.
    """

    list_file: str
    root: str
    schema: Schema
    relpaths: PackedBytes
    sizes: np.ndarray
    lines: np.ndarray
    class_tables: dict[str, list[str]]
    problems: list[tuple[str, str]]
    missing: np.ndarray
    columns: dict[str, _Column]
    #: duck-typing :class:`fastdata.writer.sources.folder.SourceScan` for the converter's reports
    is_list: bool = True
    hidden_classes: list[str] = dataclass_field(default_factory=list)

    def __len__(self) -> int:
        return len(self.relpaths)

    @property
    def paths(self) -> PackedBytes:
        """Absolute image paths (file system bytes), one per row."""
        cached = self.__dict__.get("_paths")
        if cached is None:
            root, builder = os.fsencode(self.root), _PackedBuilder()
            for relative in self.relpaths:
                builder.append(relative if os.path.isabs(relative) else os.path.join(root, relative))
            cached = self.__dict__["_paths"] = builder.freeze()
        return cached

    def path(self, i: int) -> bytes:
        """The absolute path of row ``i``'s image (file system bytes)."""
        relative = self.relpaths[i]
        return relative if os.path.isabs(relative) else os.path.join(os.fsencode(self.root), relative)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_paths"}

    @property
    def classes(self) -> list[str]:
        if "label" in self.class_tables:
            return self.class_tables["label"]
        return next(iter(self.class_tables.values())) if len(self.class_tables) == 1 else []

    @property
    def walk_problems(self) -> list[tuple[str, str]]:
        return self.problems

    @property
    def labels(self) -> np.ndarray | None:
        """The single-label ``label`` field's class indices (int64), else None."""
        column = self.columns.get("label")
        return column.values if isinstance(column, _ScalarColumn) and "label" in self.class_tables else None

    def row(self, i: int) -> dict[str, Any]:
        """Sample ``i`` as ``{field name: value}`` in schema order: the image as its
        absolute path (``str``, ``os.fsdecode``: read it, then :meth:`Schema.check`),
        ints and floats as Python numbers, arrays as numpy arrays of the field's
        dtype, strings as ``str``, json values as lists/dicts, class fields as
        class indices (an int, or an int64 array for multi-label)."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} out of range for {len(self)} rows")
        i %= len(self)
        out: dict[str, Any] = {}
        for name, _ in self.schema:
            out[name] = os.fsdecode(self.path(i)) if name == IMAGE_FIELD else self.columns[name].get(i)
        return out

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.row(i)


def is_table_list(list_file: str | os.PathLike, schema: Any = None) -> bool:
    """True when ``list_file`` needs :func:`scan_table` rather than the classification
    reader :func:`fastdata.writer.sources.folder.scan_list`: a JSONL file, a ``--schema``, or a
    CSV/TSV whose header names columns other than exactly ``path`` and ``label``."""
    name = os.fspath(list_file).lower()
    if name.endswith(JSONL_SUFFIXES) or schema is not None:
        return True
    if not name.endswith(CSV_SUFFIXES):
        return False
    rows = _csv_rows(os.fspath(list_file))
    try:
        header = next(rows, None)
    except (OSError, SourceError):
        return False
    finally:
        rows.close()
    if header is None:
        return False
    cells = [c.strip().lower() for c in header[1]]
    return PATH_KEY in cells and cells != [PATH_KEY, "label"]


def scan_table(list_file: str | os.PathLike, schema: str | os.PathLike | Mapping | list | None = None) -> TableSource:
    """Parse a JSONL or CSV/TSV list file (rules: this module's docstring).

    Args:
        list_file: ``*.jsonl``/``*.ndjson``, or ``*.csv``/``*.tsv``.
        schema: declared fields (see :func:`parse_schema`); undeclared ones are inferred.

    Returns:
        TableSource: the schema, class tables and columns.

    Raises:
        SourceError: the file is missing, empty, has bad rows (all reported, with
            line numbers and columns), or a declared field names no column.
        SchemaError: the schema spec is malformed.
    """
    path = os.path.abspath(os.fspath(list_file))
    declared = parse_schema(schema)
    reader = _Reader(path)
    specs = reader.infer(declared)
    return reader.load(specs)


def _csv_rows(list_file: str) -> Generator[tuple[int, list[str]], None, None]:
    import csv

    delimiter = "\t" if list_file.lower().endswith(".tsv") else ","
    try:
        fh = open(list_file, newline="", encoding="utf-8-sig", errors="surrogateescape")
    except FileNotFoundError:
        raise SourceError(f"list file not found: {list_file}") from None
    with fh:
        reader = csv.reader(fh, delimiter=delimiter)
        try:
            for row in reader:
                if row and not (len(row) == 1 and not row[0].strip()):
                    yield reader.line_num, row
        except csv.Error as err:  # e.g. a NUL byte: csv cannot read past it
            raise SourceError(f"{list_file}:{reader.line_num}: {err}; fix that line") from None


class _Reader:
    """Two passes over one list file: :meth:`infer` (kinds, class tables, syntax
    errors), then :meth:`load` (values into columns, value errors)."""

    def __init__(self, list_file: str):
        self.list_file = list_file
        self.root = os.path.dirname(list_file)
        self.is_jsonl = list_file.lower().endswith(JSONL_SUFFIXES)
        if not self.is_jsonl and not list_file.lower().endswith(CSV_SUFFIXES):
            raise SourceError(f"{list_file}: a list file ends in {', '.join(JSONL_SUFFIXES + CSV_SUFFIXES)}")
        self.bad: dict[int, str] = {}  # line -> first problem of that line
        self.keys: list[str] = []  # in file order, without the path key

    # ---- reading rows

    def rows(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(line, {key: raw value})`` of every well-formed row; malformed ones go to :attr:`bad`."""
        return self._jsonl_rows() if self.is_jsonl else self._table_rows()

    def _jsonl_rows(self) -> Iterator[tuple[int, dict[str, Any]]]:
        try:
            fh = open(self.list_file, encoding="utf-8-sig", errors="surrogateescape")
        except FileNotFoundError:
            raise SourceError(f"list file not found: {self.list_file}") from None
        with fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as err:
                    self.bad.setdefault(lineno, f"not JSON ({err.msg} at column {err.colno})")
                    continue
                except RecursionError:
                    self.bad.setdefault(lineno, "JSON nested too deeply to read")
                    continue
                if not isinstance(obj, dict):
                    self.bad.setdefault(lineno, f"expected a JSON object, got {type(obj).__name__}")
                    continue
                yield lineno, obj

    def _table_rows(self) -> Iterator[tuple[int, dict[str, Any]]]:
        rows = _csv_rows(self.list_file)
        first = next(rows, None)
        if first is None:
            return
        header = [c.strip() for c in first[1]]
        if PATH_KEY in (c.lower() for c in header):
            names = [PATH_KEY if c.lower() == PATH_KEY else c for c in header]
            self._check_header(first[0], names)
            data: Iterator[tuple[int, list[str]]] = rows
        elif len(header) == 2:  # today's headerless path,label list
            names = [PATH_KEY, "label"]
            data = _chain_one(first, rows)
        else:
            raise SourceError(f"{self.list_file}:{first[0]}: a list with {len(header)} columns needs a header row "
                              f"naming them, one of them '{PATH_KEY}' (e.g. path,label,score)")
        for lineno, row in data:
            if len(row) != len(names):
                self.bad.setdefault(lineno, f"expected {len(names)} columns ({', '.join(names)}), got {len(row)}")
                continue
            yield lineno, {k: v.strip() for k, v in zip(names, row, strict=True)}

    def _check_header(self, lineno: int, names: list[str]) -> None:
        seen = set()
        for name in names:
            if name in seen:
                raise SourceError(f"{self.list_file}:{lineno}: column {name!r} appears twice in the header")
            seen.add(name)

    # ---- pass 1

    def infer(self, declared: dict[str, Declared]) -> list[_Spec]:
        """Kinds of the undeclared keys and every class field's table."""
        evidence: dict[str, _Evidence] = {}
        label_texts: dict[str, set[str]] = {}
        handlers: dict[str, Callable[[Any], None]] = {}
        count = 0
        for lineno, row in self.rows():
            count += 1
            if PATH_KEY not in row:
                self.bad.setdefault(lineno, f"no '{PATH_KEY}' key (the image file)")
            for key, raw in row.items():
                handler = handlers.get(key)
                if handler is None:
                    handler = handlers[key] = self._observer(key, declared, evidence, label_texts)
                if raw is not None and (raw != "" or self.is_jsonl):
                    handler(raw)
        if not count and not self.bad:
            raise SourceError(f"{self.list_file}: the list names no image files")
        specs = [_Spec(IMAGE_FIELD, PATH_KEY, "image", Image())]
        if PATH_KEY in declared or IMAGE_FIELD in declared and not isinstance(declared[IMAGE_FIELD].kind, Image):
            raise SchemaError(f"--schema: '{PATH_KEY}' is the image file of each row and always becomes the image "
                              f"field '{IMAGE_FIELD}'; declare only the other fields")
        for name in declared:
            if name not in evidence and name != IMAGE_FIELD:
                raise SourceError(f"{self.list_file}: --schema declares {name!r}, which no row has "
                                  f"(the list's fields: {', '.join(self.keys) or 'none'})")
        for key in self.keys:
            specs.append(self._spec(key, declared.get(key), evidence[key]))
        self._check_names(specs)
        for spec in specs:
            if spec.role in CLASS_KINDS:
                texts = label_texts.get(spec.key, set())
                if spec.default is not _MISSING:
                    texts |= set(_label_texts(spec.default, True))
                spec.classes, spec.class_index = self._class_table(spec.key, texts)
        return specs

    def _observer(self, key: str, declared: dict[str, Declared], evidence: dict[str, _Evidence],
                  label_texts: dict[str, set[str]]) -> Callable[[Any], None]:
        """What pass 1 does with each present value of ``key`` (chosen once per key):
        gather evidence of its kind unless declared, and its labels if it is a class field."""
        if key == PATH_KEY:
            return _ignore
        self.keys.append(key)
        evidence[key] = observed = _Evidence()
        kind = declared[key].kind if key in declared else None
        is_class = kind in CLASS_KINDS if kind is not None else key.lower() in CLASS_NAMES
        if kind is not None and not is_class:
            return _ignore  # declared: nothing to infer, pass 2 checks the values
        texts = label_texts.setdefault(key, set())
        if self.is_jsonl:
            def observe_json(raw: Any) -> None:
                observed.add_json(raw)
                if is_class and observed.class_like:
                    try:
                        texts.update(_label_texts(raw, True))
                    except _CellError:
                        pass  # a bad label: pass 2 reports it with its line
            return observe_json
        split = kind != "class"  # an undeclared label column may be multi-label (a|b)

        def observe_text(raw: str) -> None:
            observed.add_text(raw)
            if is_class:
                texts.update(_cell_value(raw, "multilabel") if split else [raw])
        return observe_text

    def _spec(self, key: str, declared: Declared | None, evidence: _Evidence) -> _Spec:
        if declared is not None:
            if declared.kind in CLASS_KINDS:
                return _Spec(key, key, str(declared.kind), _class_field(str(declared.kind)), declared.default)
            assert isinstance(declared.kind, Field)
            return _Spec(key, key, "value", declared.kind, declared.default)
        if key.lower() in CLASS_NAMES and (not self.is_jsonl or evidence.class_like):
            role = "multilabel" if evidence.multi else "class"
            return _Spec(key, key, role, _class_field(role))
        return _Spec(key, key, "value", evidence.resolve(from_text=not self.is_jsonl))

    def _check_names(self, specs: list[_Spec]) -> None:
        try:
            Schema(tuple((s.name, s.field) for s in specs))
        except SchemaError as err:
            where = "a column of the header" if not self.is_jsonl else "a key of the rows"
            raise SourceError(f"{self.list_file}: {where} cannot be a field name: {err} "
                              "(rename it; the path key becomes the field 'image')") from None

    def _class_table(self, key: str, texts: set[str]) -> tuple[list[str], dict[str, int]]:
        """The classes of one class field (rule: :func:`fastdata.writer.sources.folder.scan_list`)."""
        if texts and all(t.isascii() and t.isdigit() for t in texts):
            top = max(int(t) for t in texts)
            if top >= MAX_INTEGER_LABEL:
                raise SourceError(
                    f"{self.list_file}: integer label {top} in {key!r} is taken as a class index and would make "
                    f"{top + 1} classes (limit {MAX_INTEGER_LABEL}); renumber the labels from 0, or use class names")
            classes = [str(i) for i in range(top + 1)]
            # "07" and "7" are one label: index by value
            return classes, {t: int(t) for t in texts}
        classes = sorted(texts)
        return classes, {c: i for i, c in enumerate(classes)}

    # ---- pass 2

    def load(self, specs: list[_Spec]) -> TableSource:
        """Every row's values into columns; every bad row reported at once."""
        columns = [_column_for(s) for s in specs[1:]]
        converters = [self._converter(s) for s in specs]
        relpaths = _PackedBuilder()
        lines, sizes, missing = array("q"), array("q"), array("q")
        problems: list[tuple[str, str]] = []
        for lineno, row in self.rows():
            if lineno in self.bad:
                continue
            try:
                values = [convert(row) for convert in converters]
            except _RowError as err:
                self.bad.setdefault(lineno, str(err))
                continue
            absolute, relative = self._image_path(values[0])
            relpaths.append(relative)
            for column, value in zip(columns, values[1:], strict=True):
                column.append(value)
            size = _file_size(absolute)
            if size < 0:
                missing.append(len(lines))
                if len(problems) < MAX_ROW_ERRORS:
                    problems.append((os.fsdecode(absolute), f"{self.list_file}:{lineno}: image file not found"))
            lines.append(lineno)
            sizes.append(size)
        self._raise_bad()
        if len(missing) > MAX_ROW_ERRORS:
            problems.append((self.list_file, f"... and {len(missing) - MAX_ROW_ERRORS} more missing image files"))
        for column in columns:
            column.freeze()
        return TableSource(
            list_file=self.list_file, root=self.root,
            schema=Schema(tuple((s.name, s.field) for s in specs)),
            relpaths=relpaths.freeze(),
            sizes=_int64(sizes), lines=_int64(lines),
            class_tables={s.name: s.classes for s in specs if s.role in CLASS_KINDS},
            problems=problems, missing=_int64(missing),
            columns={s.name: c for s, c in zip(specs[1:], columns, strict=True)})

    def _converter(self, spec: _Spec) -> Callable[[dict[str, Any]], Any]:
        """``row -> stored value`` of one field (what its column appends), built once
        per field so the per-row work is a few calls; raises :class:`_RowError`
        naming the column (the caller adds the line)."""
        where = f"{'key' if self.is_jsonl else 'column'} {spec.key!r}"
        key, default, is_jsonl = spec.key, spec.default, self.is_jsonl
        null_is_value = isinstance(spec.field, JSON)
        store = self._store_function(spec, where)
        parse = _cell_parser(spec.kind)

        def convert(row: dict[str, Any]) -> Any:
            raw = row.get(key, _MISSING)
            try:
                if raw is _MISSING or raw == "" and (not is_jsonl or spec.role == "image") or (
                        raw is None and not null_is_value):
                    if default is _MISSING:
                        raise _CellError(_absent_message(raw, spec))
                    return store(default)
                return store(raw if is_jsonl else parse(raw))
            except _CellError as err:
                raise _RowError(f"{where}: {err}") from None

        return convert

    def _store_function(self, spec: _Spec, where: str) -> Callable[[Any], Any]:
        """``value -> stored form`` for one field (the JSON-like value of a JSONL row,
        a parsed CSV cell or a default)."""
        f = spec.field
        if spec.role == "image":
            return _store_path
        if spec.role in CLASS_KINDS:
            return _class_store(spec)
        if isinstance(f, Image):  # a second image column: a path like the first
            return lambda v: self._image_path(_store_path(v))[0]
        checked = _checked(f, where)
        if isinstance(f, Int) and f.dtype.kind != "b":
            info = np.iinfo(f.dtype)
            low, high = int(info.min), int(info.max)
            return lambda v: v if type(v) is int and low <= v <= high else checked(v)
        if isinstance(f, Float):
            allow_nan = f.allow_nan
            return lambda v: v if type(v) is float and (allow_nan or v == v) else checked(v)
        if isinstance(f, String):
            return lambda v: _encode_string(checked(v if type(v) is str or self.is_jsonl else str(v)))
        if isinstance(f, NDArray):
            return lambda v: checked(v).tobytes()
        if isinstance(f, JSON):
            return lambda v: _pack_json(checked(v))
        return checked  # ragged: the column keeps the array's bytes and row count

    def _image_path(self, text: str) -> tuple[bytes, bytes]:
        """``(absolute, as written and normalised)`` file system bytes of a listed path."""
        relative = os.path.normpath(text)
        absolute = relative if os.path.isabs(relative) else os.path.join(self.root, relative)
        return os.fsencode(absolute), os.fsencode(relative)

    def _raise_bad(self) -> None:
        bad = sorted(self.bad.items())
        if len(bad) == 1:
            raise SourceError(f"{self.list_file}:{bad[0][0]}: {bad[0][1]}")
        if bad:
            shown = "; ".join(f"line {n}: {why}" for n, why in bad[:MAX_ROW_ERRORS])
            more = f"; ... and {len(bad) - MAX_ROW_ERRORS} more" if len(bad) > MAX_ROW_ERRORS else ""
            raise SourceError(f"{self.list_file}: {len(bad)} bad rows (fix them all, then convert again): "
                              f"{shown}{more}")


def _absent_message(raw: Any, spec: _Spec) -> str:
    if spec.role == "image":
        return "no image path"
    what = "missing" if raw is _MISSING else "empty" if raw == "" else "null"
    return f"{what} value (fill it in, or declare a default: --schema '{spec.key}:KIND=DEFAULT')"


def _store_path(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _CellError(f"an image path must be a non-empty string, got {value!r:.60}")
    return value


def _class_store(spec: _Spec) -> Callable[[Any], Any]:
    index, multi = spec.class_index, spec.role == "multilabel"

    def store(value: Any) -> Any:
        texts = _label_texts(value, multi)
        unknown = [t for t in texts if t not in index]
        if unknown:  # pass 1 saw every label; only a malformed one ends here
            raise _CellError(f"label {unknown[0]!r:.60} is not a class of this field")
        if multi:
            return np.asarray([index[t] for t in texts], dtype=np.int64)
        return index[texts[0]]

    return store


def _checked(f: Field, where: str) -> Callable[[Any], Any]:
    """``f.check`` with its error as a :class:`_CellError` (the caller names the column)."""

    def check(value: Any) -> Any:
        try:
            return f.check(value, where)
        except SchemaError as err:
            raise _CellError(str(err).removeprefix(f"{where}: ")) from None

    return check


def _encode_string(value: str) -> bytes:
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as err:  # a lone surrogate, e.g. from a non-UTF-8 CSV byte
        raise _CellError(f"not valid UTF-8 text ({err.reason})") from None


def _pack_json(value: Any) -> bytes:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (UnicodeEncodeError, ValueError, OverflowError, TypeError) as err:
        raise _CellError(f"cannot be stored as msgpack ({err})") from None


def _int64(values: array) -> np.ndarray:
    return np.frombuffer(values.tobytes(), dtype=np.int64).copy()


class _RowError(ValueError):
    """A bad value in one row; the message names the column, the caller the line."""


def _ignore(raw: Any) -> None:
    return None


def _class_field(role: str) -> Field:
    return Int("int64") if role == "class" else Ragged("int64")


def _chain_one(first: tuple[int, list[str]], rest: Iterator[tuple[int, list[str]]]
               ) -> Iterator[tuple[int, list[str]]]:
    yield first
    yield from rest


def _file_size(path: bytes) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1
