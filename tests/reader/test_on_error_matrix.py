"""``on_error`` on every read path: damaged records at a batch's first position and in
its middle, for each output, decode transform, backend and worker count.

``on_error="raise"`` raises :class:`CorruptRecordError` naming the record;
``on_error="skip"`` replaces a damaged sample by the next readable one, in the form the
batch expects (the same shape and layout as the original would have had), with that
sample's own label, and counts it in ``dataset.skipped`` in the main process, also when
the skip happened in a DataLoader worker.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from helpers.backends import NAME_SUFFIXES
from helpers.images import make_tree
from test_dataset import _flip_payload_byte

import fastdata
from fastdata import transforms
from fastdata.errors import CorruptRecordError

BACKENDS = dict(NAME_SUFFIXES)
FIRST, MIDDLE = 4, 9  # damaged samples
BATCHES = [[FIRST, 0, 1, 2], [5, MIDDLE, 6, 7]]  # one at a batch's first position, one in the middle
#: what skipping reads instead: the next readable sample
SOURCES = [[FIRST + 1, 0, 1, 2], [5, MIDDLE + 1, 6, 7]]
DECODES = {
    "full": lambda: None,
    "rrc": lambda: transforms.RandomResizedCrop(16),
    "center": lambda: transforms.CenterCrop(16, resize=20),
}


@pytest.fixture(scope="module")
def damaged_stores(tmp_path_factory) -> dict:
    """One tiny store per backend (12 images of one size) with samples FIRST and MIDDLE damaged."""
    root = tmp_path_factory.mktemp("on_error")
    src = make_tree(root / "src", {"a": 6, "b": 6}, size=(32, 24), seed=11)
    stores = {}
    for backend, ext in BACKENDS.items():
        store = str(root / f"s{ext}")
        fastdata.convert(src, store, workers=1, progress=False)
        ds = fastdata.open_dataset(store)
        for victim in (FIRST, MIDDLE):
            with open(f"{src}/{ds.relpath(victim)}", "rb") as f:
                _flip_payload_byte(store, f.read())
        stores[backend] = store
    return stores


def open_ds(store: str, output: str, decode: str, on_error: str):
    # PIL images do not collate: turn them into arrays with a (user) transform, which
    # also sends the batch through the per-sample list path rather than the batch array
    transform = np.array if output == "pil" else None
    return fastdata.open_dataset(store, output=output, decode=DECODES[decode](), on_error=on_error,
                                 transform=transform, seed=1234)


def as_hwc(image, output: str) -> np.ndarray:
    """One image of a batch (or from ``ds[i]``) as an HWC numpy array."""
    image = image.numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    return image.transpose(1, 2, 0) if output == "tensor" else image


def read_all(ds, workers: int) -> list:
    dl = fastdata.loader(ds, batch_sampler=BATCHES, num_workers=workers, persistent_workers=False)
    batches, it = [], iter(dl)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            batches.extend(it)
    except CorruptRecordError as err:
        # Drop the traceback: its frames hold the iterator, whose workers would otherwise
        # be shut down whenever the garbage collector gets to it (seconds, mid-way through
        # another test); this way they stop here, while they still listen.
        error = err.with_traceback(None)
    else:
        return batches
    del it
    raise error


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
@pytest.mark.parametrize("decode", sorted(DECODES))
@pytest.mark.parametrize("output", ["pil", "numpy", "tensor"])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_damaged_record_first_and_middle_of_a_batch(damaged_stores, backend, output, decode, on_error, workers):
    store = damaged_stores[backend]
    ds = open_ds(store, output, decode, on_error)
    if on_error == "raise":
        with pytest.raises(CorruptRecordError) as info:
            read_all(ds, workers)
        assert f"sample {FIRST}" in str(info.value)  # the first batch's first sample is named
        with pytest.raises(CorruptRecordError) as info:
            ds.__getitems__(BATCHES[1])
        assert info.value.index == MIDDLE
        for victim in (FIRST, MIDDLE):
            with pytest.raises(CorruptRecordError):
                ds[victim]
        return

    batches = read_all(ds, workers)
    # every skip reaches the main process's count, also from worker processes
    assert ds.skipped == 2
    reference = open_ds(store, output, decode, "raise")  # per-sample reads of the readable samples
    reference.set_epoch(0)  # the loader's first iteration is epoch 0
    assert len(batches) == len(SOURCES)
    for (images, labels), sources in zip(batches, SOURCES, strict=False):
        assert labels.tolist() == [int(reference.targets[k]) for k in sources]
        assert len(images) == len(sources)
        for image, k in zip(images, sources, strict=False):
            np.testing.assert_array_equal(as_hwc(image, output), as_hwc(reference[k][0], output))
    if workers:
        return
    # the per-sample path substitutes in the same way
    for victim in (FIRST, MIDDLE):
        with pytest.warns(RuntimeWarning, match=f"skipping damaged sample {victim}"):
            image, label = ds[victim]
        np.testing.assert_array_equal(as_hwc(image, output), as_hwc(reference[victim + 1][0], output))
        assert label == int(reference.targets[victim + 1])
    assert ds.skipped == 4


def test_skip_count_reaches_the_main_process_from_persistent_spawned_workers(damaged_stores):
    ds = open_ds(damaged_stores["lmdb"], "tensor", "rrc", "skip")
    dl = fastdata.loader(ds, batch_sampler=BATCHES, num_workers=2, multiprocessing_context="spawn",
                         persistent_workers=True)
    assert dl.persistent_workers
    for epoch in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            assert len(list(dl)) == 2
        assert ds.skipped == 2 * (epoch + 1)  # the same worker processes, counted per batch received
    # without fastdata.collate a worker's count has no way back: it stays where it was made
    plain = open_ds(damaged_stores["lmdb"], "tensor", "rrc", "skip")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        list(fastdata.loader(plain, batch_sampler=BATCHES, num_workers=2, persistent_workers=False,
                             collate_fn=lambda batch: len(batch)))
    assert plain.skipped == 0


@pytest.mark.parametrize("output", ["pil", "tensor"])
def test_collate_lists_gives_image_lists_or_stacks_and_carries_skips_from_workers(damaged_stores, output):
    """fastdata.collate_lists (what `tune` prints for batches that cannot be stacked): PIL images
    stay a list, same-shape tensors are stacked, and worker skips still reach dataset.skipped."""
    ds = fastdata.open_dataset(damaged_stores["lmdb"], output=output, on_error="skip")
    dl = fastdata.loader(ds, batch_sampler=BATCHES, num_workers=2, persistent_workers=False,
                         collate_fn=fastdata.collate_lists)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        batches = list(dl)
    assert ds.skipped == 2
    images, labels = batches[0]
    assert labels.dtype == torch.int64 and len(labels) == len(SOURCES[0])
    if output == "pil":
        assert isinstance(images, list) and len(images) == len(SOURCES[0])
    else:
        assert isinstance(images, torch.Tensor) and images.shape[0] == len(SOURCES[0])
