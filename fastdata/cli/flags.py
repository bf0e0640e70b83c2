"""The CLI's spelling of library messages: the library names Python parameters, the CLI its flags.

The convention for every message and docstring outside ``fastdata/cli/`` (a test scans the package
for ``--flag`` text there):

* a switch is written as the keyword set: ``resume=True`` (the CLI shows ``--resume``);
* a value as a keyword argument: ``max_side=512``, ``storage="raw"``, ``raw_budget=SIZE`` (a quoted
  string, a number or an UPPERCASE placeholder; the CLI shows ``--max-side 512``, ``--storage raw``,
  ``--raw-budget SIZE``);
* a parameter alone by its name when the name has an underscore: ``max_side`` (``--max-side``). A
  name without one (``resume``, ``strict``) is an English word too, so alone it stays as written:
  write ``resume=True`` where the CLI should show the flag. It is read as a parameter, and shown as
  the running command's flag, only where a message uses it as one: as the subject of a check that
  opens the message or a clause (``chunks must be ...``, ``workers must be 0 ...``, ``raw shape
  must ...``, ``chunks for images takes 2 sides``), in a list of parameters joined by slashes
  (``chunks/codec/max_pixels apply to ...``), or alone in parentheses (``a Table (schema)``).

:func:`cli_spelling` derives the translation from the argparse parser (each option's ``dest`` and
its option string), so a new option needs nothing here; the CLI applies it where it prints an error,
a warning or a summary.
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Callable, Iterator

#: a keyword argument's value as a message writes it: a quoted string, or one token
_VALUE = r"""(?P<value>"[^"\n]*"|'[^'\n]*'|[\w.+*/:%-]+(?<![.:]))"""


def _options(parser: argparse.ArgumentParser) -> Iterator[tuple[argparse.ArgumentParser, argparse.Action]]:
    """Every (parser, option) pair of ``parser`` and its subcommands, depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _options(sub)
        elif action.option_strings and action.dest != argparse.SUPPRESS:
            yield parser, action


def _flag(action: argparse.Action) -> str:
    """The option's long spelling (``--max-side`` rather than ``-m``)."""
    return max(action.option_strings, key=len)


def _switch_value(action: argparse.Action) -> object:
    """The value a flag given alone sets (True for ``store_true``), or None for an option that takes one."""
    return action.const if action.nargs in (0, "?") else None


def cli_spelling(parser: argparse.ArgumentParser,
                 command: argparse.ArgumentParser | None = None) -> Callable[[str], str]:
    """A function that rewrites a library message in the CLI's terms: ``resume=True`` becomes
    ``--resume``, ``max_side=512`` becomes ``--max-side 512`` and a bare ``max_side`` becomes
    ``--max-side``, for every option of ``parser``; where two commands spell one parameter
    differently, ``command`` (the subcommand that runs) decides. Other text is left alone.
    """
    actions: dict[str, argparse.Action] = {}
    for owner, action in _options(parser):
        if owner is command or action.dest not in actions:
            actions[action.dest] = action
    if not actions:
        return lambda text: text
    names = "|".join(sorted((re.escape(d) for d in actions), key=len, reverse=True))
    # not inside a path, a dotted name, a quoted key or a longer name
    keyword = re.compile(rf"(?<![\w.'\"/\\-])(?P<name>{names})={_VALUE}")
    bare = re.compile(rf"(?<![\w.'\"/\\=-])(?P<name>{'|'.join(re.escape(d) for d in actions if '_' in d) or '(?!)'})"
                      r"(?![\w=(/\\]|\.\w)")
    # names without an underscore (English words too), where a message uses them as parameters:
    # only the running command's own options (a message about another command's --size is not this one's)
    own = {action.dest for owner, action in _options(parser) if command is None or owner is command}
    plain = "|".join(sorted((re.escape(d) for d in actions if "_" not in d and d in own), key=len, reverse=True))
    plain = plain or "(?!)"
    subject = re.compile(rf"(?:^|(?<=: )|(?<=; ))(?P<name>{plain})"
                         rf"(?=(?: shape| for \w+)? (?:must|takes|take|applies|apply|needs|need)\b)", re.M)
    listable = "|".join(sorted((re.escape(d) for d in actions if "_" in d or d in own), key=len, reverse=True))
    listed = re.compile(rf"(?<![\w.'\"/\\=-])(?P<names>(?:{listable})(?:/(?:{listable}))+)(?![\w/\\]|\.\w)")
    parenthesized = re.compile(rf"(?<=\()(?P<name>{plain})(?=\))")

    def keyword_as_flag(match: re.Match) -> str:
        action, value = actions[match["name"]], match["value"]
        flag = _flag(action)
        switch = _switch_value(action)
        if switch is not None and value == repr(switch):
            return flag
        if switch is True and value == "False":
            return f"no {flag}"
        if value[:1] in "'\"":
            value = shlex.quote(value[1:-1])
        return f"{flag} {value}"

    def flag_of(match: re.Match) -> str:
        return _flag(actions[match["name"]])

    def spell(text: str) -> str:
        text = keyword.sub(keyword_as_flag, text)
        text = listed.sub(lambda match: "/".join(_flag(actions[name]) for name in match["names"].split("/")), text)
        text = subject.sub(flag_of, text)
        text = parenthesized.sub(flag_of, text)
        return bare.sub(flag_of, text)

    return spell


def command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser | None:
    """The (sub)parser whose command ``args`` runs (the one that set ``args.func``), or None."""
    func = getattr(args, "func", None)
    for owner, _ in _options(parser):
        if func is not None and owner.get_default("func") is func:
            return owner
    return None
