"""Text from a store, made safe to print: control characters escaped.

A store is untrusted input: a class name, a shard name, a path or a reason in
``rejected.tsv`` may hold terminal escape sequences (``"\\x1b]0;owned\\x07"`` sets the
window title; others move the cursor or rewrite what was printed before). Everything
the CLI prints that came from a store goes through :func:`printable` first.
"""

from __future__ import annotations

import re

# C0 controls (but not the space), DEL, C1 controls, and the Unicode line/paragraph
# separators and bidirectional overrides that reorder what a terminal shows
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match) -> str:
    char = match.group()
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def printable(text: object, *, keep_newlines: bool = False) -> str:
    """``text`` (``str()`` of it when not a str) with every control character escaped the way
    ``repr`` writes it (``\\x1b``, ``\\x07``, ``\\u202e``); a backslash is left as it is, so
    ordinary Windows-style paths stay readable. Tabs and newlines are escaped too (one store
    value always prints as one line) unless ``keep_newlines`` (a multi-line message of
    fastdata's own, such as a verify report, whose lines may quote store text)."""
    s = text if isinstance(text, str) else str(text)
    if not _UNSAFE.search(s):
        return s
    if keep_newlines:
        return "\n".join(_UNSAFE.sub(_escape, line) for line in s.split("\n"))
    return _UNSAFE.sub(_escape, s)
