"""What the framework examples share: a tiny store to train on, and a record of what each rank saw.

``make_store(path)`` writes ``n`` random 32x32 RGB images, each with its ``index`` as a field, so
that a run can tell which samples every rank received; ``StepLog`` appends one JSON line per
training step (epoch, step, the batch's sample indices and a digest of each augmented image) to
``<log_dir>/rank<r>.jsonl``, which the tests read to check that every sample arrives exactly once
per epoch and that random crops change from epoch to epoch.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
from PIL import Image

import fastdata


def make_store(path: str | os.PathLike, n: int = 300, seed: int = 0) -> Path:
    """Write ``n`` noise images (32x32 RGB, with an ``index`` field) to ``path`` unless it exists."""
    path = Path(path)
    if not (path / "manifest.json").exists():
        rng = np.random.default_rng(seed)
        samples = [{"image": Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)), "index": i}
                   for i in range(n)]
        fastdata.write(samples, path, progress=False, workers=1)
    return path


class StepLog:
    """One JSON line per training step in ``<log_dir>/rank<rank>.jsonl`` (nothing when ``log_dir`` is None)."""

    def __init__(self, log_dir: str | os.PathLike | None, rank: int) -> None:
        self.path = None if log_dir is None else Path(log_dir) / f"rank{rank}.jsonl"
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, epoch: int, step: int, indices, images) -> None:
        if self.path is None:
            return
        crops = [hashlib.blake2b(np.ascontiguousarray(image).tobytes(), digest_size=8).hexdigest()
                 for image in images.cpu().numpy()]
        line = {"epoch": int(epoch), "step": int(step), "index": [int(i) for i in indices], "crop": crops}
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
