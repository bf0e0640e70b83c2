"""A griffe extension for the documentation site: the Sphinx roles of fastdata's docstrings
(:class:`fastdata.X`, :func:`~fastdata.y`, :meth:`get`, :class:`Title <fastdata.Z>`, ...) become
code, and a link where the target is documented on the site.

mkdocstrings renders docstrings as Markdown, where a role shows as ``:class:`` text followed by
code. Before rendering, each role is resolved from the object whose docstring holds it (the names
of its scope, then the package's public names), and rewritten into an optional mkdocs-autorefs
cross-reference: autorefs makes it a link where the target has an entry on the site and leaves
plain code otherwise, so a role naming an internal helper breaks no link (``mkdocs build --strict``
stays clean). A role that names nothing griffe can find becomes plain code.

Registered in mkdocs.yml (the python handler's ``extensions``).
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

#: ``:role:`target``` with an optional ``~`` (show the last component only) and an optional
#: explicit title (``Title <target>``); ``py:`` domains are accepted too.
ROLE = re.compile(r":(?:py:)?(?P<role>class|func|meth|mod|attr|exc|data|obj|const):`(?P<body>[^`]+)`")
EXPLICIT_TITLE = re.compile(r"^(?P<title>.+?)\s*<(?P<target>[^<>]+)>$")


def parse_role(body: str) -> tuple[str, str]:
    """The title shown and the target named by a role's text: ``~a.b.C`` shows ``C``, ``Title <a.b>``
    shows ``Title``, anything else shows as written."""
    explicit = EXPLICIT_TITLE.match(body.strip())
    if explicit:
        return explicit["title"], explicit["target"].lstrip("~.!")
    target = body.strip().lstrip("!")
    if target.startswith("~"):
        target = target[1:].lstrip(".")
        return target.rsplit(".", 1)[-1], target
    target = target.lstrip(".")
    return target, target


def lookup(collection: Any, path: str) -> griffe.Object | griffe.Alias | None:
    """The object at a dotted path of the loaded modules, or None."""
    try:
        return collection[path]
    except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


def resolve(obj: griffe.Object, target: str, collection: Any, package: str) -> str | None:
    """The canonical path of what ``target`` names in the docstring of ``obj``, or None."""
    candidates: list[str] = []
    if target.split(".", 1)[0] == package:
        candidates.append(target)
    else:
        head, _, rest = target.partition(".")
        try:
            found = obj.resolve(head)
        except (griffe.NameResolutionError, griffe.AliasResolutionError, griffe.CyclicAliasError, KeyError):
            found = None
        if found:
            candidates.append(f"{found}.{rest}" if rest else found)
        candidates.append(f"{package}.{target}")  # a public name: fastdata.X
    for path in candidates:
        hit = lookup(collection, path)
        if hit is None:
            continue
        try:
            return hit.final_target.path if isinstance(hit, griffe.Alias) else hit.path
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            return path
    return None


def rewrite(text: str, obj: griffe.Object, collection: Any, package: str) -> str:
    """``text`` with each role replaced by an optional autoref (or plain code where unresolved)."""

    def replace(match: re.Match) -> str:
        title, target = parse_role(match["body"])
        path = resolve(obj, target, collection, package)
        code = f"<code>{html.escape(title)}</code>"
        if path is None:
            return code
        return f'<autoref identifier="{html.escape(path)}" optional>{code}</autoref>'

    return ROLE.sub(replace, text)


class SphinxRoles(griffe.Extension):
    """Rewrites the Sphinx roles of every docstring of a loaded package (see the module's docstring)."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        collection = loader.modules_collection
        seen: set[int] = set()
        stack: list[griffe.Object] = [pkg]
        while stack:
            obj = stack.pop()
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if obj.docstring is not None and ":" in obj.docstring.value:
                obj.docstring.value = rewrite(obj.docstring.value, obj, collection, pkg.name)
            stack.extend(member for member in obj.members.values() if not member.is_alias)
