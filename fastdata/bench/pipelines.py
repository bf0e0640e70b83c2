"""Build the Dataset a configuration measures, and describe which pipeline it is.

* folder: :class:`~fastdata.bench.folder.FolderDataset` (ImageFolder + PIL transforms).
* lmdb / hdf5: :func:`fastdata.open_dataset` with the matching decode-time transform
  from :mod:`fastdata.reader.transforms` (``rrc224`` -> ``RandomResizedCrop(224)``,
  ``resize224`` -> ``CenterCrop(224, resize=224)``): fastdata's fast path, which
  decodes straight to the output size.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fastdata.bench.folder import DESCRIPTIONS, FolderDataset
from fastdata.bench.grid import BenchConfig
from fastdata.errors import FastdataError
from fastdata.format.storage_mode import StorageMode


@dataclass
class Target:
    """A dataset ready to measure.

    Attributes:
        dataset: the map-style Dataset.
        pipeline: human description of how samples are read and decoded.
        files: callable returning every file the dataset reads (for ``cold``).
        sample_bytes: stored bytes per sample (numpy int64, one per sample), used for MB/s.
        storage: how the target holds its images (:func:`describe_storage`), so rows of a JPEG,
            a raw and a mixed store of the same images say which is which.
        disk_bytes: bytes the target takes on disk (a folder's image files; a store's shards).
    """

    dataset: Any
    pipeline: str
    files: Callable[[], list]
    sample_bytes: np.ndarray
    storage: str = "files"
    disk_bytes: int | None = None


def describe_storage(storage: dict) -> str:
    """A store's ``manifest["storage"]`` in a few words: ``original``, ``raw-native <=512``,
    ``mixed 50% raw <=512``, ``raw 224x224``, ``reencode <=512 q90``, ``lossless``."""
    mode = StorageMode.parse(storage.get("mode"))
    side = f" <={storage['max_side']}" if storage.get("max_side") else ""
    if mode.picks_images_to_hold_as_pixels:
        return f"mixed {100 * float(storage.get('raw_fraction', 0)):.0f}% raw{side}"
    if mode.holds_fixed_size_pixels and storage.get("raw_shape"):
        return "raw {}x{}".format(*storage["raw_shape"])
    if mode.reencodes_large_images:
        return f"reencode{side}" + (f" q{storage['quality']}" if storage.get("quality") else "")
    return mode.value + (side if mode.holds_only_native_size_pixels else "")


def decode_transform(name: str):
    """fastdata decode-time transform for a transform name (None for ``"none"``)."""
    from fastdata.reader import transforms
    if name == "none":
        return None
    if name == "rrc224":
        return transforms.RandomResizedCrop(224)
    if name == "resize224":
        return transforms.CenterCrop(224, resize=224)
    raise ValueError(f"unknown transform {name!r}")


def store_options_from_env() -> dict:
    """The remote-store options the harness passed for a URL target (see ``harness.STORE_OPTIONS_ENV``)."""
    import json

    from fastdata.bench.grid import STORE_OPTIONS_ENV

    text = os.environ.get(STORE_OPTIONS_ENV)
    return json.loads(text) if text else {}


def build_target(cfg: BenchConfig) -> Target:
    """The Dataset and its description for ``cfg``.

    Raises:
        FastdataError: the target cannot be opened, or the transform does not apply
            (e.g. a decode-time transform on a store of raw pixels).
    """
    if cfg.kind == "folder":
        ds = FolderDataset(cfg.target, transform=cfg.transform, output=cfg.output)
        return Target(ds, f"ImageFolder-equivalent: {DESCRIPTIONS[cfg.transform]}", ds.files, ds.file_sizes,
                      disk_bytes=int(np.sum(ds.file_sizes)))

    from fastdata.reader.open import open_dataset
    from fastdata.remote.store import is_remote, locate_store

    decode = decode_transform(cfg.transform)
    remote = store_options_from_env() if is_remote(cfg.target) else {}
    try:
        store = open_dataset(cfg.target, output=cfg.output, decode=decode, **remote)
    except ValueError as err:  # e.g. a raw-pixel store and a decode-time transform
        raise FastdataError(str(err) if cfg.target in str(err) else f"{cfg.target}: {err}") from None
    nbytes = getattr(store, "_nbytes", None)
    if nbytes is None or len(nbytes) != len(store):
        from fastdata.tools.verify import info

        meta = info(cfg.target, storage_options=remote.get("storage_options"), cache_dir=remote.get("cache_dir"))
        nbytes = np.full(len(store), meta["total_bytes"] // max(1, meta["num_samples"]), dtype=np.int64)
    how = f"decode={decode!r}" if decode is not None else (
        "raw pixels" if store.storage.mode.holds_fixed_size_pixels else "full decode (simplejpeg/PIL)")
    root = cfg.target
    # the whole manifest once (the dataset keeps only a slim copy): storage, sizes and the files cold evicts
    manifest = locate_store(root, storage_options=remote.get("storage_options"), cache_dir=remote.get("cache_dir"),
                            cache_limit=remote.get("cache_limit")).manifest
    shard_files = [os.path.join(root, s["name"]) for s in manifest["shards"]]
    return Target(store, f"fastdata {cfg.kind}: {how}", lambda: shard_files, np.asarray(nbytes, np.int64),
                  storage=describe_storage(manifest["storage"]),
                  disk_bytes=sum(int(s["bytes"]) for s in manifest["shards"]))


def decoded_nbytes(images) -> int:
    """Bytes of decoded pixels in a batch's images (tensor, list of tensors/arrays/PIL images)."""
    if isinstance(images, torch.Tensor):
        return images.numel() * images.element_size()
    total = 0
    for im in images:
        if isinstance(im, torch.Tensor):
            total += im.numel() * im.element_size()
        elif isinstance(im, np.ndarray):
            total += im.nbytes
        else:  # PIL
            total += im.width * im.height * len(im.getbands())
    return total
