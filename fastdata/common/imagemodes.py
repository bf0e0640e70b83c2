"""The read modes of image fields (``image_mode=`` of every reader).

* ``"RGB"``, ``"L"``, ``"RGBA"``: Pillow's ``convert(mode)`` of the decoded image, what
  torchvision's loaders give (ImageFolder's is ``convert("RGB")``): 8 bits per channel,
  so a 16-bit image is reduced (Pillow clips it). Only for images Pillow can open.
* ``"unchanged"``: the pixels as stored, in their own dtype (``uint8``, ``uint16``,
  ``int16``, ``float32``, ...) and channel count (1, 2, 3, 4 or N), as torchvision's
  ``ImageReadMode.UNCHANGED``, ``cv2.IMREAD_UNCHANGED`` and ``tifffile.imread`` give them
  (channels last, colour channels in RGB order; a palette PNG gives its indices).
"""

from __future__ import annotations

#: every read mode, in the order the docs list them
IMAGE_MODES = ("RGB", "L", "RGBA", "unchanged")
#: the modes that go through Pillow's conversions
PILLOW_MODES = ("RGB", "L", "RGBA")
#: channels of each Pillow mode's output
MODE_CHANNELS = {"RGB": 3, "L": 1, "RGBA": 4}


def check_mode(mode: object, where: str = "image_mode") -> str:
    """``mode`` when it is one of :data:`IMAGE_MODES`, else ValueError naming ``where``."""
    if not isinstance(mode, str) or mode not in IMAGE_MODES:
        raise ValueError(f"{where} must be one of {', '.join(map(repr, IMAGE_MODES))}, got {mode!r}")
    return mode
