"""The Parquet files of a conversion, from their footers alone (no row is read here but the
first value of a binary column that may hold images): each file's row groups, one schema for
all files, the null counts of the statistics, and the Hugging Face ``features`` (class names)
from the schema metadata or a ``dataset_info.json``/``README.md`` beside the files."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from fastdata.errors import SourceError

__all__ = ["ParquetFileInfo", "read_footers", "hf_features", "null_counts", "first_value", "open_parquet",
           "column_minimum"]

#: the schema metadata key ``datasets`` writes its features under
HF_METADATA_KEY = b"huggingface"


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
        if schema is None:
            schema = file_schema
        elif not file_schema.remove_metadata().equals(schema.remove_metadata()):
            raise SourceError(f"{paths[0]} and {path} have different columns ({_difference(schema, file_schema)}): "
                              "convert files of one schema into one store")
        groups = tuple(meta.row_group(g).num_rows for g in range(meta.num_row_groups))
        sizes = tuple(sum(meta.row_group(g).column(c).total_compressed_size for c in range(meta.num_columns))
                      for g in range(meta.num_row_groups))
        infos.append(ParquetFileInfo(os.path.abspath(path), st.st_size, st.st_mtime_ns, groups, sizes))
        metas.append(meta)
    assert schema is not None, "parquet_files never gives an empty list"
    return infos, schema, metas


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


def hf_features(schema: pa.Schema, paths: list[str]) -> tuple[dict[str, Any] | None, str]:
    """The Hugging Face ``features`` description of the files and where it was found: the schema
    metadata's ``huggingface`` key (what ``datasets`` writes into every Parquet file), else a
    ``dataset_info.json`` or a ``README.md`` card's ``dataset_info`` beside the first file or in
    the folder above it (a Hub repository's ``data/`` folder). ``(None, "")`` when there is none."""
    raw = (schema.metadata or {}).get(HF_METADATA_KEY)
    if raw:
        try:
            features = json.loads(raw).get("info", {}).get("features")
            if isinstance(features, dict):
                return features, "the Parquet schema metadata"
        except (ValueError, AttributeError):
            pass
    folder = os.path.dirname(os.path.abspath(paths[0]))
    for where in (folder, os.path.dirname(folder)):
        info_file = os.path.join(where, "dataset_info.json")
        features = _features_of_info_json(info_file)
        if features is not None:
            return features, info_file
        card = os.path.join(where, "README.md")
        features = _features_of_card(card)
        if features is not None:
            return features, card
    return None, ""


def _features_of_info_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as fh:
            info = json.load(fh)
    except (OSError, ValueError):
        return None
    if isinstance(info, dict) and isinstance(info.get("features"), dict):
        return info["features"]
    # one entry per configuration: {"default": {"features": ...}}
    configs = [v for v in info.values() if isinstance(v, dict) and isinstance(v.get("features"), dict)] if isinstance(
        info, dict) else []
    return configs[0]["features"] if len(configs) == 1 else None


def _features_of_card(path: str) -> dict[str, Any] | None:
    """A dataset card's YAML ``dataset_info.features`` (a list of ``{name, dtype}``) in the
    features form: class labels as ``ClassLabel`` with their names, images as ``Image``."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read(1 << 20)
    except (OSError, UnicodeDecodeError):
        return None
    if not text.startswith("---"):
        return None
    end = text.find("\n---", 3)
    try:
        import yaml  # (PyYAML comes with datasets; without it a card is not read)

        card = yaml.safe_load(text[3:end if end > 0 else None])
    except Exception:  # noqa: BLE001 - no yaml, or a card that is not YAML: no features from it
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
        out[entry["name"]] = _card_feature(entry.get("dtype"))
    return out


def _card_feature(dtype: Any) -> Any:
    if dtype == "image":
        return {"_type": "Image"}
    if isinstance(dtype, dict) and isinstance(dtype.get("class_label"), dict):
        names = dtype["class_label"].get("names")
        if isinstance(names, dict):
            ordered = sorted(names.items(), key=lambda kv: int(kv[0]))
            return {"_type": "ClassLabel", "names": [str(v) for _, v in ordered]}
        if isinstance(names, list):
            return {"_type": "ClassLabel", "names": [str(v) for v in names]}
    if isinstance(dtype, dict) and "list" in dtype:  # {"list": {"class_label": ...}}
        return {"_type": "List", "feature": _card_feature(dtype["list"])}
    if isinstance(dtype, list) and len(dtype) == 1:
        return {"_type": "List", "feature": _card_feature(dtype[0])}
    return None
