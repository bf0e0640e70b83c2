"""``SampleDataset``: a general (layout version 2) store as a map-style Dataset.

``ds[i]`` is a dict of the stored fields in schema order: image fields decoded per
``output`` (``"pil"``, ``"numpy"`` HWC uint8, ``"tensor"`` CHW uint8), ints and
floats as Python scalars, fixed-shape arrays and ragged arrays as numpy arrays
(tensors with ``output="tensor"``), strings and JSON values as they were written,
chunked fields as lazy :class:`~fastdata.reader.chunked.ChunkedArray` objects that
read a region's chunks when indexed (``fastdata.PatchDataset`` cuts patches from them).
``transform`` receives that dict.

Everything about handles is shared with the classification datasets
(:class:`fastdata.reader.dataset.StoreDataset`, the base class): readers open lazily once
per process, nothing inherited through fork is touched, pickles carry no handle,
and a damaged record raises :class:`~fastdata.errors.CorruptRecordError` naming
store, shard and record, or is replaced under ``on_error="skip"``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fastdata.common.imageio import decoded_bytes_limit, pixel_limit
from fastdata.errors import CorruptRecordError, FastdataError, ImageModeError
from fastdata.format.chunks import ChunkTable, check_shape
from fastdata.format.fields import Chunked, Float, Image, Int, NDArray, Ragged
from fastdata.format.manifest import schema_of
from fastdata.format.record import (
    FIELD_PREFIX,
    FORMAT_NAMES,
    IMAGE_DTYPE_NAMES,
    IMAGE_META,
    SampleIndex,
    chunk_first_key,
    chunk_shape_key,
    decode_record_v2,
)
from fastdata.reader import batch_ring
from fastdata.reader.batching import Samples, aligned, new_segment
from fastdata.reader.chunked import ChunkedArray
from fastdata.reader.dataset import StoreDataset
from fastdata.reader.decode import decode_numpy, decode_numpy_into, decode_pil, pil_of, squeezed, to_tensor
from fastdata.reader.overrides import each_sample, overrides_getitem
from fastdata.reader.seeding import epoch_of, sample_rng
from fastdata.reader.subset import code_names, read_only
from fastdata.remote.store import StoreLocation


class SampleDataset(StoreDataset):
    """A general fastdata store (written by :func:`fastdata.write`); open it with
    :func:`fastdata.open_dataset`."""

    def __init__(
        self,
        path: str | os.PathLike | StoreLocation,
        transform: Callable | None = None,
        output: str = "pil",
        decode: Callable | None = None,
        *,
        on_error: str = "raise",
        readahead: bool | None = None,
        seed: int | None = None,
        image_mode: str | dict[str, str] | None = None,
        **store_options: Any,
    ):
        """Open the store's metadata (see :class:`StoreDataset` for ``on_error``,
        ``readahead`` and ``seed``).

        Args:
            path: a store directory written by :func:`fastdata.write`.
            transform: called with each sample dict (after decoding); its result is returned.
            output: ``"pil"``, ``"numpy"`` or ``"tensor"`` for image fields (tensor also
                turns array fields into tensors).
            decode: a decode-time transform for the image fields (``fastdata.reader.transforms``);
                refused when the schema holds anything but images and index scalars, since a
                fused crop would move the image but not, e.g., its boxes.
            image_mode: the read mode of the image fields (a str for all, or a dict per field);
                None: each field's schema default (``Image(mode=...)``), else ``"RGB"`` for the field
                named ``image`` and ``"unchanged"`` for any other (a mask comes back as stored). See
                :class:`StoreDataset`.
            store_options: ``storage_options``, ``cache_dir``, ``cache_limit``, ``max_open_shards``
                of a remote store (a URL ``path``), as :class:`StoreDataset`.
        """
        super().__init__(path, transform=transform, output=output, decode=decode, on_error=on_error,
                         readahead=readahead, seed=seed, image_mode=image_mode, **store_options)

    # -- metadata ---------------------------------------------------------------------------
    def _load_index(self, manifest: dict) -> None:
        self.schema = schema_of(manifest, self.root)
        self._schema = self.schema
        self._ragged_fields = tuple(name for name, f in self.schema if isinstance(f, Ragged))
        others = [name for name, f in self.schema if not isinstance(f, Image | Int | Float)]
        if self.decode is not None and others:
            raise ValueError(
                f"{self.root}: decode= is refused for a store with fields {', '.join(others)}: a fused crop "
                "would move the image but not its boxes: use transform= with torchvision.transforms.v2")
        parts: dict[str, list[np.ndarray]] = {}
        paths, path_offsets, base = [], [np.zeros(1, dtype=np.int64)], 0
        from fastdata.format.backends.registry import reader_class

        indexes = self._store.shard_indexes(reader_class(self.backend), self.storage, self.schema)
        for shard, index in zip(manifest["shards"], indexes, strict=True):
            assert isinstance(index, SampleIndex)
            if len(index) != shard["count"]:
                raise CorruptRecordError(f"{self.root}/{shard['name']}: holds {len(index)} records, the manifest "
                                         f"says {shard['count']}; run 'fastdata verify'", store=self.root,
                                         shard=shard["name"])
            for key, arr in index.arrays.items():
                if key.startswith(FIELD_PREFIX):
                    parts.setdefault(key, []).append(arr)
            paths.append(index.arrays["relpaths"])
            path_offsets.append(index.arrays["relpath_offsets"][1:] + base)
            base += len(index.arrays["relpaths"])
        self._count = int(manifest["num_samples"])
        #: index-resident arrays by key (``fields/<name>``, ``fields/<image>.format``, ...)
        self.index_arrays = {key: np.concatenate(arrs) for key, arrs in parts.items()}
        if any(len(arr) != self._count for arr in self.index_arrays.values()):
            raise CorruptRecordError(f"{self.root}: index disagrees with the manifest; run 'fastdata verify'",
                                     store=self.root)
        self._relpaths = np.concatenate(paths).astype(np.uint8) if paths else np.zeros(0, dtype=np.uint8)
        self._relpath_offsets = np.concatenate(path_offsets).astype(np.int64)
        self._load_class_tables(manifest)
        self.uniform_shape = None
        self._pixel_meta = {name: (self.index_arrays[f"{FIELD_PREFIX}{name}.dtype"],
                                   self.index_arrays[f"{FIELD_PREFIX}{name}.channels"])
                            for name in self.schema.image_fields()}

    def _image_field_names(self) -> tuple[str, ...]:
        return self.schema.image_fields()

    # -- index columns ----------------------------------------------------------------------
    def _column_keys(self) -> dict[str, str]:
        """Column name -> its key in :attr:`index_arrays`: every index-resident field by name,
        ``<image>.format|width|height|dtype|channels`` per image field, ``<chunked>.shape`` per
        chunked field; with one image field also its metadata without the prefix, and
        ``label`` for the class field, unless a field already has that name."""
        keys = {name: FIELD_PREFIX + name for name in self.schema.index_fields()}
        images = self.schema.image_fields()
        for name in images:
            keys.update({f"{name}.{meta}": f"{FIELD_PREFIX}{name}.{meta}" for meta in IMAGE_META})
        for name in self.schema.chunked_fields():
            keys[f"{name}.shape"] = chunk_shape_key(name)
        if len(images) == 1:
            for meta in IMAGE_META:
                keys.setdefault(meta, f"{FIELD_PREFIX}{images[0]}.{meta}")
        if self.target_field is not None:
            keys.setdefault("label", FIELD_PREFIX + self.target_field)
        return {name: key for name, key in keys.items() if key in self.index_arrays}

    def columns(self) -> tuple[str, ...]:
        """The names :meth:`column` accepts for this store (see there)."""
        return tuple(self._column_keys())

    def column(self, name: str) -> np.ndarray:
        """One value per sample of an index-resident field, without reading a record.

        Names: every field the index holds (ints, floats, small fixed-shape arrays: ``(n, *shape)``
        rows), the class field included; per image field ``<image>.width``, ``.height``,
        ``.channels`` (0: not recorded), ``.dtype`` (the numpy dtype name of the stored pixels,
        ``""``: not recorded) and ``.format`` (``"JPEG"``, ``"PNG"``...); per chunked field
        ``<field>.shape`` (``(n, ndim)``). With a single image field also ``width``, ``height``,
        ``channels``, ``dtype``, ``format``; with a class field also ``label`` (unless a field
        has that name).

        Args:
            name (str): a column name (:meth:`columns` lists them).

        Returns:
            np.ndarray: ``len(self)`` values, read-only.

        Raises:
            KeyError: no such column; the message lists the available ones.
        """
        return super().column(name)

    def _column(self, name: str) -> np.ndarray | None:
        key = self._column_keys().get(name)
        if key is None:
            return None
        array = self.index_arrays[key]
        field, _, meta = key[len(FIELD_PREFIX):].partition(".")
        if field in self.schema.image_fields() and meta in ("dtype", "format"):  # codes -> names
            return code_names(array, IMAGE_DTYPE_NAMES if meta == "dtype" else FORMAT_NAMES)
        return array

    def _default_mode(self, name: str, manifest: dict) -> str:
        """The schema's mode for the field (``Image(mode=...)``), else "RGB" for ``image`` and
        "unchanged" for any other image field."""
        field = self.schema[name]
        assert isinstance(field, Image)
        return field.default_mode(name)

    def _load_class_tables(self, manifest: dict) -> None:
        """``class_tables`` (every class field's names, e.g. from a JSONL list), and
        ``targets``: the single-label class field's indices (one per sample, as ImageFolder's, as a
        read-only int64 numpy array: see :attr:`StoreDataset.targets`), so samplers and class counts
        work; empty when there is none."""
        from fastdata.format.manifest import CLASS_TABLES_KEY, target_field

        #: field name -> class names, for each class field (``classes`` is the targets' table)
        self.class_tables: dict[str, list[str]] = {k: list(v) for k, v in manifest.get(CLASS_TABLES_KEY, {}).items()}
        target = target_field(self.schema, self.class_tables)
        self.target_field = target
        self.targets = read_only(self.index_arrays[FIELD_PREFIX + target].astype(np.int64) if target is not None
                                 else np.zeros(0, dtype=np.int64))

    def __len__(self) -> int:
        return self._count

    def extra_repr(self) -> str:
        return super().extra_repr() + "\nFields: " + ", ".join(f"{n} ({f.kind})" for n, f in self.schema)

    # -- reading ----------------------------------------------------------------------------
    def _decode_image(self, data: bytes, fmt: str, index: int, name: str, epoch: int | None,
                      into: np.ndarray | None = None):
        """One image field decoded per ``output``/``decode`` (full decodes straight into
        ``into`` when given: an HWC slot of the batch's shared segment); fastdata's own
        decoders' failures become :class:`CorruptRecordError` (a user's decode callable's propagate)."""
        mode = self.image_modes[name]
        try:
            if self.decode is None:
                if into is not None:
                    decode_numpy_into(data, fmt, into, None, mode)
                    return into
                return (decode_pil(data, fmt, None, mode) if self.output == "pil"
                        else decode_numpy(data, fmt, None, mode))
            moded = {} if mode == "RGB" or not self._decode_is_ours else {"mode": mode}
            if self._decode_takes_rng:
                rng = None if epoch is None else sample_rng(self.seed, epoch, index)
                image = self.decode(data, rng, **moded)
            else:
                image = self.decode(data, **moded)
            return pil_of(image) if self.output == "pil" else squeezed(image, mode)
        except ImageModeError as err:  # sound bytes the read mode cannot give: not damage, never skipped
            shard, local = self.locate(index)
            raise ImageModeError(f"{self.root}: shard {self._shard_files[shard]} record {local} (sample {index}) "
                                 f"image field {name!r}: {err}") from None
        except FastdataError:
            raise
        except Exception as err:  # noqa: BLE001 - decoders raise many types on damaged data
            if not self._decode_is_ours:
                raise
            shard, local = self.locate(index)
            raise CorruptRecordError(
                f"{self.root}: shard {self._shard_files[shard]} record {local} (sample {index}): cannot decode "
                f"{fmt} image field {name!r} ({type(err).__name__}: {err}); verify the store with decode=True",
                store=self.root, shard=self._shard_files[shard], index=index) from err

    def _as_output(self, value: Any):
        if self.output == "tensor":
            if isinstance(value, np.ndarray):
                return torch.from_numpy(np.array(value))  # a writable copy
        return value

    def _build(self, data: bytes, index: int, epoch: int | None, slots: dict | None = None) -> dict:
        """The sample dict of record ``data`` (sample ``index``), before ``transform``;
        ``slots``: image field -> HWC uint8 tensor to decode that image into (see
        :meth:`_image_slots`)."""
        shard, local = self.locate(index)
        where = f"{self.root}: shard {self._shard_files[shard]} record {local} (sample {index})"
        record = decode_record_v2(data, self.schema, where=where)
        out: dict[str, Any] = {}
        for name, field in self.schema:
            if isinstance(field, Image):
                fmt = FORMAT_NAMES[int(self.index_arrays[f"{FIELD_PREFIX}{name}.format"][index])]
                slot = slots.get(name) if slots else None
                if slot is not None:
                    self._decode_image(record[name], fmt, index, name, epoch, into=slot.numpy())
                    out[name] = slot.permute(2, 0, 1)
                    continue
                image = self._decode_image(record[name], fmt, index, name, epoch)
                if self.output == "tensor" and isinstance(image, np.ndarray):
                    image = to_tensor(np.ascontiguousarray(image))
                out[name] = image
            elif field.index_shape is not None:
                value = self.index_arrays[FIELD_PREFIX + name][index]
                out[name] = (field.decode(value, where) if not isinstance(field, NDArray)
                             else self._as_output(np.array(value)))
            elif isinstance(field, NDArray | Ragged):
                out[name] = self._as_output(record[name])
            elif isinstance(field, Chunked):
                out[name] = self._chunked(name, field, record[name], index, f"{where} field {name!r}")
            else:
                out[name] = record[name]
        return out

    def _chunked(self, name: str, field: Chunked, table: bytes, index: int, where: str) -> ChunkedArray:
        """The lazy array of chunked field ``name`` of sample ``index`` (shape and table checked)."""
        shape = check_shape(self.index_arrays[chunk_shape_key(name)][index], field.chunks, field.dtype.itemsize,
                            where)
        shard, _local = self.locate(index)
        return ChunkedArray(self._shards, shard, int(self.index_arrays[chunk_first_key(name)][index]),
                            ChunkTable.from_bytes(table, shape, field.chunks, where), field, where)

    def array_shapes(self, name: str) -> np.ndarray:
        """Every sample's shape of chunked field ``name``, ``(len(self), ndim)`` int64, from the
        index (no record is read): what a patch sampler needs to place patches.

        Raises:
            KeyError: ``name`` is not a chunked field of this store.
        """
        if name not in self.schema or not isinstance(self.schema[name], Chunked):
            raise KeyError(f"{name!r} is not a chunked field of {self.root} (chunked fields: "
                           f"{', '.join(self.schema.chunked_fields()) or 'none'})")
        return self.index_arrays[chunk_shape_key(name)]

    def _finish_sample(self, sample: dict):
        return self.transform(sample) if self.transform is not None else sample

    def _load(self, epoch: int | None, index: int):
        return self._finish_sample(self._build(self._raw_bytes(index), index, epoch))

    def __getitem__(self, index: int):
        epoch = epoch_of(index, self.epoch)
        index = self._check_index(index)
        try:
            sample = self._build(self._raw_bytes(index), index, epoch)
        except CorruptRecordError as err:
            return self._skip_to_next(index, err, functools.partial(self._load, epoch))[1]
        return self._finish_sample(sample)

    def _image_slots(self, idx: np.ndarray) -> list[dict[str, torch.Tensor]] | None:
        """In a DataLoader worker with ``output="tensor"`` and full decodes: one HWC
        slot per image of the batch, all in one piece of shared memory sized from the
        index's widths, heights, channels and dtypes (per the read mode), so that images are
        decoded where they travel from (:class:`fastdata.reader.batching.PackedBatch` sends it
        once). None otherwise (and when the index does not record what a mode needs)."""
        if self.output != "tensor" or self.decode is not None or torch.utils.data.get_worker_info() is None:
            return None
        names = [name for name, field in self.schema if isinstance(field, Image)]
        if not names or not len(idx):
            return None
        layouts = {}
        for name in names:
            layout = self._pixel_layout(name, idx)
            if layout is None:
                return None  # dtypes/channels differ or are not recorded: each image decoded on its own
            layouts[name] = layout
        shapes = [{name: (int(self.index_arrays[f"{FIELD_PREFIX}{name}.height"][i]),
                          int(self.index_arrays[f"{FIELD_PREFIX}{name}.width"][i])) for name in names}
                  for i in idx.tolist()]
        limit, byte_limit = pixel_limit(), decoded_bytes_limit()
        if any(not (h > 0 and w > 0 and h * w <= limit
                    and h * w * layouts[name][0] * layouts[name][1].itemsize <= byte_limit)
               for sample in shapes for name, (h, w) in sample.items()):
            return None  # sizes no image may have: decoded one by one (where bombs are refused), nothing allocated
        size = {name: channels * dtype.itemsize for name, (channels, dtype) in layouts.items()}
        total = max(1, sum(aligned(h * w * size[name]) for sample in shapes for name, (h, w) in sample.items()))
        # a slot of the worker's ring: shared memory already mapped and touched by earlier
        # batches; a new segment (its creation and first-touch faults cost ~0.4 ms an image
        # of 400x350) only until the main process has mapped the ring, or when it is full
        lent = batch_ring.lend(total)
        flat = torch.from_numpy(lent) if lent is not None else new_segment(total)
        slots, offset = [], 0
        for sample in shapes:
            mine = {}
            for name, (h, w) in sample.items():
                channels, dtype = layouts[name]
                nbytes = h * w * size[name]
                torch_dtype = torch.from_numpy(np.zeros(0, dtype=dtype)).dtype
                mine[name] = flat[offset:offset + nbytes].view(torch_dtype).view(h, w, channels)
                offset += aligned(nbytes)
            slots.append(mine)
        return slots

    def __getitems__(self, indices: Sequence[int]) -> Samples:
        """A batch of sample dicts, storage read shard by shard in key/offset order
        (as :meth:`StoreDataset.__getitems__`), returned in the order asked; ``self[i]`` for each
        index when a subclass overrides ``__getitem__`` (:mod:`fastdata.reader.overrides`)."""
        epoch = epoch_of(indices, self.epoch)
        before = self._skips
        if overrides_getitem(type(self)):
            samples = each_sample(self, indices, epoch)
            samples.skips, samples.token, samples.ragged = self._skips - before, self._token, self._ragged_fields
            return samples
        idx = self._check_indices(indices)
        out = Samples()
        load = functools.partial(self._load, epoch)
        slots = self._image_slots(idx)
        for k, (i, data) in enumerate(zip(idx.tolist(), self._read_batch(idx), strict=True)):
            try:
                if isinstance(data, CorruptRecordError):
                    raise data
                sample = self._build(data, i, epoch, slots[k] if slots else None)
            except CorruptRecordError as err:
                out.append(self._skip_to_next(i, err, load)[1])
                continue
            out.append(self._finish_sample(sample))
        out.skips, out.token = self._skips - before, self._token
        out.ragged = self._ragged_fields
        return out
