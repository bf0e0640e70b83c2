"""PatchDataset with MONAI (and torchio) conventions: a channel axis and a dtype cast per patch,
each patch's own affine, MetaTensor items that survive ``fastdata.collate``, the source file name
of converted NIfTI volumes, and the MONAI training example end to end with two workers.

The affines are checked against nibabel's ``apply_affine`` and MONAI's own ``SpatialCrop`` of a
MetaTensor (which moves the affine to the crop), never against PatchDataset's formula."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.nifti import affine_of, raw_values, write_nifti

import fastdata
from fastdata.reader.patches import PatchDataset

monai = pytest.importorskip("monai")
nib = pytest.importorskip("nibabel")
from monai.data import MetaTensor, decollate_batch  # noqa: E402
from monai.transforms import SpatialCrop  # noqa: E402
from nibabel.affines import apply_affine  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SHAPE = (32, 32, 32)
PATCH = (16, 12, 8)


class Volumes:
    """A plain base: uint16 CT-like volumes, a uint8 label, a 4-D field (x, y, z, 2 echoes) and an
    affine per sample."""

    def __len__(self) -> int:
        return 3

    def __getitem__(self, index):
        i = int(index)
        image = ((np.arange(math.prod(SHAPE)).reshape(SHAPE) * (i + 1)) % 4096).astype(np.uint16)
        echoes = np.stack([image, image // 2], axis=-1)
        return {"image": image, "label": (image > 2048).astype(np.uint8), "echoes": echoes,
                "affine": affine_of(i), "id": i}


# --------------------------------------------------------------------------- channel axis and dtype


def test_channel_first_and_dtype_cast_each_patch():
    plain = PatchDataset(Volumes(), PATCH, seed=3)
    ds = PatchDataset(Volumes(), PATCH, seed=3, channel_first=True, dtype={"image": np.float32, "echoes": "float32"})
    for p in range(len(ds)):
        raw, item = plain[p], ds[p]
        assert item["image"].shape == (1, *PATCH) and item["image"].dtype == np.float32
        assert item["label"].shape == (1, *PATCH) and item["label"].dtype == np.uint8  # not named: kept
        # the trailing axis (echoes) moved to the front, MONAI's EnsureChannelFirst(channel_dim=-1)
        assert item["echoes"].shape == (2, *PATCH) and item["echoes"].dtype == np.float32
        assert np.array_equal(item["image"][0], raw["image"].astype(np.float32))
        assert np.array_equal(item["echoes"], np.moveaxis(raw["echoes"], -1, 0).astype(np.float32))
        assert item["image"].flags.c_contiguous and item["echoes"].flags.c_contiguous
        assert np.array_equal(item["position"], raw["position"])  # the cut axes only

    tensors = PatchDataset(Volumes(), PATCH, fields=("image", "label"), channel_first=True, dtype=torch.float32,
                           output="tensor")
    item = tensors[0]
    assert item["image"].dtype == item["label"].dtype == torch.float32 and item["image"].shape == (1, *PATCH)
    assert torch.isfinite(torch.nn.functional.conv3d(item["image"][None], torch.ones(1, 1, 3, 3, 3))).all()


def test_channel_and_dtype_settings_are_checked():
    with pytest.raises(ValueError, match="first already"):
        PatchDataset(Volumes(), (None, 16, 16), channel_first=True)
    with pytest.raises(ValueError, match="not among the fields cut"):
        PatchDataset(Volumes(), PATCH, fields="image", dtype={"label": np.float32})
    with pytest.raises(ValueError, match="not a numpy or torch dtype"):
        PatchDataset(Volumes(), PATCH, dtype="floaty")
    with pytest.raises(ValueError, match="affine is not cut"):
        PatchDataset(Volumes(), PATCH, fields=("image", "affine"))
    with pytest.raises(ValueError, match="channel_first moves at most one"):
        PatchDataset(Volumes(), (16, 16), fields="echoes", channel_first=True)[0]  # 2 axes after the patch's


# --------------------------------------------------------------------------- the patch's affine


def test_each_patch_carries_its_own_affine_as_nibabel_and_monai_compute_it():
    ds = PatchDataset(Volumes(), PATCH, fields=("image",), patches_per_sample=4, seed=1, output="monai")
    volumes = Volumes()
    for p in range(len(ds)):
        item = ds[p]
        sample = volumes[item["sample"]]
        start = item["position"].numpy()
        affine = item["affine"].numpy()
        # nibabel: the patch's voxel v is the volume's voxel start + v, in the same world place
        for v in ([0, 0, 0], [5, 11, 7], [PATCH[0] - 1, 0, PATCH[2] - 1]):
            np.testing.assert_allclose(apply_affine(affine, v), apply_affine(sample["affine"], start + v), atol=1e-9)
        # MONAI: its SpatialCrop of the whole volume as a MetaTensor moves the affine the same way
        whole = MetaTensor(torch.from_numpy(sample["image"][None].astype(np.int32)),
                           affine=torch.from_numpy(sample["affine"]))
        crop = SpatialCrop(roi_start=start.tolist(), roi_end=(start + PATCH).tolist())(whole)
        np.testing.assert_allclose(item["image"].affine.numpy(), crop.affine.numpy(), atol=1e-9)
        np.testing.assert_allclose(affine, crop.affine.numpy(), atol=1e-9)
        assert np.array_equal(item["image"].numpy(), crop.numpy()[0])
        assert not np.allclose(affine, sample["affine"]) or not start.any()  # not the volume's own


def test_a_channel_first_base_and_padded_patches_move_the_affine_on_the_spatial_axes():
    class ChannelFirst:
        def __len__(self):
            return 1

        def __getitem__(self, index):
            return {"image": np.zeros((2, 10, 12, 6), np.float32), "affine": affine_of(2)}

    ds = PatchDataset(ChannelFirst(), (None, 8, 16, 4), pad_value=0, seed=0)  # axis 2 shorter: padded
    item = ds[0]
    start = item["position"][1:]
    assert start[1] == -2  # centred in the patch
    np.testing.assert_allclose(apply_affine(item["affine"], [0, 0, 0]), apply_affine(affine_of(2), start))


# --------------------------------------------------------------------------- MetaTensors through collate


def test_monai_items_are_metatensors_that_fastdata_collate_keeps_with_per_item_affines():
    ds = PatchDataset(Volumes(), PATCH, fields=("image", "label"), seed=2, channel_first=True,
                      dtype=np.float32, output="monai")
    items = [ds[0], ds[1], ds[2]]
    assert isinstance(items[0]["image"], MetaTensor) and items[0]["image"].meta["original_channel_dim"] == 0
    batch = fastdata.collate(items)
    for key in ("image", "label"):
        assert isinstance(batch[key], MetaTensor) and batch[key].is_batch
        assert batch[key].shape == (3, 1, *PATCH) and batch[key].dtype == torch.float32
        assert batch[key].affine.shape == (3, 4, 4)
        for k, item in enumerate(items):
            assert torch.equal(batch[key].affine[k], item[key].affine)
    assert len({tuple(a.flatten().tolist()) for a in batch["image"].affine}) == 3  # three samples, three affines
    assert torch.equal(batch["position"], torch.stack([item["position"] for item in items]))
    # MONAI takes the batch apart again, each item with its own affine
    for item, back in zip(items, decollate_batch(batch), strict=True):
        assert torch.equal(back["image"].affine, item["image"].affine)
        assert torch.equal(back["image"].as_tensor(), item["image"].as_tensor())


def test_monai_stays_optional(tmp_path):
    """``import fastdata``, PatchDataset and collate without output="monai" never import MONAI; asking
    for it without MONAI is a clear error. A fresh interpreter: this one has imported MONAI."""
    script = tmp_path / "check.py"
    script.write_text(
        "import sys\n"
        "import numpy as np\n"
        "import fastdata\n"
        "from fastdata.reader.patches import PatchDataset\n"
        "base = [{'image': np.zeros((8, 8, 8), np.uint16), 'affine': np.eye(4)}]\n"
        "ds = PatchDataset(base, (4, 4, 4), channel_first=True, dtype=np.float32, output='tensor')\n"
        "fastdata.collate([ds[0], ds[0]])\n"
        "assert not any(m == 'monai' or m.startswith('monai.') for m in sys.modules), 'monai imported'\n"
        "sys.modules['monai'] = None  # as if not installed\n"
        "try:\n"
        "    PatchDataset(base, (4, 4, 4), output='monai')\n"
        "except fastdata.errors.MissingExtraError as err:\n"
        "    assert 'pip install monai' in str(err), err\n"
        "else:\n"
        "    raise AssertionError('no error without MONAI')\n"
        "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


# --------------------------------------------------------------------------- converted NIfTI volumes


def test_converted_volumes_keep_their_file_names_and_affines(tmp_path):
    root = tmp_path / "scans"
    files = {"a.nii.gz": 0, "sub/b.nii": 1}  # a nested path: relative to the converted root
    for rel, i in files.items():
        write_nifti(root / rel, ((np.indices(SHAPE).sum(0) * (i + 2)) % 900).astype(np.int16), affine_of(i))
    # a flat folder's own files only (subfolders are classes): list them instead
    (tmp_path / "list.csv").write_text("image\n" + "".join(f"scans/{rel}\n" for rel in files))
    store = tmp_path / "v.lmdb"
    report = fastdata.convert(tmp_path / "list.csv", store, chunks=(16, 16, 16), workers=0, progress=False)
    assert report.images == 2
    ds = fastdata.open_dataset(store)
    names = {ds.relpath(i): i for i in range(len(ds))}
    assert sorted(names) == sorted(f"scans/{rel}" for rel in files)
    patches = PatchDataset(ds, PATCH, fields="image", seed=0, channel_first=True, dtype=np.float32, output="monai")
    for p in range(len(patches)):
        item = patches[p]
        filename = item["image"].meta["filename_or_obj"]
        path = tmp_path / filename
        assert filename == ds.relpath(item["sample"]) and path.exists()
        start = item["position"].numpy()
        region = tuple(slice(a, a + e) for a, e in zip(start.tolist(), PATCH, strict=True))
        assert np.array_equal(item["image"][0].numpy(), raw_values(path)[region].astype(np.float32))
        np.testing.assert_allclose(apply_affine(item["image"].affine.numpy(), [0, 0, 0]),
                                   apply_affine(nib.load(str(path)).affine, start))
    batch = fastdata.collate([patches[0], patches[1]])
    assert batch["image"].meta["filename_or_obj"] == [patches[0]["image"].meta["filename_or_obj"],
                                                      patches[1]["image"].meta["filename_or_obj"]]


# --------------------------------------------------------------------------- the example, end to end


def _example():
    spec = importlib.util.spec_from_file_location("monai_training_example", ROOT / "examples" / "monai_training.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_monai_training_example_trains_with_two_workers(tmp_path):
    example = _example()
    source = example.write_synthetic_set(str(tmp_path / "set"), count=2, shape=(32, 32, 24))
    store = str(tmp_path / "v.lmdb")
    fastdata.convert(source, store, chunks=(16, 16, 16), workers=0, progress=False)
    loader = example.patch_loader(store, patch=16, batch_size=2, workers=2)
    assert loader.num_workers == 2
    batch = next(iter(loader))
    assert isinstance(batch["image"], MetaTensor) and batch["image"].dtype == torch.float32
    assert batch["image"].shape[:2] == (2, 1) and batch["image"].affine.shape == (2, 4, 4)
    # Orientationd ran in the workers: the stored LPS-like affine now points to RAS (positive diagonal)
    assert (torch.diagonal(batch["image"].affine[:, :3, :3], dim1=1, dim2=2) > 0).all()
    assert 0.0 <= float(batch["image"].min()) and float(batch["image"].max()) <= 1.0  # ScaleIntensityRanged
    model, losses, before = example.train(loader, steps=2, log=None)
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    changed = [name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])]
    assert changed, "no parameter changed"
