"""Optional dependencies: imported only by the commands that need them.

The core (convert, verify, info, the datasets, the transforms) needs none of these.
The demo, the synthetic datasets (:mod:`fastdata.tools.synth`) and the benchmark plots do,
and they come with the ``bench`` extra: ``pip install "fastdata[bench]"``; converting Parquet
files or ``datasets`` objects needs pyarrow (the ``parquet`` extra).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from fastdata.errors import MissingExtraError

__all__ = ["MissingExtraError", "require"]

# import name -> (pip package, extra that provides it)
_PROVIDERS = {
    "cv2": ("opencv-python-headless", "bench"),
    "matplotlib": ("matplotlib", "bench"),
    "pyarrow": ("pyarrow", "parquet"),
}


def require(module: str, purpose: str) -> ModuleType:
    """Import ``module`` or say, in one line, which extra provides it.

    Args:
        module (str): import name, one of ``cv2``, ``matplotlib``, ``pyarrow``.
        purpose (str): what needs it, e.g. ``"fastdata demo"`` (starts the message).

    Returns:
        types.ModuleType: the imported module.

    Raises:
        MissingExtraError: the module cannot be imported.
    """
    package, extra = _PROVIDERS[module]
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtraError(
            f"{purpose} needs {package}, which is not installed: pip install \"fastdata[{extra}]\"") from None
