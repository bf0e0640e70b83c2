"""What the per-sample random generator costs next to the decode it seeds.

Every sample's crop is drawn from ``fastdata.reader.seeding.sample_rng(seed, epoch, index)``,
a fresh generator per sample (that is what makes crops independent of workers, batch size
and start method). This prints the cost of making one against the cost of decoding one
small JPEG with ``transforms.RandomResizedCrop``, best of 3 rounds of ``--calls`` each; the
generator should cost well under half a decode.

    python benchmarks/bench_seeding.py [--calls 300]
"""

from __future__ import annotations

import argparse
import io
import time

import numpy as np
from PIL import Image

from fastdata import transforms
from fastdata.reader.seeding import sample_rng


def per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="calls per round (default 300)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (40, 100, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    data = buf.getvalue()
    crop = transforms.RandomResizedCrop(16)
    decode = min(per_call(lambda i: crop(data, rng), args.calls) for _ in range(3))
    make = min(per_call(lambda i: sample_rng(1234, 3, i), args.calls) for _ in range(3))
    print(f"decode + crop of a 100x40 JPEG: {decode * 1e6:8.1f} us")
    print(f"sample_rng(seed, epoch, index): {make * 1e6:8.1f} us  ({make / decode:.2f}x a decode)")


if __name__ == "__main__":
    main()
