"""``SampleDataset``: the name under which :func:`fastdata.open_dataset` returns a general store.

A general store (what :func:`fastdata.write` and the table, Parquet, WebDataset, volume and
DICOM sources write) is read by :class:`fastdata.reader.dataset.StoreDataset`, the one dataset
class of every store: ``ds[i]`` is a dict of the stored fields. This class adds nothing to it;
it keeps the name that such datasets have always had (in ``repr`` and ``isinstance`` checks).
"""

from __future__ import annotations

from fastdata.reader.dataset import StoreDataset


class SampleDataset(StoreDataset):
    """A general fastdata store (written by :func:`fastdata.write`): ``ds[i]`` is a dict of its
    fields (see :class:`~fastdata.reader.dataset.StoreDataset`); open it with
    :func:`fastdata.open_dataset`."""
