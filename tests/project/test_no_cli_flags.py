"""The library speaks Python: no string or docstring outside ``fastdata/cli/`` spells a command-line
flag (``--resume``); messages name the parameter (``resume=True``) and the CLI shows its own flags
(:mod:`fastdata.cli.flags`). A tokenize scan of every module, with a control."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fastdata"
CLI = PACKAGE / "cli"
#: flags of other programs that a message tells the user to type there (not fastdata's options)
FOREIGN_FLAGS = {
    "--shm-size": "bench/envcheck: Docker's option for a larger /dev/shm, typed into `docker run`",
    "--ipc": "bench/envcheck: Docker's option to share the host's IPC namespace, typed into `docker run`",
}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def flags_in_strings(source: str, filename: str = "<src>") -> list[str]:
    """``file:line: --flag`` for each flag spelled in a string literal (docstrings and f-strings
    included) of ``source``, but the foreign ones."""
    hits = []
    # (from Python 3.12 an f-string is tokenized in pieces: its literal text is FSTRING_MIDDLE)
    literal = {tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in literal:
            continue
        for match in FLAG.finditer(tok.string):
            if match.group() not in FOREIGN_FLAGS:
                line = tok.start[0] + tok.string.count("\n", 0, match.start())
                hits.append(f"{filename}:{line}: {match.group()}")
    return hits


def test_the_scan_finds_a_flag_in_a_message_or_docstring_control():
    source = ('"""Finish it with ``--resume``."""\n'
              'raise ValueError(f"{dst}: rerun with --max-side {n}")\n'
              "x = 1  # a comment may say --resume: it is no message\n"
              'y = "a--b, -- , resume=True, --shm-size=8g"\n')
    assert flags_in_strings(source) == ["<src>:1: --resume", "<src>:2: --max-side"]


def test_no_string_outside_the_cli_spells_a_flag():
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if CLI not in path.parents:
            hits += flags_in_strings(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert hits == [], ("name the parameter (resume=True, max_side=N; see fastdata/cli/flags.py), "
                        "not the flag:\n" + "\n".join(hits))


def test_the_foreign_flags_are_still_used():
    """The allowance goes when the advice does."""
    text = (PACKAGE / "bench" / "envcheck.py").read_text()
    assert all(flag in text for flag in FOREIGN_FLAGS)
