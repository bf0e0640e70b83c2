"""The package's structure, checked over the AST of every module (function-local imports included):

* layers: ``common <- format <- remote <- writer | reader <- tools, bench, cli``; a module imports
  only from its own layer or the ones below it, and ``writer`` and ``reader`` never import each
  other. ``errors`` and ``_version`` are leaves every layer may use; the facade (``fastdata``) and
  the thin alias modules beside it sit on top.
* no import cycles between modules, whether the import runs at import time or in a function;
* no ``from x import _private`` (nor ``x._private``) across modules;
* subpackage ``__init__`` files hold a docstring only (re-exports from them are how cycles start);
* at most a dozen modules at the package's top level.

Each check has a control: the same function run over a small made-up graph that breaks the rule.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "fastdata"

#: layer of each top-level part, lowest first; equal numbers may import each other only when
#: they are the same part
LAYERS = {
    "errors": 0, "_version": 0,
    "common": 1,
    "format": 2,
    "remote": 3,
    "writer": 4, "reader": 4,
    "tools": 5, "bench": 5,
    "cli": 6, "integrations": 6,
}
#: the facade and the alias modules for public paths: on top of everything
TOP = 7
#: parts of one layer that may import each other (tools <-> bench: the demo runs the harness,
#: bench reads through tools)
SIBLINGS_ALLOWED = {frozenset({"tools", "bench"})}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> list[tuple[str, str, int]]:
    """``(imported module, imported name or "", line)`` for every fastdata import in ``path``:
    ``from a.b import c`` gives ``a.b.c`` when that is a module, else ``a.b`` with name ``c``."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == "fastdata"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "fastdata":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.append((sub, "", node.lineno) if sub in known else (target, alias.name, node.lineno))
    return out


def graph() -> dict[str, list[tuple[str, str, int]]]:
    modules = all_modules()
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def part_of(module: str) -> str | None:
    """``"writer"`` for ``fastdata.writer.pipeline``; None for the facade and alias modules."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    if len(parts) == 2 and parts[1] not in LAYERS:  # fastdata.fields, fastdata.transforms, ...
        return None
    return parts[1]


def level(module: str) -> int:
    part = part_of(module)
    return TOP if part is None else LAYERS[part]


def upward_imports(edges: dict[str, list[tuple[str, str, int]]]) -> list[str]:
    bad = []
    for src, targets in edges.items():
        for dst, _, line in targets:
            a, b = part_of(src), part_of(dst)
            if a == b or level(dst) < level(src):
                continue
            if a is not None and b is not None and frozenset({a, b}) in SIBLINGS_ALLOWED:
                continue
            bad.append(f"{src}:{line} imports {dst} ({b or 'facade'} is not below {a or 'facade'})")
    return bad


def cycles(edges: dict[str, list[tuple[str, str, int]]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    succ = {m: sorted({d for d, _, _ in t if d in edges and d != m}) for m, t in edges.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for m in succ:
            if m not in index:
                visit(m)
    finally:
        sys.setrecursionlimit(limit)
    return out


def private_imports(edges: dict[str, list[tuple[str, str, int]]]) -> list[str]:
    return [f"{src}:{line} imports {name} from {dst}"
            for src, targets in edges.items() for dst, name, line in targets
            if dst != src and (name.startswith("_") and not name.startswith("__")
                               or dst.rpartition(".")[2].startswith("_") and dst.rpartition(".")[2] != "_version")]


# ------------------------------------------------------------------------------------------- the checks


def test_no_module_imports_a_layer_above_it_and_writer_and_reader_stay_apart():
    assert upward_imports(graph()) == []


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_no_private_names_imported_across_modules():
    assert private_imports(graph()) == []


def test_subpackage_init_files_hold_a_docstring_only():
    offenders = []
    for path in PACKAGE.rglob("__init__.py"):
        if path.parent == PACKAGE:
            continue
        body = ast.parse(path.read_text()).body
        if len(body) != 1 or not (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)):
            offenders.append(str(path.relative_to(PACKAGE.parent)))
    assert offenders == []


def test_the_top_level_holds_at_most_a_dozen_modules_and_every_folder_is_a_known_layer():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert set(folders) <= set(LAYERS), folders


def test_no_module_is_named_after_a_standard_library_module():
    clashes = sorted(name for name in all_modules() if name.rpartition(".")[2] in sys.stdlib_module_names
                     and name.count(".") >= 1 and name.rpartition(".")[2] not in ("__main__",))
    assert clashes == []


# ------------------------------------------------------------------------------------------- controls


def test_controls_each_rule_fails_on_a_graph_that_breaks_it():
    edges = {
        "fastdata.format.fields": [("fastdata.writer.sources.folder", "has_image_extension", 1)],
        "fastdata.writer.sources.folder": [("fastdata.format.fields", "Schema", 2)],
        "fastdata.writer.convert": [("fastdata.reader.dataset", "StoreDataset", 3),
                                    ("fastdata.writer.pipeline", "_io_error", 4)],
        "fastdata.writer.pipeline": [],
        "fastdata.reader.dataset": [],
        "fastdata.tools.demo": [("fastdata.bench.harness", "run", 5)],
        "fastdata.bench.harness": [],
    }
    up = upward_imports(edges)
    assert any("fastdata.format.fields:1" in u for u in up)  # format -> writer
    assert any("fastdata.writer.convert:3" in u for u in up)  # writer -> reader
    assert not any("fastdata.tools.demo" in u for u in up)  # tools <-> bench allowed
    assert cycles(edges) == [["fastdata.format.fields", "fastdata.writer.sources.folder"]]
    assert private_imports(edges) == ["fastdata.writer.convert:4 imports _io_error from fastdata.writer.pipeline"]


@pytest.mark.parametrize("source, expected", [
    ("from fastdata.writer import pipeline\n", ("fastdata.writer.pipeline", "")),
    ("from fastdata.writer.pipeline import run_shards\n", ("fastdata.writer.pipeline", "run_shards")),
    ("def f():\n    from .pipeline import run_shards\n", ("fastdata.writer.pipeline", "run_shards")),
    ("import fastdata.reader.dataset as d\n", ("fastdata.reader.dataset", "")),
])
def test_control_function_local_and_relative_imports_are_seen(tmp_path, source, expected):
    path = tmp_path / "convert.py"
    path.write_text(source)
    got = imports_of("fastdata.writer.convert", path, {"fastdata.writer.pipeline", "fastdata.reader.dataset"})
    assert [(m, n) for m, n, _ in got] == [expected]
