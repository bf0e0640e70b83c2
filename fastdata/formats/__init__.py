"""Storage backends. Each backend only encodes/decodes its shard files; the
writer pipeline (``fastdata.pipeline``) and the datasets are shared. Backends are
declared in one place: :mod:`fastdata.formats.registry`."""

from __future__ import annotations

from .base import ShardReader, ShardWriter
from .registry import get_backend


def writer_class(backend: str) -> type[ShardWriter]:
    """The shard writer class of ``backend`` (a name in :data:`~fastdata.formats.registry.BACKENDS`)."""
    return get_backend(backend).writer_class()


def reader_class(backend: str) -> type[ShardReader]:
    """The shard reader class of ``backend`` (a name in :data:`~fastdata.formats.registry.BACKENDS`)."""
    return get_backend(backend).reader_class()
