"""Ray Data out and in: write a ``ray.data.Dataset`` into one fastdata store, read a store as one.

Writing (:class:`StoreSink`, :func:`write`)::

    ds = ray.data.read_parquet("s3://bucket/raw/").map_batches(preprocess)
    fastdata.integrations.ray.write(ds, "/shared/train.lmdb", schema={"image": Image(), "label": Int()})

Each Ray write task writes its rows into a store of its own (a *part*, through :func:`fastdata.write`)
beside the destination (``.NAME.ray-parts/<job>/``); when every task has succeeded, the driver
publishes the parts as one store (:func:`fastdata.writer.merge.publish_parts`: shard files linked,
or copied by the server for a URL; the manifest last). Only the parts the successful attempts
returned are published, in task order, so Ray's retries leave no duplicate and no gap; a failed job
publishes nothing and removes its parts. Reading (:func:`read`, :class:`StoreDatasource`): one read
task per shard, images as stored bytes or arrays, every other field a column. The guide "Ray Data"
(``docs/guides/ray.md``) says the rest: order, atomicity, URLs, Spark and Dask.
"""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

try:
    import ray.data
    from ray.data.block import Block, BlockAccessor, BlockMetadata
    from ray.data.datasource import Datasink, Datasource, ReadTask, WriteResult
except ImportError as exc:  # pragma: no cover - depends on what is installed
    from fastdata.errors import MissingExtraError

    raise MissingExtraError("fastdata.integrations.ray needs Ray Data: pip install 'fastdata[ray]'") from exc

import numpy as np

from fastdata.errors import FastdataError, RejectedInputError
from fastdata.format.backends.registry import backend_for_path, get_backend, suffix_hint
from fastdata.format.fields import Chunked, Image, Schema, SchemaError
from fastdata.remote.location import RemoteLocation
from fastdata.remote.store import is_remote, locate_store
from fastdata.writer.api import write as write_samples
from fastdata.writer.lock import raise_if_locked
from fastdata.writer.merge import MergeReport, publish_parts
from fastdata.writer.options import WriteOptions
from fastdata.writer.remote_sink import RemoteLock, check_url_path
from fastdata.writer.remote_sink import check_destination as check_url_destination
from fastdata.writer.session import check_destination

if TYPE_CHECKING:
    from fastdata.reader.dataset import StoreDataset

__all__ = ["StoreDatasource", "StoreSink", "read", "write"]

#: what a store written by :class:`StoreSink` records as its writer (``options.source``)
RAY_SOURCE = "fastdata.integrations.ray"
#: the options of a part that are the job's, not the part's
_JOB_OPTIONS = ("resume", "append", "add_classes", "overwrite", "progress", "staging_dir")


class RayWriteError(FastdataError, ValueError):
    """A Ray write that cannot run or cannot be published (the reason named); nothing is published."""


def parts_folder(dst: str) -> str:
    """The folder (or prefix, for a URL) beside ``dst`` where the write tasks put their parts
    (``.NAME.ray-parts``): on the destination's filesystem, so that publishing hard-links the parts'
    shards instead of copying them (on the destination's server: copied there, server-side)."""
    if is_remote(dst):
        parent, _, name = dst.rstrip("/").rpartition("/")
        return f"{parent}/.{name}.ray-parts"
    parent, name = os.path.split(os.path.abspath(dst).rstrip(os.sep))
    return os.path.join(parent, f".{name}.ray-parts")


def _python_value(value: Any) -> Any:
    """A row value as :func:`fastdata.write` takes it from Python: a numpy scalar (what Arrow's
    integer and float columns give) as its Python number; everything else as it is."""
    return value.item() if isinstance(value, np.generic) else value


def _rows(blocks: Iterable[Block]) -> Iterator[dict[str, Any]]:
    """The rows of ``blocks`` (Arrow tables or pandas frames) as dicts, one block in memory at a time."""
    for block in blocks:
        for row in BlockAccessor.for_block(block).iter_rows(public_row_format=True):  # type: ignore[var-annotated]
            values: dict[str, Any] = dict(row)
            yield {key: _python_value(value) for key, value in values.items()}


class StoreSink(Datasink):
    """A Ray ``Datasink`` that writes a dataset into one fastdata store at ``dst``
    (``ds.write_datasink(StoreSink(dst, schema=...))``; see the module docstring for retries,
    atomicity and order).

    Args:
        dst: the store's directory (its suffix picks the backend unless ``options.format`` is
            given), a path every node of the cluster sees; or its URL (``s3://bucket/train.lmdb``,
            with ``storage_options``; the parts are uploaded beside it and copied server-side).
        schema: a :class:`~fastdata.format.fields.Schema` or ``{name: Field}``; None: each task
            infers it from its first row (parts that infer different schemas are refused when the
            store is published, with the differences named: give ``schema=`` for a stable one).
        options: the write's :class:`~fastdata.WriteOptions` (``format``, ``shard_size``,
            ``strict``, ``lmdb_map_size``, ``workers``...): each part is written with them;
            ``workers`` is the worker processes of each task and defaults to 0 (the task's own
            process: Ray runs the tasks in parallel). ``overwrite`` replaces a store at ``dst``
            when the job publishes. ``resume``, ``append`` and ``staging_dir`` are refused: a
            failed job is rerun.
        metadata: a JSON object stored in the manifest under ``"metadata"``.
        rows_per_task: the fewest rows Ray gives each write task (its ``min_rows_per_write``):
            fewer, larger parts (each part's last shard is short); None: Ray's choice (its blocks).
        **keywords: fields of :class:`~fastdata.WriteOptions`, overriding ``options``.

    Raises:
        RayWriteError: ``resume``/``append``/``staging_dir``, an unknown backend.
        StoreExistsError, StoreLockedError: the destination, checked here, before the job runs,
            and again when it publishes.
    """

    def __init__(self, dst: str | os.PathLike, schema: Schema | Mapping[str, Any] | None = None, *,
                 options: WriteOptions | None = None, metadata: Mapping[str, Any] | None = None,
                 rows_per_task: int | None = None, **keywords: Any) -> None:
        dst = os.fspath(dst)
        options = options if options is not None else WriteOptions()
        if not isinstance(options, WriteOptions):
            raise TypeError(f"options must be a fastdata.WriteOptions, got {type(options).__name__}")
        options = WriteOptions(**{**{f: getattr(options, f) for f in options.__dataclass_fields__
                                     if f != "chunk_size"}, **keywords})
        if (options.resume or options.append or options.staging_dir is not None or options.added_values is not None
                or options.added_defaults is not None):
            raise RayWriteError("a Ray write takes no resume, append (added_values, added_defaults) or staging_dir: a "
                                "failed job publishes nothing and is run again; to add to a store, write a new one and "
                                "fastdata merge them")
        backend = options.format or backend_for_path(dst)
        if backend is None:
            raise RayWriteError(f"{dst}: cannot tell the backend from the destination's suffix; {suffix_hint()}")
        if rows_per_task is not None and (isinstance(rows_per_task, bool) or not isinstance(rows_per_task, int)
                                          or rows_per_task < 1):
            raise ValueError(f"rows_per_task must be an int >= 1 or None, got {rows_per_task!r}")
        self.remote = is_remote(dst)
        self.dst = dst.rstrip("/") if self.remote else os.path.abspath(dst)
        self.storage_options = dict(options.storage_options or {})
        self.schema = Schema.of(schema) if schema is not None else None
        self.metadata = dict(metadata) if metadata is not None else None
        self.overwrite = bool(options.overwrite)
        self.suffix = get_backend(backend).shard_suffix
        part = {f: getattr(options, f) for f in options.__dataclass_fields__ if f not in (*_JOB_OPTIONS, "chunk_size")}
        part.update(format=backend, workers=0 if options.workers is None else options.workers, progress=False)
        self.part_options = WriteOptions(**part)
        self.rows_per_task = rows_per_task
        #: this job's folder of parts (removed when the job publishes or fails)
        self.parts_dir = self._join(parts_folder(self.dst), uuid.uuid4().hex[:12])
        #: what the job published (set by :meth:`on_write_complete`)
        self.report: MergeReport | None = None
        if self.remote:
            check_url_path(self.dst)
            target = RemoteLocation(self.dst, self.storage_options)
            RemoteLock(target).check()
            check_url_destination(target, resume=False, overwrite=self.overwrite, clear=False)
        else:
            raise_if_locked(self.dst)
            if os.path.exists(self.dst):
                check_destination(self.dst, resume=False, overwrite=self.overwrite)

    def _join(self, folder: str, name: str) -> str:
        return f"{folder}/{name}" if self.remote else os.path.join(folder, name)

    @property
    def min_rows_per_write(self) -> int | None:
        return self.rows_per_task

    def get_name(self) -> str:
        return "FastdataStore"

    def write(self, blocks: Iterable[Block], ctx: Any) -> dict[str, Any]:
        """Write this task's rows into a part of its own (runs in a Ray worker); returns
        ``{"task", "part", "samples"}`` (``part`` None for a task given no rows)."""
        task = int(ctx.task_idx)
        rows = _rows(blocks)
        first = next(rows, None)
        if first is None:
            return {"task": task, "part": None, "samples": 0}
        # a name of this attempt's own: an earlier attempt of the task that died left its part
        # (perhaps half written) under another name, never published
        part = self._join(self.parts_dir, f"part-{task:06d}-{uuid.uuid4().hex[:8]}{self.suffix}")
        if not self.remote:
            os.makedirs(self.parts_dir, exist_ok=True)

        def chained() -> Iterator[dict[str, Any]]:
            yield first
            yield from rows

        try:
            report = write_samples(chained(), part, self.schema, options=self.part_options, metadata=self.metadata)
        except (SchemaError, RejectedInputError) as err:
            # the same error, named where it is in the job ("sample k" is the task's k-th row)
            if err.args and isinstance(err.args[0], str):
                err.args = (f"Ray write task {task} (its rows counted from 0, in the order it received them): "
                            f"{err.args[0]}; nothing was published: fix the rows or the schema and run the job "
                            "again", *err.args[1:])
            raise
        return {"task": task, "part": part, "samples": int(report.images)}

    def on_write_complete(self, write_result: WriteResult) -> None:
        """Publish the parts of the successful tasks as one store (on the driver), then remove the
        parts folder."""
        returns = sorted(write_result.write_returns, key=lambda r: r["task"])
        tasks = [r["task"] for r in returns]
        if len(set(tasks)) != len(tasks):
            raise RayWriteError(f"Ray returned two results for one write task ({tasks}); nothing was published")
        parts = [r["part"] for r in returns if r["part"] is not None]
        try:
            if parts:
                self.report = publish_parts(parts, self.dst, source=RAY_SOURCE, overwrite=self.overwrite,
                                            storage_options=self.storage_options)
            else:
                self._write_empty()
        finally:
            self._remove_parts()

    def _write_empty(self) -> None:
        if self.schema is None:
            raise RayWriteError(f"{self.dst}: the dataset has no rows and no schema= was given: nothing to infer "
                                "the store's fields from; nothing was published")
        options = WriteOptions(**{**{f: getattr(self.part_options, f) for f in self.part_options.__dataclass_fields__
                                     if f != "chunk_size"}, "overwrite": self.overwrite})
        write_samples([], self.dst, self.schema, options=options, metadata=self.metadata)

    def on_write_failed(self, error: Exception) -> None:
        """A failed job publishes nothing: remove its parts folder."""
        self._remove_parts()

    def _remove_parts(self) -> None:
        if self.remote:
            parts = RemoteLocation(self.parts_dir, self.storage_options)
            try:
                parts.remove(sorted(parts.listing()))
            except FastdataError as err:  # the store is published (or the job failed) either way: say what is left
                warnings.warn(f"{self.parts_dir}: the parts of this Ray write could not be deleted ({err}); delete "
                              "that prefix", RuntimeWarning, stacklevel=2)
            return
        shutil.rmtree(self.parts_dir, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(self.parts_dir))  # (only when no other job of this destination uses it)
        except OSError:
            pass


def _unwrap(err: BaseException) -> BaseException:
    """The error a Ray task raised, out of Ray's wrapper (whose text holds the task's traceback),
    without the lines Ray Data appends to its message (how to configure Ray's retries: a
    fastdata error is not transient)."""
    cause = getattr(err, "cause", None)
    if not isinstance(cause, BaseException):
        return err
    if cause.args and isinstance(cause.args[0], str) and "\nFailed to " in cause.args[0]:
        cause.args = (cause.args[0].split("\nFailed to ", 1)[0], *cause.args[1:])
    return cause


def write(dataset: ray.data.Dataset, dst: str | os.PathLike, schema: Schema | Mapping[str, Any] | None = None, *,
          options: WriteOptions | None = None, metadata: Mapping[str, Any] | None = None,
          rows_per_task: int | None = None, ray_remote_args: Mapping[str, Any] | None = None,
          concurrency: int | None = None, **keywords: Any) -> MergeReport | None:
    """Write a ``ray.data.Dataset`` into one fastdata store: ``dataset.write_datasink(StoreSink(...))``,
    with the schema inferred once from the dataset's first row when not given (so every part has
    the same one) and a fastdata error raised as itself (Ray wraps a task's error in its own).

    Args:
        dataset: the rows: dicts of field name -> value, as :func:`fastdata.write` takes them
            (Arrow's binary columns are bytes, its tensor columns numpy arrays).
        dst, schema, options, metadata, rows_per_task, **keywords: as :class:`StoreSink`.
        ray_remote_args: Ray options of the write tasks (e.g. ``{"max_retries": 3}``).
        concurrency: most write tasks at once (None: Ray's choice).

    Returns:
        The :class:`~fastdata.writer.merge.MergeReport` of the publish (None for an empty dataset).

    Raises:
        SchemaError: a row does not match the schema (naming the write task, the row and the
            field); nothing is published.
        RayWriteError, StoreExistsError, StoreLockedError: as :class:`StoreSink`.
        Any other error of the job (e.g. ``ray.exceptions.RayTaskError`` of a task out of retries);
        nothing is published and the parts are removed.
    """
    if schema is None:
        first = dataset.take(1)
        if first:
            schema = Schema.infer({k: _python_value(v) for k, v in first[0].items()}, "row 0")
    sink = StoreSink(dst, schema, options=options, metadata=metadata, rows_per_task=rows_per_task, **keywords)
    try:
        dataset.write_datasink(sink, ray_remote_args=dict(ray_remote_args or {}), concurrency=concurrency)
    except Exception as err:
        cause = _unwrap(err)
        if isinstance(cause, FastdataError) and cause is not err:
            raise cause.with_traceback(None) from None
        raise
    return sink.report


# -- reading -------------------------------------------------------------------------------------

#: how :func:`read` gives image fields
IMAGES = ("bytes", "numpy")


def _column(values: list[Any]) -> np.ndarray:
    """``values`` as one column of a Ray batch: numbers as a numpy array, anything else (bytes,
    strings, arrays of different shapes, JSON values) as an object array, one value per row."""
    if values and all(isinstance(v, bool | int | float) for v in values):
        return np.asarray(values)
    column = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        column[i] = value
    return column


class StoreDatasource(Datasource):
    """A Ray ``Datasource`` over a fastdata store: one read task per shard (see :func:`read`)."""

    def __init__(self, store: str | os.PathLike, *, images: str = "bytes",
                 image_mode: str | Mapping[str, str] | None = None, columns: Sequence[str] | None = None,
                 index_column: str | None = None,
                 storage_options: Mapping[str, Any] | None = None, cache_dir: str | None = None,
                 cache_limit: int | str | None = None, rows_per_block: int | None = None) -> None:
        if images not in IMAGES:
            raise ValueError(f"images must be one of {IMAGES}, got {images!r}")
        if rows_per_block is not None and (isinstance(rows_per_block, bool) or not isinstance(rows_per_block, int)
                                           or rows_per_block < 1):
            raise ValueError(f"rows_per_block must be an int >= 1 or None, got {rows_per_block!r}")
        self.store = os.fspath(store)
        self.open_options: dict[str, Any] = {
            "output": "bytes" if images == "bytes" else "numpy", "image_mode": image_mode,
            "storage_options": dict(storage_options) if storage_options is not None else None,
            "cache_dir": cache_dir, "cache_limit": cache_limit}
        from fastdata.reader.dataset import StoreDataset  # (here: the write tasks never import the reader)

        location = locate_store(self.store, storage_options=storage_options, cache_dir=cache_dir,
                                cache_limit=cache_limit)
        # (the manifest and the index; for a remote store, no shard is downloaded here)
        dataset = StoreDataset(location, **{k: v for k, v in self.open_options.items()
                                             if k in ("output", "image_mode")})
        self.root = dataset.root
        names = [name for name, _ in dataset.schema]
        chosen = list(names if columns is None else columns)
        unknown = [c for c in chosen if c not in names]
        if unknown:
            raise ValueError(f"{self.root} has no field {unknown[0]!r}; its fields: {', '.join(names)}")
        chunked = [c for c in chosen if isinstance(dataset.schema[c], Chunked)]
        if chunked:
            raise ValueError(f"{self.root}: field {chunked[0]!r} is a chunked array (read by region with "
                             "fastdata.open_dataset or fastdata.PatchDataset, not as a column): pass columns= "
                             "without it")
        if index_column is not None and index_column in chosen:
            raise ValueError(f"index_column {index_column!r} is a field of {self.root}: choose another name")
        self.columns, self.index_column = chosen, index_column
        self.image_columns = [c for c in chosen if isinstance(dataset.schema[c], Image)]
        manifest = location.manifest
        self.shards = [(int(s["first_index"]), int(s["count"]), int(s["bytes"])) for s in manifest["shards"]]
        self.rows_per_block = rows_per_block
        dataset.close()

    def _open(self) -> StoreDataset:
        from fastdata.reader.dataset import StoreDataset

        return StoreDataset(self.store, **self.open_options)

    def get_name(self) -> str:
        return "FastdataStore"

    def estimate_inmemory_data_size(self) -> int | None:
        return sum(nbytes for _, _, nbytes in self.shards) or None

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list[ReadTask]:
        """One read task per shard whatever ``parallelism`` asks: a shard is read whole by one
        process (a remote store's shard downloaded once, into that node's cache)."""
        tasks = []
        for first, count, nbytes in self.shards:
            if count == 0:
                continue
            meta = BlockMetadata(num_rows=count, size_bytes=nbytes, input_files=None, exec_stats=None)
            tasks.append(ReadTask(self._read_fn(first, count, nbytes), meta, per_task_row_limit=per_task_row_limit))
        return tasks

    def _read_fn(self, first: int, count: int, nbytes: int):
        # about 32 MiB of stored bytes a block (Ray's blocks stay well under its 128 MiB target)
        rows = self.rows_per_block or max(1, min(count, (32 << 20) * count // max(1, nbytes)))

        def read_shard() -> Iterator[Block]:
            dataset = self._open()
            try:
                for start in range(first, first + count, rows):
                    stop = min(start + rows, first + count)
                    samples = [dataset[i] for i in range(start, stop)]
                    batch = {c: _column([s[c] for s in samples]) for c in self.columns}
                    if self.index_column is not None:
                        batch[self.index_column] = np.arange(start, stop, dtype=np.int64)
                    yield BlockAccessor.batch_to_block(batch)
            finally:
                dataset.close()

        return read_shard


def read(store: str | os.PathLike, *, images: str = "bytes", image_mode: str | Mapping[str, str] | None = None,
         columns: Sequence[str] | None = None, index_column: str | None = None,
         storage_options: Mapping[str, Any] | None = None, cache_dir: str | None = None,
         cache_limit: int | str | None = None, rows_per_block: int | None = None,
         **read_args: Any) -> ray.data.Dataset:
    """A fastdata store as a ``ray.data.Dataset``: one read task per shard, every sample exactly once.

    ::

        ds = fastdata.integrations.ray.read("s3://bucket/train.lmdb", images="numpy",
                                            storage_options={"endpoint_url": ...})
        ds.map_batches(Predictor, batch_size=64, num_gpus=1, concurrency=4)

    Args:
        store: a store directory (every node must see it) or URL (``s3://``, ``gs://``, ``az://``,
            ``https://``: each read task downloads its shard into its node's cache, checked).
        images: ``"bytes"`` (default: each image field a binary column of its stored, encoded
            bytes) or ``"numpy"`` (decoded HWC arrays per ``image_mode``, a tensor column).
        image_mode: as :func:`fastdata.open_dataset` (``"RGB"``, ``"unchanged"``...; a dict per field).
        columns: the fields to read (None: all; chunked-array fields cannot be columns).
        index_column: also a column of this name holding each sample's index in the store.
        storage_options, cache_dir, cache_limit: as :func:`fastdata.open_dataset`, for a remote store.
        rows_per_block: rows of each block a read task yields (None: about 32 MiB of stored bytes).
        **read_args: keywords of ``ray.data.read_datasource`` (``concurrency``, ``ray_remote_args``...).

    Returns:
        ray.data.Dataset: a column per field (ints and floats as numbers, strings, ragged and
        fixed-shape arrays as tensors, JSON values as Python objects), in store order per shard.

    Raises:
        ValueError: an unknown ``images``, a field that the store lacks, a chunked field.
        FastdataError subclasses for the store (missing, damaged, unreachable), on the driver.
    """
    source = StoreDatasource(store, images=images, image_mode=image_mode, columns=columns, index_column=index_column,
                             storage_options=storage_options, cache_dir=cache_dir, cache_limit=cache_limit,
                             rows_per_block=rows_per_block)
    return ray.data.read_datasource(source, **read_args)
