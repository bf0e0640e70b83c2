"""How a store keeps its images: :class:`StorageMode`, one member per mode, with what each mode does.

The mode is the ``"mode"`` of a manifest's ``storage`` record. The string written there is the
member's value and never changes (a store written by any version reads the same); in code the mode
is this enum, and a question about it ("does this store hold fixed-size pixels?") is a property here.
This module is the only place that compares a mode with its string (``tests/format`` scans the
package for comparisons elsewhere).

Two modes keep decoded pixels, and their names say which: :attr:`StorageMode.FIXED_SIZE_PIXELS`
(``"raw"`` on disk; ``convert(raw="HxW")``) squashes every image to one height and width, while
:attr:`StorageMode.NATIVE_SIZE_PIXELS` (``"raw-native"`` on disk; ``convert(storage="raw")``) keeps
each image's own size, its longer side capped at ``max_side``.
"""

from __future__ import annotations

import enum

from fastdata.errors import FormatError


class StorageMode(enum.StrEnum):
    """A store's storage mode; its value is the string the manifest records."""

    #: each file's bytes as they are (validated)
    ORIGINAL = "original"
    #: images larger than ``max_side`` re-encoded as JPEG at ``quality``; the others as they are
    REENCODE = "reencode"
    #: every image but JPEG, WebP and DICOM re-encoded as a zstd TIFF of its unchanged pixels
    LOSSLESS = "lossless"
    #: decoded RGB pixels squashed to one ``raw_shape`` (H, W): records of format ``RAW``
    FIXED_SIZE_PIXELS = "raw"
    #: every image's decoded RGB pixels at its own size (longer side at most ``max_side``), as PPM
    NATIVE_SIZE_PIXELS = "raw-native"
    #: some images as in :attr:`NATIVE_SIZE_PIXELS` (by a fraction or a byte budget), the rest as given
    MIXED = "mixed"

    @classmethod
    def parse(cls, value: object, where: str = "storage") -> StorageMode:
        """The mode whose manifest string is ``value`` (a member: itself).

        Raises:
            FormatError: ``value`` names no storage mode.
        """
        try:
            return cls(value)  # type: ignore[arg-type]  # any value: a manifest's, checked here
        except ValueError:
            raise FormatError(f"{where}: {value!r} is not a storage mode (one of "
                              f"{', '.join(repr(m.value) for m in cls)})") from None

    @property
    def holds_fixed_size_pixels(self) -> bool:
        """Every record is ``raw_shape`` RGB pixels (no encoded image): read without a decode."""
        return self is StorageMode.FIXED_SIZE_PIXELS

    @property
    def may_hold_native_size_pixels(self) -> bool:
        """Some or all records are PPM pixels at the image's own size (capped at ``max_side``)."""
        return self in (StorageMode.NATIVE_SIZE_PIXELS, StorageMode.MIXED)

    @property
    def holds_only_native_size_pixels(self) -> bool:
        """Every image is stored as PPM pixels at its own size."""
        return self is StorageMode.NATIVE_SIZE_PIXELS

    @property
    def picks_images_to_hold_as_pixels(self) -> bool:
        """Only some images are stored as pixels (by a rule on the path or a byte budget)."""
        return self is StorageMode.MIXED

    @property
    def reencodes_large_images(self) -> bool:
        """Images larger than ``max_side`` are scaled down and stored as JPEG."""
        return self is StorageMode.REENCODE

    @property
    def transcodes_losslessly(self) -> bool:
        """Images (but JPEG, WebP and DICOM) are stored as zstd TIFFs of their unchanged pixels."""
        return self is StorageMode.LOSSLESS

    @property
    def keeps_files_as_given(self) -> bool:
        """Every image is stored as the bytes of its file (checked, never changed)."""
        return self is StorageMode.ORIGINAL
