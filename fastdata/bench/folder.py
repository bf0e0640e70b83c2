"""The baseline users start from: ``torchvision.datasets.ImageFolder`` + PIL transforms.

torchvision is not a dependency, so this module reimplements what the baseline
does, faithfully enough that its speed and memory are the ones users see:

* :class:`FolderDataset` scans like ImageFolder (fastdata's scanner is
  ImageFolder-identical: sorted classes, sorted walk, same extensions) and, like
  ImageFolder, keeps ``samples`` as a Python list of ``(path, class_index)``
  tuples and ``targets`` as a list of ints: the per-sample objects that forked
  workers copy page by page (pytorch/pytorch#13246). That cost is part of the
  baseline, so it is kept on purpose.
* Loading is ImageFolder's ``pil_loader``: ``Image.open(f).convert("RGB")``.
* Transforms (PIL, like torchvision on PIL images):

  - ``resize224``: ``Resize(224)`` (shorter side to 224, longer side
    ``int(224 * long / short)``, bilinear with PIL's antialiasing) then
    ``CenterCrop(224)`` (offsets ``int(round((size - 224) / 2))``). The eval
    recipe commonly written ``Resize(256) + CenterCrop(224)`` costs the same;
    224 keeps the output equal to fastdata's ``CenterCrop(224, resize=224)``.
  - ``rrc224``: ``RandomResizedCrop(224)``: torchvision's ``get_params``
    (scale 0.08-1, ratio 3/4-4/3, 10 attempts then a centre fallback) drawing
    from torch's RNG, then ``img.crop(box).resize((224, 224), BILINEAR)``.

* ``output="tensor"`` is ``PILToTensor``: a uint8 CHW tensor (a copy).
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch
from PIL import Image

from fastdata.writer.sources.folder import scan_folder

CROP = 224


def pil_loader(path: str) -> Image.Image:
    """ImageFolder's loader: open, convert to RGB (which fully decodes)."""
    with open(path, "rb") as f:
        img = Image.open(f)
        return img.convert("RGB")


def resize_center_crop(img: Image.Image, size: int = CROP) -> Image.Image:
    """torchvision ``Resize(size)`` + ``CenterCrop(size)`` on a PIL image."""
    w, h = img.size
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = size, int(size * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    img = img.resize((new_w, new_h), Image.Resampling.BILINEAR)
    top = int(round((new_h - size) / 2.0))
    left = int(round((new_w - size) / 2.0))
    return img.crop((left, top, left + size, top + size))


def rrc_params(height: int, width: int, scale=(0.08, 1.0), ratio=(3.0 / 4.0, 4.0 / 3.0)):
    """torchvision ``RandomResizedCrop.get_params``: ``(top, left, h, w)`` from torch's RNG."""
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        # torchvision passes 0-d tensors as the bounds; the same draws as floats
        aspect_ratio = torch.exp(torch.empty(1).uniform_(float(log_ratio[0]), float(log_ratio[1]))).item()
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            top = torch.randint(0, height - h + 1, size=(1,)).item()
            left = torch.randint(0, width - w + 1, size=(1,)).item()
            return top, left, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def random_resized_crop(img: Image.Image, size: int = CROP) -> Image.Image:
    """torchvision ``RandomResizedCrop(size)`` on a PIL image (bilinear)."""
    top, left, h, w = rrc_params(img.height, img.width)
    return img.crop((left, top, left + w, top + h)).resize((size, size), Image.Resampling.BILINEAR)


def pil_to_tensor(img: Image.Image) -> torch.Tensor:
    """torchvision ``PILToTensor`` for RGB images: uint8 CHW (a copy)."""
    return torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1).contiguous()


_TRANSFORMS = {"none": None, "resize224": resize_center_crop, "rrc224": random_resized_crop}
DESCRIPTIONS = {
    "none": "PIL decode",
    "resize224": "PIL decode + PIL Resize(224)+CenterCrop(224)",
    "rrc224": "PIL decode + PIL RandomResizedCrop(224)",
}


class FolderDataset(torch.utils.data.Dataset):
    """ImageFolder-equivalent dataset over ``root/<class>/**/<image>``.

    Args:
        root (str): the image folder.
        transform (str): ``"none"``, ``"resize224"`` or ``"rrc224"`` (see module docstring).
        output (str): ``"pil"`` or ``"tensor"``.

    Attributes:
        classes (list[str]), class_to_idx (dict[str, int]), samples (list[tuple[str, int]]),
        targets (list[int]), file_sizes (numpy int64 array, bytes per sample).
    """

    def __init__(self, root: str, transform: str = "none", output: str = "pil"):
        if transform not in _TRANSFORMS:
            raise ValueError(f"transform must be one of {sorted(_TRANSFORMS)}, got {transform!r}")
        if output not in ("pil", "tensor"):
            raise ValueError(f"output must be 'pil' or 'tensor', got {output!r}")
        scan = scan_folder(root)
        self.root = scan.root
        self.classes = scan.classes
        self.class_to_idx = scan.class_to_idx
        self.samples = [(os.fsdecode(p), int(t)) for p, t in zip(scan.paths, scan.labels, strict=False)]
        self.targets = [t for _, t in self.samples]
        self.file_sizes = np.asarray(scan.sizes, dtype=np.int64)
        self.transform_name = transform
        self.output = output
        self._transform = _TRANSFORMS[transform]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, target = self.samples[index]
        img: Any = pil_loader(path)
        if self._transform is not None:
            img = self._transform(img)
        if self.output == "tensor":
            img = pil_to_tensor(img)
        return img, target

    def files(self) -> list[str]:
        """Every file this dataset reads (for page-cache eviction)."""
        return [p for p, _ in self.samples]
