"""The storage backends the tests run over, derived from the registry
(``fastdata.format.backends.registry.BACKENDS``), never written out by hand: a backend
registered there is tested everywhere these are used.

``NAMES``: backend names; ``SUFFIXES``: each backend's shard (and default destination)
suffix; ``NAME_SUFFIXES``: ``(name, suffix)`` pairs; ``ACCEPTED_SUFFIXES``: every suffix a
destination may end in; :func:`first_in_ci` parametrizes a heavy test over them.
:func:`dummy_backend` registers a throwaway backend for a test.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from fastdata.format.backends.registry import BACKENDS, Backend, get_backend, register_backend, unregister_backend

NAMES: tuple[str, ...] = tuple(BACKENDS)
SUFFIXES: tuple[str, ...] = tuple(b.shard_suffix for b in BACKENDS.values())
NAME_SUFFIXES: tuple[tuple[str, str], ...] = tuple((b.name, b.shard_suffix) for b in BACKENDS.values())
ACCEPTED_SUFFIXES: tuple[str, ...] = tuple(s for b in BACKENDS.values() for s in b.suffixes)

def first_in_ci(values) -> list:
    """``values`` as pytest params with all but the first marked ``slow``: a heavy test runs over
    one backend in CI and over every backend nightly (``FASTDATA_NIGHTLY=1``), where the cheaper
    tests already cover each backend's own code."""
    import pytest

    return [pytest.param(v, marks=() if i == 0 else pytest.mark.slow) for i, v in enumerate(values)]


#: the test-only backend of :func:`dummy_backend`
DUMMY = "dummy"


@contextmanager
def dummy_backend(name: str = DUMMY, suffixes: tuple[str, ...] = (".dmy",), like: str = "lmdb") -> Iterator[Backend]:
    """A backend declared in one :func:`register_backend` call for the block (the classes of
    backend ``like`` under a new name and suffix), unregistered afterwards."""
    base = get_backend(like)
    backend = register_backend(Backend(name, suffixes, base.writer, base.reader, base.spec))
    try:
        yield backend
    finally:
        unregister_backend(name)
