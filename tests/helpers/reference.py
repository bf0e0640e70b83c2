"""torchvision's ImageFolder scan (``torchvision.datasets.folder``, v0.20), transcribed: the
reference the folder source's classes and sample order are compared with where torchvision
is not installed."""

from __future__ import annotations

import os

from fastdata.common.extensions import IMG_EXTENSIONS


def ref_find_classes(directory: str) -> tuple[list[str], dict[str, int]]:
    classes = sorted(entry.name for entry in os.scandir(directory) if entry.is_dir())
    return classes, {cls_name: i for i, cls_name in enumerate(classes)}


def ref_has_file_allowed_extension(filename: str, extensions) -> bool:
    return filename.lower().endswith(extensions if isinstance(extensions, str) else tuple(extensions))


def ref_make_dataset(directory: str, class_to_idx: dict[str, int], extensions=IMG_EXTENSIONS):
    directory = os.path.expanduser(directory)
    instances = []
    for target_class in sorted(class_to_idx.keys()):
        class_index = class_to_idx[target_class]
        target_dir = os.path.join(directory, target_class)
        if not os.path.isdir(target_dir):
            continue
        for root, _, fnames in sorted(os.walk(target_dir, followlinks=True)):
            for fname in sorted(fnames):
                path = os.path.join(root, fname)
                if ref_has_file_allowed_extension(path, extensions):
                    instances.append((path, class_index))
    return instances


def ref_image_folder(root: str):
    """(classes, [(path, class_index)]) as ``ImageFolder(root, allow_empty=True)``."""
    classes, class_to_idx = ref_find_classes(root)
    return classes, ref_make_dataset(root, class_to_idx)
