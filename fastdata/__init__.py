"""fastdata: pack JPEG folders into LMDB/HDF5 shards and load them fast and
leak-free in PyTorch DataLoaders.

Public API::

    fastdata.convert(src, dst, **options) -> ConvertReport
    fastdata.verify(store, decode=False) -> VerifyReport
    fastdata.info(store) -> dict
    fastdata.LMDBImageDataset / HDF5ImageDataset / open_dataset
    fastdata.seed_worker, fastdata.loader
    fastdata.errors
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import errors  # noqa: E402
from .convert import ConvertReport, convert  # noqa: E402
from .inspect import info, verify  # noqa: E402

__all__ = ["__version__", "errors", "convert", "ConvertReport", "info", "verify"]
