"""Human-readable byte sizes.

Units follow the SI/IEC convention: ``k``/``kB``, ``M``/``MB``, ``G``/``GB``,
``T``/``TB`` are decimal (powers of 1000); ``KiB``, ``MiB``, ``GiB``, ``TiB``
are binary (powers of 1024). Case does not matter, so ``2g`` = ``2GB`` =
2,000,000,000 bytes and ``2GiB`` = 2,147,483,648 bytes. A size remembers the
unit it was written in, so messages print it back the way the user wrote it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: lower-cased unit as typed -> (bytes per unit, how it is printed back)
_UNITS = {
    "": (1, ""), "b": (1, ""),
    "k": (1000, "kB"), "kb": (1000, "kB"), "kib": (1 << 10, "KiB"),
    "m": (1000**2, "MB"), "mb": (1000**2, "MB"), "mib": (1 << 20, "MiB"),
    "g": (1000**3, "GB"), "gb": (1000**3, "GB"), "gib": (1 << 30, "GiB"),
    "t": (1000**4, "TB"), "tb": (1000**4, "TB"), "tib": (1 << 40, "TiB"),
}
_FACTORS = {label: factor for factor, label in _UNITS.values()}


@dataclass(frozen=True)
class Size:
    """A byte count and the unit label it was written with (``"GB"``, ``"GiB"``, ``""`` for bytes)."""

    bytes: int
    unit: str = ""

    def __str__(self) -> str:
        return describe_size(self.bytes, self.unit)


def parse_size_spec(text: str | int | Size) -> Size:
    """Parse ``"512MiB"``, ``"2g"``, ``"1.5GB"`` or ``250000000`` into a :class:`Size`.

    Raises:
        ValueError: not a size, or not positive (the message gives examples).
    """
    if isinstance(text, Size):
        return text
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise ValueError(f"size must be positive, got {text}")
        return Size(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 512MiB, 2GB, 2G = 2GB, 250000000; "
                         "k/M/G/T and kB/MB/GB/TB are decimal, KiB/MiB/GiB/TiB binary)")
    factor, label = _UNITS[m.group(2).lower()]
    value = int(float(m.group(1)) * factor)
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return Size(value, label)


def parse_size(text: str | int | Size) -> int:
    """Parse a byte size with an optional unit (see :func:`parse_size_spec`); returns bytes."""
    return parse_size_spec(text).bytes


def exact_unit(n: int) -> str:
    """The largest unit that divides ``n`` exactly (binary preferred), or ``""`` (bytes)."""
    for label in ("TiB", "TB", "GiB", "GB", "MiB", "MB", "KiB", "kB"):
        if n and n % _FACTORS[label] == 0:
            return label
    return ""


def exact_size(n: int) -> str:
    """``"200 GB"``, ``"1.5 TiB"``: ``n`` in the largest unit that divides it exactly (as a user
    would have written it), else :func:`format_size`'s rounding."""
    if not exact_unit(n):
        return format_size(n)
    return describe_size(n).split(" (", 1)[0]


def describe_size(n: int, unit: str | None = None) -> str:
    """``2 GB (2,000,000,000 bytes)`` in ``unit`` (default: the largest exact unit).

    Plain byte counts print as ``4,000 bytes``.
    """
    label = exact_unit(n) if unit is None else unit
    if not label:
        return f"{n:,} bytes"
    value = n / _FACTORS[label]
    shown = f"{value:,.3f}".rstrip("0").rstrip(".")
    return f"{shown} {label} ({n:,} bytes)"


def format_size(n: float) -> str:
    """Format a byte count with a binary unit, e.g. ``12.3 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
