"""Reading a published store back through fastdata's own shard readers; small ImageFolder trees."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image


def store_records(dst) -> tuple[dict, list[dict]]:
    """Read a published store back through fastdata's shard readers.

    Returns ``(manifest, records)``; each record is a dict with ``image``
    (stored bytes, checksum-verified), ``label``, ``width``, ``height``, ``fmt``,
    ``relpath`` (str), ``dtype`` and ``channels`` (None: not recorded), ``shard`` and ``local``
    index, in store order.
    """
    from fastdata.format.backends.base import StorageSpec
    from fastdata.format.backends.registry import reader_class
    from fastdata.format.manifest import read_manifest
    from fastdata.format.record import FORMAT_NAMES, IMAGE_DTYPE_NAMES

    manifest = read_manifest(str(dst))
    storage = StorageSpec.from_json(manifest["storage"])
    records = []
    for shard in manifest["shards"]:
        with reader_class(manifest["backend"])(os.path.join(str(dst), shard["name"]), storage) as reader:
            index = reader.read_index()
            assert len(index) == shard["count"]
            for i in range(len(index)):
                records.append({
                    "image": reader.get(i),
                    "label": int(index.labels[i]),
                    "width": int(index.widths[i]),
                    "height": int(index.heights[i]),
                    "fmt": FORMAT_NAMES[int(index.formats[i])],
                    "relpath": os.fsdecode(index.relpath(i)),
                    "dtype": IMAGE_DTYPE_NAMES.get(int(index.dtypes[i])),
                    "channels": int(index.channels[i]) or None,
                    "shard": shard["name"],
                    "local": i,
                })
    return manifest, records


def general_records(dst, *, index: bool = False) -> list[dict]:
    """A general (version-2) store's records in store order, decoded from the shards directly (image
    fields as stored bytes). ``index``: add each record's index entries, keyed without the
    ``fields/`` prefix (``label``, ``image.format``, ``image.dtype``, ...), as stored (codes)."""
    from fastdata.format.backends.base import StorageSpec
    from fastdata.format.backends.registry import reader_class
    from fastdata.format.manifest import read_manifest, schema_of
    from fastdata.format.record import FIELD_PREFIX, decode_record_v2

    manifest = read_manifest(str(dst))
    schema = schema_of(manifest)
    out = []
    for shard in manifest["shards"]:
        with reader_class(manifest["backend"])(os.path.join(str(dst), shard["name"]), StorageSpec(),
                                               schema=schema) as reader:
            arrays = reader.read_index().arrays
            for i in range(shard["count"]):
                rec = decode_record_v2(reader.get(i), schema, where=f"{shard['name']} record {i}")
                if index:
                    for key, arr in arrays.items():
                        if key.startswith(FIELD_PREFIX):
                            rec[key[len(FIELD_PREFIX):]] = arr[i].tolist() if arr.ndim > 1 else arr[i].item()
                out.append(rec)
    return out


def make_folder(root: Path, classes: dict[str, int], seed: int, size=(20, 24)) -> Path:
    """An ImageFolder tree of distinct noise JPEGs: ``classes`` maps a class name to its count."""
    rng = np.random.default_rng(seed)
    for name, count in classes.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            pixels = rng.integers(0, 255, (*size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"s{seed}_{i:03d}.jpg", quality=95)
    return root


def files_of(folder: Path) -> list[tuple[str, bytes]]:
    """(class name, file bytes) of every image, in ImageFolder's order."""
    out = []
    for name in sorted(os.listdir(folder)):
        for f in sorted(os.listdir(folder / name)):
            out.append((name, (folder / name / f).read_bytes()))
    return out
