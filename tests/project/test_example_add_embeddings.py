"""examples/add_embeddings.py runs end to end (in this process, without worker processes: the
loader paths with workers are the reader tests' business; with torchvision installed it embeds with
resnet18, else with the example's tiny CNN)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_add_embeddings_example(tmp_path):
    spec = importlib.util.spec_from_file_location("add_embeddings", ROOT / "examples" / "add_embeddings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    summary = module.main(["--per-class", "4", "--classes", "3", "--workers", "0", "--hard", "0.5",
                           "--workdir", str(tmp_path)])
    assert summary["samples"] == 12 and summary["hard"] == 6 and summary["read"] == 6
    assert summary["shards_unchanged"] and summary["verified"]
    assert summary["embedding_shape"] == [6, 512]
    assert summary["columns"][:1] == ["label"] and {"clip", "loss"} <= set(summary["columns"])
