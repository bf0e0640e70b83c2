"""Which file names are images: the one extension table (light: no image library imported)."""

from __future__ import annotations

import os

#: the one extension table: extension -> the format a file with that name normally holds
#: (torchvision's IMG_EXTENSIONS, then DICOM's ``.dcm``/``.dicom``, which ImageFolder does not
#: take). A folder scan takes the files with these names; the content, not the name, decides
#: the decoder (as for ImageFolder's loader), and a file whose content differs is kept with a warning.
EXTENSION_FORMATS = {
    ".jpg": "JPEG", ".jpeg": "JPEG", ".png": "PNG", ".ppm": "PPM", ".bmp": "BMP", ".pgm": "PPM",
    ".tif": "TIFF", ".tiff": "TIFF", ".webp": "WEBP", ".dcm": "DICOM", ".dicom": "DICOM",
}
#: the image file extensions, torchvision's order first
IMG_EXTENSIONS = tuple(EXTENSION_FORMATS)


def has_image_extension(name: str | bytes) -> bool:
    """True when ``name`` ends with one of :data:`IMG_EXTENSIONS`, ignoring case."""
    if isinstance(name, bytes):
        name = os.fsdecode(name)
    return name.lower().endswith(IMG_EXTENSIONS)
