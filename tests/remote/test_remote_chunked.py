"""Chunked fields in a store on a real S3 server (SeaweedFS): written through the URL sink, read
back by region through the shard cache, and cut into patches by DataLoader workers."""

from __future__ import annotations

import numpy as np
from helpers.volumes import SCHEMA, volume

import fastdata


def test_chunked_volumes_written_to_s3_read_by_region_and_patch(s3, tmp_path):
    _, bucket = s3
    url = f"{bucket}/vols.lmdb"
    vols = [volume(i, (40, 36, 30)) for i in range(6)]
    fastdata.write([{"ct": v, "label": i} for i, v in enumerate(vols)], url, SCHEMA, shard_size="1MiB",
                   workers=2, progress=False)
    ds = fastdata.open_dataset(url, cache_dir=str(tmp_path / "cache"))
    for i in (0, 5):
        assert np.array_equal(ds[i]["ct"][3:33, ::2, 7], vols[i][3:33, ::2, 7])
    patches = fastdata.PatchDataset(ds, (16, 16, 16), fields=("ct",), patches_per_sample=2, seed=0)
    for batch in fastdata.loader(patches, batch_size=4, num_workers=2):
        for s, p, ct in zip(batch["sample"], batch["position"], batch["ct"], strict=True):
            region = tuple(slice(a, a + 16) for a in p.tolist())
            assert np.array_equal(ct.numpy(), vols[int(s)][region])
    assert fastdata.verify(url).ok
