"""``fastdata doctor module:attribute``: load a user's Dataset by name and diagnose it."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any

from ..errors import FastdataError


def _needs_arguments(fn) -> list[str]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: just try calling
        return []
    return [name for name, p in sig.parameters.items()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def load_object(spec: str) -> Any:
    """Import ``module:attribute`` (attribute may be dotted) and return the dataset it names.

    A class or a function (a factory) is called with no arguments; anything else is
    returned as is. The current directory is importable, as with ``python -m``.

    Raises:
        FastdataError: bad spec, import failure, missing attribute, a factory that
            needs arguments or raises.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise FastdataError(f"expected module:attribute (e.g. mypkg.data:train_set), got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
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
