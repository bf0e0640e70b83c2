"""Which files a WebDataset source names: a ``.tar`` file, a brace pattern
(``train-{000000..000099}.tar``), a glob, or a folder of ``.tar`` files."""

from __future__ import annotations

import glob
import os
import re

from fastdata.errors import SourceError

__all__ = ["COMPRESSED_SUFFIXES", "TAR_SUFFIX", "expand_braces", "tar_files"]

TAR_SUFFIX = ".tar"
#: compressed tars: refused (a worker could not seek to a member), with the command that fixes it
COMPRESSED_SUFFIXES = {".tar.gz": "gunzip", ".tgz": "gunzip", ".tar.bz2": "bunzip2", ".tar.xz": "unxz",
                       ".tar.zst": "unzstd"}
_BRACE = re.compile(r"\{([^{}]*)\}")
#: the most files one brace pattern may name
MAX_FILES = 1_000_000


def expand_braces(pattern: str) -> list[str]:
    """``train-{000000..000002}.tar`` -> the three names (zero-padded as written); ``{a,b}`` -> each.

    Raises:
        SourceError: a range that runs backwards or names more than :data:`MAX_FILES` files.
    """
    match = _BRACE.search(pattern)
    if match is None:
        return [pattern]
    body = match.group(1)
    span = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if span:
        first, last = span.group(1), span.group(2)
        if int(last) < int(first) or int(last) - int(first) >= MAX_FILES:
            raise SourceError(f"{pattern}: the range {{{body}}} must run forwards and name at most {MAX_FILES:,} files")
        width = len(first) if first.startswith("0") else 0
        options = [str(i).zfill(width) for i in range(int(first), int(last) + 1)]
    else:
        options = body.split(",")
    head, tail = pattern[:match.start()], pattern[match.end():]
    out: list[str] = []
    for option in options:
        out.extend(expand_braces(head + option + tail))
        if len(out) > MAX_FILES:
            raise SourceError(f"{pattern} names more than {MAX_FILES:,} files")
    return out


def _compressed(name: str) -> str | None:
    lower = name.lower()
    return next((s for s in COMPRESSED_SUFFIXES if lower.endswith(s)), None)


def tar_files(src: str) -> list[str] | None:
    """The tar shards ``src`` names (a ``.tar`` file, a brace pattern, a glob, a folder of ``.tar``
    files), or None when ``src`` is not a WebDataset source.

    Raises:
        SourceError: a compressed tar (with the command that decompresses it), a pattern naming a
            missing file, or a glob matching none.
    """
    candidates = expand_braces(src) if _BRACE.search(src) else [src]
    if not any(c.lower().endswith(TAR_SUFFIX) or _compressed(c) for c in candidates):
        if os.path.isdir(src):
            try:
                entries = os.listdir(src)
            except OSError:
                return None
            names = sorted(n for n in entries
                           if n.lower().endswith(TAR_SUFFIX) and os.path.isfile(os.path.join(src, n)))
            # a folder of shards, not an image folder (class subfolders) with a stray archive in it
            if names and not any(os.path.isdir(os.path.join(src, n)) for n in entries if not n.startswith(".")):
                return [os.path.join(src, n) for n in names]
        return None
    files: list[str] = []
    for c in candidates:
        files.extend(sorted(glob.glob(c)) if glob.has_magic(c) else [c])
    if not files:
        raise SourceError(f"no file matches {src}")
    for f in files:
        suffix = _compressed(f)
        if suffix:
            raise SourceError(f"{f}: a compressed tar cannot be read by offset; decompress it first "
                              f"({COMPRESSED_SUFFIXES[suffix]} {f})")
        if not os.path.isfile(f):
            missing = sum(not os.path.isfile(x) for x in files)
            raise SourceError(f"{f} does not exist" + (f" ({missing} of the {len(files)} files named are missing)"
                                                       if missing > 1 else ""))
    return files
