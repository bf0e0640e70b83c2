"""Parquet files in the Hugging Face Hub's layout (an image ``struct<bytes, path>`` column and a
``ClassLabel`` in the ``huggingface`` schema metadata), written by pyarrow alone, and the store
read back for comparison (the tests that use these import pyarrow or skip)."""

from __future__ import annotations

import json
import os

import numpy as np
from helpers.samples import jpeg

#: the class names of the label column
NAMES = ["airplane", "bird", "cat"]


def hf_rows(n: int, seed: int = 0) -> dict[str, list]:
    """``n`` rows of every column kind: image structs with JPEG bytes, a ClassLabel label, ints,
    floats with a NaN, captions, ragged boxes, fixed-size embeddings and a nested struct."""
    rng = np.random.default_rng(seed)
    return {
        "image": [{"bytes": jpeg(seed * 1000 + i, size=(12 + i % 5, 10)), "path": f"img_{i:04d}.jpg"}
                  for i in range(n)],
        "label": [i % len(NAMES) for i in range(n)],
        "idx": [i * 3 - 7 for i in range(n)],
        "score": [float("nan") if i == 1 else float(np.float32(i / 7)) for i in range(n)],
        "caption": [f"photo {i} \N{SNOWMAN}" for i in range(n)],
        "boxes": [rng.random((i % 3, 4)).astype(np.float32).tolist() for i in range(n)],
        "embedding": [rng.standard_normal(3).astype(np.float32).tolist() for i in range(n)],
        "meta": [{"id": i, "tags": ["a", "b"][: i % 3]} for i in range(n)],
    }


def hf_table(rows: dict[str, list]):
    """The rows as an Arrow table of the Hub's types, its features in the ``huggingface`` metadata."""
    import pyarrow as pa

    types = {
        "image": pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
        "label": pa.int64(),
        "idx": pa.int32(),
        "score": pa.float32(),
        "caption": pa.string(),
        "boxes": pa.list_(pa.list_(pa.float32(), 4)),
        "embedding": pa.list_(pa.float32(), 3),
        "meta": pa.struct([("id", pa.int64()), ("tags", pa.list_(pa.string()))]),
    }
    features = {
        "image": {"_type": "Image"},
        "label": {"names": NAMES, "_type": "ClassLabel"},
        "idx": {"dtype": "int32", "_type": "Value"},
        "score": {"dtype": "float32", "_type": "Value"},
        "caption": {"dtype": "string", "_type": "Value"},
    }
    names = [n for n in types if n in rows]
    table = pa.table({n: pa.array(rows[n], type=types[n]) for n in names})
    meta = {b"huggingface": json.dumps({"info": {"features": {k: v for k, v in features.items() if k in rows}}})}
    return table.replace_schema_metadata(meta)


def write_hf_parquet(path, rows: dict[str, list], row_group_size: int = 4) -> str:
    """Write ``rows`` to ``path`` as the Hub lays them out, ``row_group_size`` rows per row group."""
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(str(path)) or ".", exist_ok=True)
    pq.write_table(hf_table(rows), str(path), row_group_size=row_group_size)
    return str(path)


def decoded_rgb(data: bytes) -> np.ndarray:
    """An encoded image as an RGB array (how two images are compared)."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))
