"""Distributed conversion: 2 ranks on one machine through torchrun (gloo, CPU)."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest
from helpers.images import make_tree
from helpers.procs import torchrun
from helpers.stores import store_records

from fastdata.common.units import parse_size
from fastdata.format.backends.base import StorageSpec
from fastdata.writer.plan import estimated_sizes, plan_shards
from fastdata.writer.sources.folder import scan

pytestmark = pytest.mark.timeout(180)


def single(src, dst, *args):
    """The single-process reference conversion, through the CLI in this process (the subprocess is
    not what these tests compare: a fresh interpreter only added its start-up, seconds of it)."""
    from fastdata.cli.main import main

    assert main(["convert", str(src), str(dst), "--quiet", *args]) == 0


def shard_digests(dst) -> list[tuple[str, int, str]]:
    with open(os.path.join(dst, "manifest.json")) as fh:
        m = json.load(fh)
    return [(s["name"], s["count"], s["xxh"]) for s in m["shards"]]


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist") / "src"
    make_tree(root, {"a": 14, "b": 12, "c": 10}, size=(96, 72))
    return root


# The distributed driver is backend-agnostic (ranks only choose which shards to write): nightly
# over both backends; in CI test_resume_across_ranks_after_kill below checks that the ranks' shards
# are byte-identical to a single-process conversion's (every shard's name, count and checksum).
@pytest.mark.slow
@pytest.mark.parametrize("suffix", [".lmdb", ".h5"])
def test_two_ranks_equal_single_process(tree, tmp_path, suffix):
    single(tree, tmp_path / f"one{suffix}", "--shard-size", "40KB")
    torchrun("convert", str(tree), str(tmp_path / f"two{suffix}"), "--shard-size", "40KB", "--workers", "1",
             "--quiet")
    one, two = shard_digests(tmp_path / f"one{suffix}"), shard_digests(tmp_path / f"two{suffix}")
    assert len(one) >= 4, "the test needs several shards so both ranks write some"
    # byte-identical shard files, not merely equal records
    assert one == two
    rec_one = [(r["relpath"], r["label"], r["image"]) for r in store_records(tmp_path / f"one{suffix}")[1]]
    rec_two = [(r["relpath"], r["label"], r["image"]) for r in store_records(tmp_path / f"two{suffix}")[1]]
    assert rec_one == rec_two


def test_failing_rank_fails_the_job_and_is_named(tree, tmp_path):
    src = tmp_path / "src"
    make_tree(src, {"a": 10, "b": 10}, size=(96, 72))
    bad = src / "b" / "zz_bad.jpg"
    bad.write_bytes(b"not an image at all")
    # choose a shard size so the bad file lands in a shard owned by rank 1 (odd shard id)
    s = scan(str(src))
    bad_pos = [os.fsdecode(p) for p in s.relpaths].index(os.path.join("b", "zz_bad.jpg"))
    for size in ("20KB", "25KB", "30KB", "35KB", "40KB", "50KB", "60KB"):
        plans = plan_shards(estimated_sizes(s, StorageSpec()), parse_size(size))
        owner = next(p.shard_id for p in plans if p.start <= bad_pos < p.stop)
        if owner % 2 == 1:
            break
    else:
        pytest.fail("no shard size puts the bad file on rank 1")
    proc = torchrun("convert", str(src), str(tmp_path / "out.lmdb"), "--shard-size", size, "--workers", "1",
                    "--strict", "--quiet", check=False)
    assert proc.returncode != 0
    assert "rank 1 failed" in proc.stderr
    assert "zz_bad.jpg" in proc.stderr
    assert not os.path.exists(tmp_path / "out.lmdb" / "manifest.json")


# nightly (30 s: torchrun conversion, its failing rank and single-process kill-and-resume run in CI; this combines them)
@pytest.mark.slow
def test_resume_across_ranks_after_kill(tmp_path):
    src = tmp_path / "src"
    make_tree(src, {"a": 40, "b": 40}, size=(160, 120))
    dst = tmp_path / "out.lmdb"
    single(src, tmp_path / "ref.lmdb", "--shard-size", "30KB")
    proc = torchrun("convert", str(src), str(dst), "--shard-size", "30KB", "--workers", "1", "--quiet", wait=False)
    staging = dst / ".fastdata-staging"
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        if staging.is_dir() and len([n for n in os.listdir(staging) if n.endswith(".lmdb.json")]) >= 2:
            break
        time.sleep(0.02)
    killed = proc.poll() is None
    if killed:
        # torchrun starts its workers in their own sessions: kill the whole tree
        tree = psutil.Process(proc.pid)
        victims = [tree] + tree.children(recursive=True)
        for victim in victims:
            try:
                victim.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(victims, timeout=30)
    proc.wait(30)
    proc.stdout.close()
    proc.stderr.close()
    if killed:
        assert not (dst / "manifest.json").exists(), "nothing may be published by an interrupted run"
    done_before = {n for n in os.listdir(staging)} if staging.is_dir() else set()
    result = torchrun("convert", str(src), str(dst), "--shard-size", "30KB", "--workers", "1", "--resume")
    assert shard_digests(dst) == shard_digests(tmp_path / "ref.lmdb")
    if killed and any(n.endswith(".lmdb.json") for n in done_before):
        assert "kept from the interrupted run" in result.stdout


# Nightly: ranks run the same session as one process, so tests/writer/test_resume_options.py (the
# recorded options, one process) and test_resume_across_ranks_after_kill (ranks) cover it in CI.
@pytest.mark.slow
def test_resume_across_ranks_reuses_the_recorded_options(tmp_path, monkeypatch):
    """An interrupted 30 kB-shard conversion finished by torchrun with only --resume: the
    ranks take the recorded shard size; a different --shard-size is refused, naming it."""
    import importlib

    import fastdata

    session_module = importlib.import_module("fastdata.writer.session")
    src, dst = tmp_path / "src", tmp_path / "out.lmdb"
    make_tree(src, {"a": 20, "b": 20}, size=(96, 72))
    single(src, tmp_path / "ref.lmdb", "--shard-size", "30kB")
    real = session_module.run_shards

    def first_shard_then_ctrl_c(**kwargs):
        real(**dict(kwargs, plans=kwargs["plans"][:1]))
        raise KeyboardInterrupt

    monkeypatch.setattr(session_module, "run_shards", first_shard_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        fastdata.convert(str(src), str(dst), shard_size="30kB", workers=1, progress=False)
    monkeypatch.undo()

    refused = torchrun("convert", str(src), str(dst), "--shard-size", "40kB", "--workers", "1", "--resume",
                       check=False)
    assert refused.returncode != 0
    assert "shard size: was 30 kB (30,000 bytes), now 40 kB (40,000 bytes)" in refused.stderr, refused.stderr[-2000:]
    result = torchrun("convert", str(src), str(dst), "--workers", "1", "--resume")
    assert "1 kept from the interrupted run" in result.stdout
    assert shard_digests(dst) == shard_digests(tmp_path / "ref.lmdb")
