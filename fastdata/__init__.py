"""fastdata: pack image datasets into LMDB/HDF5 shard stores and load them fast and
leak-free in PyTorch DataLoaders.

Public API::

    fastdata.convert(source, dst, options=None, **keywords) -> ConvertReport
        source: a fastdata.sources object (ImageFolder, Table, Coco, Parquet, WebDataset,
        Volumes, Dicom, Samples) or a path; options: fastdata.WriteOptions
    fastdata.write(samples, dst, schema=None, options=None, **keywords) -> ConvertReport
    fastdata.convert_coco(annotations_json, image_dir, dst, options=None, **keywords) -> ConvertReport
    fastdata.WriteOptions(format=, workers=, shard_size=, resume=, overwrite=, append=, task_size=, ...)
    fastdata.merge([store_a, store_b, ...], dst) -> MergeReport
    fastdata.add_fields(store, {"name": values}) -> manifest; drop_fields, rename_field, gc
    fastdata.compute_fields(store, fn, batch_size=64, resume=False) -> manifest (fn over every batch)
    fastdata.verify(store, decode=False) -> VerifyReport
    fastdata.info(store) -> dict
    fastdata.LMDBImageDataset, fastdata.HDF5ImageDataset, fastdata.open_dataset
    fastdata.seed_worker, fastdata.collate
    fastdata.loader(dataset, batch_size) -> Loader (state_dict/load_state_dict, set_epoch)
    fastdata.DistributedShardSampler (a DistributedSampler; ranks resolved when first used)
    fastdata.integrations.lightning.StoreDataModule (optional: needs lightning)
    fastdata.random_split, fastdata.StoreSubset (ds.subset(indices), ds.column(name))
    fastdata.mix([fastdata.MixPart(store, weight=...), ...], **options) -> MixedDataset
    fastdata.PatchDataset, fastdata.Stitcher, fastdata.stitch
    fastdata.diagnose
    fastdata.errors, fastdata.fields, fastdata.sources, fastdata.transforms, fastdata.targets, fastdata.synth

Every name is imported on first use: ``import fastdata`` loads neither the writer
nor torch, h5py or lmdb (nor ``fcntl``, so the readers work where it is missing),
and the converter's worker processes start without importing torch.

The package is layered, imports flowing one way (``tests/project/test_architecture.py``
checks it, and lint-imports in CI)::

    common <- format <- remote <- writer | reader <- tools, bench, cli
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fastdata import errors
from fastdata._version import __version__

#: public name -> the module that defines it
_LAZY = {
    "convert": "fastdata.writer.api",
    "convert_table": "fastdata.writer.api",
    "write": "fastdata.writer.api",
    "merge": "fastdata.writer.merge",
    "add_fields": "fastdata.writer.add_fields",
    "drop_fields": "fastdata.writer.add_fields",
    "rename_field": "fastdata.writer.add_fields",
    "gc": "fastdata.writer.add_fields",
    "compute_fields": "fastdata.tools.compute",
    "convert_coco": "fastdata.writer.api",
    "WriteOptions": "fastdata.writer.options",
    "ConvertReport": "fastdata.writer.report",
    "info": "fastdata.tools.verify",
    "verify": "fastdata.tools.verify",
    "LMDBImageDataset": "fastdata.reader.dataset",
    "HDF5ImageDataset": "fastdata.reader.dataset",
    "open_dataset": "fastdata.reader.open",
    "collate": "fastdata.reader.batching",
    "collate_samples": "fastdata.reader.batching",
    "collate_lists": "fastdata.reader.batching",
    "collate_detection": "fastdata.reader.batching",
    "CocoStoreDataset": "fastdata.reader.coco",
    "seed_worker": "fastdata.reader.seeding",
    "loader": "fastdata.reader.loader",
    "DistributedShardSampler": "fastdata.reader.sampler",
    "StoreSubset": "fastdata.reader.subset",
    "random_split": "fastdata.reader.subset",
    "mix": "fastdata.reader.mix",
    "MixedDataset": "fastdata.reader.mix",
    "MixPart": "fastdata.reader.mix",
    "diagnose": "fastdata.tools.diagnose",
    "PatchDataset": "fastdata.reader.patches",
    "Stitcher": "fastdata.reader.patches",
    "stitch": "fastdata.reader.patches",
}
#: public modules: ``fastdata.<name>`` is the module itself (thin alias modules beside this file)
_MODULES = ("fields", "sources", "transforms", "targets", "synth", "synth_coco")

__all__ = ["__version__", "errors", *_LAZY, *_MODULES]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time each name loads on first use
    from fastdata import fields, sources, synth, synth_coco, targets, transforms  # noqa: F401
    from fastdata.reader.batching import collate, collate_detection, collate_lists, collate_samples  # noqa: F401
    from fastdata.reader.coco import CocoStoreDataset  # noqa: F401
    from fastdata.reader.dataset import HDF5ImageDataset, LMDBImageDataset  # noqa: F401
    from fastdata.reader.loader import loader  # noqa: F401
    from fastdata.reader.mix import MixedDataset, MixPart, mix  # noqa: F401
    from fastdata.reader.open import open_dataset  # noqa: F401
    from fastdata.reader.patches import PatchDataset, Stitcher, stitch  # noqa: F401
    from fastdata.reader.sampler import DistributedShardSampler  # noqa: F401
    from fastdata.reader.seeding import seed_worker  # noqa: F401
    from fastdata.reader.subset import StoreSubset, random_split  # noqa: F401
    from fastdata.tools.compute import compute_fields  # noqa: F401
    from fastdata.tools.diagnose import diagnose  # noqa: F401
    from fastdata.tools.verify import info, verify  # noqa: F401
    from fastdata.writer.api import convert, convert_coco, convert_table, write  # noqa: F401
    from fastdata.writer.add_fields import add_fields, drop_fields, gc, rename_field  # noqa: F401
    from fastdata.writer.merge import merge  # noqa: F401
    from fastdata.writer.options import WriteOptions  # noqa: F401
    from fastdata.writer.report import ConvertReport  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        value: Any = importlib.import_module(f"fastdata.{name}")
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module 'fastdata' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_MODULES))
