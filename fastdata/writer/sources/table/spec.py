"""The ``schema`` grammar (:data:`SPEC_GRAMMAR`): fields declared by kind, with optional
defaults, read by :func:`parse_schema` from an inline spec, a JSON file or a loaded JSON value;
and :class:`Spec`, how one key or column of a list becomes one field."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

from fastdata.errors import SourceError
from fastdata.format.fields import JSON, Field, Float, Image, Int, NDArray, Ragged, SchemaError, String, field_from_json
from fastdata.writer.sources.table.cells import CellError, cell_value

__all__ = ["Declared", "SPEC_GRAMMAR", "parse_schema", "Spec", "CLASS_KINDS", "MISSING"]

#: declared kinds that are class fields (the stored field is Int / Ragged int64 of class indices)
CLASS_KINDS = ("class", "multilabel")
#: the default of a declaration without one, and the value of a key a row does not have
MISSING = object()


# --------------------------------------------------------------------------- declared schema


@dataclass(frozen=True)
class Declared:
    """A field declared with ``schema``: its kind (a :class:`~fastdata.format.fields.Field`,
    or ``"class"``/``"multilabel"``) and an optional default for missing values
    (a JSON-like value, as a JSONL row would hold it)."""

    kind: Field | str
    default: Any = MISSING

    @property
    def has_default(self) -> bool:
        return self.default is not MISSING


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
        where = f"schema field {name!r}"
        if not colon or not name:
            raise SchemaError(f"schema: {item.strip()!r} is not NAME:KIND; the grammar is:\n{SPEC_GRAMMAR}")
        kind_text, eq, default_text = rest.partition("=")
        kind = _kind_from_text(kind_text, where)
        default = MISSING
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
        return cell_value(text, kind)
    except CellError as err:
        raise SchemaError(f"{where}: default {err}") from None


def _add_declared(out: dict[str, Declared], name: str, declared: Declared) -> None:
    if name in out:
        raise SchemaError(f"schema: field {name!r} is declared twice")
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
                                              if eq else MISSING))
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
        _add_declared(out, name, Declared(kind_obj, entry.get("default", MISSING)))
    return out


def parse_schema(spec: str | os.PathLike | Mapping | list | None) -> dict[str, Declared]:
    """Declared fields from ``schema``: an inline spec (grammar:
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
        return _parse_json_schema(spec, "schema")
    text = os.fspath(spec)
    if text.lower().endswith(".json") or os.path.isfile(text):
        try:
            with open(text, encoding="utf-8") as fh:
                obj = json.load(fh)
        except FileNotFoundError:
            raise SourceError(f"schema file not found: {text}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise SourceError(f"schema file {text} is not JSON: {err}") from None
        return _parse_json_schema(obj, text)
    return _parse_inline(text)


# --------------------------------------------------------------------------- one key/column of a list


@dataclass
class Spec:
    """How one key/column of the list becomes one field."""

    name: str
    key: str
    role: str  # "image" (the path), "value", "class", "multilabel"
    field: Field
    default: Any = MISSING
    classes: list[str] = dataclass_field(default_factory=list)
    class_index: dict[str, int] = dataclass_field(default_factory=dict)

    @property
    def kind(self) -> Field | str:
        return self.role if self.role in CLASS_KINDS else self.field
