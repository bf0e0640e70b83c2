"""Decoding untrusted JSON and msgpack with bounded expansion.

A few bytes of JSON or msgpack can decode to many Python objects: an empty list is 1
byte of msgpack (2 of JSON) and 56 bytes of Python, so an 8 MB record of empty lists
costs ~0.5 GB. Every manifest, store index and record fastdata reads is decoded here,
under a budget of objects that grows with the input's size:

* :func:`object_budget` ``(n)`` = :data:`OBJECTS_FLOOR` + ``n //`` :data:`BYTES_PER_OBJECT`:
  the most objects (containers plus the values and keys in them) ``n`` bytes may decode
  to. At ~72 bytes per object at worst (an empty dict and its slot), decoding costs at
  most ~9x the input plus ~5 MB.
* msgpack: :func:`unpackb_bounded` sets ``max_str_len``/``max_bin_len`` to the input's
  size, ``max_array_len``/``max_map_len`` to the budget (a header claiming more is
  refused before anything is allocated), no ext types, and counts every container as it
  completes (``list_hook``/``object_hook``), stopping at the budget. Input no larger
  than the floor cannot exceed it (every msgpack object is at least one byte), so small
  records pay nothing for the count.
* JSON: :func:`json_loads_bounded` counts the containers (``[`` and ``{``) before parsing,
  with a C-speed ``bytes.count``, against :func:`json_container_budget`; only when that
  count is over the budget are the strings blanked out and the count redone exactly (a
  bracket inside a string is no container). A manifest over budget is refused before
  ``json.loads`` creates anything. Containers are what JSON makes cheap and Python makes
  dear (``[],``: 3 bytes, 64 bytes of Python: 21x); any other JSON value costs at most
  ~12x its text (``"ab",``: 5 bytes, a 59-byte string and its slot), so bounding the
  containers at one per :data:`JSON_BYTES_PER_CONTAINER` bytes bounds the whole decode
  at ~12x the input plus the floor.

Both raise :class:`ExpansionError` (a ``ValueError``); callers turn it into their own
typed error naming the file, shard, record and field.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgpack

#: objects any input may decode to, whatever its size
OBJECTS_FLOOR = 1 << 16
#: beyond the floor, one object per this many input bytes
BYTES_PER_OBJECT = 8
#: JSON containers (``[`` ``{``) any input may hold, whatever its size
JSON_CONTAINERS_FLOOR = 4096
#: beyond the floor, one JSON container per this many input bytes (real manifests: ~155, measured)
JSON_BYTES_PER_CONTAINER = 16

_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


class ExpansionError(ValueError):
    """The input would decode to more objects than its budget (a decompression-style bomb)."""


def object_budget(nbytes: int) -> int:
    """The most objects ``nbytes`` of JSON or msgpack may decode to (see the module doc)."""
    return OBJECTS_FLOOR + nbytes // BYTES_PER_OBJECT


def json_container_budget(nbytes: int) -> int:
    """The most JSON containers (lists and objects) ``nbytes`` of JSON may hold."""
    return JSON_CONTAINERS_FLOOR + nbytes // JSON_BYTES_PER_CONTAINER


def _json_containers(raw: bytes) -> int:
    return raw.count(b"[") + raw.count(b"{")


def json_loads_bounded(raw: bytes, *, max_containers: int | None = None) -> Any:
    """``json.loads(raw)`` once the input is known to hold at most ``max_containers`` lists and
    objects (default :func:`json_container_budget` of ``len(raw)``).

    Raises:
        ExpansionError: over budget (nothing was decoded).
        ValueError: not valid JSON or not UTF-8 (``json.JSONDecodeError``, ``UnicodeDecodeError``).
        RecursionError: nested too deeply for the parser.
    """
    limit = json_container_budget(len(raw)) if max_containers is None else max_containers
    containers = _json_containers(raw)
    if containers > limit:
        # brackets inside strings are text: count again without them
        containers = _json_containers(_JSON_STRING.sub(b'""', raw))
    if containers > limit:
        raise ExpansionError(f"{containers:,} JSON lists/objects in {len(raw):,} bytes, more than the "
                             f"{limit:,} allowed")
    return json.loads(raw.decode("utf-8"))


class _Counter:
    __slots__ = ("left", "limit", "size")

    def __init__(self, limit: int, size: int):
        self.left = limit
        self.limit = limit
        self.size = size

    def _over(self) -> ExpansionError:
        return ExpansionError(f"decodes to more than the {self.limit:,} objects allowed for {self.size:,} bytes")

    def list_hook(self, value):
        self.left -= 1 + len(value)
        if self.left < 0:
            raise self._over()
        return value

    def object_hook(self, value):
        self.left -= 1 + 2 * len(value)
        if self.left < 0:
            raise self._over()
        return value


def unpack_limits(nbytes: int, max_objects: int | None = None) -> dict:
    """The ``msgpack.unpackb`` length limits for ``nbytes`` of input (see the module doc)."""
    budget = object_budget(nbytes) if max_objects is None else max_objects
    return {"max_str_len": nbytes, "max_bin_len": nbytes, "max_array_len": min(nbytes, budget),
            "max_map_len": min(nbytes // 2, budget), "max_ext_len": 0}


def unpackb_bounded(buf: bytes | memoryview, *, max_objects: int | None = None, **kwargs: Any) -> Any:
    """``msgpack.unpackb(buf, **kwargs)`` creating at most ``max_objects`` objects (default
    :func:`object_budget` ``(len(buf))``), with the length limits of :func:`unpack_limits`
    (a limit given in ``kwargs`` that is lower wins) and no ext types.

    Input no longer than its budget takes msgpack's own defaults, which are then the same
    limits (each at most the input's size), and no count: nothing is added to a small
    record's decode but this call.

    Raises:
        ExpansionError: over budget.
        ValueError, msgpack.UnpackException: not valid msgpack, or a length over its limit.
    """
    n = len(buf)
    budget = OBJECTS_FLOOR + n // BYTES_PER_OBJECT if max_objects is None else max_objects
    if n <= budget:  # at most one object per byte: it cannot exceed the budget
        kwargs.setdefault("max_ext_len", 0)
        return msgpack.unpackb(buf, **kwargs)
    limits = unpack_limits(n, budget)
    for key, value in kwargs.items():
        if key in limits and value is not None:
            limits[key] = min(limits[key], value)
    kw = {k: v for k, v in kwargs.items() if k not in limits}
    counter = _Counter(budget, n)
    return msgpack.unpackb(buf, **limits, **kw, list_hook=counter.list_hook, object_hook=counter.object_hook)
