"""The one place a storage backend is declared.

A backend is a name, the destination suffixes that select it, and three modules:
its shard writer class, its shard reader class and its ``spec`` module (the
documented on-disk layout). Everything that needs to know the backends (the
writer pipeline, ``convert``'s backend choice, the ``format=`` choices,
shard file names, manifest validation, ``open_dataset``, ``verify``) asks this
registry, so adding a backend is one :func:`register_backend` call (see
docs/FORMAT.md, "Adding a backend").

Classes are named as ``"module:Class"`` strings and imported on first use, so
declaring a backend costs no import of its library (lmdb, h5py).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastdata.format.backends.base import ShardReader, ShardWriter


def _load(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Backend:
    """A storage backend: ``suffixes[0]`` is its shard files' suffix; a destination
    ending in any of ``suffixes`` selects it; ``aliases`` are extra ``format=`` names."""

    name: str
    suffixes: tuple[str, ...]
    writer: str  #: "module:Class" of its ShardWriter
    reader: str  #: "module:Class" of its ShardReader
    spec: str    #: module documenting its layout (LAYOUT, VERSION, ...)
    aliases: tuple[str, ...] = field(default=())

    @property
    def shard_suffix(self) -> str:
        return self.suffixes[0]

    def writer_class(self) -> type[ShardWriter]:
        return _load(self.writer)

    def reader_class(self) -> type[ShardReader]:
        return _load(self.reader)


#: name -> backend, in registration order
BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    """Declare ``backend`` (a name, suffix or alias already taken by another is an error)."""
    taken = {n: b.name for b in BACKENDS.values() if b.name != backend.name for n in (b.name, *b.aliases)}
    taken_suffixes = {s: b.name for b in BACKENDS.values() if b.name != backend.name for s in b.suffixes}
    clash = [n for n in (backend.name, *backend.aliases) if n in taken] + [
        s for s in backend.suffixes if s in taken_suffixes]
    if clash or not backend.suffixes:
        raise ValueError(f"backend {backend.name!r}: {clash or 'no suffixes'} already declared or missing")
    BACKENDS[backend.name] = backend
    return backend


def unregister_backend(name: str) -> None:
    """Forget a backend (tests that declare a throwaway one)."""
    BACKENDS.pop(name, None)


def get_backend(name: str) -> Backend:
    """The backend called ``name`` (or one of its aliases); ValueError naming the known ones."""
    key = name.lower()
    for backend in BACKENDS.values():
        if key == backend.name or key in backend.aliases:
            return backend
    raise ValueError(f"unknown format {name!r}: use {' or '.join(format_choices())}")


def writer_class(backend: str) -> type[ShardWriter]:
    """The shard writer class of ``backend`` (a name in :data:`BACKENDS`)."""
    return get_backend(backend).writer_class()


def reader_class(backend: str) -> type[ShardReader]:
    """The shard reader class of ``backend`` (a name in :data:`BACKENDS`)."""
    return get_backend(backend).reader_class()


def format_choices() -> list[str]:
    """Every name ``format=`` accepts (names, then aliases)."""
    return [b.name for b in BACKENDS.values()] + [a for b in BACKENDS.values() for a in b.aliases]


def backend_for_path(path: str) -> str | None:
    """The backend a destination's suffix selects, or None."""
    low = path.rstrip("/").lower()
    for backend in BACKENDS.values():
        if low.endswith(backend.suffixes):
            return backend.name
    return None


def suffix_hint() -> str:
    """``*.lmdb, *.h5 or *.hdf5`` for messages."""
    names = [f"*{s}" for b in BACKENDS.values() for s in b.suffixes]
    return ", ".join(names[:-1]) + (" or " if len(names) > 1 else "") + names[-1]


register_backend(Backend("lmdb", (".lmdb",), "fastdata.format.backends.lmdb.writer:LMDBShardWriter",
                         "fastdata.format.backends.lmdb.reader:LMDBShardReader", "fastdata.format.backends.lmdb.spec"))
register_backend(Backend("hdf5", (".h5", ".hdf5"), "fastdata.format.backends.hdf5.writer:HDF5ShardWriter",
                         "fastdata.format.backends.hdf5.reader:HDF5ShardReader", "fastdata.format.backends.hdf5.spec",
                         aliases=("h5",)))
