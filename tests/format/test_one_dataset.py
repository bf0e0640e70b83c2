"""One dataset class reads every store kind, through one record model.

Every fixture store of tests/fixtures/legacy/ (each layout and version fastdata has written:
classification, list, raw, reencode, native and mixed pixels, merged, appended, general,
chunked, COCO, DICOM tags) opens with :class:`fastdata.reader.dataset.StoreDataset` itself,
whose items are dicts of the store's fields, and the class :func:`fastdata.open_dataset` picks
for it is a presentation of those same dicts: an image-classification store's ``(image, target)``
are its dict's ``image`` and ``label``. The read path (storage reads, record model, sample build,
decoding) is defined in StoreDataset alone; the presentations add what ``ds[i]`` is.
"""

from __future__ import annotations

import os
import tarfile
import warnings

import numpy as np
import pytest

import fastdata
from fastdata.format.legacy import ClassificationRecords, GeneralRecords
from fastdata.reader.coco import CocoStoreDataset
from fastdata.reader.dataset import ImageFolderDataset, StoreDataset
from fastdata.reader.samples import SampleDataset

LEGACY = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "fixtures", "legacy")
NAMES = sorted(n for n in os.listdir(LEGACY) if os.path.isfile(os.path.join(LEGACY, n, "expected.json")))
#: read in CI: the current layouts (``head-*``) and one of each older record layout; nightly: every fixture
#: (tests/format/test_legacy_stores.py reads every one in CI, through the class open_dataset picks)
IN_CI = ("g0-lmdb-original", "g0-hdf5-raw", "g0b-hdf5-original", "g1-lmdb-general", "g1-lmdb-coco",
         "g3a-lmdb-chunked", "g4-lmdb-merged", "g4t-lmdb-original", "g5-lmdb-coco")
#: the methods that read: storage, record model, sample build, decoding
READ_PATH = ("_load_index", "_field_plan", "_raw_bytes", "_read_each", "_read_batch", "_build", "_run_decoder",
             "__getitem__")


def _unpack(name: str, dst) -> str:
    with tarfile.open(os.path.join(LEGACY, name, "store.tar.gz")) as tar:
        tar.extractall(dst, filter="data")
    (store,) = [os.path.join(dst, n) for n in os.listdir(dst) if n.startswith("store.")]
    return store


def _pixels(image) -> np.ndarray:
    return np.asarray(image)


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("one-dataset")
    return {name: _unpack(name, base / name) for name in NAMES}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n.startswith("head-") or n in IN_CI
                                                else pytest.mark.slow) for n in NAMES])
def test_every_store_kind_reads_with_the_one_class(stores, name):
    store = stores[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. ImagesReducedWarning
        opened = fastdata.open_dataset(store, output="numpy")
        one = StoreDataset(store, output="numpy")
    assert isinstance(opened, StoreDataset) and type(one) is StoreDataset
    assert len(one) == len(opened) and len(one) > 0
    model = ClassificationRecords if isinstance(opened, ImageFolderDataset) else GeneralRecords
    assert type(one._records) is model
    for i in range(len(one)):
        try:
            sample = one[i]
        except fastdata.FastdataError as err:  # a fixture's deliberately unreadable sample: both refuse it
            with pytest.raises(type(err)):
                opened[i]
            continue
        assert isinstance(sample, dict) and list(sample) == [n for n, _ in one.schema]
        if isinstance(opened, ImageFolderDataset):  # ImageFolder's pair is the dict's image and label
            image, target = opened[i]
            assert target == sample["label"] == int(one.targets[i])
            np.testing.assert_array_equal(_pixels(image), _pixels(sample["image"]))
        elif type(opened) is SampleDataset:
            got = opened[i]
            assert list(got) == list(sample)


def test_the_read_path_is_defined_once():
    """Only StoreDataset defines the read path; the presentations extend _load_index (calling it)
    and say what ds[i] is (_finish_sample), nothing else that reads."""
    for cls in (ImageFolderDataset, fastdata.LMDBImageDataset, fastdata.HDF5ImageDataset, SampleDataset,
                CocoStoreDataset):
        assert issubclass(cls, StoreDataset)
        own = set(vars(cls)) & set(READ_PATH)
        assert own <= {"_load_index"}, (cls.__name__, own)
    assert all(name in vars(StoreDataset) for name in READ_PATH)


def test_control_a_classification_store_read_as_general_store_is_image_and_label(stores):
    """The control of the parity above: the dict is not the pair (a test comparing the wrong
    things would pass on both)."""
    store = stores["head-lmdb-original"]
    one, pair = StoreDataset(store, output="numpy"), fastdata.open_dataset(store, output="numpy")
    assert one.schema.image_fields() == ("image",) and "label" in one.schema
    assert not isinstance(one[0], tuple) and isinstance(pair[0], tuple)
    assert one.columns() != pair.columns() and set(pair.columns()) <= set(one.columns())
