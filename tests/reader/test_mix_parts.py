"""``fastdata.MixPart``: a mix given one object per source draws exactly what the dict form
draws (same counts, order and samples), a path opens its store named after its file, and what
cannot be mixed is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.images import make_jpeg

import fastdata
from fastdata import MixPart


class Plain(torch.utils.data.Dataset):
    """Sample i is (i, -i)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return int(i), -int(i)


def same_mix(a, b) -> None:
    assert a.source_names == b.source_names and a.counts == b.counts and a.epoch_size == b.epoch_size
    for epoch in (0, 1):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        assert [a[i] for i in range(len(a))] == [b[i] for i in range(len(b))]


@pytest.mark.parametrize("sizing", [
    {"weight": {"a": 0.7, "b": 0.3}},
    {"repeat": {"a": 0.5, "b": 2}},
    {"samples": {"a": 5, "b": 9}},
    {},
])
def test_parts_mix_exactly_as_the_dicts_do(sizing):
    a, b = Plain(20), Plain(7)
    kind, sizes = next(iter(sizing.items()), (None, {}))
    double = (lambda s: s[0] * 2) if kind != "weight" else None
    parts = [MixPart(a, name="a", transform=double, **({kind: sizes["a"]} if kind else {})),
             MixPart(b, name="b", **({kind: sizes["b"]} if kind else {}))]
    dicts = {"weights" if kind == "weight" else kind: sizes} if kind else {}
    transforms = {"a": double} if double else None
    epoch = {"epoch_size": 18} if kind in ("weight", None) else {}
    same_mix(fastdata.mix(parts, seed=3, **epoch),
             fastdata.mix({"a": a, "b": b}, seed=3, transforms=transforms, **dicts, **epoch))


def test_the_comparison_tells_mixes_apart():
    """Control for the test above: other weights are another mix."""
    with pytest.raises(AssertionError):
        same_mix(fastdata.mix([MixPart(Plain(20), name="a", weight=1), MixPart(Plain(7), name="b", weight=1)],
                              epoch_size=18),
                 fastdata.mix([MixPart(Plain(20), name="a", weight=3), MixPart(Plain(7), name="b", weight=1)],
                              epoch_size=18))


def test_a_path_part_opens_its_store_named_after_the_file(tmp_path):
    for i in range(4):
        make_jpeg(tmp_path / "src" / f"c{i % 2}" / f"{i}.jpg", size=(20, 16), seed=i)
    fastdata.convert(tmp_path / "src", tmp_path / "real.lmdb", workers=0, progress=False)
    part = MixPart(tmp_path / "real.lmdb", repeat=2)
    assert part.name == "real" and len(part.dataset) == 4
    m = fastdata.mix([part, MixPart(Plain(3), name="plain", repeat=1)])
    assert m.counts == {"real": 8, "plain": 3}
    assert "real" in repr(part) and "repeat=2" in repr(part)


@pytest.mark.parametrize("make, error, match", [
    (lambda: MixPart(Plain(3)), ValueError, "name is needed"),
    (lambda: MixPart(Plain(3), name=""), ValueError, "name must be"),
    (lambda: MixPart(3, name="x"), TypeError, "dataset must be"),
    (lambda: MixPart(Plain(3), name="x", weight=1, repeat=2), ValueError, "one of weight, repeat or samples"),
    (lambda: MixPart(Plain(3), name="x", weight=-1), ValueError, "weight must be >= 0"),
    (lambda: MixPart(Plain(3), name="x", repeat=0), ValueError, "repeat must be > 0"),
    (lambda: MixPart(Plain(3), name="x", samples=1.5), ValueError, "samples must be an int"),
    (lambda: MixPart(Plain(3), name="x", transform=3), TypeError, "transform must be callable"),
    (lambda: fastdata.mix([MixPart(Plain(3), name="x"), MixPart(Plain(3), name="x")]), ValueError,
     "two parts are named 'x'"),
    (lambda: fastdata.mix([MixPart(Plain(3), name="x", weight=1), MixPart(Plain(3), name="y", repeat=1)]),
     ValueError, "sized the same way"),
    (lambda: fastdata.mix([MixPart(Plain(3), name="x")], weights={"x": 1}), ValueError, "on each part"),
    (lambda: fastdata.mix([Plain(3)]), TypeError, "MixPart"),
    (lambda: fastdata.mix([]), ValueError, "non-empty"),
])
def test_what_cannot_be_mixed_is_refused_by_name(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_the_dict_form_still_works():
    m = fastdata.mix({"a": Plain(4), "b": Plain(2)}, samples={"a": 2, "b": 2})
    assert m.counts == {"a": 2, "b": 2} and sorted(np.asarray(m.order()[0]).tolist()) == [0, 0, 1, 1]
