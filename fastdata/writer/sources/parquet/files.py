"""The Parquet files of a conversion, from their footers alone (no row is read here but the
first value of a binary column that may hold images): each file's row groups, one schema for
all files, the null counts of the statistics, and the Hugging Face ``features`` (class names)
from the schema metadata or a ``dataset_info.json``/``README.md`` beside the files.

The files' footers and sidecars are untrusted input (docs/SECURITY.md, "Sources: untrusted input
files"): row counts are checked with Python integers against :data:`MAX_ROWS`; a sidecar is
opened as a regular file only (``O_NONBLOCK``, checked with ``fstat``: a FIFO never blocks, a
link to a device is refused), read up to :data:`MAX_SIDECAR_BYTES` (a card's YAML front matter
up to :data:`MAX_CARD_BYTES`), its JSON decoded with bounded expansion, and its class lists held
to :data:`~fastdata.writer.sources.parquet.columns.MAX_CLASS_NAMES` names and
:data:`~fastdata.writer.sources.parquet.columns.MAX_CLASS_NAMES_BYTES` bytes."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from fastdata.common.bounded import ExpansionError, json_loads_bounded
from fastdata.common.fileio import open_regular, read_regular
from fastdata.errors import SourceError, UnsafeStoreError
from fastdata.writer.sources.parquet.columns import check_class_names

__all__ = ["ParquetFileInfo", "read_footers", "footer_entry", "hf_features", "null_counts", "first_value",
           "open_parquet", "column_minimum"]

#: the schema metadata key ``datasets`` writes its features under
HF_METADATA_KEY = b"huggingface"
#: the most rows a row group, and all the files of a conversion together, may declare
MAX_ROWS = 1 << 48
#: the largest ``dataset_info.json`` read for the features
MAX_SIDECAR_BYTES = 16 << 20
#: the most of a ``README.md`` read for its YAML front matter (which must end within it)
MAX_CARD_BYTES = 4 << 20


@dataclass(frozen=True)
class ParquetFileInfo:
    """One file's footer: what the plan, the fingerprint and the workers' checks need."""

    path: str
    size: int
    mtime_ns: int
    #: rows of each row group
    row_groups: tuple[int, ...]
    #: compressed bytes of each row group (what it adds to a shard, about)
    group_bytes: tuple[int, ...]


def _unreadable(path: str, err: Exception) -> SourceError:
    return SourceError(f"{path}: not a readable Parquet file ({type(err).__name__}: {err})")


def open_parquet(path: str) -> pq.ParquetFile:
    """``path`` opened for reading row groups a page at a time (bounded memory).

    Raises:
        SourceError: ``path`` is not a readable Parquet file (truncated, not Parquet, unreadable).
    """
    try:
        return pq.ParquetFile(path, buffer_size=1 << 20, pre_buffer=False)
    except (pa.ArrowException, OSError, ValueError) as err:
        raise _unreadable(path, err) from None


def read_footers(paths: list[str]) -> tuple[list[ParquetFileInfo], pa.Schema, list[pq.FileMetaData]]:
    """Every file's footer, and the schema they share (the first file's, with its metadata).

    Raises:
        SourceError: a file is missing or not Parquet (named), or two files have different columns
            (both named, with the first difference).
    """
    infos, metas = [], []
    schema: pa.Schema | None = None
    total = 0
    for path in paths:
        try:
            st = os.stat(path)
        except OSError as err:
            raise SourceError(f"{path}: {err.strerror or err}") from None
        if not os.path.isfile(path):
            raise SourceError(f"{path} is not a file")
        try:
            meta = pq.read_metadata(path)
            file_schema = meta.schema.to_arrow_schema()
        except (pa.ArrowException, OSError, ValueError) as err:
            raise _unreadable(path, err) from None
        info, schema, total = footer_entry(os.path.abspath(path), st.st_size, st.st_mtime_ns, meta, file_schema,
                                           schema, paths[0], total)
        infos.append(info)
        metas.append(meta)
    assert schema is not None, "parquet_files never gives an empty list"
    return infos, schema, metas


def footer_entry(path: str, size: int, mtime_ns: int, meta: Any, file_schema: pa.Schema, schema: pa.Schema | None,
                 first: str, total: int) -> tuple[ParquetFileInfo, pa.Schema, int]:
    """One file's plan entry from its footer ``meta`` (a local file's or a remote one's): its
    columns checked against ``schema`` (the first file's, named ``first``; None for the first file),
    its row counts (:func:`check_row_counts`, after ``total`` rows of the files before it) and each
    row group's bytes. Returns ``(info, the store's schema, total rows so far)``.

    Raises:
        SourceError: its columns differ from the first file's (both named, with the first
            difference), or its row counts are out of bounds.
    """
    if schema is None:
        schema = file_schema
    elif not file_schema.remove_metadata().equals(schema.remove_metadata()):
        raise SourceError(f"{first} and {path} have different columns ({_difference(schema, file_schema)}): "
                          "convert files of one schema into one store")
    groups = tuple(int(meta.row_group(g).num_rows) for g in range(meta.num_row_groups))
    total += check_row_counts(path, groups, total)
    # (a plan estimate: a crafted size is held within the file, never refused for itself)
    sizes = tuple(min(max(sum(int(meta.row_group(g).column(c).total_compressed_size)
                              for c in range(meta.num_columns)), 0), size)
                  for g in range(meta.num_row_groups))
    return ParquetFileInfo(path, size, mtime_ns, groups, sizes), schema, total


def check_row_counts(path: str, groups: tuple[int, ...], before: int = 0) -> int:
    """The rows of the row groups ``groups`` of file ``path`` (its footer's ``num_rows``), checked as
    Python integers: each from 0 to :data:`MAX_ROWS`, and ``before`` (the rows of the files before it)
    plus all of them at most :data:`MAX_ROWS`.

    Raises:
        SourceError: a count out of range, naming the file and row group (the footer is damaged
            or crafted: no conversion of it can succeed, ``resume=True`` included).
    """
    total = 0
    for g, rows in enumerate(groups):
        if not 0 <= rows <= MAX_ROWS:
            raise SourceError(f"{path}: its footer says row group {g} holds {rows:,} rows, not a count from 0 to "
                              f"{MAX_ROWS:,}: the file is damaged or crafted")
        total += rows
    if before + total > MAX_ROWS:
        raise SourceError(f"{path}: its footer declares {total:,} rows, {before + total:,} with the files before it, "
                          f"more than the {MAX_ROWS:,} a conversion takes: the file is damaged or crafted")
    return total


def _difference(a: pa.Schema, b: pa.Schema) -> str:
    for name in dict.fromkeys(a.names + b.names):
        if name not in b.names:
            return f"column {name!r} only in the first"
        if name not in a.names:
            return f"column {name!r} only in the second"
        if not a.field(name).type.equals(b.field(name).type):
            return f"column {name!r} is {a.field(name).type} in the first, {b.field(name).type} in the second"
    return "the same columns in another order"


def null_counts(schema: pa.Schema, metas: list[pq.FileMetaData]) -> dict[str, int | None]:
    """Nulls of each top-level column that is one Parquet leaf (numbers, strings, binary), summed
    over every row group's statistics; None where a row group has no null count (unknown)."""
    out: dict[str, int | None] = {}
    for meta in metas:
        leaves = {meta.schema.column(c).path: c for c in range(meta.num_columns)}
        for name in schema.names:
            c = leaves.get(name)
            if c is None:
                continue
            for g in range(meta.num_row_groups):
                stats = meta.row_group(g).column(c).statistics
                known = out.get(name, 0)
                if stats is None or not stats.has_null_count or known is None:
                    out[name] = None
                else:
                    out[name] = known + stats.null_count
    return out


def column_minimum(infos: list[ParquetFileInfo], metas: list[pq.FileMetaData], column: str) -> int | None:
    """The smallest value of the integer ``column`` over every file: from the row groups' statistics,
    or, in a file without them, from the column itself (one integer column is read). None: no values."""
    low: int | None = None
    for info, meta in zip(infos, metas, strict=True):
        leaves = {meta.schema.column(c).path: c for c in range(meta.num_columns)}
        c = leaves.get(column)
        stats = [meta.row_group(g).column(c).statistics if c is not None else None
                 for g in range(meta.num_row_groups) if meta.row_group(g).num_rows]
        if all(st is not None and st.has_min_max for st in stats):
            values = [int(st.min) for st in stats if st is not None]
        else:
            try:
                values = [v for v in [pc.min(pq.read_table(info.path, columns=[column]).column(column)).as_py()]
                          if v is not None]
            except (pa.ArrowException, OSError) as err:
                raise _unreadable(info.path, err) from None
        if values:
            low = min(values) if low is None else min(low, *values)
    return low


def first_value(info: ParquetFileInfo, column: str) -> Any:
    """The first non-null value of ``column`` in its file's first row group that has one (or None)."""
    f = open_parquet(info.path)
    try:
        for g, rows in enumerate(info.row_groups):
            if rows:
                for batch in f.iter_batches(batch_size=16, row_groups=[g], use_threads=False):
                    for v in batch.column(batch.schema.get_field_index(column)).to_pylist():
                        if v is not None:
                            return v
        return None
    except (pa.ArrowException, OSError) as err:
        raise _unreadable(info.path, err) from None
    finally:
        f.close()


def hf_features(schema: pa.Schema, paths: list[str],
                warnings: list[str] | None = None) -> tuple[dict[str, Any] | None, str]:
    """The Hugging Face ``features`` description of the files and where it was found: the schema
    metadata's ``huggingface`` key (what ``datasets`` writes into every Parquet file), else a
    ``dataset_info.json`` or a ``README.md`` card's ``dataset_info`` beside the first file or in
    the folder above it (a Hub repository's ``data/`` folder). ``(None, "")`` when there is none.

    A sidecar that cannot be trusted to be read (a FIFO, socket, device or directory, a link to
    one, a file over :data:`MAX_SIDECAR_BYTES`, a card whose front matter does not end within
    :data:`MAX_CARD_BYTES`, JSON that would expand past its budget, a ``ClassLabel`` over the
    limits of :func:`~fastdata.writer.sources.parquet.columns.check_class_names`) stops the
    conversion; one that is merely not valid JSON/YAML/UTF-8 is skipped with a line in ``warnings``.

    Raises:
        SourceError: naming the sidecar and what is wrong with it.
    """
    notes = warnings if warnings is not None else []
    raw = (schema.metadata or {}).get(HF_METADATA_KEY)
    if raw:
        where = f"the Parquet schema metadata of {paths[0]}"
        try:
            meta = json_loads_bounded(raw)
            features = meta.get("info", {}).get("features") if isinstance(meta, dict) else None
        except ExpansionError as err:
            raise SourceError(f"{where}: its {HF_METADATA_KEY.decode()} entry {err}") from None
        except (ValueError, AttributeError, RecursionError):
            features = None
        if isinstance(features, dict):
            check_class_names(features, where)
            return features, "the Parquet schema metadata"
    folder = os.path.dirname(os.path.abspath(paths[0]))
    for where in (folder, os.path.dirname(folder)):
        info_file = os.path.join(where, "dataset_info.json")
        features = _features_of_info_json(info_file, notes)
        if features is not None:
            check_class_names(features, info_file)
            return features, info_file
        card = os.path.join(where, "README.md")
        features = _features_of_card(card, notes)
        if features is not None:
            check_class_names(features, card)
            return features, card
    return None, ""


def _sidecar_refused(path: str, err: Exception) -> SourceError:
    return SourceError(f"{err}; remove or replace {path} (read for the class names of the Parquet files) and "
                       "convert again")


def _read_sidecar(path: str, read: Callable[[str], bytes], notes: list[str]) -> bytes | None:
    """``read(path)``: None when the sidecar is missing, or unreadable (a line in ``notes``).

    Raises:
        SourceError: it is not a regular file, or larger than its limit (see :func:`_sidecar_refused`).
    """
    try:
        return read(path)
    except FileNotFoundError:
        return None
    except UnsafeStoreError as err:
        raise _sidecar_refused(path, err) from None
    except OSError as err:
        notes.append(f"{path}: not read ({err.strerror or err}); no class names from it")
        return None


def _features_of_info_json(path: str, notes: list[str]) -> dict[str, Any] | None:
    raw = _read_sidecar(path, lambda p: read_regular(p, MAX_SIDECAR_BYTES, "dataset_info.json"), notes)
    if raw is None:
        return None
    try:
        info = json_loads_bounded(raw)
    except ExpansionError as err:
        raise _sidecar_refused(path, SourceError(f"{path}: {err}")) from None
    except (ValueError, RecursionError) as err:
        notes.append(f"{path}: not valid JSON ({type(err).__name__}); no class names from it")
        return None
    if isinstance(info, dict) and isinstance(info.get("features"), dict):
        return info["features"]
    # one entry per configuration: {"default": {"features": ...}}
    configs = [v for v in info.values() if isinstance(v, dict) and isinstance(v.get("features"), dict)] if isinstance(
        info, dict) else []
    return configs[0]["features"] if len(configs) == 1 else None


def _read_card(path: str) -> bytes:
    """The first :data:`MAX_CARD_BYTES` + 1 bytes of the regular file ``path`` (at most)."""
    fd = open_regular(path, "README.md")
    try:
        chunks: list[bytes] = []
        left = MAX_CARD_BYTES + 1
        while left > 0:
            block = os.read(fd, min(left, 1 << 20))
            if not block:
                break
            chunks.append(block)
            left -= len(block)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _features_of_card(path: str, notes: list[str]) -> dict[str, Any] | None:
    """A dataset card's YAML ``dataset_info.features`` (a list of ``{name, dtype}``) in the
    features form: class labels as ``ClassLabel`` with their names, images as ``Image``."""
    data = _read_sidecar(path, _read_card, notes)
    if data is None:
        return None
    if not data.startswith(b"---"):
        return None
    end = data.find(b"\n---", 3)
    if end < 0 and len(data) > MAX_CARD_BYTES:
        raise _sidecar_refused(path, SourceError(f"{path}: its YAML front matter does not end within the first "
                                                 f"{MAX_CARD_BYTES:,} bytes"))
    try:
        text = data[3:end if end > 0 else None].decode("utf-8")
    except UnicodeDecodeError:
        notes.append(f"{path}: its front matter is not UTF-8; no class names from it")
        return None
    try:
        import yaml  # (PyYAML comes with datasets; without it a card is not read)

        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        card = yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader (C or Python)
    except ImportError:
        return None
    except Exception as err:  # noqa: BLE001 - a card that is not YAML: no features from it
        notes.append(f"{path}: its front matter is not YAML ({type(err).__name__}); no class names from it")
        return None
    info = card.get("dataset_info") if isinstance(card, dict) else None
    if isinstance(info, list):
        info = next((c for c in info if isinstance(c, dict) and c.get("config_name") in (None, "default")),
                    info[0] if len(info) == 1 else None)
    feats = info.get("features") if isinstance(info, dict) else None
    if not isinstance(feats, list):
        return None
    out: dict[str, Any] = {}
    for entry in feats:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            continue
        out[entry["name"]] = _card_feature(entry.get("dtype"), path)
    return out


def _card_feature(dtype: Any, path: str, depth: int = 0) -> Any:
    """One card ``dtype`` as a feature (None: not one fastdata reads); lists nested at most 8 deep,
    class names strings or numbers only (a YAML alias may make any other value huge)."""
    if dtype == "image":
        return {"_type": "Image"}
    if depth > 8:
        return None
    if isinstance(dtype, dict) and isinstance(dtype.get("class_label"), dict):
        names = dtype["class_label"].get("names")
        if isinstance(names, dict | list):
            check_class_names({"_type": "ClassLabel", "names": names}, path)  # (its count, before any copy)
        if isinstance(names, dict):
            try:
                ordered = sorted(((int(k), v) for k, v in names.items()), key=lambda kv: kv[0])
            except (TypeError, ValueError):
                return None
            values = [v for _, v in ordered]
        elif isinstance(names, list):
            values = names
        else:
            return None
        if not all(isinstance(v, str | int | float) and not isinstance(v, bool) for v in values):
            return None
        feature = {"_type": "ClassLabel", "names": [str(v) for v in values]}
        check_class_names(feature, path)
        return feature
    if isinstance(dtype, dict) and "list" in dtype:  # {"list": {"class_label": ...}}
        return {"_type": "List", "feature": _card_feature(dtype["list"], path, depth + 1)}
    if isinstance(dtype, list) and len(dtype) == 1:
        return {"_type": "List", "feature": _card_feature(dtype[0], path, depth + 1)}
    return None
