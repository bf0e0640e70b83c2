"""``CocoStoreDataset``: a store converted from COCO, read like ``torchvision.datasets.CocoDetection``.

``ds[i]`` is ``(image, annotations)``: the RGB PIL image (``Image.open(path).convert("RGB")``,
pixel for pixel) and the list of the image's annotation dicts exactly as ``json.load`` gave
them, which is what ``CocoDetection(IMAGE_DIR, ANNOTATIONS)[i]`` returns. The keywords are
torchvision's ``VisionDataset`` ones: ``transform`` (image), ``target_transform``
(annotation list), or ``transforms`` (both at once, ``transforms(image, target)``); giving
``transforms`` together with either of the others is refused, as torchvision refuses it.

With ``target_format="v2"`` the target is what
``torchvision.datasets.wrap_dataset_for_transforms_v2(CocoDetection(...))[i]`` returns
(``image_id``, ``boxes`` as XYXY ``tv_tensors.BoundingBoxes`` on the image's canvas,
``labels``; other keys with ``target_keys``), computed from the untransformed image by
:func:`fastdata.reader.targets.coco_to_v2`, then ``transforms(image, target)`` is applied, so
``torchvision.transforms.v2`` pipelines move image and boxes together. torchvision is
imported only in that mode.

Batches (``__getitems__``, what the DataLoader calls) come marked for
:func:`fastdata.collate`, which turns them into ``(list of images, list of targets)``, as
torchvision's detection references do: images of different sizes cannot be stacked and
detection models take lists.

``ds.coco`` is, as ``CocoDetection.coco``, a ``pycocotools.coco.COCO`` of the ground truth:
built on first access from the stored images and annotation dicts (crowd ones, RLE and polygon
segmentations, ids, areas, boxes as the file has them) and the manifest's categories, so that
``COCOeval`` (and torchvision's detection references' ``CocoEvaluator``) scores predictions on
the store exactly as on the annotation file. It is never pickled into DataLoader workers.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, overload

import numpy as np

from fastdata.errors import CorruptRecordError, FormatError, MissingExtraError
from fastdata.format.record import FIELD_PREFIX, decode_record_v2
from fastdata.reader.batching import Samples
from fastdata.reader.samples import SampleDataset
from fastdata.remote.store import StoreLocation

__all__ = ["CocoStoreDataset", "CocoIds", "TARGET_FORMATS", "is_coco_manifest"]

#: ``"coco"``: the annotation dicts (``CocoDetection``); ``"v2"``: torchvision's transforms-v2 target dict
TARGET_FORMATS = ("coco", "v2")
#: the fields a COCO store must have for this class to read it
_REQUIRED_FIELDS = ("image", "image_id", "annotations")
#: records read at a time while rebuilding the annotation file (``coco_dataset``)
_GT_READ_BATCH = 256


def is_coco_manifest(manifest: dict) -> bool:
    """Whether a (validated) manifest is a store :func:`fastdata.convert_coco` wrote."""
    metadata = manifest.get("metadata")
    return isinstance(metadata, dict) and isinstance(metadata.get("coco"), dict)


class CocoIds(Sequence):
    """The image ids in dataset order (``CocoDetection.ids``), as a read-only sequence of
    ints over the store's int64 index array (no Python object per image until asked).
    Equal to a list or tuple holding the same ints."""

    def __init__(self, array: np.ndarray):
        self._array = array

    def __len__(self) -> int:
        return len(self._array)

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._array[i].tolist()
        return int(self._array[i])

    def __iter__(self) -> Iterator[int]:
        return iter(self._array.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CocoIds):
            return bool(np.array_equal(self._array, other._array))
        if isinstance(other, list | tuple):
            return self._array.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"CocoIds({self._array.tolist()!r:.200})"

    def array(self) -> np.ndarray:
        """The ids as a read-only int64 array."""
        view = self._array.view()
        view.flags.writeable = False
        return view


class _JointTransform:
    """torchvision's ``StandardTransform``: ``transform`` on the image, ``target_transform`` on the target."""

    def __init__(self, transform: Callable | None, target_transform: Callable | None):
        self.transform, self.target_transform = transform, target_transform

    def __call__(self, image: Any, target: Any) -> tuple[Any, Any]:
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target

    def __repr__(self) -> str:
        return f"StandardTransform(transform={self.transform!r}, target_transform={self.target_transform!r})"


class CocoStoreDataset(SampleDataset):
    """A store written by :func:`fastdata.convert_coco`; open it
    with :func:`fastdata.open_dataset`. ``ds[i]`` equals ``CocoDetection(IMAGE_DIR, ANNOTATIONS)[i]``
    (or its transforms-v2 wrapper's with ``target_format="v2"``)."""

    def __init__(
        self,
        path: str | os.PathLike | StoreLocation,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        transforms: Callable | None = None,
        *,
        target_format: str = "coco",
        target_keys: Collection[str] | str | None = None,
        output: str = "pil",
        on_error: str = "raise",
        readahead: bool | None = None,
        seed: int | None = None,
        **store_options: Any,
    ):
        """Open the store's metadata.

        Args:
            path: a store directory written by :func:`fastdata.convert_coco`.
            transform: applied to the image (torchvision ``VisionDataset`` semantics).
            target_transform: applied to the target.
            transforms: applied as ``transforms(image, target)``; exclusive with the two above.
            target_format: ``"coco"`` (the annotation dicts) or ``"v2"`` (torchvision's
                transforms-v2 target; needs torchvision).
            target_keys: with ``"v2"``: ``None`` (``image_id``, ``boxes``, ``labels``), ``"all"``
                or a collection of keys, as ``wrap_dataset_for_transforms_v2``'s.
            output: ``"pil"`` (default, as ``CocoDetection``), ``"numpy"`` (HWC uint8) or
                ``"tensor"`` (CHW uint8).
            on_error, readahead, seed: as :class:`fastdata.reader.dataset.StoreDataset`.
            store_options: ``storage_options``, ``cache_dir``, ``cache_limit``, ``max_open_shards``,
                ``cache`` of a remote store, as :class:`fastdata.reader.dataset.StoreDataset`.

        Raises:
            ValueError: ``transforms`` together with ``transform``/``target_transform``, an
                unknown ``target_format``, or ``target_keys`` without ``"v2"`` or not offered.
            MissingExtraError: ``"v2"`` without an importable torchvision.
            FormatError: the store was not converted from COCO.
        """
        if target_format not in TARGET_FORMATS:
            raise ValueError(f"target_format must be one of {TARGET_FORMATS}, got {target_format!r}")
        if transforms is not None and (transform is not None or target_transform is not None):
            raise ValueError("Only transforms or transform/target_transform can be passed as argument")
        if target_keys is not None and target_format != "v2":
            raise ValueError("target_keys applies to target_format='v2' (the annotation dicts are returned whole)")
        self.target_keys: frozenset[str] | None = None
        if target_format == "v2":
            from fastdata.reader.targets import coco_target_keys, tv_tensors_module

            self.target_keys = coco_target_keys(target_keys)
            tv_tensors_module()  # say now, not at the first sample, that torchvision is missing
        super().__init__(path, output=output, on_error=on_error, readahead=readahead, seed=seed, **store_options)
        self.target_format = target_format
        self.transform = transform
        self.target_transform = target_transform
        self.transforms = transforms if transforms is not None else (
            _JointTransform(transform, target_transform) if transform is not None or target_transform is not None
            else None)

    def _load_index(self, manifest: dict) -> None:
        super()._load_index(manifest)
        missing = [name for name in _REQUIRED_FIELDS if name not in self.schema]
        if missing or not is_coco_manifest(manifest):
            raise FormatError(f"{self.root} was not converted from a COCO annotation file (no "
                              f"{', '.join(missing) or 'metadata.coco'}); open it with fastdata.open_dataset")
        #: what the manifest keeps of the annotation file: categories, info, licenses, problems, paths
        self.coco_metadata: dict = manifest["metadata"]["coco"]
        self._ids = CocoIds(self.index_arrays[FIELD_PREFIX + "image_id"])
        self._coco: Any = None  # the pycocotools COCO, built on first access of .coco

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_coco"] = None  # the whole ground truth: workers rebuild it only if they ask for it
        return state

    @property
    def coco(self) -> Any:
        """The ground truth as a ``pycocotools.coco.COCO``, like ``CocoDetection.coco``.

        Built on first access (in the process that asks, never pickled into DataLoader workers)
        from :meth:`coco_dataset`: reading it costs one pass over the store's records (their
        images are read but not decoded). ``COCOeval(ds.coco, ds.coco.loadRes(detections), "bbox")``
        gives the stats ``COCO(annotation_file)`` gives for the store's images.

        Returns:
            pycocotools.coco.COCO: with ``dataset``, ``imgs``, ``anns``, ``cats`` indexed.

        Raises:
            MissingExtraError: pycocotools is not installed (an ``ImportError``).
            CorruptRecordError: a damaged record (whatever ``on_error`` says: ground truth with
                an image missing would score predictions wrongly).
        """
        if self._coco is None:
            try:
                from pycocotools.coco import COCO
            except ImportError as err:
                raise MissingExtraError(f"CocoStoreDataset.coco needs pycocotools, which is not importable ({err}): "
                                        "pip install pycocotools (or use ds.coco_dataset(), the annotation "
                                        "file's dict, which needs nothing)") from None
            api = COCO()
            api.dataset = self.coco_dataset()
            with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress lines
                api.createIndex()
            self._coco = api
        return self._coco

    def coco_dataset(self) -> dict:
        """The annotation file's content for the store's images, rebuilt from the store.

        ``info`` and ``licenses`` (when the file had them) and ``categories`` from the manifest;
        ``images`` in dataset order, each the file's entry as ``json.load`` gave it (stores converted
        before entries were stored: ``id``, ``file_name``, and ``height``/``width`` when listed);
        ``annotations``: every image's annotation dicts as the file has them (what ``ds[i][1]`` holds),
        image by image. Images the conversion rejected (missing files) and their annotations are not
        in the store, so not here; annotations of images the file does not list were never kept.

        Returns:
            dict: JSON-serialisable, the shape of a COCO instances file.

        Raises:
            CorruptRecordError: a damaged record; run ``fastdata verify`` on the store.
        """
        stored_entries = "image_info" in self.schema
        images: list[dict] = []
        annotations: list[dict] = []
        for start in range(0, len(self), _GT_READ_BATCH):
            idx = np.arange(start, min(len(self), start + _GT_READ_BATCH), dtype=np.int64)
            for i, data in zip(idx.tolist(), self._read_batch(idx), strict=True):
                if isinstance(data, CorruptRecordError):
                    raise data
                shard, local = self.locate(i)
                record = decode_record_v2(data, self.schema,
                                          where=f"{self.root}: shard {self._shard_files[shard]} record {local} "
                                                f"(sample {i})")
                images.append(record["image_info"] if stored_entries else self._image_entry(i))
                annotations.extend(record["annotations"])
        meta = self.coco_metadata
        dataset: dict[str, Any] = {key: meta[key] for key in ("info", "licenses") if meta.get(key) is not None}
        dataset.update(images=images, annotations=annotations, categories=list(meta.get("categories") or []))
        return dataset

    def _image_entry(self, i: int) -> dict:
        """Image ``i``'s ``images`` entry from the index, for a store converted before entries were stored."""
        entry: dict[str, Any] = {"id": self._ids[i]}
        path, image_dir = self.relpath(i), self.coco_metadata.get("image_dir")
        # the stored path is IMAGE_DIR/file_name as it was at conversion
        entry["file_name"] = (os.path.relpath(path, image_dir) if image_dir and os.path.isabs(path)
                              and path.startswith(os.path.join(image_dir, "")) else path)
        for key in ("height", "width"):
            value = int(self.index_arrays[FIELD_PREFIX + key][i])
            if value >= 0:
                entry[key] = value
        return entry

    @property
    def ids(self) -> CocoIds:
        """Image ids in dataset order, like ``CocoDetection.ids``."""
        return self._ids

    @property
    def categories(self) -> list[dict]:
        """The annotation file's ``categories`` list."""
        return self.coco_metadata["categories"]

    def extra_repr(self) -> str:
        return super().extra_repr() + f"\nTarget format: {self.target_format}"

    def _decode_image(self, data: bytes, fmt: str, index: int, name: str, epoch: int | None,
                      into: np.ndarray | None = None):
        """PIL output through :func:`fastdata.reader.decode.decode_numpy` (libjpeg-turbo straight into
        an array for JPEGs, faster than Pillow's decoder and pixel-identical to
        ``Image.open(f).convert("RGB")``) wrapped as an RGB PIL image."""
        if self.output != "pil" or self.image_modes.get(name) != "RGB":
            return super()._decode_image(data, fmt, index, name, epoch, into)
        from PIL import Image as PILImage

        from fastdata.reader.decode import decode_numpy

        try:
            array = decode_numpy(data, fmt, None)
        except Exception:  # noqa: BLE001 - damaged bytes: the shared path decodes again and names the damage
            return super()._decode_image(data, fmt, index, name, epoch)
        return PILImage.fromarray(array)

    def _finish_sample(self, sample: dict) -> Any:
        image, target = sample["image"], sample["annotations"]
        if self.target_format == "v2":
            from fastdata.reader.targets import coco_to_v2

            image, target = coco_to_v2(image, target, sample["image_id"], target_keys=self.target_keys)
        if self.transforms is not None:
            return self.transforms(image, target)
        return image, target

    def __getitems__(self, indices: Sequence[int]) -> Samples:
        """A batch of ``(image, target)`` samples, marked for :func:`fastdata.collate`
        to collate as lists (see the module docstring)."""
        batch = super().__getitems__(indices)
        batch.detection = True
        return batch
