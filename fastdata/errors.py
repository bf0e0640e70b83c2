"""Error types raised by fastdata.

Data problems are never ``assert`` or a bare ``Exception``: every error a user can
meet is a :class:`FastdataError` whose message names the file, shard or record at
fault and says what to do next. The CLI turns these into one line and exit code 2.
"""

from __future__ import annotations


class FastdataError(Exception):
    """Base class of every error fastdata raises on purpose."""


class SourceError(FastdataError):
    """The input tree or list file cannot be used (missing, empty, unreadable, bad line)."""


class RejectedInputError(SourceError):
    """An input file is not a usable image and ``strict`` mode forbids skipping it."""


class StoreExistsError(FastdataError):
    """The destination already exists and neither ``resume`` nor ``overwrite`` was given."""


class StoreLockedError(FastdataError):
    """Another live converter holds the lock on the destination."""


class FormatError(FastdataError):
    """A store, manifest or shard does not follow the documented layout or version."""


class UnsafeStoreError(FormatError):
    """A store holds something fastdata refuses to open or follow: a FIFO, device or
    directory where a file belongs, HDF5 external storage or links, an LMDB page outside
    its file, a size beyond the documented limits (see docs/SECURITY.md)."""


class StoreChangedError(FormatError):
    """The store was rewritten after the dataset opened it: reading on would mix two versions."""


class IncompleteStoreError(FormatError):
    """The path holds an unfinished conversion (no published manifest)."""


class CorruptRecordError(FormatError):
    """A record failed its checksum or could not be decoded.

    Attributes name where: ``store``, ``shard`` and ``index`` (global sample index).
    """

    def __init__(self, message: str, *, store: str = "", shard: str = "", index: int = -1):
        super().__init__(message)
        self.store = store
        self.shard = shard
        self.index = index


class ImageModeError(FastdataError, ValueError):
    """An image cannot be given in the asked ``image_mode`` or output: e.g. a 5-band TIFF
    or a DICOM read as ``"RGB"`` (Pillow cannot open them), or a 16-bit RGB image as a PIL
    image (PIL has no such mode). The message names the mode or output to use instead.
    Not damage: ``on_error="skip"`` does not skip it."""


class MissingExtraError(FastdataError, ImportError):
    """An optional dependency is missing; the message names the extra to install
    (``pip install 'fastdata[images]'``...). Not damage: ``on_error="skip"`` does not skip it.

    Also an ``ImportError``, so code that already guards an import keeps working.
    """


class ConversionError(FastdataError):
    """The conversion failed (a worker died, an I/O error, a rank failed)."""


class ResumeMismatchError(ConversionError):
    """``resume`` was asked but the source or options differ from the interrupted run."""


class PathNotFoundError(FastdataError):
    """A path given to fastdata (source, store, list file, doctor target) does not exist."""


class RemotePathError(FastdataError):
    """A remote URL was given where only a local path works (a source folder, a list file)."""


class RemoteStoreError(FastdataError):
    """A remote store could not be reached, read or written (after retries), or it changed
    underneath a reader; the message names the URL and what to check."""


class CacheFullError(FastdataError):
    """The local cache of remote shards cannot make room (its limit is below the shards in
    use at once, or its disk is full); the message names the cache directory."""


class ReadLimitError(FastdataError, ValueError):
    """A read would cost more than a reader-side limit allows: the bytes one region read or the
    lazy values of one batch decode (``FASTDATA_MAX_REGION_BYTES``, ``FASTDATA_MAX_BATCH_BYTES``),
    or the tiles of one sample's patch grid. The limits are the user's, never the store's; the
    message names the sample and field and the setting that raises the limit."""
