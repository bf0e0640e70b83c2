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

Field kinds, when not declared (see :func:`~fastdata.writer.sources.table.spec.parse_schema` to declare them):

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
rejects unreadable images, ``strict=True`` stopping).

**Memory.** The file is read twice (once to infer kinds and class tables, once to
store values), one row at a time; values are kept as numpy columns (numbers), or
packed bytes plus offsets (paths, strings, arrays, msgpack for json), never one
Python object per row.
"""

from __future__ import annotations

import csv
import json
import os
from array import array
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

import msgpack
import numpy as np

from fastdata.errors import SourceError
from fastdata.format.fields import JSON, Field, Float, Image, Int, NDArray, Ragged, Schema, SchemaError, String
from fastdata.writer.sources.folder import is_url, MAX_INTEGER_LABEL, MAX_ROW_ERRORS, mixed_rows_message
from fastdata.writer.sources.table.cells import CellError, Evidence, cell_parser, cell_value, label_texts_of
from fastdata.writer.sources.table.columns import Column, PackedBuilder, PackedBytes, ScalarColumn, column_for
from fastdata.writer.sources.table.spec import CLASS_KINDS, MISSING, Declared, Spec, parse_schema

__all__ = ["TableSource", "scan_table", "is_table_list", "JSONL_SUFFIXES"]

JSONL_SUFFIXES = (".jsonl", ".ndjson")
CSV_SUFFIXES = (".csv", ".tsv")
#: names (compared lower-case) that make an undeclared column a class field
CLASS_NAMES = frozenset({"label", "labels"})
#: the list's path column/key; it becomes the image field :data:`IMAGE_FIELD`
PATH_KEY = "path"
IMAGE_FIELD = "image"


# --------------------------------------------------------------------------- the source


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
    columns: dict[str, Column]
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
            root, builder = os.fsencode(self.root), PackedBuilder()
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
        return column.values if isinstance(column, ScalarColumn) and "label" in self.class_tables else None

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
    reader :func:`fastdata.writer.sources.folder.scan_list`: a JSONL file, a ``schema``, or a
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


def scan_table(list_file: str | os.PathLike, schema: str | os.PathLike | Mapping | list | None = None, *,
               mixed_urls: bool = False) -> TableSource:
    """Parse a JSONL or CSV/TSV list file (rules: this module's docstring).

    Args:
        list_file: ``*.jsonl``/``*.ndjson``, or ``*.csv``/``*.tsv``.
        schema: declared fields (see :func:`parse_schema`); undeclared ones are inferred.
        mixed_urls (bool): rows may name URLs beside relative paths (the copy of a list read from
            a URL, whose relative rows are joined to its folder URL); False: a row naming a URL
            while the first names a local path (or the reverse) is refused. A URL row's path is
            kept as written, and not looked up here (its size is -1).

    Returns:
        TableSource: the schema, class tables and columns.

    Raises:
        SourceError: the file is missing, empty, has bad rows (all reported, with
            line numbers and columns), a declared field names no column, or (without
            ``mixed_urls``) rows name both URLs and local paths.
        SchemaError: the schema spec is malformed.
    """
    path = os.path.abspath(os.fspath(list_file))
    declared = parse_schema(schema)
    reader = _Reader(path, mixed_urls)
    specs = reader.infer(declared)
    return reader.load(specs)


def _csv_rows(list_file: str) -> Generator[tuple[int, list[str]], None, None]:
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

    def __init__(self, list_file: str, mixed_urls: bool = False):
        self.list_file = list_file
        self.mixed_urls = mixed_urls
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

    def infer(self, declared: dict[str, Declared]) -> list[Spec]:
        """Kinds of the undeclared keys and every class field's table."""
        evidence: dict[str, Evidence] = {}
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
        specs = [Spec(IMAGE_FIELD, PATH_KEY, "image", Image())]
        if PATH_KEY in declared or IMAGE_FIELD in declared and not isinstance(declared[IMAGE_FIELD].kind, Image):
            raise SchemaError(f"schema: '{PATH_KEY}' is the image file of each row and always becomes the image "
                              f"field '{IMAGE_FIELD}'; declare only the other fields")
        for name in declared:
            if name not in evidence and name != IMAGE_FIELD:
                raise SourceError(f"{self.list_file}: schema declares {name!r}, which no row has "
                                  f"(the list's fields: {', '.join(self.keys) or 'none'})")
        for key in self.keys:
            specs.append(self._spec(key, declared.get(key), evidence[key]))
        self._check_names(specs)
        for spec in specs:
            if spec.role in CLASS_KINDS:
                texts = label_texts.get(spec.key, set())
                if spec.default is not MISSING:
                    texts |= set(label_texts_of(spec.default, True))
                spec.classes, spec.class_index = self._class_table(spec.key, texts)
        return specs

    def _observer(self, key: str, declared: dict[str, Declared], evidence: dict[str, Evidence],
                  label_texts: dict[str, set[str]]) -> Callable[[Any], None]:
        """What pass 1 does with each present value of ``key`` (chosen once per key):
        gather evidence of its kind unless declared, and its labels if it is a class field."""
        if key == PATH_KEY:
            return _ignore
        self.keys.append(key)
        evidence[key] = observed = Evidence()
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
                        texts.update(label_texts_of(raw, True))
                    except CellError:
                        pass  # a bad label: pass 2 reports it with its line
            return observe_json
        split = kind != "class"  # an undeclared label column may be multi-label (a|b)

        def observe_text(raw: str) -> None:
            observed.add_text(raw)
            if is_class:
                texts.update(cell_value(raw, "multilabel") if split else [raw])
        return observe_text

    def _spec(self, key: str, declared: Declared | None, evidence: Evidence) -> Spec:
        if declared is not None:
            if declared.kind in CLASS_KINDS:
                return Spec(key, key, str(declared.kind), _class_field(str(declared.kind)), declared.default)
            assert isinstance(declared.kind, Field)
            return Spec(key, key, "value", declared.kind, declared.default)
        if key.lower() in CLASS_NAMES and (not self.is_jsonl or evidence.class_like):
            role = "multilabel" if evidence.multi else "class"
            return Spec(key, key, role, _class_field(role))
        return Spec(key, key, "value", evidence.resolve(from_text=not self.is_jsonl))

    def _check_names(self, specs: list[Spec]) -> None:
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

    def load(self, specs: list[Spec]) -> TableSource:
        """Every row's values into columns; every bad row reported at once."""
        columns = [column_for(s) for s in specs[1:]]
        converters = [self._converter(s) for s in specs]
        relpaths = PackedBuilder()
        lines, sizes, missing = array("q"), array("q"), array("q")
        problems: list[tuple[str, str]] = []
        first: tuple[int, str, bool] | None = None  # (line, path, a URL?) of the first row
        for lineno, row in self.rows():
            if lineno in self.bad:
                continue
            try:
                values = [convert(row) for convert in converters]
            except _RowError as err:
                self.bad.setdefault(lineno, str(err))
                continue
            if not self.mixed_urls:
                url = is_url(values[0])
                if first is None:
                    first = (lineno, values[0], url)
                elif url != first[2]:
                    raise SourceError(mixed_rows_message(self.list_file, lineno, values[0], first[0], first[1]))
            absolute, relative = self._image_path(values[0])
            relpaths.append(relative)
            for column, value in zip(columns, values[1:], strict=True):
                column.append(value)
            size = -1 if is_url(values[0]) else _file_size(absolute)  # (a URL: its caller looks it up)
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

    def _converter(self, spec: Spec) -> Callable[[dict[str, Any]], Any]:
        """``row -> stored value`` of one field (what its column appends), built once
        per field so the per-row work is a few calls; raises :class:`_RowError`
        naming the column (the caller adds the line)."""
        where = f"{'key' if self.is_jsonl else 'column'} {spec.key!r}"
        key, default, is_jsonl = spec.key, spec.default, self.is_jsonl
        null_is_value = isinstance(spec.field, JSON)
        store = self._store_function(spec, where)
        parse = cell_parser(spec.kind)

        def convert(row: dict[str, Any]) -> Any:
            raw = row.get(key, MISSING)
            try:
                if raw is MISSING or raw == "" and (not is_jsonl or spec.role == "image") or (
                        raw is None and not null_is_value):
                    if default is MISSING:
                        raise CellError(_absent_message(raw, spec))
                    return store(default)
                return store(raw if is_jsonl else parse(raw))
            except CellError as err:
                raise _RowError(f"{where}: {err}") from None

        return convert

    def _store_function(self, spec: Spec, where: str) -> Callable[[Any], Any]:
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
        """``(absolute, as written and normalised)`` file system bytes of a listed path (a URL: as
        written, twice; normalising would fold its ``//``)."""
        if is_url(text):
            return text.encode(), text.encode()
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


def _absent_message(raw: Any, spec: Spec) -> str:
    if spec.role == "image":
        return "no image path"
    what = "missing" if raw is MISSING else "empty" if raw == "" else "null"
    return f"{what} value (fill it in, or declare a default: schema '{spec.key}:KIND=DEFAULT')"


def _store_path(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise CellError(f"an image path must be a non-empty string, got {value!r:.60}")
    return value


def _class_store(spec: Spec) -> Callable[[Any], Any]:
    index, multi = spec.class_index, spec.role == "multilabel"

    def store(value: Any) -> Any:
        texts = label_texts_of(value, multi)
        unknown = [t for t in texts if t not in index]
        if unknown:  # pass 1 saw every label; only a malformed one ends here
            raise CellError(f"label {unknown[0]!r:.60} is not a class of this field")
        if multi:
            return np.asarray([index[t] for t in texts], dtype=np.int64)
        return index[texts[0]]

    return store


def _checked(f: Field, where: str) -> Callable[[Any], Any]:
    """``f.check`` with its error as a :class:`CellError` (the caller names the column)."""

    def check(value: Any) -> Any:
        try:
            return f.check(value, where)
        except SchemaError as err:
            raise CellError(str(err).removeprefix(f"{where}: ")) from None

    return check


def _encode_string(value: str) -> bytes:
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as err:  # a lone surrogate, e.g. from a non-UTF-8 CSV byte
        raise CellError(f"not valid UTF-8 text ({err.reason})") from None


def _pack_json(value: Any) -> bytes:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (UnicodeEncodeError, ValueError, OverflowError, TypeError) as err:
        raise CellError(f"cannot be stored as msgpack ({err})") from None


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
