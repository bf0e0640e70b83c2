"""The code blocks of the documentation (README.md and the pages under docs/), read as the site renders them.

A block is a fenced block whose info string names its language: ``python`` (executed), ``bash``
(each command handled by tests/docs/test_code_blocks.py), or ``text`` (output, layouts, diagrams: not code).
A block that the docs tests do not execute says so where a reader sees it, in its title, which the
site shows above the block:

* ``title="Not run in the tests: <why>"``: nothing here can run it (a GPU, several nodes); the
  reason is part of the title. ``tests/docs/test_code_blocks.py`` counts them, so the set cannot
  grow silently.
* ``title="Run by tests/<path>.py"``: another test executes it (with the data it needs); that file
  must exist and name something of the block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

#: the languages a fence may name: code that runs, or text that is not code
LANGUAGES = ("python", "bash", "text")
NOT_RUN = "Not run in the tests: "
RUN_BY = "Run by "

_FENCE = re.compile(r"^(?P<indent> *)```(?P<info>.*)$")
_TITLE = re.compile(r'title="(?P<title>[^"]*)"')


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root, e.g. docs/guides/sources.md
    line: int  # of the opening fence, 1-based
    language: str  # "" when the fence names none
    title: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def not_run_reason(self) -> str | None:
        return self.title[len(NOT_RUN):] if self.title.startswith(NOT_RUN) else None

    @property
    def run_by(self) -> str | None:
        return self.title[len(RUN_BY):].strip() if self.title.startswith(RUN_BY) else None


def pages() -> list[Path]:
    """README.md and every page of the site."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def blocks_of(path: Path, text: str | None = None) -> list[Block]:
    """The fenced blocks of one markdown file, in order."""
    text = path.read_text(encoding="utf-8") if text is None else text
    page = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    found: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, info = len(m["indent"]), m["info"].strip()
        language = info.split()[0] if info and not info.startswith("{") else ""
        title = _TITLE.search(info)
        body: list[str] = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            body.append(lines[j][indent:])
            j += 1
        if j == len(lines):
            raise AssertionError(f"{page}:{i + 1}: a code block that is never closed")
        found.append(Block(page, i + 1, language, title["title"] if title else "", "\n".join(body) + "\n"))
        i = j + 1
    return found


def all_blocks() -> list[Block]:
    return [b for p in pages() for b in blocks_of(p)]
