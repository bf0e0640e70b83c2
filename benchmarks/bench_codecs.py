"""Chunk codecs for N-D array fields: compression ratio, one-thread speed and import cost.

Picks the default codec of the chunked array field kind by measurement. The data:

* 3-D: a CT-like uint16 volume (``fastdata.tools.synth_volumes.ct_volume``: zero padding
  outside the field of view, air, body, organs, bone, noise of 5 units), cut into
  independently compressed chunks (default 256^3 in 64^3 chunks of 512 KiB);
* 2-D: a photo-like uint8 RGB image (smooth colour fields, hard-edged shapes, texture and
  grain of a few units; numpy only, generated here) cut into (256, 256, 3) chunks, as a
  whole-slide image would be, to check that the default is not bad for 8-bit data.

For every candidate (numcodecs Blosc with zstd/lz4 and no shuffle / byte shuffle /
bitshuffle at a few levels, with Blosc's automatic block size and with 256 KiB blocks,
Blosc's own blosclz with byte shuffle and 256 KiB blocks, numcodecs Zstd and LZ4, the ``blosc2``
package, plain ``zstandard``) it measures, on one
thread (Blosc's thread pools set to 1):

* ratio: raw bytes / stored bytes over all chunks (each codec's own framing included);
* compress and decompress MB/s (10^6 raw bytes per second): one chunk per call, the whole
  chunk list timed per pass, median over ``--repeats`` passes; the passes of all candidates
  are interleaved round by round, so that load from other processes does not favour some;
  decompression goes through each library's plain call that returns a new buffer, as a
  reader would; every chunk's round trip is checked once;
* import ms: the codec's module imported in a fresh interpreter that has already imported
  numpy (fastdata always has), median of ``--import-repeats`` runs, with the third-party
  packages the import pulls in.

Codecs that are not installed are reported as skipped. The output is Markdown: one table
per data kind sorted by ratio, then the recommendation rule and what it picks.

Usage::

    PYTHONPATH=. python benchmarks/bench_codecs.py                       # 256^3 in 64^3 chunks, ~6 min on 2 cores
    PYTHONPATH=. python benchmarks/bench_codecs.py --shape 512 512 512 --repeats 3 --exclude clevel=9,level=9
    PYTHONPATH=. python benchmarks/bench_codecs.py --only blosc --skip-2d   # names containing "blosc", 3-D only

It needs numpy and the codecs it measures (``pip install numcodecs zstandard lz4 blosc2``),
not torch nor OpenCV.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastdata.tools.synth_volumes import ct_volume  # noqa: E402

Encode = Callable[[np.ndarray], bytes]
Decode = Callable[[bytes], Any]

#: an explicit Blosc block: half of a 64^3 uint16 chunk (smaller chunks are one block)
_BIG_BLOCK = 256 * 1024
#: packages whose versions the report names
_VERSIONED = ("numpy", "numcodecs", "blosc2", "zstandard", "lz4")


@dataclass(frozen=True)
class Candidate:
    """One codec configuration.

    Attributes:
        name: the row's name (library and codec).
        params: its parameters, as a user would write them.
        module: what a reader imports to use it (timed in a fresh interpreter).
        make: returns ``(encode, decode)``; raises ImportError when the library is missing.
    """

    name: str
    params: str
    module: str
    make: Callable[[], tuple[Encode, Decode]]


@dataclass
class Result:
    """What one candidate measured on one data kind (``None`` fields: skipped)."""

    name: str
    params: str
    module: str
    ratio: float | None = None
    compress_mbps: float | None = None
    decompress_mbps: float | None = None
    stored_bytes: int | None = None
    skipped: str | None = None
    compress_runs_s: list[float] = field(default_factory=list)
    decompress_runs_s: list[float] = field(default_factory=list)


# --------------------------------------------------------------------------- candidates


def _numcodecs_blosc(cname: str, clevel: int, shuffle: str, blocksize: int = 0) -> Callable[[], tuple[Encode, Decode]]:
    def make() -> tuple[Encode, Decode]:
        numcodecs = importlib.import_module("numcodecs")  # optional, and without type information
        numcodecs.blosc.set_nthreads(1)  # one thread: readers decode in DataLoader workers, one chunk each
        blosc = numcodecs.Blosc
        modes = {"noshuffle": blosc.NOSHUFFLE, "shuffle": blosc.SHUFFLE, "bitshuffle": blosc.BITSHUFFLE}
        codec = blosc(cname=cname, clevel=clevel, shuffle=modes[shuffle], blocksize=blocksize)
        return codec.encode, codec.decode

    return make


def _numcodecs_zstd(level: int) -> Callable[[], tuple[Encode, Decode]]:
    def make() -> tuple[Encode, Decode]:
        codec = importlib.import_module("numcodecs").Zstd(level=level)
        return codec.encode, codec.decode

    return make


def _numcodecs_lz4(acceleration: int) -> Callable[[], tuple[Encode, Decode]]:
    def make() -> tuple[Encode, Decode]:
        codec = importlib.import_module("numcodecs").LZ4(acceleration=acceleration)
        return codec.encode, codec.decode

    return make


def _blosc2(codec_name: str, clevel: int, filter_names: tuple[str, ...]) -> Callable[[], tuple[Encode, Decode]]:
    def make() -> tuple[Encode, Decode]:
        blosc2 = importlib.import_module("blosc2")  # optional, and without type information
        blosc2.set_nthreads(1)
        codec = getattr(blosc2.Codec, codec_name.upper())
        filters = [getattr(blosc2.Filter, f.upper()) for f in filter_names]

        def encode(chunk: np.ndarray) -> bytes:
            return blosc2.compress2(chunk, codec=codec, clevel=clevel, typesize=chunk.itemsize, filters=filters,
                                    filters_meta=[0] * len(filters), nthreads=1)

        def decode(buf: bytes) -> Any:
            return blosc2.decompress2(buf, nthreads=1)

        return encode, decode

    return make


def _zstandard(level: int) -> Callable[[], tuple[Encode, Decode]]:
    def make() -> tuple[Encode, Decode]:
        zstandard = importlib.import_module("zstandard")
        # one (de)compressor per codec, reused across chunks, as a reader would keep it
        compressor, decompressor = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()

        def encode(chunk: np.ndarray) -> bytes:
            return compressor.compress(chunk)

        def decode(buf: bytes) -> Any:
            return decompressor.decompress(buf)

        return encode, decode

    return make


def candidates() -> list[Candidate]:
    """Every configuration measured, numcodecs Blosc first."""
    out: list[Candidate] = []
    for cname, levels in (("zstd", (1, 3, 5, 9)), ("lz4", (1, 5, 9))):
        for shuffle in ("noshuffle", "shuffle", "bitshuffle"):
            for clevel in levels:
                params = f"cname={cname!r}, clevel={clevel}, shuffle={shuffle.upper()}"
                out.append(Candidate(f"numcodecs.Blosc {cname} {shuffle}", params, "numcodecs",
                                     _numcodecs_blosc(cname, clevel, shuffle)))
    # Blosc's automatic block grows with clevel (32 KiB at zstd clevel 1, 256 KiB at 5 for 2-byte
    # items): larger blocks at a low level separate block size from zstd level (clevel 1 is zstd
    # level 1, 3 is 5, 5 is 9, 9 is 22)
    for cname, shuffle, clevel in (("zstd", "shuffle", 1), ("zstd", "shuffle", 3), ("zstd", "bitshuffle", 1),
                                   ("lz4", "shuffle", 5), ("lz4", "bitshuffle", 5), ("blosclz", "shuffle", 1),
                                   ("blosclz", "shuffle", 5)):
        params = f"cname={cname!r}, clevel={clevel}, shuffle={shuffle.upper()}, blocksize={_BIG_BLOCK}"
        out.append(Candidate(f"numcodecs.Blosc {cname} {shuffle}", params, "numcodecs",
                             _numcodecs_blosc(cname, clevel, shuffle, _BIG_BLOCK)))
    # level 0 is zstd's default (3): zarr 3's default codec for numeric arrays
    for level in (1, 3, 9):
        out.append(Candidate("numcodecs.Zstd", f"level={level}", "numcodecs", _numcodecs_zstd(level)))
    out.append(Candidate("numcodecs.LZ4", "acceleration=1", "numcodecs", _numcodecs_lz4(1)))
    for codec_name, clevel, filters in (("zstd", 1, ("shuffle",)), ("zstd", 5, ("shuffle",)),
                                        ("zstd", 5, ("shuffle", "bytedelta")), ("zstd", 5, ("bitshuffle",)),
                                        ("lz4", 5, ("shuffle",))):
        out.append(Candidate(f"blosc2 {codec_name} {'+'.join(filters)}", f"codec={codec_name.upper()}, "
                             f"clevel={clevel}, filters={'+'.join(f.upper() for f in filters)}", "blosc2",
                             _blosc2(codec_name, clevel, filters)))
    for level in (1, 3, 9):
        out.append(Candidate("zstandard", f"level={level}", "zstandard", _zstandard(level)))
    return out


# --------------------------------------------------------------------------- data


def chunked(array: np.ndarray, chunks: tuple[int, ...]) -> list[np.ndarray]:
    """Cut ``array`` into C-contiguous chunks (edge chunks smaller), in C order of the chunk grid.

    Args:
        array (numpy.ndarray): the data.
        chunks (tuple[int, ...]): chunk shape, one entry per leading axis of ``array`` (trailing
            axes are whole in every chunk).

    Returns:
        list[numpy.ndarray]: the chunks, each a contiguous copy (the copy is not timed).
    """
    grid = [range(0, n, c) for n, c in zip(array.shape, chunks, strict=False)]
    out: list[np.ndarray] = []

    def walk(prefix: tuple[slice, ...], depth: int) -> Iterator[tuple[slice, ...]]:
        if depth == len(grid):
            yield prefix
            return
        for start in grid[depth]:
            yield from walk(prefix + (slice(start, start + chunks[depth]),), depth + 1)

    for index in walk((), 0):
        out.append(np.ascontiguousarray(array[index]))
    return out


def photo_like_rgb(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A photo-like uint8 RGB image from numpy alone: what an 8-bit whole-slide or photo chunk holds.

    Smooth colour octaves (bilinear upsampling of coarse random grids), a few dozen hard-edged
    discs and rectangles, mid-frequency texture and grain of a few units: lossless codecs see
    the edges and the noise floor of a real photograph, not a flat field.

    Args:
        height (int): rows.
        width (int): columns.
        seed (int): the image is a pure function of (height, width, seed).

    Returns:
        numpy.ndarray: uint8 of shape (height, width, 3).
    """
    rng = np.random.default_rng([seed, 0xF070])

    def upsample(cells_y: int, cells_x: int, channels: int) -> np.ndarray:
        # separable linear interpolation as two small matrix products: fast at any image size
        grid = rng.standard_normal((cells_y, cells_x, channels)).astype(np.float32)

        def weights(n: int, cells: int) -> np.ndarray:
            pos = np.linspace(0, cells - 1, n, dtype=np.float32)
            lo = np.minimum(pos.astype(np.int64), cells - 2)
            frac = pos - lo
            w = np.zeros((n, cells), np.float32)
            w[np.arange(n), lo] = 1 - frac
            w[np.arange(n), lo + 1] = frac
            return w

        wy, wx = weights(height, cells_y), weights(width, cells_x)
        return np.stack([wy @ grid[:, :, c] @ wx.T for c in range(channels)], axis=-1)

    img = np.full((height, width, 3), 128.0, np.float32) + rng.uniform(-30, 30, 3).astype(np.float32)
    amplitude = 40.0
    for cells in (3, 6, 12, 24):
        img += amplitude * upsample(cells, max(2, round(cells * width / height)), 3)
        amplitude *= 0.55
    yy, xx = np.arange(height)[:, None], np.arange(width)[None, :]
    for _ in range(max(8, height * width // 100_000)):
        colour = rng.uniform(20, 235, 3).astype(np.float32)
        cy, cx = int(rng.integers(0, height)), int(rng.integers(0, width))
        size = int(rng.integers(8, max(9, min(height, width) // 6)))
        ys, xs = slice(max(0, cy - size), cy + size), slice(max(0, cx - size), cx + size)
        region = img[ys, xs]  # a view: the shape is painted in place
        if rng.random() < 0.5:  # a disc, else the whole square
            inside = (yy[ys] - cy) ** 2 + (xx[:, xs] - cx) ** 2 <= size * size
        else:
            inside = np.ones(region.shape[:2], bool)
        region[inside] = 0.3 * region[inside] + 0.7 * colour
    img += 6.0 * upsample(max(2, height // 8), max(2, width // 8), 1)  # texture a few pixels across
    img += 3.0 * rng.standard_normal((height, width, 1), dtype=np.float32)  # grain, mostly luminance
    img += 1.5 * rng.standard_normal((height, width, 3), dtype=np.float32)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


# --------------------------------------------------------------------------- measurement


def measure(chosen: list[Candidate], chunks: list[np.ndarray], repeats: int,
            progress: Callable[[str], None] = lambda line: None) -> list[Result]:
    """Ratio and one-thread speeds of every candidate over ``chunks``.

    The timed passes are interleaved, one pass of every candidate per round (in an order that
    rotates from round to round), so that a burst of load from other processes on a shared
    machine spreads over all candidates instead of biasing the few measured while it lasted.

    Args:
        chosen (list[Candidate]): the codec configurations.
        chunks (list[numpy.ndarray]): contiguous chunks of one array.
        repeats (int): timed passes over all chunks per candidate, for compression and for
            decompression.
        progress (Callable[[str], None]): called with a line before each round.

    Returns:
        list[Result]: one per candidate, in ``chosen``'s order: medians over the repeats;
        ``skipped`` set when the library is missing.
    """
    results = [Result(c.name, c.params, c.module) for c in chosen]
    codecs: dict[int, tuple[Encode, Decode]] = {}
    for i, candidate in enumerate(chosen):
        try:
            codecs[i] = candidate.make()
        except ImportError as err:
            results[i].skipped = f"not installed ({err.name or err})"
    raw = sum(c.nbytes for c in chunks)
    stored: dict[int, list[bytes]] = {}
    live = list(codecs)

    def rounds(kind: str) -> Iterator[int]:
        for r in range(repeats):
            progress(f"{kind} round {r + 1}/{repeats}")
            shift = r % len(live) if live else 0
            yield from live[shift:] + live[:shift]

    for i in rounds("compress"):
        encode = codecs[i][0]
        t0 = time.perf_counter()
        stored[i] = [encode(c) for c in chunks]
        results[i].compress_runs_s.append(time.perf_counter() - t0)
    for i in live:  # lossless, or the row is worthless
        for original, buf in zip(chunks, stored[i], strict=True):
            decoded = np.frombuffer(memoryview(codecs[i][1](buf)), dtype=original.dtype)
            if not np.array_equal(decoded, original.ravel()):
                raise AssertionError(f"{chosen[i].name} ({chosen[i].params}) did not round-trip a chunk")
    for i in rounds("decompress"):
        decode = codecs[i][1]
        t0 = time.perf_counter()
        for buf in stored[i]:
            decode(buf)
        results[i].decompress_runs_s.append(time.perf_counter() - t0)
    for i in live:
        result = results[i]
        result.stored_bytes = sum(len(b) for b in stored[i])
        result.ratio = raw / result.stored_bytes
        result.compress_mbps = raw / statistics.median(result.compress_runs_s) / 1e6
        result.decompress_mbps = raw / statistics.median(result.decompress_runs_s) / 1e6
    return results


_IMPORT_PROBE = """
import sys, time
import numpy  # fastdata has always imported it: only the codec's own cost counts
before = set(sys.modules)
t0 = time.perf_counter()
import {module}
elapsed = time.perf_counter() - t0
added = set(sys.modules) - before
from importlib.metadata import packages_distributions
owners = packages_distributions()  # top-level import name -> distributions that install it
tops = {{m.split('.')[0] for m in added}} - {{m.split('.')[0] for m in before}}
dists = sorted({{d for t in tops for d in owners.get(t, [])}})
print(elapsed, len(added), ','.join(dists))
"""


def import_cost(module: str, repeats: int) -> dict[str, Any]:
    """Median seconds to import ``module`` in a fresh interpreter that has imported numpy.

    Args:
        module (str): import name.
        repeats (int): fresh interpreters timed (after one untimed run that warms the disk cache).

    Returns:
        dict: ``seconds`` (median), ``modules`` (how many modules the import added), ``packages``
        (the installed distributions whose modules it loaded, the codec's own included), or
        ``skipped`` with the reason.
    """
    probe = _IMPORT_PROBE.format(module=module)
    runs: list[float] = []
    line = ""
    for attempt in range(repeats + 1):
        proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            return {"skipped": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "import failed"}
        line = proc.stdout.strip()
        if attempt:
            runs.append(float(line.split()[0]))
    _, count, packages = (line.split(" ") + [""])[:3]
    return {"seconds": statistics.median(runs), "modules": int(count), "packages": packages.split(",") if packages
            else []}


# --------------------------------------------------------------------------- report


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def table(results: list[Result], imports: dict[str, dict[str, Any]], recommended: Result | None) -> str:
    """A Markdown table of ``results`` sorted by ratio (skipped rows last)."""
    lines = ["| codec | parameters | ratio | compress MB/s | decompress MB/s | import ms |",
             "|---|---|---:|---:|---:|---:|"]
    ranked = sorted(results, key=lambda r: (r.ratio is None, -(r.ratio or 0.0)))
    for r in ranked:
        cost = imports.get(r.module, {})
        ms = _fmt(cost["seconds"] * 1e3) if "seconds" in cost else "-"
        mark = " **(pick)**" if recommended is not None and (r.name, r.params) == (recommended.name,
                                                                                  recommended.params) else ""
        if r.skipped:
            lines.append(f"| {r.name} | {r.params} | skipped: {r.skipped} | | | |")
        else:
            lines.append(f"| {r.name}{mark} | {r.params} | {r.ratio:.3f} | {_fmt(r.compress_mbps)} | "
                         f"{_fmt(r.decompress_mbps)} | {ms} |")
    return "\n".join(lines)


def recommend(results: list[Result], min_decompress: float, min_compress: float, tie: float) -> Result | None:
    """The rule: among rows decompressing at >= ``min_decompress`` and compressing at >= ``min_compress``
    MB/s, the best ratio; rows within ``tie`` (relative) of it count as equal, and of those the fastest
    decompression wins."""
    fit = [r for r in results if r.ratio is not None and (r.decompress_mbps or 0) >= min_decompress
           and (r.compress_mbps or 0) >= min_compress]
    if not fit:
        return None
    best = max(r.ratio or 0.0 for r in fit)
    close = [r for r in fit if (r.ratio or 0.0) >= best * (1 - tie)]
    return max(close, key=lambda r: r.decompress_mbps or 0.0)


def machine() -> dict[str, Any]:
    """CPU, cores this process may use, the load average, Python and the codec packages' versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    versions: dict[str, str | None] = {}
    for package in _VERSIONED:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # other processes compete for the cores
    load = tuple(round(x, 1) for x in os.getloadavg()) if hasattr(os, "getloadavg") else None
    return {"cpu": cpu, "cores": cores, "load_average": load, "python": sys.version.split()[0], **versions}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Measure chunk codecs (ratio, one-thread compress/decompress MB/s, import time) on a "
                    "CT-like uint16 volume and a photo-like uint8 RGB image; print Markdown tables sorted by "
                    "ratio and the codec the recommendation rule picks.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shape", type=int, nargs=3, default=[256, 256, 256], metavar=("Z", "Y", "X"),
                   help="shape of the CT-like volume (fastdata.tools.synth_volumes.ct_volume)")
    p.add_argument("--chunks", type=int, nargs=3, default=[64, 64, 64], metavar=("CZ", "CY", "CX"),
                   help="chunk shape of the volume")
    p.add_argument("--image-size", type=int, nargs=2, default=[2048, 2048], metavar=("H", "W"),
                   help="height and width of the photo-like RGB image (the 2-D case)")
    p.add_argument("--image-chunks", type=int, nargs=2, default=[256, 256], metavar=("CH", "CW"),
                   help="chunk height and width of the image (chunks keep all 3 channels)")
    p.add_argument("--repeats", type=int, default=5, help="timed passes over all chunks; medians are reported")
    p.add_argument("--import-repeats", type=int, default=3, help="fresh interpreters per import-time figure")
    p.add_argument("--seed", type=int, default=0, help="seed of the volume and of the image")
    p.add_argument("--noise-sigma", type=float, default=5.0,
                   help="Gaussian noise of the volume in stored units (the ratio depends on it most)")
    p.add_argument("--only", default="", help="measure only candidates whose name or parameters contain this "
                                              "text (case-insensitive); empty: all")
    p.add_argument("--exclude", default="", help="comma-separated texts: drop candidates whose name or parameters "
                                                 "contain any (e.g. 'clevel=9,level=9': the slowest compressors)")
    p.add_argument("--skip-2d", action="store_true", help="measure the volume only")
    # a random 96^3 patch on a 64^3 grid decodes 3.9x its own bytes (6.9 MB of uint16 and 3.5 MB of
    # uint8 labels); being 4x faster than a loader that np.loads a whole 256^3 volume (~9 ms a patch
    # in one process) leaves ~2 ms a patch, of which decoding may take about 1.5: 5 GB/s
    p.add_argument("--min-decompress-mbps", type=float, default=5000.0,
                   help="rule: a default must decompress at least this fast on one thread (3-D data): the patch "
                        "loader is bound by decoding")
    p.add_argument("--min-compress-mbps", type=float, default=50.0,
                   help="rule: and compress at least this fast (stores are written once, so a low floor)")
    p.add_argument("--tie", type=float, default=0.01,
                   help="rule: ratios within this fraction of the best count as equal; the fastest decoder wins")
    p.add_argument("--json", metavar="OUT", help="also write every figure (and the raw timings) to this JSON file")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.import_repeats < 1:
        p.error("--repeats and --import-repeats must be >= 1")
    if min(args.shape + args.chunks + args.image_size + args.image_chunks) < 1:
        p.error("shapes and chunk shapes must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    excluded = [t.strip().lower() for t in args.exclude.split(",") if t.strip()]
    chosen = [c for c in candidates() if args.only.lower() in f"{c.name} {c.params}".lower()
              and not any(t in f"{c.name} {c.params}".lower() for t in excluded)]
    if not chosen:
        print(f"no candidate left by --only {args.only!r} --exclude {args.exclude!r}", file=sys.stderr)
        return 2
    info = machine()
    print(f"# Chunk codecs\n\nmachine: {info}\n")

    t0 = time.perf_counter()
    volume = ct_volume(tuple(args.shape), seed=args.seed, noise_sigma=args.noise_sigma)
    datasets = {"3d": (volume, tuple(args.chunks),
                       f"CT-like uint16 volume {tuple(args.shape)} (seed {args.seed}, noise {args.noise_sigma}) in "
                       f"{tuple(args.chunks)} chunks")}
    if not args.skip_2d:
        image = photo_like_rgb(args.image_size[0], args.image_size[1], seed=args.seed)
        datasets["2d"] = (image, tuple(args.image_chunks),
                          f"photo-like uint8 RGB image {image.shape} in {tuple(args.image_chunks) + (3,)} chunks")
    print(f"data generated in {time.perf_counter() - t0:.1f} s\n")

    imports = {m: import_cost(m, args.import_repeats) for m in sorted({c.module for c in chosen})}
    report: dict[str, Any] = {"machine": info, "args": vars(args), "imports": imports, "data": {}}
    results: dict[str, list[Result]] = {}
    for kind, (array, chunk_shape, description) in datasets.items():
        chunks = chunked(array, chunk_shape)
        def progress(line: str, kind: str = kind) -> None:
            print(f"{kind}: {line}", file=sys.stderr, flush=True)

        results[kind] = measure(chosen, chunks, args.repeats, progress)
        report["data"][kind] = {"description": description, "chunks": len(chunks), "raw_bytes": int(array.nbytes),
                                "results": [asdict(r) for r in results[kind]]}
        del chunks

    rule = (f"the best 3-D ratio among codecs that decompress >= {args.min_decompress_mbps:,.0f} MB/s and compress "
            f">= {args.min_compress_mbps:,.0f} MB/s on one thread; ratios within {args.tie:.0%} of it are ties, won "
            f"by the fastest decompression")
    pick = recommend(results["3d"], args.min_decompress_mbps, args.min_compress_mbps, args.tie)
    for kind, rows in results.items():
        print(f"## {report['data'][kind]['description']}\n")
        print(table(rows, imports, pick) + "\n")
    print("## Import cost (fresh interpreter, numpy already imported)\n")
    print("| module | import ms | modules added | distributions loaded |\n|---|---:|---:|---|")
    for module, cost in imports.items():
        if "skipped" in cost:
            print(f"| {module} | skipped: {cost['skipped']} | | |")
        else:
            print(f"| {module} | {cost['seconds'] * 1e3:.0f} | {cost['modules']} | "
                  f"{', '.join(cost['packages']) or '-'} |")
    # the speeds are this machine's under its load at the time: say what the load was
    report["load_average_end"] = tuple(round(x, 1) for x in os.getloadavg()) if hasattr(os, "getloadavg") else None
    print(f"\nload average (1, 5, 15 min) at the start {info['load_average']}, at the end "
          f"{report['load_average_end']}; speeds are one thread's on this machine under that load")
    print(f"\nrule: {rule}")
    if pick is None:
        print("recommended: none fits the rule (lower --min-decompress-mbps?)")
    else:
        line = f"recommended: {pick.name} ({pick.params}): ratio {pick.ratio:.3f}, decompress " \
               f"{pick.decompress_mbps:,.0f} MB/s, compress {pick.compress_mbps:,.0f} MB/s"
        if "2d" in results:
            same = next(r for r in results["2d"] if (r.name, r.params) == (pick.name, pick.params))
            ranked = sorted((r for r in results["2d"] if r.ratio is not None), key=lambda r: -(r.ratio or 0.0))
            line += f"; on the 2-D image ratio {same.ratio:.3f} (rank {ranked.index(same) + 1} of {len(ranked)}, " \
                    f"best {ranked[0].ratio:.3f}), decompress {same.decompress_mbps:,.0f} MB/s"
        print(line)
    report["rule"] = rule
    report["recommended"] = None if pick is None else {"name": pick.name, "params": pick.params}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
