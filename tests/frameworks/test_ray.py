"""Ray Data out and in (fastdata.integrations.ray) on a real local Ray cluster (2 CPUs, started
once for the module: Ray's start-up is the slow part).

Writing: the store equals a single-process ``fastdata.write`` of the same rows in Ray's order
(every field of every sample, the labels), verifies, and records its parts; a worker killed
mid-write (its first attempt) is retried by Ray and leaves no duplicate and no gap; a row that does
not match the schema is one clear error naming the task, row and field, and nothing is published
(no store, no parts left). Reading: one read task per shard, every sample exactly once, images as
their bytes or decoded arrays, from a local store and from the S3 test server.
"""

from __future__ import annotations

import io
import json
import os
import sys

import numpy as np
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

import fastdata  # noqa: E402
from fastdata.format.fields import Float, Image, Int, Ragged, SchemaError, String  # noqa: E402
from fastdata.format.names import MANIFEST_NAME  # noqa: E402
from fastdata.integrations import ray as fray  # noqa: E402
from fastdata.tools.verify import verify  # noqa: E402

ROWS = 240
SCHEMA = {"id": Int(), "image": Image(), "label": Int(), "name": String(), "boxes": Ragged("float32", (4,)),
          "score": Float()}


def _png(i: int) -> bytes:
    from PIL import Image as PILImage

    buf = io.BytesIO()
    PILImage.fromarray(np.full((6 + i % 5, 7, 3), (i * 7) % 256, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def make_rows(batch: dict) -> dict:
    """A Ray ``map_batches`` UDF: the rows of ids ``batch["id"]``, each field a column."""
    ids = [int(i) for i in batch["id"]]
    boxes = np.empty(len(ids), dtype=object)
    for k, i in enumerate(ids):
        boxes[k] = np.arange(4 * (i % 4), dtype=np.float32).reshape(-1, 4)
    images = np.empty(len(ids), dtype=object)
    for k, i in enumerate(ids):
        images[k] = _png(i)
    return {"id": np.array(ids), "image": images, "label": np.array([i % 7 for i in ids]),
            "name": np.array([f"sample-{i}" for i in ids], dtype=object), "boxes": boxes,
            "score": np.array([i / 4 for i in ids])}


def python_rows(ids) -> list[dict]:
    """The same rows as :func:`make_rows`, as a Python list for ``fastdata.write``."""
    batch = make_rows({"id": np.asarray(list(ids))})
    return [{k: (v[j].item() if isinstance(v[j], np.generic) else v[j]) for k, v in batch.items()}
            for j in range(len(batch["id"]))]


class DyingSink(fray.StoreSink):
    """A :class:`StoreSink` whose first attempt of write task ``kill_task`` kills its worker process
    outright (``os._exit``: no cleanup, no exception for Ray to see) once its part store holds all
    of its rows but is not finished, leaving a marker file that lists the part files at that moment."""

    def __init__(self, *args, marker: str, kill_task: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.marker, self.kill_task = marker, kill_task

    def write(self, blocks, ctx):
        def dying(blocks):
            yield from blocks  # (the write session consumes these rows, writing the part's shards)
            if ctx.task_idx == self.kill_task and not os.path.exists(self.marker):
                found = [os.path.relpath(os.path.join(d, f), self.parts_dir)
                         for d, _, fs in os.walk(self.parts_dir) for f in fs]
                with open(self.marker, "w") as fh:
                    json.dump(found, fh)
                os._exit(1)

        return super().write(dying(blocks), ctx)


@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster for the module, rows in a deterministic order."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # (Ray would report the cluster's start to its servers)
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 << 20, log_to_driver=False,
             configure_logging=False)
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False
    try:
        yield ray
    finally:
        ray.shutdown()


def source(n: int = ROWS, blocks: int = 4):
    return ray.data.range(n, override_num_blocks=blocks)


def assert_same_samples(path, reference) -> None:
    """Every field of every sample of ``path`` equals ``reference``'s (decoded), in order."""
    got, want = fastdata.open_dataset(path, output="numpy"), fastdata.open_dataset(reference, output="numpy")
    assert len(got) == len(want)
    for i in range(len(want)):
        a, b = got[i], want[i]
        assert a.keys() == b.keys()
        for key in b:
            assert np.array_equal(np.asarray(a[key]), np.asarray(b[key])), (i, key)


@pytest.fixture(scope="module")
def written(cluster, tmp_path_factory):
    """The module's store: the rows written by Ray (4 write tasks), and the reference."""
    root = tmp_path_factory.mktemp("ray")
    report = fray.write(source().map_batches(make_rows, batch_size=20), root / "ray.lmdb", SCHEMA,
                        shard_size="4KiB")
    fastdata.write(python_rows(range(ROWS)), root / "ref.lmdb", SCHEMA, shard_size="4KiB")
    return root, report


def test_write_equals_fastdata_write(written, capsys):
    from fastdata.cli.main import main as cli

    root, report = written
    assert report is not None and report.samples == ROWS
    assert_same_samples(root / "ray.lmdb", root / "ref.lmdb")
    assert cli(["verify", str(root / "ray.lmdb")]) == 0
    assert cli(["info", str(root / "ray.lmdb")]) == 0
    assert "made by:  fastdata.integrations.ray, 4 part(s) published as one store" in capsys.readouterr().out
    manifest = json.loads((root / "ray.lmdb" / MANIFEST_NAME).read_text())
    # the order is recorded: the parts in task order, with their sample counts
    assert manifest["options"]["source"] == fray.RAY_SOURCE
    parts = manifest["options"]["merged"]
    assert [os.path.basename(p["store"])[:11] for p in parts] == [f"part-{k:06d}" for k in range(len(parts))]
    assert sum(p["samples"] for p in parts) == ROWS and len(parts) == 4
    # each record keeps its row within its part
    ds = fastdata.open_dataset(root / "ray.lmdb")
    assert [ds.relpath(i) for i in (0, 1, parts[0]["samples"])] == ["0", "1", "0"]
    # published with hard links, nothing left beside the store
    assert report.linked == report.shards
    assert sorted(os.listdir(root)) == ["ray.lmdb", "ref.lmdb"]


def test_read_every_sample_once(written):
    root, _ = written
    store = root / "ray.lmdb"
    opened = fastdata.open_dataset(store, output="numpy")
    shards = len(json.loads((store / MANIFEST_NAME).read_text())["shards"])
    assert shards > 4  # (several shards a part: one read task each)
    assert len(fray.StoreDatasource(store).get_read_tasks(2)) == shards
    rows = fray.read(store, index_column="index").take_all()
    assert sorted(r["index"] for r in rows) == list(range(len(opened)))
    assert sorted(r["id"] for r in rows) == list(range(ROWS))
    for row in rows[:: len(rows) // 10]:
        want = opened[row["index"]]
        assert row["image"] == _png(row["id"]) and row["label"] == want["label"] and row["name"] == want["name"]
        assert np.array_equal(row["boxes"], want["boxes"])
    decoded = fray.read(store, images="numpy", columns=["image", "id"]).take(8)
    for row in decoded:
        assert np.array_equal(row["image"], opened[row["id"]]["image"])


def test_killed_worker_is_retried_without_duplicate_or_gap(written, tmp_path):
    root, _ = written
    marker, dst = tmp_path / "killed", tmp_path / "retried.lmdb"
    # (task_size=8: the part's shards are written as its rows arrive, so some are there at the kill)
    sink = DyingSink(dst, SCHEMA, shard_size="4KiB", task_size=8, marker=str(marker), kill_task=2)
    # Ray's own call (what fray.write makes); Ray's default retries for a dead worker run task 2 again
    source().map_batches(make_rows, batch_size=20).write_datasink(sink)
    # the control: a worker did die while task 2's part was half written (shards, no manifest)
    killed = [f for f in json.loads(marker.read_text()) if f.split(os.sep)[0].startswith("part-000002-")]
    assert any(os.path.basename(f).startswith("shard-") for f in killed), killed
    assert not any(f.endswith(MANIFEST_NAME) for f in killed), killed
    assert verify(str(tmp_path / "retried.lmdb")).ok
    assert_same_samples(tmp_path / "retried.lmdb", root / "ref.lmdb")
    assert sorted(os.listdir(tmp_path)) == ["killed", "retried.lmdb"]  # the dead attempt's part is gone


def bad_rows(batch: dict) -> dict:
    rows = make_rows(batch)
    rows["label"] = np.array([None if i == 97 else i % 7 for i in batch["id"]], dtype=object)
    return rows


def test_bad_row_names_it_and_publishes_nothing(cluster, tmp_path):
    with pytest.raises(SchemaError) as err:
        fray.write(source().map_batches(bad_rows, batch_size=20), tmp_path / "bad.lmdb", SCHEMA)
    text = str(err.value)
    # 240 rows in 4 blocks of 60: row 97 is row 37 of task 1
    assert "Ray write task 1" in text and "sample 37 field 'label'" in text and "nothing was published" in text
    assert "Traceback" not in text and len(text.splitlines()) == 1
    assert os.listdir(tmp_path) == []  # no store, no parts


def test_refused_before_the_job(cluster, written, tmp_path):
    root, _ = written
    with pytest.raises(fastdata.errors.StoreExistsError, match="overwrite"):
        fray.StoreSink(root / "ray.lmdb", SCHEMA)
    with pytest.raises(fray.RayWriteError, match="resume"):
        fray.StoreSink(tmp_path / "x.lmdb", SCHEMA, resume=True)
    with pytest.raises(fray.RayWriteError, match="added_values"):  # (they go with an append)
        fray.StoreSink(tmp_path / "x.lmdb", SCHEMA, added_values={"score": [1.0]})
    with pytest.raises(ValueError, match="no field 'nope'"):
        fray.read(root / "ray.lmdb", columns=["nope"])


@pytest.mark.slow
def test_hdf5_and_one_task(cluster, tmp_path):
    """Both backends, and a dataset of one block (one part: published on its own)."""
    for blocks, name in ((4, "four.h5"), (1, "one.h5")):
        fray.write(source(60, blocks).map_batches(make_rows, batch_size=20), tmp_path / name, SCHEMA)
        fastdata.write(python_rows(range(60)), tmp_path / f"ref-{name}", SCHEMA)
        assert verify(str(tmp_path / name)).ok
        assert_same_samples(tmp_path / name, tmp_path / f"ref-{name}")


@pytest.mark.slow
def test_inferred_schema(cluster, tmp_path):
    """No schema=: fray.write infers it once from the first row, as fastdata.write does from its first sample."""
    fray.write(source(60, 2).map_batches(make_rows, batch_size=20), tmp_path / "inferred.lmdb")
    fastdata.write(python_rows(range(60)), tmp_path / "ref.lmdb")
    inferred, reference = (fastdata.open_dataset(tmp_path / name) for name in ("inferred.lmdb", "ref.lmdb"))
    assert inferred.schema == reference.schema
    assert_same_samples(tmp_path / "inferred.lmdb", tmp_path / "ref.lmdb")


@pytest.mark.slow
def test_empty_dataset(cluster, tmp_path):
    fray.write(source(0, 1).map_batches(make_rows, batch_size=20), tmp_path / "empty.lmdb", SCHEMA)
    assert len(fastdata.open_dataset(tmp_path / "empty.lmdb")) == 0


@pytest.mark.slow
def test_read_remote_store(cluster, written, s3, tmp_path):
    server, bucket = s3
    root, _ = written
    options = {"endpoint_url": server.endpoint, "key": "fastdata-test", "secret": "fastdata-test-secret"}
    url = f"{bucket}/remote.lmdb"
    fastdata.write(python_rows(range(ROWS)), url, SCHEMA, shard_size="4KiB", storage_options=options)
    rows = fray.read(url, storage_options=options, cache_dir=str(tmp_path / "cache"), index_column="index").take_all()
    assert sorted(r["id"] for r in rows) == list(range(ROWS))
    assert sorted(r["index"] for r in rows) == list(range(ROWS))


def unreadable_image(batch: dict) -> dict:
    rows = make_rows(batch)
    rows["image"][3] = b"not an image"
    return rows


@pytest.mark.slow
def test_unusable_image_names_its_task_and_row(cluster, tmp_path):
    with pytest.raises(fastdata.errors.RejectedInputError) as err:
        fray.write(source(60, 1).map_batches(unreadable_image, batch_size=20), tmp_path / "bad.lmdb", SCHEMA)
    assert "Ray write task 0" in str(err.value) and "sample 3 field 'image'" in str(err.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_control_killed_worker_without_retries_publishes_nothing(cluster, tmp_path):
    """The control of the retry test: with no retry the kill fails the job, and the destination
    and the parts folder are left empty (no half store)."""
    marker, dst = tmp_path / "killed", tmp_path / "out.lmdb"
    sink = DyingSink(dst, SCHEMA, marker=str(marker), kill_task=2)
    with pytest.raises(Exception, match="died|crash|exit|Worker"):
        source().map_batches(make_rows, batch_size=20).write_datasink(sink, ray_remote_args={"max_retries": 0})
    assert marker.exists() and os.listdir(tmp_path) == ["killed"]


@pytest.mark.slow
def test_write_to_url(cluster, written, s3):
    """A URL destination: each task uploads its part beside it, the server copies the parts' shards
    into the store, the parts are deleted; the store verifies and equals the local reference."""
    server, bucket = s3
    root, _ = written
    options = {"endpoint_url": server.endpoint, "key": "fastdata-test", "secret": "fastdata-test-secret"}
    url = f"{bucket}/ray.lmdb"
    report = fray.write(source().map_batches(make_rows, batch_size=20), url, SCHEMA, shard_size="4KiB",
                        storage_options=options)
    assert report is not None and report.server_side == report.shards
    assert verify(url, storage_options=options).ok
    assert_same_samples_at(url, options, root / "ref.lmdb")
    from fastdata.remote.location import RemoteLocation

    left = RemoteLocation(bucket, options).listing()
    assert left and all(name.startswith("ray.lmdb/") for name in left), sorted(left)[:5]


def assert_same_samples_at(url: str, options: dict, reference) -> None:
    got = fastdata.open_dataset(url, output="numpy", storage_options=options)
    want = fastdata.open_dataset(reference, output="numpy")
    assert len(got) == len(want)
    for i in range(len(want)):
        for key, value in want[i].items():
            assert np.array_equal(np.asarray(got[i][key]), np.asarray(value)), (i, key)
