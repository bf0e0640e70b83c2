"""No test patches a private name (issue 37, item 4: seams, not patches).

A test that replaces a private function, class or attribute of fastdata pins the code's
insides: renaming or restructuring them breaks the test (or, worse, leaves it patching a name
nothing reads any more, passing vacuously). What a test needs to vary goes through a seam: a
documented parameter (``executor_factory=``, ``sink=``, ``loader_factory=``), a public module
hook documented as such, or an environment setting; or the test observes public behaviour.

Every ``tests/**/*.py`` is parsed with :mod:`ast` and these calls are refused when the name they
replace is private (a leading underscore, not a dunder), anywhere in its target:
``monkeypatch.setattr(obj, "_name", ...)``, ``monkeypatch.setattr("dotted._name", ...)`` (also
``mp.setattr`` of ``monkeypatch.context()`` and ``delattr``), ``mock.patch("..._name")``,
``mock.patch.object(obj, "_name")`` (``unittest.mock.patch``, ``patch``, ``patch.object``), the
builtin ``setattr(obj, "_name", ...)``, and those whose object is itself reached through a
private name (``monkeypatch.setattr(module._Class, "finish", ...)``).
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

#: (file relative to tests/, private name patched) still allowed: none. An entry may be added only
#: for a patch that work in progress is removing; the list may only shrink (see
#: test_the_allowlist_names_only_patches_that_still_occur).
ALLOWED: set[tuple[str, str]] = set()

#: the calls that replace an attribute: the fixture's (and its ``context()``'s) and the builtins
_MONKEYPATCH_CALLS = {"setattr", "delattr"}
#: what ``patch`` is reached through in ``unittest.mock``'s usual spellings
_MOCK_PATCH_ROOTS = {"mock", "unittest"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__") and len(name) > 4)


def _dotted(node: ast.AST) -> list[str]:
    """The names of an attribute chain or name (``a.b._c`` -> ``["a", "b", "_c"]``); [] otherwise."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return parts[::-1]
    return []


def _string(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _is_mock_patch(func: list[str]) -> str | None:
    """``"patch"`` for ``mock.patch`` / ``unittest.mock.patch`` / ``patch``, ``"object"`` for their
    ``.object``; None for anything else."""
    if func[-1:] == ["patch"] and (len(func) == 1 or func[-2] in _MOCK_PATCH_ROOTS):
        return "patch"
    if func[-2:] == ["patch", "object"] and (len(func) == 2 or func[-3] in _MOCK_PATCH_ROOTS):
        return "object"
    return None


def _is_setattr(func: list[str]) -> bool:
    """``<fixture>.setattr`` / ``.delattr`` (``monkeypatch``, ``mp`` of ``monkeypatch.context()``,
    whatever name holds one), or the builtins ``setattr`` / ``delattr`` (a patch not even undone)."""
    return func[-1] in _MONKEYPATCH_CALLS


def private_patches(source: str, filename: str = "<test>") -> list[tuple[int, str]]:
    """``(line, private name)`` of each patch of a private name in the test module ``source``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call):
            continue
        func = _dotted(node.func)
        if not func:
            continue
        names: list[str] = []
        kind = _is_mock_patch(func)
        if kind == "patch" and node.args:
            target = _string(node.args[0])
            names = target.split(".") if target else []
        elif kind == "object" and len(node.args) >= 2:
            names = _dotted(node.args[0]) + [_string(node.args[1]) or ""]
        elif kind is None and _is_setattr(func) and node.args:
            target = _string(node.args[0])
            if target is not None:  # setattr("dotted.path._name", value)
                names = target.split(".")
            elif len(node.args) >= 2:  # setattr(obj, "_name", value)
                names = _dotted(node.args[0]) + [_string(node.args[1]) or ""]
        found.extend((node.lineno, name) for name in names if _private(name))
    return sorted(found)


def _all_private_patches() -> list[tuple[str, int, str]]:
    out = []
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS).as_posix()
        out.extend((rel, line, name) for line, name in private_patches(path.read_text(encoding="utf-8"), str(path)))
    return out


def test_no_test_patches_a_private_name():
    refused = [f"tests/{rel}:{line}: patches {name}" for rel, line, name in _all_private_patches()
               if (rel, name) not in ALLOWED]
    assert not refused, ("tests patch private names; give the code a seam (a documented parameter, a public "
                         "hook, a setting) or observe public behaviour instead:\n" + "\n".join(refused))


def test_the_allowlist_names_only_patches_that_still_occur():
    """The allowlist shrinks: an entry whose patch is gone must be removed with it."""
    occurring = {(rel, name) for rel, _, name in _all_private_patches()}
    stale = sorted(entry for entry in ALLOWED if entry not in occurring)
    assert not stale, f"allowlist entries that no longer occur (remove them from ALLOWED): {stale}"


def test_the_checker_sees_every_spelling_of_a_private_patch():
    """Control: each form the checker claims to refuse is found (else the test above passes vacuously),
    and the public and dunder forms are not."""
    refused = '''
monkeypatch.setattr(module, "_hidden", 1)
monkeypatch.setattr("fastdata.reader.transforms._decode", spy)
mp.setattr(module._Private, "finish", finish)
monkeypatch.delattr(module, "_gone")
mock.patch("fastdata.remote.location._backoff")
unittest.mock.patch("fastdata.x._y", new=1)
patch("fastdata.x._y")
mock.patch.object(RemoteLocation, "_open_read")
patch.object(module, "_z")
with mock.patch.object(thing, "_w"):
    pass
setattr(module, "_v", 1)
'''
    assert [line for line, _ in private_patches(refused)] == [*range(2, 12), 13]
    allowed = '''
monkeypatch.setattr(module, "backoff", 1)
monkeypatch.setattr(owner, "__getitem__", spy)
monkeypatch.setattr("fastdata.reader.dataset.machine_memory", lambda: 1000)
monkeypatch.setenv("_PRIVATE_LOOKING", "1")
monkeypatch.setitem(sys.modules, "_thing", None)
setattr(obj, name, 1)
mock.patch("fastdata.x.y")
'''
    assert private_patches(allowed) == []
