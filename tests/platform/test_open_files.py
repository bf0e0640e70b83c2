"""Overwrite and append while another process reads the store (issue 38, item 2), where an open file
cannot be deleted or replaced (the Windows proxy) and, as the control, on Linux.

On Windows the old version's shards that a reader holds open cannot be deleted: the overwrite
leaves them in place, numbers the new shards past them and says so; the next write (here an
append, once the reader has closed them) deletes them. On Linux the overwrite deletes them at
once (the reader keeps its unlinked files) and numbers the new shards from 0, as it always has.
On both, the reader's next read says the store was rewritten (StoreChangedError: open it again),
as a reader of a store overwritten under it always has been told.
"""

from __future__ import annotations

import pytest
from helpers.proxies import collect, start

pytestmark = pytest.mark.timeout(240)


#: system -> the backends its run covers: the proxy both; the Linux control one (Linux's deletes are
#: what every other test of the writer runs)
RUNS = {"windows": ("lmdb", "hdf5"), "linux": ("lmdb",)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Each run's report, both runs at the same time."""
    return collect({system: start("open_files_steps.py", None if system == "linux" else system,
                                  str(tmp_path_factory.mktemp(system)), *backends)
                    for system, backends in RUNS.items()})


@pytest.mark.parametrize(("system", "backend"), [(s, b) for s, backends in RUNS.items() for b in backends])
def test_overwrite_and_append_while_a_reader_holds_the_store(runs, system, backend):
    got = runs[system][backend]
    old, new = got["a_shards"], got["b_listed"]
    assert len(old) >= 2 and old[0].startswith("shard-00000")
    # the reader read the old version whole; after the overwrite it is told to open the store again
    assert got["reader_first"] == got["a"] and got["reader_again"] == "StoreChangedError"
    # the new version is tree B, and then B + C
    assert got["b"] != got["a"] and len(got["b"]) == 4
    assert got["bc"] == got["b"] + got["c_alone"]
    if system == "windows":
        # the old shards stayed (open in the reader), the new ones are numbered past them
        assert set(old) <= set(got["b_on_disk"]) and not set(old) & set(new)
        first_new = int(new[0].split("-")[1].split(".")[0])
        assert first_new == len(old)
        assert any("open in another process" in w and old[0] in w for w in got["overwrite_warnings"])
    else:
        # control: Linux deletes them at once and numbers from 0, as before
        assert new[0].startswith("shard-00000") and got["b_on_disk"] == sorted(new)
        assert not any("open in another process" in w for w in got["overwrite_warnings"])
    # once the reader is gone, the next write deleted what was left
    assert got["c_on_disk"] == sorted(got["c_listed"])  # every shard file on disk is the store's
    assert not any("open in another process" in w for w in got["append_warnings"])
