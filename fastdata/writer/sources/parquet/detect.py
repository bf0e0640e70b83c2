"""Which inputs are Parquet files or Hugging Face ``datasets`` objects, without importing
pyarrow or ``datasets`` (``fastdata`` never imports either unless such an input is given)."""

from __future__ import annotations

import glob
import os
import re
from typing import Any

from fastdata.errors import SourceError

__all__ = ["PARQUET_SUFFIX", "hf_kind", "parquet_files", "split_of"]

PARQUET_SUFFIX = ".parquet"
#: the file names the Hugging Face Hub gives a split's shards: ``train-00000-of-00004.parquet``
_HUB_SHARD = re.compile(r"^(?P<split>.+?)-\d{5}-of-\d{5}\.parquet$", re.IGNORECASE)
#: the class names of the ``datasets`` objects fastdata.write takes
HF_CLASSES = ("Dataset", "DatasetDict", "IterableDataset", "IterableDatasetDict")


def _is_parquet(name: str) -> bool:
    return name.lower().endswith(PARQUET_SUFFIX)


def split_of(name: str) -> str | None:
    """The split a Hub-named shard file holds (``train`` of ``train-00000-of-00004.parquet``), else None."""
    match = _HUB_SHARD.match(os.path.basename(name))
    return match.group("split") if match else None


def parquet_files(src: str) -> list[str] | None:
    """The Parquet files ``src`` names, in sorted order, or None when ``src`` is not a Parquet source.

    ``src`` is a ``.parquet`` file, a folder holding ``.parquet`` files (directly inside it), or a
    glob (``data/train-*.parquet``) matching such files.

    Raises:
        SourceError: a glob that matches no file; a folder holding several splits' Hub-named files
            (``train-...``, ``test-...``), which would be mixed into one store.
    """
    if glob.has_magic(src):
        matches = sorted(p for p in glob.glob(src) if os.path.isfile(p))
        if not matches:
            if _is_parquet(src):
                raise SourceError(f"no file matches {src}")
            return None
        if not all(_is_parquet(p) for p in matches):
            if _is_parquet(src) or any(_is_parquet(p) for p in matches):
                other = next(p for p in matches if not _is_parquet(p))
                raise SourceError(f"{src} matches {other}, which is not a .parquet file")
            return None
        return matches
    if _is_parquet(src) and not os.path.isdir(src):
        return [src]
    if not os.path.isdir(src):
        return None
    try:
        names = sorted(n for n in os.listdir(src) if _is_parquet(n) and os.path.isfile(os.path.join(src, n)))
    except OSError:
        return None
    if not names:
        return None
    splits = sorted({s for s in map(split_of, names) if s is not None})
    if len(splits) > 1:
        raise SourceError(f"{src} holds the files of several splits ({', '.join(splits)}): convert one split per "
                          f"store, e.g. '{os.path.join(src, splits[0] + '-*.parquet')}'")
    return [os.path.join(src, n) for n in names]


def hf_kind(obj: Any) -> str | None:
    """``"Dataset"``, ``"DatasetDict"``, ``"IterableDataset"`` or ``"IterableDatasetDict"`` when
    ``obj`` is (a subclass of) that ``datasets`` class, else None. Decided from the classes'
    module names, so ``datasets`` is never imported here."""
    for cls in type(obj).__mro__:
        if cls.__module__.split(".")[0] == "datasets" and cls.__name__ in HF_CLASSES:
            return cls.__name__
    return None
