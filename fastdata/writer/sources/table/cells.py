"""The values of a list file: a CSV cell (or an inline ``schema`` default) as the JSON-like
value its kind takes, class labels as text, and the kind of an undeclared field inferred from
the values it holds (rules: :mod:`fastdata.writer.sources.table.reader`)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

from fastdata.format.fields import JSON, Field, Float, Int, NDArray, Ragged, String

__all__ = ["CellError", "cell_value", "cell_parser", "label_texts_of", "Evidence", "LABEL_SEPARATOR", "MAX_ARRAY_DIMS"]

#: separates the labels of one multi-label CSV cell
LABEL_SEPARATOR = "|"
_INT_TEXT = re.compile(r"^[+-]?[0-9]+$")
_FLOAT_TEXT = re.compile(r"^[+-]?([0-9]+\.?[0-9]*([eE][+-]?[0-9]+)?|\.[0-9]+([eE][+-]?[0-9]+)?|nan|inf|infinity)$",
                         re.IGNORECASE)
#: a JSON list nested deeper than this is a json value, not an array (numpy's own limit is 64)
MAX_ARRAY_DIMS = 32


class CellError(ValueError):
    """A value that its field cannot take; the message names no line (the caller adds it)."""


def cell_value(text: str, kind: Field | str) -> Any:
    """A CSV cell (or an inline default) as the JSON-like value its kind takes."""
    return cell_parser(kind)(text)


def cell_parser(kind: Field | str) -> Callable[[str], Any]:
    """``cell text -> JSON-like value`` for one kind (chosen once per column)."""
    if kind == "multilabel":
        return lambda text: [t.strip() for t in text.split(LABEL_SEPARATOR) if t.strip()]
    if isinstance(kind, Int | Float):
        pattern, convert = (_INT_TEXT, int) if isinstance(kind, Int) else (_FLOAT_TEXT, float)
        what = "an integer" if isinstance(kind, Int) else "a number"
        dtype = kind.dtype.name

        def number(text: str) -> Any:
            if not pattern.match(text):
                raise CellError(f"{text!r:.60} is not {what} ({dtype})")
            return convert(text)

        return number
    if isinstance(kind, Ragged | NDArray | JSON):
        name = kind.kind

        def json_text(text: str) -> Any:
            try:
                return json.loads(text)
            except json.JSONDecodeError as err:
                raise CellError(f"{text!r:.60} is not JSON ({err.msg}); a {name} cell holds JSON text such "
                                 "as [[1, 2, 3, 4]]") from None
            except RecursionError:
                raise CellError("JSON nested too deeply to read") from None

        return json_text
    return _same  # string, image path, class name


def _same(text: str) -> str:
    return text


def label_texts_of(value: Any, multi: bool) -> list[str]:
    """The labels of one class value as text (``7`` and ``"7"`` are one label)."""
    items = value if isinstance(value, list) else [value]
    if isinstance(value, list) and not multi:
        raise CellError("a list in a single-label field (declare it multilabel)")
    out = []
    for item in items:
        if isinstance(item, str) and item.strip():
            out.append(item.strip())
        elif type(item) is int:
            out.append(str(item))
        else:
            raise CellError(f"label {item!r:.60} is not a class name or an integer")
    return out



# --------------------------------------------------------------------------- inference


class Evidence:
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
