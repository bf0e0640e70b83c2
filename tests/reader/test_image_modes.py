"""``image_mode=``: images read as stored (dtype and channels kept) or through Pillow's modes.

The stores are small and built once per module: a class folder of 16-bit grayscale PNGs
(what a CT or microscopy export looks like) in both backends, and a general store with an
RGB ``image`` and a palette-PNG ``mask`` (a segmentation target whose pixels are class indices).
"""

from __future__ import annotations

import io
import os
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

import fastdata
from fastdata.errors import CorruptRecordError, ImageModeError
from fastdata.format.fields import Image as ImageField
from fastdata.format.fields import Int
from fastdata.reader.dataset import ImagesReducedWarning

H, W = 24, 20


def _png(array: np.ndarray, **save) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG", **save)
    return buf.getvalue()


@pytest.fixture(scope="module")
def deep_tree(tmp_path_factory) -> tuple[str, dict[str, np.ndarray]]:
    """Two classes of 16-bit grayscale PNGs spanning the full 0-65535 range."""
    root = tmp_path_factory.mktemp("deep")
    rng = np.random.default_rng(7)
    arrays = {}
    for cls in ("ct", "mr"):
        os.makedirs(root / "src" / cls)
        for i in range(5):
            array = rng.integers(0, 65536, (H, W), dtype=np.uint16)
            array[0, 0], array[0, 1] = 0, 65535
            rel = f"{cls}/{i}.png"
            Image.fromarray(array).save(root / "src" / rel)
            arrays[rel] = array
    return str(root), arrays


@pytest.fixture(scope="module", params=["lmdb", "hdf5"])
def deep_store(request, deep_tree) -> tuple[str, dict[str, np.ndarray]]:
    root, arrays = deep_tree
    dst = os.path.join(root, f"deep.{request.param}")
    if not os.path.exists(dst):
        fastdata.convert(os.path.join(root, "src"), dst, workers=0)
    return dst, arrays


def _open(store: str, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ImagesReducedWarning)
        return fastdata.open_dataset(store, **kwargs)


def test_unchanged_numpy_is_the_stored_array_bit_for_bit(deep_store):
    store, arrays = deep_store
    ds = _open(store, image_mode="unchanged", output="numpy")
    assert ds.image_mode == "unchanged"
    for i in range(len(ds)):
        image, _ = ds[i]
        expected = arrays[ds.relpath(i)]
        assert image.dtype == np.uint16 and image.shape == (H, W)
        np.testing.assert_array_equal(image, expected)


def test_unchanged_tensor_is_one_channel_chw_of_the_stored_dtype(deep_store):
    store, arrays = deep_store
    ds = _open(store, image_mode="unchanged", output="tensor")
    image, _ = ds[3]
    assert image.dtype == torch.uint16 and tuple(image.shape) == (1, H, W)
    np.testing.assert_array_equal(image[0].numpy(), arrays[ds.relpath(3)])


@pytest.mark.parametrize("workers", [0, 2])
def test_unchanged_batches_through_the_loader_keep_dtype_and_values(deep_store, workers):
    store, arrays = deep_store
    ds = _open(store, image_mode="unchanged", output="tensor")
    seen = 0
    for images, labels in fastdata.loader(ds, batch_size=4, num_workers=workers, shuffle=False):
        assert images.dtype == torch.uint16 and tuple(images.shape[1:]) == (1, H, W)
        for k in range(len(labels)):
            np.testing.assert_array_equal(images[k, 0].numpy(), arrays[ds.relpath(seen + k)])
        seen += len(labels)
    assert seen == len(ds)


def test_unchanged_numpy_batches_are_n_h_w_for_one_channel(deep_store):
    store, arrays = deep_store
    ds = _open(store, image_mode="unchanged", output="numpy")
    batch = ds.__getitems__([0, 1, 2])
    assert batch.images.shape == (3, H, W) and batch.images.dtype == np.uint16
    np.testing.assert_array_equal(batch.images[2], arrays[ds.relpath(2)])


def test_unchanged_pil_is_a_16_bit_mode(deep_store):
    store, arrays = deep_store
    image, _ = _open(store, image_mode="unchanged")[0]
    assert image.mode.startswith("I;16")
    np.testing.assert_array_equal(np.asarray(image).astype(np.uint16), arrays[_open(store).relpath(0)])


def test_default_rgb_mode_is_pillows_reduction_and_warns_once(deep_store):
    """The default keeps ImageFolder's answer (Pillow's convert("RGB") of a 16-bit PNG), but says so."""
    store, arrays = deep_store
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = fastdata.open_dataset(store, output="numpy")
    reduced = [w for w in caught if issubclass(w.category, ImagesReducedWarning)]
    assert len(reduced) == 1
    message = str(reduced[0].message)
    assert "uint16" in message and "image_mode='unchanged'" in message and "10 of 10" in message
    image, _ = ds[0]
    reference = np.array(Image.open(os.path.join(os.path.dirname(store), "src", ds.relpath(0))).convert("RGB"))
    assert image.dtype == np.uint8 and image.shape == (H, W, 3)
    np.testing.assert_array_equal(image, reference)


def test_eight_bit_rgb_stores_do_not_warn(tmp_path, small_tree):
    """Control for the warning above: a store of ordinary 8-bit RGB images opens silently."""
    dst = str(tmp_path / "rgb.lmdb")
    fastdata.convert(small_tree, dst, workers=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ImagesReducedWarning)
        ds = fastdata.open_dataset(dst)
    assert ds.image_mode == "RGB"


def test_a_mode_the_caller_chose_does_not_warn(deep_store):
    store, _ = deep_store
    with warnings.catch_warnings():
        warnings.simplefilter("error", ImagesReducedWarning)
        assert fastdata.open_dataset(store, image_mode="RGB").image_mode == "RGB"


def test_l_mode_on_rgb_images_is_pillows_convert_l(tmp_path, small_tree):
    dst = str(tmp_path / "rgb.lmdb")
    fastdata.convert(small_tree, dst, workers=0)
    ds = fastdata.open_dataset(dst, image_mode="L", output="numpy")
    image, _ = ds[0]
    source = os.path.join(small_tree, ds.relpath(0))
    np.testing.assert_array_equal(image, np.array(Image.open(source).convert("L")))
    batch = fastdata.open_dataset(dst, image_mode="RGBA", output="tensor")[0][0]
    assert tuple(batch.shape)[0] == 4


@pytest.fixture(scope="module")
def mask_store(tmp_path_factory) -> tuple[str, list[np.ndarray], list[np.ndarray]]:
    """A general store: an RGB photo and a palette-PNG mask of class indices 0-4 per sample."""
    rng = np.random.default_rng(3)
    palette = [0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255, 255, 255, 0] + [0] * (768 - 15)
    photos, masks, samples = [], [], []
    for i in range(6):
        photo = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
        mask = rng.integers(0, 5, (H, W), dtype=np.uint8)
        pimage = Image.fromarray(mask, mode="P")
        pimage.putpalette(palette)
        buf = io.BytesIO()
        pimage.save(buf, format="PNG")
        photos.append(photo)
        masks.append(mask)
        samples.append({"image": _png(photo), "mask": buf.getvalue(), "label": i % 2})
    dst = str(tmp_path_factory.mktemp("masks") / "masks.lmdb")
    fastdata.write(samples, dst, schema={"image": ImageField(), "mask": ImageField(), "label": Int()}, workers=0)
    return dst, photos, masks


def test_a_mask_field_reads_back_as_its_class_indices_by_default(mask_store):
    """Defaults: "RGB" for the field named image, "unchanged" for any other image field."""
    dst, photos, masks = mask_store
    ds = fastdata.open_dataset(dst, output="numpy")
    assert ds.image_modes == {"image": "RGB", "mask": "unchanged"}
    sample = ds[2]
    np.testing.assert_array_equal(sample["image"], photos[2])
    assert sample["mask"].shape == (H, W) and sample["mask"].dtype == np.uint8
    np.testing.assert_array_equal(sample["mask"], masks[2])
    # the control: the same field read in RGB mode is palette colours, not indices
    rgb = fastdata.open_dataset(dst, output="numpy", image_mode={"mask": "RGB"})[2]["mask"]
    assert rgb.shape == (H, W, 3) and not np.array_equal(rgb[..., 0], masks[2])


def test_a_mask_keeps_its_palette_as_a_pil_image(mask_store):
    dst, _, masks = mask_store
    mask = fastdata.open_dataset(dst)[1]["mask"]
    assert mask.mode == "P"
    np.testing.assert_array_equal(np.asarray(mask), masks[1])


@pytest.mark.parametrize("workers", [0, 2])
def test_mask_tensors_through_the_loader(mask_store, workers):
    dst, photos, masks = mask_store
    ds = fastdata.open_dataset(dst, output="tensor")
    batches = list(fastdata.loader(ds, batch_size=3, num_workers=workers, shuffle=False))
    got = torch.cat([b["mask"] for b in batches])
    assert got.dtype == torch.uint8 and tuple(got.shape) == (6, 1, H, W)
    np.testing.assert_array_equal(got[:, 0].numpy(), np.stack(masks))
    images = torch.cat([b["image"] for b in batches])
    np.testing.assert_array_equal(images.permute(0, 2, 3, 1).numpy(), np.stack(photos))


def test_the_schema_records_a_default_mode(tmp_path):
    array = np.arange(H * W, dtype=np.uint16).reshape(H, W) * 97
    dst = str(tmp_path / "s.lmdb")
    fastdata.write([{"image": _png(array), "label": 0}], dst,
                   schema={"image": ImageField(mode="unchanged"), "label": Int()}, workers=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ImagesReducedWarning)  # the store's own default reduces nothing
        ds = fastdata.open_dataset(dst, output="numpy")
    assert ds.image_mode == "unchanged"
    np.testing.assert_array_equal(ds[0]["image"], array)
    assert fastdata.open_dataset(dst, image_mode="RGB", output="numpy")[0]["image"].dtype == np.uint8


def test_bad_modes_are_refused_by_name(mask_store):
    dst, _, _ = mask_store
    with pytest.raises(ValueError, match="image_mode must be one of"):
        fastdata.open_dataset(dst, image_mode="rgb16")
    with pytest.raises(ValueError, match="'depth'.*not image fields"):
        fastdata.open_dataset(dst, image_mode={"depth": "unchanged"})
    with pytest.raises(ValueError, match=r"image_mode\['mask'\]"):
        fastdata.open_dataset(dst, image_mode={"mask": "float"})


def test_no_pil_mode_for_16_bit_rgb_says_what_to_use(tmp_path):
    """A decode transform's 16-bit RGB output has no PIL mode: a clear error, not a wrong image."""
    from fastdata.reader.decode import pil_of

    with pytest.raises(ImageModeError, match="output='numpy'"):
        pil_of(np.zeros((4, 4, 3), np.uint16))


def test_an_index_that_lies_about_the_dtype_is_damage_named_by_sample(deep_store, monkeypatch):
    """Batches are sized from the index; an image that does not match it is refused, never
    written into a slot of another size."""
    from fastdata.format.record import IMAGE_DTYPE_CODES

    store, _ = deep_store
    ds = _open(store, image_mode="unchanged", output="tensor")
    codes, channels = ds._pixel_meta["image"]
    ds._pixel_meta["image"] = (np.full_like(codes, IMAGE_DTYPE_CODES["uint8"]), channels)
    with pytest.raises(CorruptRecordError, match=r"sample \d+.*uint16.*the index says"):
        ds.__getitems__([0, 1])


def test_declared_channels_no_image_may_have_are_refused_before_allocation(deep_store):
    """A hostile index (65535 channels of float64 at a legal width and height) must not size a
    batch: the decoded-bytes limit is checked first, and nothing is allocated."""
    from fastdata.format.record import IMAGE_DTYPE_CODES

    store, _ = deep_store
    ds = _open(store, image_mode="unchanged", output="tensor")
    codes, channels = ds._pixel_meta["image"]
    ds._pixel_meta["image"] = (np.full_like(codes, IMAGE_DTYPE_CODES["float64"]), np.full_like(channels, 65535))
    ds.uniform_shape = (4096, 4096)
    with pytest.raises(CorruptRecordError, match="4096x4096 with 65535 channel.*of 8 byte.*more than the"):
        ds.__getitems__([0, 1])


@pytest.mark.parametrize("workers", [0, 2])
def test_numpy_batches_through_the_loader_are_n_h_w(deep_store, workers):
    store, arrays = deep_store
    ds = _open(store, image_mode="unchanged", output="numpy")
    images, _ = next(iter(fastdata.loader(ds, batch_size=4, num_workers=workers, shuffle=False)))
    assert isinstance(images, np.ndarray) and images.shape == (4, H, W) and images.dtype == np.uint16
    np.testing.assert_array_equal(images[1], arrays[ds.relpath(1)])
