"""Image lists (JSONL rows with every JSON kind) written beside their images, for the list sources' tests."""

from __future__ import annotations

import json
from pathlib import Path

from helpers.images import make_jpeg


def jsonl_rows(n: int) -> list[dict]:
    """Rows with every JSON kind: ints, floats, strings, ragged boxes, objects, one class
    label and a multi-label list (``labels``), some of it empty."""
    return [{"path": f"img/{i}.jpg", "n": i * 7 - 3, "score": i / 3, "caption": f"photo {i} é",
             "boxes": [[i + 0.25, 2.5, 30.125, 40.0]] * (i % 3), "meta": {"id": i, "tags": ["a"] * (i % 2)},
             "label": ["cat", "dog", "bird"][i % 3], "labels": [["x"], ["y", "x"], []][i % 3]}
            for i in range(n)]


def write_list(tmp_path: Path, rows: list[dict], name: str = "rows.jsonl") -> Path:
    """Each row's JPEG at its ``path`` under ``tmp_path``, and the rows as the JSONL list ``name``
    there; returns the list's path."""
    for i, row in enumerate(rows):
        make_jpeg(tmp_path / row["path"], size=(24 + i, 16), seed=i)
    lst = tmp_path / name
    lst.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return lst
