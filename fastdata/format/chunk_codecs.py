"""Chunk codecs: how the chunks of a ``chunked`` field are compressed on disk.

Every codec is declared here, once (:data:`CHUNK_CODECS`); the field kind
(:class:`fastdata.format.fields.Chunked`), the writer, the readers, ``verify`` and
``docs/FORMAT.md`` all look codecs up by name in this table.

The compressors come from numcodecs (the codec library zarr uses, numpy its only
dependency): a chunk stored with ``blosc-lz4`` or ``blosc-zstd`` is a Blosc frame, so a reader in any
language decodes it with c-blosc (Python: ``numcodecs.Blosc().decode(data)``); ``zstd``
and ``lz4`` chunks are numcodecs' ``Zstd``/``LZ4`` frames; ``raw`` chunks are the
little-endian bytes themselves.

Decoding is bounded: the caller passes the chunk's decoded size (known from the
schema and the index) and the codec decodes into a buffer of exactly that size, so
a hostile chunk cannot make a reader allocate more than one chunk.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from fastdata.errors import CorruptRecordError

#: the codec a ``Chunked`` field gets unless it names one (chosen by ``benchmarks/bench_codecs.py``)
DEFAULT_CODEC = "blosc-lz4"
#: Blosc's block size (see :meth:`ChunkCodec._compressor`)
BLOSC_BLOCK_BYTES = 1 << 18
_blosc_ready_pid: int | None = None
#: a Blosc header's nbytes, blocksize and cbytes (uint32 LE at bytes 4-16)
_BLOSC_SIZES = struct.Struct("<III")


def _blosc() -> Any:
    """``numcodecs.blosc``, set up once per process.

    * Blosc's own threads are off unless the user chose (``numcodecs.blosc.use_threads`` left
      at None, numcodecs' default, means threads when called from a main thread). With threads,
      Blosc's output for the same array differs from run to run (measured: 6 different frames in
      10 encodings of one float32 chunk), and a store must be the same bytes when written twice
      from the same data: resume compares fingerprints of encoded samples, and chunk checksums
      would differ. fastdata parallelises by processes anyway (writer and DataLoader workers, one
      per core), where threads only oversubscribe the cores. A single process decoding large
      regions loses some speed (0.61 vs 0.79 GB/s for 64^3 uint16 chunks on 2 cores): set
      ``numcodecs.blosc.use_threads = True`` to trade reproducibility for it.
    * numcodecs guards Blosc with a ``multiprocessing.Lock`` it makes on first use. In a process
      started by forkserver or spawn (the writer's workers, whenever the converter has threads,
      which numpy's BLAS pool alone gives it) such a lock is a named semaphore registered with
      the resource tracker, which reports it as leaked when the pool ends its workers: one
      warning per worker at the end of every conversion. So fastdata gives numcodecs that lock
      first, made by the fork context (an unnamed semaphore, nothing registered). It only does
      so while numcodecs has made none (its ``_MUTEX_IS_INIT``), and if numcodecs ever drops
      these globals nothing is done.
    """
    global _blosc_ready_pid
    blosc: Any = importlib.import_module("numcodecs.blosc")
    if _blosc_ready_pid != os.getpid():
        if blosc.use_threads is None:
            blosc.use_threads = False
        if (getattr(blosc, "_MUTEX_IS_INIT", True) is False and getattr(blosc, "_MUTEX", False) is None
                and "fork" in multiprocessing.get_all_start_methods()):
            blosc._MUTEX = multiprocessing.get_context("fork").Lock()
            blosc._MUTEX_IS_INIT = True
        _blosc_ready_pid = os.getpid()
    return blosc


@dataclass(frozen=True)
class ChunkCodec:
    """One way to store a chunk's bytes.

    Attributes:
        name: the name stored in the schema (``Chunked(codec=...)``).
        default_level: the compression level used when the field gives none (None: no levels).
        levels: the allowed levels ``(low, high)``, or None.
        describe: one line for FORMAT.md.
    """

    name: str
    default_level: int | None
    levels: tuple[int, int] | None
    describe: str

    def _compressor(self, level: int | None, typesize: int) -> Any:
        if self.name == "raw":
            return None
        numcodecs = importlib.import_module("numcodecs")
        if self.name.startswith("blosc-"):
            _blosc()
            cname = self.name.split("-", 1)[1]
            # byte shuffle groups the high and low bytes of wider items, so the compressor sees long
            # runs; one-byte items (labels, 8-bit images) have nothing to shuffle. Bit shuffle gives
            # lz4 a better ratio (2.39 vs 1.90 on the CT-like chunks) but decodes at a third of the
            # speed (3.4 vs 11 GB/s), and the patch loader is bound by decoding (bench_codecs.py)
            shuffle = numcodecs.Blosc.NOSHUFFLE if typesize == 1 else numcodecs.Blosc.SHUFFLE
            # 256 KiB blocks: Blosc's automatic block at low levels is 32 KiB, which halves the
            # decompression speed and costs 3% of the ratio (benchmarks/bench_codecs.py)
            return numcodecs.Blosc(cname=cname, clevel=level, shuffle=shuffle, blocksize=BLOSC_BLOCK_BYTES)
        if self.name == "zstd":
            return numcodecs.Zstd(level=level)
        return numcodecs.LZ4(acceleration=1)

    def encode(self, chunk: np.ndarray, level: int | None) -> bytes:
        """The stored bytes of ``chunk`` (a C-contiguous, little-endian array)."""
        if self.name == "raw":
            return chunk.tobytes()
        return bytes(self._compressor(level, chunk.dtype.itemsize).encode(chunk))

    def decode_into(self, data: bytes | memoryview, out: np.ndarray, where: str) -> None:
        """Decode the stored bytes ``data`` into ``out`` (a C-contiguous array of exactly the
        chunk's decoded size): no other buffer is allocated.

        Raises:
            CorruptRecordError: ``data`` is not a chunk of this codec or decodes to another size
                (named by ``where``).
        """
        target = out.reshape(-1).view(np.uint8)
        if self.name == "raw":
            if len(data) != target.nbytes:
                raise CorruptRecordError(f"{where}: raw chunk of {len(data)} bytes, expected {target.nbytes}")
            target[:] = np.frombuffer(data, dtype=np.uint8)
            return
        try:
            if self.name.startswith("blosc-"):
                blosc = _blosc()
                # the Blosc header (16 bytes): version, versionlz, flags, typesize, then
                # nbytes (decoded), blocksize and cbytes (this frame's length) as uint32 LE
                if len(data) < 16:
                    raise ValueError("shorter than a Blosc header")
                decoded, _block, frame = _BLOSC_SIZES.unpack_from(data, 4)
                if decoded != target.nbytes or frame != len(data):
                    raise ValueError(f"the header says {decoded} bytes in a frame of {frame}, expected "
                                     f"{target.nbytes} in {len(data)}")
                blosc.decompress(data, target)
                return
            numcodecs = importlib.import_module("numcodecs")
            codec = numcodecs.Zstd() if self.name == "zstd" else numcodecs.LZ4()
            if self.name == "lz4":
                # numcodecs' LZ4 frames start with the decoded size (little-endian int32)
                if len(data) < 4 or int.from_bytes(bytes(data[:4]), "little") != target.nbytes:
                    raise ValueError(f"the frame does not say {target.nbytes} bytes")
            decoded_view = codec.decode(data, out=target)
            if np.asarray(decoded_view).nbytes != target.nbytes:
                raise ValueError("short chunk")
        except CorruptRecordError:
            raise
        except Exception as err:  # noqa: BLE001 - the codecs raise several types on damaged frames
            raise CorruptRecordError(f"{where}: cannot decode the {self.name} chunk ({type(err).__name__}: "
                                     f"{err}); run 'fastdata verify'") from None

    def check_level(self, level: int | None, where: str) -> int | None:
        """``level`` checked against :attr:`levels` (None: the default)."""
        if level is None:
            return self.default_level
        if self.levels is None:
            raise ValueError(f"{where}: codec {self.name!r} takes no level")
        low, high = self.levels
        if isinstance(level, bool) or not isinstance(level, int) or not low <= level <= high:
            raise ValueError(f"{where}: codec {self.name!r} takes a level from {low} to {high}, not {level!r}")
        return level


#: codec name -> codec; ``Chunked(codec=None)`` means ``"raw"``
CHUNK_CODECS: dict[str, ChunkCodec] = {
    codec.name: codec for codec in (
        # the default: a random 96^3 patch on a 64^3 grid decodes 3.9x its own bytes, so patches/s are
        # bound by decompression; Blosc lz4 with byte shuffle decompresses CT-like uint16 at 6-11 GB/s on
        # one thread (stores 3.3-3.5x smaller than raw; .nii.gz 4.3-4.5x) and gives the patch loader
        # 1.6-2x the rate of blosc-zstd (benchmarks/bench_codecs.py, bench_patches.py)
        ChunkCodec("blosc-lz4", 5, (0, 9), "a Blosc frame: byte shuffle (items wider than one byte), lz4"),
        # the smaller store: level 1 (Blosc's clevel 1 is zstd level 1) is within 3% of the best ratio
        # measured (clevel 9, zstd level 22, which compresses at 3 MB/s), 5x faster to compress than
        # clevel 5 and faster to decompress (ratio 3.57 vs 2.3-2.4 for blosc-lz4 on the CT-like volume,
        # ~1.8-2.5 GB/s out on one thread: about half the patch rate)
        ChunkCodec("blosc-zstd", 1, (0, 9), "a Blosc frame: byte shuffle (items wider than one byte), zstd"),
        ChunkCodec("zstd", 3, (-131072, 22), "a zstd frame (numcodecs Zstd)"),
        ChunkCodec("lz4", None, None, "numcodecs' LZ4: the decoded size (int32 LE), then an lz4 block"),
        ChunkCodec("raw", None, None, "the chunk's little-endian bytes, uncompressed"),
    )
}


def chunk_codec(name: str | None, where: str = "chunked field") -> ChunkCodec:
    """The codec called ``name`` (None: ``"raw"``).

    Raises:
        ValueError: no such codec (the message lists them).
    """
    codec = CHUNK_CODECS.get("raw" if name is None else name)
    if codec is None:
        raise ValueError(f"{where}: codec {name!r} is not one of {', '.join(CHUNK_CODECS)} (or None)")
    return codec
