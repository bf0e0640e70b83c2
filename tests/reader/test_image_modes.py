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


# -- what counts as reduced, and where the warning points ------------------------------------------


@pytest.fixture(scope="module")
def cmyk_store(tmp_path_factory) -> str:
    """Ordinary photos beside CMYK JPEGs (Pillow's own), as every ImageNet-like folder has: the
    CMYK ones are recorded as 4 channels of uint8."""
    root = tmp_path_factory.mktemp("cmyk")
    rng = np.random.default_rng(5)
    for cls in ("a", "b"):
        os.makedirs(root / "src" / cls)
        for i in range(2):
            rgb = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
            image = Image.fromarray(rgb).convert("CMYK") if i == 0 else Image.fromarray(rgb)
            image.save(root / "src" / cls / f"{i}.jpg", format="JPEG")
    dst = str(root / "cmyk.lmdb")
    fastdata.convert(str(root / "src"), dst, workers=0)
    return dst


def test_cmyk_jpegs_open_without_a_reduced_warning(cmyk_store):
    """ImageFolder converts CMYK to RGB silently; so does the default read mode, without a warning."""
    assert Image.open(os.path.join(os.path.dirname(cmyk_store), "src", "a", "0.jpg")).mode == "CMYK"
    with warnings.catch_warnings():
        warnings.simplefilter("error", ImagesReducedWarning)
        ds = fastdata.open_dataset(cmyk_store, output="numpy")
        fastdata.LMDBImageDataset(cmyk_store)
    assert sorted(ds.column("channels").tolist()) == [3, 3, 4, 4]  # the index does record 4 channels
    image, _ = ds[0]
    assert image.shape == (H, W, 3)


def _reduced_warning(open_it) -> warnings.WarningMessage:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        open_it()
    reduced = [w for w in caught if issubclass(w.category, ImagesReducedWarning)]
    assert len(reduced) == 1, [str(w.message) for w in caught]
    return reduced[0]


def test_the_reduced_warning_points_at_the_callers_line(deep_store, tmp_path):
    """Whichever way the dataset is opened (the facade, the class, a subclass of it, a general
    store), the warning names the caller's line, never a line inside fastdata."""
    store, _ = deep_store
    cls = fastdata.LMDBImageDataset if store.endswith(".lmdb") else fastdata.HDF5ImageDataset
    general = str(tmp_path / "general.lmdb")
    fastdata.write([{"image": _png(np.arange(H * W, dtype=np.uint16).reshape(H, W) * 97), "label": 0}], general,
                   schema={"image": ImageField(), "label": Int()}, workers=0)

    class Mine(cls):  # type: ignore[misc, valid-type]
        def __init__(self, path):
            super().__init__(path)  # the first line outside fastdata: where the warning points

    # each call on its own line: a lambda's first line is the line of its call
    calls = [
        lambda: fastdata.open_dataset(store),
        lambda: cls(store),
        lambda: fastdata.open_dataset(general),
    ]
    expected = [(c, c.__code__.co_firstlineno) for c in calls]
    expected.append((lambda: Mine(store), Mine.__init__.__code__.co_firstlineno + 1))
    for open_it, line in expected:
        w = _reduced_warning(open_it)
        assert (w.filename, w.lineno) == (__file__, line)


@pytest.fixture(scope="module")
def band_store(tmp_path_factory) -> tuple[str, dict[str, np.ndarray]]:
    """A class folder with a 5-band TIFF, a 4-band (not RGBA) TIFF, both written by tifffile, and
    a JPEG: sound records, two of which the default "RGB" mode cannot represent."""
    from helpers.native_images import pixels, tiff

    root = tmp_path_factory.mktemp("bands")
    os.makedirs(root / "src" / "a")
    five, four = pixels(np.uint8, 5, seed=1, shape=(H, W)), pixels(np.uint8, 4, seed=2, shape=(H, W))
    (root / "src" / "a" / "five.tif").write_bytes(tiff(five))
    buf = io.BytesIO()
    import tifffile

    tifffile.imwrite(buf, four, photometric="minisblack", planarconfig="contig", metadata=None)
    (root / "src" / "a" / "four.tif").write_bytes(buf.getvalue())
    Image.fromarray(pixels(np.uint8, 3, seed=3, shape=(H, W))).save(root / "src" / "a" / "photo.jpg")
    dst = str(root / "bands.lmdb")
    fastdata.convert(str(root / "src"), dst, workers=0)
    return dst, {"a/five.tif": five, "a/four.tif": four}


def test_a_five_band_store_warns_at_the_callers_line(band_store):
    store, _ = band_store
    call = lambda: fastdata.open_dataset(store)  # noqa: E731 - its first line is the line of the call
    w = _reduced_warning(call)
    assert (w.filename, w.lineno) == (__file__, call.__code__.co_firstlineno)
    assert "1 have 5 channels" in str(w.message) and "ImageModeError" in str(w.message)


@pytest.mark.parametrize("output", ["numpy", "pil", "tensor"])
def test_bands_rgb_cannot_represent_raise_a_mode_error_that_skip_never_skips(band_store, output):
    """Sound records a read mode cannot give are not damage: ImageModeError naming the record and the
    mode to use, under on_error="skip" too, one by one and in batches; nothing is counted as skipped."""
    store, arrays = band_store
    ds = _open(store, output=output, on_error="skip")
    for rel in arrays:
        i = [ds.relpath(k) for k in range(len(ds))].index(rel)
        with pytest.raises(ImageModeError, match=rf"record {i} \(sample {i}\).*image_mode=\"unchanged\"") as info:
            ds[i]
        assert not isinstance(info.value, CorruptRecordError)
        with pytest.raises(ImageModeError, match=rf"sample {i}\)"):
            ds.__getitems__([i, (i + 1) % len(ds)])
    assert ds.skipped == 0
    unchanged = _open(store, output="numpy", image_mode="unchanged")
    for i in range(len(unchanged)):
        if unchanged.relpath(i) in arrays:
            np.testing.assert_array_equal(unchanged[i][0], arrays[unchanged.relpath(i)])


def test_a_five_band_image_field_of_a_general_store_is_a_mode_error_too(tmp_path):
    from helpers.native_images import pixels, tiff

    dst = str(tmp_path / "g.lmdb")
    five = pixels(np.uint8, 5, seed=4, shape=(H, W))
    fastdata.write([{"image": tiff(five), "label": 0}], dst, schema={"image": ImageField(), "label": Int()},
                   workers=0)
    ds = _open(dst, output="numpy", on_error="skip")
    with pytest.raises(ImageModeError, match=r"sample 0\) image field 'image'.*image_mode=\"unchanged\""):
        ds[0]
    assert ds.skipped == 0
