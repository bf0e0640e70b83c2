"""``fastdata doctor module:attribute`` or ``fastdata doctor path/to/file.py:attribute``:
load a user's Dataset by name and diagnose it."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from typing import Any

from fastdata.errors import FastdataError


def _needs_arguments(fn) -> list[str]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: just try calling
        return []
    return [name for name, p in sig.parameters.items()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _is_file_spec(module_part: str) -> bool:
    """``path/to/data.py`` (or any path that names a file) rather than a dotted module name."""
    return module_part.endswith(".py") or os.sep in module_part or "/" in module_part


def _import_file(path: str) -> Any:
    """Import a ``.py`` file as a module named after it, with its folder importable.

    The folder goes on ``sys.path`` so the file's own sibling imports work, and so
    spawn/forkserver workers (which re-import the module by name) find it too.
    """
    from fastdata.common.paths import check_local_path

    check_local_path(path, "doctor target file")
    if os.path.isdir(path) or not path.endswith(".py"):
        raise FastdataError(f"{path}: expected a Python file (path/to/file.py:attribute) or module:attribute")
    folder, name = os.path.split(os.path.abspath(path))
    module_name = name[: -len(".py")]
    if not module_name.isidentifier():
        raise FastdataError(f"{path}: the file name must be a valid Python module name (e.g. my_data.py) so "
                            "DataLoader workers can import it")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    loaded = sys.modules.get(module_name)
    if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") == os.path.join(folder, name):
        return loaded
    spec = importlib.util.spec_from_file_location(module_name, os.path.join(folder, name))
    if spec is None or spec.loader is None:
        raise FastdataError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - any import failure is the user's to fix, in one line
        del sys.modules[module_name]
        raise FastdataError(f"cannot import {path}: {type(err).__name__}: {err}") from None
    return module


def load_object(spec: str) -> Any:
    """Import ``module:attribute`` or ``path/to/file.py:attribute`` (attribute may be
    dotted) and return the dataset it names.

    A class or a function (a factory) is called with no arguments; anything else is
    returned as is. The current directory is importable, as with ``python -m``; a
    file's own folder is importable too.

    Args:
        spec: ``"mypkg.data:train_set"`` or ``"path/to/data.py:train_set"``.

    Returns:
        The dataset object.

    Raises:
        FastdataError: bad spec, missing file, import failure, missing attribute, a
            factory that needs arguments or raises.
    """
    module_name, sep, attr = spec.rpartition(":")  # the last colon: a file path may hold one (C:\...)
    if not sep or not module_name or not attr:
        raise FastdataError(f"expected module:attribute or path/to/file.py:attribute (e.g. mypkg.data:train_set), "
                            f"got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    if _is_file_spec(module_name):
        obj = _import_file(module_name)
    else:
        try:
            obj = importlib.import_module(module_name)
        except Exception as err:  # noqa: BLE001 - any import failure is the user's to fix, in one line
            raise FastdataError(f"cannot import {module_name}: {type(err).__name__}: {err}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise FastdataError(f"{module_name} has no attribute {attr!r}") from None
    if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismethod(obj) or \
            type(obj).__name__ == "partial":
        missing = _needs_arguments(obj)
        if missing:
            raise FastdataError(f"{spec} needs arguments ({', '.join(missing)}); point doctor at a dataset "
                                "object or a factory with no required arguments")
        try:
            obj = obj()
        except Exception as err:  # noqa: BLE001
            raise FastdataError(f"calling {spec}() failed: {type(err).__name__}: {err}") from None
    return obj
