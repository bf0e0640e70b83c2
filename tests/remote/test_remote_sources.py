"""Remote sources: an image folder or a path,label list on a real S3-compatible server (SeaweedFS,
tests/helpers/s3server.py) converts to the store its local copy converts to; the listing's ETags
and sizes hold while reading (a changed or deleted object stops the run, nothing published); a
SIGKILLed conversion resumes to the same store; missing buckets, prefixes and credentials are one
clear line; the objects fetched but not yet written stay within the pipeline's window."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.counting_proxy import CountingProxy
from helpers.images import make_jpeg, make_small_tree
from helpers.procs import cli_in_process, sigkill_once_a_shard_is_staged

import fastdata
from fastdata.errors import RemotePathError, RemoteStoreError, SourceError
from fastdata.format.manifest import read_manifest
from fastdata.format.names import STAGING_DIR
from fastdata.remote.direct import CURL_USER_AGENT
from fastdata.remote.location import RemoteLocation, SourceChangedError
from fastdata.writer.options import WriteOptions
from fastdata.writer.session import WriteSession
from fastdata.writer.sources.remote import RemoteFolderInput

LIST_ROWS = ["path,label", "../imgs/bee/img_0.jpg,bee", "../imgs/ant/img_1.jpg,ant", "../imgs/ant/missing.jpg,ant",
             "../imgs/wasp/sub/deeper/img_7.jpg,wasp", "../imgs/bee/broken.jpg,bee"]


def upload_tree(local: str | Path, url: str, storage_options: dict | None = None) -> None:
    """Every file under ``local`` to ``url``/<its relative path>, as `aws s3 sync` would (all at once)."""
    loc = RemoteLocation(url, storage_options or {})
    paths = [os.path.join(root, name) for root, _, files in os.walk(local) for name in files]
    targets = [loc.child(os.path.relpath(p, local).replace(os.sep, "/")).split("://", 1)[1] for p in paths]
    loc.filesystem().put(paths, targets)


def same_store(a: str, b: str) -> None:
    """``a`` and ``b`` hold the same shards (names, counts, checksums of the files), classes and
    rejected inputs; each verifies."""
    ma, mb = read_manifest(a), read_manifest(b)
    assert [(s["name"], s["count"], s["xxh"]) for s in ma["shards"]] == \
        [(s["name"], s["count"], s["xxh"]) for s in mb["shards"]]
    assert ma["classes"] == mb["classes"] and ma["num_samples"] == mb["num_samples"]
    assert Path(a, "rejected.tsv").read_text() == Path(b, "rejected.tsv").read_text()
    assert fastdata.verify(a).ok and fastdata.verify(b).ok


@pytest.fixture(scope="module")
def remote_tree(s3_server, tmp_path_factory):
    """The small tree (nested folders, an upper-case .JPG, plus a corrupt JPEG, a text file and a
    name with a space, a plus sign and a non-ASCII letter)
    beside a path,label list under ``lists/``, locally and in a bucket of its own; with the
    local conversions of both. Yields a namespace of the URLs and paths."""
    mp = pytest.MonkeyPatch()
    for key, value in s3_server.env().items():
        mp.setenv(key, value)
    mp.setenv("FASTDATA_REMOTE_RETRIES", "2")
    root = tmp_path_factory.mktemp("remote-sources")
    tree = make_small_tree(root / "data" / "imgs")
    Path(tree, "bee", "broken.jpg").write_bytes(b"\xff\xd8not a jpeg")
    Path(tree, "ant", "notes.txt").write_text("not an image")
    make_jpeg(Path(tree, "ant", "odd name+1 ü~.jpg"), size=(24, 20), seed=99)  # quoted in a URL path
    Path(root, "data", "lists").mkdir()
    Path(root, "data", "lists", "train.csv").write_text("\n".join(LIST_ROWS) + "\n")
    rows = [{"path": path, "label": label, "score": k / 4} for k, (path, label) in
            enumerate(row.split(",") for row in LIST_ROWS[1:])]
    Path(root, "data", "lists", "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bucket = f"s3://{s3_server.take_bucket(f'rsrc{os.getpid()}')}"
    upload_tree(root / "data", bucket)
    local = str(root / "local.lmdb")
    fastdata.convert(tree, local, shard_size="20kB", progress=False, workers=0)
    local_list = str(root / "local-list.lmdb")
    fastdata.convert(str(root / "data" / "lists" / "train.csv"), local_list, progress=False, workers=0)
    local_table = str(root / "local-table.lmdb")
    fastdata.convert(str(root / "data" / "lists" / "rows.jsonl"), local_table, progress=False, workers=0)

    class Tree:
        pass
    t = Tree()
    t.server, t.bucket, t.tree, t.local, t.local_list, t.root = s3_server, bucket, tree, local, local_list, root
    t.local_table = local_table
    yield t
    mp.undo()


def test_remote_folder_converts_to_the_local_store(remote_tree, tmp_path):
    dst = str(tmp_path / "remote.lmdb")
    report = fastdata.convert(f"{remote_tree.bucket}/imgs/", dst, shard_size="20kB", progress=False, workers=0)
    assert report.images == 25 and len(read_manifest(dst)["shards"]) > 1
    assert [r[0] for r in report.rejected_items] == ["bee/broken.jpg"]  # reported like a corrupt local file
    same_store(dst, remote_tree.local)
    assert read_manifest(dst)["options"]["source"] == f"{remote_tree.bucket}/imgs"
    # the same listing and options: a resume of the published store is complete, nothing rewritten
    again = fastdata.convert(f"{remote_tree.bucket}/imgs", dst, shard_size="20kB", progress=False, resume=True)
    assert again.already_complete


def test_remote_list_converts_to_the_local_store(remote_tree, tmp_path):
    dst = str(tmp_path / "list.lmdb")
    report = fastdata.convert(fastdata.sources.ImageFolder(f"{remote_tree.bucket}/lists/train.csv"), dst,
                              progress=False, workers=0)
    assert report.images == 3
    assert sorted(r[0] for r in report.rejected_items) == ["../imgs/ant/missing.jpg", "../imgs/bee/broken.jpg"]
    same_store(dst, remote_tree.local_list)
    # the same list over plain HTTP (the test server answers anonymous GETs): read-only http(s) sources
    http_list = f"{remote_tree.server.endpoint}/{remote_tree.bucket.split('://')[1]}/lists/train.csv"
    dst = str(tmp_path / "http-list.lmdb")
    fastdata.convert(http_list, dst, progress=False, workers=0)
    same_store(dst, remote_tree.local_list)


def test_remote_jsonl_list_converts_to_the_local_store(remote_tree, tmp_path):
    dst = str(tmp_path / "table.lmdb")
    report = fastdata.convert(f"{remote_tree.bucket}/lists/rows.jsonl", dst, progress=False, workers=0)
    assert report.images == 3 and len(report.rejected_items) == 2
    same_store(dst, remote_tree.local_table)
    assert fastdata.open_dataset(dst)[0]["score"] == 0.0


def _url_lists(remote_tree, folder: Path) -> tuple[str, str, list[str]]:
    """The list rows of ``LIST_ROWS`` as URLs, written locally into ``folder`` and uploaded beside
    them (``lists/urls.csv``, ``lists/urls.jsonl``, each row with a score). Returns the local CSV,
    the local JSONL and the URLs."""
    urls = [f"{remote_tree.bucket}/{row.split(',')[0].replace('../', '')}" for row in LIST_ROWS[1:]]
    labels = [row.split(",")[1] for row in LIST_ROWS[1:]]
    folder.mkdir(exist_ok=True)
    csv_file, jsonl_file = folder / "urls.csv", folder / "urls.jsonl"
    csv_file.write_text("path,label\n" + "".join(f"{u},{label}\n" for u, label in zip(urls, labels, strict=True)))
    jsonl_file.write_text("".join(json.dumps({"path": u, "label": label, "score": k / 4}) + "\n"
                                  for k, (u, label) in enumerate(zip(urls, labels, strict=True))))
    loc = RemoteLocation(f"{remote_tree.bucket}/lists")
    loc.write_bytes("urls.csv", csv_file.read_bytes())
    loc.write_bytes("urls.jsonl", jsonl_file.read_bytes())
    return str(csv_file), str(jsonl_file), urls


def same_samples(a: str, b: str) -> None:
    """``a`` and ``b`` hold the same samples (every field, images as their stored bytes), classes
    and rejected inputs (by file name): the stores of one list naming local files and one naming URLs."""
    ma, mb = read_manifest(a), read_manifest(b)
    assert ma["classes"] == mb["classes"] and ma["num_samples"] == mb["num_samples"]
    da, db = fastdata.open_dataset(a, output="bytes"), fastdata.open_dataset(b, output="bytes")
    for i in range(len(da)):
        assert repr(da[i]) == repr(db[i]), i

    def rejected(store: str) -> list[str]:
        lines = Path(store, "rejected.tsv").read_text().splitlines()[1:]
        return sorted(line.split("\t", 1)[0].rsplit("/", 1)[-1] for line in lines)
    assert rejected(a) == rejected(b)


def test_a_local_list_naming_urls_converts_to_the_store_of_the_list_at_a_url(remote_tree, tmp_path, capsys):
    """A local path,label list whose rows are URLs: read from the server (storage options apply to
    the rows' URLs), the store the same list at a URL gives and the samples of the local files;
    missing and corrupt objects rejected as local files are; an object rewritten at the same size
    makes a resume refused."""
    from fastdata.errors import RejectedInputError, ResumeMismatchError
    from fastdata.writer.sources.folder import FolderInput

    local_csv, _, urls = _url_lists(remote_tree, tmp_path / "lists")
    assert isinstance(fastdata.sources.ImageFolder(local_csv).write_source(), RemoteFolderInput)
    dst, at_url = str(tmp_path / "local-urls.lmdb"), str(tmp_path / "url-urls.lmdb")
    report = fastdata.convert(local_csv, dst, progress=False, workers=0)
    assert report.images == 3
    assert sorted(r[0] for r in report.rejected_items) == sorted([urls[2], urls[4]])  # missing, corrupt
    fastdata.convert(f"{remote_tree.bucket}/lists/urls.csv", at_url, progress=False, workers=0)
    same_store(dst, at_url)  # (shards, classes, rejected rows)
    ds = fastdata.open_dataset(dst)
    assert [ds.relpath(i) for i in range(len(ds))] == [urls[0], urls[1], urls[3]]  # the URLs as written
    same_samples(dst, remote_tree.local_list)
    assert read_manifest(dst)["options"]["source"] == local_csv
    with pytest.raises(RejectedInputError, match="missing.jpg"):
        fastdata.convert(local_csv, str(tmp_path / "strict.lmdb"), progress=False, workers=0, strict=True)
    # control: read as a list of local files (how it was read before), every row is a missing file
    control = WriteSession(FolderInput(local_csv), str(tmp_path / "control.lmdb"),
                           WriteOptions(progress=False, workers=0)).run()
    assert control.images == 0 and len(control.rejected_items) == 5
    assert all("not found" in why for _, why in control.rejected_items)
    # storage options (the API's and the command's) apply to the rows' URLs
    bad = str(tmp_path / "bad.lmdb")
    with pytest.raises(SourceError, match="credentials were refused or are missing"):
        fastdata.convert(local_csv, bad, progress=False, storage_options={"profile": "nope-fd"})
    cli = cli_in_process(capsys, "convert", local_csv, bad, "--storage-option", "profile=nope-fd")
    assert cli.returncode != 0 and "credentials" in cli.stderr and "Traceback" not in cli.stderr
    # an object rewritten at the same size (another ETag) is another input: a resume is refused
    loc = RemoteLocation(f"{remote_tree.bucket}/imgs")
    original = loc.read_bytes("bee/img_0.jpg")
    loc.write_bytes("bee/img_0.jpg", original[:-2] + bytes([original[-2] ^ 0xFF, original[-1]]))
    try:
        with pytest.raises(ResumeMismatchError, match="different inputs"):
            fastdata.convert(local_csv, dst, progress=False, workers=0, resume=True)
    finally:
        loc.write_bytes("bee/img_0.jpg", original)
    assert fastdata.convert(local_csv, dst, progress=False, workers=0, resume=True).already_complete  # control


def test_a_local_jsonl_list_naming_urls_converts_to_the_store_of_the_list_at_a_url(remote_tree, tmp_path):
    _, local_jsonl, urls = _url_lists(remote_tree, tmp_path / "lists")
    dst, at_url = str(tmp_path / "local-urls.lmdb"), str(tmp_path / "url-urls.lmdb")
    report = fastdata.convert(local_jsonl, dst, progress=False, workers=2)
    assert report.images == 3 and sorted(r[0] for r in report.rejected_items) == sorted([urls[2], urls[4]])
    fastdata.convert(f"{remote_tree.bucket}/lists/urls.jsonl", at_url, progress=False, workers=0)
    same_store(dst, at_url)
    same_samples(dst, remote_tree.local_table)
    ds = fastdata.open_dataset(dst)
    assert [ds.relpath(i) for i in range(len(ds))] == [urls[0], urls[1], urls[3]]
    assert [ds[i]["score"] for i in range(len(ds))] == [0.0, 0.25, 0.75]


@pytest.mark.parametrize("name", ["list.csv", "list.jsonl"])
@pytest.mark.parametrize("first", ["url", "local"])
def test_a_local_list_naming_urls_and_local_files_is_one_line_naming_the_first_mixed_row(remote_tree, tmp_path,
                                                                                        name, first):
    url = f"{remote_tree.bucket}/imgs/bee/img_0.jpg"
    local = str(Path(remote_tree.tree, "ant", "img_1.jpg"))
    paths = [url, url, local] if first == "url" else [local, local, url]
    listed = tmp_path / name
    if name.endswith(".csv"):
        listed.write_text("path,label\n" + "".join(f"{p},x\n" for p in paths))
    else:
        listed.write_text("".join(json.dumps({"path": p, "label": "x", "score": 1.0}) + "\n" for p in paths))
    line = 4 if name.endswith(".csv") else 3
    with pytest.raises(SourceError, match=f"{listed}:{line}: the row names a .* not both") as caught:
        fastdata.convert(str(listed), str(tmp_path / "mixed.lmdb"), progress=False, workers=0)
    assert "\n" not in str(caught.value) and paths[2] in str(caught.value)
    assert not (tmp_path / "mixed.lmdb" / "manifest.json").exists()


def _source_changing_after_listing(url: str, change):
    """A remote folder input that calls ``change()`` once its listing is taken (the plan made):
    the object store changes between the listing and the reads, as it may in any long run."""
    class Changing(RemoteFolderInput):
        def plan(self, run, dst):
            plans = super().plan(run, dst)
            change()
            return plans
    return Changing(url)


@pytest.mark.parametrize("how", ["rewritten-same-size", "grown", "deleted"])
def test_an_object_changed_after_listing_stops_the_run_naming_it(remote_tree, tmp_path, how):
    url = f"{remote_tree.bucket}/changing-{how}"
    upload_tree(Path(remote_tree.tree) / "ant", f"{url}/ant")
    loc = RemoteLocation(url)
    victim = "ant/img_2.jpg"
    data = loc.read_bytes(victim)

    def change() -> None:
        if how == "deleted":
            loc.remove([victim])
        else:
            loc.write_bytes(victim, data[:-2] + bytes([data[-2] ^ 0xFF, data[-1]]) if how == "rewritten-same-size"
                            else data + b"\0")
    dst = tmp_path / "changed.lmdb"
    with pytest.raises(SourceChangedError, match=f"{url}/{victim}: the object (changed|was deleted)") as caught:
        WriteSession(_source_changing_after_listing(url, change), str(dst),
                     WriteOptions(workers=0, progress=False)).run()
    assert "\n" not in str(caught.value)
    assert not (dst / "manifest.json").exists()  # nothing published
    # control: the same run with nothing changed after the listing converts
    fastdata.convert(url, str(tmp_path / "control.lmdb"), progress=False, workers=0)


def test_missing_bucket_prefix_and_failing_credentials_are_one_line_errors(remote_tree, tmp_path, capsys):
    dst = str(tmp_path / "x.lmdb")
    with pytest.raises(SourceError, match="bucket 'no-such-bucket-fd' does not exist"):
        fastdata.convert("s3://no-such-bucket-fd/imgs", dst, progress=False)
    with pytest.raises(SourceError, match="no objects under this prefix"):
        fastdata.convert(f"{remote_tree.bucket}/nothing-here", dst, progress=False)
    # credentials that cannot be used: a profile that does not exist (SeaweedFS here accepts any key)
    with pytest.raises(SourceError, match="credentials were refused or are missing.*ProfileNotFound"):
        fastdata.convert(f"{remote_tree.bucket}/imgs", dst, progress=False, storage_options={"profile": "nope-fd"})
    with pytest.raises(SourceError, match="cannot be listed"):
        fastdata.convert("https://example.invalid/imgs/", dst, progress=False)
    with pytest.raises(RemotePathError, match="read from a local or mounted filesystem"):
        fastdata.convert(f"{remote_tree.bucket}/vols/a.nii.gz", dst, progress=False)
    assert not os.path.exists(os.path.join(dst, "manifest.json"))
    cli = cli_in_process(capsys, "convert", "s3://no-such-bucket-fd/imgs", dst)
    assert cli.returncode != 0 and "no-such-bucket-fd" in cli.stderr and "Traceback" not in cli.stderr
    assert len(cli.stderr.strip().splitlines()) == 1, cli.stderr
    cli = cli_in_process(capsys, "convert", f"{remote_tree.bucket}/imgs", dst, "--storage-option", "profile=nope-fd")
    assert cli.returncode != 0 and "credentials" in cli.stderr and "Traceback" not in cli.stderr


def _convert_until_killed(url: str, dst: str) -> None:
    """In a forked child: convert ``url`` into ``dst`` and, once a shard's sidecar is staged, block at
    the next file opened, to be SIGKILLed there (an audit hook: no race with a fast conversion)."""
    staged = []

    def hook(event: str, args: tuple) -> None:
        if event == "os.rename" and len(args) > 1 and isinstance(args[1], str | bytes | os.PathLike):
            base = os.path.basename(os.fsdecode(args[1]))
            if base.startswith("shard-") and base.endswith(".json"):
                staged.append(base)
        elif event == "open" and staged:
            time.sleep(120)
    try:
        sys.addaudithook(hook)
        fastdata.convert(url, dst, shard_size="20kB", progress=False, workers=0)
    finally:
        os._exit(1)


def test_killed_remote_conversion_resumes_to_the_local_store(remote_tree, tmp_path):
    """SIGKILLed once a shard is finished (a forked converter), then ``resume=True``: the store of the
    uninterrupted local conversion. (The CLI in a subprocess: the slow variant below.)"""
    import multiprocessing

    dst = tmp_path / "killed.lmdb"
    child = multiprocessing.get_context("fork").Process(target=_convert_until_killed,
                                                        args=(f"{remote_tree.bucket}/imgs", str(dst)))
    child.start()
    try:
        deadline = time.monotonic() + 60
        staging = dst / STAGING_DIR
        while not (staging.exists() and any(staging.glob("shard-*.json"))):
            assert child.is_alive() and time.monotonic() < deadline, "no shard finished"
            time.sleep(0.005)
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
    finally:
        if child.is_alive():
            child.kill()
            child.join(10)
    assert not (dst / "manifest.json").exists()
    report = fastdata.convert(f"{remote_tree.bucket}/imgs", str(dst), shard_size="20kB", progress=False, workers=0,
                              resume=True)
    assert report.resumed_shards >= 1
    same_store(str(dst), remote_tree.local)


@pytest.mark.slow
def test_killed_remote_cli_conversion_resumes_to_the_local_store(remote_tree, tmp_path):
    dst = tmp_path / "killed.lmdb"
    command = [sys.executable, "-m", "fastdata", "convert", f"{remote_tree.bucket}/imgs", str(dst),
               "--shard-size", "20kB", "--workers", "1", "--quiet"]
    env = dict(os.environ, FASTDATA_MIN_SHARD_SIZE="1")
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sigkill_once_a_shard_is_staged(proc, dst, "convert")
    assert not (dst / "manifest.json").exists()
    report = fastdata.convert(f"{remote_tree.bucket}/imgs", str(dst), shard_size="20kB", progress=False, workers=0,
                              resume=True)
    assert report.resumed_shards >= 1
    same_store(str(dst), remote_tree.local)


def _convert_through(endpoint: str, url: str, dst: str) -> None:
    """In a forked child: convert ``url`` with one worker and tasks of 2 inputs, through ``endpoint``."""
    try:
        from multiprocessing import forkserver

        # this child inherited the test process's forkserver handle, but that server is not its child
        # (multiprocessing would waitpid it and fail with ECHILD): let the pool start one of its own
        server = forkserver._forkserver  # type: ignore[attr-defined]
        server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        fastdata.convert(url, dst, workers=1, task_size=2, progress=False)
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def test_objects_fetched_but_not_written_stay_within_the_pipeline_window(remote_tree, tmp_path):
    """The converter is stopped (SIGSTOP) as soon as its first input is fetched: its worker can go on
    only through the tasks already handed to it, so the GETs then stop at the window (4 tasks of 2
    inputs for one worker, and the task it runs) instead of fetching the whole prefix ahead."""
    n = 48
    url = f"{remote_tree.bucket}/many"
    src = tmp_path / "many"
    for i in range(n):
        make_jpeg(src / "c" / f"{i:03d}.jpg", size=(8, 8), seed=i)
    upload_tree(src, url)
    proxy = CountingProxy(remote_tree.server.endpoint).start()
    prefix = f"/{url.split('://')[1]}/c/"
    import multiprocessing

    try:
        # forked (the imports are done here), and single-threaded there: its pool forks its worker
        child = multiprocessing.get_context("fork").Process(
            target=_convert_through, args=(proxy.endpoint, url, str(tmp_path / "many.lmdb")))
        child.start()
        try:
            deadline = time.monotonic() + 60
            while not [r for r in proxy.gets() if r.path.startswith(prefix)]:
                assert child.is_alive() and time.monotonic() < deadline, "no input fetched"
                time.sleep(0.001)
            os.kill(child.pid, signal.SIGSTOP)  # the converter only: its worker runs on
            try:
                counts = []
                for _ in range(3):
                    time.sleep(0.4)
                    counts.append(len([r for r in proxy.gets() if r.path.startswith(prefix)]))
            finally:
                os.kill(child.pid, signal.SIGCONT)
            child.join(120)
            assert child.exitcode == 0
        finally:
            if child.is_alive():
                child.kill()
                child.join(10)
        fetched = [r.path for r in proxy.gets() if r.path.startswith(prefix)]
        agents = {r.agent for r in proxy.gets() if r.path.startswith(prefix)}
        # the control: a read through s3fs (botocore) names botocore in its User-Agent
        proxy.clear()
        RemoteLocation(f"{url}/c", {"endpoint_url": proxy.endpoint}).read_object(
            "000.jpg", (src / "c" / "000.jpg").stat().st_size)
        control_agents = {r.agent for r in proxy.gets()}
    finally:
        proxy.stop()
    window_inputs = (4 + 1) * 2 + 2  # the window's tasks, the one running, and one queued by the pool
    assert counts[-1] == counts[-2], counts  # settled: nothing more is fetched while nothing is written
    assert counts[-1] <= window_inputs < n, counts
    assert sorted(fetched) == sorted(set(fetched)) and len(fetched) == n  # each object read once
    # by libcurl's signed GETs of fastdata.remote.direct (botocore's requests name it in User-Agent)
    assert agents == {CURL_USER_AGENT}, agents
    assert control_agents and all("botocore" in agent.lower() for agent in control_agents), control_agents
    assert json.loads(Path(tmp_path / "many.lmdb" / "manifest.json").read_text())["num_samples"] == n


def test_the_signed_listing_pages_equal_s3fs_listing(remote_tree, monkeypatch):
    """A prefix listed through the signed ListObjectsV2 pages (two keys a page here, so continuation
    tokens are followed; keys with a space, a plus sign and a non-ASCII letter) gives what the
    listing through s3fs gives. Control: the pages were read by that path (it is counted), and with
    it refused the s3fs listing alone gives the same."""
    from fastdata.remote import direct
    from fastdata.remote.sources import list_objects

    url = f"{remote_tree.bucket}/imgs"
    pages = []
    real = direct.DirectS3.list_objects

    def counted(self, bucket, prefix):
        for entry in real(self, bucket, prefix):
            pages.append(entry)
            yield entry

    monkeypatch.setattr(direct, "LISTING_PAGE_KEYS", 2)
    monkeypatch.setattr(direct.DirectS3, "list_objects", counted)
    signed = list_objects(RemoteLocation(url))
    assert len(pages) == len(signed) > 4 and None not in pages
    monkeypatch.setattr(direct.DirectS3, "list_objects", lambda self, bucket, prefix: iter([None]))
    through_s3fs = list_objects(RemoteLocation(url))
    assert signed.names == through_s3fs.names
    assert "odd name+1 ü~.jpg".encode() in [n.split(b"/")[-1] for n in signed.names]
    assert signed.sizes.tolist() == through_s3fs.sizes.tolist()
    assert signed.etags.tolist() == through_s3fs.etags.tolist()


def test_a_batch_is_fetched_by_libcurl_with_signed_gets_and_checked_against_its_listing(remote_tree):
    """A batch of objects (names with a space, a plus sign and a non-ASCII letter among them) is
    fetched by libcurl, signed by its SigV4, with no request falling back to s3fs: every GET names
    libcurl, and the bytes are the files'. An object listed at another size, or with another ETag,
    is a SourceChangedError naming it; a batch left early leaves the thread's next batch working.
    (That the signatures are right is the next test's: this server checks none.)"""
    from fastdata.remote.sources import list_objects

    url = f"{remote_tree.bucket}/imgs"
    listing = list_objects(RemoteLocation(url))
    names = [n.decode() for n in listing.names]
    assert "ant/odd name+1 ü~.jpg" in names
    proxy = CountingProxy(remote_tree.server.endpoint).start()
    try:
        loc = RemoteLocation(url, {"endpoint_url": proxy.endpoint})
        read = loc.batch_reader()
        assert read is not None
        got = list(read(names, listing.sizes.tolist(), listing.etags.tolist()))
        assert got == [Path(remote_tree.tree, n).read_bytes() for n in names]
        seen = [r for r in proxy.gets() if "/imgs/" in r.path]
        assert len(seen) == len(names) and {r.agent for r in seen} == {CURL_USER_AGENT}
        assert all(r.status == 200 for r in seen)
        # left after one object: the rest is dropped; the next batch on this thread still works
        partial = read(names, listing.sizes.tolist(), listing.etags.tolist())
        assert next(partial) == got[0]
        partial.close()
        assert list(read(names[:3], listing.sizes[:3].tolist(), listing.etags[:3].tolist())) == got[:3]
        # listed at another size; listed with another ETag
        sizes = listing.sizes.tolist()
        sizes[1] += 1
        with pytest.raises(SourceChangedError, match=f"{url}/{names[1]}: the object changed .*listed as"):
            list(read(names, sizes, listing.etags.tolist()))
        sizes = listing.sizes.tolist()
        sizes[3] -= 1  # (listed shorter: libcurl stops the longer body)
        with pytest.raises(SourceChangedError, match=f"{url}/{names[3]}: the object changed .*listed as"):
            list(read(names, sizes, listing.etags.tolist()))
        etags = listing.etags.tolist()
        etags[2] ^= 1
        with pytest.raises(SourceChangedError, match=f"{url}/{names[2]}: the object changed .*ETag differs"):
            list(read(names, listing.sizes.tolist(), etags))
    finally:
        proxy.stop()


def test_libcurl_signatures_are_accepted_by_a_server_that_checks_them(tmp_path, monkeypatch):
    """Against a SeaweedFS server with an identity, which checks every SigV4 signature, libcurl's
    signed GETs of keys with a space, a plus sign, a tilde and a non-ASCII letter are all answered
    200 (none falls back to s3fs). Control: with a wrong secret the same GETs are refused (403),
    so the server does check them."""
    from helpers.s3server import S3Server

    from fastdata.remote.sources import list_objects

    server = S3Server(str(tmp_path / "signed"), check_signatures=True).start()
    proxy = CountingProxy(server.endpoint).start()
    try:
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        server.make_bucket("signed")
        names = ["a/plain.jpg", "a/odd name+1 ü~.jpg", "b/x=y&z(1).jpg"]
        for k, name in enumerate(names):
            make_jpeg(tmp_path / "src" / name, size=(8, 8), seed=k)
        upload_tree(tmp_path / "src", "s3://signed/imgs")
        listing = list_objects(RemoteLocation("s3://signed/imgs"))
        listed = [n.decode() for n in listing.names]
        assert sorted(listed) == sorted(names)
        read = RemoteLocation("s3://signed/imgs", {"endpoint_url": proxy.endpoint}).batch_reader()
        assert read is not None
        got = list(read(listed, listing.sizes.tolist(), listing.etags.tolist()))
        assert got == [(tmp_path / "src" / n).read_bytes() for n in listed]
        seen = proxy.gets("/imgs/")
        assert [(r.status, r.agent) for r in seen] == [(200, CURL_USER_AGENT)] * len(names)
        # control: signed with a wrong secret, libcurl's GETs are refused by this server
        proxy.clear()
        wrong = RemoteLocation("s3://signed/imgs", {"endpoint_url": proxy.endpoint, "key": "fastdata-test",
                                                    "secret": "not-the-secret"}).batch_reader()
        assert wrong is not None
        with pytest.raises(RemoteStoreError, match="signature we calculated does not match"):  # (s3fs's too)
            list(wrong(listed[:1], listing.sizes[:1].tolist(), listing.etags[:1].tolist()))
        assert (403, CURL_USER_AGENT) in [(r.status, r.agent) for r in proxy.gets("/imgs/")]
    finally:
        proxy.stop()
        server.kill()

