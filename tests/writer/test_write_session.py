"""The one write session (fastdata.writer.session): every entry point goes through it,
``workers=0`` means no worker process for every one of them, a single process is the
rank group of one, and a new kind of input plugs in as a source alone."""

from __future__ import annotations

import concurrent.futures as cf
import json
import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.images import make_jpeg, make_tree
from helpers.samples import SCHEMA, sample

import fastdata
from fastdata.format.fields import Int, Schema, String
from fastdata.format.manifest import read_manifest
from fastdata.format.record import encode_sample
from fastdata.synth_coco import make_coco
from fastdata.writer.distributed import RankGroup
from fastdata.writer.ingest import spill
from fastdata.writer.pipeline import Chunk, ChunkSource
from fastdata.writer.plan import ShardPlan
from fastdata.writer.report import ProgressBar
from fastdata.writer.resume import RunOptions
from fastdata.writer.session import WriteOptions, WriteSession
from fastdata.writer.sources.public import Coco, ImageFolder, Samples, Source, Table
from fastdata.writer.sources.base import WriteSource


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inputs")
    tree = Path(make_tree(root / "tree", {"a": 6, "b": 5}, size=(40, 30), seed=4))
    rel = sorted(str(p.relative_to(tree)) for p in tree.rglob("*.jpg"))
    (tree / "list.csv").write_text("path,label\n" + "".join(f"{r},{r.split('/')[0]}\n" for r in rel))
    rows = [{"path": f"img/{i}.jpg", "n": i, "label": ["x", "y"][i % 2]} for i in range(9)]
    for i, row in enumerate(rows):
        make_jpeg(root / row["path"], size=(20 + i, 16), seed=i)
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    coco = make_coco(root / "coco", 6, seed=2, max_boxes=3, size=(60, 50))
    return {"tree": tree, "list": tree / "list.csv", "table": root / "rows.jsonl",
            "ann_file": Path(coco.ann_file), "image_dir": Path(coco.image_dir)}


def run_entry_point(kind: str, inputs: dict[str, Path], dst: Path, workers: int):
    options = dict(workers=workers, shard_size="6kB", progress=False)
    if kind == "folder":
        return fastdata.convert(inputs["tree"], dst, **options)
    if kind == "list":
        return fastdata.convert(inputs["list"], dst, **options)
    if kind == "table":
        return fastdata.convert_table(inputs["table"], dst, **options)
    if kind == "map":
        return fastdata.write([sample(i) for i in range(12)], dst, SCHEMA, **options)
    if kind == "iterable":
        return fastdata.write((sample(i) for i in range(12)), dst, SCHEMA, **options)
    assert kind == "coco"
    return fastdata.convert_coco(inputs["ann_file"], inputs["image_dir"], dst, **options)


def entry_point_source(kind: str, inputs: dict[str, Path]) -> Source:
    """The source object the entry point ``kind`` of :func:`run_entry_point` builds and writes
    (``Source.write``), for a write given an ``executor_factory``."""
    if kind in ("folder", "list"):
        return ImageFolder(inputs["tree" if kind == "folder" else "list"])
    if kind == "table":
        return Table(inputs["table"])
    if kind in ("map", "iterable"):
        return Samples([sample(i) for i in range(12)] if kind == "map" else (sample(i) for i in range(12)), SCHEMA)
    assert kind == "coco"
    return Coco(inputs["ann_file"], inputs["image_dir"])


@pytest.fixture
def pools(monkeypatch) -> dict:
    """Counts the worker pools started by ``pools["factory"]`` (an ``executor_factory``: a
    ProcessPoolExecutor subclass), and the most child processes alive when a chunk is written
    that were not alive before (earlier tests may leave long-lived helpers, e.g. a forkserver)."""
    seen: dict = {"pools": 0, "children": 0}
    already = {p.pid for p in multiprocessing.active_children()}

    class CountingPool(cf.ProcessPoolExecutor):
        def __init__(self, *args, **kwargs):
            seen["pools"] += 1
            super().__init__(*args, **kwargs)

    real_update = ProgressBar.update_counts

    def update_counts(self, *args):
        new = [p for p in multiprocessing.active_children() if p.pid not in already]
        seen["children"] = max(seen["children"], len(new))
        real_update(self, *args)

    monkeypatch.setattr(ProgressBar, "update_counts", update_counts)
    seen["factory"] = CountingPool  # given to the write as its executor_factory
    return seen


@pytest.mark.parametrize("kind", ["folder", "list", "table", "map", "iterable", "coco"])
def test_workers_0_runs_everything_in_this_process_for_every_entry_point(inputs, tmp_path, pools, kind):
    # the entry point itself: no worker process is alive while it writes
    in_process = run_entry_point(kind, inputs, tmp_path / "zero.lmdb", workers=0)
    assert pools["children"] == 0, "workers=0 started a worker process"
    # the source that entry point writes, given a counting pool factory: workers=0 never makes a pool
    source = entry_point_source(kind, inputs)
    source.write(tmp_path / "zero-again.lmdb", WriteOptions(workers=0, shard_size="6kB", progress=False),
                 executor_factory=pools["factory"])
    assert (pools["pools"], pools["children"]) == (0, 0), "workers=0 started a worker pool"
    # control: workers=1 starts a pool (of one worker process), from the factory it is given
    pooled = entry_point_source(kind, inputs).write(
        tmp_path / "one.lmdb", WriteOptions(workers=1, shard_size="6kB", progress=False),
        executor_factory=pools["factory"])
    assert pools["pools"] == 1
    # and both write the same store
    m0, m1 = read_manifest(in_process.dst), read_manifest(pooled.dst)
    assert in_process.images == pooled.images > 0 and in_process.rejected == pooled.rejected
    assert [s["xxh"] for s in m0["shards"]] == [s["xxh"] for s in m1["shards"]]
    assert len(m0["shards"]) >= 2, "the test wants several shards"


def test_negative_workers_is_refused_the_same_way_by_every_entry_point(inputs, tmp_path):
    for kind in ("folder", "table", "map", "coco"):
        with pytest.raises(ValueError, match="workers must be 0 .no worker processes"):
            run_entry_point(kind, inputs, tmp_path / f"{kind}.lmdb", workers=-1)
        assert not (tmp_path / f"{kind}.lmdb").exists()


def test_a_single_process_run_is_the_rank_group_of_one(inputs, tmp_path, monkeypatch):
    """No torchrun: the steps a rank group takes (rank 0 prepares, every rank writes, rank 0
    publishes) run on RankGroup(0, 1), in that order; torch.distributed is not needed."""
    calls: list[tuple[str, int, int]] = []
    real_rank0, real_every = RankGroup.on_rank0, RankGroup.on_every_rank

    def on_rank0(self, fn, failed):
        calls.append(("on_rank0", self.rank, self.world_size))
        return real_rank0(self, fn, failed)

    def on_every_rank(self, fn, failed):
        calls.append(("on_every_rank", self.rank, self.world_size))
        return real_every(self, fn, failed)

    monkeypatch.setattr(RankGroup, "on_rank0", on_rank0)
    monkeypatch.setattr(RankGroup, "on_every_rank", on_every_rank)
    for kind in ("folder", "map"):
        calls.clear()
        run_entry_point(kind, inputs, tmp_path / f"{kind}.lmdb", workers=0)
        assert calls == [("on_rank0", 0, 1), ("on_every_rank", 0, 1), ("on_rank0", 0, 1)]
    assert RankGroup().all_gather("x") == ["x"]  # a group of one's collectives are trivial


# --------------------------------------------------------------------------- a new input, written in this file


NUMBERS_SCHEMA = Schema.of({"n": Int("int64"), "word": String()})


def encode_numbers(schema: Schema, start: int, stop: int, spill_dir: str | None):
    """The worker function of :class:`NumbersInput` (module level: workers import it by name);
    multiples of 7 are rejected."""
    items: list = []
    for i in range(start, stop):
        if i % 7 == 6:
            items.append(f"{i} is unlucky")
            continue
        checked = schema.check({"n": i * i, "word": f"number {i}"}, f"number {i}")
        items.append(encode_sample(schema, checked, {}, f"n/{i}".encode()))
    return (spill(items, spill_dir) if spill_dir is not None else items), 8 * (stop - start)


class NumberChunks(ChunkSource):
    worker = staticmethod(encode_numbers)

    def chunks(self, plans: list[ShardPlan] | None) -> Iterator[Chunk]:
        for plan in plans or []:
            for a in range(plan.start, plan.stop, 4):
                b = min(a + 4, plan.stop)
                yield Chunk(plan, a, b, b == plan.stop, (NUMBERS_SCHEMA, a, b))

    def describe(self, start: int, stop: int) -> str:
        return f"numbers {start} .. {stop - 1}"

    def input_name(self, i: int) -> str:
        return f"n/{i}"


class NumbersInput(WriteSource):
    """The numbers ``0 .. count-1``, ten to a shard: an input kind the session has never heard of."""

    unit = "numbers"

    def __init__(self, count: int):
        super().__init__("numbers:test")
        self.count = count
        self.schema = NUMBERS_SCHEMA

    def plan(self, run: RunOptions, dst: str) -> list[ShardPlan]:
        self.warnings.append("numbers are not images")
        return [ShardPlan(k, a, min(a + 10, self.count)) for k, a in enumerate(range(0, self.count, 10))]

    def fingerprint(self, run: RunOptions) -> str:
        return f"numbers-{self.count}-{run.backend}"

    def chunks(self, run: RunOptions, chunk_size: int) -> NumberChunks:
        return NumberChunks()

    def manifest_extra(self) -> dict:
        return {"metadata": {"numbers": self.count}}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_new_input_plugs_in_as_a_source_alone(tmp_path, workers):
    dst = tmp_path / "numbers.lmdb"
    report = WriteSession(NumbersInput(35), dst, WriteOptions(workers=workers, progress=False)).run()
    # the session's report, manifest and store for an input it knows only through WriteSource
    assert report.images == 30 and report.rejected == 5 and report.shards == 4 and report.unit == "numbers"
    assert report.warnings == ["numbers are not images"]
    assert "wrote 30 numbers to" in report.summary()
    manifest = read_manifest(str(dst))
    assert manifest["options"]["source"] == "numbers:test" and manifest["metadata"] == {"numbers": 35}
    assert manifest["options"]["fingerprint"] == "numbers-35-lmdb"
    assert [r["path"] for r in manifest["rejected"]] == ["n/6", "n/13", "n/20", "n/27", "n/34"]
    ds = fastdata.open_dataset(dst)
    assert [ds[i]["n"] for i in range(3)] == [0, 1, 4] and ds[6]["word"] == "number 7"
    # the destination checks, resume and overwrite come with the session
    with pytest.raises(fastdata.errors.StoreExistsError, match="already holds a fastdata store"):
        WriteSession(NumbersInput(35), dst, WriteOptions(workers=workers)).run()
    again = WriteSession(NumbersInput(35), dst, WriteOptions(workers=workers, resume=True, progress=False)).run()
    assert again.already_complete and again.images == 30
    with pytest.raises(fastdata.errors.ResumeMismatchError, match="complete store made from different inputs"):
        WriteSession(NumbersInput(36), dst, WriteOptions(workers=workers, resume=True)).run()
    # in process: overwriting is the session's, not the workers' (a second pool would only cost start-up)
    replaced = WriteSession(NumbersInput(12), dst, WriteOptions(workers=0, overwrite=True, progress=False)).run()
    assert replaced.images == 11 and not os.path.exists(dst / ".fastdata-staging")


def test_the_worker_pool_is_whatever_the_executor_factory_makes(tmp_path):
    """``executor_factory`` (WriteSession, run_shards) makes the pool: it is called with the process
    pool's keywords, and an executor that is not a process pool (threads here) writes the same store
    and is shut down at the end."""
    made: list[tuple[dict, cf.ThreadPoolExecutor]] = []

    def threads(**keywords) -> cf.ThreadPoolExecutor:
        pool = cf.ThreadPoolExecutor(keywords["max_workers"])
        made.append((keywords, pool))
        return pool

    ref = WriteSession(NumbersInput(35), tmp_path / "ref.lmdb", WriteOptions(workers=0, progress=False)).run()
    report = WriteSession(NumbersInput(35), tmp_path / "threads.lmdb", WriteOptions(workers=2, progress=False),
                          executor_factory=threads).run()
    assert len(made) == 1
    keywords, pool = made[0]
    assert keywords["max_workers"] == 2 and {"mp_context", "initializer", "initargs"} <= set(keywords)
    with pytest.raises(RuntimeError, match="after shutdown"):  # shut down by the pipeline
        pool.submit(int)
    assert (report.images, report.rejected, report.shards) == (ref.images, ref.rejected, ref.shards) == (30, 5, 4)
    xxh = [[s["xxh"] for s in read_manifest(str(r.dst))["shards"]] for r in (ref, report)]
    assert xxh[0] == xxh[1]
