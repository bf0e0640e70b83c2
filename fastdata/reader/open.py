"""``fastdata.open_dataset``: open any store with the Dataset class it needs.

The one module that knows every dataset class: a new kind of store adds its class here.
"""

from __future__ import annotations

import os

from fastdata.format.manifest import is_classification
from fastdata.reader.coco import CocoStoreDataset, is_coco_manifest
from fastdata.reader.dataset import HDF5ImageDataset, ImageFolderDataset, LMDBImageDataset, StoreDataset
from fastdata.reader.samples import SampleDataset
from fastdata.remote.store import StoreLocation, locate_store


def open_dataset(path: str | os.PathLike | StoreLocation, **kwargs) -> StoreDataset:
    """Open a store with the Dataset class it needs (same keyword arguments as that class).

    Every class reads through :class:`StoreDataset` (one record model); they differ in what
    ``ds[i]`` is. A classification store (layout version 1, what ``fastdata convert`` of an image
    folder writes) opens as :class:`LMDBImageDataset` / :class:`HDF5ImageDataset`
    (:class:`ImageFolderDataset` for another registered backend); a general store (version 2,
    what :func:`fastdata.write` writes) as a :class:`fastdata.reader.samples.SampleDataset`,
    whose items are dicts of its fields; a store converted from COCO (``fastdata convert
    coco``) as a :class:`fastdata.reader.coco.CocoStoreDataset`, whose items are
    ``CocoDetection``'s ``(image, annotations)`` (``target_format="v2"``: torchvision's
    transforms-v2 targets)."""
    store = path if isinstance(path, StoreLocation) else locate_store(
        path, storage_options=kwargs.pop("storage_options", None), cache_dir=kwargs.pop("cache_dir", None),
        cache_limit=kwargs.pop("cache_limit", None), cache=kwargs.pop("cache", "shards"))
    manifest = store.manifest
    if not is_classification(manifest):
        if is_coco_manifest(manifest):
            return CocoStoreDataset(store, **kwargs)

        return SampleDataset(store, **kwargs)
    cls = {"lmdb": LMDBImageDataset, "hdf5": HDF5ImageDataset}.get(manifest["backend"], ImageFolderDataset)
    return cls(store, **kwargs)
