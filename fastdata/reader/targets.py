"""COCO annotations as torchvision transforms-v2 targets, without a torchvision dataset.

:func:`coco_to_v2` turns one sample of ``torchvision.datasets.CocoDetection`` (an image
and the list of its annotation dicts) into what
``torchvision.datasets.wrap_dataset_for_transforms_v2(CocoDetection(...))`` returns for
it, so ``torchvision.transforms.v2`` pipelines move image and boxes together. It follows
torchvision's COCO wrapper rule for rule (``torchvision/tv_tensors/_dataset_wrapper.py``):

* an image without annotations gives ``{"image_id": image_id}`` and nothing else,
  whatever ``target_keys`` asks for;
* otherwise the target holds the asked keys (default ``image_id``, ``boxes``, ``labels``;
  ``"all"`` = every key below):

  - ``image_id``: the ``image_id`` argument (the sample's id in ``CocoDetection.ids``);
  - ``boxes``: ``tv_tensors.BoundingBoxes`` in ``XYXY`` with ``canvas_size=(H, W)`` of the
    image, from the annotations' ``bbox`` (COCO ``[x, y, w, h]``), dtype as
    ``torch.as_tensor`` gives for the JSON numbers (float32, or int64 if all are ints);
  - ``labels``: ``torch.tensor`` of the ``category_id`` values (int64);
  - ``masks``: ``tv_tensors.Mask`` ``(N, H, W)`` uint8, each annotation's ``segmentation``
    (polygons or RLE) rasterised with pycocotools;
  - ``segmentation``, ``area``, ``iscrowd``, ``bbox``, ``category_id``: the list of that key's
    values over the annotations that have it (``[ann[key] for ann in anns if key in ann]``).

:func:`coco_target` computes the same target with plain tensors and needs only torch (and
pycocotools for masks); torchvision is imported by :func:`coco_to_v2` only, when it has a
box or mask to wrap.
"""

from __future__ import annotations

import importlib
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fastdata.common.coco_rle import rle_size
from fastdata.common.extras import MissingExtraError

__all__ = ["COCO_TARGET_KEYS", "DEFAULT_COCO_TARGET_KEYS", "coco_target_keys", "coco_target", "coco_to_v2",
           "canvas_size", "xywh_to_xyxy"]

#: every key torchvision's COCO wrapper can return: the annotations' own and the ones it adds
COCO_TARGET_KEYS = frozenset({"segmentation", "area", "iscrowd", "image_id", "bbox", "category_id",
                              "boxes", "masks", "labels"})
#: what it returns when ``target_keys`` is not given
DEFAULT_COCO_TARGET_KEYS = frozenset({"image_id", "boxes", "labels"})
#: keys computed from the annotations rather than copied as a list
_DERIVED = ("image_id", "boxes", "masks", "labels")


def coco_target_keys(target_keys: Collection[str] | str | None = None) -> frozenset[str]:
    """The keys a target will hold, checked as torchvision checks them.

    Args:
        target_keys (Collection[str] | str | None): ``None`` (``image_id``, ``boxes``,
            ``labels``), ``"all"``, or a collection of keys from :data:`COCO_TARGET_KEYS`.

    Returns:
        frozenset[str]: the keys.

    Raises:
        ValueError: anything else, or a key torchvision does not offer (named).
        MissingExtraError: ``masks`` asked for but pycocotools is not installed.
    """
    if target_keys is None:
        keys = DEFAULT_COCO_TARGET_KEYS
    elif target_keys == "all":
        keys = COCO_TARGET_KEYS
    elif isinstance(target_keys, Collection) and not isinstance(target_keys, str) and \
            all(isinstance(key, str) for key in target_keys):
        keys = frozenset(target_keys)
        extra = keys - COCO_TARGET_KEYS
        if extra:
            raise ValueError(f"Target keys {sorted(extra)} are not available; choose from "
                             f"{sorted(COCO_TARGET_KEYS)} or 'all'")
    else:
        raise ValueError(f"target_keys can be None, 'all', or a collection of strings denoting the keys to be "
                         f"returned, but got {target_keys!r}")
    if "masks" in keys:
        _pycocotools_mask()  # say now, not at the first annotated image, that masks cannot be made
    return keys


def xywh_to_xyxy(boxes: torch.Tensor) -> torch.Tensor:
    """COCO ``[x, y, w, h]`` boxes ``(..., 4)`` as ``[x1, y1, x2, y2]`` (a new tensor, same dtype),
    with torchvision's arithmetic (``x2 = x + w``, ``y2 = y + h``)."""
    xyxy = boxes.clone()
    xyxy[..., 2:] += xyxy[..., :2]
    return xyxy


def canvas_size(image: Any) -> tuple[int, int]:
    """``(height, width)`` of a PIL image, a ``(..., H, W)`` tensor (torchvision's layout,
    ``tv_tensors.Image`` included) or an ``(H, W[, C])`` numpy array (fastdata's ``output="numpy"``).

    Raises:
        TypeError: any other type.
    """
    if isinstance(image, torch.Tensor):
        if image.ndim < 2:
            raise TypeError(f"an image tensor needs at least 2 dimensions, got shape {tuple(image.shape)}")
        return int(image.shape[-2]), int(image.shape[-1])
    if isinstance(image, np.ndarray):
        if image.ndim not in (2, 3):
            raise TypeError(f"an image array must be (H, W) or (H, W, C), got shape {image.shape}")
        return int(image.shape[0]), int(image.shape[1])
    size = getattr(image, "size", None)  # PIL: (width, height)
    if hasattr(image, "getbands") and isinstance(size, tuple) and len(size) == 2:
        return int(size[1]), int(size[0])
    raise TypeError(f"cannot tell the size of a {type(image).__name__} image; give a PIL image, tensor or array")


def coco_target(annotations: Sequence[Mapping[str, Any]], image_id: Any, size: tuple[int, int],
                target_keys: Collection[str] | str | None = None) -> dict[str, Any]:
    """The v2 target of one image with plain tensors (see the module docstring for the rule).

    Args:
        annotations (Sequence[Mapping]): the image's annotation dicts, as ``CocoDetection`` returns them.
        image_id: the image's id.
        size (tuple[int, int]): the image's ``(height, width)`` (for masks).
        target_keys: as :func:`coco_target_keys`.

    Returns:
        dict: ``boxes`` a float/int ``(N, 4)`` XYXY tensor, ``masks`` a uint8 ``(N, H, W)``
        tensor, the rest as :func:`coco_to_v2` returns them.

    Raises:
        KeyError: a key asked for that no annotation has (names it).
    """
    keys = coco_target_keys(target_keys)
    if not annotations:
        return {"image_id": image_id}
    columns = _columns(annotations)
    target: dict[str, Any] = {}
    if "image_id" in keys:
        target["image_id"] = image_id
    if "boxes" in keys:
        target["boxes"] = xywh_to_xyxy(torch.as_tensor(_column(columns, "bbox")))
    if "masks" in keys:
        target["masks"] = torch.stack([_segmentation_to_mask(s, size) for s in _column(columns, "segmentation")])
    if "labels" in keys:
        target["labels"] = torch.tensor(_column(columns, "category_id"))
    for key in sorted(keys - set(_DERIVED)):
        target[key] = _column(columns, key)
    return target


def coco_to_v2(image: Any, annotations: Sequence[Mapping[str, Any]], image_id: Any, *,
               target_keys: Collection[str] | str | None = None) -> tuple[Any, dict[str, Any]]:
    """``(image, target)`` as ``wrap_dataset_for_transforms_v2(CocoDetection(...))`` returns it.

    The image comes back unchanged; give it before any transform (the wrapper converts
    first and transforms after: ``transforms(image, target)``).

    Args:
        image: the decoded image (PIL, ``(C, H, W)`` tensor or ``(H, W, C)`` array); its size
            is the boxes' canvas.
        annotations (Sequence[Mapping]): the image's annotation dicts, as ``CocoDetection`` returns them.
        image_id: the image's id (``CocoDetection.ids[i]``).
        target_keys: ``None`` (``image_id``, ``boxes``, ``labels``), ``"all"``, or a collection
            of keys from :data:`COCO_TARGET_KEYS`.

    Returns:
        tuple: the image and the target dict; ``boxes`` a ``tv_tensors.BoundingBoxes`` (XYXY,
        ``canvas_size=(H, W)``), ``masks`` a ``tv_tensors.Mask``.

    Raises:
        MissingExtraError: torchvision (or, for ``masks``, pycocotools) is not installed.
        ValueError: bad ``target_keys``.
        KeyError: a key asked for that no annotation has.
    """
    size = canvas_size(image)
    target = coco_target(annotations, image_id, size, target_keys)
    if "boxes" in target or "masks" in target:
        tv_tensors = tv_tensors_module()
        if "boxes" in target:
            target["boxes"] = tv_tensors.BoundingBoxes(target["boxes"], format=tv_tensors.BoundingBoxFormat.XYXY,
                                                       canvas_size=size)
        if "masks" in target:
            target["masks"] = tv_tensors.Mask(target["masks"])
    return image, target


class AddEmptyBoxes:
    """A v2 transform step that gives an image without annotations empty ``boxes``
    and ``labels``.

    torchvision's v2 wrapper of ``CocoDetection`` (and so ``target_format="v2"``)
    leaves both keys out of such an image's target; ``v2.SanitizeBoundingBoxes``
    and torchvision's detection models need them. Put it first in the pipeline. A
    class, not a lambda, so DataLoader workers receive it under any start method.
    """

    def __call__(self, image: Any, target: dict) -> tuple[Any, dict]:
        if "boxes" in target:
            return image, target
        tv_tensors = tv_tensors_module()
        empty = tv_tensors.BoundingBoxes(torch.zeros(0, 4), format="XYXY", canvas_size=canvas_size(image))
        return image, dict(target, boxes=empty, labels=torch.zeros(0, dtype=torch.int64))

    def __repr__(self) -> str:
        return "AddEmptyBoxes()"


def _columns(annotations: Sequence[Mapping[str, Any]]) -> dict[str, list]:
    """torchvision's ``list_of_dicts_to_dict_of_lists``: key -> values of the annotations that have it."""
    columns: dict[str, list] = {}
    for ann in annotations:
        for key, value in ann.items():
            columns.setdefault(key, []).append(value)
    return columns


def _column(columns: dict[str, list], key: str) -> list:
    try:
        return columns[key]
    except KeyError:
        raise KeyError(f"target key needs the annotations' {key!r}, which none of this image's "
                       f"annotations has (they have {sorted(columns)})") from None


def _segmentation_to_mask(segmentation: Any, size: tuple[int, int]) -> torch.Tensor:
    """One annotation's polygons or RLE as an ``(H, W)`` uint8 mask, as torchvision rasterises it."""
    mask = _pycocotools_mask()
    if isinstance(segmentation, dict):
        _check_rle(segmentation, size)
        if not isinstance(segmentation["counts"], str):  # uncompressed RLE; a str is already encoded
            segmentation = mask.frPyObjects(segmentation, *size)
    elif isinstance(segmentation, list):
        segmentation = mask.merge(mask.frPyObjects(segmentation, *size))
    else:
        raise ValueError(f"COCO segmentation expected to be a dict or a list, got {type(segmentation)}")
    return torch.from_numpy(mask.decode(segmentation))


def _check_rle(rle: Mapping[str, Any], size: tuple[int, int]) -> None:
    """Refuse (ValueError) an RLE whose ``size`` is not the image's ``(height, width)`` or whose run
    lengths do not add up to its pixels, before pycocotools allocates the mask at the declared size."""
    declared, why = rle_size(rle)
    if why is not None:
        raise ValueError(f"COCO segmentation: {why}")
    if declared != (int(size[0]), int(size[1])):
        raise ValueError(f"COCO segmentation: RLE size [{declared[0]}, {declared[1]}] is not the image's "
                         f"[{size[0]}, {size[1]}] (height, width)")


def _pycocotools_mask() -> Any:
    try:
        mask = importlib.import_module("pycocotools.mask")  # by name: it ships no type information
    except ImportError:
        raise MissingExtraError("target key 'masks' needs pycocotools to rasterise segmentations, which is not "
                                "installed: pip install pycocotools") from None
    return mask


def tv_tensors_module() -> Any:
    """``torchvision.tv_tensors``, imported now; call it early to say up front that torchvision is missing.

    Raises:
        MissingExtraError: torchvision cannot be imported (not installed, or built for another torch).
    """
    try:
        from torchvision import tv_tensors
    except ImportError as err:
        raise MissingExtraError(f"torchvision transforms-v2 targets need torchvision, which cannot be imported "
                                f"({err}): pip install the torchvision built for torch {torch.__version__}") from None
    return tv_tensors
