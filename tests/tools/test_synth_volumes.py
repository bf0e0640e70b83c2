"""Tests for fastdata.tools.synth_volumes: the volumes are a pure function of (shape, seed), look
like CT where it matters to codecs and samplers (zero padding, air, body, noise of the advertised
size), and the labels mark voxels whose intensities really are the organs'."""

from __future__ import annotations

import numpy as np
import pytest

from fastdata.tools.synth_volumes import (
    CT_MAX,
    LABEL_NAMES,
    LESION_LABEL,
    ct_pair,
    ct_volume,
    label_volume,
    phantom,
)

SMALL = (48, 64, 64)
LESION_SHAPE = (64, 128, 128)  # lesions a few voxels across inside kidneys that are more than that


def _dilate(mask: np.ndarray, steps: int) -> np.ndarray:
    # 6-neighbour binary dilation by array shifts (no scipy in the core dependencies)
    out = mask.copy()
    for _ in range(steps):
        grown = out.copy()
        for axis in range(3):
            for shift in (1, -1):
                grown |= np.roll(out, shift, axis=axis)
        out = grown
    return out


def test_same_seed_same_bytes_other_seed_other_bytes():
    volume, label = ct_pair(SMALL, seed=3)
    assert volume.tobytes() == ct_volume(SMALL, seed=3).tobytes()
    assert label.tobytes() == label_volume(SMALL, seed=3).tobytes()
    assert volume.tobytes() != ct_volume(SMALL, seed=4).tobytes()
    assert label.tobytes() != label_volume(SMALL, seed=4).tobytes()
    # the labels are geometry only: the noise level does not move them
    assert label.tobytes() == ct_pair(SMALL, seed=3, noise_sigma=0.0)[1].tobytes()


def test_dtype_shape_and_ct_value_ranges():
    volume = ct_volume(SMALL, seed=0)
    assert volume.dtype == np.uint16 and volume.shape == SMALL
    assert 0 <= volume.min() and volume.max() <= CT_MAX
    assert volume[:, 0, 0].max() == 0  # outside the circular field of view: the scanner's padding
    assert 0 < np.median(volume[:, 3, 32]) < 80  # air in front of the body (HU -1000 -> 24)
    assert 950 < np.median(volume[24, 28:36, 28:36]) < 1250  # soft tissue / organs in the middle
    assert volume.max() > 1700  # cortical bone
    hu = ct_volume(SMALL, seed=0, dtype="int16")
    assert hu.dtype == np.int16 and np.array_equal(hu.astype(np.int32), volume.astype(np.int32) - 1024)
    exact = ct_volume(SMALL, seed=0, dtype="float32")
    assert exact.dtype == np.float32 and np.array_equal(np.clip(np.rint(exact), 0, CT_MAX).astype(np.uint16), volume)
    label = label_volume(SMALL, seed=0)
    assert label.dtype == np.uint8 and label.shape == SMALL and label.max() <= LESION_LABEL


def test_noise_is_the_requested_size():
    air = (slice(None), slice(2, 6), slice(28, 36))  # in front of the body, inside the field of view
    assert ct_volume(SMALL, seed=1, noise_sigma=0.0)[air].std() < 1.0
    assert 4.0 < ct_volume(SMALL, seed=1, noise_sigma=5.0)[air].std() < 6.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_labelled_organs_have_their_own_intensity(seed):
    volume, label = ct_pair((64, 96, 96), seed=seed)
    volume = volume.astype(np.float32)
    intensity = {s.label: s.intensity for s in phantom((64, 96, 96), seed) if 0 < s.label < LESION_LABEL}
    for k in range(1, LESION_LABEL):
        inside = label == k
        assert inside.sum() > 50, f"{LABEL_NAMES[k]} missing"
        # the bias field moves values by a few percent at most
        assert abs(np.median(volume[inside]) - intensity[k]) < 0.04 * intensity[k], LABEL_NAMES[k]
        # and the organ stands out from what surrounds it (lungs darker, the others brighter)
        ring = _dilate(inside, 3) & ~_dilate(inside, 1) & (label == 0)
        assert abs(np.median(volume[inside]) - np.median(volume[ring])) > 30, LABEL_NAMES[k]


@pytest.mark.parametrize("seed", range(5))
def test_lesions_exist_are_rare_and_differ_from_their_organ(seed):
    volume, label = ct_pair(LESION_SHAPE, seed=seed)
    volume = volume.astype(np.float32)
    assert 0 < (label == LESION_LABEL).mean() < 0.05
    for lesion in (s for s in phantom(LESION_SHAPE, seed) if s.label == LESION_LABEL):
        # this lesion's voxels: the lesion label within its own bounding box
        box = tuple(slice(max(0, int(c - a - 1)), int(c + a + 2))
                    for c, a in zip(lesion.centre, lesion.semi_axes, strict=True))
        mine = np.zeros(LESION_SHAPE, bool)
        mine[box] = label[box] == LESION_LABEL
        assert mine.any()
        ring = _dilate(mine, 2) & ~_dilate(mine, 1)
        organs = label[ring & (label > 0) & (label < LESION_LABEL)]
        if organs.size < 10:  # a lesion on its organ's edge may have little organ around it
            continue
        around = ring & (label == np.bincount(organs).argmax())  # the host organ only, not a neighbour
        if around.sum() >= 10:
            # >= 35 units of contrast, less what the soft edge blurs away on a lesion 3 voxels across
            assert abs(np.median(volume[mine]) - np.median(volume[around])) > 15


def test_anisotropic_shapes_are_the_same_anatomy_resampled():
    coarse, fine = label_volume((32, 96, 80), seed=5), label_volume((64, 96, 80), seed=5)
    assert coarse.shape == (32, 96, 80) and ct_volume((32, 96, 80), seed=5).shape == (32, 96, 80)
    # positions and sizes are fractions of each axis: each organ fills the same share of the volume,
    # up to sampling (a kidney is about 5 slices thick in 32)
    for k in range(1, LESION_LABEL):
        share_coarse, share_fine = (coarse == k).mean(), (fine == k).mean()
        assert share_coarse > 0 and abs(share_coarse - share_fine) < 0.25 * share_fine, LABEL_NAMES[k]


@pytest.mark.parametrize("kwargs", [{"shape": (64, 64)}, {"shape": (4, 64, 64)}, {"dtype": "uint8"},
                                    {"noise_sigma": -1.0}])
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        ct_volume(**{"shape": SMALL, **kwargs})
