"""The options every write has (:class:`WriteOptions`, public as ``fastdata.WriteOptions``), and
the shared rules behind them, checked and resolved in one place: the storage mode, the backend,
the shard size (and the shard count it gives), the content options a resumed write reuses, and
what ``workers`` means.

``workers`` means the same for every write (PyTorch ``DataLoader(num_workers=...)``'s
convention): None (the default) is all cores this process may run on (its CPU affinity,
where the OS keeps one); 0 is no worker process at all, everything
runs in this process (useful for debugging); N > 0 is N worker processes; a negative
number is an error; more than :data:`WORKERS_PER_CORE_WARNING` times the cores is
allowed (slow network storage can use it) with a warning.

Messages name the Python parameters (``max_side``, ``resume=True``); the command line
translates them to its flags.
"""

from __future__ import annotations

import numbers
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field

from fastdata.common import portable
from fastdata.common.units import Size, describe_size, format_size, parse_size, parse_size_spec
from fastdata.format.backends.base import MIN_RAW_MAX_SIDE, StorageSpec
from fastdata.format.backends.registry import backend_for_path, get_backend, suffix_hint
from fastdata.writer.plan import ShardPlan
from fastdata.writer.resume import RunOptions

DEFAULT_SHARD_SIZE = "1GiB"
#: smallest shard size accepted: below it a store is thousands of tiny files to open and check.
#: FASTDATA_MIN_SHARD_SIZE lowers it (the test suite converts kilobyte-sized trees into several shards).
MIN_SHARD_SIZE = 1 << 20
#: most shards one conversion may make (each shard is a file a reader opens and maps)
MAX_SHARDS = 10_000
#: ``workers`` above this many times the core count gets a warning
WORKERS_PER_CORE_WARNING = 4
#: the ``workers`` rule, as each entry point's docstring and the CLI help say it
WORKERS_HELP = ("worker processes that read, validate and encode the inputs (default: all cores this process may "
                "run on; 0: none, "
                "everything runs in this process, e.g. for debugging; more than 4x the cores is allowed with a "
                "warning)")
#: inputs per worker task unless ``task_size`` says otherwise
DEFAULT_TASK_SIZE = 32


def _check_flag(value: object, name: str, optional: bool = False) -> None:
    if not (isinstance(value, bool) or (optional and value is None)):
        raise TypeError(f"{name} must be True or False{' (or None)' if optional else ''}, got {value!r}")


def _check_size(value: object, name: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, str | numbers.Integral):
        raise TypeError(f"{name} must be a byte count or a size such as \"512MiB\", got {value!r}")
    try:
        parse_size_spec(value if isinstance(value, str) else int(value))
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None


@dataclass(frozen=True)
class WriteOptions:
    """How to write a store: the options every write has, whatever its source.

    ``fastdata.convert(source, dst, options)`` takes one (keywords of ``convert`` with these names
    override its fields); each value is checked here, when the object is made. The options that
    decide the content (``format``, ``shard_size``, ``strict``) left as None take, with ``resume``,
    the values the interrupted write recorded, else their defaults.

    Args:
        format (str | None): the backend, ``"lmdb"`` or ``"hdf5"``; None: from the destination's
            suffix (``.lmdb``, ``.h5``).
        workers (int | None): worker processes that read, validate and encode the inputs. None (the
            default): all cores; 0: none, everything runs in this process (for debugging, or inputs
            that cannot be pickled); N > 0: N processes (more than 4x the cores is allowed, with a
            warning).
        shard_size (int | str | None): target bytes per shard file (an ``int`` or a size such as
            ``"512MiB"``, ``"2GB"``); default 1 GiB, at least 1 MiB, and at most 10,000 shards per store.
        strict (bool | None): stop at the first unusable input instead of skipping and reporting it.
            None: the source's default (False for files on disk, True for
            :class:`~fastdata.writer.sources.public.Samples`).
        resume (bool): finish an interrupted write, keeping its completed shards.
        overwrite (bool): replace an existing store at the destination.
        append (bool): add the samples to the published store at the destination as new shards
            (:mod:`fastdata.writer.append`); with ``resume``, finish an interrupted append.
        add_classes (bool): with ``append``: class names the store lacks are appended to its class table.
        added_values (Mapping | None): with ``append`` to a store with added fields
            (``fastdata.add_fields``): ``{name: values}``, one value a new sample in the order
            they are appended (an array or a list, as ``add_fields`` takes them), written into
            the new shards' field files.
        added_defaults (Mapping | None): with ``append``: ``{name: value}``, one value for every
            new sample of these added fields (a field added with ``defaults=`` takes its own
            when neither is given; an added field with neither values nor a default is an error).
        progress (bool | None): show a progress bar; None: when stderr is a terminal.
        lmdb_map_size (int | str | None): the initial LMDB map size (it grows automatically).
        task_size (int): inputs per worker task (default 32): smaller tasks spread a few large
            inputs over more workers, larger ones cost less per input. Not an array's chunk shape
            (that is ``chunks`` of :class:`~fastdata.writer.sources.public.Volumes`).
        storage_options (Mapping | None): fsspec options for a URL destination (endpoint, credentials, ...).
        staging_dir (str | os.PathLike | None): local folder the shards of a URL destination are
            written in before upload (default: under the cache directory).
        chunk_size (int | None): deprecated name of ``task_size`` (a DeprecationWarning).

    Raises:
        TypeError: a value of the wrong type, naming the parameter.
        ValueError: an invalid value (an unknown format, a negative ``workers``, a malformed size).
    """

    format: str | None = None
    workers: int | None = None
    shard_size: int | str | None = None
    strict: bool | None = None
    resume: bool = False
    overwrite: bool = False
    append: bool = False
    add_classes: bool = False
    added_values: Mapping | None = field(default=None, compare=False, repr=False)
    added_defaults: Mapping | None = field(default=None, compare=False)
    progress: bool | None = None
    lmdb_map_size: int | str | None = None
    task_size: int = DEFAULT_TASK_SIZE
    storage_options: Mapping | None = None
    staging_dir: str | os.PathLike | None = None
    chunk_size: InitVar[int | None] = None

    def __post_init__(self, chunk_size: int | None) -> None:
        if chunk_size is not None:
            warnings.warn("chunk_size is deprecated: it is the number of inputs per worker task, now named "
                          "task_size (chunks is an array's chunk shape)", DeprecationWarning, stacklevel=3)
            if self.task_size not in (DEFAULT_TASK_SIZE, chunk_size):
                raise ValueError(f"chunk_size (deprecated) and task_size name one option: give task_size only, "
                                 f"got chunk_size={chunk_size!r}, task_size={self.task_size!r}")
            object.__setattr__(self, "task_size", chunk_size)
        if self.format is not None:
            if not isinstance(self.format, str):
                raise TypeError(f"format must be a backend name such as \"lmdb\" or \"hdf5\", got {self.format!r}")
            get_backend(self.format)
        if self.workers is not None:
            if isinstance(self.workers, bool) or not isinstance(self.workers, numbers.Integral):
                raise TypeError(f"workers must be an int or None, got {self.workers!r}")
            resolve_workers(int(self.workers))
        _check_size(self.shard_size, "shard_size")
        _check_size(self.lmdb_map_size, "lmdb_map_size")
        if isinstance(self.task_size, bool) or not isinstance(self.task_size, numbers.Integral) or self.task_size < 1:
            raise ValueError(f"task_size must be a positive int (inputs per worker task), got {self.task_size!r}")
        for name in ("resume", "overwrite", "append", "add_classes"):
            _check_flag(getattr(self, name), name)
        for name in ("strict", "progress"):
            _check_flag(getattr(self, name), name, optional=True)
        for name in ("added_values", "added_defaults"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Mapping):
                raise TypeError(f"{name} must be a dict of added field names, got {type(value).__name__}")
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise TypeError(f"storage_options must be a dict of fsspec options, got {self.storage_options!r}")
        if self.staging_dir is not None and not isinstance(self.staging_dir, str | os.PathLike):
            raise TypeError(f"staging_dir must be a path, got {self.staging_dir!r}")


def _given(name: str, value: object) -> str:
    """``name=value`` as a message writes a keyword argument (a string quoted)."""
    return f'{name}="{value}"' if isinstance(value, str) else f"{name}={value!r}"


def parse_raw_shape(value) -> tuple[int, int]:
    """``"32x32"`` / ``"32"`` / ``(32, 32)`` -> (H, W)."""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        h, w = int(value[0]), int(value[1])
    else:
        m = re.fullmatch(r"\s*(\d+)\s*(?:[xX]\s*(\d+))?\s*", str(value))
        if not m:
            raise ValueError(f"raw shape must look like HxW (e.g. 32x32), got {value!r}")
        h = int(m.group(1))
        w = int(m.group(2) or h)
    if h <= 0 or w <= 0:
        raise ValueError(f"raw shape must be positive, got {value!r}")
    return h, w


#: the ``lossless=`` codecs: zstd-compressed TIFF, the one there is
LOSSLESS_CODECS = ("tiff",)


#: the ``storage=`` choices: decoded pixels for all images, or for a share of them
STORAGE_CHOICES = ("raw", "mixed")


def parse_raw_budget(value) -> int:
    """``raw_budget``: ``"200GB"``, ``"1.5TiB"`` or a byte count, as bytes (positive).

    Raises:
        ValueError: not a positive size.
    """
    budget = 0
    if not isinstance(value, bool):
        try:
            budget = parse_size(value)
        except (TypeError, ValueError):
            pass
    if budget <= 0:
        raise ValueError(f"raw_budget must be a positive size such as 200GB or 1.5TiB (the most bytes the images "
                         f"may take), got {value!r}")
    return budget


def _raw_native_spec(storage: str, max_side, quality, raw, lossless, raw_fraction, raw_budget) -> StorageSpec:
    """``storage="raw"`` or ``"mixed"`` (modes ``'raw-native'``/``'mixed'`` of :class:`StorageSpec`), checked."""
    if storage not in STORAGE_CHOICES:
        raise ValueError(f"storage must be one of {', '.join(STORAGE_CHOICES)}, got {storage!r}")
    others = [_given(name, v) for name, v in (("raw", raw), ("lossless", lossless), ("quality", quality))
              if v is not None]
    if others:
        raise ValueError(f"storage=\"{storage}\" and {', '.join(others)} are exclusive: storage=\"{storage}\" keeps "
                         "decoded pixels at their own size (up to max_side), raw resizes every image to one shape, "
                         "lossless/quality re-encode; choose one storage mode")
    if max_side is None:
        raise ValueError(f"storage=\"{storage}\" needs max_side=N (N >= {MIN_RAW_MAX_SIDE}): the longest side "
                         "decoded pixels are stored at (e.g. max_side=512), which bounds the disk they take")
    if isinstance(max_side, bool) or int(max_side) != max_side or int(max_side) < MIN_RAW_MAX_SIDE:
        raise ValueError(f"max_side must be a whole number of at least {MIN_RAW_MAX_SIDE} pixels with "
                         f"storage=\"{storage}\" (a random crop needs pixels to choose from), got {max_side!r}")
    budget = None if raw_budget is None else parse_raw_budget(raw_budget)
    if storage == "raw":
        if raw_fraction is not None:
            raise ValueError('raw_fraction applies to storage="mixed" (storage="raw" stores every image as '
                             'pixels)')
        return StorageSpec(mode="raw-native", max_side=int(max_side), raw_budget=budget)
    if raw_fraction is not None and budget is not None:
        raise ValueError("raw_fraction and raw_budget are exclusive: a fraction picks the share of images "
                         "stored as pixels, a budget picks as many as fit in it; give one")
    if budget is not None:
        return StorageSpec(mode="mixed", max_side=int(max_side), raw_budget=budget)
    if raw_fraction is None:
        raise ValueError('storage="mixed" needs raw_fraction=F (the share of images stored as pixels, 0 to 1, '
                         'e.g. 0.5) or raw_budget=SIZE (as many as fit in it, e.g. "200GB"); the rest are kept '
                         'as their original bytes')
    try:
        fraction = float(raw_fraction)
    except (TypeError, ValueError):
        raise ValueError(f"raw_fraction must be a number from 0 to 1, got {raw_fraction!r}") from None
    if not 0.0 <= fraction <= 1.0:  # (NaN fails this too)
        raise ValueError(f"raw_fraction must be from 0 to 1 (the share of images stored as pixels), got "
                         f"{raw_fraction!r}")
    return StorageSpec(mode="mixed", max_side=int(max_side), raw_fraction=fraction)


def storage_spec(max_side: int | None = None, quality: int | None = None, raw=None,
                 lossless: str | None = None, storage: str | None = None,
                 raw_fraction: float | None = None, raw_budget: int | str | None = None) -> StorageSpec:
    """Build the :class:`StorageSpec` for the chosen storage mode.

    Args:
        max_side (int | None): the longest side kept (re-encoding, or raw pixels with ``storage``).
        quality (int | None): JPEG quality of re-encoding.
        raw: ``"HxW"``: fixed-size pixels.
        lossless (str | None): ``"tiff"``.
        storage (str | None): ``"raw"`` (every image's decoded pixels, at its own size capped
            at ``max_side``: mode ``'raw-native'``) or ``"mixed"`` (a share ``raw_fraction`` of
            them, the rest kept as they are: mode ``'mixed'``).
        raw_fraction (float | None): 0 to 1, with ``storage="mixed"``.
        raw_budget (int | str | None): bytes or a size such as ``"200GB"``) with
            ``storage``: the most bytes the images may take; ``"mixed"`` then keeps as pixels the
            images that save the most decode time per byte, as many as fit
            (:mod:`fastdata.writer.raw_budget`), ``"raw"`` refuses a source that does not fit.

    Returns:
        StorageSpec: the mode and its parameters, as the manifest records them.

    Raises:
        ValueError: options of two storage modes, or an invalid value (the message says which).
    """
    if storage is not None:
        return _raw_native_spec(storage, max_side, quality, raw, lossless, raw_fraction, raw_budget)
    if raw_fraction is not None:
        raise ValueError('raw_fraction applies to storage="mixed" only')
    if raw_budget is not None:
        raise ValueError('raw_budget applies to storage="raw" or "mixed" (the bytes decoded pixels may take)')
    if lossless is not None:
        if lossless not in LOSSLESS_CODECS:
            raise ValueError(f"lossless must be one of {', '.join(LOSSLESS_CODECS)}, got {lossless!r}")
        others = [_given(name, v) for name, v in (("raw", raw), ("max_side", max_side), ("quality", quality))
                  if v is not None]
        if others:
            raise ValueError(f"{_given('lossless', lossless)} and {', '.join(others)} are exclusive: it keeps every "
                             "pixel (re-encoded as TIFF), the others resize or re-encode as JPEG; choose one storage "
                             "mode")
        return StorageSpec(mode="lossless")
    if raw is not None and max_side is not None:
        raise ValueError(f"{_given('raw', raw)} and max_side={max_side!r} are exclusive: choose one storage mode")
    if raw is not None:
        return StorageSpec(mode="raw", raw_shape=parse_raw_shape(raw))
    if max_side is not None:
        if int(max_side) <= 0:
            raise ValueError("max_side must be a positive number of pixels")
        if quality is not None and not 1 <= int(quality) <= 100:
            raise ValueError("quality must be within 1..100")
        return StorageSpec(mode="reencode", max_side=int(max_side), quality=int(quality or 90))
    if quality is not None:
        raise ValueError(f"{_given('quality', quality)} only applies with max_side=N (original mode keeps the bytes "
                         "unchanged)")
    return StorageSpec()


def choose_backend(dst: str, fmt: str | None) -> str:
    """Backend from ``format`` or from ``dst``'s suffix."""
    if fmt:
        return get_backend(fmt).name
    backend = backend_for_path(dst)
    if backend is None:
        raise ValueError(f"cannot tell the backend from {dst!r}: name it {suffix_hint()}, or pass format=NAME")
    return backend


def min_shard_size() -> int:
    """The smallest shard size accepted (``FASTDATA_MIN_SHARD_SIZE`` lowers the 1 MiB floor)."""
    override = os.environ.get("FASTDATA_MIN_SHARD_SIZE")
    return parse_size(override) if override else MIN_SHARD_SIZE


def check_shard_size(size: Size) -> Size:
    """Refuse a shard size below :func:`min_shard_size`, saying what to pick."""
    floor = min_shard_size()
    if size.bytes < floor:
        raise ValueError(f"shard size {size} is below the {describe_size(floor)} minimum (tiny shards make a store "
                         "of thousands of files to open and check): pick e.g. shard_size=\"256MiB\", or leave the "
                         f"default {DEFAULT_SHARD_SIZE}")
    return size


def check_shard_count(plans: list[ShardPlan], sizes_total: int, size: Size) -> None:
    """Refuse a plan of more than :data:`MAX_SHARDS` shards, suggesting a shard size that fits."""
    if len(plans) <= MAX_SHARDS:
        return
    suggest = MIN_SHARD_SIZE  # a power of two MiB with room for greedy packing's slack
    while suggest * MAX_SHARDS < 2 * sizes_total:
        suggest *= 2
    raise ValueError(f"shard size {size} would split {format_size(sizes_total)} of images into {len(plans):,} shards "
                     f"(more than {MAX_SHARDS:,}): pick at least shard_size=\"{suggest >> 20}MiB\"")


def resolve_workers(workers: int | None) -> tuple[int, str | None]:
    """``(processes, warning or None)`` for ``workers`` (see the module docstring): None is all
    the cores this process may run on (:func:`~fastdata.common.portable.available_cores`), 0 is
    none (everything in this process), N > 0 is N.

    Raises:
        ValueError: ``workers`` is negative.
    """
    # the cores this process may run on (its CPU affinity: a container's cpuset, taskset), not the
    # machine's: a converter limited to 4 of 64 cores would otherwise start 64 worker processes
    cores = portable.available_cores()
    if workers is None:
        return cores, None
    workers = int(workers)
    if workers < 0:
        raise ValueError(f"workers must be 0 (no worker processes: everything runs in this process) or a positive "
                         f"number of processes, got {workers}")
    if workers > WORKERS_PER_CORE_WARNING * cores:
        return workers, (f"workers={workers} is more than {WORKERS_PER_CORE_WARNING}x the {cores} core(s) here: "
                         "each worker is a process with its own memory, and past the core count they mostly wait; "
                         f"{cores} is usually fastest for local disks")
    return workers, None


def resolve_options(dst: str, recorded: RunOptions | None, *, format: str | None, shard_size,
                    max_side: int | None = None, quality: int | None = None, raw=None,
                    lossless: str | None = None, storage: str | None = None, raw_fraction: float | None = None,
                    raw_budget: int | str | None = None, strict: bool | None) -> RunOptions:
    """The content options of this run.

    Each option given (not None) is used as given; each one not given takes the
    value recorded by the run being resumed (``recorded``), else its default.
    The storage options (``max_side``, ``quality``, ``raw``, ``lossless``, ``storage``,
    ``raw_fraction``, ``raw_budget``) count as one: giving any of them replaces the recorded storage mode.

    Raises:
        ValueError: an option is invalid (the message says what to give instead).
    """
    backend = choose_backend(dst, format) if format is not None or recorded is None else recorded.backend
    storage_given = any(v is not None for v in (max_side, quality, raw, lossless, storage, raw_fraction, raw_budget))
    spec = (storage_spec(max_side, quality, raw, lossless, storage, raw_fraction, raw_budget)
            if storage_given or recorded is None else recorded.storage)
    if shard_size is not None:
        size = check_shard_size(parse_size_spec(shard_size))
    else:
        size = recorded.shard_size if recorded is not None else parse_size_spec(DEFAULT_SHARD_SIZE)
    strict = bool(strict) if strict is not None else (recorded.strict if recorded is not None else False)
    return RunOptions(backend=backend, storage=spec, shard_size=size, strict=strict)
