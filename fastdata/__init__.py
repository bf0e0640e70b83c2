"""fastdata: pack JPEG folders into LMDB/HDF5 shards and load them fast and
leak-free in PyTorch DataLoaders.

Public API::

    fastdata.convert(src, dst, **options) -> ConvertReport
    fastdata.write(samples, dst, schema=None, **options) -> ConvertReport
    fastdata.convert_coco(annotations_json, image_dir, dst, **options) -> ConvertReport
    fastdata.verify(store, decode=False) -> VerifyReport
    fastdata.info(store) -> dict
    fastdata.LMDBImageDataset, fastdata.HDF5ImageDataset, fastdata.open_dataset
    fastdata.seed_worker, fastdata.loader, fastdata.collate
    fastdata.DistributedShardSampler
    fastdata.diagnose
    fastdata.errors, fastdata.transforms

Names that need torch are imported on first use, so the converter and its
worker processes start without importing torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

from . import errors  # noqa: E402
from .convert import ConvertReport, convert  # noqa: E402
from .inspect import info, verify  # noqa: E402
from .writing import write  # noqa: E402
from .coco_convert import convert_coco  # noqa: E402

_LAZY = {
    "LMDBImageDataset": "fastdata.dataset",
    "HDF5ImageDataset": "fastdata.dataset",
    "open_dataset": "fastdata.dataset",
    "collate": "fastdata.dataset",
    "collate_samples": "fastdata.batching",
    "collate_lists": "fastdata.batching",
    "collate_detection": "fastdata.batching",
    "CocoStoreDataset": "fastdata.coco_dataset",
    "seed_worker": "fastdata.seeding",
    "loader": "fastdata.loading",
    "DistributedShardSampler": "fastdata.sampler",
    "diagnose": "fastdata.diagnose",
    "transforms": "fastdata.transforms",
}

__all__ = ["__version__", "errors", "convert", "ConvertReport", "write", "convert_coco", "info", "verify", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fastdata' has no attribute {name!r}")
    mod = importlib.import_module(module)
    value = mod if name == "transforms" else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
