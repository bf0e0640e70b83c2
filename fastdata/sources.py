"""``fastdata.sources``: what :func:`fastdata.convert` writes from, one class per input kind.

::

    from fastdata.sources import ImageFolder, NativeSizePixels
    fastdata.convert(ImageFolder("train/", storage=NativeSizePixels(max_side=512)), "train.lmdb")

Each class takes only the options of its kind, with Python names, and checks them when it
is made (a ValueError or TypeError naming the parameter); the options every write has are
one :class:`fastdata.WriteOptions`. A path given to ``convert`` is sniffed into one of these,
its older keywords (``max_side=``, ``raw="HxW"``, ``storage="raw"``, ...) building the same
object, so both calls write the same store.

How the images of an :class:`ImageFolder` are stored is one object, not seven keywords
whose combinations had to be refused: :class:`Reencode`, :class:`Lossless`,
:class:`FixedSizePixels` (every image squashed to one shape: the older ``raw="HxW"``) and
:class:`NativeSizePixels` (each image's pixels at its own size: the older ``storage="raw"``),
:class:`MixedPixels` (some of them: ``storage="mixed"``). The two pixel modes used to share the
word "raw"; the names now say which size the pixels keep.
"""

from fastdata.writer.sources.public import (
    Coco,
    Dicom,
    FixedSizePixels,
    ImageFolder,
    ImageStorage,
    Lossless,
    MixedPixels,
    NativeSizePixels,
    Parquet,
    Reencode,
    Samples,
    Source,
    Table,
    Volumes,
    WebDataset,
)

__all__ = [
    "Coco", "Dicom", "FixedSizePixels", "ImageFolder", "ImageStorage", "Lossless", "MixedPixels", "NativeSizePixels",
    "Parquet", "Reencode", "Samples", "Source", "Table", "Volumes", "WebDataset",
]
