"""``fastdata.compute_fields``: add fields computed by a function of the samples, run over the store.

The store is read through :func:`fastdata.loader` (worker processes read and decode; batches in
store order, none crossing a shard), the function runs in the calling process on each batch (on
a GPU when it puts its model and the batch there), and each shard's values are staged as its field
file as soon as the shard is done (:class:`fastdata.writer.add_fields.FieldsRun`). A crash loses
at most the shard in progress: ``resume=True`` computes only the shards not staged, then the
store is published as with :func:`fastdata.add_fields`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from fastdata.format.fields import Field
from fastdata.writer.add_fields import AddFieldsError, FieldsRun


class ComputeFieldsError(AddFieldsError):
    """The function raised, or returned something else than one value a sample of the batch; the
    message names the samples of the batch (nothing is published)."""


def _as_rows(name: str, value: Any, count: int, where: str) -> Any:
    """One field's values of a batch as a numpy array or a list of ``count`` values."""
    if type(value).__module__.startswith("torch") and hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    rows: Any
    if isinstance(value, np.ndarray):
        rows = value
    elif isinstance(value, list | tuple):
        rows = list(value)
    else:
        raise ComputeFieldsError(f"{where}: field {name!r}: the function returned {type(value).__name__}, not an "
                                 "array or a list with one value a sample")
    if len(rows) != count:
        raise ComputeFieldsError(f"{where}: field {name!r}: the function returned {len(rows)} values for a batch of "
                                 f"{count} samples")
    return rows


def _first_failing(ds: Any, fn: Callable[[Any], Any], idx: list[int]) -> int | None:
    """The first sample of a batch on which ``fn`` raised that ``fn`` also raises on alone (a batch
    of one, collated as the loader collates), to name it; None when none does alone."""
    from fastdata.reader.batching import collate

    for i in idx:
        try:
            fn(collate(ds.__getitems__([i])))
        except Exception:  # noqa: BLE001 - any exception of the user's function names the sample
            return i
    return None


def _joined(parts: list) -> Any:
    if parts and all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts)
    return [v for p in parts for v in p]


def compute_fields(store: str | os.PathLike, fn: Callable[[Any], Mapping[str, Any]], *, batch_size: int = 64,
                   num_workers: int | None = None, resume: bool = False, replace: bool = False,
                   fields: Mapping[str, Field] | None = None, progress: Callable[[int, int], None] | None = None,
                   **dataset_options: Any) -> dict:
    """Add fields computed by ``fn`` over every sample of a local store, as a new version.

    Args:
        store: the store directory.
        fn: called with each batch as :func:`fastdata.loader` gives it (``(images, targets)`` for a
            folder store, a dict of fields for a general one), in store order; returns
            ``{name: values}``, one value a sample of the batch (a numpy array, a tensor, or a list).
        batch_size: samples a batch (a shard's last batch may be smaller: batches never cross shards).
        num_workers: the loader's worker processes (None: its default).
        resume: finish a run that was interrupted (by a crash, SIGKILL, Ctrl-C): the shards whose
            values were staged are not computed again (``fn`` must be the same function).
        replace: replace added fields of these names.
        fields: declared kinds by name (else inferred from the first shard's values).
        progress: ``progress(done, total)`` after each shard.
        dataset_options: for :func:`fastdata.open_dataset` (``output="tensor"``, ``decode=...``).

    Returns:
        dict: the new manifest.

    Raises:
        ComputeFieldsError: ``fn`` raised (its exception chained; the message names the first
            sample it raises on alone, else the batch's samples, and the shard) or returned values
            that are not one a sample.
        AddFieldsError: values refused as :func:`fastdata.add_fields` refuses them.
    """
    from fastdata.reader.loader import loader
    from fastdata.reader.open import open_dataset

    run = FieldsRun(store, resume=resume, fields=fields, replace=replace)
    try:
        shards = run.manifest["shards"]
        ds = open_dataset(run.store, **dataset_options)
        if ds._store.manifest["checksum"] != run.manifest["checksum"]:  # (the lock is held: cannot differ)
            raise AddFieldsError(f"{run.store} changed while it was opened")
        todo = [k for k in range(len(shards)) if not run.done(k)]
        batches = [list(range(start, min(start + batch_size, s["first_index"] + s["count"])))
                   for k in todo for s in [shards[k]]
                   for start in range(s["first_index"], s["first_index"] + s["count"], batch_size)]
        options: dict[str, Any] = {} if num_workers is None else {"num_workers": num_workers}
        pending = iter([k for k in todo if shards[k]["count"] > 0])
        shard = next(pending, None)
        parts: dict[str, list] = {}
        filled = 0
        done = len(shards) - len(todo)
        for idx, batch in zip(batches, loader(ds, batch_sampler=batches, **options), strict=True):
            assert shard is not None  # (as many batches as the shards to do hold samples)
            entry = shards[shard]
            where = (f"{run.store}: samples {idx[0]}..{idx[-1]} (shard {entry['name']})")
            try:
                out = fn(batch)
            except Exception as err:
                sample = _first_failing(ds, fn, idx)
                which = f"{run.store}: sample {sample} (shard {entry['name']})" if sample is not None else where
                raise ComputeFieldsError(f"{which}: the function raised {type(err).__name__}: {err}") from err
            if not isinstance(out, Mapping) or not out:
                raise ComputeFieldsError(f"{where}: the function returned {type(out).__name__}, not a dict of "
                                         "field name -> values")
            for name, value in out.items():
                parts.setdefault(str(name), []).append(_as_rows(str(name), value, len(idx), where))
            filled += len(idx)
            if filled == entry["count"]:
                run.put(shard, {name: _joined(p) for name, p in parts.items()})
                parts, filled, done = {}, 0, done + 1
                shard = next(pending, None)
                if progress is not None:
                    progress(done, len(shards))
        for k in todo:  # shards without samples (none read)
            if not run.done(k) and shards[k]["count"] == 0:
                run.put(k, {name: [] for name in (run.plan["fields"] or {})})
        ds.close()
        return run.publish()
    finally:
        run.close()
