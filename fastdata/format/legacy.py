"""The record models a reader meets, chosen once per store: the general one, and the image-classification
stores of manifest versions 1 and 3 read through it.

A general store (version 2) declares its schema; its shard indexes hold ``fields/<name>`` arrays and
each record is a msgpack map of the fields the index does not hold. An image-classification store
(what ``fastdata convert`` of an image folder or a path,label list writes) predates that model: its
records hold one image and its index a label, size, format, dtype and channel count per sample, and a
merged store (version 3) maps each shard's labels onto the store's classes. :class:`ClassificationRecords`
presents such a store as a general store of schema ``{image: Image, label: Int}`` with the class
table ``{"label": classes}``, so one dataset class reads every store (see
:class:`fastdata.reader.dataset.StoreDataset`); nothing outside this module tells the two apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from fastdata.common.imagemodes import IMAGE_MODES
from fastdata.errors import CorruptRecordError, FormatError
from fastdata.format.fields import CLASSIFICATION, Image, Schema
from fastdata.format.manifest import (
    CLASS_TABLES_KEY,
    IMAGE_MODES_KEY,
    is_classification,
    label_map_of,
    schema_of,
)
from fastdata.format.record import FIELD_PREFIX, SampleIndex, ShardIndex, decode_record_v2

__all__ = ["ClassificationRecords", "GeneralRecords", "RecordModel", "record_model"]

#: the index keys every model's :meth:`RecordModel.shard_arrays` gives besides the fields' own
PATHS, PATH_OFFSETS, NBYTES = "relpaths", "relpath_offsets", "nbytes"


class RecordModel:
    """How one store's shards are read into the general model: its schema, its class tables,
    each shard's index as ``fields/...`` arrays, and each record's non-index fields."""

    #: the schema the store's samples have
    schema: Schema
    #: the schema its shard readers are opened with (None: a classification shard)
    reader_schema: Schema | None
    #: field name -> its class names, for each class field
    class_tables: dict[str, list[str]]
    #: column name -> index key of the columns this model adds to the schema's (see ``StoreDataset.column``)
    extra_columns: dict[str, str] = {}

    def shard_arrays(self, index: Any, shard: dict, root: str) -> dict[str, np.ndarray]:
        """The arrays of one shard's index (``shard``: its manifest entry; ``root``: the store,
        for errors) keyed as a general index (``fields/<name>``, ``fields/<image>.<meta>``,
        ``relpaths``, ``relpath_offsets``, ``nbytes``)."""
        raise NotImplementedError

    def record_fields(self, data: bytes, where: Callable[[], str]) -> dict[str, Any]:
        """The values of the fields a record holds (those the index does not), by name; ``where()``
        names the record for an error (called only when one is needed: this is per sample)."""
        raise NotImplementedError

    def default_mode(self, name: str, where: str) -> str:
        """The read mode of image field ``name`` when the reader is not told one."""
        field = self.schema[name]
        assert isinstance(field, Image)
        return field.default_mode(name)

    def check_targets(self, targets: np.ndarray, manifest: dict, where: str) -> None:
        """Refuse targets the store's manifest cannot have written (nothing to check by default)."""


class GeneralRecords(RecordModel):
    """A general (version-2) store: the model as written."""

    def __init__(self, manifest: dict, where: str):
        self.schema = schema_of(manifest, where)
        self.reader_schema = self.schema
        self.class_tables = {k: list(v) for k, v in manifest.get(CLASS_TABLES_KEY, {}).items()}

    def shard_arrays(self, index: SampleIndex, shard: dict, root: str) -> dict[str, np.ndarray]:
        return {key: arr for key, arr in index.arrays.items()
                if key.startswith(FIELD_PREFIX) or key in (PATHS, PATH_OFFSETS, NBYTES)}

    def record_fields(self, data: bytes, where: Callable[[], str]) -> dict[str, Any]:
        return decode_record_v2(data, self.schema, where=where())


class ClassificationRecords(RecordModel):
    """An image-classification store (versions 1 and 3) as a general store of schema
    ``{image: Image, label: Int}``: a shard reader's ``get`` gives the image's bytes (checked
    against the record's checksum), the label and image metadata come from the index."""

    extra_columns = {"nbytes": NBYTES}  # the stored image's size (a general index records the record's)

    def __init__(self, manifest: dict, where: str):
        self.schema = CLASSIFICATION
        self.reader_schema = None
        self.class_tables = {"label": list(manifest["classes"])}
        self._modes = manifest.get(IMAGE_MODES_KEY)

    def shard_arrays(self, index: ShardIndex, shard: dict, root: str) -> dict[str, np.ndarray]:
        labels = index.labels
        label_map = label_map_of(shard)
        if label_map is not None:  # a merged store's shard: its stored labels index its own store's classes
            if len(index) and int(labels.max()) >= len(label_map):
                raise CorruptRecordError(f"{root}/{shard['name']}: a label is outside the shard's label_map of "
                                         f"{len(label_map)} classes; run 'fastdata verify'", store=root,
                                         shard=shard["name"])
            labels = np.asarray(label_map, dtype=np.int64)[labels]
        image = FIELD_PREFIX + "image."
        return {FIELD_PREFIX + "label": labels.astype(np.int64, copy=False),
                image + "format": index.formats, image + "width": index.widths, image + "height": index.heights,
                image + "dtype": index.dtypes, image + "channels": index.channels,
                NBYTES: index.nbytes, PATHS: index.relpaths, PATH_OFFSETS: index.relpath_offsets}

    def record_fields(self, data: bytes, where: Callable[[], str]) -> dict[str, Any]:
        return {"image": data}

    def default_mode(self, name: str, where: str) -> str:
        """The manifest's recorded default (``image_modes``), else ``"RGB"``."""
        if self._modes is None:
            return "RGB"
        mode = self._modes.get(name, "RGB") if isinstance(self._modes, dict) else None
        if mode not in IMAGE_MODES:
            raise FormatError(f"{where}: the manifest's image_modes {self._modes!r:.80} is not a map of image "
                              f"field -> one of {', '.join(IMAGE_MODES)}")
        return mode

    def check_targets(self, targets: np.ndarray, manifest: dict, where: str) -> None:
        if len(targets) != manifest["num_samples"] or (
                len(targets) and int(targets.max()) >= len(self.class_tables["label"])):
            raise CorruptRecordError(f"{where}: index disagrees with the manifest; run 'fastdata verify'",
                                     store=where)


def record_model(manifest: dict, where: str) -> RecordModel:
    """The record model of a (validated) manifest's store, chosen once when it is opened."""
    return ClassificationRecords(manifest, where) if is_classification(manifest) else GeneralRecords(manifest, where)
