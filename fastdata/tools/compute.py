"""``fastdata.compute_fields``: add fields computed by a function of the samples, run over the store.

The store is read through :func:`fastdata.loader` (worker processes read and decode; batches in
store order, none crossing a shard), the function runs in the calling process on each batch (on
a GPU when it puts its model and the batch there), and each shard's values are staged as its field
file as soon as the shard is done (:class:`fastdata.writer.add_fields.FieldsRun`). A crash loses
at most the shard in progress: ``resume=True`` computes only the shards not staged, then the
store is published as with :func:`fastdata.add_fields`. A store at a URL is computed the same
way, its field files staged in a local folder and uploaded when every shard is done.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
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


#: what ``on_error`` takes
ON_ERROR = ("raise", "skip")


def _per_sample(ds: Any, fn: Callable[[Any], Any], idx: list[int], names: list[str], defaults: Mapping[str, Any],
                where: str) -> tuple[dict[str, list], list[tuple[int, str]]]:
    """``fn`` over a batch's samples one at a time (a batch of one each, collated as the loader
    collates): the values of those it returns for, its fields' defaults for those it raises on.

    Returns:
        ``({name: one value a sample}, [(sample, why) skipped])``.
    """
    from fastdata.reader.batching import collate

    got: list[Mapping[str, Any] | None] = []
    skipped: list[tuple[int, str]] = []
    for i in idx:
        try:
            out = fn(collate(ds.__getitems__([i])))
        except Exception as err:  # noqa: BLE001 - any exception of the user's function skips the sample
            got.append(None)
            skipped.append((i, f"{type(err).__name__}: {err}"[:300]))
            continue
        if not isinstance(out, Mapping) or not out:
            raise ComputeFieldsError(f"{where}: the function returned {type(out).__name__} for sample {i}, not a dict "
                                     "of field name -> values")
        got.append({str(n): _as_rows(str(n), v, 1, f"{where} sample {i}")[0] for n, v in out.items()})
    names = names or next((list(o) for o in got if o is not None), list(defaults))
    missing = [n for n in names if n not in defaults]
    if skipped and missing:
        raise ComputeFieldsError(f"{where}: on_error='skip' skipped sample {skipped[0][0]} ({skipped[0][1]}) but "
                                 f"field(s) {', '.join(missing)} have no default to give it: pass defaults="
                                 f"{{{missing[0]!r}: value}}")
    values = {n: [o[n] if o is not None else defaults[n] for o in got] for n in names}
    for i, o in zip(idx, got, strict=True):
        if o is not None and sorted(o) != sorted(names):
            raise ComputeFieldsError(f"{where}: the function returned fields {', '.join(sorted(o))} for sample {i}, "
                                     f"{', '.join(sorted(names))} for others")
    return values, skipped


def _shard_values(ds: Any, fn: Callable[[Any], Any], shards: list[dict], todo: list[int], batch_size: int,
                  loader_options: dict, on_error: str, defaults: Mapping[str, Any], store: str,
                  names: list[str]) -> Iterator[tuple[int, dict[str, Any], list[tuple[int, str]]]]:
    """``(shard, {name: its values}, skipped samples)`` for each shard of ``todo`` with samples, in order:
    ``fn`` over the loader's batches of the shard (store order, never crossing a shard)."""
    from fastdata.reader.loader import loader

    batches = [list(range(start, min(start + batch_size, s["first_index"] + s["count"])))
               for k in todo for s in [shards[k]]
               for start in range(s["first_index"], s["first_index"] + s["count"], batch_size)]
    pending = iter([k for k in todo if shards[k]["count"] > 0])
    shard = next(pending, None)
    parts: dict[str, list] = {}
    skipped: list[tuple[int, str]] = []
    filled = 0
    for idx, batch in zip(batches, loader(ds, batch_sampler=batches, **loader_options), strict=True):
        assert shard is not None  # (as many batches as the shards to do hold samples)
        entry = shards[shard]
        where = f"{store}: samples {idx[0]}..{idx[-1]} (shard {entry['name']})"
        try:
            out = fn(batch)
        except Exception as err:
            if on_error != "skip":
                sample = _first_failing(ds, fn, idx)
                which = f"{store}: sample {sample} (shard {entry['name']})" if sample is not None else where
                raise ComputeFieldsError(f"{which}: the function raised {type(err).__name__}: {err}") from err
            out, lost = _per_sample(ds, fn, idx, names or list(parts), defaults, where)
            skipped += lost
        if not isinstance(out, Mapping) or not out:
            raise ComputeFieldsError(f"{where}: the function returned {type(out).__name__}, not a dict of "
                                     "field name -> values")
        for name, value in out.items():
            parts.setdefault(str(name), []).append(_as_rows(str(name), value, len(idx), where))
        names = names or list(parts)
        filled += len(idx)
        if filled == entry["count"]:
            yield shard, {name: _joined(p) for name, p in parts.items()}, skipped
            parts, skipped, filled = {}, [], 0
            shard = next(pending, None)


def compute_fields(store: str | os.PathLike, fn: Callable[[Any], Mapping[str, Any]], *, batch_size: int = 64,
                   num_workers: int | None = None, resume: bool = False, replace: bool = False,
                   fields: Mapping[str, Field] | None = None, progress: Callable[[int, int], None] | None = None,
                   on_error: str = "raise", defaults: Mapping[str, Any] | None = None,
                   storage_options: Mapping[str, Any] | None = None, staging_dir: str | os.PathLike | None = None,
                   **dataset_options: Any) -> dict:
    """Add fields computed by ``fn`` over every sample of a store, as a new version.

    Args:
        store: the store directory, or its URL (``s3://...``: the version opened is read through
            the dataset's cache, each shard's field file staged locally (``staging_dir``) as it is
            done, and all of them uploaded and checked, then the manifest, under the store's lock
            object, refused if a new version was published meanwhile).
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
        on_error: ``"raise"`` (default): a sample ``fn`` raises on stops the run, naming it, and
            nothing is published. ``"skip"``: a batch ``fn`` raises on is run again one sample at a
            time; the samples it raises on get their fields' ``defaults`` and are reported: the
            new version's history entry (``manifest["options"]["field_history"][-1]``) lists them
            (``skipped``: ``[index, "Error: message"]``, the first 1000; ``skipped_count``), and a
            :class:`ComputeFieldsWarning` names the count and the first ones.
        defaults: ``{name: value}``: each field's default (recorded as ``add_fields(defaults=)``
            records it: appends use it too); with ``on_error="skip"``, the value of a skipped sample
            (required for every field then).
        storage_options: fsspec options of a store at a URL.
        staging_dir: a store at a URL: the local folder its run stages the field files in
            (default: one per URL in the cache directory, ``FASTDATA_CACHE_DIR``); ``resume``
            looks there.
        dataset_options: for :func:`fastdata.open_dataset` (``output="tensor"``, ``decode=...``).

    Returns:
        dict: the new manifest.

    Raises:
        ComputeFieldsError: ``fn`` raised (its exception chained; the message names the first
            sample it raises on alone, else the batch's samples, and the shard) or returned values
            that are not one a sample; with ``on_error="skip"``, a skipped sample's field without a
            default.
        AddFieldsError: values refused as :func:`fastdata.add_fields` refuses them; ``resume``
            with nothing to resume or of a store changed since; a store at a URL changed while its
            values were computed.
    """
    from fastdata.common.paths import remote_scheme
    from fastdata.reader.open import open_dataset

    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {', '.join(map(repr, ON_ERROR))}, got {on_error!r}")
    defaults = dict(defaults or {})
    options: dict[str, Any] = {} if num_workers is None else {"num_workers": num_workers}
    store = os.fspath(store)
    if remote_scheme(store) is not None:
        from fastdata.writer.remote_sink import local_staging_dir

        ds: Any = open_dataset(store, storage_options=storage_options, **dataset_options) if storage_options else \
            open_dataset(store, **dataset_options)
        staging = local_staging_dir(store, staging_dir, None) + ".fields"
        try:
            run = FieldsRun(store, resume=resume, fields=fields, replace=replace, defaults=defaults, staging=staging,
                            storage_options=storage_options)
        except BaseException:
            ds.close()
            raise
    else:
        if storage_options:
            raise ValueError("storage_options apply to a store at a URL only")
        if staging_dir is not None:
            raise ValueError("staging_dir applies to a store at a URL only (a local store stages in itself)")
        run = FieldsRun(store, resume=resume, fields=fields, replace=replace, defaults=defaults)
        ds = None
    try:
        shards = run.manifest["shards"]
        if ds is None:
            ds = open_dataset(run.store, **dataset_options)
        if ds._store.manifest["checksum"] != run.manifest["checksum"]:  # (a local store's lock is held: cannot
            # differ; a URL's version may have changed between the two reads)
            raise AddFieldsError(f"{run.store} changed while it was opened; run it again")
        todo = [k for k in range(len(shards)) if not run.done(k)]
        done = len(shards) - len(todo)
        for shard, values, lost in _shard_values(ds, fn, shards, todo, batch_size, options, on_error, defaults,
                                                 run.store, list(run.plan["fields"] or {})):
            run.put(shard, values, lost)
            done += 1
            if progress is not None:
                progress(done, len(shards))
        for k in todo:  # shards without samples (none read)
            if not run.done(k) and shards[k]["count"] == 0:
                run.put(k, {name: [] for name in (run.plan["fields"] or {})})
        ds.close()
        ds = None
        manifest = run.publish()
        _warn_skipped(run.store, manifest)
        return manifest
    finally:
        if ds is not None:
            ds.close()
        run.close()


class ComputeFieldsWarning(UserWarning):
    """``compute_fields(on_error="skip")`` skipped samples (named; the version's history lists them)."""


def _warn_skipped(store: str, manifest: dict) -> None:
    import warnings

    entry = (manifest["options"].get("field_history") or [{}])[-1]
    if entry.get("skipped_count"):
        first = "; ".join(f"sample {i}: {why}" for i, why in entry["skipped"][:3])
        warnings.warn(f"{store}: compute_fields skipped {entry['skipped_count']} sample(s) the function raised on "
                      f"(given the fields' defaults): {first}{'; ...' if entry['skipped_count'] > 3 else ''} (all "
                      "listed in manifest['options']['field_history'][-1]['skipped'])", ComputeFieldsWarning,
                      stacklevel=3)
