"""Reading a published store back through fastdata's own shard readers."""

from __future__ import annotations

import os


def store_records(dst) -> tuple[dict, list[dict]]:
    """Read a published store back through fastdata's shard readers.

    Returns ``(manifest, records)``; each record is a dict with ``image``
    (stored bytes, checksum-verified), ``label``, ``width``, ``height``, ``fmt``,
    ``relpath`` (str), ``shard`` and ``local`` index, in store order.
    """
    from fastdata.format.backends.base import StorageSpec
    from fastdata.format.backends.registry import reader_class
    from fastdata.format.manifest import read_manifest
    from fastdata.format.record import FORMAT_NAMES

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
                    "shard": shard["name"],
                    "local": i,
                })
    return manifest, records
