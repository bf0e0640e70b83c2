"""Adding a field to a store (``fastdata.add_fields``) vs rewriting the store with it, and loading a
store with an added field vs one written with the field from the start (issue 41).

Data: ``--n`` (4000) photo-like JPEGs (``fastdata.synth``, ``--side`` x ``--side``, 128), a label, and a
512-d float16 embedding per sample (random: the embedding model's time is not what is measured).

Row 1, **add vs rewrite** (wall time; the embedding is computed beforehand, so the user's function
costs nothing in either):

* ``rewrite``: ``fastdata.write`` of every sample with ``{image, label, clip}`` into a new store: the
  samples already in memory, so this is a lower bound of a real rewrite, which also reads the store;
* ``add``: ``fastdata.add_fields(store, {"clip": embeddings})`` on the store written without ``clip``.

Each is run ``--rounds`` (3) times alternately; the ratio is the median ``add`` over the median
``rewrite``. Target: <= 5%. Also reported: the bytes the add wrote beyond the embedding's own
(``N x 1024``): the field files' headers, alignment and checksums.

Row 2, **loading**: both stores (``written``: ``clip`` in the schema from the start; ``added``: written
without it, then ``add_fields``) read through the same pipeline, ``fastdata.loader`` with
``--workers`` (2) worker processes, batch 64, shuffled, ``output="tensor"`` (each image fully decoded,
the embedding a tensor in the batch), from the page cache. After a warm-up epoch of each, epochs
alternate for ``--rounds`` rounds; the ratio is the median of the rounds' own ``added / written``
ratios of samples/s. Target: >= 0.95x.

Usage::

    python benchmarks/bench_add_fields.py                     # 4000 samples
    python benchmarks/bench_add_fields.py --n 400 --rounds 2  # a quick check that it works
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ADD_TARGET = 0.05
LOAD_TARGET = 0.95
DIM = 512


def samples(n: int, side: int, seed: int = 0) -> tuple[list[dict], object]:
    """``n`` samples ``{image: JPEG bytes, label}`` and an ``n x 512`` float16 embedding array."""
    import numpy as np
    from PIL import Image

    from fastdata.tools.synth import render_photo

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        pixels = render_photo(rng, side, side, rng.random(3) * 0.5 + 0.5)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", quality=90)
        out.append({"image": buf.getvalue(), "label": i % 10})
    return out, rng.standard_normal((n, DIM)).astype(np.float16)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def epoch(ld) -> tuple[int, float]:
    t0 = time.perf_counter()
    count = 0
    for batch in ld:
        count += len(batch["label"])
    return count, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=4000)
    p.add_argument("--side", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--data", help="working folder (default: a temporary one, removed)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)

    import numpy as np

    import fastdata

    base = Path(args.data or tempfile.mkdtemp(prefix="bench-add-fields-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        data, emb = samples(args.n, args.side)
        with_clip = [dict(s, clip=emb[i]) for i, s in enumerate(data)]
        schema = {"image": fastdata.fields.Image(), "label": fastdata.fields.Int(),
                  "clip": fastdata.fields.NDArray("float16", (DIM,))}
        plain = str(base / "plain.lmdb")
        fastdata.write(data, plain, overwrite=True, progress=False)
        rewrite_s, add_s, extra = [], [], []
        for r in range(args.rounds):
            target = str(base / "rewritten.lmdb")
            rewrite_s.append(timed(lambda: fastdata.write(with_clip, target, schema=schema,  # noqa: B023
                                                          overwrite=True, progress=False)))
            added = str(base / f"added-{r}.lmdb")
            shutil.rmtree(added, ignore_errors=True)
            shutil.copytree(plain, added)
            before = dir_bytes(added)
            add_s.append(timed(lambda: fastdata.add_fields(added, {"clip": emb})))  # noqa: B023 (called at once)
            extra.append(dir_bytes(added) - before - emb.nbytes)
            print(f"round {r + 1}: rewrite {rewrite_s[-1]:.3f} s, add {add_s[-1]:.4f} s", flush=True)
        add_ratio = statistics.median(add_s) / statistics.median(rewrite_s)
        written, added = str(base / "rewritten.lmdb"), str(base / "added-0.lmdb")
        manifest_growth = extra[0]

        def make(path):
            return fastdata.loader(fastdata.open_dataset(path, output="tensor"), batch_size=64,
                                   num_workers=args.workers, seed=0)

        for path in (written, added):  # warm-up epochs (page cache, imports, worker start-up)
            epoch(make(path))
        rates: dict[str, list[float]] = {"written": [], "added": []}
        for r in range(args.rounds):
            for name, path in (("written", written), ("added", added)):
                count, secs = epoch(make(path))
                assert count == args.n
                rates[name].append(count / secs)
            print(f"round {r + 1}: written {rates['written'][-1]:.0f}/s, added {rates['added'][-1]:.0f}/s", flush=True)
        load_ratio = statistics.median(a / w for a, w in zip(rates["added"], rates["written"], strict=True))
        check = fastdata.open_dataset(added)
        assert np.array_equal(check.column("clip"), emb)
        result = {
            "n": args.n, "side": args.side, "rounds": args.rounds, "workers": args.workers,
            "rewrite_s": rewrite_s, "add_s": add_s, "add_over_rewrite": add_ratio,
            "added_bytes_beyond_values": manifest_growth, "embedding_bytes": int(emb.nbytes),
            "load_written_per_s": rates["written"], "load_added_per_s": rates["added"], "load_ratio": load_ratio,
        }
        print(f"\nadd vs rewrite: add {statistics.median(add_s):.4f} s, rewrite {statistics.median(rewrite_s):.3f} s "
              f"(medians): {add_ratio:.2%} (target <= {ADD_TARGET:.0%})")
        print(f"disk: {emb.nbytes:,} bytes of embedding, {manifest_growth:,} bytes more (field file headers, "
              "alignment, the manifest's growth)")
        print(f"loading: written {statistics.median(rates['written']):.0f}/s, added "
              f"{statistics.median(rates['added']):.0f}/s: {load_ratio:.3f}x (target >= {LOAD_TARGET}x)")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return 0 if add_ratio <= ADD_TARGET and load_ratio >= LOAD_TARGET else 1
    finally:
        if not args.data:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
