"""Collation of samples beyond (image, class): dicts of fields and (image, target_dict) pairs.

The rule under test is the one :func:`fastdata.collate_samples` documents: equal-shape
tensors/arrays stacked, numbers turned into tensors, ragged arrays, JSON values, strings
and PIL images kept as lists, target dicts kept as a list of dicts.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

import fastdata
from fastdata.reader.batching import WORKER_SKIPS, Samples


def _sample(i: int, boxes: int) -> dict:
    return {
        "image": torch.full((3, 4, 5), i, dtype=torch.uint8),
        "depth": np.full((4, 5), i, dtype=np.float32),
        "label": i,
        "score": i + 0.5,
        "flag": bool(i % 2),
        "weight": np.float32(i / 4),
        "caption": f"sample {i}",
        "meta": {"id": i, "tags": ["a"] * i},
        "boxes": np.arange(boxes * 4, dtype=np.float32).reshape(boxes, 4) + i,
    }


def test_dict_samples_follow_the_documented_rule():
    batch = [_sample(0, 1), _sample(1, 3), _sample(2, 0)]
    out = fastdata.collate_samples(batch)
    assert list(out) == list(batch[0])  # same keys, same order
    # fixed-shape tensors and arrays: one stacked tensor
    assert out["image"].shape == (3, 3, 4, 5) and out["image"].dtype == torch.uint8
    assert out["image"][2].eq(2).all()
    assert out["depth"].shape == (3, 4, 5) and out["depth"].dtype == torch.float32
    # numbers: tensors, with default_collate's dtypes (numpy scalars keep theirs)
    assert out["label"].dtype == torch.int64 and out["label"].tolist() == [0, 1, 2]
    assert out["score"].dtype == torch.float64 and out["score"].tolist() == [0.5, 1.5, 2.5]
    assert out["flag"].dtype == torch.bool and out["flag"].tolist() == [False, True, False]
    assert out["weight"].dtype == torch.float32 and out["weight"].tolist() == [0.0, 0.25, 0.5]
    # strings and JSON values: lists of the values as given
    assert out["caption"] == ["sample 0", "sample 1", "sample 2"]
    assert out["meta"] == [s["meta"] for s in batch]
    # ragged arrays: a list of tensors, one per sample, values intact (including the empty one)
    assert isinstance(out["boxes"], list) and [tuple(b.shape) for b in out["boxes"]] == [(1, 4), (3, 4), (0, 4)]
    for got, sample in zip(out["boxes"], batch, strict=True):
        assert isinstance(got, torch.Tensor) and np.array_equal(got.numpy(), sample["boxes"])
    # control: torch's default_collate cannot collate this batch at all
    with pytest.raises(RuntimeError, match="equal size"):
        torch.utils.data.default_collate(batch)


def test_fastdata_collate_takes_dict_samples():
    batch = [_sample(0, 2), _sample(1, 5)]
    out = fastdata.collate(batch)
    assert isinstance(out, dict) and out["image"].shape == (2, 3, 4, 5)
    assert [len(b) for b in out["boxes"]] == [2, 5]


def test_ragged_names_make_lists_whatever_the_batch():
    batch = [_sample(0, 2), _sample(1, 2)]  # both have 2 boxes: the shape rule alone stacks them
    assert fastdata.collate_samples(batch)["boxes"].shape == (2, 2, 4)
    out = fastdata.collate_samples(batch, ragged={"boxes", "caption"})
    assert isinstance(out["boxes"], list) and [tuple(b.shape) for b in out["boxes"]] == [(2, 4), (2, 4)]
    assert out["caption"] == ["sample 0", "sample 1"]
    assert out["image"].shape == (2, 3, 4, 5)  # other fields keep the rule
    # as a collate_fn: a partial is picklable, so it works with spawn workers too
    fn = functools.partial(fastdata.collate_samples, ragged={"boxes"})
    assert isinstance(fn(batch)["boxes"], list)


def test_pil_images_become_a_list():
    images = [Image.new("RGB", (5 + i, 4)) for i in range(3)]
    out = fastdata.collate_samples([{"image": im, "label": i} for i, im in enumerate(images)])
    assert out["image"] == images and out["label"].tolist() == [0, 1, 2]


def test_image_and_target_dict_pairs():
    targets = [{"boxes": torch.rand(n, 4), "labels": torch.arange(n), "image_id": n} for n in (1, 3)]
    stacked = fastdata.collate([(torch.zeros(3, 8, 8), t) for t in targets])
    assert isinstance(stacked, tuple) and stacked[0].shape == (2, 3, 8, 8)
    assert stacked[1] == targets and all(a is b for a, b in zip(stacked[1], targets, strict=True))
    # images of different sizes (or PIL images): a list, as torchvision's detection references collate
    sizes = [torch.zeros(3, 8, 8), torch.zeros(3, 6, 9)]
    listed = fastdata.collate([(im, t) for im, t in zip(sizes, targets, strict=True)])
    assert isinstance(listed[0], list) and [tuple(im.shape) for im in listed[0]] == [(3, 8, 8), (3, 6, 9)]
    assert listed[1] == targets


def test_classification_pairs_collate_as_before():
    batch = [(torch.full((3, 2, 2), i, dtype=torch.uint8), i) for i in range(4)]
    images, labels = fastdata.collate(batch)
    ref_images, ref_labels = torch.utils.data.default_collate(batch)
    assert torch.equal(images, ref_images) and torch.equal(labels, ref_labels)


def test_arrays_decoded_from_records_need_no_warning():
    """Arrays viewing record bytes are read-only (and may be big-endian): converted without
    torch's non-writable warning, values intact."""
    raw = np.arange(12, dtype=np.float32).tobytes()
    readonly = np.frombuffer(raw, dtype=np.float32).reshape(3, 4)
    assert not readonly.flags.writeable
    big_endian = np.arange(8, dtype=">i8").reshape(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = fastdata.collate_samples([{"a": readonly, "b": big_endian}, {"a": readonly[:1], "b": big_endian}])
    assert np.array_equal(out["a"][0].numpy(), readonly) and np.array_equal(out["a"][1].numpy(), readonly[:1])
    assert out["b"].dtype == torch.int64 and out["b"][1].tolist() == big_endian.tolist()


def test_mismatched_samples_are_named():
    with pytest.raises(ValueError, match="sample 1 of the batch has keys"):
        fastdata.collate_samples([{"a": 1, "b": 2}, {"a": 1}])
    with pytest.raises(ValueError, match="sample 2 of the batch is not a tuple of 2"):
        fastdata.collate_samples([(1, {}), (2, {}), (3,)])
    with pytest.raises(ValueError, match="empty"):
        fastdata.collate_samples([])


class _DictDataset(Dataset):
    """Dict samples with a ragged field; ``__getitems__`` returns a :class:`Samples` list
    that says one damaged sample was replaced, as the store datasets do."""

    def __init__(self, token: str):
        self.token = token

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> dict:
        return _sample(i, i % 3)

    def __getitems__(self, indices):
        out = Samples(self[i] for i in indices)
        out.skips, out.token = 1, self.token
        return out


def test_dict_batches_cross_worker_processes_with_their_skip_count():
    token = "collate-test-token"
    loader = DataLoader(_DictDataset(token), batch_size=3, num_workers=2, multiprocessing_context="fork",
                        collate_fn=fastdata.collate)
    batches = list(loader)
    assert [b["label"].tolist() for b in batches] == [[0, 1, 2], [3, 4, 5]]
    assert [[len(x) for x in b["boxes"]] for b in batches] == [[0, 1, 2], [0, 1, 2]]
    assert batches[1]["caption"] == ["sample 3", "sample 4", "sample 5"]
    assert WORKER_SKIPS[token] == 2  # one per batch, carried back to the main process


def test_a_general_store_batches_its_ragged_fields_as_lists_even_when_lengths_agree(tmp_path):
    """The loader's batches have one type per field: a ragged field is a list in every
    batch, also in one whose samples happen to have equal lengths (control: without the
    store's ragged names the same batch is stacked)."""
    from helpers.samples import jpeg

    from fastdata.fields import Image as ImageField
    from fastdata.fields import Ragged

    samples = [{"image": jpeg(i), "boxes": np.full((2, 4), i, np.float32)} for i in range(4)]
    store = str(tmp_path / "s.lmdb")
    fastdata.write(samples, store, {"image": ImageField(), "boxes": Ragged("float32", (4,))}, workers=0)
    ds = fastdata.open_dataset(store, output="tensor")
    batch = ds.__getitems__([0, 1, 2])
    out = fastdata.collate(batch)
    assert isinstance(out["boxes"], list) and [b.shape for b in out["boxes"]] == [(2, 4)] * 3
    assert torch.equal(out["boxes"][2], torch.full((2, 4), 2.0))
    assert torch.is_tensor(fastdata.collate_samples(list(batch))["boxes"])  # control: stacked without the names
